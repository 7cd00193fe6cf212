"""Fault injection: a rank told by `XDIT_FAULT` in its environment (JSON, see Fault) kills or stops itself, kills its
client, or raises an out-of-memory error at one point of its life, a given number of times. The engine's fault matrix
(engine/cli/bench_faults.py, tests/test_fault_matrix.py) drives it; without the variable every call here is a no-op.

The points are where real faults bite: "start" (before the rendezvous), "broadcast" (the job just announced),
"load" (a model's weights being read), "step" (at a given step of the job's loop, or a session's call of that number),
"return" (the result written to shared memory, not yet announced).
Each firing appends a line to `marker` (the time it fired and the rank's pid and process group), so the caller can
time the detection and check that nothing of the rank is left.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass

import torch

ENV = "XDIT_FAULT"
POINTS = ("start", "broadcast", "load", "step", "return")
ACTIONS = ("kill", "stop", "kill_client", "oom")


@dataclass(frozen=True)
class Fault:
    rank: int
    point: str          # one of POINTS
    action: str         # kill: SIGKILL itself; stop: SIGSTOP itself; kill_client: SIGKILL its parent; oom: raise
    marker: str         # file the firings are appended to
    step: int = 2       # for point "step"
    times: int = 1      # how many firings in all (across restarts: counted in `marker`)

    def __post_init__(self):
        if self.point not in POINTS or self.action not in ACTIONS:
            raise ValueError(f"fault {self.point}/{self.action} is invalid: points {POINTS}, actions {ACTIONS}")

    def env(self) -> dict[str, str]:
        """The ranks' environment entry that arms this fault."""
        return {ENV: json.dumps(asdict(self))}

    def firings(self) -> list[dict]:
        """What each firing recorded: {"time": epoch s, "pid", "pgid", "rank"}."""
        try:
            with open(self.marker) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


def from_env() -> Fault | None:
    raw = os.environ.get(ENV)
    return Fault(**json.loads(raw)) if raw else None


def fire(fault: Fault | None, rank: int, point: str, step: int | None = None) -> None:
    """Fire `fault` if it is armed for this rank, point (and step), and has fired fewer than `times` times."""
    if fault is None or fault.rank != rank or fault.point != point or (point == "step" and step != fault.step):
        return
    if len(fault.firings()) >= fault.times:
        return
    record = {"time": time.time(), "pid": os.getpid(), "pgid": os.getpgid(0), "rank": rank, "point": point}
    with open(fault.marker, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "kill_client":
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected by {ENV} at "
                                     f"{point} on rank {rank})")
