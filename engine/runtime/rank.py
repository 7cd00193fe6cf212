"""One rank process: joins the process group, receives jobs from rank 0's broadcast, runs them, and
returns results through the bridge. Started by the client (client.py) as `python -m engine.runtime.rank --fd N`.

Threads: the main thread runs jobs; a reader thread takes control messages off the socket (so a
cancel arrives while a job runs); a ticker thread sends heartbeats while busy and notices when the
client is gone. When the client dies (EOF or a new parent) the rank removes the engine's shared
memory and kills its whole rank group, so no rank outlives its client, stopped ones included.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from . import bridge, ending, faults
from .. import syncs, wording
from .launch import pin_process
from ..errors import SESSION_IDLE, EngineError, JobCancelledSignal, JobStoppedSignal
from .jobs import HANDLERS, JobContext, is_out_of_memory, rank_memory
from .protocol import Channel, ChannelClosed, ProtocolError


class RankRuntime:
    def __init__(self, chan: Channel, init: dict):
        self.chan = chan
        self.rank: int = init["rank"]
        self.world: int = init["world"]
        self.backend: str = init["backend"]
        self.engine_dir: str = init["engine_dir"]
        self.heartbeat_interval_s: float = init["heartbeat_interval_s"]
        self.ppid = os.getppid()
        self.inbox: queue.Queue = queue.Queue()
        self.busy = False
        self.starting = True          # heartbeats flow from start-up on, so a rank stopped in it is seen
        self.phase: str | None = None  # of the running job, for reports and heartbeats
        self.step: int | None = None   # the last step the running job reached on this rank
        self.fault = faults.from_env()
        self.cancel_job_id: int | None = None
        self.ctx: JobContext | None = None   # the running job's context
        self.stopping = False
        self.cache: dict = {}
        self._answers: dict[int, bridge.OutputSegment] = {}   # a session's answer segment, by job
        if self.backend == "nccl":
            # Before init_process_group, and no device_id: see FIELD_NOTES (xDiT #735).
            torch.cuda.set_device(init["local_device"])
            self.device = torch.device("cuda", init["local_device"])
        else:
            self.device = torch.device("cpu")
            if init.get("cores"):   # Engine(pin_cpus=True): this rank's own cores, before its thread pool grows
                pin_process(init["cores"])
            torch.set_num_threads(max(1, int(init.get("threads", 1))))
        self.group = None
        self.control_group = None   # host-memory (gloo) group of every rank: per-step agreements (jobs.py)
        self._init = init

    def connect(self) -> None:
        """Join the process group (none at world size 1: no collective, no send, ever)."""
        init = self._init
        if self.world > 1:
            timeout = timedelta(seconds=init["collective_timeout_s"])
            if init.get("tcp_store"):  # ranks on several machines: the client's TCPStore, one prefix per generation
                where = init["tcp_store"]
                store = dist.PrefixStore(where["prefix"], dist.TCPStore(where["host"], where["port"], None, False,
                                                                        timeout))
            else:
                store = dist.FileStore(init["store_path"], self.world)
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                    timeout=timeout)
            self.group = dist.group.WORLD
            self.control_group = dist.new_group(backend="gloo", timeout=timeout)

    # ---- threads -------------------------------------------------------------------------------
    def start_threads(self) -> None:
        threading.Thread(target=self._reader, name="xdit-reader", daemon=True).start()
        threading.Thread(target=self._ticker, name="xdit-ticker", daemon=True).start()

    def _reader(self) -> None:
        try:
            while True:
                message = self.chan.recv()
                if message.get("op") == "cancel":
                    self.cancel_job_id = message.get("job_id")
                elif message.get("op") == "abort":
                    self._abort(message.get("job_id"))
                else:
                    self.inbox.put(message)
        except BaseException as e:  # closed, or garbage on the channel (ProtocolError): the client is broken
            if not self.stopping:
                if not isinstance(e, ChannelClosed) or isinstance(e, ProtocolError):
                    print(f"rank {self.rank}: control channel from the client is broken ({type(e).__name__}: {e}); "
                          f"taking the rank group down", file=sys.stderr, flush=True)
                self._client_gone()

    def _abort(self, job_id: int | None) -> None:
        """The client says a rank of job `job_id` failed (its "failing" report). On GPUs this rank's main thread may be
        held by a collective of the job's mesh queued on its device, which the failed rank will never enter: NCCL
        peers on one machine do not notice a peer's abort by themselves, so each rank aborts its own communicators
        here, on the reader thread, and the main thread goes on to the job's next agreement, which carries the
        failure. Gloo needs nothing here: the failed rank letting go of its communicators fails the waits."""
        ctx = self.ctx
        mesh = ctx.job_mesh if ctx is not None and ctx.job_id == job_id else None
        if mesh is not None:
            mesh.abort_communicators()

    def _ticker(self) -> None:
        while True:
            time.sleep(self.heartbeat_interval_s)
            if os.getppid() != self.ppid and not self.stopping:
                self._client_gone()
            if self.busy or self.starting:
                try:
                    self.chan.send({"op": "hb", "phase": self.phase, "step": self.step})
                except (ChannelClosed, OSError):
                    pass

    def _client_gone(self) -> None:
        """The client died: release shared memory and take the whole rank group down with us."""
        bridge.remove_engine_dir(self.engine_dir)
        try:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(0)

    # ---- jobs ----------------------------------------------------------------------------------
    def serve(self) -> None:
        self.starting = False
        self.chan.send({"op": "ready", "rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                        "backend": self.backend if self.world > 1 else "none", "torch": torch.__version__})
        while True:
            message = self.inbox.get()
            op = message.get("op")
            if op == "shutdown":
                self.stopping = True
                return
            if op == "job":
                self.run_job(message)

    def enter_phase(self, job_id: int, phase: str, **detail) -> None:
        """Tell the client this rank's job is now in `phase` (its deadline starts now); detail: e.g. the bytes a load
        reads, which scale its deadline."""
        self.phase = phase
        self.chan.send({"op": "phase", "job_id": job_id, "phase": phase, **detail})

    def run_job(self, message: dict) -> None:
        job_id = message["job_id"]
        self.busy = True
        self.step = None
        self.ctx = None
        report = None
        try:
            ending.forget_meshes(self.cache, message.get("stale_meshes", []))
            report, state = self._run(job_id, message)
            # a failure's exception and the frames of the failed step are released by now, so what they held (the
            # step's tensors, the job's communicators) can go
            if report is not None:
                if state is not None:
                    self._wind_down(report, state, float(message.get("error_grace_s", 3.0)))
                self.chan.send(report)
                # what a cycle still holds of the failed job's activations goes back to the device before this rank
                # takes its next job (after the report: a full collection takes a while)
                import gc
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            segment = self._answers.pop(job_id, None)
            if segment is not None:   # the session's answer segment: its last answer was read before the end
                segment.close()
            self.busy = False
            self.phase = None
            self.ctx = None
            if self.cancel_job_id == job_id:
                self.cancel_job_id = None

    def _run(self, job_id: int, message: dict) -> tuple[dict | None, int | None]:
        """Run the job and report it done or cancelled; a failure comes back as its report, with the state this rank
        winds down with (ending.py) when it took part in a job of several ranks (None: it reports at once)."""
        timings = {}
        try:
            self.enter_phase(job_id, "broadcast")
            faults.fire(self.fault, self.rank, "broadcast")
            t0 = time.perf_counter()
            doc, manifest, buf = self._receive_job(message)
            crc = bridge.checksum(doc.encode(), bridge.payload_crc(buf, manifest))
            self._verify_job(job_id, message["crc32"], crc)
            timings["broadcast_s"] = time.perf_counter() - t0
            job = json.loads(doc)
            if job["job_id"] != job_id:
                raise EngineError(f"rank {self.rank} was told job {job_id} but received job {job['job_id']}",
                                  rank=self.rank, phase=self.phase)
            handler = HANDLERS.get(job["kind"])
            if handler is None:
                raise EngineError(f"job kind {job['kind']!r} is unknown to the ranks; known: {sorted(HANDLERS)}")
            inputs = bridge.tensors_from_buffer(buf, manifest)

            self.enter_phase(job_id, "compute")
            t0 = time.perf_counter()
            ctx = self.ctx = JobContext(self, job_id)
            outputs = handler(ctx, job["spec"], inputs)
            ctx.finish()
            t_end = time.perf_counter()
            timings["compute_s"] = t_end - t0
            step_s = ctx.steady_step_s(t_end)
            if step_s is not None:
                timings["step_s"] = step_s

            self.enter_phase(job_id, "return")
            t0 = time.perf_counter()
            out_manifest = None
            if outputs:
                path = os.path.join(self.engine_dir, f"j{job_id}-out-r{self.rank}")
                out_manifest = bridge.write_segment(path, outputs, checksum=False)
            faults.fire(self.fault, self.rank, "return")
            timings["return_s"] = time.perf_counter() - t0
            self.chan.send({"op": "done", "job_id": job_id, "timings": timings, "outputs": out_manifest,
                            "info": {"rank": self.rank, "job_id": job_id, "crc32": crc, **ctx.info}})
            return None, None
        except JobCancelledSignal as e:
            self.chan.send({"op": "cancelled", "job_id": job_id, "phase": self.phase, "step": e.step})
            return None, None
        except Exception as e:  # reported to the client, which decides whether the group is still sound
            out_of_memory = is_out_of_memory(e)
            report = {"op": "error", "job_id": job_id, "phase": self.phase, "step": self.step,
                      "message": f"{type(e).__name__}: {e}" if not isinstance(e, EngineError) else str(e),
                      "traceback": traceback.format_exc(limit=20),
                      "secondary": isinstance(e, JobStoppedSignal)}   # stopped because another rank failed
            if out_of_memory:  # what the device held when it ran out: the client names a plan that needs less
                report.update(oom=True, memory=rank_memory(self.device))
            ctx = self.ctx
            if ctx is None or not ctx.taking_part or ctx.job_world == 1 or self.phase == "return":
                return report, None
            state = ending.state_of(e, out_of_memory)
            if ctx.job_mesh is not None:
                report["plan"] = wording.plan(ctx.job_mesh.plan)
            if state != ending.STOPPED:   # the client starts its grace now and tells every rank the job failed
                self.chan.send({**report, "op": "failing", "traceback": ""})
            return report, state

    def _wind_down(self, report: dict, state: int, deadline_s: float) -> None:
        """Every rank of the failed job stops together and keeps its models (JobContext.wind_down): the report says
        which rank's failure ended the job, or that the rank group is out of step (`unsound`: the client replaces
        it)."""
        t0 = time.perf_counter()
        states = self.ctx.wind_down(state, deadline_s)
        report["wind_down_s"] = time.perf_counter() - t0
        if self.ctx.dropped_plan is not None:   # the client tells every rank at the next job (forget_meshes)
            report["dropped_plan"] = self.ctx.dropped_plan.as_dict()
        if states is None:
            report["unsound"] = True
            return
        first = ending.first_failure(states)
        if ending.code(state) == ending.STOPPED and first is not None and first != self.rank:
            report.update(secondary=True, message=f"JobStoppedSignal: {ending.cause(states, self.step)}; this rank "
                                                  f"stopped with it ({report['message'].splitlines()[0][:200]})")

    def _receive_job(self, message: dict) -> tuple[str, dict, torch.Tensor]:
        """Rank 0 reads the job from shared memory and broadcasts document + payload to all ranks."""
        if self.rank == 0:
            doc = message["doc"]
            segment = message["segment"]
            payload = bridge.map_buffer(segment) if segment else torch.empty(0, dtype=torch.uint8)
            if self.world == 1:
                return doc, self._manifest(doc, segment), payload
            raw = doc.encode()
            doc_bytes = torch.zeros(-(-len(raw) // bridge.ALIGN) * bridge.ALIGN, dtype=torch.uint8)
            doc_bytes[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            # sizes: document, document padded (the payload stays aligned for typed views), payload
            sizes = torch.tensor([len(raw), doc_bytes.numel(), payload.numel()], dtype=torch.int64)
        else:
            sizes = torch.zeros(3, dtype=torch.int64)
        sizes = self._bcast(sizes)
        n_doc, n_padded, n_payload = (int(v) for v in sizes)
        if self.rank == 0:
            data = torch.cat([doc_bytes, payload])
        else:
            data = torch.empty(n_padded + n_payload, dtype=torch.uint8)
        data = self._bcast(data)
        doc = bytes(data[:n_doc].numpy()).decode()
        segment = {"nbytes": n_payload} if n_payload else None
        return doc, self._manifest(doc, segment), data[n_padded:]

    def next_call(self, job_id: int, timeout_s: float, device: torch.device | None = None,
                  read: bool = True, host=None) -> tuple[int, dict, dict[str, torch.Tensor]] | None:
        """A session's next call on every rank. With every rank on this machine each takes the call from the client
        and maps its segment itself; otherwise rank 0 takes it and broadcasts it like a job. device: the call's
        tensors go there in one copy of the whole segment (the one upload a call needs); read False: this rank takes
        no part in the calls (a plan on fewer ranks) and leaves the tensors unread; host: a test of a tensor's key,
        true for those returned as views of the call's host buffer instead (still copied with the rest: one upload).
        Returns (call, meta, tensors), or None when the client ended the session."""
        message: dict = {}
        direct = self._init.get("calls_by_shared_memory", False)
        if self.rank == 0 or direct:
            try:
                message = self.inbox.get(timeout=timeout_s)
            except queue.Empty:
                raise EngineError(f"job {job_id}: {SESSION_IDLE} for {timeout_s:g} s (the collective timeout); the "
                                  f"session ends", rank=self.rank, phase="compute") from None
            if message.get("op") != "call" or message.get("job_id") != job_id:
                raise EngineError(f"job {job_id}: expected a call, the client sent {message.get('op')!r} for job "
                                  f"{message.get('job_id')}", rank=self.rank, phase="compute")
        if direct:
            doc, segment = message["doc"], message["segment"]
            if segment and not read:
                bridge.unlink_quietly(segment["path"])
            buf = syncs.in_host_memory(bridge.map_buffer(segment, unlink=True)) if segment and read else \
                torch.empty(0, dtype=torch.uint8)
            manifest = self._manifest(doc, segment)
        else:
            doc, manifest, buf = self._receive_job(message)
        header = json.loads(doc)
        if header.get("end"):
            return None
        if not read:
            return header["call"], header["meta"], {}
        in_host = syncs.in_host_memory(buf)
        if device is not None and buf.numel():
            with syncs.call_transfer():
                buf = buf.to(device)   # the whole call at once: one copy, typed views of it on the device
        tensors = bridge.tensors_from_buffer(buf, manifest)
        if host is not None and buf is not in_host:
            on_host = bridge.tensors_from_buffer(in_host, manifest)
            tensors.update({k: t for k, t in on_host.items() if host(k)})
        return header["call"], header["meta"], tensors

    def answer_call(self, job_id: int, call: int, outputs: dict[str, torch.Tensor] | None, info: dict,
                    clock=None) -> None:
        """Rank 0 returns a call's outputs through shared memory, each copied once, from the device straight into the
        session's answer segment (the same file every call: the client copies an answer out before the next call);
        the other ranks have nothing to say."""
        if self.rank != 0:
            return
        manifest = None
        if outputs:
            segment = self._answers.get(job_id)
            if segment is None:
                segment = self._answers[job_id] = bridge.OutputSegment(
                    os.path.join(self.engine_dir, f"j{job_id}-answers"))
            with syncs.call_transfer():
                manifest = segment.write(outputs)
        if clock is not None:   # the outputs are on the host: the device has finished the call
            with syncs.call_transfer():
                info = dict(info, model_s=clock.model_s(), rank_s=time.perf_counter() - clock.started)
        self.chan.send({"op": "answer", "job_id": job_id, "call": call, "outputs": manifest, "info": info})

    @staticmethod
    def _manifest(doc: str, segment: dict | None) -> dict:
        entries = json.loads(doc)["entries"]
        return {"entries": entries, "nbytes": segment["nbytes"] if segment else 0}

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend == "nccl":
            dev = t.to(self.device)
            dist.broadcast(dev, src=0, group=self.group)
            return dev.cpu()
        dist.broadcast(t, src=0, group=self.group)
        return t

    def _verify_job(self, job_id: int, client_crc: int, crc: int) -> None:
        """Every rank checks its copy against the client's checksum, then all ranks compare notes."""
        if self.world == 1:
            if crc != client_crc:
                raise EngineError(f"job {job_id}: rank 0 read a job with crc32 {crc:08x}, the client wrote "
                                  f"{client_crc:08x}; shared memory was altered", rank=0, phase="broadcast")
            return
        mine = torch.tensor([job_id, crc, int(crc == client_crc)], dtype=torch.int64)
        everyone = torch.zeros(self.world * 3, dtype=torch.int64)
        if self.backend == "nccl":
            mine, everyone = mine.to(self.device), everyone.to(self.device)
        dist.all_gather_into_tensor(everyone, mine, group=self.group)
        rows = everyone.cpu().view(self.world, 3).tolist()
        bad = [r for r, (jid, c, ok) in enumerate(rows) if jid != job_id or not ok]
        if bad:
            detail = ", ".join(f"rank {r}: job {rows[r][0]} crc32 {rows[r][1]:08x}" for r in bad)
            raise EngineError(f"job {job_id}: ranks disagree on the job (client crc32 {client_crc:08x}; {detail})",
                              rank=bad[0], phase="broadcast")


def main(argv: list[str]) -> None:
    fd = int(argv[argv.index("--fd") + 1])
    chan = Channel(socket.socket(fileno=fd))
    init = chan.recv()
    runtime = RankRuntime(chan, init)
    runtime.start_threads()  # first, so a client that dies during rendezvous still takes us down
    chan.send({"op": "hello", "rank": runtime.rank, "pid": os.getpid()})
    faults.fire(runtime.fault, runtime.rank, "start")
    runtime.connect()
    runtime.serve()
    if runtime.group is not None:
        dist.destroy_process_group()
    chan.close()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
