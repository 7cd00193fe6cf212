"""FLUX.2's checkpoints: the dimensions of each variant, the tensors of BFL's single-file layout (which tiny files and
full-size checks are made from), the diffusers config detected from a file's shapes, as ComfyUI's model_detection
reads them, and the key map into the diffusers Flux2Transformer2DModel. The family's behaviour is in flux2.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointError
from .base import count, fused, linear, linear_shapes, rope_axes

THETA = 2000
HEAD_DIM_AXES = {128: (32, 32, 32, 32)}

# ---- dimensions and the BFL single-file layout -----------------------------------------------------------------------
@dataclass(frozen=True)
class Flux2Dims:
    hidden: int = 6144
    heads: int = 48
    depth: int = 8             # double-stream blocks
    depth_single: int = 48     # single-stream blocks
    mlp_ratio: float = 3.0     # SwiGLU: the input projection is twice this wide
    in_channels: int = 128     # 32 VAE channels x 2x2, packed by the VAE
    context_in: int = 15360    # 3 hidden-state layers of the text encoder
    guidance_embed: bool = True
    axes_dim: tuple = (32, 32, 32, 32)

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_TINY = dict(hidden=128, heads=4, depth=4, depth_single=4, axes_dim=(8, 8, 8, 8))
DIMS = {
    # BFL's Flux2Params; diffusers' scripts/convert_flux2_to_diffusers.py for klein
    "full": {"flux2-dev": Flux2Dims(),
             "flux2-klein-4b": Flux2Dims(hidden=3072, heads=24, depth=5, depth_single=20, context_in=7680,
                                         guidance_embed=False),
             "flux2-klein-9b": Flux2Dims(hidden=4096, heads=32, depth=8, depth_single=24, context_in=12288,
                                         guidance_embed=False)},
    # text widths stand for 3 x a tiny encoder's width, so each variant's conditioning differs in shape
    "tiny": {"flux2-dev": Flux2Dims(**_TINY, context_in=96),
             "flux2-klein-4b": Flux2Dims(**_TINY, context_in=48, guidance_embed=False),
             "flux2-klein-9b": Flux2Dims(**_TINY, context_in=72, guidance_embed=False)},
    "small": {"flux2-dev": Flux2Dims(hidden=512, heads=4, depth=4, depth_single=8, context_in=1536)},
}


def bfl_shapes(d: Flux2Dims) -> dict[str, tuple]:
    """Every tensor of a FLUX.2 transformer in the BFL layout (flux2-dev.safetensors, ComfyUI's repackaged files),
    with its shape. No biases anywhere."""
    h, m, s = d.hidden, d.mlp_hidden, {}
    linear_shapes(s, "img_in", h, d.in_channels, bias=False)
    linear_shapes(s, "txt_in", h, d.context_in, bias=False)
    linear_shapes(s, "time_in.in_layer", h, 256, bias=False)
    linear_shapes(s, "time_in.out_layer", h, h, bias=False)
    if d.guidance_embed:
        linear_shapes(s, "guidance_in.in_layer", h, 256, bias=False)
        linear_shapes(s, "guidance_in.out_layer", h, h, bias=False)
    linear_shapes(s, "double_stream_modulation_img.lin", 6 * h, h, bias=False)
    linear_shapes(s, "double_stream_modulation_txt.lin", 6 * h, h, bias=False)
    linear_shapes(s, "single_stream_modulation.lin", 3 * h, h, bias=False)
    for i in range(d.depth):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            linear_shapes(s, f"{p}_attn.qkv", 3 * h, h, bias=False)
            s[f"{p}_attn.norm.query_norm.scale"] = (d.head_dim,)
            s[f"{p}_attn.norm.key_norm.scale"] = (d.head_dim,)
            linear_shapes(s, f"{p}_attn.proj", h, h, bias=False)
            linear_shapes(s, f"{p}_mlp.0", 2 * m, h, bias=False)
            linear_shapes(s, f"{p}_mlp.2", h, m, bias=False)
    for i in range(d.depth_single):
        p = f"single_blocks.{i}"
        linear_shapes(s, f"{p}.linear1", 3 * h + 2 * m, h, bias=False)
        linear_shapes(s, f"{p}.linear2", h, h + m, bias=False)
        s[f"{p}.norm.query_norm.scale"] = (d.head_dim,)
        s[f"{p}.norm.key_norm.scale"] = (d.head_dim,)
    linear_shapes(s, "final_layer.adaLN_modulation.1", 2 * h, h, bias=False)
    linear_shapes(s, "final_layer.linear", d.in_channels, h, bias=False)
    return s


# ---- detection: the diffusers config from the tensors' shapes --------------------------------------------------------


def _variant(hidden: int, guidance: bool, metadata: dict) -> str:
    """[dev] has the guidance embedding; [klein] 4B and 9B differ in width (3072, 4096). Base and distilled files
    have one structure (ComfyUI does not tell them apart either): the workflow's cfg and steps do."""
    synthetic = metadata.get("xdit.synthetic")
    stated = json.loads(synthetic).get("variant", "") if synthetic else ""
    if stated in DIMS["full"] and DIMS["full"][stated].guidance_embed == guidance:
        return stated
    if guidance:
        return "flux2-dev"
    return "flux2-klein-9b" if hidden >= 4096 else "flux2-klein-4b"


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    if layout == "bfl":
        hidden, in_channels = s["img_in.weight"]
        head_dim = s["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        depth, single = count(s, r"double_blocks\.(\d+)\."), count(s, r"single_blocks\.(\d+)\.")
        context_in, mlp = s["txt_in.weight"][1], s["double_blocks.0.img_mlp.2.weight"][1]
        out_channels, guidance = s["final_layer.linear.weight"][0], "guidance_in.in_layer.weight" in s
    else:
        hidden, in_channels = s["x_embedder.weight"]
        head_dim = s["transformer_blocks.0.attn.norm_q.weight"][0]
        depth = count(s, r"transformer_blocks\.(\d+)\.")
        single = count(s, r"single_transformer_blocks\.(\d+)\.")
        context_in, mlp = s["context_embedder.weight"][1], s["transformer_blocks.0.ff.linear_out.weight"][1]
        out_channels = s["proj_out.weight"][0]
        guidance = "time_guidance_embed.guidance_embedder.linear_1.weight" in s
    if hidden % head_dim:
        raise CheckpointError(f"FLUX.2 width {hidden} is not a multiple of its head width {head_dim}")
    if in_channels != 128 or out_channels != 128:
        raise CheckpointError(f"FLUX.2 transformer with {in_channels} input / {out_channels} output channels; the "
                              f"engine runs FLUX.2's 128-channel latent (ComfyUI's Flux2 latent format)")
    if mlp * 2 % hidden:
        raise CheckpointError(f"FLUX.2 transformer whose MLP width {mlp} is no multiple of half its width {hidden}")
    config = {"patch_size": 1, "in_channels": 128, "num_layers": depth, "num_single_layers": single,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": context_in, "mlp_ratio": mlp / hidden,
              "axes_dims_rope": rope_axes(head_dim, metadata, HEAD_DIM_AXES, "FLUX.2"), "rope_theta": THETA, "guidance_embeds": guidance}
    return config, _variant(hidden, guidance, metadata)


def key_map(layout: str, config: dict) -> list | None:
    """BFL keys -> diffusers' Flux2Transformer2DModel keys (None: the diffusers layout needs none); the same map as
    diffusers' convert_flux2_transformer_checkpoint_to_diffusers (a test checks it against that)."""
    if layout == "diffusers":
        return None
    h = config["num_attention_heads"] * config["attention_head_dim"]
    m: list = []
    linear(m, "x_embedder", "img_in", bias=False)
    linear(m, "context_embedder", "txt_in", bias=False)
    linear(m, "time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer", bias=False)
    linear(m, "time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer", bias=False)
    if config["guidance_embeds"]:
        linear(m, "time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer", bias=False)
        linear(m, "time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer", bias=False)
    for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        linear(m, f"{name}.linear", f"{name}.lin", bias=False)
    for i in range(config["num_layers"]):
        d, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        fused(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{s}.img_attn.qkv", (h, h, h), bias=False)
        fused(m, (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), f"{s}.txt_attn.qkv",
              (h, h, h), bias=False)
        for dst, src in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            m.append((f"{d}.attn.{dst}.weight", f"{s}.{src}.scale", None))
        linear(m, f"{d}.attn.to_out.0", f"{s}.img_attn.proj", bias=False)
        linear(m, f"{d}.attn.to_add_out", f"{s}.txt_attn.proj", bias=False)
        linear(m, f"{d}.ff.linear_in", f"{s}.img_mlp.0", bias=False)
        linear(m, f"{d}.ff.linear_out", f"{s}.img_mlp.2", bias=False)
        linear(m, f"{d}.ff_context.linear_in", f"{s}.txt_mlp.0", bias=False)
        linear(m, f"{d}.ff_context.linear_out", f"{s}.txt_mlp.2", bias=False)
    for i in range(config["num_single_layers"]):
        d, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        linear(m, f"{d}.attn.to_qkv_mlp_proj", f"{s}.linear1", bias=False)   # [q, k, v, gate, up] in both
        linear(m, f"{d}.attn.to_out", f"{s}.linear2", bias=False)
        m.append((f"{d}.attn.norm_q.weight", f"{s}.norm.query_norm.scale", None))
        m.append((f"{d}.attn.norm_k.weight", f"{s}.norm.key_norm.scale", None))
    linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap", bias=False)
    linear(m, "proj_out", "final_layer.linear", bias=False)
    return m
