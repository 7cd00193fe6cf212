"""The cost model's fitted constants: where each one lives (the module whose value the model reads), the bounds a fit
keeps it in and why; read and set them together. engine/published/fitting.py fits them to the published rows marked
"fit"."""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    name: str
    module: str              # where the value lives (engine.<module>: parallel.cost, published.video, ...)
    low: float               # the bounds the fit keeps it in, and why
    high: float
    bounds: str


CONSTANTS = (
    Constant("GEMM_HALF_WORK", "parallel.cost", 1e4, 1e7,
             "a GEMM of 1e4 (3 rows of FLUX) to 1e7 (3300 rows) elements at half speed"),
    Constant("ATTN_HALF_KEYS", "parallel.cost", 64.0, 1024.0,
             "a tile's fixed work worth half a key tile to eight tiles of 128"),
    Constant("LAUNCH_US", "parallel.cost", 3.0, 60.0, "eager PyTorch spends ~5-50 us of host time per operation"),
    Constant("COMPILED_LAUNCH_SHARE", "parallel.cost", 0.05, 1.0, "torch.compile leaves at most every launch"),
    Constant("PCIE_A2A_CONTENTION", "parallel.devices", 0.01, 10.0,
             "none to a flow's time ten times over per extra flow"),
    Constant("PCIE_SOCKET_GBS", "parallel.devices", 10.0, 24.0,
             "NCCL's inter-socket figures, Skylake UPI to AMD Zen 3/4"),
    Constant("HUNYUANVIDEO_OUTSIDE_S", "published.video", 10.0, 300.0,
             "10 s to 5 minutes of text encoders and VAE decode for a 129-frame video"),
)


def names() -> tuple[str, ...]:
    return tuple(c.name for c in CONSTANTS)


def _module(c: Constant):
    return importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.{c.module}")   # the engine package's own


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
