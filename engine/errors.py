"""Errors the engine raises to its caller; each names the input or rank, the value, and what would work."""


class EngineError(RuntimeError):
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


class CheckpointError(ValueError):
    """A model file that cannot be used; the message names the file and what is wrong with it."""


class PlanError(ValueError):
    """A parallel plan that cannot run; raised before any rank starts."""


class JobCancelledSignal(Exception):
    """Raised on every rank of a job the client cancelled, at the step the ranks agreed on (the rank turns it into
    the client's JobCancelled)."""

    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step
