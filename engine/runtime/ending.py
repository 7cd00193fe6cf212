"""How a job that failed on one rank (out of memory mid-step, say) ends on every rank of it while the rank processes,
their models and the control plane stay: the states the ranks agree over, and letting go of a torn-down mesh.

Every agreement of a job (the per-step cancel check, `stop_here`, the end of the job, the wind-down after a failure)
is the same all-reduce (MAX) over the job's control group (gloo, host memory): one int64 slot per rank of the job, each
rank writing its own state. So whatever point each rank has reached, the agreements stay in one sequence and every
rank reads the same states at the same agreement. A rank that fails keeps posting its failure (`JobContext.wind_down`)
until one agreement shows every rank of the job stopped; a rank still running reads the failure at its next check (or
at the job's end) and stops too. A rank waiting in a data-plane collective that the failed rank will never enter is
freed first: the failed rank tears its mesh down (Mesh.abort), which fails that collective on every peer.
"""
from __future__ import annotations

import gc
import threading
import time

import torch.distributed as dist

from ..errors import JobStoppedSignal

GO, CANCEL, STOPPED, FAILED, OUT_OF_MEMORY = 0, 1, 2, 3, 4
TORN = 8   # added to a state: that rank tore its mesh down before agreeing (so every rank drops the job's mesh)
_CAUSE = {FAILED: "failed", OUT_OF_MEMORY: "ran out of memory"}


def code(state: int) -> int:
    return state & (TORN - 1)


def stopped(states: list[int]) -> bool:
    """Has a rank of the job failed (or stopped with one that did)?"""
    return any(code(s) >= STOPPED for s in states)


def everyone_stopped(states: list[int]) -> bool:
    return all(code(s) >= STOPPED for s in states)


def torn(states: list[int]) -> bool:
    return any(s & TORN for s in states)


def first_failure(states: list[int]) -> int | None:
    """The rank whose own failure ended the job (the lowest such rank), or None when every rank only stopped."""
    return next((r for r, s in enumerate(states) if code(s) >= FAILED), None)


def cause(states: list[int], step: int | None) -> str:
    """"rank 1 ran out of memory at step 2": why the job ended, from the agreed states."""
    r = first_failure(states)
    at = f" at step {step}" if step is not None else ""
    if r is None:
        return f"a collective of the job failed on every rank{at}"
    return f"rank {r} {_CAUSE[code(states[r])]}{at}"


def peer_ended(e: BaseException) -> bool:
    """A collective that failed because another rank tore the job's communicators down: gloo reports the closed
    connection (a peer process that died reads the same, and then the control group fails too), NCCL an aborted
    communicator."""
    if isinstance(e, getattr(dist, "DistBackendError", ())):
        return True
    text = str(e)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "communicator was aborted"))


def state_of(e: BaseException, out_of_memory: bool) -> int:
    """The state a rank reports for the error that ended its part of the job (`out_of_memory`: that error is one)."""
    if isinstance(e, JobStoppedSignal) or peer_ended(e):
        return STOPPED
    return OUT_OF_MEMORY if out_of_memory else FAILED


def let_go(box: list, end: float) -> bool:
    """Drop the last references to what `box` holds (a torn-down mesh's gloo communicators) on a thread of its own,
    waiting until `end` (monotonic). A gloo communicator's destructor waits for the work queued on it, which a peer
    that never joins would hold until the collective timeout; the rank does not wait for that (False: not let go in
    time; the client then replaces the group)."""
    done = threading.Thread(target=lambda: (box.clear(), gc.collect()), name="xdit-let-go", daemon=True)
    done.start()
    done.join(max(0.0, end - time.monotonic()))
    return not done.is_alive()
