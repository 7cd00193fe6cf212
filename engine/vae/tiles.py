"""The tile pool: many whole tiles of one VAE decode or encode (VAE Decode (Tiled) / VAE Encode (Tiled)'s tiles, as
ComfyUI's tiler cuts them) handed to the engine in one job (`vae_tiles`), each rank computing whole tiles with the
unsplit network, the raw results returned in the order given. The caller blends them (ComfyUI's own tiler does, in its
own order: xdit_nodes/vae.py TilePool), so the result is ComfyUI's tiled result computed by the ranks' networks.

Tiles go to ranks by longest-processing-time on their volume (ties: the earlier tile to the lower rank), fixed by
the client so every rank reads the same assignment. The ranks go through their tiles in rounds, agreeing on a cancel
after each (a rank with fewer tiles idles through the rest), and report progress by rounds.

    from engine.vae import tiles
    outs = tiles.run(engine, "decode", "wan_2.1_vae.safetensors", [tile0, tile1, ...], "bf16")[0]
"""
from __future__ import annotations

import heapq
import math

import torch

from ..errors import EngineError
from . import room
from .layers import ATTENTION, bind
from .load import DTYPES, VAEInputError, dtype_name, inspect_vae


def assign(volumes: list[int], ranks: int) -> list[int]:
    """The rank of each tile: the largest tiles first, each to the rank with the least work so far (the lowest rank
    on a tie); tiles of equal volume keep their order."""
    load = [(0, r) for r in range(ranks)]
    owners = [0] * len(volumes)
    for i in sorted(range(len(volumes)), key=lambda i: (-volumes[i], i)):
        work, rank = heapq.heappop(load)
        owners[i] = rank
        heapq.heappush(load, (work + volumes[i], rank))
    return owners


def rounds(owners: list[int], ranks: int) -> int:
    """How many rounds the busiest rank runs (each rank one of its tiles a round)."""
    return max([owners.count(r) for r in range(ranks)] or [0])


# ---- on the ranks ------------------------------------------------------------------------------------------------
def run_pool(ctx, spec: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """This rank's tiles of the job, each through the whole network on this rank (no collective inside a tile)."""
    from .job import kept_vae
    ctx.reset_peak_memory()
    model = kept_vae(ctx, spec)
    op, owners = spec["op"], spec["owners"]
    mine = [i for i, owner in enumerate(owners) if owner == ctx.rank]
    total = rounds(owners, ctx.world)
    bind(model, None, attention=spec.get("attention") or ("sdpa" if ctx.device.type == "cuda" else "split"))
    out = {}
    ctx.check_cancel(0)
    for r in range(total):
        if r < len(mine):
            i = mine[r]
            x = inputs[f"tile.{i}"].to(ctx.device, non_blocking=True)
            with torch.inference_mode():
                y = model.decode(x) if op == "decode" else model.encode(x)
            out[f"tile.{i}"] = y.to("cpu").contiguous()   # held in host memory until the job returns
        ctx.progress(r + 1, total)
        ctx.check_cancel(r + 1)
    ctx.info["vae"] = {"tiles": mine, "rounds": total, "memory": ctx.memory()}
    return out or None


# ---- from the caller's process -----------------------------------------------------------------------------------
def run(engine, op: str, path: str, tiles: list[torch.Tensor], dtype="fp32", *, prefix: str = "",
        attention: str | None = None, on_progress=None, should_cancel=None, deadlines=None):
    """(the results of `op` on each tile, in the tiles' order, the JobResult): every tile [B, C, T, H, W] checked
    against the VAE before any rank starts (one line naming the tile), all sent in one job."""
    if op not in ("decode", "encode"):
        raise ValueError(f"VAE job {op!r} is not decode or encode")
    if not tiles:
        raise ValueError("the tile pool got no tiles")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
    info = inspect_vae(path, prefix)
    dtype = dtype_name(dtype)
    shapes = []
    for i, t in enumerate(tiles):
        try:
            (info.check_latent if op == "decode" else info.check_pixels)(t.shape)
        except VAEInputError as e:
            raise VAEInputError(f"tile {i} of {len(tiles)}: {e}") from None
        shapes.append(info.decoded_shape(tuple(t.shape)) if op == "decode" else info.encoded_shape(tuple(t.shape)))
    owners = assign([t.numel() for t in tiles], engine.world)
    spec = {"path": info.path, "mtime_ns": info.mtime_ns, "dtype": dtype, "op": op, "owners": owners}
    if prefix:
        spec["prefix"] = prefix
    if attention is not None:
        spec["attention"] = attention
    spec.update(room.job_need(engine, info, [tuple(t.shape) for t in tiles], op, dtype, tiles=True))
    inputs = {f"tile.{i}": t.detach().to("cpu", DTYPES[dtype]).contiguous() for i, t in enumerate(tiles)}
    try:
        result = engine.submit("vae_tiles", spec, inputs, on_progress=on_progress, should_cancel=should_cancel,
                               deadlines=deadlines,
                               output_bytes=sum(math.prod(s) for s in shapes) * DTYPES[dtype].itemsize)
    except EngineError as e:
        if not e.oom:
            raise
        largest = max((tuple(t.shape) for t in tiles), key=math.prod)
        raise room.out_of_memory(e, engine, info, largest, op, dtype, tiles=True) from e
    outs = []
    for i, shape in enumerate(shapes):
        y = result.outputs.get(f"tile.{i}")
        if y is None or tuple(y.shape) != shape:
            raise EngineError(f"job {result.job_id}: tile {i} came back as "
                              f"{'nothing' if y is None else list(y.shape)}, expected {list(shape)}")
        outs.append(y)
    return outs, result
