"""The engine's VAE jobs on the ranks: `vae_decode` and `vae_encode` (each rank computes its band of rows of every
frame and returns it; the client puts the bands together; a VAE tiled by definition, MiniMax-H3's, runs as a pool of
whole pieces instead, pool.py), and `vae_layer` (one row layer on each rank's band, what
the layers' own tests and benchmarks run). Registered in engine/runtime/jobs.py.

A rank keeps the VAEs it loaded (ctx.cache, keyed by file, mtime and dtype; the last VAES_KEPT) between jobs. The
frame is split in latent rows, as evenly as possible; a latent of fewer rows than ranks runs on that many (the first
ones), the others idle through the job's cancel checks. Progress is reported after each temporal chunk, where the ranks
also agree on a cancel (ctx.check_cancel, as the generate job does at its steps).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
import torch.distributed as dist

from .layers import (CausalConv3d, RowConv2d, RowDownConv2d, RowGroupNorm, RowSplit, bind, gathered_attention,
                     split_rows)
from .load import inspect_vae, load_vae
from .room import make_room

VAES_KEPT = 2


def row_split(ctx, total_rows: int, rows: list[int] | None = None) -> RowSplit | None:
    """This rank's band of a frame of `total_rows` rows (or of the given `rows` per rank), on the first
    min(world, total_rows) ranks; None for a rank that idles. A group of fewer ranks than the engine's is made once
    (a collective of every rank) and kept."""
    members = len(rows) if rows else min(ctx.world, total_rows)
    rows = tuple(rows) if rows else split_rows(total_rows, members)
    if members == ctx.world:
        group = ctx.group
    else:
        groups = ctx.cache.setdefault("vae_groups", {})
        if members not in groups:
            groups[members] = dist.new_group(list(range(members))) if members > 1 else None
        group = groups[members]
    if ctx.rank >= members:
        return None
    return RowSplit(ctx.rank, rows, tuple(range(members)), group if members > 1 else None)


def _band(x: torch.Tensor, split: RowSplit, scale: int) -> torch.Tensor:
    """This rank's rows of `x` (rows at dim -2), the split's rows times `scale`."""
    return x.narrow(-2, split.start * scale, split.rows[split.index] * scale)


def kept_vae(ctx, spec: dict) -> torch.nn.Module:
    """The VAE of the job, loaded once and kept (the last VAES_KEPT; a checkpoint's VAE keyed by its key prefix
    too)."""
    vaes = ctx.cache.setdefault("vaes", OrderedDict())
    key = (spec["path"], spec["mtime_ns"], spec["dtype"], spec.get("prefix", ""))
    need = spec.get("need_bytes", 0)
    if key in vaes:
        vaes.move_to_end(key)
        ctx.info["vae_source"] = "resident"
        # every rank agrees here, whether it holds the VAE or loads it (after a failed load some ranks keep theirs)
        ctx.stop_here(failure=make_room(ctx, need))
        return vaes[key]
    failure, model = make_room(ctx, need + spec.get("weight_bytes", 0)), None
    try:
        if failure is not None:
            raise failure
        info = inspect_vae(spec["path"], spec.get("prefix", ""))
        if info.mtime_ns != spec["mtime_ns"]:
            raise RuntimeError(f"{os.path.basename(spec['path'])} changed after the job was sent; send it again")
        ctx.enter_phase("load", bytes=os.path.getsize(spec["path"]))
        model = load_vae(info, spec["dtype"], ctx.device)
        ctx.enter_phase("compute")
    except Exception as e:   # every rank stops with it (stop_here), keeping what it holds
        failure = e
    if model is not None:   # kept before the agreement: a rank whose load succeeded keeps it if another's failed
        while len(vaes) >= VAES_KEPT:
            vaes.popitem(last=False)
        vaes[key] = model
    ctx.stop_here(failure=failure)
    ctx.info["vae_source"] = "file"
    return model


def run_vae(ctx, spec: dict, inputs: dict[str, torch.Tensor], op: str) -> dict[str, torch.Tensor] | None:
    """decode (inputs["latent"]) or encode (inputs["pixels"]) of the file's VAE: this rank's band of the result."""
    ctx.reset_peak_memory()
    model = kept_vae(ctx, spec)
    x = inputs["latent" if op == "decode" else "pixels"]
    if getattr(model, "pool", False):   # tiled by definition (MiniMax-H3): whole pieces, not bands
        from .pool import run_pool
        ctx.check_cancel(0)
        return run_pool(ctx, model, x, op, lambda i, total: (ctx.progress(i + 1, total), ctx.check_cancel(i + 1)))
    scale = 1 if op == "decode" else model.spatial
    split = row_split(ctx, x.shape[-2] // scale)
    frames = x.shape[2]
    chunks = model.decode_chunks(frames) if op == "decode" else model.encode_chunks(frames)

    def on_chunk(i: int, total: int) -> None:
        ctx.progress(i + 1, total)
        ctx.check_cancel(i + 1)

    ctx.check_cancel(0)
    if split is None:   # idle: in step with the working ranks' cancel checks
        for i in range(chunks):
            ctx.check_cancel(i + 1)
        ctx.info["vae"] = {"idle": True}
        return None
    bind(model, split, attention=spec.get("attention") or ("sdpa" if ctx.device.type == "cuda" else "split"))
    band = _band(x, split, scale).to(ctx.device, non_blocking=True)
    extra = {}   # LTX: the decode noise the caller drew (its band), the byte-sized chunks' size
    if "noise" in inputs:
        extra["noise"] = _band(inputs["noise"], split, 1).to(ctx.device, non_blocking=True)
    if "chunk_bytes" in spec:
        extra["chunk_bytes"] = spec["chunk_bytes"]
    with torch.inference_mode():
        out = model.decode(band, on_chunk, **extra) if op == "decode" else model.encode(band, on_chunk)
    ctx.info["vae"] = {"rows": list(split.rows), "index": split.index, "chunks": chunks, "sent": dict(split.sent),
                       "memory": ctx.memory()}
    return {f"rows.{split.index}": out.contiguous()}


def run_layer(ctx, spec: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """One row layer on this rank's band of inputs["x"] (rows at dim -2 split as spec["rows"] says): conv2d, down2d,
    causal3d (chunk by chunk over spec["chunks"] frames, the caches as wan.causal keeps them), groupnorm, attention
    (inputs q, k, v). The layers' tests compare the bands put together with the unsplit torch op."""
    from .wan import causal
    split = row_split(ctx, 0, spec["rows"])
    x = inputs["x"]
    if split is None:
        return None
    band = _band(x, split, 1).to(ctx.device)
    layer, weight, bias = spec["layer"], inputs.get("weight"), inputs.get("bias")
    k = tuple(weight.shape[2:]) if weight is not None else ()
    if layer == "conv2d":
        m = RowConv2d(weight.shape[1], weight.shape[0], k, padding=spec["padding"], padding_mode=spec["mode"])
    elif layer == "down2d":
        m = RowDownConv2d(weight.shape[1], weight.shape[0], k, stride=2)
    elif layer == "causal3d":
        m = CausalConv3d(weight.shape[1], weight.shape[0], k, padding=spec["padding"])
    elif layer == "groupnorm":
        m = RowGroupNorm(spec["groups"], x.shape[1], eps=spec["eps"], per_frame=spec["per_frame"])
    elif layer != "attention":
        raise ValueError(f"vae_layer: layer {layer!r} is unknown")
    with torch.inference_mode():
        if layer == "attention":
            q, kk, v = (_band(inputs[n], split, 1).to(ctx.device) for n in ("q", "k", "v"))
            out = gathered_attention(q, kk, v, split, spec.get("kernel", "split"))
        else:
            m.load_state_dict({"weight": weight, "bias": bias})
            bind(m.to(ctx.device), split)
            if layer == "causal3d":
                cache, pieces, first = {}, [], 0
                for n in spec["chunks"]:
                    pieces.append(causal(m, band[:, :, first:first + n], cache))
                    first += n
                out = torch.cat(pieces, 2)
            else:
                out = m(band)
    ctx.info["sent"] = dict(split.sent)
    return {f"rows.{split.index}": out.contiguous()}
