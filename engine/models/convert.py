"""Applying a family's key map (engine/families: a list of (diffusers_key, source_key, op) from a single-file layout
to diffusers' names): op is None (take as is), ("chunk", i, sizes) (rows of a fused tensor, e.g. q/k/v out of qkv),
"swap" (shift/scale halves exchanged: BFL/SAI put shift first, diffusers scale first), or "rows:N" (a flat tensor as
its N rows, e.g. Krea 2's six modulation vectors stored as one). The loader streams each source tensor once and
applies the op as a view; a string op to the whole tensor (a rank's rows are taken after it).
"""
from __future__ import annotations

import torch

from ..families.base import Op


def apply_op(t: torch.Tensor, op: Op) -> torch.Tensor:
    if op is None:
        return t
    if op == "swap":
        first, second = t.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    if isinstance(op, str) and op.startswith("rows:"):
        return t.reshape(int(op[len("rows:"):]), -1)
    _, index, sizes = op
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"cannot split {t.shape[0]} rows into {list(sizes)}")
    return torch.split(t, list(sizes), dim=0)[index]


def key_map(info) -> list[tuple[str, str, Op]] | None:
    """The checkpoint's key map (None: its keys are already diffusers keys)."""
    if info.layout in ("diffusers", "synthetic"):
        return None
    return info.spec.key_map(info.layout, info.config)
