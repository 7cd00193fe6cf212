"""A job that answers calls (Engine.session): the ranks keep the model loaded and answer one call at a time, e.g. one
model evaluation per call for a sampler that runs in the caller's process."""
from __future__ import annotations

import json
import os
import time

import torch

from . import bridge
from ..errors import EngineError
from .protocol import ChannelClosed
from .watch import Deadlines, JobResult, JobWatch


class Session:
    """A job that answers calls: see Engine.session (`engine` is that Engine). Holds the engine (one job at a time)
    from enter to exit."""

    def __init__(self, engine, kind: str, spec, inputs, deadlines: Deadlines):
        self.engine, self.kind, self.spec, self.inputs, self.deadlines = engine, kind, spec, inputs, deadlines
        self.job_id: int | None = None
        self.calls = 0
        self.result: JobResult | None = None   # the job's result, once ended
        self.call_s: list[float] = []          # each call's time as the caller saw it (write, compute, read)
        self.answers: list[dict] = []          # what rank 0 said of each call besides its outputs (e.g. its model_s)
        self._answer_bytes = 0                 # the largest answer so far: rank 0's answer segment holds that much
        self.ended: EngineError | None = None  # what ended the job while a call waited (the ranks' error, a deadline)
        self._watch: JobWatch | None = None

    def __enter__(self) -> "Session":
        self.engine._lock.acquire()
        try:
            t_submit = time.perf_counter()
            self.job_id, self._crc, t_ready, t_written = self.engine._send_job(self.kind, self.spec, self.inputs,
                                                                               self.deadlines)
            self._times = (t_submit, t_ready, t_written)
            self._watch = JobWatch(self.engine.world, self.job_id)
        except BaseException:
            self.engine._lock.release()
            raise
        return self

    def _call_chans(self):
        """Who is told of a call: every rank when all share this machine's memory (each maps the call's segment
        itself), else rank 0, which broadcasts it to the others."""
        chans = self.engine._chans
        return chans if self.engine.calls_by_shared_memory else chans[:1]

    def call(self, inputs: dict[str, torch.Tensor], output_bytes: int = 0, should_cancel=None,
             **meta) -> dict[str, torch.Tensor]:
        """One call: `inputs` through shared memory and `meta` (small JSON values) to the ranks; rank 0's outputs.
        output_bytes: what the answer will take in shared memory (checked with the inputs before anything is written;
        rank 0 reuses one answer segment, so only its growth counts). should_cancel: polled while the call waits; once
        true the ranks are asked to stop (a model load in the first call stops at its next tensor) and JobCancelled
        ends the session, unless the call was answered first."""
        if self._watch is None or self.result is not None:
            raise RuntimeError("the session is not open: use it inside its with-block")
        if self.ended is not None:
            raise EngineError(f"job {self.job_id}: the session has ended ({str(self.ended).splitlines()[0]}); open a "
                              f"new one", phase="compute")
        engine, job_id = self.engine, self.job_id
        bridge.check_room(f"a call of job {job_id} (its inputs and output)",
                          bridge.layout(inputs)[1] + max(0, int(output_bytes) - self._answer_bytes), engine.engine_dir)
        t0 = time.perf_counter()
        self.calls += 1
        call = self.calls
        path = os.path.join(engine.engine_dir, f"j{job_id}-c{call}-in")
        try:
            manifest = bridge.write_segment(path, inputs, checksum=False) if inputs else None
            doc = json.dumps({"call": call, "meta": meta, "entries": manifest["entries"] if manifest else []},
                             sort_keys=True, separators=(",", ":"))
            chans = self._call_chans()
            for rank, chan in enumerate(chans):
                segment = None
                if manifest:
                    # one name per rank reading it (hard links to the one segment): each rank unlinks its own name
                    # once mapped, so the bytes go when the last reader is done, and no rank can find them gone
                    mine = path if len(chans) == 1 else f"{path}-r{rank}"
                    if mine != path:
                        os.link(path, mine)
                    segment = {"path": mine, "nbytes": manifest["nbytes"]}
                chan.send({"op": "call", "job_id": job_id, "call": call, "doc": doc, "segment": segment})
            if len(chans) > 1:
                bridge.unlink_quietly(path)
            answer = engine._await_job(job_id, self.deadlines, None, should_cancel, self._watch, call=call)
            manifest = answer.get("outputs")
            outputs = {} if not manifest else bridge.copy_segment(manifest) if manifest.get("reused") else \
                bridge.read_segment(manifest)
            self._answer_bytes = max(self._answer_bytes, manifest["nbytes"] if manifest else 0)
            self.answers.append(answer.get("info") or {})
        except bridge.SharedMemoryFull:
            raise
        except EngineError as e:   # the ranks ended the job (a rank's error, a deadline): the session is over
            self.ended = e
            raise
        except (ChannelClosed, OSError) as e:
            engine._fail(f"control channel failed: {e}")
            raise EngineError(f"job {job_id}: the engine's control channel failed during call {call} ({e}); the "
                              f"ranks will be replaced", phase="compute") from e
        finally:
            bridge.unlink_quietly(path)
        self.call_s.append(time.perf_counter() - t0)
        return outputs

    def __exit__(self, exc_type, exc, tb):
        engine = self.engine
        try:
            if self._watch is not None and engine._broken is None:
                # every rank still serving is told the session ended (one that failed has reported, and those waiting
                # for its next call end too: the group stays in step, with nothing left waiting)
                engine._end_session(self.job_id, self._watch, aborted=exc_type is not None)
            if engine._broken is None:
                try:
                    self.result = engine._collect(self.job_id, self._crc, self._watch, self.deadlines, None, None,
                                                  self._times)
                except BaseException:
                    if exc_type is None and self.ended is None:   # an error a call raised is not raised twice
                        raise
            else:
                engine._unlink_job_files(self.job_id)
        finally:
            engine._lock.release()
        return False
