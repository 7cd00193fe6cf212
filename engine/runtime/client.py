"""The engine client: lives in the caller's process (ComfyUI's), owns the rank group (group.py), submits jobs, follows
them to the end and returns their outputs. It is never a rank and never joins the process group.

Every wait has a deadline (watch.py); a dead, silent, stalled or late rank becomes an EngineError naming the rank,
the phase and the step, and the group is replaced before the next job.
"""
from __future__ import annotations

import glob
import json
import os
import selectors
import time
import torch

from . import bridge
from .. import wording
from ..errors import EngineError, JobCancelled
from .group import RankGroup
from .protocol import ChannelClosed, ProtocolError
from .session import Session
from .watch import PHASES, Deadlines, JobResult, JobWatch

__all__ = ["Deadlines", "Engine", "JobResult", "Session"]


class Engine(RankGroup):
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

    # ---- jobs ----------------------------------------------------------------------------------
    def submit(self, kind: str, spec: dict | None = None, inputs: dict[str, torch.Tensor] | None = None, *,
               on_progress=None, should_cancel=None, deadlines: Deadlines | None = None,
               output_bytes: int = 0) -> JobResult:
        """Run one job on all ranks and return its outputs. Blocks; callbacks run on this thread.

        on_progress(step, total) is called as rank 0 reports steps; should_cancel() is polled about
        every 0.1 s and, once true, the ranks stop together at their next step boundary (JobCancelled).
        If a callback raises, the job is cancelled the same way and the exception re-raised.
        Jobs on one engine run one at a time; a second caller waits for the first. output_bytes: what the job's
        outputs will take in shared memory beside its inputs (checked before anything is written).
        """
        with self._lock:
            return self._submit(kind, spec, inputs, on_progress, should_cancel, deadlines, output_bytes)

    def _submit(self, kind, spec, inputs, on_progress, should_cancel, deadlines, output_bytes=0) -> JobResult:
        t_submit = time.perf_counter()
        deadlines = deadlines or self.deadlines
        job_id, crc, t_ready, t_written = self._send_job(kind, spec, inputs, deadlines, output_bytes)
        return self._collect(job_id, crc, JobWatch(self.world, job_id), deadlines, on_progress, should_cancel,
                             (t_submit, t_ready, t_written))

    def _send_job(self, kind, spec, inputs, deadlines, output_bytes: int = 0) -> tuple[int, int, float, float]:
        """Write the job's inputs to shared memory and tell every rank; returns (job id, crc32, times). A group found
        going down while the job is being handed over (a rank gone, or its directory) is replaced and the job sent
        to the new one: the old group is killed whole, so no rank of it runs the job. Shared memory too small for the
        inputs and `output_bytes` is refused first, in one line (SharedMemoryFull), the ranks untouched."""
        deadlines.validate()
        inputs = dict(inputs or {})
        spec = dict(spec or {})
        for attempt in range(2):
            self._ensure_healthy()
            bridge.check_room(f"this {kind} job (its inputs and outputs)",
                              bridge.layout(inputs)[1] + int(output_bytes), self.engine_dir)
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
                    message = {"op": "job", "job_id": job_id, "crc32": crc,   # grace: how long a failed job's
                               "error_grace_s": deadlines.error_grace_s,    # ranks may take to agree it ended
                               "stale_meshes": self._stale_meshes}
                    if rank == 0:
                        message.update(doc=doc, segment=segment)
                    chan.send(message)
            except bridge.SharedMemoryFull:
                bridge.unlink_quietly(segment_path)
                raise
            except (ChannelClosed, OSError) as e:
                bridge.unlink_quietly(segment_path)
                going = self._idle_problem() if attempt == 0 else None
                if going:
                    self._replace_idle_group(going)
                    continue
                self._fail(f"control channel failed: {e}")
                raise EngineError(f"job {job_id}: the engine's control channel failed ({e}); the ranks will be "
                                  f"replaced", phase="sent") from e
            self._stale_meshes = []
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
        steps = [t["step_s"] for t in rank_t if "step_s" in t]
        if steps:   # a steady step after the first, on the slowest rank
            timings["step_s"] = max(steps)
        return JobResult(outputs=outputs, timings=timings, ranks=[r["info"] for r in reports],
                         job_id=job_id, crc32=crc)

    def _end_session(self, job_id: int, watch: "JobWatch", aborted: bool) -> None:
        """Tell every rank still serving session `job_id` that it has ended (each then finishes its job and reports). A
        rank held in a collective by a failed one does not hear it, and is handled by the error grace as in a job."""
        chans = self._chans if self.calls_by_shared_memory else self._chans[:1]
        if watch.final and not self.calls_by_shared_memory:
            chans = []   # rank 0 relays calls to the ranks on other machines, and it has ended
        end = json.dumps({"call": 0, "end": True, "aborted": aborted, "entries": []})
        for rank, chan in enumerate(chans):
            if rank not in watch.final and rank not in watch.ended:
                watch.ended.add(rank)
                try:
                    chan.send({"op": "call", "job_id": job_id, "call": 0, "doc": end, "segment": None})
                except (ChannelClosed, OSError):
                    pass

    def _unlink_job_files(self, job_id: int) -> None:
        if self.engine_dir:
            for path in glob.glob(os.path.join(self.engine_dir, f"j{job_id}-*")):
                bridge.unlink_quietly(path)

    def session(self, kind: str, spec: dict | None = None, inputs: dict[str, torch.Tensor] | None = None, *,
                deadlines: Deadlines | None = None) -> "Session":
        """Start a job that answers calls (e.g. one model evaluation each) until the caller ends it; use as a
        context manager: `with engine.session("model", spec, inputs) as s: out = s.call({"x": x}, held={})`.
        The engine serves nothing else meanwhile. Leaving the block ends the job; an exception in the block ends it
        too (the ranks stop serving and stay up) and is re-raised."""
        return Session(self, kind, spec, inputs, deadlines or self.deadlines)

    def _await_job(self, job_id: int, deadlines: Deadlines, on_progress, should_cancel, watch: "JobWatch",
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
                        elif op == "failing":   # the rank winds the job down with the others (rank.py), then reports
                            self._relay_failure(job_id, watch, rank, m, now, call)
                        elif op in ("done", "error", "cancelled"):
                            final[rank] = m
                            if op == "error" and watch.first_error_at is None:
                                watch.first_error_at = now
                                if call is not None:   # a session's rank failed: the others stop waiting for calls
                                    self._end_session(job_id, watch, aborted=True)
                now = time.monotonic()
                if watch.first_error_at is not None and len(final) < self.world and \
                        now - watch.first_error_at > deadlines.error_grace_s:
                    # a rank's error, else what a rank said as it began to wind the job down
                    r, m = next(iter([(r, m) for r, m in sorted(final.items()) if m["op"] == "error"] or
                                     sorted(watch.failing.items())))
                    self._fail(f"rank {r} failed in phase {m['phase']}; others did not finish")
                    raise self._rank_error(job_id, r, m, "; the ranks will be replaced before the next job")
                self._check_deadlines(job_id, deadlines, watch, now)
        finally:
            sel.close()
        self._failures = 0   # every rank answered: the group is sound, whatever the job's outcome
        # the failing rank's own report first (the others may only say they stopped with it)
        errors = sorted(((r, m) for r, m in final.items() if m["op"] == "error"),
                        key=lambda e: (bool(e[1].get("secondary")), e[0]))
        unsound = next((r for r, m in errors if m.get("unsound")), None)
        for _, m in errors:   # a failed job's mesh, dropped by its ranks: every rank drops it before the next job
            if m.get("dropped_plan") and m["dropped_plan"] not in self._stale_meshes:
                self._stale_meshes.append(m["dropped_plan"])
        if unsound is not None:   # a failed job's ranks did not agree that it ended in time: out of step
            self._fail(f"rank {unsound} could not agree with the others that job {job_id} ended")
        if caller_error is not None:
            raise caller_error
        if errors:  # every rank answered and agreed, so the group is back in step and stays up
            then = ""
            if unsound is not None:
                then = "; the ranks will be replaced before the next job"
            elif any("wind_down_s" in m for _, m in errors):   # the job's ranks ended it together (rank.py)
                then = "; every rank of the job stopped with it, and the ranks stay up with their whole weights" + (
                    " (weights divided over its ranks are read again)" if "shard" in errors[0][1].get("plan", "")
                    else "")
            raise self._rank_error(job_id, *errors[0], then)
        if any(m["op"] == "cancelled" for m in final.values()):
            steps = sorted({m.get("step") for m in final.values() if m["op"] == "cancelled"})
            raise JobCancelled(f"job {job_id} cancelled at step {steps[0]}; the engine is ready", step=steps[0])
        if call is not None:
            raise EngineError(f"job {job_id}: the ranks ended the job without answering call {call}", phase="compute")
        return [final[r] for r in range(self.world)]

    def _relay_failure(self, job_id: int, watch: "JobWatch", failed: int, m: dict, now: float,
                       call: int | None) -> None:
        """A rank's part of the job failed (`m`: its error, as its report will say) and it is winding the job down: the
        error grace starts now, and every other rank hears it once (on GPUs each aborts its own communicators of the
        job: rank.py `_abort`); a session's ranks stop waiting for calls."""
        watch.failing.setdefault(failed, m)
        if watch.first_error_at is None:
            watch.first_error_at = now
        if not watch.aborted:
            watch.aborted = True
            for rank, chan in enumerate(self._chans):
                if rank != failed and rank not in watch.final:
                    try:
                        chan.send({"op": "abort", "job_id": job_id})
                    except (ChannelClosed, OSError):
                        pass   # a rank gone: the channel's close is read and named next
        if call is not None:
            self._end_session(job_id, watch, aborted=True)

    def _check_deadlines(self, job_id: int, deadlines: Deadlines, watch: "JobWatch", now: float) -> None:
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
                          f"load_s_per_gib" if name == "load" else wording.say("compute deadline")
                          if name == "compute" else f"deadline {name}_s")
                raise EngineError(f"job {job_id}: rank {rank} exceeded the {name} deadline during "
                                  f"{watch.where(rank)} ({limit:g} s, {detail}); the ranks will be replaced",
                                  rank=rank, phase=name)

    def _rank_error(self, job_id: int, rank: int, m: dict, then: str) -> EngineError:
        """A rank's error report as the caller sees it; an out-of-memory one says what the rank held, and on which
        device."""
        at = f" at step {m['step']}" if m.get("step") is not None else ""
        if m.get("oom"):
            mem = m.get("memory") or {}
            held = (f"; it held {mem['peak_gib']:.1f} GiB at peak, the device {mem['device_used_gib']:.1f} of "
                    f"{mem['device_total_gib']:.1f} GiB" if "device_total_gib" in mem else
                    f"; its peak RSS was {mem['peak_rss_gib']:.1f} GiB" if "peak_rss_gib" in mem else "")
            where = f" (cuda:{self.gpus[rank]})" if self.device == "cuda" and self.gpus and rank < len(self.gpus) \
                else f" ({self.device})"
            at += f" under {m['plan']}" if m.get("plan") else ""
            return EngineError(f"job {job_id}: rank {rank}{where} ran out of memory in phase {m['phase']}{at}: "
                               f"{m['message'].splitlines()[0]}{held}{then}", rank=rank, phase=m["phase"], oom=True,
                               memory=mem)
        return EngineError(f"job {job_id}: rank {rank} failed in phase {m['phase']}{at}: {m['message']}{then}",
                           rank=rank, phase=m["phase"])
