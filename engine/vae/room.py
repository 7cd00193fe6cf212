"""Room for a VAE job on a rank's GPU, and what to say when a decode cannot fit.

On the rank, before the job (GPUs only; CPU ranks share the host): the VAE's need (its weights unless the rank keeps
them, its activations as the client's count of the network gives them, engine/vae/cost.py) against the device's free
memory. The transformer models the rank keeps stay where the decode fits beside them, else they go to host memory
(or are dropped where the host has no room), as before a generate job (generate/residency.py decides, run.py moves);
the next generate job brings them back. Where even that leaves too little, every rank stops with one out-of-memory
line naming the figures, before any work.

In the caller, after an out-of-memory failure: the figures and what would fit (more GPUs, or VAE Decode (Tiled), whose
tiles the ranks spread among themselves), priced by the same count.
"""
from __future__ import annotations

import torch

from .cost import Counted, price

GiB = 2 ** 30


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 0.095 else f"{gib * 1024:.1f} MiB"


def make_room(ctx, need_bytes: int) -> BaseException | None:
    """Before a VAE job on a GPU: move the rank's transformer models away where the job's `need_bytes` would not fit
    beside them; an OutOfMemoryError (not raised: every rank stops with it) where it still does not."""
    if ctx.device.type != "cuda" or not need_bytes:
        return None
    from ..generate.residency import RESIDENT_MODELS, Held, decide, host_available_bytes
    from ..generate.run import apply_moves
    from ..models.reader import held_bytes

    def free_now() -> int:
        free = torch.cuda.mem_get_info(ctx.device)[0]
        return free + torch.cuda.memory_reserved(ctx.device) - torch.cuda.memory_allocated(ctx.device)
    models = ctx.cache.get("models", {})
    others = [Held(k, held_bytes(s["loaded"].model), "host" if s.get("offloaded") else "device")
              for k, s in models.items()]
    if others:
        moves = decide(others, device="cuda", need_bytes=need_bytes, free_bytes=free_now(),
                       host_free_bytes=host_available_bytes(), local_ranks=ctx.local_ranks, keep=RESIDENT_MODELS)
        apply_moves(ctx, models, moves)
    free, total = free_now(), torch.cuda.mem_get_info(ctx.device)[1]
    if need_bytes <= free:
        return None
    return torch.OutOfMemoryError(f"{ctx.device} has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB and this VAE "
                                  f"job needs about {need_bytes / GiB:.1f} GiB on it (the count of its network); "
                                  f"nothing was run")


def advice(counted: Counted, ranks: int, device_gib: float | None, tile: Counted | None = None,
           tile_size: int = 0) -> str:
    """What would fit after an out-of-memory decode of `counted` on `ranks` ranks of `device_gib` GiB each: the
    estimate, the fewest ranks whose share fits, and VAE Decode (Tiled) at `tile_size` px when its tile fits."""
    from ..parallel.devices import cpu_hardware
    hw = cpu_hardware(ranks)   # memory only: the shares do not depend on the device's speed
    mine = price(counted, ranks, hw)
    said = [f"the decode needs about {_size(mine.memory_gib)} a rank on {mine.ranks} rank(s) (weights "
            f"{_size(mine.weights_gib)}, activations {_size(mine.activations_gib)})"]
    if device_gib:
        more = next((n for n in range(ranks + 1, 9) if price(counted, n, hw).memory_gib <= 0.9 * device_gib), None)
        if more:
            said.append(f"{more} GPUs would fit it (est. {_size(price(counted, more, hw).memory_gib)} each)")
        if tile is not None and price(tile, 1, hw).memory_gib <= 0.9 * device_gib:
            said.append(f"VAE Decode (Tiled) at tile_size {tile_size} would (est. {_size(price(tile, 1, hw).memory_gib)} "
                        f"a rank, its tiles spread over the ranks; blended tiles, ComfyUI's tiled result)")
    return "; ".join(said)


# ---- in the caller -------------------------------------------------------------------------------------------------
ADVICE_TILE_PX, ADVICE_TILE_FRAMES = 512, 64   # VAE Decode (Tiled)'s defaults (tile_size, temporal_size)


def _counted(info, shape: tuple, op: str, dtype: str) -> Counted:
    from .cost import count
    return count(info.kind, info.widths, tuple(shape), op, dtype)


def job_need(engine, info, shapes: list, op: str, dtype: str, tiles: bool = False) -> dict:
    """The spec entries a rank's make_room reads (GPUs only: nothing for CPU ranks): a rank's activations (a row
    split's share, or the largest tile's whole) and the VAE's weights, in bytes."""
    if getattr(engine, "device", "cpu") != "cuda":
        return {}
    from ..parallel.devices import cpu_hardware
    largest = max(shapes, key=lambda s: torch.Size(s).numel())
    c = _counted(info, largest, op, dtype)
    share = price(c, 1 if tiles else engine.world, cpu_hardware(engine.world))
    return {"need_bytes": int(share.activations_gib * GiB), "weight_bytes": int(c.weight_bytes)}


def out_of_memory(e, engine, info, shape: tuple, op: str, dtype: str, tiles: bool = False):
    """An out-of-memory EngineError of a VAE job with what would fit added (a decode's: more GPUs, or VAE Decode
    (Tiled); a tile pool's (`shape` its largest tile): a smaller tile), in one line."""
    from ..errors import EngineError
    from ..parallel.devices import cpu_hardware
    try:
        c = _counted(info, shape, op, dtype)
        if tiles:
            one = price(c, 1, cpu_hardware(1))
            return EngineError(f"{e}; a tile of {list(shape)} needs about {_size(one.memory_gib)} on its rank "
                               f"(weights {_size(one.weights_gib)}, activations {_size(one.activations_gib)}): a smaller "
                               f"tile_size (or temporal_size) needs less", rank=e.rank, phase=e.phase, oom=True,
                               memory=e.memory)
        tile = None
        if op == "decode" and len(shape) == 5:
            s, t = ADVICE_TILE_PX // info.kind.spatial, (ADVICE_TILE_FRAMES - 1) // info.kind.temporal + 1
            small = shape[:2] + (min(shape[2], t), min(shape[3], s), min(shape[4], s))
            tile = _counted(info, small, op, dtype) if small != tuple(shape) else None
        total = (e.memory or {}).get("device_total_gib")
        said = advice(c, engine.world, total, tile, ADVICE_TILE_PX)
    except Exception as failed:   # the advice never hides the failure itself
        said = f"(what would fit could not be counted: {failed})"
    return EngineError(f"{e}; {said}", rank=e.rank, phase=e.phase, oom=True, memory=e.memory)
