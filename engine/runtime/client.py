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
from .launch import kill_all, log_tail, rank_env, signal_name, spawn_rank
from .protocol import Channel, ChannelClosed, ProtocolError

MAX_RANKS = 8
PHASES = ("sent", "broadcast", "compute", "return")


@dataclass(frozen=True)
class Deadlines:
    """Seconds. A phase that runs past its deadline, or a busy rank silent past `heartbeat_s`, fails the job."""

    start_s: float = 180.0       # all ranks up and the process group formed
    broadcast_s: float = 120.0   # job received and verified on every rank ("sent" counts here too)
    compute_s: float = 3600.0    # the job itself
    return_s: float = 120.0      # results written to shared memory
    heartbeat_s: float = 15.0    # a busy rank that says nothing for this long is hung
    error_grace_s: float = 3.0   # after one rank fails, how long the others get to report
    shutdown_s: float = 10.0

    def for_phase(self, phase: str) -> float:
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
    """

    def __init__(self, ranks: int = 1, *, device: str = "cpu", gpus: list[int] | None = None,
                 deadlines: Deadlines | None = None, heartbeat_interval_s: float = 0.5,
                 collective_timeout_s: float = 1800.0, rank_stdio: str = "log", start: bool = True):
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
        if rank_stdio not in ("log", "inherit"):
            raise ValueError(f"rank_stdio={rank_stdio!r} is invalid: use 'log' or 'inherit'")
        self.world = ranks
        self.device = device
        self.gpus = gpus
        self.deadlines = deadlines or Deadlines()
        self.deadlines.validate()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.collective_timeout_s = collective_timeout_s
        self.rank_stdio = rank_stdio
        self.generation = 0          # how many times the rank group was (re)started
        self.restarts: list[str] = []  # why each replacement happened
        self._procs: list[subprocess.Popen] = []
        self._chans: list[Channel] = []
        self.engine_dir: str | None = None
        self.rank_info: list[dict] = []
        self._broken: str | None = None
        self._job_ids = itertools.count(1)
        self._finalizer = None
        self._lock = threading.RLock()  # one job (or lifecycle change) at a time
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

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
        env = rank_env(self.gpus if self.device == "cuda" else None)
        threads = max(1, (os.cpu_count() or 1) // self.world)
        self._finalizer = weakref.finalize(self, kill_all, self._procs, self._chans, self.engine_dir)
        pgid = 0
        try:
            for rank in range(self.world):
                log = os.path.join(self.engine_dir, f"rank{rank}.log") if self.rank_stdio == "log" else None
                proc, chan = spawn_rank(env, pgid, log)
                pgid = pgid or proc.pid  # all ranks share one process group, led by rank 0
                self._procs.append(proc)
                self._chans.append(chan)
                chan.send({"op": "init", "rank": rank, "world": self.world,
                           "backend": "nccl" if self.device == "cuda" else "gloo",
                           "local_device": rank, "engine_dir": self.engine_dir, "store_path": store_path,
                           "heartbeat_interval_s": self.heartbeat_interval_s,
                           "collective_timeout_s": self.collective_timeout_s, "threads": threads})
            self.rank_info = self._wait_ready()
        except BaseException:
            self._teardown()
            raise
        self._broken = None

    def _wait_ready(self) -> list[dict]:
        ready: dict[int, dict] = {}
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
                            if message.get("op") == "ready":
                                ready[rank] = message
                    except ChannelClosed as e:
                        if isinstance(e, ProtocolError):
                            raise EngineError(f"rank {rank} broke the control protocol during start-up ({e})",
                                              rank=rank, phase="start") from None
                        status = self._reap(rank)
                        raise EngineError(f"rank {rank} exited during start-up ({status})"
                                          f"{self._log_tail(rank)}", rank=rank, phase="start") from None
        finally:
            sel.close()
        return [ready[r] for r in range(self.world)]

    def _reap(self, rank: int, timeout_s: float = 2.0) -> str:
        try:
            self._procs[rank].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        return signal_name(self._procs[rank].poll())

    def _log_tail(self, rank: int) -> str:
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
        else:
            self.close()

    def _ensure_healthy(self) -> None:
        if not self._procs:
            self.start()
            return
        if self._broken:
            self.restart(self._broken)
            return
        dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
        if dead:
            self.restart(f"rank {dead[0]} had exited while idle ({signal_name(self._procs[dead[0]].poll())})")

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
        """Write the job's inputs to shared memory and tell every rank; returns (job id, crc32, times)."""
        deadlines.validate()
        inputs = dict(inputs or {})
        spec = dict(spec or {})
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
            self._fail(f"control channel failed: {e}")
            raise EngineError(f"job {job_id}: the engine's control channel failed ({e}); the ranks will be "
                              f"replaced", phase="sent") from e
        return job_id, crc, t_ready, t_written

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
        kill_all(self._procs, [], None)

    def _await_job(self, job_id: int, deadlines: Deadlines, on_progress, should_cancel, watch: "_Watch",
                   call: int | None = None) -> list[dict] | dict:
        """Follow the job's ranks until each has finished (the reports, rank order) or, with `call`, until rank 0
        answers that call (its answer). Every wait has a deadline; a dead, silent or late rank fails the job."""
        phase, phase_start, last_seen, final = watch.phase, watch.phase_start, watch.last_seen, watch.final
        if call is not None:  # between calls nobody read the ranks' heartbeats: they count from now
            now = time.monotonic()
            for rank in last_seen:
                last_seen[rank] = now
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
                        where = phase[rank] if rank not in final else "after finishing its part"
                        if isinstance(e, ProtocolError):  # garbage from a live rank: as broken as a dead one
                            self._fail(f"rank {rank} broke the control protocol: {e}")
                            raise EngineError(f"job {job_id}: rank {rank} broke the control protocol during phase "
                                              f"{where} ({e}); the ranks will be replaced before the next job",
                                              rank=rank, phase=phase[rank]) from None
                        status = self._reap(rank)
                        self._fail(f"rank {rank} died ({status})")
                        raise EngineError(f"job {job_id}: rank {rank} died during phase {where} ({status}); "
                                          f"the ranks will be replaced before the next job{self._log_tail(rank)}",
                                          rank=rank, phase=phase[rank]) from None
                    now = time.monotonic()
                    last_seen[rank] = now
                    for m in messages:
                        if m.get("job_id", job_id) != job_id:
                            continue
                        op = m["op"]
                        if op == "phase":
                            phase[rank], phase_start[rank] = m["phase"], now
                        elif op == "answer":
                            watch.answers[m["call"]] = m
                        elif op == "progress" and on_progress is not None and caller_error is None:
                            try:
                                on_progress(m["step"], m["total"])
                            except BaseException as e:  # e.g. ComfyUI's interrupt, raised by its progress bar
                                caller_error = e
                        elif op in ("done", "error", "cancelled"):
                            final[rank] = m
                            if op == "error" and watch.first_error_at is None:
                                watch.first_error_at = now
                now = time.monotonic()
                if watch.first_error_at is not None and len(final) < self.world and \
                        now - watch.first_error_at > deadlines.error_grace_s:
                    r, m = next((r, m) for r, m in sorted(final.items()) if m["op"] == "error")
                    self._fail(f"rank {r} failed in phase {m['phase']}; others did not finish")
                    raise EngineError(f"job {job_id}: rank {r} failed in phase {m['phase']}: {m['message']}; "
                                      f"the ranks will be replaced before the next job", rank=r, phase=m["phase"])
                for rank in range(self.world):
                    if rank in final:
                        continue
                    if now - last_seen[rank] > deadlines.heartbeat_s:
                        self._fail(f"rank {rank} stopped answering in phase {phase[rank]}")
                        raise EngineError(f"job {job_id}: rank {rank} stopped answering during phase "
                                          f"{phase[rank]} (no heartbeat for {deadlines.heartbeat_s:g} s, deadline "
                                          f"heartbeat_s; pid {self._procs[rank].pid}); the ranks will be replaced",
                                          rank=rank, phase=phase[rank])
                    limit = deadlines.for_phase(phase[rank])
                    if now - phase_start[rank] > limit:
                        name = "broadcast" if phase[rank] == "sent" else phase[rank]
                        self._fail(f"rank {rank} exceeded the {name} deadline")
                        raise EngineError(f"job {job_id}: rank {rank} exceeded the {name} deadline "
                                          f"({limit:g} s, deadline {name}_s); the ranks will be replaced",
                                          rank=rank, phase=name)
        finally:
            sel.close()
        if caller_error is not None:
            raise caller_error
        errors = [(r, m) for r, m in sorted(final.items()) if m["op"] == "error"]
        if errors:  # every rank answered, so the group is back in step and stays up
            r, m = errors[0]
            raise EngineError(f"job {job_id}: rank {r} failed in phase {m['phase']}: {m['message']}",
                              rank=r, phase=m["phase"])
        if any(m["op"] == "cancelled" for m in final.values()):
            steps = sorted({m.get("step") for m in final.values() if m["op"] == "cancelled"})
            raise JobCancelled(f"job {job_id} cancelled at step {steps[0]}; the engine is ready", step=steps[0])
        if call is not None:
            raise EngineError(f"job {job_id}: the ranks ended the job without answering call {call}", phase="compute")
        return [final[r] for r in range(self.world)]


class _Watch:
    """What the client knows of a running job's ranks; a session keeps it across its calls."""

    def __init__(self, world: int, job_id: int):
        now = time.monotonic()
        self.job_id = job_id
        self.phase = {r: "sent" for r in range(world)}
        self.phase_start = dict.fromkeys(range(world), now)
        self.last_seen = dict.fromkeys(range(world), now)
        self.final: dict[int, dict] = {}
        self.answers: dict[int, dict] = {}   # call -> rank 0's answer, until taken
        self.first_error_at: float | None = None


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
