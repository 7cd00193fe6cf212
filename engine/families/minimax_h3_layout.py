"""MiniMax-H3's checkpoints: the dimensions of the released model and of the tiny test one, the tensors of ComfyUI's
single-file layout (Comfy-Org's repackaged files), the key map into diffusers' MiniMaxH3Transformer3DModel, and the
diffusers config detected from a file's shapes, as ComfyUI's model_detection reads them (0.33: the branch keyed on
`video_patch_proj.weight` and `audio_patch_proj.weight`). The family's behaviour is in minimax_h3.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointError
from .base import count, fused, linear, linear_shapes


@dataclass(frozen=True)
class H3Dims:
    hidden: int = 5376
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336
    depth: int = 50
    refiner: int = 2            # token refiner blocks (the text stream's own transformer)
    text_dim: int = 5120        # Qwen3-VL 32B hidden states
    freq_dim: int = 256         # the time embedding's sinusoid
    time_hidden: int = 5376
    time_dim: int = 2688
    rope_freqs: int = 16        # rotary frequencies per axis (t, h, w): 2 x 3 x 16 = 96 of 128 channels rotate
    video_channels: int = 24
    audio_channels: int = 32
    curve_grid: int = 0         # pruned files: an adaln_t_table of this many rows replaces the time embedder (its
    #                             width is time_dim), and the block modulations read it without an activation

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


DIMS = {
    "full": {"minimax-h3": H3Dims()},
    # 4 heads (4-way plans), inner width 128 != hidden 64 as in the released model (7168 != 5376), 24 of 32 head
    # channels rotated (partial rotation as released), a text width unlike the hidden width (ComfyUI refines the text
    # only then)
    "tiny": {"minimax-h3": H3Dims(hidden=64, heads=4, head_dim=32, ffn=96, depth=4, refiner=2, text_dim=48,
                                  freq_dim=64, time_hidden=64, time_dim=32, rope_freqs=4)},
}
# the pruned form (Comfy-Org's "pruned" files, e.g. the fl2va int8 one ComfyUI's template loads): the curve's grid
# and width are read from each file; these are the tiny test file's, and a stand-in for the released one's
DIMS["full"]["minimax-h3-pruned"] = H3Dims(time_dim=64, curve_grid=1001)
DIMS["tiny"]["minimax-h3-pruned"] = H3Dims(**{**DIMS["tiny"]["minimax-h3"].__dict__, "time_dim": 16,
                                              "curve_grid": 33})


def shapes(d: H3Dims) -> dict[str, tuple]:
    """Every tensor of a MiniMax-H3 transformer in ComfyUI's layout, with its shape."""
    s: dict[str, tuple] = {}
    linear_shapes(s, "video_patch_proj", d.hidden, d.video_channels * 4)
    linear_shapes(s, "audio_patch_proj", d.hidden, d.audio_channels)
    linear_shapes(s, "condition_proj", d.hidden, d.text_dim)
    if d.curve_grid:
        s["adaln_t_table"] = (d.curve_grid, d.time_dim)
    else:
        linear_shapes(s, "time_embedder.proj_in", d.time_hidden, d.freq_dim)
        linear_shapes(s, "time_embedder.proj_out", d.time_dim, d.time_hidden)
    s["rope.inv_freq"] = (d.rope_freqs,)

    def block(b: str, adaln: bool) -> None:
        s[f"{b}.norm1.weight"] = s[f"{b}.norm2.weight"] = (d.hidden,)
        linear_shapes(s, f"{b}.attn.qkv_proj", 3 * d.inner, d.hidden, bias=False)
        s[f"{b}.attn.q_norm.weight"] = s[f"{b}.attn.k_norm.weight"] = (d.head_dim,)
        linear_shapes(s, f"{b}.attn.out_proj", d.hidden, d.inner, bias=False)
        linear_shapes(s, f"{b}.mlp.fc1", 2 * d.ffn, d.hidden, bias=False)
        linear_shapes(s, f"{b}.mlp.fc2", d.hidden, d.ffn, bias=False)
        if adaln:
            linear_shapes(s, f"{b}.adaln_proj.linear", 6 * d.hidden * 3, d.time_dim)

    for i in range(d.refiner):
        block(f"token_refiner.blocks.{i}", adaln=False)
    s["token_refiner.final_norm.weight"] = (d.hidden,)
    for i in range(d.depth):
        block(f"blocks.{i}", adaln=True)
    s["final_layer.norm.weight"] = (d.hidden,)
    linear_shapes(s, "final_layer.adaln_proj.linear", 2 * d.hidden, d.time_dim)
    linear_shapes(s, "final_layer.video_out", d.video_channels * 4, d.hidden)
    linear_shapes(s, "final_layer.audio_out", d.audio_channels, d.hidden)
    return s


TOP = {"video_patch_proj": "proj_in", "audio_patch_proj": "audio_proj_in", "condition_proj": "context_embedder",
       "time_embedder.proj_in": "time_embedder.linear_1", "time_embedder.proj_out": "time_embedder.linear_2",
       "final_layer.adaln_proj.linear": "norm_out.linear", "final_layer.video_out": "proj_out",
       "final_layer.audio_out": "audio_proj_out"}


def _block(m: list, src: str, dst: str, d: H3Dims, adaln: bool) -> None:
    m.append((f"{dst}.norm1.weight", f"{src}.norm1.weight", None))
    m.append((f"{dst}.norm2.weight", f"{src}.norm2.weight", None))
    fused(m, (f"{dst}.attn.to_q", f"{dst}.attn.to_k", f"{dst}.attn.to_v"), f"{src}.attn.qkv_proj",
          (d.inner,) * 3, bias=False)
    m.append((f"{dst}.attn.norm_q.weight", f"{src}.attn.q_norm.weight", None))
    m.append((f"{dst}.attn.norm_k.weight", f"{src}.attn.k_norm.weight", None))
    linear(m, f"{dst}.attn.to_out.0", f"{src}.attn.out_proj", bias=False)
    # ComfyUI's SwiGLU gates with the first half of fc1 (silu(gate) * up), diffusers' with the second
    linear(m, f"{dst}.ff.net.0.proj", f"{src}.mlp.fc1", "swap", bias=False)
    linear(m, f"{dst}.ff.net.2", f"{src}.mlp.fc2", bias=False)
    if adaln:
        linear(m, f"{dst}.adaln_proj.linear", f"{src}.adaln_proj.linear")


def key_map(layout: str, config: dict) -> list | None:
    """ComfyUI's keys -> diffusers' MiniMaxH3Transformer3DModel keys (rope.inv_freq loaded as the file holds it, as
    ComfyUI reads it: the family's model holds it as a parameter-like buffer)."""
    d = dims_of(config)
    m: list = []
    for src, dst in TOP.items():
        if src.startswith("time_embedder.") and d.curve_grid:
            continue
        linear(m, dst, src)
    if d.curve_grid:
        m.append(("time_embedder.table", "adaln_t_table", None))
    m.append(("rope.inv_freq", "rope.inv_freq", None))
    for i in range(d.refiner):
        _block(m, f"token_refiner.blocks.{i}", f"token_refiner.refiner_blocks.{i}", d, adaln=False)
    m.append(("token_refiner.final_norm.weight", "token_refiner.final_norm.weight", None))
    for i in range(d.depth):
        _block(m, f"blocks.{i}", f"transformer_blocks.{i}", d, adaln=True)
    m.append(("norm_out.norm.weight", "final_layer.norm.weight", None))
    return m


def dims_of(config: dict) -> H3Dims:
    return H3Dims(hidden=config["hidden_size"], heads=config["num_attention_heads"],
                  head_dim=config["attention_head_dim"], ffn=config["ffn_dim"], depth=config["num_layers"],
                  refiner=config["num_refiner_layers"], text_dim=config["text_dim"], freq_dim=config["freq_dim"],
                  time_hidden=config["time_embed_hidden_dim"], time_dim=config["time_embed_dim"],
                  rope_freqs=config["rope_freq_dim"], video_channels=config["in_channels"],
                  audio_channels=config["audio_in_channels"], curve_grid=config.get("adaln_curve_grid", 0))


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    """The diffusers config of a file in ComfyUI's layout, from its shapes as model_detection reads them (and the
    `config` header's transformer entries, which ComfyUI lets override them)."""
    curve = s.get("adaln_t_table")
    head_dim = s["blocks.0.attn.q_norm.weight"][0]
    stated = {}
    if metadata.get("config"):
        try:
            stated = json.loads(metadata["config"]).get("transformer", {}) or {}
        except (ValueError, AttributeError):
            stated = {}
    hidden = s["video_patch_proj.weight"][0]
    rope = s["rope.inv_freq"][0]
    if 6 * rope > head_dim:
        raise CheckpointError(f"MiniMax-H3 transformer whose RoPE rotates {6 * rope} channels of {head_dim}-wide "
                              f"heads: the file is damaged")
    config = {
        "num_attention_heads": s["blocks.0.attn.qkv_proj.weight"][0] // (3 * head_dim),
        "attention_head_dim": head_dim, "hidden_size": hidden,
        "num_layers": count(s, r"blocks\.(\d+)\."),
        "num_refiner_layers": count(s, r"token_refiner\.blocks\.(\d+)\."),
        "ffn_dim": s["blocks.0.mlp.fc1.weight"][0] // 2,
        "in_channels": s["final_layer.video_out.weight"][0] // 4,
        "audio_in_channels": s["final_layer.audio_out.weight"][0],
        "text_dim": s["condition_proj.weight"][1],
        "freq_dim": curve[1] if curve else s["time_embedder.proj_in.weight"][1],
        "time_embed_hidden_dim": curve[1] if curve else s["time_embedder.proj_in.weight"][0],
        "time_embed_dim": curve[1] if curve else s["time_embedder.proj_out.weight"][0],
        "rope_freq_dim": rope, "rope_theta": 10000.0,
        "norm_eps": float(stated.get("norm_eps", 1e-5)), "qk_norm_eps": float(stated.get("qk_norm_eps", 1e-5)),
        "final_norm_eps": float(stated.get("final_norm_eps", 1e-5)),
    }
    if curve:
        config["adaln_curve_grid"] = curve[0]
    return config, "minimax-h3-pruned" if curve else "minimax-h3"
