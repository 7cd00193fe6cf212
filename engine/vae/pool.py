"""A pool of whole pieces on the engine's ranks, for a VAE that is tiled by definition (MiniMax-H3: vae.plan lays out
its (clip, tile) pieces): the pieces assigned deterministically, largest first, each to the rank with the least work
so far (LPT; equal pieces go round robin), each computed by its rank with the unsplit network and returned raw; the
caller blends them (the VAE module's `assemble`, ComfyUI's own order). No collective inside a piece; the ranks meet
only at the cancel checks, one a round (a round: every rank's next piece)."""
from __future__ import annotations

import torch


def assign(costs: list[int], ranks: int) -> list[list[int]]:
    """Each rank's pieces (indices into `costs`, in the order it computes them): longest processing time first, ties
    to the lower index and the lower rank; every rank's list in ascending piece order."""
    load, mine = [0] * ranks, [[] for _ in range(ranks)]
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        load[r] += costs[k]
        mine[r].append(k)
    return [sorted(m) for m in mine]


def rounds(plan, ranks: int) -> int:
    """The cancel checks of a job: the most pieces any rank computes."""
    return max(len(m) for m in assign([p.cost for p in plan.pieces], ranks))


def run_pool(ctx, model, x: torch.Tensor, op: str, on_chunk) -> dict[str, torch.Tensor]:
    """This rank's pieces of `op` on `x` (every rank holds all of x in host memory; each piece goes to the device as
    it is computed): {"piece.<k>": raw piece}."""
    plan = model.plan(op, tuple(x.shape))
    mine = assign([p.cost for p in plan.pieces], ctx.world)
    total = max(len(m) for m in mine)
    out = {}
    with torch.inference_mode():
        for i in range(total):
            if i < len(mine[ctx.rank]):
                k = mine[ctx.rank][i]
                out[f"piece.{k}"] = model.piece(x, plan, k).contiguous()
            on_chunk(i, total)
    ctx.info["vae"] = {"pieces": mine[ctx.rank], "of": len(plan.pieces), "chunks": total, "memory": ctx.memory()}
    return out
