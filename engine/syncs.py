"""Host synchronisations in a rank's step loop, counted per step (a test instrument, armed by `XDIT_HOST_SYNCS` in the
rank's environment; without it every call here is a no-op, as with faults.py).

On a GPU the host launches work and runs ahead of the device; a step loop that makes the host wait for the device
per layer, patch or model call leaves the device idle while Python launches the next kernels. CPU ranks have no
device, so the instrument models one: a tensor made on the host (a factory without a device, torch.tensor from
Python data, a copy to the CPU) is a host tensor, and so is whatever is computed from host tensors alone; every
other tensor lives on the "device". It counts, per step of the loop:
  read    a device tensor's value taken to the host: .item(), .tolist(), bool()/int()/float()/index use, .cpu(),
          .numpy(), a blocking copy into a host tensor (on a GPU each drains the device's queue);
  upload  a host tensor of more than one element moved to the device or used by an op on device tensors (an index,
          a position table): on a GPU a blocking copy from pageable memory, which also drains the queue;
  wait    the host blocking on a transfer: a wait with a timeout, a poll that found the work unfinished, a barrier,
          torch.cuda.synchronize (a wait without a timeout is ordered on the device's stream by NCCL: the host goes on);
  deferred  a value read through `Deferred`, queued a model call or step earlier (so on a GPU it is long done): the
          step cache's agreed change and nothing else; reported, not a sync.
Host tensors reduced over the host's own control group (the cancel flag) are host memory: reading them is free.

"error" mode instead runs the loop's steps after the first under torch.cuda.set_sync_debug_mode("error") on a CUDA
rank: any synchronising CUDA call raises. Steps are marked by JobContext.progress; step k's bucket holds what happened
after step k was reported (bucket 0: the first step, including what a job builds once).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "XDIT_HOST_SYNCS"   # "count" or "error"
KINDS = ("read", "upload", "wait", "deferred")

_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
          "__complex__"}
_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "linspace", "logspace", "randn", "rand", "randint",
              "randperm", "eye", "tensor", "as_tensor", "scalar_tensor", "from_numpy", "asarray"}
_ACTIVE: "Counter | None" = None
_ERROR_FROM = None   # "error" mode: the sync debug mode to restore after the loop


def mode() -> str | None:
    value = os.environ.get(ENV)
    if value not in (None, "", "count", "error"):
        raise ValueError(f"{ENV}={value!r} is invalid: use count or error")
    return value or None


def _is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_xdit_host", False)


def _mark(value) -> None:
    if isinstance(value, torch.Tensor):
        try:
            value._xdit_host = True
        except (AttributeError, RuntimeError):
            pass
    elif isinstance(value, (tuple, list)):
        for v in value:
            _mark(v)


def _tensors(values, out: list) -> list:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            _tensors(v, out)
    return out


def _device_arg(args, kwargs):
    """The device a .to()/.copy_ call targets, or None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str)) and not isinstance(a, torch.dtype):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class Counter(TorchFunctionMode):
    """Counts per step while active (see the module's first lines)."""

    def __init__(self):
        super().__init__()
        self.steps: dict[int, dict[str, int]] = {}
        self.where: dict[str, dict[str, int]] = {}   # kind -> {"op at file:line": count}, for the report
        self.step = 0
        self.counting = False   # host tensors are marked from the loop's set-up on, counted from `start`
        self._deferred = 0
        self._thread = threading.get_ident()

    def note(self, kind: str, what: str) -> None:
        if threading.get_ident() != self._thread:   # the rank's reader and ticker threads are not the loop
            return
        bucket = self.steps.setdefault(self.step, dict.fromkeys(KINDS, 0))
        bucket[kind] += 1
        site = what + " at " + _caller()
        self.where.setdefault(kind, {})
        self.where[kind][site] = self.where[kind].get(site, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(list(args) + list(kwargs.values()), [])
        if self.counting:
            self._count(name, args, kwargs, inputs)
        out = func(*args, **kwargs)
        if name in _FACTORIES and kwargs.get("device") is None and not (
                name in ("tensor", "as_tensor", "asarray") and inputs and not _is_host(inputs[0])):
            _mark(out)
        elif name == "cpu" or (inputs and all(_is_host(t) for t in inputs) and name not in ("to", "cuda")):
            _mark(out)
        return out

    def _count(self, name: str, args, kwargs, inputs: list) -> None:
        if not inputs:
            return
        if name in _READS:
            if not _is_host(inputs[0]) and not self._deferred:
                self.note("read", name)
            return
        if name == "copy_":
            target, source = inputs[0], inputs[-1]
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if _is_host(target) and not _is_host(source) and blocking and not self._deferred:
                self.note("read", "copy_ into a host tensor")
            elif not _is_host(target) and _is_host(source) and source.numel() > 1:
                self.note("upload", "copy_ from a host tensor")
            return
        if name in ("to", "cuda"):
            source = inputs[0]
            if _is_host(source) and source.numel() > 1 and (name == "cuda" or _device_arg(args[1:], kwargs) is not None):
                self.note("upload", f".{name}(device) of a host tensor")
            return
        if any(_is_host(t) and t.numel() > 1 for t in inputs) and any(not _is_host(t) for t in inputs):
            self.note("upload", f"{name} of a host tensor with device tensors")


def _caller() -> str:
    """The first frame outside torch and this module: where the loop asked for it."""
    import sys
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("syncs.py") and "contextlib" not in path:
            parts = path.split("/")
            return f"{'/'.join(parts[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


# ---- waits: patched for the duration of a counted loop ------------------------------------------------------------
def _patched_waits(counter: Counter):
    work = dist.Work
    original = {"wait": work.wait, "is_completed": work.is_completed}

    def wait(self, timeout=None):
        if timeout is not None:
            counter.note("wait", "Work.wait(timeout)")
        return original["wait"](self, timeout) if timeout is not None else original["wait"](self)

    def is_completed(self):
        done = original["is_completed"](self)
        if not done:
            counter.note("wait", "Work.is_completed() polled unfinished")
        return done

    barrier, synchronize = dist.barrier, torch.cuda.synchronize

    def counted_barrier(*args, **kwargs):
        counter.note("wait", "dist.barrier")
        return barrier(*args, **kwargs)

    def counted_synchronize(*args, **kwargs):
        counter.note("wait", "torch.cuda.synchronize")
        return synchronize(*args, **kwargs)

    @contextlib.contextmanager
    def patched():
        work.wait, work.is_completed = wait, is_completed
        dist.barrier, torch.cuda.synchronize = counted_barrier, counted_synchronize
        try:
            yield
        finally:
            work.wait, work.is_completed = original["wait"], original["is_completed"]
            dist.barrier, torch.cuda.synchronize = barrier, synchronize
    return patched()


@contextlib.contextmanager
def loop(info: dict, device: torch.device):
    """Around a job's step loop and the set-up it needs: counts (mode "count", from `start` on) into
    info["host_syncs"], or runs its steps after the first under CUDA's sync debug mode "error" (mode "error", CUDA
    ranks).
    A no-op unless the rank's environment arms it."""
    global _ACTIVE, _ERROR_FROM
    how = mode()
    if how is None:
        yield
        return
    if how == "error":
        if device.type != "cuda":
            yield
            return
        _ERROR_FROM = torch.cuda.get_sync_debug_mode()
        try:
            yield
        finally:
            if _ERROR_FROM is not None:
                torch.cuda.set_sync_debug_mode(_ERROR_FROM)
            _ERROR_FROM = None
        info["host_syncs"] = {"mode": "error"}
        return
    counter = Counter()
    _ACTIVE = counter
    try:
        with _patched_waits(counter), counter:
            yield
    finally:
        _ACTIVE = None
        steps = max(counter.steps, default=-1) + 1
        info["host_syncs"] = {"mode": "count",
                              "per_step": [counter.steps.get(s, dict.fromkeys(KINDS, 0)) for s in range(steps)],
                              "where": counter.where}


def start() -> None:
    """The step loop begins: count from here (host tensors made during the set-up before it are marked already)."""
    if _ACTIVE is not None:
        _ACTIVE.counting = True


def step(index: int) -> None:
    """Step `index` was reported: what follows is counted in its bucket. In "error" mode the steps after the first
    run under CUDA's sync debug mode (the first step builds what a job builds once)."""
    if _ACTIVE is not None:
        _ACTIVE.step = index
    if _ERROR_FROM is not None and index >= 1:
        torch.cuda.set_sync_debug_mode("error")


@contextlib.contextmanager
def deferred_read():
    """A value queued at least a call earlier is read (Deferred.result): counted as deferred, not as a read."""
    counter = _ACTIVE
    if counter is None:
        yield
        return
    counter.note("deferred", "Deferred.result")
    counter._deferred += 1
    try:
        yield
    finally:
        counter._deferred -= 1
