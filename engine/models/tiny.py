"""Tiny synthetic checkpoints in the key layouts real ComfyUI model files use, for tests and the demo.

Each family declares its native layout's key/shape table (e.g. FLUX.1 in the BFL layout of flux1-dev.safetensors,
SD3/SD3.5 in the SAI MMDiT layout), parameterised by the model's dims, so the same table describes the full-size
models (tests check those against diffusers' own single-file converters) and the tiny ones written here:
deterministic random weights, at least 4 heads and 4 blocks of each kind, so 4-way plans are testable.

Besides plain safetensors, the same weights as ComfyUI's fp8_scaled files hold them (fp8 matrices, a float32
scale_weight per layer, the `scaled_fp8` marker), as its mixed-precision fp8 files do (the blocks' matrices fp8 with a
weight_scale, the layers listed in `_quantization_metadata`, the rest bf16), as its int8_tensorwise files do (the same
with int8 matrices, a per-row weight_scale, ConvRot-rotated or not: Comfy-Org's MiniMax-H3 int8 releases) and as
ComfyUI-GGUF's .gguf files (arch field, the native keys, matrices in one block type, vectors in F32).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import torch
from safetensors.torch import save_file

from .. import families
from .quantize_files import quantize
from .quantized import BLOCKS, CONVROT_GROUP, FP8_MAX, INT8_FORMAT, SUPPORTED, quantize_int8

COMFY_PREFIX = "model.diffusion_model."


def shapes_for(variant: str, dims=None) -> dict[str, tuple]:
    """Every tensor of `variant` in its family's native single-file layout, with its shape (tiny dims by default)."""
    family = families.by_variant(variant)
    return family.shapes(dims if dims is not None else family.variant_dims(variant, "tiny"))


def variants(kind: str) -> tuple[str, ...]:
    """The variants make-tiny writes for family `kind` (those with tiny dims)."""
    return tuple(families.get(kind).dims["tiny"])


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3fn": torch.float8_e4m3fn}
FORMATS = ("safetensors", "fp8_scaled", "fp8_mixed", "int8", "int8_convrot", "gguf")


def make_state_dict(variant: str, *, seed: int = 0, dtype: str = "fp32", dims=None) -> dict[str, torch.Tensor]:
    """Deterministic weights, scaled like a trained model's (1/sqrt(fan_in)) so activations stay sane.

    fp8_e4m3fn stores matrices in fp8 and vectors (biases, norm scales) in bf16, as fp8 FLUX files do.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(DTYPES)}")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes_for(variant, dims).items():
        if name == "rope.inv_freq":   # a computed table the file carries (MiniMax-H3): theta 10000 over 2 x its length
            t = 1.0 / 10000.0 ** (torch.arange(0, 2 * shape[0], 2, dtype=torch.float32) / (2 * shape[0]))
        elif name.endswith((".scale", "ln_q.weight", "ln_k.weight")) or (
                len(shape) == 1 and "norm" in name and name.endswith(".weight")):
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


def _layers_header(layers: dict, comfy_quant: bool) -> dict[str, str]:
    """The header metadata listing quantized layers as ComfyUI reads it (none where each carries a comfy_quant tensor)."""
    if comfy_quant:
        return {}
    return {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


def mixed_fp8(weights: dict[str, torch.Tensor], comfy_quant: bool = False) -> tuple[dict, dict[str, str]]:
    """fp32 weights as ComfyUI's mixed-precision files hold them (comfy/ops.py MixedPrecisionOps): the blocks'
    matrices as float8_e4m3fn with a float32 `weight_scale` (largest magnitude / 448), every other tensor in bf16; the
    quantized layers listed in the header's `_quantization_metadata`, or (comfy_quant) in a per-layer `comfy_quant`
    tensor of JSON bytes, as files saved by newer ComfyUI carry them. Returns (tensors, header metadata)."""
    out, layers = {}, {}
    for name, t in weights.items():
        if t.ndim == 2 and name.endswith(".weight") and "blocks." in name:
            layer = name[:-len(".weight")]
            scale = (t.float().abs().amax() / FP8_MAX).clamp(min=2.0 ** -30)
            out[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[layer + ".weight_scale"] = scale.reshape(())
            layers[layer] = {"format": "float8_e4m3fn"}
            if comfy_quant:
                out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(layers[layer]).encode()), dtype=torch.uint8)
        else:
            out[name] = t.to(torch.bfloat16)
    return out, _layers_header(layers, comfy_quant)


def convrot_group_for(width: int, largest: int = CONVROT_GROUP) -> int | None:
    """The ConvRot group a converter can give a layer of `width` inputs: the largest power of 4 up to `largest`
    (ComfyUI's 256) that divides it (tiny widths such as 96 take 16); None where none does."""
    group = largest
    while group >= 4:
        if width % group == 0:
            return group
        group //= 4
    return None


def mixed_int8(weights: dict[str, torch.Tensor], convrot: bool = True, comfy_quant: bool = False,
               group: int | None = None) -> tuple[dict, dict[str, str]]:
    """fp32 weights as ComfyUI's int8_tensorwise files hold them (comfy/ops.py MixedPrecisionOps, Comfy-Org's
    MiniMax-H3 `*_int8_convrot` releases): the blocks' matrices int8 with a float32 per-row `weight_scale` [rows, 1]
    (the row's largest magnitude / 127), rotated first by ConvRot (quantized.convrot) in groups of `group`, or of the
    largest power of 4 up to 256 that divides the layer's width (convrot_group_for); every other tensor in bf16. The
    layers are listed in the header's `_quantization_metadata` ({"format": "int8_tensorwise", "convrot": true,
    "convrot_groupsize": g}, as ComfyUI's own state_dict writes them) or (comfy_quant) each in a per-layer `comfy_quant`
    tensor of JSON bytes. Returns (tensors, header metadata)."""
    out, layers = {}, {}
    for name, t in weights.items():
        if t.ndim == 2 and name.endswith(".weight") and "blocks." in name:
            layer = name[:-len(".weight")]
            size = (group or convrot_group_for(t.shape[1])) if convrot else None
            if convrot and (size is None or t.shape[1] % size):
                raise ValueError(f"{layer}: no ConvRot group of {group or 'a power of 4'} divides its width "
                                 f"{t.shape[1]}")
            q, scale = quantize_int8(t.float(), size)
            out[name], out[layer + ".weight_scale"] = q, scale
            layers[layer] = {"format": INT8_FORMAT}
            if convrot:
                layers[layer].update(convrot=True, convrot_groupsize=size)
            if comfy_quant:
                out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(layers[layer]).encode()), dtype=torch.uint8)
        else:
            out[name] = t.to(torch.bfloat16)
    return out, _layers_header(layers, comfy_quant)


def gguf_type(name: str, shape: tuple, quant: str) -> str:
    """The GGUF type a converter gives each tensor: vectors and tiny tensors F32; matrices in `quant`, or, where a
    row is not a whole number of its blocks, Q8_0 (32-value blocks) as llama.cpp's fallback does, else F16."""
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) == 1 or len(shape) > 4 or numel <= 1024:   # a 5-D conv kernel: F32, as ComfyUI-GGUF's 5-D fix
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
               prefix: bool = False, full: bool = False, format: str = "safetensors", quant: str = "Q8_0",
               real_depth: bool = False) -> str:
    """Write one tiny checkpoint and return its path. `full` adds placeholder text-encoder / VAE tensors
    and the `model.diffusion_model.` prefix, as in a full ComfyUI checkpoint. format: safetensors (in `dtype`),
    fp8_scaled, fp8_mixed, int8 / int8_convrot (ComfyUI's int8_tensorwise layers, see mixed_int8), or gguf (matrices in
    `quant`, see gguf_type)."""
    if kind not in families.names():
        raise ValueError(f"kind={kind!r} is invalid: use one of {', '.join(families.names())}")
    family = families.get(kind)
    variant = family.variant_aliases.get(variant, variant) or family.variants[0]
    if variant not in variants(kind):
        raise ValueError(f"variant={variant!r} is not a {kind} variant: use one of {list(variants(kind))}")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is invalid: use one of {list(FORMATS)}")
    if format != "safetensors" and dtype != "fp32":
        raise ValueError(f"dtype={dtype!r} applies to the safetensors format; {format} sets its own types")
    if format == "gguf" and (prefix or full):
        raise ValueError("prefix/full apply to safetensors files: ComfyUI-GGUF files hold the bare transformer")
    if format == "gguf" and quant not in SUPPORTED:
        raise ValueError(f"quant={quant!r} is invalid: use one of {list(SUPPORTED)}")
    tiny = family.variant_dims(variant, "tiny")
    if real_depth:   # tiny widths, the full model's block counts (what a per-block cost scales with)
        full_dims = family.variant_dims(variant, "full")
        tiny = replace(tiny, **{k: getattr(full_dims, k) for k in asdict(tiny) if k.startswith("depth")})
    dims = asdict(tiny)
    metadata = {"format": "pt", "xdit.synthetic": json.dumps({"variant": variant, "seed": seed, "dims": dims})}
    metadata.update(family.tiny_metadata(tiny))   # header entries the family's files carry (LTX-2.3: its config)
    os.makedirs(out_dir, exist_ok=True)
    weights = make_state_dict(variant, seed=seed, dtype=dtype, dims=tiny)
    if format == "gguf":
        path = os.path.join(out_dir, tiny_file(variant, format=format, quant=quant, real_depth=real_depth))
        # the family's header entries as GGUF strings (LTX-2.3's `config`, which ComfyUI-GGUF hands ComfyUI as the
        # metadata its detection reads)
        write_gguf(path, family.gguf_arches[0], weights, quant,
                   {"xdit.synthetic": metadata["xdit.synthetic"], **family.tiny_metadata(tiny)})
        return path
    if format == "fp8_scaled":
        weights = scaled_fp8(weights)
    if format == "fp8_mixed":
        weights, header = mixed_fp8(weights)
        metadata.update(header)
    if format in ("int8", "int8_convrot"):
        weights, header = mixed_int8(weights, convrot=format == "int8_convrot")
        metadata.update(header)
    if prefix or full:
        weights = {COMFY_PREFIX + k: v for k, v in weights.items()}
        if "_quantization_metadata" in metadata:   # named by the file's keys, as ComfyUI's checkpoint loader finds them
            quant = json.loads(metadata["_quantization_metadata"])
            quant["layers"] = {COMFY_PREFIX + k: v for k, v in quant["layers"].items()}
            metadata["_quantization_metadata"] = json.dumps(quant)
    if full:
        gen = torch.Generator().manual_seed(seed + 1)
        for name in family.full_extras:
            weights[name] = torch.randn(8, 8, generator=gen).to(torch.float16)
    path = os.path.join(out_dir, tiny_file(variant, dtype=dtype, prefix=prefix, full=full, format=format,
                                           real_depth=real_depth))
    save_file(weights, path, metadata=metadata)
    return path


def tiny_file(variant: str, *, dtype: str = "fp32", prefix: bool = False, full: bool = False,
              format: str = "safetensors", quant: str = "Q8_0", real_depth: bool = False) -> str:
    """The name write_tiny gives the checkpoint of these options (a command checks it before writing)."""
    if format == "gguf":
        return f"tiny-{variant}-{quant}{'-real-depth' if real_depth else ''}.gguf"
    suffix = ("-full" if full else "-prefixed" if prefix else "") + ("" if dtype == "fp32" else f"-{dtype}")
    suffix += "-real-depth" if real_depth else ""
    suffix += f"-{format}" if format != "safetensors" else ""
    return f"tiny-{variant}{suffix}.safetensors"
