"""SD3-medium, SD3.5-medium and SD3.5-large (MMDiT): everything the engine knows of this family.

ComfyUI's conventions (ComfyUI 0.3.64: comfy/supported_models.py SD3, one class for all three; comfy/latent_formats.py
SD3; comfy/model_base.py SD3): latent format SD3 (16 channels, scale 1.5305, shift 0.0609); ModelSamplingDiscreteFlow
with shift 3.0 and multiplier 1000, so the model's timestep is sigma * 1000; CONDITIONING holds CLIP-L+G padded to
4096 then T5-XXL, [B, 77+N, 4096], and pooled [B, 2048]; real CFG with a negative. The model patchifies the latent
itself and adds positions cropped from a fixed grid (pos_embed_max_size), which bounds the image size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .stage import StageModel
from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import (Family, Marker, StageParams, StockJob, TokenTable, count, fused, linear, linear_shapes,
                   pre_hook)

CLIP_TOKENS = 77  # CLIP-L+G tokens, padded to the T5 width and put before T5's


# ---- dimensions and the SAI single-file layout -----------------------------------------------------------------------
@dataclass(frozen=True)
class SD3Dims:
    depth: int = 24           # joint blocks; SAI convention: heads = depth, head_dim 64
    head_dim: int = 64
    pos_embed_max_size: int = 192
    in_channels: int = 16
    patch: int = 2
    context_in: int = 4096
    pooled_in: int = 2048
    qk_norm: bool = False     # SD3.5
    dual_attention_layers: tuple = ()  # SD3.5-medium: 0..12

    @property
    def heads(self) -> int:
        return self.depth

    @property
    def hidden(self) -> int:
        return self.depth * self.head_dim


DIMS = {
    "full": {"sd3-medium": SD3Dims(),
             "sd3.5-medium": SD3Dims(pos_embed_max_size=384, qk_norm=True, dual_attention_layers=tuple(range(13))),
             "sd3.5-large": SD3Dims(depth=38, qk_norm=True)},
    # the head count equals the depth, so 4 heads means 4 blocks of 64-wide heads (hidden 256)
    "tiny": {"sd3-medium": SD3Dims(depth=4, pos_embed_max_size=32),
             "sd3.5-medium": SD3Dims(depth=4, pos_embed_max_size=32, qk_norm=True, dual_attention_layers=(0, 1)),
             "sd3.5-large": SD3Dims(depth=4, pos_embed_max_size=32, qk_norm=True)},
    "small": {"sd3-medium": SD3Dims(depth=8, pos_embed_max_size=64)},
}


def sai_shapes(d: SD3Dims) -> dict[str, tuple]:
    """Every tensor of an SD3/SD3.5 MMDiT in the SAI layout, with its shape."""
    h, s = d.hidden, {}
    s["pos_embed"] = (1, d.pos_embed_max_size ** 2, h)
    s["x_embedder.proj.weight"] = (h, d.in_channels, d.patch, d.patch)
    s["x_embedder.proj.bias"] = (h,)
    linear_shapes(s, "t_embedder.mlp.0", h, 256)
    linear_shapes(s, "t_embedder.mlp.2", h, h)
    linear_shapes(s, "y_embedder.mlp.0", h, d.pooled_in)
    linear_shapes(s, "y_embedder.mlp.2", h, h)
    linear_shapes(s, "context_embedder", h, d.context_in)
    for i in range(d.depth):
        last = i == d.depth - 1  # the last context block is "pre-only": no proj, no mlp, 2-way modulation
        dual = i in d.dual_attention_layers
        x, c = f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        linear_shapes(s, f"{x}.adaLN_modulation.1", (9 if dual else 6) * h, h)
        linear_shapes(s, f"{x}.attn.qkv", 3 * h, h)
        linear_shapes(s, f"{x}.attn.proj", h, h)
        linear_shapes(s, f"{x}.mlp.fc1", 4 * h, h)
        linear_shapes(s, f"{x}.mlp.fc2", h, 4 * h)
        linear_shapes(s, f"{c}.adaLN_modulation.1", (2 if last else 6) * h, h)
        linear_shapes(s, f"{c}.attn.qkv", 3 * h, h)
        if not last:
            linear_shapes(s, f"{c}.attn.proj", h, h)
            linear_shapes(s, f"{c}.mlp.fc1", 4 * h, h)
            linear_shapes(s, f"{c}.mlp.fc2", h, 4 * h)
        if d.qk_norm:
            for blk in (x, c):
                s[f"{blk}.attn.ln_q.weight"] = (d.head_dim,)
                s[f"{blk}.attn.ln_k.weight"] = (d.head_dim,)
        if dual:
            linear_shapes(s, f"{x}.attn2.qkv", 3 * h, h)
            linear_shapes(s, f"{x}.attn2.proj", h, h)
            if d.qk_norm:
                s[f"{x}.attn2.ln_q.weight"] = (d.head_dim,)
                s[f"{x}.attn2.ln_k.weight"] = (d.head_dim,)
    linear_shapes(s, "final_layer.adaLN_modulation.1", 2 * h, h)
    linear_shapes(s, "final_layer.linear", d.patch * d.patch * d.in_channels, h)
    return s


# ---- detection: the diffusers config from the tensors' shapes --------------------------------------------------------
def _config(hidden, in_channels, patch, depth, pos_len, context_in, pooled_in, out_features, head_dim, dual, qk):
    # SAI convention: 64-wide heads; SD3.5 files carry qk-norm weights that state the width outright
    head_dim = head_dim or 64
    size = int(round(pos_len ** 0.5))
    if size * size != pos_len:
        raise CheckpointError(f"SD3 pos_embed has {pos_len} positions, not a square grid")
    config = {"sample_size": 128, "patch_size": patch, "in_channels": in_channels, "num_layers": depth,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": context_in, "caption_projection_dim": hidden, "pooled_projection_dim": pooled_in,
              "out_channels": out_features // (patch * patch), "pos_embed_max_size": size,
              "dual_attention_layers": tuple(dual), "qk_norm": "rms_norm" if qk else None}
    variant = "sd3.5-medium" if dual else "sd3.5-large" if qk else "sd3-medium"
    return config, variant


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    if layout == "sai":
        qk = s.get("joint_blocks.0.x_block.attn.ln_q.weight")
        dual = sorted(int(m.group(1)) for k in s
                      if (m := re.match(r"joint_blocks\.(\d+)\.x_block\.attn2\.qkv\.weight", k)))
        w = s["x_embedder.proj.weight"]
        return _config(w[0], w[1], w[2], count(s, r"joint_blocks\.(\d+)\."), s["pos_embed"][1],
                       s["context_embedder.weight"][1], s["y_embedder.mlp.0.weight"][1],
                       s["final_layer.linear.weight"][0], qk[0] if qk else None, dual, qk)
    qk = s.get("transformer_blocks.0.attn.norm_q.weight")
    dual = sorted(int(m.group(1)) for k in s if (m := re.match(r"transformer_blocks\.(\d+)\.attn2\.to_q\.weight", k)))
    w = s["pos_embed.proj.weight"]
    return _config(w[0], w[1], w[2], count(s, r"transformer_blocks\.(\d+)\."), s["pos_embed.pos_embed"][1],
                   s["context_embedder.weight"][1], s["time_text_embed.text_embedder.linear_1.weight"][1],
                   s["proj_out.weight"][0], qk[0] if qk else None, dual, qk)


def key_map(layout: str, config: dict) -> list | None:
    """SAI MMDiT keys -> diffusers' SD3Transformer2DModel keys (None: the diffusers layout needs none)."""
    if layout == "diffusers":
        return None
    h = config["num_attention_heads"] * config["attention_head_dim"]
    depth = config["num_layers"]
    m: list = [("pos_embed.pos_embed", "pos_embed", None)]
    linear(m, "pos_embed.proj", "x_embedder.proj")
    linear(m, "time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0")
    linear(m, "time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2")
    linear(m, "time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0")
    linear(m, "time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2")
    linear(m, "context_embedder", "context_embedder")
    for i in range(depth):
        d, x, c = f"transformer_blocks.{i}", f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        last = i == depth - 1
        fused(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{x}.attn.qkv", (h, h, h))
        fused(m, (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), f"{c}.attn.qkv", (h, h, h))
        if config["qk_norm"]:
            for dst, src in (("norm_q", f"{x}.attn.ln_q"), ("norm_k", f"{x}.attn.ln_k"),
                             ("norm_added_q", f"{c}.attn.ln_q"), ("norm_added_k", f"{c}.attn.ln_k")):
                m.append((f"{d}.attn.{dst}.weight", f"{src}.weight", None))
        linear(m, f"{d}.attn.to_out.0", f"{x}.attn.proj")
        if not last:
            linear(m, f"{d}.attn.to_add_out", f"{c}.attn.proj")
        if i in config["dual_attention_layers"]:
            fused(m, (f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v"), f"{x}.attn2.qkv", (h, h, h))
            if config["qk_norm"]:
                m.append((f"{d}.attn2.norm_q.weight", f"{x}.attn2.ln_q.weight", None))
                m.append((f"{d}.attn2.norm_k.weight", f"{x}.attn2.ln_k.weight", None))
            linear(m, f"{d}.attn2.to_out.0", f"{x}.attn2.proj")
        linear(m, f"{d}.norm1.linear", f"{x}.adaLN_modulation.1")
        # the last context block only modulates (shift, scale): diffusers wants (scale, shift)
        linear(m, f"{d}.norm1_context.linear", f"{c}.adaLN_modulation.1", "swap" if last else None)
        linear(m, f"{d}.ff.net.0.proj", f"{x}.mlp.fc1")
        linear(m, f"{d}.ff.net.2", f"{x}.mlp.fc2")
        if not last:
            linear(m, f"{d}.ff_context.net.0.proj", f"{c}.mlp.fc1")
            linear(m, f"{d}.ff_context.net.2", f"{c}.mlp.fc2")
    linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap")
    linear(m, "proj_out", "final_layer.linear")
    return m


# ---- the one forward, with ComfyUI's conventions ---------------------------------------------------------------------
def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 16, h, w] (model space, compute dtype): one call of the unmodified SD3Transformer2DModel, its
    timestep (ComfyUI's: sigma * 1000, float32) embedded from fp32 values."""
    with pre_hook(flow.model.time_text_embed, lambda module, args: (timestep, args[1])):
        return flow.model(hidden_states=x, encoder_hidden_states=prepared.cond, pooled_projections=prepared.pooled,
                          timestep=timestep, return_dict=False)[0]


# ---- sequence parallel: the attention processor ----------------------------------------------------------------------
class SD3SPProcessor:
    """SD3/SD3.5 joint attention (image tokens sharded, the 77+N text tokens joint) and SD3.5's image-only attn2, as
    diffusers' JointAttnProcessor2_0 computes them, through the sequence-parallel entry point."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        """SD3's text tokens arrive separately (encoder_hidden_states) and are always joint."""
        if attention_mask is not None:
            raise ValueError("sequence-parallel SD3 attention takes no attention mask")
        q, k, v = (proj(hidden_states) for proj in (attn.to_q, attn.to_k, attn.to_v))
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.unflatten(-1, (attn.heads, head_dim)) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        joint = None
        if encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(-1, (attn.heads, head_dim))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            joint = (eq, ek, ev)
        image, text = self.attention(q, k, v, joint=joint)
        image = attn.to_out[1](attn.to_out[0](image.flatten(2, 3).to(q.dtype)))
        if encoder_hidden_states is None:
            return image
        text = text.flatten(2, 3).to(q.dtype)
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return image, text


# ---- PipeFusion: a stage's share of the forward ----------------------------------------------------------------------
class SD3Stage(StageModel):
    def temb(self, prepared, sigma32: torch.Tensor) -> torch.Tensor:
        n = prepared.cond.shape[0]
        return self.model.time_text_embed(sigma32.reshape(-1).expand(n) * 1000.0, prepared.pooled)

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        pe = self.model.pos_embed   # PatchEmbed's forward, on a band of rows: the conv is per patch, positions cropped
        tokens = pe.proj(x).flatten(2).transpose(1, 2)
        height, width = self.layout.rows * self.patch, self.layout.cols * self.patch
        positions = pe.cropped_pos_embed(height, width)[:, self.local_index(band)]
        image = (tokens[:, self.band_index(band)] + positions).to(tokens.dtype)
        text = (self.model.context_embedder(prepared.cond) if with_text
                else image.new_zeros(x.shape[0], 0, image.shape[2]))
        return text, image

    def run_blocks(self, text, image, temb, band, with_text: bool):
        for block in self.blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb)
            if text is None:  # the last block keeps no text stream
                text = image.new_zeros(image.shape[0], 0, image.shape[2])
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb))

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        """SD3 packs (row, col, channel) per token."""
        (h, w), p, b = self.band_grid(band), self.patch, tokens.shape[0]
        grid = tokens.reshape(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return grid.reshape(b, -1, h * p, w * p)


def _model_class():
    from diffusers import SD3Transformer2DModel
    return SD3Transformer2DModel


FAMILY = Family(
    name="sd3", title="SD3/SD3.5", variants=("sd3-medium", "sd3.5-medium", "sd3.5-large"),
    markers=(Marker("joint_blocks.0.x_block.attn.qkv.weight", "sai"), Marker("pos_embed.proj.weight", "diffusers")),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("sd3",),
    layers=lambda config: config["num_layers"],
    latent=LatentFormat("SD3", channels=16, scale_factor=1.5305, shift_factor=0.0609),
    latent_patch=lambda config: config["patch_size"],
    sampling=lambda variant: FlowSampling.sd3(3.0),
    comfy_model=lambda config: ("SD3", {"in_channels": 16, "pos_embed_scaling_factor": None}),
    cond_width=lambda config: config["joint_attention_dim"],
    pooled_width=lambda config: config["pooled_projection_dim"],
    takes_guidance=lambda config: False,
    forward=forward, cfg=4.5, text_tokens=CLIP_TOKENS + 256,
    stock_jobs={v: StockJob("sd3.5-large", 1024, 1024, 28, 4.5, shift=3.0,
                            note="" if v == "sd3.5-large" else "the SD3.5-large workflow's values (none of its own)")
                for v in ("sd3-medium", "sd3.5-medium", "sd3.5-large")},
    max_latent_side=lambda config: config["pos_embed_max_size"] * config["patch_size"],
    # SD3 adds its positional embedding to the whole patch grid: split right after it. Its 77+N text tokens rarely
    # divide a degree, so they are always joint (they reach the processor separately, as encoder_hidden_states).
    tokens=TokenTable(processor=SD3SPProcessor, gather_after="proj_out", split_after=(("pos_embed", None, 1),),
                      blocks=("transformer_blocks",)),
    stage=SD3Stage,
    stage_params=StageParams(every=("time_text_embed.",), first=("pos_embed.", "context_embedder."),
                             last=("norm_out.", "proj_out.")),
    text_splits=False,
    native_layout="sai", dims=DIMS, shapes=sai_shapes,
    full_extras=("first_stage_model.decoder.conv_in.weight",
                 "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
                 "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight",
                 "text_encoders.t5xxl.transformer.shared.weight"),
    describe_blocks=lambda c: f"{c['num_layers']} joint blocks",
    describe_conditioning=lambda c: (
        f"cond [B, {CLIP_TOKENS}+N, {c['joint_attention_dim']}] (CLIP-L+G padded to {c['joint_attention_dim']}, then "
        f"T5-XXL), pooled [B, {c['pooled_projection_dim']}] (CLIP-L+G)"),
    text_encoder=lambda variant: "CLIP-G, CLIP-L and T5-XXL (TripleCLIPLoader with clip_g.safetensors, "
                                 "clip_l.safetensors and t5xxl_fp16.safetensors, or the checkpoint's own CLIP)",
)
