"""One rank's share of a parallel plan, timed on one device, and the plan's time projected from it.

The share is the rank's real work: its generate job (its tokens and heads, its ring blocks, its CFG pass or batch
share, the sampler every rank runs) through the engine's own loop, or a PipeFusion stage's blocks on each patch against
a full K/V buffer. It runs inside a stand-in process group of the plan's world size in which this process is the rank
and every collective is a local operation of the same shapes: torch's fake process group, where all-gathers copy the
rank's input into every slot, all-to-alls copy input to output, all-reduces and broadcasts leave the tensor as it is,
and sends and receives move nothing (a ring's incoming K/V keeps whatever its new buffer held, so its values are
garbage; the kernels, their shapes and the host's work are a real rank's, and only the step cache, which compares
values, decides on what this rank sees). The projection adds the link time the planner's link model gives for the
plan's collectives (cost.comm_ms) to the share's time, and for PipeFusion assembles the job as the planner does
(warmup steps through the stages in turn, steady steps at the slowest stage, the pipeline's fill).

`serve` is the worker process `python -m engine bench project` starts (`python -m engine.parallel.projection`): JSON
commands on stdin, one result line on stdout each.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..generate.request import GenerateRequest
from ..generate.run import run_generate
from ..models.flow import Conditioning, FlowModel
from ..models.load import inspect_model, load_model
from ..models.speed import release_model_memory
from ..parallel import cost
from ..parallel.devices import Interconnect
from ..parallel.pipefusion.layout import make_layout, stage_keep
from ..parallel.pipefusion.pipeline import Pipeline
from ..parallel.plan import ParallelPlan, Workload
from .jobs import JobContext
from .launch import pin_process

RESULT = "share: "   # the prefix of the worker's result lines (anything else on stdout is not ours)


# ---- the rank a stand-in world runs ------------------------------------------------------------------------------
class _NoClient:
    """A control channel nobody reads: progress reports from rank 0 go nowhere."""

    def send(self, message: dict) -> None:
        pass


class ShareRuntime:
    """What a JobContext reads of its rank (runtime/rank.py's RankRuntime), for rank `rank` of a stand-in world of
    `world` ranks in this process. The loaded model stays in `cache` between jobs, as on a rank."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cache: dict = {}
        self.cancel_job_id = None
        self.step = None
        self.fault = None
        self._init: dict = {}
        self.chan = _NoClient()
        self.rank, self.world, self.group = 0, 1, None
        self.control_group = None   # the per-step cancel agreement's group (the stand-in world's own)
        self.last_info: dict = {}   # what the last job reported (its JobContext.info), bytes per collective included

    def join(self, world: int, rank: int) -> None:
        """Become rank `rank` of a stand-in world of `world` (one rank: no process group, as on a real engine)."""
        if (world, rank) == (self.world, self.rank):
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.cache.pop("meshes", None)   # their groups belonged to the old world
        if world > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dist.init_process_group("fake", rank=rank, world_size=world)
        self.world, self.rank = world, rank
        self.group = self.control_group = dist.group.WORLD if world > 1 else None

    def enter_phase(self, job_id: int, phase: str, **detail) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def share_request(fields: dict, plan: ParallelPlan):
    """The benchmark's generate request (random conditioning drawn as `bench overhead` draws it) under `plan`."""

    fields = dict(fields)
    model, width, height = fields.pop("model"), fields.pop("width"), fields.pop("height")
    text_tokens, batch = fields.pop("text_tokens", None), fields.pop("batch", 1)
    request = GenerateRequest.random_conditioning(model, width, height, text_tokens=text_tokens, batch=batch,
                                                  plan=plan, **fields)
    return request.validate(plan.world_size)


def time_job(rt: ShareRuntime, request, repeats: int, warmups: int = 1, rank: int = 0) -> list[float]:
    """Seconds of rank `rank`'s generate job under the request's plan, `repeats` times after `warmups` untimed runs."""

    if rt.cache.pop("stage", None):   # one model at a time on the device
        release_model_memory(rt.device)
    rt.join(request.plan.world_size, rank)
    times = []
    for i in range(warmups + repeats):
        ctx = JobContext(rt, i)
        _sync(rt.device)
        t0 = time.perf_counter()
        run_generate(ctx, request)
        _sync(rt.device)
        times.append(time.perf_counter() - t0)
        rt.last_info = ctx.info
    return times[warmups:]


def time_stage(rt: ShareRuntime, request, stage: int, repeats: int) -> dict:
    """A PipeFusion stage's share: its blocks on the whole latent (a warmup call, which fills the K/V buffers) and on
    every patch in turn against those full buffers (a steady step), `repeats` times after one untimed round. The last
    stage's sampler step per patch (elementwise on one patch's latent) is left out.
    Returns {"whole_s": [...], "steady_s": [...]} (the steady figure is all patches of one step)."""

    plan = request.plan
    rt.join(plan.world_size, stage * plan.ring * plan.ulysses)   # mesh order: ..., pipefusion, ring, ulysses
    info = inspect_model(request.model)
    lat = request.latent_raw
    layout = make_layout(info, plan, lat.shape[-2], lat.shape[-1], request.patches, request.warmup_steps,
                         request.stage_blocks)
    mesh = JobContext(rt, 0).mesh(plan)
    key = (request.model, request.dtype, request.fp8_weights, layout.stage_blocks, stage)
    held = rt.cache.setdefault("stage", {})
    if held.get("key") != key:   # one model at a time on the device: a stage's weights replace the last ones
        held.clear()
        rt.cache.pop("generate", None)
        release_model_memory(rt.device)
        loaded = load_model(request.model, dtype=request.dtype, device=rt.device, fp8_weights=request.fp8_weights,
                            keep=stage_keep(info, layout, stage))
        held.update(key=key, flow=FlowModel(loaded))
    pipeline = Pipeline(held["flow"], mesh)
    positive = Conditioning(request.cond, request.pooled, request.guidance)
    negative = Conditioning(request.neg_cond, request.neg_pooled, request.guidance) \
        if request.neg_cond is not None else None
    try:
        pipeline.setup(layout)
        pipeline.bind(positive, negative, tuple(lat.shape), request.cfg)
        items = pipeline.items.stop - pipeline.items.start
        g = torch.Generator(device=rt.device).manual_seed(0)
        x = torch.randn((items,) + tuple(lat.shape[1:]), generator=g, device=rt.device)   # model space, first stage

        def inputs(band):   # what the stage receives for a piece (allocated before the clock starts)
            if pipeline.model.first:
                return (x if band is None else x[:, :, pipeline.model.latent_rows(band)]), None
            return None, [torch.randn(s, generator=g, device=rt.device).to(pipeline.flow.dtype)
                          for s in pipeline._piece_shapes(band)]

        pieces = {band: inputs(band) for band in [None] + list(range(layout.patches))}

        def run(band, sigma):
            x_in, received = pieces[band]
            out = pipeline.compute(band, sigma, x_in, received)
            if pipeline.model.last:   # the velocities gathered for the sampler, as the last stage does
                pipeline._velocities(out, band)

        whole, steady = [], []
        with torch.no_grad():
            for i in range(1 + repeats):
                sigma = 1.0 - (i + 1) / (repeats + 2)   # a new sigma a round: the timestep embedding is recomputed
                _sync(rt.device)
                t0 = time.perf_counter()
                run(None, sigma)
                _sync(rt.device)
                t1 = time.perf_counter()
                for band in range(layout.patches):
                    run(band, sigma)
                _sync(rt.device)
                whole.append(t1 - t0)
                steady.append(time.perf_counter() - t1)
    finally:
        pipeline.close()
        for kv in pipeline.kvs.values():
            kv.buffers.clear()
    return {"whole_s": whole[1:], "steady_s": steady[1:]}


# ---- the projection ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Projection:
    plan: ParallelPlan
    job_s: float      # the projected job (one rank's share + the link's time)
    link_s: float     # of which the link model's
    batch: int = 1

    @property
    def share_s(self) -> float:
        return self.job_s - self.link_s

    @property
    def s_per_image(self) -> float:
        return self.job_s / self.batch


def _attention_share(plan: ParallelPlan, work: Workload) -> float:
    flops, attention = cost.rank_flops(plan, work)
    return attention / flops if flops else 0.0


def project_job(plan: ParallelPlan, work: Workload, link: Interconnect, job_s: float) -> Projection:
    """A plan without PipeFusion: the rank's measured job plus, each step, the collectives the planner's link model
    prices (calls x latency + bytes / bandwidth, less what the code overlaps with the measured step)."""
    steps = max(1, work.steps)
    step_ms = job_s / steps * 1e3
    comm = cost.comm_ms(plan, work, link, step_ms * _attention_share(plan, work), cost.engine_code(), step_ms)
    link_s = steps * comm / 1e3
    return Projection(plan, job_s + link_s, link_s, work.batch)


def project_pipefusion(plan: ParallelPlan, work: Workload, link: Interconnect, whole_s: list[float],
                       steady_s: list[float]) -> Projection:
    """PipeFusion from every stage's share, assembled as the planner assembles it: each warmup step runs the whole
    latent through the stages in turn (their whole-latent times summed, plus the plan's collectives without
    PipeFusion and a hop between stages); each steady step takes the slowest stage's patches plus the plan's
    collectives; the pipeline fills once, (P - 1) / patches of a step."""
    code = cost.engine_code()
    steps = max(1, work.steps)
    warm = min(work.warmup_steps, steps)
    steady_ms = max(steady_s) * 1e3
    steady_comm = cost.comm_ms(plan, work, link, steady_ms * _attention_share(plan, work), code, steady_ms)
    whole = ParallelPlan(dp=plan.dp, cfg=plan.cfg, ulysses=plan.ulysses, ring=plan.ring)
    warm_ms = sum(whole_s) * 1e3
    hop = cost.pipefusion_step_bytes(plan, work) / (link.bandwidth_gbs * 1e9) * 1e3 + link.latency_us / 1e3
    warm_comm = cost.comm_ms(whole, work, link, warm_ms * _attention_share(whole, work), code, warm_ms) \
        + (plan.pipefusion - 1) * hop
    fill = (plan.pipefusion - 1) / cost.patches(plan, work) if steps > warm else 0.0
    steady_n = steps - warm + fill
    job_ms = warm * (warm_ms + warm_comm) + steady_n * (steady_ms + steady_comm)
    link_ms = warm * warm_comm + steady_n * steady_comm
    return Projection(plan, job_ms / 1e3, link_ms / 1e3, work.batch)


# ---- the worker process --------------------------------------------------------------------------------------------
def _answer(command: dict, rt: ShareRuntime) -> dict:
    plan = ParallelPlan.parse(command["plan"])
    request = share_request(command["request"], plan)
    if command["op"] == "job":
        times = time_job(rt, request, int(command["repeats"]), int(command.get("warmups", 1)),
                         int(command.get("rank", 0)))
        return {"times_s": times, "bytes_sent_per_step": rt.last_info.get("bytes_sent_per_step", {})}
    if command["op"] == "stages":
        stages = [time_stage(rt, request, s, int(command["repeats"]))
                  for s in command.get("stages") or range(plan.pipefusion)]
        return {"whole_s": [statistics.median(s["whole_s"]) for s in stages],
                "steady_s": [statistics.median(s["steady_s"]) for s in stages]}
    raise ValueError(f"unknown command {command['op']!r}: use job or stages")


def serve() -> None:
    """Answer commands until stdin closes. The first sets the device, threads and cores: {"op": "init", "device":
    "cpu" | "cuda", "threads": n, "cores": [...] | null}; then {"op": "job", "plan": "ulysses2", "request": {...},
    "repeats": n, "warmups": 1, "rank": 0} or {"op": "stages", "plan": "pipefusion2", "request": {...}, "repeats": n,
    "stages": [0, 1] (default: every stage)}."""

    rt = None
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "init":
                if command.get("cores"):
                    pin_process(command["cores"])
                if command["device"] == "cuda":
                    torch.cuda.set_device(0)
                    rt = ShareRuntime(torch.device("cuda", 0))
                else:
                    torch.set_num_threads(int(command["threads"]))
                    rt = ShareRuntime(torch.device("cpu"))
                reply = {"ready": True, "threads": torch.get_num_threads()}
            else:
                reply = _answer(command, rt)
        except Exception as e:   # reported to the benchmark, which names the plan
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(RESULT + json.dumps(reply), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    serve()
