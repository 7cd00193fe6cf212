"""Job kinds the ranks run, and the context a job sees (rank, group, progress, agreed cancel)."""
from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import JobCancelledSignal, JobStoppedSignal
from .. import syncs
from . import ending, faults

HANDLERS: dict[str, Callable] = {}
MESHES_KEPT = 3   # plans whose meshes (and their NCCL communicators, with their buffers) a rank keeps


def _process_groups() -> int | None:
    """How many process groups this process holds now, as torch.distributed counts them (its default group
    included)."""
    try:
        from torch.distributed import distributed_c10d
        return len(distributed_c10d._world.pg_map)
    except (AttributeError, ImportError):
        return None


def job(kind: str):
    def register(fn):
        HANDLERS[kind] = fn
        return fn
    return register


def rank_memory(device: torch.device) -> dict:
    """A rank's own memory, GiB: RSS and its high-water mark; on CUDA what torch holds, its peak and the device's use."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("VmRSS", "VmHWM"))}
        out["rss_gib"] = int(status["VmRSS"]) / 2**20
        out["peak_rss_gib"] = int(status["VmHWM"]) / 2**20   # the process's high-water mark
    except (OSError, KeyError):
        pass
    if device.type == "cuda":
        out["allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        free, total = torch.cuda.mem_get_info(device)
        out["device_used_gib"], out["device_total_gib"] = (total - free) / 2**30, total / 2**30
    return out


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator failing (a job too large for the host)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e))


class JobContext:
    """What a job handler may use. Every collective here is entered by all ranks at the same point."""

    def __init__(self, runtime, job_id: int):
        self._rt = runtime
        self.job_id = job_id
        self.rank: int = runtime.rank
        self.world: int = runtime.world
        self.group = runtime.group
        self.device: torch.device = runtime.device
        self.local_ranks: int = int(runtime._init.get("machine_ranks") or runtime.world)   # ranks on this machine
        self.cache: dict = runtime.cache  # lives as long as the rank: loaded models stay between jobs
        self.info: dict = {}
        # who agrees on cancelling: every rank, until the job's mesh says the plan runs on fewer (`mesh`); they agree
        # over a group of their own in host memory (gloo, also beside NCCL), so the agreement never touches a device
        self.job_world: int = self.world
        self.job_group = self.group
        self.control_group = runtime.control_group
        self._agreement = None   # (work, states) of the agreement posted at the last check, still unread
        self.step_clock: list[float] = []   # when each step's progress came (host time, every rank)
        self.taking_part = True   # False on a rank the job's plan leaves idle: it is in none of the job's agreements
        self.agreed = False       # this rank's failure was raised where every rank of the job agreed (no wind-down
        #                           needs its mesh torn down: it left no peer waiting in a collective)
        self.job_mesh = None      # the job's mesh, while this rank runs the job on it
        self.dropped_plan = None  # the plan whose mesh this rank dropped after a failure (the idle ranks drop theirs
        #                           before the next job: forget_meshes)
        self._dropped = None      # the job's mesh once torn down after a failure (its control group ends later)

    def mesh(self, plan):
        """The rank mesh for `plan`, its byte counters reset for this job. The last MESHES_KEPT plans' meshes are kept;
        building one and destroying the least recently used are collectives, and every rank runs the same jobs in the
        same order, so every rank builds and destroys the same meshes at the same point."""
        from ..parallel.mesh import Mesh

        meshes = self.cache.setdefault("meshes", OrderedDict())
        if plan in meshes:
            meshes.move_to_end(plan)
        else:
            while len(meshes) >= MESHES_KEPT:
                _, dropped = meshes.popitem(last=False)
                dropped.destroy()
                self.cache["meshes_destroyed"] = self.cache.get("meshes_destroyed", 0) + 1
            meshes[plan] = Mesh(plan, self.rank, self.world, self.device.type)
        mesh = meshes[plan]
        self.info["meshes"] = {"kept": len(meshes), "destroyed": self.cache.get("meshes_destroyed", 0),
                               "plan_communicators": mesh.communicators,
                               "communicators": sum(m.communicators for m in meshes.values()),
                               "process_groups": _process_groups()}
        mesh.stats.reset()
        if mesh.active:   # only the ranks that run the job enter its per-step collectives
            self.job_world, self.job_group = plan.world_size, mesh.job_pg
            self.control_group = mesh.control_pg or self._rt.control_group
            self.job_mesh = mesh
        else:
            self.info["idle"] = True
            self.taking_part = False
        return mesh

    def drop_mesh(self, end: float) -> bool:
        """After a failure: tear the job's mesh down (Mesh.abort) and forget it, with what holds its communicators (a
        model's parallel form over it, weights divided over it: the "mesh_users" releases the job kinds register in the
        rank's cache), so a peer waiting in one of its collectives fails at once; the next job of the plan builds its
        mesh anew. Whole weights stay. False: the communicators were not let go of by `end` (monotonic)."""
        mesh, self.job_mesh = self.job_mesh, None
        if mesh is None:
            return True
        meshes = self.cache.get("meshes", {})
        for plan in [p for p, m in meshes.items() if m is mesh]:
            del meshes[plan]
            self.cache["meshes_destroyed"] = self.cache.get("meshes_destroyed", 0) + 1
        for release in self.cache.get("mesh_users", {}).values():
            release(self, mesh)
        self.job_group = None
        self._dropped, self.dropped_plan = mesh, mesh.plan
        return ending.let_go([mesh.abort()], end)

    def reset_peak_memory(self) -> None:
        """The next memory() reports this job's peak, not the process's."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory(self) -> dict:
        """This rank's own memory (measured here: asking from the client would open CUDA contexts in ComfyUI)."""
        return rank_memory(self.device)

    def enter_phase(self, phase: str, **detail) -> None:
        """The job moves to `phase` ("load" with bytes=N: reading N bytes of weights; "compute"): the client applies
        that phase's deadline from now."""
        self._rt.enter_phase(self.job_id, phase, **detail)
        faults.fire(self._rt.fault, self.rank, phase)

    def progress(self, step: int, total: int) -> None:
        """Rank 0 reports; the client calls the caller's progress callback on the caller's thread. Every rank notes the
        step: its heartbeats carry it, so a stall names the step."""
        self._rt.step = step
        self.step_clock.append(time.perf_counter())
        syncs.step(step)
        if self.rank == 0:
            self._rt.chan.send({"op": "progress", "job_id": self.job_id, "step": step, "total": total})

    def steady_step_s(self, end: float) -> float | None:
        """Seconds per step after the first (which also compiles, tunes kernels and fills caches), up to `end` (the
        job's end, when the device has finished); None for a job of fewer than two steps."""
        if len(self.step_clock) < 2:
            return None
        return (end - self.step_clock[0]) / (len(self.step_clock) - 1)

    def cancel_requested(self) -> bool:
        """This rank's own view (no collective): has the client asked to cancel this job?"""
        return self._rt.cancel_job_id == self.job_id

    @property
    def deadline_s(self) -> float:
        """How long any one wait for another rank may take (the process group's collective timeout)."""
        return float(self._rt._init.get("collective_timeout_s", 1800.0))

    def calls(self, device: torch.device | None = None, read: bool = True, host=None):
        """Serve a session (client: Engine.session): yields (call, meta, tensors) on every rank, in the same order,
        until the client ends it; answer each with answer(). Each rank waits at most the collective timeout for the
        next call. device: the call's tensors arrive there, in one copy; host: a test of a tensor's key, true for those
        wanted in host memory instead (values read on the host: read there, they make the device wait for nothing);
        read False: a rank that takes no part in the calls gets none."""
        while True:
            received = self._rt.next_call(self.job_id, self.deadline_s, device, read, host)
            if received is None:
                return
            if read:   # a session's call is its step: a fault armed for "step" k fires at call k
                faults.fire(self._rt.fault, self.rank, "step", received[0])
            yield received

    def answer(self, call: int, outputs: dict[str, torch.Tensor] | None, clock=None, **info) -> None:
        """A call's outputs (rank 0's are returned; the others' are ignored) and small JSON facts about it. clock: the
        call's CallClock (model_call.py), started when its inputs were on this rank's device: rank 0 reports the
        model's time (`model_s`) and its own from then to the outputs written back (`rank_s`)."""
        self._rt.answer_call(self.job_id, call, outputs, info, clock)

    def check_cancel(self, step: int) -> None:
        """Raise on every rank of the job at once if the client asked any of them to cancel (`cancel_agreed`)."""
        if self.cancel_agreed(step):
            raise JobCancelledSignal(step)

    def cancel_agreed(self, step: int) -> bool:
        """Has the job agreed to stop here? Call at the same checks on every rank of the job (once per step).

        No rank waits for the others, nor for its device: each posts its own view (has the client asked to cancel?) as
        an all-reduce MAX of a flag in host memory over the job's control group, and acts on the agreement it posted
        at the check before, which every rank has posted too and which is complete by now. So a cancel that arrives
        during step k stops the job at the check after step k+1 (within about a step), on every rank at the same
        check, and no rank leaves a collective the others still wait in. One rank needs no agreement: it stops at
        the next check. The same agreement carries a failure: a rank that failed posts it (`wind_down`), and every
        rank that reads it at a check stops there (JobStoppedSignal) and winds down with it."""
        self._rt.step = step
        asked = self._rt.cancel_job_id == self.job_id
        if self.job_world == 1:
            agreed = asked
        else:
            work, mine = self._post(ending.CANCEL if asked else ending.GO)
            previous, self._agreement = self._agreement, (work, mine)
            agreed = False
            if previous is not None:
                previous[0].wait()   # the control group's own deadline (the collective timeout) bounds it
                states = previous[1].tolist()
                self._stop_if_failed(states)
                agreed = ending.CANCEL in states
            if agreed:
                self._stop_if_failed(self.settle())   # a rank that failed in the same step: a failure, not a cancel
        if not agreed:
            faults.fire(self._rt.fault, self.rank, "step", step)
        return agreed

    def _post(self, state: int):
        """Post this rank's state to the job's agreement (all-reduce MAX over the control group, one slot a rank):
        (work, states)."""
        mine = syncs.in_host_memory(torch.zeros(self.job_world, dtype=torch.int64))
        mine[self.rank] = state
        return dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True), mine

    def _stop_if_failed(self, states: list[int] | None) -> None:
        if states is not None and ending.stopped(states):
            self.agreed = True
            raise JobStoppedSignal(f"{ending.cause(states, self._rt.step)}; this rank stopped with it")

    def stop_here(self, stopped: bool = False, failure: BaseException | None = None) -> None:
        """A point every rank of the job reaches (the end of a model load, a calibration's phase), where they agree at
        once, waiting for each other, whether to go on: each says whether it was asked to cancel (or `stopped`, e.g.
        its load cut short by the cancel) and whether it failed (`failure`, e.g. out of memory loading its weights).
        If any failed, the failing ranks raise their own error and the others JobStoppedSignal; else if any was asked
        to cancel, every rank raises JobCancelledSignal. So no rank is left waiting in a collective for one that
        failed, and every rank keeps what it holds. A blocking agreement, for the long parts of a job before its steps
        (a step's cancel check never waits: cancel_agreed)."""
        if failure is not None:
            state = ending.OUT_OF_MEMORY if is_out_of_memory(failure) else ending.FAILED
        else:
            state = ending.CANCEL if stopped or self.cancel_requested() else ending.GO
        states = [state]
        if self.job_world > 1:
            work, mine = self._post(state)
            work.wait()
            states = mine.tolist()
        if ending.stopped(states):
            self.agreed = True
            if failure is not None:
                raise failure
            raise JobStoppedSignal(f"{ending.cause(states, None)} before the job's first step; this rank stopped "
                                   f"with it")
        if ending.CANCEL in states:
            raise JobCancelledSignal(self._rt.step or 0)

    def settle(self) -> list[int] | None:
        """Complete the agreement posted at the last check (every rank of the job posted it), so the control group
        is in step for the next job; its states (None: none was posted). A cancel calls it before raising."""
        if self._agreement is None:
            return None
        (work, mine), self._agreement = self._agreement, None
        work.wait()
        return mine.tolist()

    def finish(self) -> None:
        """When the handler returns, on every rank of the job: settle, then agree once more, waiting for each other,
        that every rank ended well. A rank that failed after its last check (or a job without checks) is read here,
        and the others stop with it (JobStoppedSignal) instead of reporting done while it waits for them."""
        states = self.settle()
        if self.taking_part and self.job_world > 1:
            work, mine = self._post(ending.GO)
            work.wait()
            states = mine.tolist()
        self._stop_if_failed(states)

    def wind_down(self, state: int, deadline_s: float) -> list[int] | None:
        """After this rank's part of the job failed (`state`, ending.py): tear the job's mesh down unless the failure
        was raised where every rank agreed (a peer may wait in one of its collectives), then post the state at every
        agreement until one shows every rank of the job stopped, then drop the mesh on every rank if any rank tore its
        own down (the next job's mesh is then built anew everywhere, in step). The agreed states; None when it did
        not end by `deadline_s` (a peer never joined: the group is out of step and the client replaces it). Every
        wait keeps the deadline."""
        if self.job_world == 1:
            return [state]
        end = time.monotonic() + deadline_s
        if not self.agreed and self.job_mesh is not None:
            state |= ending.TORN
            if not self.drop_mesh(end):
                return None
        pending, self._agreement = self._agreement, None
        states = ending.agree_stopped(lambda: self._post(state), pending, end)
        if states is None:
            return None
        if ending.torn(states) and self.job_mesh is not None and not self.drop_mesh(end):
            return None
        if self._dropped is not None:   # its control group, last: every rank of the job is past the agreement
            self._dropped.destroy()
            self._dropped = None
        return states



@job("echo")
def echo(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """Return the inputs as this rank received them, from `return_rank`. Optional `steps` with
    `step_sleep_s` make a job that takes time, reports progress and can be cancelled; `raise_on_rank`
    makes one rank fail at `raise_at_step`, for the engine's own fault tests."""
    steps = int(spec.get("steps", 0))
    for step in range(steps):
        ctx.check_cancel(step)
        time.sleep(float(spec.get("step_sleep_s", 0.0)))
        if spec.get("raise_on_rank") == ctx.rank and step == int(spec.get("raise_at_step", 0)):
            raise RuntimeError(f"echo job told to fail on rank {ctx.rank} at step {step}")
        ctx.progress(step + 1, steps)
    if ctx.rank == int(spec.get("return_rank", 0)):
        return inputs
    return None


@job("echo_calls")
def echo_calls(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """A session that answers each call with its tensors times `scale` (meta) plus this rank's count of calls, summed
    over the ranks: what the engine's own tests check the call path with. `raise_on_rank` at call `raise_at_call`
    makes one rank fail mid-session."""
    served = 0
    for call, meta, tensors in ctx.calls():
        served += 1
        if spec.get("raise_on_rank") == ctx.rank and call == int(spec.get("raise_at_call", 0)):
            raise RuntimeError(f"echo_calls job told to fail on rank {ctx.rank} at call {call}")
        count = torch.tensor([float(served)])
        if ctx.world > 1:
            dist.all_reduce(count, group=ctx.group)
        ctx.answer(call, {**{k: v * float(meta.get("scale", 1.0)) for k, v in tensors.items()}, "served": count})
    ctx.info["calls"] = served
    return {"base": inputs["base"]} if ctx.rank == 0 and "base" in inputs else None


@job("inspect")
def inspect_checkpoint(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """Each rank opens the checkpoint itself (header only, streamed with safe_open) and reports what it
    holds; the inputs come back from the last rank, as a model job's result would."""
    from safetensors import safe_open

    with safe_open(spec["path"], "pt") as f:
        keys = list(f.keys())
        numel = 0
        for k in keys:
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            numel += n
    blocks: dict[str, set] = {}
    for k in keys:   # "<list>.<index>." in the file's own layout, e.g. double_blocks.3. or joint_blocks.0.
        m = re.match(r"(?:.*\.)?([a-z_]+blocks)\.(\d+)\.", k)
        if m:
            blocks.setdefault(m.group(1), set()).add(m.group(2))
    ctx.info["checkpoint"] = {"tensors": len(keys), "parameters": numel,
                              "blocks": {name: len(ids) for name, ids in sorted(blocks.items())}}
    return inputs if ctx.rank == ctx.world - 1 else None


@job("generate")
def generate(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """One KSampler run of a transformer under the job's plan (engine/generate)."""
    from ..generate.request import GenerateRequest
    from ..generate.run import run_generate
    from ..models.lora import WeightPatches

    if isinstance(spec, dict) and set(spec) == {"request", "patches"}:   # with a ComfyUI MODEL's LoRA patches
        patches = WeightPatches.from_job(spec["patches"], inputs, ctx.cache)
        spec, inputs = spec["request"], {k: v for k, v in inputs.items() if not k.startswith("patch.")}
        return run_generate(ctx, GenerateRequest.from_job(spec, inputs), patches)
    return run_generate(ctx, GenerateRequest.from_job(spec, inputs))


@job("model")
def model(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """The engine as ComfyUI's diffusion model: one model call per session call (engine/generate/model_call.py)."""
    from ..generate.model_call import run_model
    from ..generate.request import GenerateRequest
    from ..models.lora import WeightPatches

    if not isinstance(spec, dict) or set(spec) != {"request", "patches"}:
        raise ValueError(f"model job document is malformed: keys {sorted(spec) if isinstance(spec, dict) else spec!r}, "
                         f"expected request and patches (client and ranks differ in version?)")
    request_inputs = {k: v for k, v in inputs.items() if not k.startswith("patch.")}
    return run_model(ctx, GenerateRequest.from_job(spec["request"], request_inputs),
                     WeightPatches.from_job(spec["patches"], inputs, ctx.cache))


@job("calibrate")
def calibrate(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """Measure this rank's device, its links to the others and a model's step on it (engine/runtime/calibrate.py)."""
    from .calibrate import measure

    measure(ctx, spec)
    return None


@job("comm_probe")
def comm_probe(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """One denoising step's communication at full model size, attention arithmetic skipped (engine/parallel/comm)."""
    from ..parallel.comm import probe_step
    from ..parallel.plan import ParallelPlan

    mesh = ctx.mesh(ParallelPlan.from_dict(spec["plan"]))
    if mesh.active:   # a plan on fewer ranks than the engine: the others idle
        ctx.info["sent"] = probe_step(mesh, spec)
    return None


@job("vae_decode")
def vae_decode(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """A VAE decode, each rank its band of rows of every frame (engine/vae/job.py)."""
    from ..vae.job import run_vae
    return run_vae(ctx, spec, inputs, "decode")


@job("vae_encode")
def vae_encode(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """A VAE encode, each rank its band of rows of every frame (engine/vae/job.py)."""
    from ..vae.job import run_vae
    return run_vae(ctx, spec, inputs, "encode")


@job("vae_tiles")
def vae_tiles(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """Whole tiles of a VAE decode or encode spread over the ranks, each on the unsplit network (engine/vae/tiles.py)."""
    from ..vae.tiles import run_pool
    return run_pool(ctx, spec, inputs)


@job("vae_layer")
def vae_layer(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """One row-split VAE layer on each rank's band, for the layers' own tests (engine/vae/job.py)."""
    from ..vae.job import run_layer
    return run_layer(ctx, spec, inputs)
