"""Tiny synthetic checkpoints in the key layouts real ComfyUI model files use, for tests and the demo.

FLUX.1 in the BFL layout (flux1-dev / flux1-schnell .safetensors); SD3 / SD3.5 in the SAI MMDiT layout
(sd3_medium, sd3.5_medium, sd3.5_large). The key/shape tables are parameterised by the model's dims,
so the same function describes the full-size models (tests check those against diffusers' own
single-file converters) and the tiny ones written here: deterministic random weights, at least 4
heads and 4 blocks of each kind, so 4-way plans are testable.

Besides plain safetensors, the same weights as ComfyUI's fp8_scaled files hold them (fp8 matrices, a float32
scale_weight per layer, the `scaled_fp8` marker) and as ComfyUI-GGUF's .gguf files (arch field, BFL/SAI keys,
matrices in one block type, vectors in F32).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, asdict

import torch
from safetensors.torch import save_file

COMFY_PREFIX = "model.diffusion_model."


@dataclass(frozen=True)
class FluxDims:
    hidden: int = 3072
    heads: int = 24
    depth: int = 19           # double-stream blocks
    depth_single: int = 38    # single-stream blocks
    mlp_ratio: float = 4.0
    in_channels: int = 64     # 16 latent channels x 2x2 packing
    vec_in: int = 768         # CLIP-L pooled
    context_in: int = 4096    # T5-XXL
    guidance_embed: bool = True  # dev: True, schnell: False
    axes_dim: tuple = (16, 56, 56)

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


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


REAL = {
    "flux-dev": FluxDims(),
    "flux-schnell": FluxDims(guidance_embed=False),
    "sd3-medium": SD3Dims(),
    "sd3.5-medium": SD3Dims(pos_embed_max_size=384, qk_norm=True, dual_attention_layers=tuple(range(13))),
    "sd3.5-large": SD3Dims(depth=38, qk_norm=True),
}

TINY = {
    "flux-dev": FluxDims(hidden=128, heads=4, depth=4, depth_single=4, axes_dim=(4, 14, 14)),
    "flux-schnell": FluxDims(hidden=128, heads=4, depth=4, depth_single=4, axes_dim=(4, 14, 14),
                             guidance_embed=False),
    # SD3's head count equals its depth, so 4 heads means 4 blocks of 64-wide heads (hidden 256).
    "sd3-medium": SD3Dims(depth=4, pos_embed_max_size=32),
    "sd3.5-medium": SD3Dims(depth=4, pos_embed_max_size=32, qk_norm=True, dual_attention_layers=(0, 1)),
    "sd3.5-large": SD3Dims(depth=4, pos_embed_max_size=32, qk_norm=True),
}
# Between the two, for the memory benchmark: a few hundred MB of fp32 weights, so weights dominate a rank's memory
SMALL = {
    "flux-dev": FluxDims(hidden=512, heads=4, depth=4, depth_single=8, axes_dim=(16, 56, 56)),
    "sd3-medium": SD3Dims(depth=8, pos_embed_max_size=64),
}
VARIANTS = {"flux": ("flux-dev", "flux-schnell"), "sd3": ("sd3-medium", "sd3.5-medium", "sd3.5-large")}


def _linear(out: dict, name: str, n_out: int, n_in: int) -> None:
    out[f"{name}.weight"] = (n_out, n_in)
    out[f"{name}.bias"] = (n_out,)


def flux_shapes(d: FluxDims) -> dict[str, tuple]:
    """Every tensor of a FLUX.1 transformer in the BFL layout, with its shape."""
    h, s = d.hidden, {}
    _linear(s, "img_in", h, d.in_channels)
    _linear(s, "time_in.in_layer", h, 256)
    _linear(s, "time_in.out_layer", h, h)
    _linear(s, "vector_in.in_layer", h, d.vec_in)
    _linear(s, "vector_in.out_layer", h, h)
    if d.guidance_embed:
        _linear(s, "guidance_in.in_layer", h, 256)
        _linear(s, "guidance_in.out_layer", h, h)
    _linear(s, "txt_in", h, d.context_in)
    for i in range(d.depth):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            _linear(s, f"{p}_mod.lin", 6 * h, h)
            _linear(s, f"{p}_attn.qkv", 3 * h, h)
            s[f"{p}_attn.norm.query_norm.scale"] = (d.head_dim,)
            s[f"{p}_attn.norm.key_norm.scale"] = (d.head_dim,)
            _linear(s, f"{p}_attn.proj", h, h)
            _linear(s, f"{p}_mlp.0", d.mlp_hidden, h)
            _linear(s, f"{p}_mlp.2", h, d.mlp_hidden)
    for i in range(d.depth_single):
        p = f"single_blocks.{i}"
        _linear(s, f"{p}.linear1", 3 * h + d.mlp_hidden, h)
        _linear(s, f"{p}.linear2", h, h + d.mlp_hidden)
        s[f"{p}.norm.query_norm.scale"] = (d.head_dim,)
        s[f"{p}.norm.key_norm.scale"] = (d.head_dim,)
        _linear(s, f"{p}.modulation.lin", 3 * h, h)
    _linear(s, "final_layer.adaLN_modulation.1", 2 * h, h)
    _linear(s, "final_layer.linear", d.in_channels, h)
    return s


def sd3_shapes(d: SD3Dims) -> dict[str, tuple]:
    """Every tensor of an SD3/SD3.5 MMDiT in the SAI layout, with its shape."""
    h, s = d.hidden, {}
    s["pos_embed"] = (1, d.pos_embed_max_size ** 2, h)
    s["x_embedder.proj.weight"] = (h, d.in_channels, d.patch, d.patch)
    s["x_embedder.proj.bias"] = (h,)
    _linear(s, "t_embedder.mlp.0", h, 256)
    _linear(s, "t_embedder.mlp.2", h, h)
    _linear(s, "y_embedder.mlp.0", h, d.pooled_in)
    _linear(s, "y_embedder.mlp.2", h, h)
    _linear(s, "context_embedder", h, d.context_in)
    for i in range(d.depth):
        last = i == d.depth - 1  # the last context block is "pre-only": no proj, no mlp, 2-way modulation
        dual = i in d.dual_attention_layers
        x, c = f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        _linear(s, f"{x}.adaLN_modulation.1", (9 if dual else 6) * h, h)
        _linear(s, f"{x}.attn.qkv", 3 * h, h)
        _linear(s, f"{x}.attn.proj", h, h)
        _linear(s, f"{x}.mlp.fc1", 4 * h, h)
        _linear(s, f"{x}.mlp.fc2", h, 4 * h)
        _linear(s, f"{c}.adaLN_modulation.1", (2 if last else 6) * h, h)
        _linear(s, f"{c}.attn.qkv", 3 * h, h)
        if not last:
            _linear(s, f"{c}.attn.proj", h, h)
            _linear(s, f"{c}.mlp.fc1", 4 * h, h)
            _linear(s, f"{c}.mlp.fc2", h, 4 * h)
        if d.qk_norm:
            for blk in (x, c):
                s[f"{blk}.attn.ln_q.weight"] = (d.head_dim,)
                s[f"{blk}.attn.ln_k.weight"] = (d.head_dim,)
        if dual:
            _linear(s, f"{x}.attn2.qkv", 3 * h, h)
            _linear(s, f"{x}.attn2.proj", h, h)
            if d.qk_norm:
                s[f"{x}.attn2.ln_q.weight"] = (d.head_dim,)
                s[f"{x}.attn2.ln_k.weight"] = (d.head_dim,)
    _linear(s, "final_layer.adaLN_modulation.1", 2 * h, h)
    _linear(s, "final_layer.linear", d.patch * d.patch * d.in_channels, h)
    return s


def shapes_for(variant: str, dims=None) -> dict[str, tuple]:
    dims = dims or TINY[variant]
    return flux_shapes(dims) if isinstance(dims, FluxDims) else sd3_shapes(dims)


# Placeholders with the key names a full ComfyUI checkpoint carries besides the transformer.
_FULL_EXTRAS = {
    "flux": ["vae.decoder.conv_in.weight", "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight"],
    "sd3": ["first_stage_model.decoder.conv_in.weight",
            "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
            "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight",
            "text_encoders.t5xxl.transformer.shared.weight"],
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3fn": torch.float8_e4m3fn}
FORMATS = ("safetensors", "fp8_scaled", "gguf")
FP8_MAX = 448.0   # largest float8_e4m3fn: a scaled layer's largest weight maps onto it


def make_state_dict(variant: str, *, seed: int = 0, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Deterministic weights, scaled like a trained model's (1/sqrt(fan_in)) so activations stay sane.

    fp8_e4m3fn stores matrices in fp8 and vectors (biases, norm scales) in bf16, as fp8 FLUX files do.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(DTYPES)}")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes_for(variant).items():
        if name.endswith((".scale", "ln_q.weight", "ln_k.weight")):
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        elif name == "pos_embed":
            t = 0.5 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            fan_in = 1
            for n in shape[1:]:
                fan_in *= n
            t = torch.randn(shape, generator=gen) / fan_in ** 0.5
        target = DTYPES[dtype]
        if target == torch.float8_e4m3fn and t.ndim < 2:
            target = torch.bfloat16
        out[name] = t.to(target).contiguous()
    return out


def scaled_fp8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 weights as a ComfyUI fp8_scaled file holds them: each matrix as float8_e4m3fn with a float32
    `scale_weight` (its largest magnitude / 448) and a `scale_input` of 1, other tensors in bf16, and the empty
    `scaled_fp8` marker, whose dtype is the weights' fp8 type."""
    out = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for name, t in weights.items():
        if t.ndim == 2 and name.endswith(".weight"):
            layer = name[:-len("weight")]
            scale = (t.float().abs().amax() / FP8_MAX).clamp(min=2.0 ** -30)
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[layer + "scale_weight"] = scale.reshape(())
            out[layer + "scale_input"] = torch.ones(())
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def gguf_type(name: str, shape: tuple, quant: str) -> str:
    """The GGUF type a converter gives each tensor: vectors and tiny tensors F32; matrices in `quant`, or, where a
    row is not a whole number of its blocks, Q8_0 (32-value blocks) as llama.cpp's fallback does, else F16."""
    from .quantized import BLOCKS
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) == 1 or numel <= 1024:
        return "F32"
    if quant not in BLOCKS:
        return quant
    if len(shape) == 2 and shape[-1] % BLOCKS[quant][1] == 0:
        return quant
    return "Q8_0" if len(shape) == 2 and shape[-1] % 32 == 0 else "F16"


def write_gguf(path: str, kind: str, weights: dict[str, torch.Tensor], quant: str, metadata: dict[str, str]) -> dict:
    """Write `weights` as a ComfyUI-GGUF-style file (general.architecture = kind); returns {type: tensor count}."""
    import gguf
    import numpy as np
    from .quantized import quantize
    writer = gguf.GGUFWriter(path, arch=kind)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in metadata.items():
        writer.add_string(key, value)
    counts: dict[str, int] = {}
    for name, t in weights.items():
        qtype = gguf_type(name, tuple(t.shape), quant)
        x = t.float().numpy()
        if qtype == "F32":
            writer.add_tensor(name, x.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(name, x.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(x, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        counts[qtype] = counts.get(qtype, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def write_tiny(kind: str, out_dir: str, *, variant: str | None = None, dtype: str = "fp32", seed: int = 0,
               prefix: bool = False, full: bool = False, format: str = "safetensors", quant: str = "Q8_0") -> str:
    """Write one tiny checkpoint and return its path. `full` adds placeholder text-encoder / VAE tensors
    and the `model.diffusion_model.` prefix, as in a full ComfyUI checkpoint. format: safetensors (in `dtype`),
    fp8_scaled, or gguf (matrices in `quant`, see gguf_type)."""
    from .quantized import SUPPORTED
    if kind not in VARIANTS:
        raise ValueError(f"kind={kind!r} is invalid: use 'flux' or 'sd3'")
    variant = variant or VARIANTS[kind][0]
    if variant not in VARIANTS[kind]:
        raise ValueError(f"variant={variant!r} is not a {kind} variant: use one of {list(VARIANTS[kind])}")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is invalid: use one of {list(FORMATS)}")
    if format != "safetensors" and dtype != "fp32":
        raise ValueError(f"dtype={dtype!r} applies to the safetensors format; {format} sets its own types")
    if format == "gguf" and (prefix or full):
        raise ValueError("prefix/full apply to safetensors files: ComfyUI-GGUF files hold the bare transformer")
    if format == "gguf" and quant not in SUPPORTED:
        raise ValueError(f"quant={quant!r} is invalid: use one of {list(SUPPORTED)}")
    dims = asdict(TINY[variant])
    metadata = {"format": "pt", "xdit.synthetic": json.dumps({"variant": variant, "seed": seed, "dims": dims})}
    os.makedirs(out_dir, exist_ok=True)
    weights = make_state_dict(variant, seed=seed, dtype=dtype)
    if format == "gguf":
        path = os.path.join(out_dir, f"tiny-{variant}-{quant}.gguf")
        write_gguf(path, kind, weights, quant, {"xdit.synthetic": metadata["xdit.synthetic"]})
        return path
    if format == "fp8_scaled":
        weights = scaled_fp8(weights)
    if prefix or full:
        weights = {COMFY_PREFIX + k: v for k, v in weights.items()}
    if full:
        gen = torch.Generator().manual_seed(seed + 1)
        for name in _FULL_EXTRAS[kind]:
            weights[name] = torch.randn(8, 8, generator=gen).to(torch.float16)
    suffix = ("-full" if full else "-prefixed" if prefix else "") + ("" if dtype == "fp32" else f"-{dtype}")
    suffix += "-fp8_scaled" if format == "fp8_scaled" else ""
    path = os.path.join(out_dir, f"tiny-{variant}{suffix}.safetensors")
    save_file(weights, path, metadata=metadata)
    return path
