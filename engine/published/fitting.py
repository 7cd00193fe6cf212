"""The cost model's fitted constants, fitted together to the published rows marked "fit" (images.py, video.py) and
nowhere else: least squares on log(predicted / published), each constant within stated physical
bounds, by coordinate descent (a golden-section search along one constant at a time, in log space, repeated until no
constant moves). `fit_constants` re-derives them; the values shipped in the modules are its result, rounded.
"""
from __future__ import annotations

import math

from ..parallel.fitted import CONSTANTS, Constant, applied, names, value, values  # noqa: F401 (read through this module too)
from .images import all_scenarios, predicted_s


def fit_rows():
    """(scenario, run) of every row marked fit."""
    return [(s, r) for s in all_scenarios() for r in s.runs if r.fit]


def loss(new: dict[str, float] | None = None) -> float:
    """Sum over the fit rows of log(predicted / published)^2 with the constants at `new` (default: as shipped)."""
    with applied(new or {}):
        return sum(math.log(predicted_s(s, r.plan, r.gpus) / r.seconds) ** 2 for s, r in fit_rows())


GOLDEN = (math.sqrt(5) - 1) / 2


def _line(current: dict, c: Constant, steps: int) -> float:
    """The value of `c` in its bounds that minimises the loss with the others held (golden section in log space;
    the loss is not always unimodal along one constant, so the best of a coarse scan brackets it first)."""
    lo, hi = math.log(max(c.low, 1e-9)), math.log(c.high)
    grid = [lo + (hi - lo) * i / 12 for i in range(13)]
    scores = [loss({**current, c.name: math.exp(x)}) for x in grid]
    i = min(range(13), key=scores.__getitem__)
    a, b = grid[max(0, i - 1)], grid[min(12, i + 1)]
    x1, x2 = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    f1, f2 = loss({**current, c.name: math.exp(x1)}), loss({**current, c.name: math.exp(x2)})
    for _ in range(steps):
        if f1 < f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - GOLDEN * (b - a)
            f1 = loss({**current, c.name: math.exp(x1)})
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + GOLDEN * (b - a)
            f2 = loss({**current, c.name: math.exp(x2)})
    return math.exp((a + b) / 2)


def fit_constants(rounds: int = 6, steps: int = 20, start: dict | None = None) -> dict[str, float]:
    """The constants that minimise `loss`, from `start` (default: the shipped values), each in its bounds. The modules'
    values are left as they were."""
    current = dict(start or values())
    for _ in range(rounds):
        before = dict(current)
        for c in CONSTANTS:
            current[c.name] = _line(current, c, steps)
        if all(abs(current[n] / before[n] - 1) < 1e-3 for n in current):
            break
    return current
