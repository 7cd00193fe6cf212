"""Host synchronisations in a rank's step loop, counted per step: a test instrument, armed by `XDIT_HOST_SYNCS` in the
rank's environment (without it every call here is a no-op, as with runtime/faults.py).

On a GPU the host launches work and runs ahead of the device; a step loop that makes the host wait for the device
per layer, patch or model call leaves the device idle while Python launches the next kernels. It counts, per step:
  read      a device tensor's value taken to the host: .item(), .tolist(), bool()/int()/float()/index use, .cpu(),
            .numpy(), nonzero and the other ops whose result size depends on the data, torch.equal, a blocking copy
            into a host tensor (on a GPU each drains the device's queue);
  upload    a host tensor (any size) or Python data put on the device by a blocking copy: .to(device), .cuda(),
            copy_, torch.tensor(data, device=...), or a host tensor of one or more dimensions used by an op on device
            tensors (an index, a position table). On a GPU a blocking copy synchronises the stream; a copy with
            non_blocking=True from pinned memory does not (from pageable memory it still does);
  wait      the host blocking on a transfer: a wait with a timeout, a poll that found the work unfinished, a barrier,
            torch.cuda.synchronize (a wait without a timeout is ordered on the device's stream by NCCL: the host goes
            on; on CPU ranks it stands for that);
  deferred  a value read through the step cache's `Deferred`, queued a model call earlier (on a GPU long done, read
            from pinned memory after an event): reported, not a sync.
CPU ranks have no device, so there the instrument models one: a tensor made on the host (a factory without a device,
torch.tensor from Python data, a copy to the CPU, the job's inputs as the bridge delivered them, a tensor marked
`in_host_memory`) is a host tensor, and so is whatever is computed from host tensors alone; every other tensor lives
on the "device", including what existed before the loop (the weights). A factory given a device makes device memory
when the engine or a library that runs the model on the rank's device (torch, diffusers, yunchang, flash-attn) asks
for it; any other library (torchsde's Brownian tree) is never handed the rank's device and allocates on the CPU
whatever device it names, so what it makes is host memory: that is where it lives on a GPU rank too. Pinned memory
exists only beside a GPU; on CPU ranks `in_pinned_memory` marks it. On CUDA ranks a host tensor is a CPU tensor.
Tensors in host memory reduced over the host's own control group (the cancel flag) are free to read.

It also records, per process group, the point-to-point operations a rank posts on it (sends, receives; batched ones
apart): on one NCCL communicator a rank's operations run in the order posted, so unbatched receives posted ahead and
sends on the same communicator can block each other (PipeFusion's links each carry one direction).

Mode "error" instead runs the loop's steps after the first under torch.cuda.set_sync_debug_mode("error") on a CUDA
rank: any synchronising CUDA call raises. Steps are marked by JobContext.progress: step k's bucket holds what happened
after step k was reported (bucket 0: the first step, with what a job builds once).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "XDIT_HOST_SYNCS"   # "count" or "error"
KINDS = ("read", "upload", "wait", "deferred")

_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "__format__", "cpu",
          "numpy", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
          "is_nonzero"}
_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "linspace", "logspace", "randn", "rand", "randint",
              "randperm", "eye", "tensor", "as_tensor", "scalar_tensor", "from_numpy", "asarray", "zeros_like",
              "ones_like", "empty_like", "full_like", "randn_like", "rand_like"}
_FROM_DATA = {"tensor", "as_tensor", "asarray"}
# where the code that runs the model on the rank's device lives: a factory placed by it makes device memory
_PACK = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEVICE_LIBRARIES = tuple(f"{os.sep}{name}{os.sep}" for name in ("torch", "diffusers", "yunchang", "flash_attn"))
_SELF = os.path.join("engine", "syncs.py")
_ACTIVE: "Counter | None" = None
_ERROR_FROM = None   # "error" mode: the sync debug mode to restore after the loop
_ERROR_ON = False    # "error" mode: the steps after the first are running under it


def mode() -> str | None:
    value = os.environ.get(ENV)
    if value not in (None, "", "count", "error"):
        raise ValueError(f"{ENV}={value!r} is invalid: use count or error")
    return value or None


def _mark(value, attribute: str = "_xdit_host") -> None:
    """Mark tensors (in tuples, lists and dataclasses too) as host tensors of a CPU rank."""
    if isinstance(value, torch.Tensor):
        try:
            setattr(value, attribute, True)
        except (AttributeError, RuntimeError):
            pass
    elif isinstance(value, (tuple, list)):
        for v in value:
            _mark(v, attribute)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _mark(getattr(value, f.name), attribute)


def in_host_memory(t: torch.Tensor) -> torch.Tensor:
    """Declare `t` host memory (on CPU ranks the instrument cannot tell otherwise; a mark, whether armed or not, as a
    tensor made before the loop may be read in it); returns it."""
    _mark(t)
    return t


def in_pinned_memory(t: torch.Tensor) -> torch.Tensor:
    """Declare `t` pinned host memory on a CPU rank, where no pinned memory exists (a GPU rank pins it for real:
    t.pin_memory()); returns it."""
    _mark(t)
    _mark(t, "_xdit_pinned")
    return t


def _tensors(values, out: list) -> list:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            _tensors(v, out)
    return out


def _device_arg(args, kwargs):
    """The device a .to() call targets (a device, a device name, or another tensor's), or None (a dtype only)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str)):
            return a
        if isinstance(a, torch.Tensor):
            return a
    return None


class Counter(TorchFunctionMode):
    """Counts per step while active (see the module's first lines)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.modelled = device.type == "cpu"   # CPU ranks: host and device are told apart by marks
        self.steps: dict[int, dict[str, int]] = {}
        self.where: dict[str, dict[str, int]] = {}   # kind -> {"op at file:line": count}, for the report
        self.step = 0
        self.counting = False   # host tensors are marked from the loop's set-up on, counted from `start`
        self._deferred = 0
        self._batched = 0
        self.p2p: dict[str, dict[str, int]] = {}   # process group -> {"send", "recv", "batched send", ...: count}
        self.host_block = 0   # inside `on_host`: every tensor made is host memory
        self._thread = threading.get_ident()

    def is_host(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.modelled:
            return getattr(t, "_xdit_host", False)
        return t.device.type == "cpu"

    def is_pinned(self, t) -> bool:
        return getattr(t, "_xdit_pinned", False) if self.modelled else t.is_pinned()

    def note(self, kind: str, what: str) -> None:
        if threading.get_ident() != self._thread:   # the rank's reader and ticker threads are not the loop
            return
        bucket = self.steps.setdefault(self.step, dict.fromkeys(KINDS, 0))
        bucket[kind] += 1
        site = what + " at " + _caller()
        self.where.setdefault(kind, {})
        self.where[kind][site] = self.where[kind].get(site, 0) + 1

    def note_p2p(self, pg, op: str) -> None:
        if not self.counting or threading.get_ident() != self._thread:
            return
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):
            ranks = "?"
        key = f"group {pg.group_name} {ranks}"
        op = ("batched " if self._batched else "") + op
        self.p2p.setdefault(key, {})
        self.p2p[key][op] = self.p2p[key].get(op, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(list(args) + list(kwargs.values()), [])
        if self.counting:
            self._count(name, args, kwargs, inputs)
        out = func(*args, **kwargs)
        if not self.modelled:
            return out
        if self.host_block:
            _mark(out)
            return out
        if name in ("to", "cuda"):
            target = "cuda" if name == "cuda" else _device_arg(args[1:], kwargs)
            source_host = bool(inputs) and self.is_host(inputs[0])
            if target is None or (isinstance(target, torch.Tensor) and self.is_host(target)):
                if source_host:
                    _mark(out)   # a dtype change stays where it is
            elif source_host and out is inputs[0]:
                out = out.clone()   # on a GPU the copy is a new tensor; on the CPU `to` returns its input
        elif name in _FACTORIES:
            placed = kwargs.get("device") is not None and not _library_caller()
            if name.endswith("_like") or (name in _FROM_DATA and inputs):   # where the tensor given is, unless placed
                host = not placed and self.is_host(inputs[0])
            else:
                host = not placed
            if host:
                _mark(out)
        elif name == "cpu" or (inputs and all(self.is_host(t) for t in inputs)):
            _mark(out)
        return out

    def _count(self, name: str, args, kwargs, inputs: list) -> None:
        if name in _FROM_DATA:
            if kwargs.get("device") is not None and (not inputs or self.is_host(inputs[0])):
                self.note("upload", f"torch.{name}(data, device=...)")
            return
        if not inputs:
            return
        host = [self.is_host(t) for t in inputs]
        if name in _READS:
            if not all(host) and not self._deferred:
                self.note("read", name)
            return
        if name == "__getitem__" and any(t.dtype == torch.bool and not h for t, h in zip(inputs[1:], host[1:])):
            self.note("read", "indexing with a boolean device tensor")
        if name == "copy_":
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if host[0] and not host[-1] and blocking and not self._deferred:
                self.note("read", "copy_ into a host tensor")
            elif not host[0] and host[-1] and (blocking or not self.is_pinned(inputs[-1])):
                self.note("upload", "copy_ from a host tensor" + ("" if blocking else " in pageable memory"))
            return
        if name in ("to", "cuda"):
            target = "cuda" if name == "cuda" else _device_arg(args[1:], kwargs)
            if host[0] and target is not None and not (isinstance(target, torch.Tensor) and self.is_host(target)):
                if not (kwargs.get("non_blocking") and self.is_pinned(inputs[0])):
                    self.note("upload", f".{name}(device) of a host tensor" +
                              (" in pageable memory" if kwargs.get("non_blocking") else ""))
            return
        if any(h and t.dim() > 0 for t, h in zip(inputs, host)) and not all(host):
            self.note("upload", f"{name} of a host tensor with device tensors")


def _library_caller() -> bool:
    """Whether the code asking torch for a tensor (the first frame outside torch and this module) is a library that
    does not run the model on the rank's device (see the module's first lines)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and not path.endswith(_SELF) and "contextlib" not in path:
            return not path.startswith(_PACK) and not any(lib in path for lib in _DEVICE_LIBRARIES)
        frame = frame.f_back
    return False


def _caller() -> str:
    """The first frame outside torch and this module: where the loop asked for it."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith(_SELF) and "contextlib" not in path:
            parts = path.split("/")
            return f"{'/'.join(parts[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


# ---- waits: patched for the duration of a counted loop ------------------------------------------------------------
@contextlib.contextmanager
def _patched_waits(counter: Counter):
    work, pg = dist.Work, dist.ProcessGroup
    # the class attributes as stored (pybind's method descriptors): read through the class they are unbound
    # functions, which put back would no longer bind the instance
    stored = {(cls, name): cls.__dict__[name] for cls, names in ((work, ("wait", "is_completed")),
                                                                 (pg, ("send", "recv"))) for name in names}
    original = {"wait": work.wait, "is_completed": work.is_completed}
    barrier, synchronize = dist.barrier, torch.cuda.synchronize
    send, recv, batch = pg.send, pg.recv, dist.batch_isend_irecv

    def counted_send(self, *args, **kwargs):
        counter.note_p2p(self, "send")
        return send(self, *args, **kwargs)

    def counted_recv(self, *args, **kwargs):
        counter.note_p2p(self, "recv")
        return recv(self, *args, **kwargs)

    def counted_batch(*args, **kwargs):
        counter._batched += 1
        try:
            return batch(*args, **kwargs)
        finally:
            counter._batched -= 1

    def wait(self, timeout=None):
        if timeout is not None:
            counter.note("wait", "Work.wait(timeout)")
            return original["wait"](self, timeout)
        return original["wait"](self)

    def is_completed(self):
        done = original["is_completed"](self)
        if not done:
            counter.note("wait", "Work.is_completed() polled unfinished")
        return done

    def counted_barrier(*args, **kwargs):
        counter.note("wait", "dist.barrier")
        return barrier(*args, **kwargs)

    def counted_synchronize(*args, **kwargs):
        counter.note("wait", "torch.cuda.synchronize")
        return synchronize(*args, **kwargs)

    work.wait, work.is_completed = wait, is_completed
    dist.barrier, torch.cuda.synchronize = counted_barrier, counted_synchronize
    pg.send, pg.recv, dist.batch_isend_irecv = counted_send, counted_recv, counted_batch
    try:
        yield
    finally:
        for (cls, name), value in stored.items():
            setattr(cls, name, value)
        dist.barrier, torch.cuda.synchronize = barrier, synchronize
        dist.batch_isend_irecv = batch


@contextlib.contextmanager
def loop(info: dict, device: torch.device, host=()):
    """Around a job's step loop and the set-up it needs: counts (mode "count", from `start` on) into
    info["host_syncs"], or runs its steps after the first under CUDA's sync debug mode "error" (mode "error", CUDA
    ranks). host: what the job holds in host memory from before the loop (its inputs as the bridge delivered them;
    tensors, lists, dataclasses). A no-op unless the rank's environment arms it."""
    global _ACTIVE, _ERROR_FROM, _ERROR_ON
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
            torch.cuda.set_sync_debug_mode(_ERROR_FROM)
            _ERROR_FROM, _ERROR_ON = None, False
        info["host_syncs"] = {"mode": "error"}
        return
    counter = Counter(device)
    _ACTIVE = counter
    _mark(list(host))
    try:
        with _patched_waits(counter), counter:
            yield
    finally:
        _ACTIVE = None
        steps = max([counter.step] + list(counter.steps)) + 1
        info["host_syncs"] = {"mode": "count",
                              "per_step": [counter.steps.get(s, dict.fromkeys(KINDS, 0)) for s in range(steps)],
                              "where": counter.where, "p2p": counter.p2p}


def start() -> None:
    """The step loop begins: count from here (host tensors made during the set-up before it are marked already)."""
    if _ACTIVE is not None:
        _ACTIVE.counting = True


def step(index: int) -> None:
    """Step `index` was reported: what follows is counted in its bucket. In "error" mode the steps after the first
    run under CUDA's sync debug mode (the first step builds what a job builds once)."""
    global _ERROR_ON
    if _ACTIVE is not None:
        _ACTIVE.step = index
    if _ERROR_FROM is not None and index >= 1:
        torch.cuda.set_sync_debug_mode("error")
        _ERROR_ON = True


@contextlib.contextmanager
def call_transfer():
    """A model session call's one upload (its tensors) or one download (its output): the transfers ComfyUI's sampler
    waits for anyway. Counted as usual in "count" mode; in "error" mode run outside CUDA's sync debug mode."""
    if not _ERROR_ON:
        yield
        return
    torch.cuda.set_sync_debug_mode(_ERROR_FROM)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("error")


@contextlib.contextmanager
def on_host():
    """A block that runs on host tensors only, by construction (PipeFusion's call schedule: the sampler run on one
    number in host memory): nothing in it is counted and what it makes is host memory. On CPU ranks the instrument
    cannot tell `.to(x.device)` of a host x from a move to the device."""
    counter = _ACTIVE
    if counter is None:
        yield
        return
    counting, counter.counting = counter.counting, False
    counter.host_block += 1
    try:
        yield
    finally:
        counter.counting = counting
        counter.host_block -= 1


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
