"""The cost model's fitted constants, fitted together to the published rows marked "fit" (published.py,
published_video.py) and nowhere else: least squares on log(predicted / published), each constant within stated physical
bounds, by coordinate descent (a golden-section search along one constant at a time, in log space, repeated until no
constant moves). `fit_constants` re-derives them; the values shipped in the modules are its result, rounded.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    name: str
    module: str              # where the value lives (engine.parallel.<module>)
    low: float               # the bounds the fit keeps it in, and why
    high: float
    bounds: str


CONSTANTS = (
    Constant("GEMM_HALF_WORK", "cost", 1e4, 1e7, "a GEMM of 1e4 (3 rows of FLUX) to 1e7 (3300 rows) elements at half "
                                                 "speed"),
    Constant("ATTN_HALF_KEYS", "cost", 64.0, 1024.0, "a tile's fixed work worth half a key tile to eight tiles of 128"),
    Constant("LAUNCH_US", "cost", 3.0, 60.0, "eager PyTorch spends ~5-50 us of host time per operation"),
    Constant("COMPILED_LAUNCH_SHARE", "cost", 0.05, 1.0, "torch.compile leaves at most every launch"),
    Constant("PCIE_A2A_CONTENTION", "devices", 0.01, 10.0, "none to a flow's time ten times over per extra flow"),
    Constant("PCIE_SOCKET_GBS", "devices", 10.0, 24.0, "NCCL's inter-socket figures, Skylake UPI to AMD Zen 3/4"),
    Constant("HUNYUANVIDEO_OUTSIDE_S", "published_video", 10.0, 300.0, "10 s to 5 minutes of text encoders and "
                                                                          "VAE decode for a 129-frame video"),
)


def names() -> tuple[str, ...]:
    return tuple(c.name for c in CONSTANTS)


def _module(c: Constant):
    return importlib.import_module(f"engine.parallel.{c.module}")


def value(name: str) -> float:
    c = next(c for c in CONSTANTS if c.name == name)
    return getattr(_module(c), name)


def values() -> dict[str, float]:
    return {c.name: value(c.name) for c in CONSTANTS}


@contextlib.contextmanager
def applied(new: dict[str, float]):
    """The constants set to `new` for the duration (the modules' values restored after)."""
    from . import memory
    saved = values()
    try:
        for c in CONSTANTS:
            if c.name in new:
                setattr(_module(c), c.name, new[c.name])
        yield
    finally:
        for c in CONSTANTS:
            setattr(_module(c), c.name, saved[c.name])
        memory.stage_memory_gib.cache_clear()


def fit_rows():
    """(scenario, run) of every row marked fit."""
    from .published import all_scenarios
    return [(s, r) for s in all_scenarios() for r in s.runs if r.fit]


def loss(new: dict[str, float] | None = None) -> float:
    """Sum over the fit rows of log(predicted / published)^2 with the constants at `new` (default: as shipped)."""
    from .published import predicted_s
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
