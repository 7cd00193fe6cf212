"""The engine client: lives in the caller's process (ComfyUI's), starts and owns the rank processes,
submits jobs, watches their health, and replaces the ranks after a failure. It is never a rank and
never joins the process group.

Control: one inherited Unix socketpair per rank (nothing listens anywhere); rendezvous through a
FileStore in the engine's private 0700 directory; gloo/NCCL bound to loopback for a local engine.
Every wait has a deadline; a dead or silent rank becomes an EngineError naming the rank and phase.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import selectors
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import bridge
from ..errors import EngineError, JobCancelled
from .launch import cpu_sets, kill_all, log_tail, rank_env, signal_name, spawn_rank
from .protocol import Channel, ChannelClosed, ProtocolError

MAX_RANKS = 8
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


@dataclass
class JobResult:
    outputs: dict[str, torch.Tensor]
    timings: dict[str, float]
    ranks: list[dict] = field(default_factory=list)  # what each rank reported (job id, crc32, ...)
    job_id: int = 0
    crc32: int = 0


class Engine:
    """A persistent group of rank processes. Use as a context manager or call close().

    ranks: 1..8. device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank from `gpus`).

    Ranks on other machines (remote.py): `listen="HOST:PORT"` (an address of this machine; port 0 picks a free one,
    see `listen_address`) and `remote_ranks=[n1, n2, ...]`, the ranks of node 1, 2, ... (each joins with `python -m
    engine worker --join HOST:PORT --node-rank K --ranks nK`); they follow this machine's `ranks` in rank order.
    `secret` (default $XDIT_SECRET) is required unless HOST is loopback; `interface` names the network interface
    gloo/NCCL use here (default: the one holding HOST). Rank 0 stays here: results return through this machine.

    pin_cpus (CPU ranks on this machine): each rank runs on its own cores (`launch.cpu_sets`), with as many threads,
    instead of every rank's threads roaming over every core; for timing ranks as if each had its own device.
    """

    def __init__(self, ranks: int = 1, *, device: str = "cpu", gpus: list[int] | None = None,
                 deadlines: Deadlines | None = None, heartbeat_interval_s: float = 0.5,
                 collective_timeout_s: float = 1800.0, rank_stdio: str = "log", env: dict[str, str] | None = None,
                 start: bool = True, listen: str | None = None, remote_ranks: list[int] | None = None,
                 secret: str | bytes | None = None, interface: str | None = None, pin_cpus: bool = False):
        if not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks={ranks!r} is invalid: use 1 to {MAX_RANKS} (one rank per GPU)")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is invalid: use 'cpu' (gloo) or 'cuda' (NCCL)")
        if device == "cuda":
            gpus = list(range(ranks)) if gpus is None else [int(g) for g in gpus]
            if len(gpus) != ranks or len(set(gpus)) != ranks:
                raise ValueError(f"gpus={gpus} is invalid for {ranks} ranks: list {ranks} distinct GPU indices, "
                                 f"e.g. {list(range(ranks))}")
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but this torch sees no CUDA device: use device='cpu'")
            if max(gpus) >= torch.cuda.device_count():
                raise ValueError(f"gpus={gpus} names GPU {max(gpus)} but only {torch.cuda.device_count()} "
                                 f"are visible (0..{torch.cuda.device_count() - 1})")
        elif gpus:
            raise ValueError(f"gpus={gpus} given with device='cpu': drop gpus or use device='cuda'")
        if pin_cpus and device != "cpu":
            raise ValueError("pin_cpus=True pins CPU ranks to cores: use it with device='cpu'")
        self.cores = cpu_sets(ranks) if pin_cpus else None
        if rank_stdio not in ("log", "inherit"):
            raise ValueError(f"rank_stdio={rank_stdio!r} is invalid: use 'log' or 'inherit'")
        if (listen is None) != (not remote_ranks):
            raise ValueError(f"listen={listen!r} and remote_ranks={remote_ranks!r}: give both (ranks on other machines) "
                             f"or neither (this machine only)")
        if remote_ranks and not all(isinstance(n, int) and 1 <= n <= MAX_RANKS for n in remote_ranks):
            raise ValueError(f"remote_ranks={remote_ranks!r} is invalid: list each node's ranks, 1 to {MAX_RANKS} each, "
                             f"e.g. [2]")
        self.local_ranks = ranks
        self.world = ranks + sum(remote_ranks or [])
        self.device = device
        self.gpus = gpus
        self.deadlines = deadlines or Deadlines()
        self.deadlines.validate()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.collective_timeout_s = collective_timeout_s
        self.rank_stdio = rank_stdio
        self.env = dict(env or {})   # added to the ranks' environment (e.g. NCCL settings, faults.ENV)
        self.generation = 0          # how many times the rank group was (re)started
        self.restarts: list[str] = []  # why each replacement happened
        self._procs: list[subprocess.Popen] = []
        self._chans: list[Channel] = []
        self.engine_dir: str | None = None
        self.rank_info: list[dict] = []
        self._broken: str | None = None
        self._failures = 0           # failures in a row (a job every rank answered ends the run)
        self._retry_at = 0.0         # monotonic time before which no restart is tried (backoff)
        self._last_failure = ""
        self._job_ids = itertools.count(1)
        self._finalizer = None
        self._lock = threading.RLock()  # one job (or lifecycle change) at a time
        self._cluster = None
        if listen is not None:
            from .remote import Cluster, secret_from
            self._cluster = Cluster(listen, list(remote_ranks), ranks, secret_from(secret), device,
                                    self.deadlines.heartbeat_s, interface)
        if start:
            try:
                self.start()
            except BaseException:
                self._close_cluster()  # stop listening: nobody holds this engine to close it
                raise

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def listen_address(self) -> str | None:
        """HOST:PORT where workers join (None for an engine on this machine only)."""
        return self._cluster.address if self._cluster else None

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._procs:
            raise RuntimeError("engine already started")
        bridge.sweep_stale_dirs()
        self.engine_dir = bridge.make_engine_dir()
        self.generation += 1
        store_path = os.path.join(self.engine_dir, f"store-{self.generation}")
        env = {**rank_env(self.gpus if self.device == "cuda" else None), **self.env}
        threads = max(1, (os.cpu_count() or 1) // self.local_ranks)
        if self._cluster:
            env.update(self._cluster.rank_env())
        self._finalizer = weakref.finalize(self, kill_all, self._procs, self._chans, self.engine_dir)
        pgid = 0
        try:
            if self._cluster:
                self._cluster.begin(self.generation, self.deadlines.start_s)
            for rank in range(self.world):
                log = os.path.join(self.engine_dir, f"rank{rank}.log") if self.rank_stdio == "log" else None
                if rank >= self.local_ranks:  # on another machine: its worker starts it, the store relays its channel
                    proc, chan = self._cluster.spawn(rank, self.generation)
                else:
                    proc, chan = spawn_rank(env, pgid, log)
                    pgid = pgid or proc.pid  # this machine's ranks share one process group, led by rank 0
                self._procs.append(proc)
                self._chans.append(chan)
                chan.send({"op": "init", "rank": rank, "world": self.world,
                           "backend": "nccl" if self.device == "cuda" else "gloo",
                           "local_device": rank, "engine_dir": self.engine_dir, "store_path": store_path,
                           "heartbeat_interval_s": self.heartbeat_interval_s,
                           "collective_timeout_s": self.collective_timeout_s,
                           "threads": len(self.cores[rank]) if self.cores and rank < self.local_ranks else threads,
                           "cores": self.cores[rank] if self.cores and rank < self.local_ranks else None,
                           "tcp_store": self._cluster.store_info(self.generation) if self._cluster else None})
            self.rank_info = self._wait_ready()
        except BaseException as e:
            self._teardown()
            if isinstance(e, Exception):
                self._note_failure(f"start-up failed: {str(e).splitlines()[0]}")
            raise
        self._broken = None

    def _wait_ready(self) -> list[dict]:
        """Every rank's "ready". A rank heard from (it says hello once its runtime is up, then beats) that falls silent
        past heartbeat_s is stopped or hung; one never heard from has until start_s."""
        ready: dict[int, dict] = {}
        heard: dict[int, float] = {}
        deadline = time.monotonic() + self.deadlines.start_s
        sel = selectors.DefaultSelector()
        for rank, chan in enumerate(self._chans):
            sel.register(chan.sock, selectors.EVENT_READ, rank)
        try:
            while len(ready) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.world) if r not in ready]
                    raise EngineError(f"ranks {missing} did not start within {self.deadlines.start_s:.0f} s "
                                      f"(deadline start_s){self._log_tail(missing[0])}", rank=missing[0], phase="start")
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    rank = key.data
                    try:
                        for message in self._chans[rank].recv_ready():
                            heard[rank] = time.monotonic()
                            if message.get("op") == "ready":
                                ready[rank] = message
                    except ChannelClosed as e:
                        if isinstance(e, ProtocolError):
                            raise EngineError(f"rank {rank} broke the control protocol during start-up ({e})",
                                              rank=rank, phase="start") from None
                        status = self._reap(rank)
                        raise EngineError(f"rank {rank} exited during start-up ({status})"
                                          f"{self._log_tail(rank)}", rank=rank, phase="start") from None
                now = time.monotonic()
                silent = [r for r, t in heard.items() if r not in ready and now - t > self.deadlines.heartbeat_s]
                if silent:
                    raise EngineError(f"rank {silent[0]} stopped answering during start-up (no heartbeat for "
                                      f"{self.deadlines.heartbeat_s:g} s, deadline heartbeat_s; pid "
                                      f"{self._procs[silent[0]].pid}){self._log_tail(silent[0])}",
                                      rank=silent[0], phase="start")
        finally:
            sel.close()
        return [ready[r] for r in range(self.world)]

    def _reap(self, rank: int, timeout_s: float = 2.0) -> str:
        try:
            self._procs[rank].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        return getattr(self._procs[rank], "reason", None) or signal_name(self._procs[rank].poll())

    def _log_tail(self, rank: int) -> str:
        if rank >= self.local_ranks:
            return getattr(self._procs[rank], "log_tail", "") if rank < len(self._procs) else ""
        return log_tail(self.engine_dir, rank)

    def _teardown(self) -> None:
        kill_all(self._procs, self._chans, self.engine_dir)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._procs.clear()
        self._chans.clear()
        self.engine_dir = None

    def close(self) -> None:
        """Ask the ranks to exit, wait up to deadlines.shutdown_s, then make sure they are gone."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for chan in self._chans:
            try:
                chan.send({"op": "shutdown"})
            except (ChannelClosed, OSError):
                pass
        end = time.monotonic() + self.deadlines.shutdown_s
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._teardown()
        self._close_cluster()

    def _close_cluster(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def restart(self, reason: str = "requested") -> None:
        with self._lock:
            self._restart_locked(reason)

    def _restart_locked(self, reason: str = "requested") -> None:
        self.restarts.append(reason)
        self._teardown()
        self.start()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._teardown()  # Ctrl-C (KeyboardInterrupt), SystemExit: kill the ranks now, do not wait for a busy job
            self._close_cluster()
        else:
            self.close()

    def _ensure_healthy(self) -> None:
        if not self._procs:
            self._check_backoff()
            self.start()
            return
        if self._broken:
            self._check_backoff()
            self.restart(self._broken)
            return
        problem = self._idle_problem()
        if problem:
            self._replace_idle_group(problem)

    def _idle_problem(self) -> str | None:
        """Why the idle rank group cannot take a job, or None. A rank that loses its client (a closed or garbled
        channel) removes the engine directory first and then kills its group, so a group can look alive while it is
        being torn down: an exited rank or a missing engine directory each mean it is going. (A rank's garbage that
        waits unread on its channel fails the next job, naming the rank and the protocol.)"""
        dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
        if dead:
            return f"rank {dead[0]} had exited while idle ({signal_name(self._procs[dead[0]].poll())})"
        if not self.engine_dir or not os.path.isdir(self.engine_dir):
            return "the engine directory was removed while idle (a rank was taking the group down)"
        return None

    def _replace_idle_group(self, reason: str) -> None:
        """A group found going down between jobs is replaced; no job is handed to it. When a rank is tearing it down
        (the engine directory is gone: the rank kills its group next), the client waits for that to finish, up to
        shutdown_s, before killing what is left and starting the new group."""
        self._check_backoff()
        if not self.engine_dir or not os.path.isdir(self.engine_dir):
            end = time.monotonic() + self.deadlines.shutdown_s
            for p in self._procs[:self.local_ranks]:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        self._restart_locked(reason)

    def _note_failure(self, reason: str) -> None:
        """A failure that took the rank group down (or kept it from starting). From the second in a row on, the next
        start waits backoff_s, doubling with each further failure (up to 16x): a fault that repeats is reported at
        once instead of restarting the ranks in a loop."""
        self._failures += 1
        self._last_failure = reason
        if self._failures >= 2:
            self._retry_at = time.monotonic() + self.deadlines.backoff_s * min(16, 2 ** (self._failures - 2))

    def _check_backoff(self) -> None:
        left = self._retry_at - time.monotonic()
        if self._failures >= 2 and left > 0:
            raise EngineError(f"the engine failed {self._failures} times in a row (last: {self._last_failure}); it "
                              f"starts its ranks again in {left:.0f} s (deadline backoff_s), so a repeating fault does "
                              f"not loop: check the rank logs, the GPUs and the model", phase="start")

    # ---- jobs ----------------------------------------------------------------------------------
    def submit(self, kind: str, spec: dict | None = None, inputs: dict[str, torch.Tensor] | None = None, *,
               on_progress=None, should_cancel=None, deadlines: Deadlines | None = None) -> JobResult:
        """Run one job on all ranks and return its outputs. Blocks; callbacks run on this thread.

        on_progress(step, total) is called as rank 0 reports steps; should_cancel() is polled about
        every 0.1 s and, once true, the ranks stop together at their next step boundary (JobCancelled).
        If a callback raises, the job is cancelled the same way and the exception re-raised.
        Jobs on one engine run one at a time; a second caller waits for the first.
        """
        with self._lock:
            return self._submit(kind, spec, inputs, on_progress, should_cancel, deadlines)

    def _submit(self, kind, spec, inputs, on_progress, should_cancel, deadlines) -> JobResult:
        t_submit = time.perf_counter()
        deadlines = deadlines or self.deadlines
        job_id, crc, t_ready, t_written = self._send_job(kind, spec, inputs, deadlines)
        return self._collect(job_id, crc, _Watch(self.world, job_id), deadlines, on_progress, should_cancel,
                             (t_submit, t_ready, t_written))

    def _send_job(self, kind, spec, inputs, deadlines) -> tuple[int, int, float, float]:
        """Write the job's inputs to shared memory and tell every rank; returns (job id, crc32, times). A group found
        going down while the job is being handed over (a rank gone, or its directory) is replaced and the job sent
        to the new one: the old group is killed whole, so no rank of it runs the job."""
        deadlines.validate()
        inputs = dict(inputs or {})
        spec = dict(spec or {})
        for attempt in range(2):
            self._ensure_healthy()
            t_ready = time.perf_counter()
            job_id = next(self._job_ids)
            segment_path = os.path.join(self.engine_dir, f"j{job_id}-in")
            try:
                manifest = bridge.write_segment(segment_path, inputs) if inputs else None
                entries = manifest["entries"] if manifest else []
                doc = json.dumps({"job_id": job_id, "kind": kind, "spec": spec, "entries": entries},
                                 sort_keys=True, separators=(",", ":"))
                crc = bridge.checksum(doc.encode(), manifest["crc32"] if manifest else 0)
                t_written = time.perf_counter()
                segment = {"path": segment_path, "nbytes": manifest["nbytes"]} if manifest else None
                for rank, chan in enumerate(self._chans):
                    message = {"op": "job", "job_id": job_id, "crc32": crc}
                    if rank == 0:
                        message.update(doc=doc, segment=segment)
                    chan.send(message)
            except (ChannelClosed, OSError) as e:
                bridge.unlink_quietly(segment_path)
                going = self._idle_problem() if attempt == 0 else None
                if going:
                    self._replace_idle_group(going)
                    continue
                self._fail(f"control channel failed: {e}")
                raise EngineError(f"job {job_id}: the engine's control channel failed ({e}); the ranks will be "
                                  f"replaced", phase="sent") from e
            return job_id, crc, t_ready, t_written
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _collect(self, job_id, crc, watch, deadlines, on_progress, should_cancel, times) -> JobResult:
        """Wait for every rank's final report of `job_id`, read its outputs and remove its shared memory."""
        t_submit, t_ready, t_written = times
        try:
            reports = self._await_job(job_id, deadlines, on_progress, should_cancel, watch)
            t_read0 = time.perf_counter()
            outputs: dict[str, torch.Tensor] = {}
            for report in reports:
                if report.get("outputs"):
                    for name, tensor in bridge.read_segment(report["outputs"]).items():
                        if name in outputs:
                            raise EngineError(f"job {job_id}: output {name!r} returned by more than one rank",
                                              rank=report["info"]["rank"], phase="return")
                        outputs[name] = tensor
            t_done = time.perf_counter()
        except (ChannelClosed, OSError) as e:
            self._fail(f"control channel failed: {e}")
            raise EngineError(f"job {job_id}: the engine's control channel failed ({e}); the ranks will be "
                              f"replaced", phase="sent") from e
        finally:
            self._unlink_job_files(job_id)
        rank_t = [r["timings"] for r in reports]
        timings = {
            "queue_s": t_ready - t_submit,
            "write_s": t_written - t_ready,
            "broadcast_s": max(t.get("broadcast_s", 0.0) for t in rank_t),
            "compute_s": max(t.get("compute_s", 0.0) for t in rank_t),
            "return_s": max(t.get("return_s", 0.0) for t in rank_t) + (t_done - t_read0),
            "total_s": t_done - t_submit,
        }
        return JobResult(outputs=outputs, timings=timings, ranks=[r["info"] for r in reports],
                         job_id=job_id, crc32=crc)

    def _unlink_job_files(self, job_id: int) -> None:
        if self.engine_dir:
            for path in glob.glob(os.path.join(self.engine_dir, f"j{job_id}-*")):
                bridge.unlink_quietly(path)

    def session(self, kind: str, spec: dict | None = None, inputs: dict[str, torch.Tensor] | None = None, *,
                deadlines: Deadlines | None = None) -> "Session":
        """Start a job that answers calls (e.g. one model evaluation each) until the caller ends it; use as a
        context manager: `with engine.session("guide", spec, inputs) as s: out = s.call({"x": x}, sigma=0.5)`.
        The engine serves nothing else meanwhile. Leaving the block ends the job; an exception in the block ends it
        too (the ranks stop serving and stay up) and is re-raised."""
        return Session(self, kind, spec, inputs, deadlines or self.deadlines)

    def _fail(self, reason: str) -> None:
        """The group may be mid-collective: kill it now (frees GPUs at once); start anew on the next job."""
        self._broken = reason
        self._note_failure(reason)
        kill_all(self._procs, [], None)

    def _await_job(self, job_id: int, deadlines: Deadlines, on_progress, should_cancel, watch: "_Watch",
                   call: int | None = None) -> list[dict] | dict:
        """Follow the job's ranks until each has finished (the reports, rank order) or, with `call`, until rank 0
        answers that call (its answer). Every wait has a deadline; a dead, silent, stalled or late rank fails the job
        with an error naming the rank, the phase and the step."""
        phase, phase_start, last_seen, final = watch.phase, watch.phase_start, watch.last_seen, watch.final
        if call is not None:  # between calls nobody read the ranks' heartbeats, and a call is a step: count from now
            now = time.monotonic()
            for rank in last_seen:
                last_seen[rank] = watch.step_start[rank] = now
        cancel_sent = cancel_requested = False
        caller_error: BaseException | None = None  # a callback raised: cancel, let ranks finish, re-raise
        sel = selectors.DefaultSelector()
        for rank, chan in enumerate(self._chans):
            sel.register(chan.sock, selectors.EVENT_READ, rank)
        try:
            while len(final) < self.world:
                if call is not None and call in watch.answers and not final:
                    return watch.answers.pop(call)
                if caller_error is None and should_cancel is not None:
                    try:
                        cancel_requested = bool(should_cancel())
                    except BaseException as e:
                        caller_error = e
                if not cancel_sent and (caller_error is not None or cancel_requested):
                    for chan in self._chans:
                        chan.send({"op": "cancel", "job_id": job_id})
                    cancel_sent = True
                for key, _ in sel.select(timeout=0.1):
                    rank = key.data
                    try:
                        messages = self._chans[rank].recv_ready()
                    except ChannelClosed as e:
                        sel.unregister(key.fileobj)
                        where = watch.where(rank) if rank not in final else "after finishing its part"
                        if isinstance(e, ProtocolError):  # garbage from a live rank: as broken as a dead one
                            self._fail(f"rank {rank} broke the control protocol: {e}")
                            raise EngineError(f"job {job_id}: rank {rank} broke the control protocol during "
                                              f"{where} ({e}); the ranks will be replaced before the next job",
                                              rank=rank, phase=phase[rank]) from None
                        status = self._reap(rank)
                        self._fail(f"rank {rank} died ({status})")
                        raise EngineError(f"job {job_id}: rank {rank} died during {where} ({status}); "
                                          f"the ranks will be replaced before the next job{self._log_tail(rank)}",
                                          rank=rank, phase=phase[rank]) from None
                    now = time.monotonic()
                    last_seen[rank] = now
                    for m in messages:
                        if m.get("job_id", job_id) != job_id:
                            continue
                        op = m["op"]
                        if op == "phase":
                            if m.get("phase") not in PHASES + ("load",):
                                self._fail(f"rank {rank} broke the control protocol: phase {m.get('phase')!r}")
                                raise EngineError(f"job {job_id}: rank {rank} broke the control protocol: it named "
                                                  f"phase {m.get('phase')!r}; the ranks will be replaced",
                                                  rank=rank, phase=phase[rank])
                            phase[rank], phase_start[rank] = m["phase"], now
                            watch.limit[rank] = deadlines.for_phase(m["phase"], m.get("bytes", 0))
                            watch.step_start[rank] = now
                        elif op in ("hb", "progress"):
                            watch.note_step(rank, m.get("step"), now)
                            if op == "progress" and on_progress is not None and caller_error is None:
                                try:
                                    on_progress(m["step"], m["total"])
                                except BaseException as e:  # e.g. ComfyUI's interrupt, raised by its progress bar
                                    caller_error = e
                        elif op == "answer":
                            watch.answers[m["call"]] = m
                        elif op in ("done", "error", "cancelled"):
                            final[rank] = m
                            if op == "error" and watch.first_error_at is None:
                                watch.first_error_at = now
                now = time.monotonic()
                if watch.first_error_at is not None and len(final) < self.world and \
                        now - watch.first_error_at > deadlines.error_grace_s:
                    r, m = next((r, m) for r, m in sorted(final.items()) if m["op"] == "error")
                    self._fail(f"rank {r} failed in phase {m['phase']}; others did not finish")
                    raise self._rank_error(job_id, r, m, "; the ranks will be replaced before the next job")
                self._check_deadlines(job_id, deadlines, watch, now)
        finally:
            sel.close()
        self._failures = 0   # every rank answered: the group is sound, whatever the job's outcome
        if caller_error is not None:
            raise caller_error
        errors = [(r, m) for r, m in sorted(final.items()) if m["op"] == "error"]
        if errors:  # every rank answered, so the group is back in step and stays up
            raise self._rank_error(job_id, *errors[0], "")
        if any(m["op"] == "cancelled" for m in final.values()):
            steps = sorted({m.get("step") for m in final.values() if m["op"] == "cancelled"})
            raise JobCancelled(f"job {job_id} cancelled at step {steps[0]}; the engine is ready", step=steps[0])
        if call is not None:
            raise EngineError(f"job {job_id}: the ranks ended the job without answering call {call}", phase="compute")
        return [final[r] for r in range(self.world)]

    def _check_deadlines(self, job_id: int, deadlines: Deadlines, watch: "_Watch", now: float) -> None:
        """A rank silent past heartbeat_s, a step or call past step_s, or a phase past its deadline fails the job."""
        phase = watch.phase
        for rank in range(self.world):
            if rank in watch.final:
                continue
            if now - watch.last_seen[rank] > deadlines.heartbeat_s:
                self._fail(f"rank {rank} stopped answering during {watch.where(rank)}")
                raise EngineError(f"job {job_id}: rank {rank} stopped answering during {watch.where(rank)} (no "
                                  f"heartbeat for {deadlines.heartbeat_s:g} s, deadline heartbeat_s; pid "
                                  f"{self._procs[rank].pid}); the ranks will be replaced", rank=rank, phase=phase[rank])
            if phase[rank] == "compute" and now - watch.step_start[rank] > deadlines.step_s:
                stalled = sorted((r for r in range(self.world) if r not in watch.final and phase[r] == "compute"
                                  and now - watch.step_start[r] > deadlines.step_s), key=lambda r: watch.step_start[r])
                behind = stalled[0]   # the rank stuck longest; the others may only be waiting for it
                self._fail(f"rank {behind} stalled during {watch.where(behind)}")
                raise EngineError(f"job {job_id}: rank {behind} made no progress for {deadlines.step_s:g} s during "
                                  f"{watch.where(behind)} (deadline step_s; ranks stalled: "
                                  f"{', '.join(map(str, stalled))}); the ranks will be replaced",
                                  rank=behind, phase="compute")
            limit = watch.limit.get(rank) or deadlines.for_phase(phase[rank])
            if now - watch.phase_start[rank] > limit:
                name = "broadcast" if phase[rank] == "sent" else phase[rank]
                self._fail(f"rank {rank} exceeded the {name} deadline")
                detail = (f"{deadlines.load_s:g} s + {deadlines.load_s_per_gib:g} s/GiB, deadlines load_s and "
                          f"load_s_per_gib" if name == "load" else f"deadline {name}_s")
                raise EngineError(f"job {job_id}: rank {rank} exceeded the {name} deadline during "
                                  f"{watch.where(rank)} ({limit:g} s, {detail}); the ranks will be replaced",
                                  rank=rank, phase=name)

    def _rank_error(self, job_id: int, rank: int, m: dict, then: str) -> EngineError:
        """A rank's error report as the caller sees it; an out-of-memory one says what the rank held."""
        at = f" at step {m['step']}" if m.get("step") is not None else ""
        if m.get("oom"):
            mem = m.get("memory") or {}
            held = (f"; it held {mem['peak_gib']:.1f} GiB at peak, the device {mem['device_used_gib']:.1f} of "
                    f"{mem['device_total_gib']:.1f} GiB" if "device_total_gib" in mem else
                    f"; its peak RSS was {mem['peak_rss_gib']:.1f} GiB" if "peak_rss_gib" in mem else "")
            return EngineError(f"job {job_id}: rank {rank} ran out of memory in phase {m['phase']}{at}: "
                               f"{m['message'].splitlines()[0]}{held}{then}", rank=rank, phase=m["phase"], oom=True,
                               memory=mem)
        return EngineError(f"job {job_id}: rank {rank} failed in phase {m['phase']}{at}: {m['message']}{then}",
                           rank=rank, phase=m["phase"])


class _Watch:
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
        self.first_error_at: float | None = None

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


class Session:
    """A job that answers calls: see Engine.session. Holds the engine (one job at a time) from enter to exit."""

    def __init__(self, engine: Engine, kind: str, spec, inputs, deadlines: Deadlines):
        self.engine, self.kind, self.spec, self.inputs, self.deadlines = engine, kind, spec, inputs, deadlines
        self.job_id: int | None = None
        self.calls = 0
        self.result: JobResult | None = None   # the job's result, once ended
        self.call_s: list[float] = []          # each call's time as the caller saw it (write, compute, read)
        self._watch: _Watch | None = None

    def __enter__(self) -> "Session":
        self.engine._lock.acquire()
        try:
            t_submit = time.perf_counter()
            self.job_id, self._crc, t_ready, t_written = self.engine._send_job(self.kind, self.spec, self.inputs,
                                                                               self.deadlines)
            self._times = (t_submit, t_ready, t_written)
            self._watch = _Watch(self.engine.world, self.job_id)
        except BaseException:
            self.engine._lock.release()
            raise
        return self

    def call(self, inputs: dict[str, torch.Tensor], **meta) -> dict[str, torch.Tensor]:
        """One call: `inputs` through shared memory and `meta` (small JSON values) to the ranks; rank 0's outputs."""
        if self._watch is None or self.result is not None:
            raise RuntimeError("the session is not open: use it inside its with-block")
        engine, job_id = self.engine, self.job_id
        t0 = time.perf_counter()
        self.calls += 1
        call = self.calls
        path = os.path.join(engine.engine_dir, f"j{job_id}-c{call}-in")
        try:
            manifest = bridge.write_segment(path, inputs) if inputs else None
            doc = json.dumps({"call": call, "meta": meta, "entries": manifest["entries"] if manifest else []},
                             sort_keys=True, separators=(",", ":"))
            engine._chans[0].send({"op": "call", "job_id": job_id, "call": call, "doc": doc,
                                   "segment": {"path": path, "nbytes": manifest["nbytes"]} if manifest else None})
            answer = engine._await_job(job_id, self.deadlines, None, None, self._watch, call=call)
            outputs = bridge.read_segment(answer["outputs"]) if answer.get("outputs") else {}
        except (ChannelClosed, OSError) as e:
            engine._fail(f"control channel failed: {e}")
            raise EngineError(f"job {job_id}: the engine's control channel failed during call {call} ({e}); the "
                              f"ranks will be replaced", phase="compute") from e
        finally:
            bridge.unlink_quietly(path)
            if engine.engine_dir:
                bridge.unlink_quietly(os.path.join(engine.engine_dir, f"j{job_id}-c{call}-out"))
        self.call_s.append(time.perf_counter() - t0)
        return outputs

    def __exit__(self, exc_type, exc, tb):
        engine = self.engine
        try:
            if self._watch is not None and not self._watch.final and engine._broken is None:
                try:
                    end = json.dumps({"call": 0, "end": True, "aborted": exc_type is not None, "entries": []})
                    engine._chans[0].send({"op": "call", "job_id": self.job_id, "call": 0, "doc": end,
                                           "segment": None})
                except (ChannelClosed, OSError):
                    pass
            if engine._broken is None:
                try:
                    self.result = engine._collect(self.job_id, self._crc, self._watch, self.deadlines, None, None,
                                                  self._times)
                except BaseException:
                    if exc_type is None:
                        raise
            else:
                engine._unlink_job_files(self.job_id)
        finally:
            engine._lock.release()
        return False
