"""A generate job on a rank: the model loaded (or kept from the last job), the plan applied by `parallelize`,
LoRAs brought up to date, and ComfyUI's KSampler run over the predictor. No parallel branch lives here."""
from __future__ import annotations

import contextlib
import os

import torch

from ..models.flow import Conditioning, FlowModel, frame
from ..models.load import LoadStopped, held_bytes, inspect_model, load_model
from ..parallel.memory import memory_gib
from ..parallel.plan import HOST, GiB
from ..models.lora import apply_loras
from ..models.speed import attention_kernels, compiled_graphs, release_model_memory, set_compiled, set_fp8_matmul
from ..parallel.parallelize import parallelize
from ..parallel.pipefusion.layout import make_layout, stage_keep
from ..parallel.pipefusion.pipeline import Pipeline
from .. import families, syncs
from ..families.base import end_of_job
from ..parallel.shard import forget_divisions, shard_spec
from ..sampling.ksampler import ksample, reshape_mask, start_sampling
from ..sampling.noise import prepare_noise
from .request import GenerateRequest
from .residency import Held, decide, host_available_bytes


def model_key(path: str, dtype: str, fp8_weights: bool = False) -> tuple:
    """What identifies loaded weights: a changed file (mtime, size) is loaded again."""
    if path.startswith("synthetic:"):
        return (path, dtype, fp8_weights)
    st = os.stat(path)
    return (os.path.abspath(path), dtype, fp8_weights, st.st_mtime_ns, st.st_size)


def _make_room(ctx, models: dict, request: GenerateRequest, resident: bool) -> None:
    """Before every job (generate/residency.py decides, from what is measured now): the other models a rank keeps go
    to host memory or are dropped where this job and they would not fit together; `resident`: this job's model is on
    the device already. Moving a model keeps the graphs compiled around it (an expert switch compiles nothing), and
    its LoRA factors move with it (models/quantized.py)."""
    cuda = ctx.device.type == "cuda"
    others = [Held(k, held_bytes(state["loaded"].model), "host" if state.get("offloaded") else "device")
              for k, state in models.items()]
    if not others:
        return
    parts = memory_gib(request.plan, request.workload(inspect_model(request.model)), HOST)   # one model's share
    need = (parts["activations"] + (0.0 if resident else parts["weights"])) * GiB
    moves = decide(others, device=ctx.device.type, need_bytes=int(need),
                   free_bytes=torch.cuda.mem_get_info(ctx.device)[0] if cuda else None,
                   host_free_bytes=host_available_bytes() if cuda else None, local_ranks=ctx.local_ranks,
                   placement=request.expert_placement)
    apply_moves(ctx, models, moves)


def apply_moves(ctx, models: dict, moves) -> None:
    """residency.decide's moves applied to the models the rank keeps, each said in the job's report."""
    cuda = ctx.device.type == "cuda"
    for move in moves:
        state = models[move.key]
        variant = state["loaded"].info.variant
        if move.action == "drop":
            _drop(ctx, models, move.key)
        else:
            state["loaded"].model.to("cpu")
            state["offloaded"] = True
            if cuda:
                torch.cuda.empty_cache()
        ctx.info.setdefault("residency_moves", []).append(
            f"{variant}: {'moved to host memory' if move.action == 'offload' else 'dropped'} ({move.why})")


def _short_of_memory(ctx, request: GenerateRequest) -> BaseException | None:
    """Before the first step on a GPU: this job's activations, as the planner's memory model counts them, against the
    memory free on the device now (beside whatever else holds it: ComfyUI's own models, another process); an
    out-of-memory error naming the device and the figures when they do not fit (every rank then stops together)."""
    if ctx.device.type != "cuda":
        return None
    work = request.workload(inspect_model(request.model))
    need = memory_gib(request.plan, work)["activations"] * GiB
    free, total = torch.cuda.mem_get_info(ctx.device)
    free += torch.cuda.memory_reserved(ctx.device) - torch.cuda.memory_allocated(ctx.device)   # the cache's spare
    if need <= free:
        return None
    return torch.OutOfMemoryError(f"{ctx.device} has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB after this "
                                  f"rank's weights, and this job's activations need about {need / GiB:.1f} GiB (the "
                                  f"planner's estimate); nothing was run")


def _drop(ctx, models: dict, key) -> None:
    state = models.pop(key)
    if state.get("parallel") is not None:
        state["parallel"].close()
    state.clear()
    release_model_memory(ctx.device)  # its weights (and graphs compiled around them) go before the new come


def _release_mesh(ctx, mesh) -> None:
    """A mesh torn down after a failed job (runtime/jobs.py JobContext.drop_mesh): what holds its communicators goes
    now, so they close and the peers waiting in them are freed: each model's parallel form over it (applied again by
    the next job) and weights divided over it (read again by the next job, as when a mesh is dropped). Whole weights
    stay."""
    models = ctx.cache.get("models", {})
    divided = [k for k, s in models.items() if s.get("shard_mesh") is mesh]
    if divided:
        forget_divisions()   # first: the collection that drops the models then frees the communicators too
    for key in divided:
        _drop(ctx, models, key)
    for state in models.values():
        if state.get("mesh") is mesh:
            state.pop("parallel").close()
            del state["mesh"]


def _parallel_model(ctx, request: GenerateRequest, mesh, stage=None, weight_patches=None):
    """The rank keeps up to RESIDENT_MODELS models (loaded, or moved to host memory on a GPU that cannot hold them
    all) and each one's parallel form for its last mesh. stage: a PipeFusion stage's (name, keep): the rank then holds
    only what `keep` accepts. weight_patches: a ComfyUI MODEL's LoRA patches (models/lora.py WeightPatches), applied
    with the request's LoRA files."""
    models = ctx.cache.setdefault("models", {})   # model key -> its state, least recently used first
    ctx.cache.setdefault("mesh_users", {})["models"] = _release_mesh
    for old in [k for k, s in models.items() if s.get("shard_mesh") is not None and s["shard_mesh"].destroyed]:
        _drop(ctx, models, old)   # weights divided over a mesh since destroyed (jobs.py keeps the last few)
    divided = request.plan.shard > 1 and not stage
    # divided weights belong to their mesh's shard group: another plan's mesh loads its own division
    key = model_key(request.model, request.dtype, request.fp8_weights) + ((stage[0],) if stage else ()) + (
        ("shard", request.plan) if divided else ())
    state = models.pop(key, None)
    _make_room(ctx, models, request, resident=state is not None and not state.get("offloaded"))
    failure = None
    if state is None:
        inspect_model(request.model).spec.model_class()  # diffusers' modules imported before the baseline
        spec = shard_spec(mesh, families.get(inspect_model(request.model).family)) if divided else None
        ctx.info["rss_before_load_gib"] = ctx.memory().get("rss_gib")
        try:   # a cancel asked during the load (minutes for a large file) ends it at the next tensor
            # the load's deadline grows with the file (Deadlines.load_s + load_s_per_gib per GiB)
            ctx.enter_phase("load", bytes=0 if request.model.startswith("synthetic:") else
                            os.path.getsize(request.model))
            loaded = load_model(request.model, dtype=request.dtype, device=ctx.device,
                                fp8_weights=request.fp8_weights, keep=stage[1] if stage else None,
                                stop=ctx.cancel_requested, shard=spec)
        except LoadStopped:
            release_model_memory(ctx.device)
            ctx.stop_here(stopped=True)   # every rank of the job stops here with this one
            raise AssertionError("unreachable: a stopped load ends the job on every rank")
        except Exception as e:   # out of memory (or a file this rank cannot read): every rank stops with it below
            failure = e
            release_model_memory(ctx.device)
        if failure is None:
            ctx.enter_phase("compute")
            state = {"key": key, "loaded": loaded, "flow": FlowModel(loaded),
                     "shard_mesh": mesh if divided else None}
            ctx.info["loaded"] = loaded.stats
            ctx.info["model_source"] = "file"
    elif state.pop("offloaded", False):
        try:
            state["loaded"].model.to(ctx.device)
            state["flow"].device = ctx.device
            ctx.info["model_source"] = "host memory"
        except Exception as e:   # no room to bring it back: it waits in host memory still
            state["loaded"].model.to("cpu")
            state["offloaded"], failure = True, e
            release_model_memory(ctx.device)
    else:
        ctx.info["model_source"] = "resident"
    if state is not None:
        models[key] = state
    if failure is None:
        failure = _short_of_memory(ctx, request)
    # the ranks agree whether a cancel came during a load, or a rank failed before the first step (any rank's): all go
    # on, or all stop here, every rank keeping the models it holds (the next job reads no file for them)
    ctx.stop_here(failure=failure)
    ctx.info["models_resident"] = len(models)
    ctx.info["residency"] = [{"model": s["loaded"].info.variant, "file": os.path.basename(s["loaded"].path),
                              "where": "host memory" if s.get("offloaded") else str(ctx.device)}
                             for s in models.values()]
    if state.get("mesh") is not mesh:
        if state.get("parallel") is not None:
            state["parallel"].close()
        parallel = Pipeline(state["flow"], mesh) if stage else parallelize(state["flow"], mesh)
        state.update(parallel=parallel, mesh=mesh)
    if request.loras or (weight_patches is not None and weight_patches.entries) or state.get("lora_state", {}).get("touched"):
        ctx.info.update(apply_loras(state["loaded"], request.loras, state.setdefault("lora_state", {}),
                                     weight_patches))
    parallel = state["parallel"]
    blocks = parallel.block_lists if stage else parallel.table.blocks
    set_compiled(state["flow"].model, blocks, request.compile)
    set_fp8_matmul(state["flow"].model, request.fp8_matmul)
    if not stage:
        parallel.set_step_cache(request.cache_threshold or None)
    return parallel


@contextlib.contextmanager
def job_ends(model):
    """The job's sampling: what the family's forward kept with the model for it is let go at its end, whatever ends
    it (families/base.py end_of_job)."""
    try:
        yield
    finally:
        end_of_job(model)


def _sides(request: GenerateRequest) -> tuple[Conditioning, Conditioning | None]:
    extras = _pose_extras(request)

    def side(byt5):   # a side's own extras: the pose branch's (both sides), its byT5 rows
        out = {**(extras or {}), **({"txt_byt5": byt5} if byt5 is not None else {})}
        return out or None
    positive = Conditioning(request.cond, request.pooled, request.guidance, tuple(request.reference_latents or ()),
                            request.reference_latents_method, request.clip_vision_output, request.concat_latent_image,
                            request.concat_mask, side(request.byt5))
    negative = (Conditioning(request.neg_cond, request.neg_pooled, request.guidance,
                             tuple(request.neg_reference_latents or ()), request.neg_reference_latents_method,
                             request.neg_clip_vision_output, request.neg_concat_latent_image, request.neg_concat_mask,
                             side(request.neg_byt5))
                if request.neg_cond is not None else None)
    return positive, negative


def _pose_extras(request: GenerateRequest) -> dict | None:
    """Wan-Animate 2's pose inputs as ComfyUI's WAN_Animate2.extra_conds hands them to its model, for both sides (its
    node sets the same pose values on the negative): the pose latent process_in'd, the pose prompt, its CLIP-vision
    features, the strengths (one float64 a row, read on the host); None without them."""
    extras = {}
    if request.pose_latent is not None:
        fmt = inspect_model(request.model).latent
        extras["pose_latents"] = fmt.process_in(request.pose_latent.to(torch.float32))
        for name, value in (("context_pose", request.pose_cond), ("clip_fea_pose", request.pose_clip_vision_output)):
            if value is not None:
                extras[name] = value
        if request.pose_strength != 1.0:
            extras["pose_strength"] = torch.tensor([float(request.pose_strength)], dtype=torch.float64)
    if request.reference_strength != 1.0:
        extras["reference_strength"] = torch.tensor([float(request.reference_strength)], dtype=torch.float64)
    return extras or None


def _finish(ctx, request: GenerateRequest, mesh, info, samples: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The job's report (every rank) and its result (rank 0)."""
    if request.compile:
        ctx.info["compiled_graphs"] = compiled_graphs()  # the same after a later job of the same shapes: reused
    ctx.info["bytes_sent_per_step"] = {k: v / request.steps for k, v in mesh.stats.sent.items()}
    ctx.info["model"] = {"variant": info.variant, "layout": info.layout}
    ctx.info["memory"] = ctx.memory()
    return {"samples": samples.cpu()} if ctx.rank == 0 else None


def run_pipefusion(ctx, request: GenerateRequest, mesh, weight_patches=None) -> dict[str, torch.Tensor] | None:
    """A KSampler run through the PipeFusion stages: this rank loads only its stage's weights."""
    info = inspect_model(request.model)
    video = request.latent_raw.ndim == 5   # a video latent format's one frame: the stages work on the image latent
    latent_raw = frame(request.latent_raw.float())
    layout = make_layout(info, request.plan, latent_raw.shape[-2], latent_raw.shape[-1], request.patches,
                         request.warmup_steps, request.stage_blocks)
    stage = mesh["pipefusion"].rank
    keep = stage_keep(info, layout, stage)
    pipeline = _parallel_model(ctx, request, mesh, stage=((layout.stages, layout.stage_blocks, stage), keep),
                               weight_patches=weight_patches)
    noise = frame(prepare_noise(request.latent_raw.float(), request.seed, request.batch_index))   # its shape's draw
    start = start_sampling(latent_raw.to(ctx.device), sampling=request.sampling(info), latent=info.latent.image(),
                           seed=request.seed, steps=request.steps, cfg=request.cfg, sampler=request.sampler,
                           scheduler=request.scheduler, denoise=request.denoise, noise=noise.to(ctx.device))
    positive, negative = _sides(request)
    ctx.check_cancel(0)
    # a test instrument around the loop; a no-op unless the rank's environment arms it
    with syncs.loop(ctx.info, ctx.device, host=(request, latent_raw, noise)):
        pipeline.setup(layout)
        with attention_kernels(request.attention, ctx.device):
            samples = pipeline.run(ctx, start, positive, negative, latent_shape=tuple(latent_raw.shape),
                                   cfg=request.cfg, cfg_norm=request.cfg_norm, sampler=request.sampler,
                                   seed=request.seed, steps=len(start.sigmas) - 1, deadline_s=ctx.deadline_s)
    pipeline.check_headers()
    if video and samples is not None:
        samples = samples.unsqueeze(2)
    ctx.info["pipefusion"] = {"stage": stage, "blocks": list(layout.blocks_of(stage)), "patches": layout.patches,
                              "warmup_steps": layout.warmup, "stage_blocks": list(layout.stage_blocks),
                              "held_bytes": pipeline.flow.loaded.stats.get("held_bytes"),
                              "receives_ahead": pipeline.inbox.most_ahead if pipeline.inbox else 0}
    return _finish(ctx, request, mesh, info, samples)


def run_generate(ctx, request: GenerateRequest, weight_patches=None) -> dict[str, torch.Tensor] | None:
    """One KSampler run under the request's plan; rank 0 returns the LATENT samples. weight_patches: a ComfyUI
    MODEL's LoRA patches (models/lora.py WeightPatches)."""
    mesh = ctx.mesh(request.plan)
    if not mesh.active:   # the plan runs on fewer ranks than the engine has: this one idles for the job
        return None
    ctx.reset_peak_memory()
    if request.plan.pipefusion > 1:
        return run_pipefusion(ctx, request, mesh, weight_patches)
    parallel = _parallel_model(ctx, request, mesh, weight_patches=weight_patches)
    latent_raw = request.latent_raw.float()
    noise = prepare_noise(latent_raw, request.seed, request.batch_index)  # the whole batch's, as ComfyUI draws it
    positive, negative = _sides(request)
    info = parallel.flow.loaded.info
    mask = None if request.noise_mask is None else reshape_mask(request.noise_mask, tuple(latent_raw.shape)).to(
        ctx.device)

    def on_step(step_index: int, total: int) -> None:
        ctx.progress(step_index + 1, total)
        ctx.check_cancel(step_index + 1)

    ctx.check_cancel(0)
    with attention_kernels(request.attention, ctx.device), syncs.loop(ctx.info, ctx.device,
                                                                         host=(request, latent_raw, noise)), \
            job_ends(parallel.flow.model):
        syncs.start()
        samples = ksample(parallel.predictor(positive, negative, mask), latent_raw.to(ctx.device),
                          sampling=request.sampling(info), latent=info.latent, seed=request.seed,
                          steps=request.steps, cfg=request.cfg, sampler=request.sampler, scheduler=request.scheduler,
                          denoise=request.denoise, noise=noise.to(ctx.device), callback=on_step,
                          cfg_norm=request.cfg_norm, denoise_mask=mask,
                          masked_latent_clean=info.spec.masked_latent_clean(info.config), window=request.window())
    if parallel.cache is not None:
        ctx.info["step_cache"] = parallel.cache.stats.as_dict()
    return _finish(ctx, request, mesh, parallel.flow.loaded.info, samples)
