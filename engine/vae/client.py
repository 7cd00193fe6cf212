"""A VAE decode or encode on an engine's ranks, from the caller's process: the file and the latent (or clip) checked
against each other before any rank starts (one line naming what does not belong), the job sent, the ranks' bands of
rows put together in the frame's order.

    from engine.vae import client
    frames = client.decode(engine, "wan_2.1_vae.safetensors", latent, "bf16")    # [B, 3, 4T-3, 8H, 8W]
    latent = client.encode(engine, "wan_2.1_vae.safetensors", pixels, "bf16")    # pixels [B, 3, T, H, W] in [-1, 1]

The result is the raw network output in the compute dtype (ComfyUI's VAE then casts it to float32 and maps it to
[0, 1]: its process_output, comfy/sd.py:1246-1251)."""
from __future__ import annotations

import math

import torch
from safetensors import safe_open

from ..errors import EngineError
from .layers import ATTENTION
from . import room
from .load import DTYPES, VAEInputError, dtype_name, inspect_vae


def run(engine, op: str, path: str, x: torch.Tensor, dtype="fp32", *, prefix: str = "", attention: str | None = None,
        noise: torch.Tensor | None = None, chunk_bytes: int | None = None, on_progress=None, should_cancel=None,
        deadlines=None):
    """(the result, the JobResult) of `op` ("decode" or "encode") of `x` by the VAE in `path` (a checkpoint's: the
    tensors named with `prefix`), computed in `dtype` (fp32, bf16, fp16 or the torch dtype); attention: ComfyUI's VAE
    attention kernel to match ("split" or "sdpa"; default: the ranks' device's, as ComfyUI's); noise: for a VAE whose
    decode mixes in noise (LTX's timestep-conditioned decoders), the noise as ComfyUI draws it (torch.randn_like of the
    latent on its VAE's device, in its dtype); chunk_bytes: the size of LTX's temporal chunks (default ComfyUI's 128
    MiB). A VAE tiled by definition (MiniMax-H3) returns ComfyUI's finished result: float32 frames in [0, 1], or the
    normalized latent."""
    if op not in ("decode", "encode"):
        raise ValueError(f"VAE job {op!r} is not decode or encode")
    name = "latent" if op == "decode" else "pixels"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise VAEInputError(f"{name}: {type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype} is not a "
                            f"floating-point tensor")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
    info = inspect_vae(path, prefix)
    dtype = dtype_name(dtype)
    if op == "decode":
        info.check_latent(x.shape)
        shape = info.decoded_shape(tuple(x.shape))
    else:
        info.check_pixels(x.shape)
        shape = info.encoded_shape(tuple(x.shape))
    inputs = {name: x.detach().to("cpu", DTYPES[dtype]).contiguous()}
    if op == "decode" and (noise is not None or info.decode_noise):
        if not info.decode_noise or noise is None or tuple(noise.shape) != tuple(x.shape):
            raise VAEInputError(f"noise: {'none' if noise is None else list(noise.shape)} given; {info.describe()} "
                                f"{'mixes noise into' if info.decode_noise else 'takes no noise for'} its decode"
                                + (f": give torch.randn_like of the latent ({list(x.shape)}), drawn as ComfyUI draws "
                                   f"it" if info.decode_noise else ""))
        inputs["noise"] = noise.detach().to("cpu", DTYPES[dtype]).contiguous()
    spec = {"path": info.path, "mtime_ns": info.mtime_ns, "dtype": dtype}
    if prefix:
        spec["prefix"] = prefix
    if attention is not None:
        spec["attention"] = attention
    if chunk_bytes is not None:
        spec["chunk_bytes"] = int(chunk_bytes)
    pool = info.kind.pool() if info.kind.pool else None
    plan = pool.plan(op, tuple(x.shape)) if pool else None
    output_bytes = (sum(math.prod(p.out_shape) for p in plan.pieces) if pool else math.prod(shape)) * \
        DTYPES[dtype].itemsize
    spec.update(room.job_need(engine, info, [tuple(x.shape)], op, dtype))
    try:
        result = engine.submit(f"vae_{op}", spec, inputs, on_progress=on_progress, should_cancel=should_cancel,
                               deadlines=deadlines, output_bytes=output_bytes)
    except EngineError as e:
        if not e.oom:
            raise
        raise room.out_of_memory(e, engine, info, tuple(x.shape), op, dtype) from e
    if pool:
        return _assemble(pool, plan, info, dtype, result, shape), result
    bands = [result.outputs[f"rows.{i}"] for i in range(len(result.outputs))]
    if not bands or any(f"rows.{i}" not in result.outputs for i in range(len(bands))):
        raise EngineError(f"job {result.job_id}: the ranks returned {sorted(result.outputs)}, not every band of rows")
    out = torch.cat(bands, -2) if len(bands) > 1 else bands[0]
    if tuple(out.shape) != shape:
        raise EngineError(f"job {result.job_id}: the ranks' {op} is {list(out.shape)}, expected {list(shape)}")
    return out, result


def decode(engine, path: str, latent: torch.Tensor, dtype="fp32", **kw) -> torch.Tensor:
    """The VAE's decode of `latent` [B, C, T, H, W] on the engine's ranks (see run)."""
    return run(engine, "decode", path, latent, dtype, **kw)[0]


def encode(engine, path: str, pixels: torch.Tensor, dtype="fp32", **kw) -> torch.Tensor:
    """The VAE's encode (the latent mean) of `pixels` [B, C, T, H, W] in [-1, 1] on the engine's ranks (see run)."""
    return run(engine, "encode", path, pixels, dtype, **kw)[0]


def _assemble(pool, plan, info, dtype: str, result, shape: tuple) -> torch.Tensor:
    """The ranks' raw pieces blended in ComfyUI's order (the VAE module's assemble)."""
    missing = [k for k in range(len(plan.pieces)) if f"piece.{k}" not in result.outputs]
    if missing:
        raise EngineError(f"job {result.job_id}: the ranks returned {len(result.outputs)} of {len(plan.pieces)} "
                          f"pieces (piece {missing[0]} missing)")
    stats = None
    if plan.op == "encode":
        with safe_open(info.path, "pt", device="cpu") as f:
            stats = tuple(f.get_tensor(info.prefix + k).to(DTYPES[dtype]) for k in ("latents_mean", "latents_std"))
    out = pool.assemble(plan, [result.outputs[f"piece.{k}"] for k in range(len(plan.pieces))], stats)
    if tuple(out.shape) != shape:
        raise EngineError(f"job {result.job_id}: the ranks' {plan.op} is {list(out.shape)}, expected {list(shape)}")
    return out
