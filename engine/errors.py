"""Errors the engine raises to its caller; each names the input or rank, the value, and what would work.

They read as the pack's own names, `xDiT.PlanError` and so on, wherever a type is shown as module + name: ComfyUI
shows an error's type in its history and on the page that way, and it imports a custom node pack by file path, so
the real module would read ".../custom_nodes/ComfyUI-xDiT.engine.errors". Pickling still finds each class in the
module that defines it (`_rebuild`), and isinstance is unchanged."""
from __future__ import annotations

import importlib

SHOWN_MODULE = "xDiT"
# what a rank says when it ends a session whose client sent no call within the collective timeout (rank.py); the client
# then opens a new session rather than failing the call (xdit_nodes/model.py)
SESSION_IDLE = "no call from the client"


class PackError:
    """Mixin for the engine's errors: the class (and every subclass, wherever defined) shows as xDiT.<Name>."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._home = cls.__dict__.get("_home", cls.__module__)   # where pickling finds it
        cls.__module__ = SHOWN_MODULE

    def __reduce__(self):
        return _rebuild, (type(self)._home, type(self).__qualname__, self.args, dict(self.__dict__))


def _rebuild(home: str, qualname: str, args: tuple, state: dict) -> BaseException:
    """An error of class `qualname` in module `home` with its message arguments and attributes, as pickled."""
    cls = importlib.import_module(home)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, PackError) and issubclass(cls, BaseException)):
        raise TypeError(f"{home}.{qualname} is not one of the engine's errors")
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class EngineError(PackError, RuntimeError):
    """A job or the rank group failed. `rank` and `phase` say where, when known; `oom` marks an out-of-memory failure."""

    def __init__(self, message: str, *, rank: int | None = None, phase: str | None = None, oom: bool = False,
                 memory: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.phase = phase
        self.oom = oom          # the rank ran out of memory (CUDA, or the host's for CPU ranks)
        self.memory = memory    # what that rank held then (GiB), as JobContext.memory() reports it


class JobCancelled(EngineError):
    """The caller cancelled the job; the ranks stopped together at `step` and the engine is ready again."""

    def __init__(self, message: str, *, step: int | None = None):
        super().__init__(message, phase="compute")
        self.step = step


class CheckpointError(PackError, ValueError):
    """A model file that cannot be used; the message names the file and what is wrong with it."""


class PlanError(PackError, ValueError):
    """A parallel plan that cannot run; raised before any rank starts."""


class JobCancelledSignal(PackError, Exception):
    """Raised on every rank of a job the client cancelled, at the step the ranks agreed on (the rank turns it into
    the client's JobCancelled)."""

    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


class JobStoppedSignal(PackError, Exception):
    """Raised on the ranks of a job that agreed to stop because another rank failed where they agree (a model load that
    ran out of memory, the memory check before the first step): the rank reports it as an error that only follows the
    failing rank's own, and the group stays up with what it holds."""
