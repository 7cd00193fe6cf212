"""Job kinds the ranks run, and the context a job sees (rank, group, progress, agreed cancel)."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

HANDLERS: dict[str, Callable] = {}


def job(kind: str):
    def register(fn):
        HANDLERS[kind] = fn
        return fn
    return register


class JobCancelledSignal(Exception):
    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


class JobContext:
    """What a job handler may use. Every collective here is entered by all ranks at the same point."""

    def __init__(self, runtime, job_id: int):
        self._rt = runtime
        self.job_id = job_id
        self.rank: int = runtime.rank
        self.world: int = runtime.world
        self.group = runtime.group
        self.device: torch.device = runtime.device
        self.cache: dict = runtime.cache  # lives as long as the rank: loaded models stay between jobs
        self.info: dict = {}

    def progress(self, step: int, total: int) -> None:
        """Rank 0 reports; the client calls the caller's progress callback on the caller's thread."""
        if self.rank == 0:
            self._rt.chan.send({"op": "progress", "job_id": self.job_id, "step": step, "total": total})

    def check_cancel(self, step: int) -> None:
        """Raise on every rank at once if the client asked any rank to cancel (agreed by all_reduce MAX,
        so no rank leaves a collective the others still wait in)."""
        flag = int(self._rt.cancel_job_id == self.job_id)
        if self.world > 1:
            t = torch.tensor([flag], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = int(t.item())
        if flag:
            raise JobCancelledSignal(step)


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
    blocks = {kind: len({k.split(".")[k.split(".").index(kind) + 1] for k in keys if f".{kind}." in f".{k}"})
              for kind in ("double_blocks", "single_blocks", "joint_blocks")}
    ctx.info["checkpoint"] = {"tensors": len(keys), "parameters": numel,
                              **{k: v for k, v in blocks.items() if v}}
    return inputs if ctx.rank == ctx.world - 1 else None


@job("generate")
def generate(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """One KSampler run of a FLUX/SD3 transformer under the job's parallel plan. The loaded model (and the mesh
    for a plan) stay in the rank for the next job."""
    from .generate import model_key
    from .models.adapters import Conditioning, FlowAdapter
    from .models.load import load_model
    from .parallel.mesh import Mesh
    from .plan import ParallelPlan
    from .sampling.ksampler import ksample
    from .sampling.noise import prepare_noise

    plan = ParallelPlan(**spec.get("plan", {}))
    plan.check_world(ctx.world)
    mesh = None
    if ctx.world > 1:
        meshes = ctx.cache.setdefault("meshes", {})
        plan_key = tuple(sorted(plan.as_dict().items()))
        if plan_key not in meshes:
            meshes[plan_key] = Mesh(plan, ctx.rank, ctx.world)  # collective: every rank builds the same groups
        mesh = meshes[plan_key]
        mesh.stats.reset()
    fp8 = bool(spec.get("fp8_weights", False))
    key = model_key(spec["model"], spec["dtype"], fp8)
    cache = ctx.cache.setdefault("models", {})
    if cache.get("key") != key:
        if cache.get("adapter") is not None:
            cache["adapter"].close()
        cache.clear()  # one model per rank group: a new model replaces the old one
        cache.update(key=key, loaded=load_model(spec["model"], dtype=spec["dtype"], device=ctx.device,
                                                fp8_weights=fp8))
        ctx.info["loaded"] = cache["loaded"].stats
    if cache.get("mesh_of_adapter", "none") is not mesh:
        if cache.get("adapter") is not None:
            cache["adapter"].close()
        cache.update(adapter=FlowAdapter(cache["loaded"], mesh), mesh_of_adapter=mesh)
    adapter = cache["adapter"]
    if spec.get("loras") or cache.get("lora_state", {}).get("touched"):
        from .models.lora import apply_loras
        ctx.info.update(apply_loras(cache["loaded"], [tuple(x) for x in spec.get("loras", [])],
                                    cache.setdefault("lora_state", {})))

    latent_raw = inputs["latent_raw"].float()
    noise = prepare_noise(latent_raw, spec["seed"], spec.get("batch_index"))  # the whole batch's, as ComfyUI draws it
    cond, pooled = inputs["cond"], inputs["pooled"]
    neg_cond, neg_pooled = inputs.get("neg_cond"), inputs.get("neg_pooled")
    batch = latent_raw.shape[0]
    if mesh is not None and mesh["dp"].size > 1:  # data parallel: this dp group's contiguous share of the batch
        per = batch // mesh["dp"].size
        items = slice(mesh["dp"].rank * per, (mesh["dp"].rank + 1) * per)
        pick = lambda t: t[items] if t is not None and t.shape[0] == batch else t  # noqa: E731
        latent_raw, noise, cond, pooled, neg_cond, neg_pooled = map(pick, (latent_raw, noise, cond, pooled,
                                                                           neg_cond, neg_pooled))
    positive = Conditioning(cond, pooled, spec.get("guidance"))
    negative = Conditioning(neg_cond, neg_pooled, spec.get("guidance")) if neg_cond is not None else None

    def on_step(step_index: int, total: int) -> None:
        ctx.progress(step_index + 1, total)
        ctx.check_cancel(step_index + 1)

    ctx.check_cancel(0)
    samples = ksample(adapter.predictor(positive, negative), latent_raw.to(ctx.device), family=adapter.family,
                      seed=spec["seed"], steps=spec["steps"], cfg=spec["cfg"], sampler=spec["sampler"],
                      scheduler=spec["scheduler"], denoise=spec["denoise"], noise=noise.to(ctx.device),
                      callback=on_step)
    if mesh is not None:
        samples = mesh.all_gather(samples, "dp", dim=0, kind="dp_gather")
        ctx.info["bytes_sent_per_step"] = {k: v / spec["steps"] for k, v in mesh.stats.sent.items()}
    ctx.info["model"] = {"variant": adapter.loaded.info.variant, "layout": adapter.loaded.info.layout}
    ctx.info["memory"] = rank_memory(ctx.device)
    return {"samples": samples.cpu()} if ctx.rank == 0 else None


def rank_memory(device: torch.device) -> dict:
    """This rank's own memory (measured here: asking from the client would open CUDA contexts in ComfyUI)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            out["rss_gib"] = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        out["allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        free, total = torch.cuda.mem_get_info(device)
        out["device_used_gib"], out["device_total_gib"] = (total - free) / 2**30, total / 2**30
    return out


@job("comm_probe")
def comm_probe(ctx: JobContext, spec: dict, inputs: dict[str, torch.Tensor]):
    """One denoising step's communication at full model size, attention arithmetic skipped: every attention layer
    sends full-size bf16 Q/K/V through the sequence-parallel entry point, then the per-step gathers run as the
    adapter runs them. Returns the bytes this rank sent, per kind."""
    from .parallel.attention import SequenceParallelAttention
    from .parallel.mesh import Mesh
    from .plan import ParallelPlan

    plan = ParallelPlan(**spec["plan"])
    mesh = Mesh(plan, ctx.rank, ctx.world)
    attention = SequenceParallelAttention(mesh, comm_only=True)
    sp = mesh["sp"].size
    batch = spec["batch_per_forward"]
    image, text, heads, head_dim = spec["image_tokens"], spec["text_tokens"], spec["heads"], spec["head_dim"]
    text_split = spec["text_split"] and text % sp == 0
    gen = torch.Generator().manual_seed(ctx.rank)

    def shard(n: int) -> torch.Tensor:
        return torch.randn(batch, n, heads, head_dim, generator=gen).to(torch.bfloat16)

    for _ in range(spec["attention_layers"]):
        if text_split:
            q, k, v = (shard((image + text) // sp) for _ in range(3))
            attention(q, k, v)
        else:
            q, k, v = (shard(image // sp) for _ in range(3))
            joint = tuple(shard(text) for _ in range(3))
            attention(q, k, v, joint=joint)
    out = torch.zeros(batch, image // sp, spec["out_features"], dtype=torch.bfloat16)
    mesh.all_gather(out, "sp", dim=1, kind="sp_gather")
    if plan.cfg == 2:
        mesh.all_gather(torch.zeros(1, 16, spec["latent_h"], spec["latent_w"]), "cfg", dim=0, kind="cfg_gather")
    ctx.info["sent"] = dict(mesh.stats.sent)
    return None
