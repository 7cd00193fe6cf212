"""`python -m engine make-tiny`: write a tiny random-weight checkpoint in a ComfyUI layout and a conditioning file
`generate --cond` reads for it, and say what the model takes."""
from __future__ import annotations

import os
import shlex
from argparse import ArgumentTypeError

from safetensors.torch import save

from ..models.load import inspect_model
from ..models.quantized import SUPPORTED
from .. import families
from ..models.tiny import DTYPES, FORMATS, tiny_file, variants, write_tiny
from ..vae import load as vae_load
from . import args as types
from . import describe, output
from .args import UsageError

SIDE = 128    # the image side the conditioning file is made for (an image-to-video model's image latent has a size)
STEPS = 4     # the steps of the generate command printed


VAE_PREFIX = "vae-"   # --kind vae-wan2.1: a VAE file, not a model


class VaeKind(str):
    """--kind's value when it names a VAE (vae-wan2.1): the VAE kind's name."""


def kind(text: str):
    """Any name of a model (families.resolve): a family (flux, ltx23) or a variant or alias of one (ltx-2.3); or a
    VAE, vae-<kind> (engine/vae/load.py's kinds)."""
    key = text.strip().lower()
    if key.startswith(VAE_PREFIX):
        if key[len(VAE_PREFIX):] not in vae_load.NAMES:
            raise ArgumentTypeError(f"{text!r} is not a VAE make-tiny writes: use "
                                    f"{' or '.join(VAE_PREFIX + n for n in sorted(vae_load.NAMES))}")
        return VaeKind(key[len(VAE_PREFIX):])
    try:
        return families.resolve(text)
    except ValueError as e:
        raise ArgumentTypeError(str(e)) from None


def register(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny synthetic checkpoint in a real ComfyUI layout",
                       description="Write a deterministic random-weight checkpoint of a model family in the layout "
                                   "its released files have (e.g. FLUX.1: BFL, SD3/SD3.5: SAI MMDiT) with 4 heads and "
                                   "4 blocks of each kind, and print its dimensions and the conditioning it takes.")
    p.add_argument("--kind", type=kind, required=True, metavar="NAME",
                   help=f"model family ({', '.join(families.names())}) or one of its variants, by any of its names "
                        f"(e.g. ltx23 or ltx-2.3); or a VAE with ComfyUI's key names: "
                        f"{', '.join(VAE_PREFIX + n for n in sorted(vae_load.NAMES))}")
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


def _variant(a) -> tuple[str, str]:
    """(family name, variant) from --kind and --variant, the variant by its canonical name (the family's first when
    neither names one; a name no family has is passed on, for write_tiny to name the family's variants)."""
    family, chosen = a.kind
    if a.variant is None:
        return family.name, chosen or family.variants[0]
    try:
        other, given = families.resolve(a.variant)
    except ValueError:
        return family.name, a.variant
    if other is not family:
        raise UsageError(f"argument --variant: {a.variant} is {other.title}, not {family.title} as --kind says: give "
                         f"a {family.name} variant ({', '.join(variants(family.name))}), or leave out --variant")
    if given is None:
        raise UsageError(f"argument --variant: {a.variant} names the {family.title} family, not one of its models: "
                         f"give one of {', '.join(variants(family.name))}")
    if chosen is not None and given != chosen:
        raise UsageError(f"argument --variant: {a.variant} contradicts --kind, which names {chosen}: leave out one "
                         f"of them")
    return family.name, given


def _check(folder: str, name: str, a) -> None:
    """A file make-tiny writes in --out: never one that is not a regular file (as generate's --out), nor an input."""
    path = os.path.join(folder, name)
    what = output.special_kind(os.path.realpath(path))
    if what:
        raise UsageError(f"argument --out: {path} is {what}, which make-tiny never replaces: remove it or write "
                         f"elsewhere")
    output.refuse_inputs("--out", path, a)


def run(a) -> int:
    if isinstance(a.kind, VaeKind):
        return _run_vae(a)
    if a.quant and a.format != "gguf":   # it would be ignored: a safetensors file has no GGUF types
        raise UsageError(f"argument --quant: {a.quant} applies to GGUF files only and the format is {a.format}: add "
                         f"--format gguf, or leave out --quant")
    kind_name, variant = _variant(a)
    quant = a.quant or "Q8_0"
    if variant in variants(kind_name):   # the files it writes, checked before either is written
        name = tiny_file(variant, dtype=a.dtype, prefix=a.prefix, full=a.full, format=a.format, quant=quant)
        _check(a.out, name, a)
        _check(a.out, _cond_name(name), a)
    try:
        path = write_tiny(kind_name, a.out, variant=variant, dtype=a.dtype, seed=a.seed, prefix=a.prefix,
                          full=a.full, format=a.format, quant=quant)
    except ValueError as e:  # a variant of another kind, or options the format does not take
        raise UsageError(f"argument --{'variant' if 'variant' in str(e) else 'format'}: {e}") from None
    except OSError as e:   # what no check foresees (a name too long, the disk full): nothing else was written
        raise UsageError(f"argument --out: could not write in {a.out} ({e.strerror or e}); write elsewhere") from None
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
    if info.spec.packed_streams:   # generate refuses these: a conditioning file would serve nothing
        print(f"cond    none: generate does not sample {info.spec.title}'s audio and video together; ComfyUI's "
              f"KSampler on the xDiT Engine's MODEL does")
        return 0
    tensors = describe.conditioning_file(info, SIDE, SIDE, seed=a.seed)
    cond = output.write(os.path.join(os.path.dirname(path), _cond_name(os.path.basename(path))), save(tensors))
    print(f"cond    {cond} (random: " + ", ".join(f"{k} {list(t.shape)}" for k, t in tensors.items())
          + (f"; the image latent is {SIDE}x{SIDE} px's" if "concat_latent_image" in tensors else "") + ")")
    latent = os.path.join(os.path.dirname(path), f"{os.path.splitext(os.path.basename(path))[0]}-latent.safetensors")
    print("try     " + " ".join(shlex.quote(w) for w in (
        "python", "-m", "engine", "generate", "--model", path, "--cond", cond, "--out", latent, "--width", str(SIDE),
        "--height", str(SIDE), "--steps", str(STEPS))))
    return 0


def _cond_name(model_name: str) -> str:
    """The conditioning file beside a tiny checkpoint: tiny-flux-dev.safetensors -> tiny-flux-dev-cond.safetensors."""
    return f"{os.path.splitext(model_name)[0]}-cond.safetensors"


def _run_vae(a) -> int:
    """make-tiny --kind vae-<kind>: a tiny VAE file of ComfyUI's key names (engine/vae/load.py), for ComfyUI's
    models/vae and the engine's VAE jobs."""
    given = [flag for flag, value in (("--variant", a.variant), ("--prefix", a.prefix), ("--full", a.full),
                                      ("--quant", a.quant), ("--format", a.format != "safetensors" and a.format))
             if value]
    if given:
        raise UsageError(f"argument {given[0]}: applies to model files, and --kind {VAE_PREFIX}{a.kind} writes a VAE "
                         f"file: leave it out")
    if a.dtype not in vae_load.DTYPES:
        raise UsageError(f"argument --dtype: a VAE file is written in {', '.join(vae_load.DTYPES)}, not {a.dtype}")
    name = vae_load.tiny_vae_file(a.kind)
    _check(a.out, name, a)
    try:
        path = vae_load.write_tiny_vae(a.kind, a.out, seed=a.seed, dtype=a.dtype)
    except OSError as e:
        raise UsageError(f"argument --out: could not write in {a.out} ({e.strerror or e}); write elsewhere") from None
    info = vae_load.inspect_vae(path)
    s = info.kind.spatial
    print(f"wrote   {path} ({os.path.getsize(path) / 2**20:.1f} MiB, {a.dtype} weights)")
    widths = {k: "the header's" if isinstance(v, dict) else v for k, v in info.widths.items()}   # LTX: its config
    print(f"vae     {info.kind.title}: widths {widths}")
    if info.kind.latent_dim == 2:
        print(f"latent  [batch, {info.latent_channels}, height / {s}, width / {s}] (an image's)")
        return 0
    frames = 2 * info.kind.temporal + 1
    print(f"latent  [batch, {info.latent_channels}, frames, height / {s}, width / {s}]; a clip of {frames} frames "
          f"encodes to {info.encoded_shape((1, 3, frames, s, s))[2]} latent frames")
    return 0
