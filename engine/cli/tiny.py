"""`python -m engine make-tiny`: write a tiny random-weight checkpoint in a ComfyUI layout, and say what it takes."""
from __future__ import annotations

import os

from ..models.load import inspect_model
from ..models.quantized import SUPPORTED
from .. import families
from ..models.tiny import DTYPES, FORMATS, variants, write_tiny
from . import args as types
from . import describe
from .args import UsageError


def register(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny synthetic checkpoint in a real ComfyUI layout",
                       description="Write a deterministic random-weight checkpoint of a model family in the layout "
                                   "its released files have (e.g. FLUX.1: BFL, SD3/SD3.5: SAI MMDiT) with 4 heads and "
                                   "4 blocks of each kind, and print its dimensions and the conditioning it takes.")
    p.add_argument("--kind", choices=list(families.names()), required=True, help="model family")
    p.add_argument("--variant", help="; ".join(
        f"{k}: {' | '.join(variants(k) + tuple(families.get(k).variant_aliases))}" for k in families.names())
        + " (default: the first of the kind)")
    p.add_argument("--out", type=types.output_dir, required=True, help="folder to write into (created if missing)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weight dtype")
    p.add_argument("--seed", type=types.seed, default=0, help="weight seed")
    p.add_argument("--prefix", action="store_true", help="prefix keys with model.diffusion_model.")
    p.add_argument("--full", action="store_true", help="full checkpoint: prefix + text encoder / VAE keys")
    p.add_argument("--format", default="safetensors", choices=list(FORMATS),
                   help="safetensors (in --dtype); fp8_scaled: fp8 matrices with a scale_weight each, as ComfyUI's "
                        "fp8_scaled releases; fp8_mixed: the blocks' matrices fp8 with a weight_scale, the rest bf16, "
                        "as ComfyUI's mixed-precision releases (e.g. fp8mixed); int8_convrot: the blocks' matrices "
                        "int8_tensorwise, ConvRot-rotated, with a per-row weight_scale, the rest bf16, as Comfy-Org's "
                        "MiniMax-H3 *_int8_convrot releases; int8: the same without the rotation; gguf: as "
                        "ComfyUI-GGUF's files, matrices in --quant")
    p.add_argument("--quant", choices=list(SUPPORTED),
                   help="with --format gguf: GGUF type of the matrices (default Q8_0; vectors stay F32; a matrix whose "
                        "rows are not whole blocks of the type falls back to Q8_0)")
    p.set_defaults(run=run, parser=p)


def run(a) -> int:
    if a.quant and a.format != "gguf":   # it would be ignored: a safetensors file has no GGUF types
        raise UsageError(f"argument --quant: {a.quant} applies to GGUF files only and the format is {a.format}: add "
                         f"--format gguf, or leave out --quant")
    try:
        path = write_tiny(a.kind, a.out, variant=a.variant, dtype=a.dtype, seed=a.seed, prefix=a.prefix, full=a.full,
                          format=a.format, quant=a.quant or "Q8_0")
    except ValueError as e:  # a variant of another kind, or options the format does not take
        raise UsageError(f"argument --{'variant' if 'variant' in str(e) else 'format'}: {e}") from None
    info = inspect_model(path)
    weights = {"safetensors": f"{a.dtype} weights", "fp8_scaled": "fp8_scaled weights",
               "fp8_mixed": "ComfyUI mixed-precision fp8 weights",
               "int8": f"ComfyUI int8_tensorwise weights: {info.quantization}",
               "int8_convrot": f"ComfyUI int8_tensorwise weights: {info.quantization}",
               "gguf": f"GGUF: {info.quantization}"}[a.format]
    print(f"wrote   {path} ({os.path.getsize(path) / 2**20:.1f} MiB, {weights})")
    print(f"model   {describe.summary(info)}")
    print(f"takes   {describe.conditioning(info)}")
    print(f"latent  {describe.latent_rule(info)}")
    return 0
