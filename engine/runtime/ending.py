"""How a job that failed on one rank (out of memory mid-step, say) ends on every rank of it while the rank processes,
their models and the control plane stay: the states the ranks agree over, and letting go of a torn-down mesh.

Every agreement of a job (the per-step cancel check, `stop_here`, the end of the job, the wind-down after a failure)
is the same all-reduce (MAX) over the job's control group (gloo, host memory): one int64 slot per rank of the job, each
rank writing its own state. So whatever point each rank has reached, the agreements stay in one sequence and every
rank reads the same states at the same agreement. A rank that fails keeps posting its failure (`JobContext.wind_down`)
until one agreement shows every rank of the job stopped; a rank still running reads the failure at its next check (or
at the job's end) and stops too. A rank waiting in a data-plane collective that the failed rank will never enter is
freed first: the failed rank tears its mesh down (Mesh.abort), which fails that collective on every peer.

Gloo (CPU ranks, tested): a collective waits on the host, and a communicator has no abort; letting go of the failed
rank's communicators closes their connections, and each peer's pending collective fails at once ("Connection closed by
peer"); the peer tears its own mesh down in turn (so ranks further away are freed too) and joins the agreement.
NCCL (GPU ranks; not run here): a collective is queued on the device and the host goes on until something waits for
the device, and the peers of an aborted communicator on one machine do not notice: their kernels keep waiting for
the failed rank. So on NCCL every rank aborts its own communicators: the failed rank tells the client ("failing"),
the client relays it to every other rank, whose reader thread aborts the job's communicators (ncclCommAbort from
another thread ends a waiting kernel: rank.py `_abort`), so a main thread held in a device sync goes on to the next
agreement; and every rank of the job aborts its mesh after the agreement (TORN), before anything waits for the device
(the memory release's empty_cache). Torch's NCCL watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING) would instead kill the
process at the collective timeout, far past the error grace.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from datetime import timedelta

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


def agree_stopped(post, pending, end: float) -> list[int] | None:
    """A failed rank's side of the wind-down (JobContext.wind_down): complete the agreement it posted last (`pending`:
    (work, states), or None), then `post()` its state at every agreement until one shows every rank of the job
    stopped; those states, or None when a wait passed `end` (monotonic) or the control group failed."""
    def done(work) -> bool:
        try:
            work.wait(timedelta(seconds=max(0.001, end - time.monotonic())))
            return True
        except RuntimeError:   # timed out, or the control group itself failed (a peer gone)
            return False

    if pending is not None and not done(pending[0]):
        return None
    while True:
        work, states = post()
        if not done(work):
            return None
        if everyone_stopped(states.tolist()):
            return states.tolist()


def forget_meshes(cache: dict, plans: list[dict]) -> None:
    """Before a job: drop the meshes of `plans` (ParallelPlan dicts), which the ranks that ran a failed job on them
    dropped (JobContext.drop_mesh) while the ranks those plans leave idle kept theirs. Building a mesh is a collective
    of every rank, so every rank must hold the same meshes: the client passes the plans on with the next job."""
    from ..parallel.plan import ParallelPlan

    meshes = cache.get("meshes", {})
    for plan in map(ParallelPlan.from_dict, plans):
        mesh = meshes.pop(plan, None)
        if mesh is not None:
            mesh.destroy()   # an idle rank's holds no communicator of the plan's
            cache["meshes_destroyed"] = cache.get("meshes_destroyed", 0) + 1


def let_go(box: list, end: float) -> bool:
    """Drop the last references to the communicators `box` holds (a torn-down mesh's: box = [list of them]) on a thread
    of its own, waiting until `end` (monotonic). A gloo communicator's destructor waits for the work queued on it,
    which a peer that never joins would hold until the collective timeout; the rank does not wait for that (False: not
    let go in time; the client then replaces the group). A full collection runs only if a reference cycle keeps one."""
    alive = [weakref.ref(pg) for pg in box[0]]

    def drop() -> None:
        box.clear()
        if any(ref() is not None for ref in alive):
            gc.collect()

    done = threading.Thread(target=drop, name="xdit-let-go", daemon=True)
    done.start()
    done.join(max(0.0, end - time.monotonic()))
    return not done.is_alive()
