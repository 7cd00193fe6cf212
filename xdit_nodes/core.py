"""What the nodes do, without ComfyUI: the engine settings a node's inputs make, a registry of running engines keyed
by settings, and the conversion of CONDITIONING / LATENT into engine jobs and back (the node specs are in specs.py).

nodes.py only turns the specs into ComfyUI V3 schemas and passes ComfyUI's progress bar and interrupt check in;
everything testable lives here and in specs.py.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import torch

from ..engine.generate.inputs import fix_empty_latent
from ..engine.generate.request import GenerateRequest, default_dtype
from ..engine.models.load import inspect_model
from ..engine.models.speed import CUDA_ONLY
from ..engine.parallel.devices import hardware_for
from ..engine.parallel.plan import AUTO, FASTEST, MAX_RANKS, ParallelPlan
from ..engine.runtime.client import Deadlines, Engine
from ..engine.sampling.schedules import FlowSampling
from .guider import EngineGuider
from .specs import ATTENTION_KERNELS, PLANS, WEIGHT_DTYPES

# ---- engine settings and registry --------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    model_path: str
    gpus: tuple[int, ...]
    device: str = "cuda"              # "cuda" or "cpu" (ComfyUI started with --cpu, or no CUDA)
    family: str = "auto"
    weight_dtype: str = "default"
    plan: str = "auto"
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    dp: int = 1
    timeout_s: int = 3600
    loras: tuple[tuple[str, float], ...] = ()   # applied in order inside the ranks
    cache_threshold: float = 0.0      # step cache; 0 is off (per job: changing it keeps the ranks)
    compile: bool = False
    attention: str = "auto"
    pipefusion: int = 1
    patches: int = 0                  # 0: one per stage
    warmup_steps: int = 1
    sampling: tuple = ()              # xDiT Model Sampling: (kind, shift, multiplier); () the family's default
    cfg_norm: float = 0.0             # xDiT CFGNorm's strength; 0: none

    def validate(self) -> None:
        """Checks that need no rank, with errors that name the input (shown as the node's error)."""
        if not self.gpus or len(set(self.gpus)) != len(self.gpus) or min(self.gpus) < 0:
            raise ValueError(f"gpus={','.join(map(str, self.gpus))!r} is invalid: list distinct GPU indices, e.g. 0,1")
        if len(self.gpus) > MAX_RANKS:
            raise ValueError(f"gpus lists {len(self.gpus)} GPUs: the engine runs 1 to {MAX_RANKS} ranks")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} is invalid: use one of {list(WEIGHT_DTYPES)}")
        info = inspect_model(self.model_path)
        if self.family != "auto" and self.family != info.family:
            raise ValueError(f"family={self.family!r} but {self.model_path} holds a {info.variant} ({info.family}) "
                             f"transformer: use auto or {info.family}")
        if self.plan not in PLANS:
            raise ValueError(f"plan={self.plan!r} is invalid: use auto or explicit")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r} is invalid: use one of {list(ATTENTION_KERNELS)}")
        if self.device != "cuda" and self.attention in CUDA_ONLY:
            raise ValueError(f"attention={self.attention!r} needs CUDA GPUs and ComfyUI runs on the CPU: use auto")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold={self.cache_threshold} is invalid: use 0 (off) to 1")
        if self.plan == "explicit":
            self.requested_plan().check_world(len(self.gpus))

    def requested_plan(self) -> ParallelPlan | str:
        """What the engine's plan resolution gets: "auto", or the explicit degrees."""
        if self.plan == "explicit":
            return ParallelPlan(dp=self.dp, cfg=2 if self.cfg_parallel else 1, ulysses=self.ulysses, ring=self.ring,
                                pipefusion=self.pipefusion)
        return FASTEST if self.plan == "fastest" else AUTO

    def with_sampling(self, method: str, shift: float) -> "EngineSettings":
        """These settings with a sampling node's model sampling (xDiT Model Sampling)."""
        chosen = FlowSampling.node(method, float(shift))   # ValueError naming a method or shift that cannot be
        return replace(self, sampling=(chosen.kind, chosen.shift, chosen.multiplier))

    def with_cfg_norm(self, strength: float) -> "EngineSettings":
        """These settings with ComfyUI's CFGNorm at `strength` (xDiT CFGNorm)."""
        return replace(self, cfg_norm=float(strength))

    @property
    def model_sampling(self) -> dict | None:
        """The request's model sampling: the sampling node's, else None (the family's default)."""
        return dict(zip(("kind", "shift", "multiplier"), self.sampling)) if self.sampling else None

    def with_lora(self, path: str, strength: float) -> "EngineSettings":
        """These settings with one more LoRA (a LoRA node returns a new engine value; upstream ones are unchanged)."""
        if strength == 0:
            return self
        return replace(self, loras=self.loras + ((path, float(strength)),))

    @property
    def ranks_key(self) -> tuple:
        """What the running ranks depend on; model, dtype and plan change per job without a restart."""
        return (self.device, self.gpus)

    @property
    def compute_dtype(self) -> str:
        if self.weight_dtype in ("bf16", "fp16"):
            return self.weight_dtype
        return default_dtype(self.device)


@dataclass
class EngineRecord:
    engine: Engine
    settings: EngineSettings
    last_plan: str = ""
    last_plan_reason: str = ""
    last_timings: dict = field(default_factory=dict)
    last_cache: dict = field(default_factory=dict)
    last_bytes: dict = field(default_factory=dict)
    last_stages: list = field(default_factory=list)   # PipeFusion: each rank's stage, blocks and weights held
    last_memory: list = field(default_factory=list)   # what each rank measured of itself
    notes: list[str] = field(default_factory=list)


class EngineRegistry:
    """The engines running in this process, one per (device, GPU list). The only process-wide state of the pack:
    an engine must outlive a prompt (that is the point), and ComfyUI runs prompts one at a time."""

    def __init__(self):
        self._records: dict[tuple, EngineRecord] = {}
        self._lock = threading.Lock()

    def get(self, settings: EngineSettings) -> EngineRecord:
        with self._lock:
            record = self._records.get(settings.ranks_key)
            if record is None:
                deadlines = Deadlines(compute_s=float(settings.timeout_s))
                engine = Engine(len(settings.gpus), device=settings.device,
                                gpus=list(settings.gpus) if settings.device == "cuda" else None, deadlines=deadlines)
                record = self._records[settings.ranks_key] = EngineRecord(engine, settings)
            record.settings = settings
            return record

    def running(self, settings: EngineSettings) -> EngineRecord | None:
        return self._records.get(settings.ranks_key)

    def unload(self, settings: EngineSettings | None = None) -> int:
        """Stop the engine for these settings (all engines when None); returns how many were stopped."""
        with self._lock:
            keys = [settings.ranks_key] if settings is not None else list(self._records)
            stopped = 0
            for key in keys:
                record = self._records.pop(key, None)
                if record is not None:
                    record.engine.close()
                    stopped += 1
            return stopped


REGISTRY = EngineRegistry()


# ---- ComfyUI values -> engine job ----------------------------------------------------------------------------
def conditioning_tensors(conditioning, name: str) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(cond, pooled, guidance) of a CONDITIONING: a list of [cond_tensor, {"pooled_output": ..., "guidance": ...}]."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{name} is not a CONDITIONING (a list of [tensor, dict]); connect a text encoder to it")
    if len(conditioning) > 1:
        raise ValueError(f"{name} holds {len(conditioning)} conditioning entries (combined or area conditioning); the "
                         f"xDiT Sampler takes exactly one: use a single text encode")
    cond, extras = conditioning[0][0], conditioning[0][1]
    pooled = extras.get("pooled_output")   # None for families without one; the request checks it per family
    unsupported = [k for k in ("area", "mask", "control", "gligen") if extras.get(k) is not None]
    if extras.get("strength", 1.0) != 1.0:
        unsupported.append("strength")
    if (extras.get("start_percent", 0.0), extras.get("end_percent", 1.0)) != (0.0, 1.0):
        unsupported.append("start_percent/end_percent")
    if unsupported:
        raise ValueError(f"{name} carries {', '.join(unsupported)} (area, mask, ControlNet, timestep-range or "
                         f"strength conditioning), which the xDiT Sampler does not support")
    return cond, pooled, extras.get("guidance")


def conditioning_references(conditioning, name: str) -> tuple[list[torch.Tensor] | None, str]:
    """The raw VAE latents ReferenceLatent (FLUX.1 Kontext, FLUX.2) or TextEncodeQwenImageEdit appended to a
    CONDITIONING checked by conditioning_tensors, and the method FluxKontextMultiReferenceLatentMethod set ("": the
    family's default, as ComfyUI's model has it)."""
    extras = conditioning[0][1]
    refs = extras.get("reference_latents")
    if refs is not None and not isinstance(refs, (list, tuple)):
        raise ValueError(f"{name} has reference_latents of type {type(refs).__name__}: connect ReferenceLatent, "
                         f"which gives a list of latents")
    return (list(refs) if refs is not None else None), extras.get("reference_latents_method") or ""


def conditioning_images(conditioning, prefix: str = "") -> dict:
    """An image-to-video CONDITIONING's keys (WanImageToVideo, WanFirstLastFrameToVideo): the CLIP-vision features
    (clip_vision_output's penultimate_hidden_states), concat_latent_image and concat_mask, as the request's fields."""
    extras = conditioning[0][1]
    clip = extras.get("clip_vision_output")
    return {prefix + "clip_vision_output": getattr(clip, "penultimate_hidden_states", clip),
            prefix + "concat_latent_image": extras.get("concat_latent_image"),
            prefix + "concat_mask": extras.get("concat_mask")}


def job_request(settings: EngineSettings, positive, negative, latent_raw: torch.Tensor, *, cfg: float,
                seed: int = 0, steps: int = 1, sampler_name: str = "euler", scheduler: str = "simple",
                denoise: float = 1.0, batch_index=None, negative_always: bool = False,
                noise_mask=None) -> GenerateRequest:
    """The engine request for these settings and ComfyUI values (not yet validated). The negative is read when
    cfg != 1, or whenever it is given with negative_always (a guider: ComfyUI's CFG++ samplers use it at cfg 1)."""
    cond, pooled, guidance = conditioning_tensors(positive, "positive")
    refs, method = conditioning_references(positive, "positive")
    neg_cond = neg_pooled = neg_refs = None
    neg_method = ""
    images = conditioning_images(positive)
    if cfg != 1.0 or (negative_always and negative is not None):
        neg_cond, neg_pooled, _ = conditioning_tensors(negative, "negative")
        neg_refs, neg_method = conditioning_references(negative, "negative")
        images.update(conditioning_images(negative, "neg_"))
    return GenerateRequest(model=settings.model_path, cond=cond, pooled=pooled, latent_raw=latent_raw,
                           seed=int(seed), steps=int(steps), cfg=float(cfg), sampler=sampler_name,
                           scheduler=scheduler, denoise=float(denoise), neg_cond=neg_cond, neg_pooled=neg_pooled,
                           guidance=3.5 if guidance is None else float(guidance), dtype=settings.compute_dtype,
                           fp8_weights=settings.weight_dtype == "fp8_e4m3fn",
                           batch_index=list(batch_index) if batch_index is not None else None,
                           loras=list(settings.loras), plan=settings.requested_plan(),
                           cache_threshold=settings.cache_threshold, compile=settings.compile,
                           attention=settings.attention,
                           patches=(settings.patches or None) if settings.pipefusion > 1 else None,
                           warmup_steps=min(settings.warmup_steps, int(steps)),
                           reference_latents=refs, reference_latents_method=method,
                           neg_reference_latents=neg_refs, neg_reference_latents_method=neg_method,
                           model_sampling=settings.model_sampling, cfg_norm=settings.cfg_norm, noise_mask=noise_mask,
                           **images)


def sample(settings: EngineSettings, positive, negative, latent: dict, *, seed: int, steps: int, cfg: float,
           sampler_name: str, scheduler: str, denoise: float, on_progress=None, should_cancel=None,
           before_job=None, registry: EngineRegistry = REGISTRY) -> dict:
    """KSampler on the engine: returns the LATENT dict (other keys kept, as KSampler does)."""
    settings.validate()
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ValueError("latent_image is not a LATENT (a dict with 'samples'); connect EmptySD3LatentImage or "
                         "VAEEncode to it")
    samples = fix_empty_latent(inspect_model(settings.model_path), latent["samples"],   # as KSampler does
                               latent.get("downscale_ratio_spacial"))
    request = job_request(settings, positive, negative, samples, cfg=cfg, seed=seed, steps=steps,
                          sampler_name=sampler_name, scheduler=scheduler, denoise=denoise,
                          batch_index=latent.get("batch_index"), noise_mask=latent.get("noise_mask"))
    hardware = hardware_for(settings.device, len(settings.gpus), settings.gpus)
    request = request.validate(len(settings.gpus), hardware)  # every check that needs no rank, before any rank starts
    choice = request.choice
    if before_job is not None:
        before_job()
    record = registry.get(settings)
    t0 = time.perf_counter()
    result = request.submit(record.engine, on_progress=on_progress, should_cancel=should_cancel)
    record.last_plan = choice.plan.describe()
    record.last_plan_reason = choice.reason
    record.last_timings = dict(result.timings, wall_s=time.perf_counter() - t0)
    record.last_cache = result.ranks[0].get("step_cache") or {}
    record.last_bytes = result.ranks[0].get("bytes_sent_per_step", {})
    record.last_memory = [r.get("memory", {}) for r in result.ranks]
    record.last_stages = [dict(r["pipefusion"], rank=r["rank"]) for r in result.ranks if r.get("pipefusion")]
    out = dict(latent)
    out["samples"] = result.outputs["samples"]
    return out


def guider(settings: EngineSettings, positive, negative, cfg: float, *, model_patcher, sampling_function,
           before_job=None, registry: EngineRegistry = REGISTRY) -> EngineGuider:
    """The xDiT Guider's GUIDER. The request is built and validated when SamplerCustomAdvanced runs it, against the
    latent it is given; the conditioning is checked now, so a wrong input fails at this node."""
    settings.validate()
    if settings.pipefusion > 1 or settings.cache_threshold:
        raise ValueError(f"the engine has {'pipefusion' if settings.pipefusion > 1 else 'cache_threshold'} set, "
                         f"which runs only inside the engine's own sampler loop: with the xDiT Guider use pipefusion "
                         f"1 and cache_threshold 0, or use xDiT Sampler")
    cfg = float(cfg)
    if cfg != 1.0 and negative is None:
        raise ValueError(f"cfg={cfg} needs a negative conditioning: connect one, or use cfg 1.0 (FLUX)")
    job_request(settings, positive, negative, torch.zeros(1, 16, 2, 2), cfg=cfg, negative_always=True)

    def request_for(latent_raw: torch.Tensor, cfg_now: float) -> GenerateRequest:
        request = job_request(settings, positive, negative, latent_raw, cfg=cfg_now, negative_always=True)
        request = request.validate(len(settings.gpus), hardware_for(settings.device, len(settings.gpus), settings.gpus))
        record = registry.get(settings)
        record.last_plan, record.last_plan_reason = request.plan.describe(), request.choice.reason
        return request

    return EngineGuider(model_patcher, sampling_function, cfg=cfg, has_negative=negative is not None,
                        request_for=request_for, engine_for=lambda: registry.get(settings), before_job=before_job)


def describe(settings: EngineSettings, registry: EngineRegistry = REGISTRY) -> str:
    """What the Info node shows."""
    record = registry.running(settings)
    lines = [f"model: {settings.model_path}", f"ranks: {len(settings.gpus)} on {settings.device} "
             f"{'GPUs ' + ','.join(map(str, settings.gpus)) if settings.device == 'cuda' else '(CPU ranks, gloo)'}",
             f"weights: {settings.weight_dtype} (compute {settings.compute_dtype}); plan setting: {settings.plan}"]
    for path, strength in settings.loras:
        lines.append(f"LoRA: {path} at {strength:g}")
    if settings.sampling:
        lines.append(f"model sampling: {FlowSampling(*settings.sampling).describe()}")
    if settings.cfg_norm:
        lines.append(f"CFGNorm: strength {settings.cfg_norm:g}")
    if record is None:
        lines.append("engine: not running (starts with the next xDiT Sampler job)")
        return "\n".join(lines)
    engine = record.engine
    lines.append(f"engine: {'running' if engine.running else 'stopped'}, pids {engine.pids}, "
                 f"restarts {len(engine.restarts)}" + (f" (last: {engine.restarts[-1]})" if engine.restarts else ""))
    for rank, memory in enumerate(record.last_memory):
        where = f"cuda:{settings.gpus[rank]}" if settings.device == "cuda" else "cpu"
        parts = [f"{k.replace('_gib', '')} {v:.2f} GiB" for k, v in memory.items()]
        lines.append(f"rank {rank} ({where}): " + ", ".join(parts))
    if record.last_timings:
        lines.append(f"last job: plan {record.last_plan}; " +
                     ", ".join(f"{k} {v:.3f} s" for k, v in record.last_timings.items()))
    if record.last_plan_reason:
        lines.append(f"plan: {record.last_plan_reason}")
    if record.last_cache:
        lines.append(f"step cache: skipped {record.last_cache['skipped_calls']} of {record.last_cache['model_calls']} "
                     f"model calls")
    for stage in record.last_stages:
        blocks = stage["blocks"]
        lines.append(f"rank {stage['rank']}: PipeFusion stage {stage['stage']}, blocks {blocks[0]}-{blocks[-1]}, weights held "
                     f"{stage['held_bytes'] / 2**30:.2f} GiB ({stage['patches']} patches, {stage['warmup_steps']} "
                     f"warmup step(s))")
    if record.last_bytes:
        lines.append("rank 0 sent per step: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in record.last_bytes.items()))
    lines.extend(record.notes)
    return "\n".join(lines)
