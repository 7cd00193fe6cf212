"""Key maps from the BFL (FLUX.1) and SAI (SD3/SD3.5) single-file layouts to diffusers' transformer keys.

A map is a list of (diffusers_key, source_key, op): op is None (take as is), ("chunk", i, sizes) (rows of
a fused tensor, e.g. q/k/v out of qkv), or "swap" (shift/scale halves exchanged: BFL/SAI put shift first,
diffusers scale first). The loader streams each source tensor once and applies the op as a view.
"""
from __future__ import annotations

import torch

Op = tuple | str | None


def _linear(m: list, dst: str, src: str, op: Op = None, bias: bool = True) -> None:
    m.append((f"{dst}.weight", f"{src}.weight", op))
    if bias:
        m.append((f"{dst}.bias", f"{src}.bias", op))


def _qkv(m: list, dsts: tuple[str, str, str], src: str, h: int) -> None:
    for i, dst in enumerate(dsts):
        _linear(m, dst, src, ("chunk", i, (h, h, h)))


def flux_bfl_map(config: dict) -> list[tuple[str, str, Op]]:
    h = config["num_attention_heads"] * config["attention_head_dim"]
    m: list = []
    _linear(m, "x_embedder", "img_in")
    _linear(m, "time_text_embed.timestep_embedder.linear_1", "time_in.in_layer")
    _linear(m, "time_text_embed.timestep_embedder.linear_2", "time_in.out_layer")
    _linear(m, "time_text_embed.text_embedder.linear_1", "vector_in.in_layer")
    _linear(m, "time_text_embed.text_embedder.linear_2", "vector_in.out_layer")
    if config["guidance_embeds"]:
        _linear(m, "time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer")
        _linear(m, "time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")
    _linear(m, "context_embedder", "txt_in")
    for i in range(config["num_layers"]):
        d, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        _linear(m, f"{d}.norm1.linear", f"{s}.img_mod.lin")
        _linear(m, f"{d}.norm1_context.linear", f"{s}.txt_mod.lin")
        _qkv(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{s}.img_attn.qkv", h)
        _qkv(m, (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), f"{s}.txt_attn.qkv", h)
        for dst, src in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            m.append((f"{d}.attn.{dst}.weight", f"{s}.{src}.scale", None))
        _linear(m, f"{d}.attn.to_out.0", f"{s}.img_attn.proj")
        _linear(m, f"{d}.attn.to_add_out", f"{s}.txt_attn.proj")
        _linear(m, f"{d}.ff.net.0.proj", f"{s}.img_mlp.0")
        _linear(m, f"{d}.ff.net.2", f"{s}.img_mlp.2")
        _linear(m, f"{d}.ff_context.net.0.proj", f"{s}.txt_mlp.0")
        _linear(m, f"{d}.ff_context.net.2", f"{s}.txt_mlp.2")
    mlp = int(h * 4.0)
    for i in range(config["num_single_layers"]):
        d, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        sizes = (h, h, h, mlp)
        for j, dst in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
            _linear(m, f"{d}.{dst}", f"{s}.linear1", ("chunk", j, sizes))
        m.append((f"{d}.attn.norm_q.weight", f"{s}.norm.query_norm.scale", None))
        m.append((f"{d}.attn.norm_k.weight", f"{s}.norm.key_norm.scale", None))
        _linear(m, f"{d}.norm.linear", f"{s}.modulation.lin")
        _linear(m, f"{d}.proj_out", f"{s}.linear2")
    _linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap")
    _linear(m, "proj_out", "final_layer.linear")
    return m


def sd3_sai_map(config: dict) -> list[tuple[str, str, Op]]:
    h = config["num_attention_heads"] * config["attention_head_dim"]
    depth = config["num_layers"]
    m: list = [("pos_embed.pos_embed", "pos_embed", None)]
    _linear(m, "pos_embed.proj", "x_embedder.proj")
    _linear(m, "time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0")
    _linear(m, "time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2")
    _linear(m, "time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0")
    _linear(m, "time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2")
    _linear(m, "context_embedder", "context_embedder")
    for i in range(depth):
        d, x, c = f"transformer_blocks.{i}", f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        last = i == depth - 1
        _qkv(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{x}.attn.qkv", h)
        _qkv(m, (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), f"{c}.attn.qkv", h)
        if config["qk_norm"]:
            for dst, src in (("norm_q", f"{x}.attn.ln_q"), ("norm_k", f"{x}.attn.ln_k"),
                             ("norm_added_q", f"{c}.attn.ln_q"), ("norm_added_k", f"{c}.attn.ln_k")):
                m.append((f"{d}.attn.{dst}.weight", f"{src}.weight", None))
        _linear(m, f"{d}.attn.to_out.0", f"{x}.attn.proj")
        if not last:
            _linear(m, f"{d}.attn.to_add_out", f"{c}.attn.proj")
        if i in config["dual_attention_layers"]:
            _qkv(m, (f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v"), f"{x}.attn2.qkv", h)
            if config["qk_norm"]:
                m.append((f"{d}.attn2.norm_q.weight", f"{x}.attn2.ln_q.weight", None))
                m.append((f"{d}.attn2.norm_k.weight", f"{x}.attn2.ln_k.weight", None))
            _linear(m, f"{d}.attn2.to_out.0", f"{x}.attn2.proj")
        _linear(m, f"{d}.norm1.linear", f"{x}.adaLN_modulation.1")
        # the last context block only modulates (shift, scale): diffusers wants (scale, shift)
        _linear(m, f"{d}.norm1_context.linear", f"{c}.adaLN_modulation.1", "swap" if last else None)
        _linear(m, f"{d}.ff.net.0.proj", f"{x}.mlp.fc1")
        _linear(m, f"{d}.ff.net.2", f"{x}.mlp.fc2")
        if not last:
            _linear(m, f"{d}.ff_context.net.0.proj", f"{c}.mlp.fc1")
            _linear(m, f"{d}.ff_context.net.2", f"{c}.mlp.fc2")
    _linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap")
    _linear(m, "proj_out", "final_layer.linear")
    return m


def apply_op(t: torch.Tensor, op: Op) -> torch.Tensor:
    if op is None:
        return t
    if op == "swap":
        first, second = t.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    _, index, sizes = op
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"cannot split {t.shape[0]} rows into {list(sizes)}")
    return torch.split(t, list(sizes), dim=0)[index]


def key_map(layout: str, family: str, config: dict) -> list[tuple[str, str, Op]] | None:
    """None for the diffusers layout: its keys are already diffusers keys."""
    if layout == "diffusers":
        return None
    return flux_bfl_map(config) if family == "flux" else sd3_sai_map(config)
