"""What the engine client knows of a job: the deadlines each phase, step and heartbeat must keep, the watch it keeps of
every rank (phase, last word, step) to name the rank, phase and step when one fails, and the result it returns."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PHASES = ("sent", "broadcast", "compute", "return")


@dataclass(frozen=True)
class Deadlines:
    """Seconds. A phase that runs past its deadline, a step that does not finish within `step_s`, or a rank silent past
    `heartbeat_s` (busy or starting) fails the job, naming the rank, the phase and the step. An idle engine has no
    deadline and runs no collective, so no process-group timeout can end it."""

    start_s: float = 180.0       # all ranks up and the process group formed
    broadcast_s: float = 120.0   # job received and verified on every rank ("sent" counts here too)
    load_s: float = 300.0        # loading a model's weights: this, plus load_s_per_gib for each GiB of the file
    load_s_per_gib: float = 60.0  # (60 s/GiB: a 23 GiB FLUX.1-dev file read at 17 MB/s, e.g. from a network disk)
    compute_s: float = 3600.0    # the job itself (model load excluded)
    step_s: float = 900.0        # one step of the job's loop, or one call of a session (the first may compile)
    return_s: float = 120.0      # results written to shared memory
    heartbeat_s: float = 15.0    # a busy or starting rank that says nothing for this long is hung
    error_grace_s: float = 3.0   # after one rank fails, how long the others get to report
    shutdown_s: float = 10.0
    backoff_s: float = 10.0      # after a second failure in a row, no restart for this long (doubling, up to 16x)

    def for_phase(self, phase: str, nbytes: int = 0) -> float:
        if phase == "load":
            return self.load_s + self.load_s_per_gib * nbytes / 2**30
        return {"sent": self.broadcast_s, "broadcast": self.broadcast_s,
                "compute": self.compute_s, "return": self.return_s}[phase]

    def validate(self) -> None:
        for name, value in self.__dict__.items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"deadline {name}={value!r} is invalid: use a number of seconds > 0")



class JobWatch:
    """What the client knows of a running job's ranks; a session keeps it across its calls."""

    def __init__(self, world: int, job_id: int):
        now = time.monotonic()
        self.job_id = job_id
        self.phase = {r: "sent" for r in range(world)}
        self.phase_start = dict.fromkeys(range(world), now)
        self.last_seen = dict.fromkeys(range(world), now)
        self.limit: dict[int, float] = {}       # rank -> its current phase's deadline, once the rank named it
        self.step: dict[int, int] = {}          # rank -> the last step it reported
        self.step_start = dict.fromkeys(range(world), now)  # since when each rank has been on that step
        self.final: dict[int, dict] = {}
        self.answers: dict[int, dict] = {}   # call -> rank 0's answer, until taken
        self.ended: set[int] = set()         # ranks told that their session has ended
        self.first_error_at: float | None = None
        self.failing: dict[int, dict] = {}   # rank -> its error, said as it began to wind a failed job down
        self.aborted = False                 # the other ranks were told the job failed (a rank's "failing")

    def note_step(self, rank: int, step: int | None, now: float) -> None:
        if step is not None and step != self.step.get(rank):
            self.step[rank], self.step_start[rank] = step, now

    def where(self, rank: int) -> str:
        """"phase compute at step 3": where a rank was, for an error message."""
        name = "broadcast" if self.phase[rank] == "sent" else self.phase[rank]
        if name != "compute" or not self.step:
            return f"phase {name}"
        # the ranks step together (each step has collectives), and a rank's own count lags by up to a heartbeat
        return f"phase {name} at step {max(self.step.values())}"


@dataclass
class JobResult:
    outputs: dict[str, torch.Tensor]
    timings: dict[str, float]
    ranks: list[dict] = field(default_factory=list)  # what each rank reported (job id, crc32, ...)
    job_id: int = 0
    crc32: int = 0
