"""A generate request (one KSampler run): its fields, defaults and checks, declared once and used on both sides of
the process boundary. The client validates it (`validate` returns a new, frozen request with its plan resolved), then
`to_job` splits it into a JSON document and tensors; a rank rebuilds the same object with `from_job`. The CLI and the
nodes build one. What the tensors must look like is the model family's to say (generate/inputs.py); what fits the
machine is the cost model's (generate/admission.py)."""
from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields, replace

import torch

from .. import wording
from ..errors import EngineError, PlanError
from ..models.load import inspect_model
from ..models.lora import HeldPatches
from ..parallel.devices import Hardware
from ..parallel.memory import expert_placement, memory_gib
from ..parallel.pipefusion.layout import layout_problems
from ..parallel.plan import AUTO, TWO_EXPERTS, GiB, ParallelPlan, PlanChoice, Workload
from ..parallel.planner import resolve_plan
from ..sampling.ksampler import StepWindow
from ..sampling.schedules import FlowSampling
from . import admission
from .inputs import (REFERENCE_METHODS, SEED_LIMIT, check_dtype, check_finite, check_image_inputs, check_latent,  # noqa: F401
                     check_byt5, check_loras, check_noise_mask, check_pose_inputs, check_references, check_scalars,
                     check_side)

TENSOR = {"tensor": True}   # field metadata: crosses as a tensor through the bridge, not in the job document
TENSOR_LIST = {"list": True}   # tensors: the document holds the list's length (or None), each crosses as "<name>.<i>"
LOCAL = {"local": True}     # stays with the client: not in the job document
BROADCAST = "broadcast"     # the document's stand-in tensors (to_job(stand_ins=True)): name -> shape, dtype, value


def default_dtype(device: str) -> str:
    """The compute dtype when none is given, the same for generate, bench, the nodes and plan: bf16 on GPUs (what the
    models are released in; fp32 doubles the weights), fp32 on CPU ranks (CPUs add bf16 slowly)."""
    return "bf16" if device == "cuda" else "fp32"


@dataclass(frozen=True)
class GenerateRequest:
    model: str                                                 # checkpoint path, or synthetic:<variant>[:tiny]
    cond: torch.Tensor = field(metadata=TENSOR)                # [B|1, N, the family's text width]
    latent_raw: torch.Tensor = field(metadata=TENSOR)          # the family's LATENT, raw VAE space (zeros: empty)
    pooled: torch.Tensor | None = field(default=None, metadata=TENSOR)  # [B|1, D], for families that have one
    seed: int = 0
    steps: int = 20
    cfg: float = 1.0
    sampler: str = "euler"
    scheduler: str = "simple"
    denoise: float = 1.0
    neg_cond: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_pooled: torch.Tensor | None = field(default=None, metadata=TENSOR)
    guidance: float = 3.5                 # families with a guidance embedding (FluxGuidance)
    dtype: str = "fp32"
    fp8_weights: bool = False             # store Linear weights as float8_e4m3fn (ComfyUI's fp8 weight dtype)
    batch_index: list[int] | None = None
    plan: ParallelPlan | str = AUTO       # "auto" until validate() resolves it
    loras: list = field(default_factory=list)   # [(path, strength)], applied in order
    cache_threshold: float = 0.0          # step cache (First-Block-Cache): 0 is off; ~0.05-0.2 useful
    compile: bool = False                 # torch.compile the transformer blocks (graphs kept for later jobs)
    attention: str = "auto"               # scaled_dot_product_attention kernel: auto, flash, efficient, cudnn, math
    fp8_matmul: bool = False              # fp8 products for fp8 weights (GPUs with fp8 tensor cores)
    patches: int | None = None            # PipeFusion: latent row bands (None: one per stage)
    warmup_steps: int = 1                 # PipeFusion: steps run whole before patches use stale K/V
    stage_blocks: list[int] | None = None  # PipeFusion: blocks per stage (None: balanced by cost)
    # ReferenceLatent: raw VAE latents per side, placed by the side's method (FluxKontextMultiReferenceLatentMethod)
    reference_latents: list[torch.Tensor] | None = field(default=None, metadata=TENSOR_LIST)
    neg_reference_latents: list[torch.Tensor] | None = field(default=None, metadata=TENSOR_LIST)
    reference_latents_method: str = ""    # "": the family's default (ComfyUI's when the conditioning names none)
    neg_reference_latents_method: str = ""
    # ComfyUI's model sampling (FlowSampling.as_dict(): kind, shift, multiplier); None: the family's default for the
    # variant. A sampling node (ModelSamplingAuraFlow, ModelSamplingFlux, ModelSamplingSD3) sets it.
    model_sampling: dict | None = None
    cfg_norm: float = 0.0                 # ComfyUI's CFGNorm node at this strength (0: not applied)
    # KSamplerAdvanced: the steps of the full schedule to run (None: from the first, to the last), the last sigma set
    # to 0 when the window ends early (return_with_leftover_noise off), and whether noise is added first
    start_step: int | None = None
    last_step: int | None = None
    force_full_denoise: bool = False
    add_noise: bool = True
    # image-to-video: the CONDITIONING keys WanImageToVideo / WanFirstLastFrameToVideo set, per side: the CLIP-vision
    # features (clip_vision_output's penultimate_hidden_states) [B|1, T, width], the image's raw VAE latent
    # (concat_latent_image) [B|1, C, F, H, W] and its mask (concat_mask) [B|1, 1|4, F, H, W]
    clip_vision_output: torch.Tensor | None = field(default=None, metadata=TENSOR)
    concat_latent_image: torch.Tensor | None = field(default=None, metadata=TENSOR)
    concat_mask: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_clip_vision_output: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_concat_latent_image: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_concat_mask: torch.Tensor | None = field(default=None, metadata=TENSOR)
    # Wan-Animate 2's pose branch (WanAnimate2ToVideo's keys, the same on both sides): the pose video's raw VAE latent
    # (pose_video_latent) [B|1, C, F - 1, H, W], its prompt (cross_attn_pose) [B|1, N, width] and CLIP-vision features
    # (clip_vision_output_pose's penultimate_hidden_states) [B|1, T, width], and the node's strengths
    pose_latent: torch.Tensor | None = field(default=None, metadata=TENSOR)
    pose_cond: torch.Tensor | None = field(default=None, metadata=TENSOR)
    pose_clip_vision_output: torch.Tensor | None = field(default=None, metadata=TENSOR)
    pose_strength: float = 1.0
    reference_strength: float = 1.0
    # HunyuanVideo 1.5's byT5 rows per side (conditioning_byt5small: a prompt's quoted text through the byT5 encoder)
    # [B|1, N, width]; None: the prompt quotes nothing
    byt5: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_byt5: torch.Tensor | None = field(default=None, metadata=TENSOR)
    # the LATENT's noise_mask (SetLatentNoiseMask, Wan22ImageToVideoLatent): 1 denoises, 0 keeps the latent, as
    # ComfyUI's KSampler applies it (resized to the latent as comfy.utils.reshape_mask does)
    noise_mask: torch.Tensor | None = field(default=None, metadata=TENSOR)
    # a clip that runs several transformers of this size in turn (Wan 2.2 A14B's high- and low-noise experts, each a
    # file): None takes the variant's count (TWO_EXPERTS: 2). expert_placement: where the idle one waits on a GPU
    # setup, "auto" (both resident where they fit, else the idle one in host memory: the planner's choice, which
    # validate() writes here), "resident" or "host"; the ranks re-check it against measured free memory every job
    experts: int | None = None
    expert_placement: str = "auto"
    choice: PlanChoice | None = field(default=None, metadata=LOCAL)   # why this plan (set by validate)

    @classmethod
    def random_conditioning(cls, model: str, width: int, height: int, *, text_tokens: int | None = None,
                            batch: int = 1, draw_seed: int = 0, frames: int = 1, **fields) -> "GenerateRequest":
        """A request for `model` with random conditioning of the model's widths (cond, pooled, then the negative
        side, drawn in that order from torch.Generator(draw_seed)), the family's usual text length by default, and
        an empty latent (a video of `frames` frames for a family that takes them): what benchmarks run."""
        info = inspect_model(model)
        family = info.spec
        tokens = text_tokens or family.text_tokens
        context, pooled = family.cond_width(info.config), family.pooled_width(info.config)
        g = torch.Generator().manual_seed(draw_seed)
        cond = torch.randn(batch, tokens, context, generator=g)
        pooled_t = torch.randn(batch, pooled, generator=g) if pooled else None
        neg_cond = torch.randn(1, tokens, context, generator=g)
        neg_pooled = torch.randn(1, pooled, generator=g) if pooled else None
        return cls(model=model, cond=cond, pooled=pooled_t,
                   latent_raw=empty_latent(info, width, height, batch, frames),
                   neg_cond=neg_cond, neg_pooled=neg_pooled, **fields)

    # ---- client side -------------------------------------------------------------------------------------------
    def validate(self, ranks: int | None = None, hardware: Hardware | None = None) -> "GenerateRequest":
        """Every check that needs no rank, then the plan resolved for `ranks` (default: an explicit plan's own rank
        count, 1 for auto) on `hardware` (devices.cpu_hardware / detect_hardware; None: assumed, as resolve_plan
        says). Returns the request with its plan (and, where PipeFusion stages had to be fitted to the GPUs, its
        stage_blocks) resolved and `choice` saying why. Raises ValueError (PlanError, CheckpointError) naming the
        input, the value and what works."""
        self.check_scalars()
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid: give a checkpoint path, a diffusers folder or "
                             f"synthetic:<variant>[:tiny]")
        info = inspect_model(self.model)  # CheckpointError (a ValueError) for a bad file; cached while unchanged
        check_dtype(info, self.dtype)
        latent_h, latent_w = check_latent(info, self.latent_raw)
        batch = self.latent_raw.shape[0]
        check_side("cond", self.cond, self.pooled, info, batch)
        if self.negative_pass:
            if self.neg_cond is None:
                raise ValueError(f"cfg={self.cfg} needs a negative conditioning (neg_cond"
                                 f"{' and neg_pooled' if info.spec.pooled_width(info.config) else ''}); give one or "
                                 f"use cfg 1.0")
            check_side("neg_cond", self.neg_cond, self.neg_pooled, info, batch)
        check_references("reference_latents", self.reference_latents, self.reference_latents_method, info, batch)
        check_image_inputs("", self.clip_vision_output, self.concat_latent_image, self.concat_mask, info,
                           self.latent_raw)
        if self.negative_pass:
            check_references("neg_reference_latents", self.neg_reference_latents, self.neg_reference_latents_method,
                             info, batch)
            check_image_inputs("neg_", self.neg_clip_vision_output, self.neg_concat_latent_image, self.neg_concat_mask,
                               info, self.latent_raw)
        if self.noise_mask is not None:
            check_noise_mask(self.noise_mask, self.latent_raw)
        check_pose_inputs(self, info)
        check_byt5("byt5", self.byt5, info, batch)
        if self.negative_pass:
            check_byt5("neg_byt5", self.neg_byt5, info, batch)
        if self.batch_index is not None and len(self.batch_index) != batch:
            raise ValueError(f"batch_index has {len(self.batch_index)} entries for a batch of {batch}")
        if self.model_sampling is not None:
            self._check_model_sampling(info)
        if self.loras:
            check_loras(self.model, self.loras, info)
        if ranks is None:
            ranks = self.plan.world_size if isinstance(self.plan, ParallelPlan) else 1
        work = self.workload(info)
        inputs_gib = sum(t.numel() * t.element_size() for _, t in self.tensors_to_check()) / GiB
        admission.check_memory(self.plan, inputs_gib, work, ranks, hardware,
                               f"{latent_w * info.latent.downscale}x{latent_h * info.latent.downscale} px")
        choice = resolve_plan(self.plan, ranks, work, hardware)
        placement = self.expert_placement
        if work.experts > 1 and placement == AUTO:   # the planner's placement for the chosen plan
            placement = expert_placement(choice.plan, work, hardware.memory_gib if hardware else None)[0]
        self._check_pipefusion(info, choice.plan, latent_h, latent_w)
        for name, t in self.tensors_to_check():   # sizes known to fit: now the values are read
            check_finite(name, t)
        stage_blocks = self.stage_blocks
        if choice.plan.pipefusion > 1 and hardware is not None and hardware.device != "cpu" and stage_blocks is None:
            choice, stage_blocks = admission.fitted_stages(info, choice, work, hardware)
        return replace(self, plan=choice.plan, stage_blocks=stage_blocks, choice=choice, expert_placement=placement)

    def workload(self, info, latent_hw: tuple[int, int] | None = None) -> Workload:
        """What the planner and the cost model know of this job (latent_hw: as if its latent were that size)."""
        lat = self.latent_raw
        h, w = latent_hw or lat.shape[-2:]
        return Workload.from_info(info, h, w, batch=lat.shape[0],
                                  frames=lat.shape[2] if info.spec.frames else 1,
                                  negative_pass=self.negative_pass, text_tokens=self._text_tokens(info),
                                  dtype=self.dtype,
                                  fp8_weights=self.fp8_weights, compiled=self.compile, steps=self.steps,
                                  warmup_steps=self.warmup_steps, patches=self.patches,
                                  pipefusion_conflict=self._pipefusion_conflict(),
                                  experts=self.experts or (2 if info.variant in TWO_EXPERTS else 1),
                                  placement=self.expert_placement)

    def _pipefusion_conflict(self) -> str:
        """Why PipeFusion cannot run this job ("": it can), as the planner says it."""
        if self.cache_threshold:
            return "the step cache does not combine with pipefusion yet: set cache_threshold 0 or"
        if self.reference_latents or (self.negative_pass and self.neg_reference_latents):
            return "reference latents do not combine with pipefusion yet:"
        if self.noise_mask is not None:
            return "a noise mask does not combine with pipefusion yet:"
        return ""

    def window(self) -> StepWindow:
        """KSamplerAdvanced's window of the schedule (the whole schedule by default, as KSampler)."""
        return StepWindow(self.start_step, self.last_step, self.force_full_denoise, self.add_noise)

    def sampling(self, info) -> FlowSampling:
        """The model sampling this job runs: the request's, else the family's default for the variant."""
        if self.model_sampling is not None:
            return FlowSampling.from_dict(self.model_sampling)
        return info.spec.sampling(info.variant)

    def _check_model_sampling(self, info) -> None:
        """A sampling node's model sampling must feed the model timesteps on its own scale: ComfyUI hands the model
        model_sampling.timestep(sigma), and the engine's forward takes the family's default scale."""
        given, default = FlowSampling.from_dict(self.model_sampling), info.spec.sampling(info.variant)
        if given.timesteps_per_sigma != default.timesteps_per_sigma:
            raise ValueError(f"model sampling {given.describe()} gives {info.variant} timesteps of sigma x "
                             f"{given.timesteps_per_sigma:g}, but it takes sigma x {default.timesteps_per_sigma:g} "
                             f"(its default: {default.describe()}); use a sampling node whose multiplier is "
                             f"{default.timesteps_per_sigma:g} (e.g. ModelSamplingAuraFlow for multiplier 1)")

    def submit(self, engine, weight_patches=None, **kwargs):
        """Run this validated request as a generate job on `engine` (kwargs: Engine.submit's callbacks).
        weight_patches: a ComfyUI MODEL's LoRA patches (models/lora.py WeightPatches) applied with the LoRA files. A
        rank that runs out of memory fails the job with what it held and the plans and settings that need less."""
        info = inspect_model(self.model)
        if info.spec.packed_streams:
            raise ValueError(f"{info.spec.title} samples audio and video together, which the engine's own loop does "
                             f"not: sample it with ComfyUI's KSampler (or SamplerCustomAdvanced) on the xDiT Engine's "
                             f"MODEL, whose calls run on the ranks")
        spec, inputs = self.to_job()
        held = HeldPatches.on_client(engine)
        if weight_patches is not None and weight_patches.entries:
            patch_spec, patch_inputs = weight_patches.to_job(held)
            spec, inputs = {"request": spec, "patches": patch_spec}, {**inputs, **patch_inputs}
        try:
            result = engine.submit("generate", spec, inputs, output_bytes=self.latent_raw.numel() * 4, **kwargs)
            if held is not None and weight_patches is not None:
                held.sent(weight_patches)
            return result
        except EngineError as e:
            if held is not None and weight_patches is not None and e.phase != "sent":   # the ranks took the job
                held.sent(weight_patches)
            if not e.oom:
                raise
            raise EngineError(f"{e}; {self.memory_advice(engine.world, e.memory)}", rank=e.rank, phase=e.phase,
                              oom=True, memory=e.memory) from e

    def memory_advice(self, ranks: int, memory: dict | None) -> str:
        """After an out-of-memory failure under this (resolved) plan: what would need less (admission.py), a smaller
        image of this one's shape among it."""
        info = inspect_model(self.model)
        return admission.memory_advice(self.plan, self.workload(info), ranks, memory,
                                       smaller=lambda part: self._smaller_image(info, part))

    def _smaller_image(self, info, part: float) -> tuple[str, dict] | None:
        """The largest image of this job's shape, in the family's steps, whose activations the planner estimates at
        most `part` of this job's under its plan: ("WxH px", its memory_gib), or None when no step smaller does."""
        h, w = self.latent_raw.shape[-2:]
        p = info.latent_patch
        want = memory_gib(self.plan, self.workload(info))["activations"] * part
        for units in range(max(h, w) // p - 1, 0, -1):   # the longer side, in patches, from one less down
            scale = units * p / max(h, w)
            size = (max(p, int(h * scale) // p * p), max(p, int(w * scale) // p * p))
            gib = memory_gib(self.plan, self.workload(info, size))
            if gib["activations"] <= want:
                down = info.latent.downscale
                return f"{size[1] * down}x{size[0] * down} px", gib
        return None

    def _text_tokens(self, info) -> int:
        """The longest prompt a pass runs (cond; neg_cond too with a negative pass), as the model takes it (a family
        that pads the text counts the padded tokens)."""
        sides = [self.cond] + ([self.neg_cond] if self.negative_pass else [])
        return max([t.shape[1] for t in sides] + [info.spec.pad_text_to])

    def tensors_to_check(self):
        """(name, tensor) of every input tensor the sampler reads: the negative side only with a negative pass."""
        yield "latent", self.latent_raw
        yield "cond", self.cond
        if self.pooled is not None:
            yield "pooled", self.pooled
        if self.negative_pass:
            yield "neg_cond", self.neg_cond
            if self.neg_pooled is not None:
                yield "neg_pooled", self.neg_pooled
        for name in ("reference_latents",) + (("neg_reference_latents",) if self.negative_pass else ()):
            for i, r in enumerate(getattr(self, name) or ()):
                yield f"{name}[{i}]", r
        for name in ("clip_vision_output", "concat_latent_image", "concat_mask"):
            for side in ("",) + (("neg_",) if self.negative_pass else ()):
                if getattr(self, side + name) is not None:
                    yield side + name, getattr(self, side + name)
        if self.noise_mask is not None:
            yield "noise_mask", self.noise_mask
        for name in ("pose_latent", "pose_cond", "pose_clip_vision_output", "byt5") + (
                ("neg_byt5",) if self.negative_pass else ()):
            if getattr(self, name) is not None:
                yield name, getattr(self, name)

    def _check_pipefusion(self, info, plan: ParallelPlan, latent_h: int, latent_w: int) -> None:
        """The PipeFusion settings against the plan and the job's shapes (parallel/pipefusion), before launch."""
        if plan.pipefusion > 1 and self.window() != StepWindow():
            raise PlanError(f"plan {plan.describe()} uses pipefusion, whose warmup counts the whole schedule; a "
                            f"start/end step window (KSamplerAdvanced) runs with ulysses, ring, cfg or dp")
        if plan.pipefusion == 1:
            given = [f"{n}={getattr(self, n)!r}" for n in ("patches", "stage_blocks") if getattr(self, n) is not None]
            if given:
                raise PlanError(f"{', '.join(given)} only apply with pipefusion >= 2; the plan is "
                                f"{wording.plan(plan)}: set pipefusion or leave them unset")
            return
        problems = layout_problems(info, plan, latent_h, latent_w, self.patches, self.warmup_steps, self.steps,
                                   self.stage_blocks)
        p = info.latent_patch
        if latent_h % p or latent_w % p:   # a family that pads to whole patches: its bands must be whole patches
            problems.append(f"pipefusion's row bands need a latent of whole {p}x{p} patches; this one is "
                            f"{latent_w}x{latent_h}: use an image whose sides are multiples of "
                            f"{p * info.latent.downscale} px")
        if problems:
            raise PlanError(f"{wording.say('plan subject', plan=wording.plan(plan))} cannot run this job: "
                            + "; ".join(problems))

    @property
    def negative_pass(self) -> bool:
        return self.cfg != 1.0

    def check_scalars(self) -> None:
        """The checks that need neither a file nor a tensor; the ranks run them too (inputs.check_scalars)."""
        check_scalars(self)

    # ---- across the process boundary ---------------------------------------------------------------------------
    def to_job(self, stand_ins: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON document, tensors) of a validated request: every field, none left to a default on the far side. With
        `stand_ins` (a model job, whose ranks read only the shapes the plan was checked against), a tensor that is one
        value seen through a broadcast view (empty_latent's zeros, a model call's stand-ins) crosses as its shape and
        value in the document: nothing is materialised."""
        if not isinstance(self.plan, ParallelPlan):
            raise ValueError("the request's plan is not resolved: call validate(ranks) first")
        spec, inputs, broadcast = {}, {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("local"):
                continue
            if f.metadata.get("list"):
                spec[f.name] = None if value is None else len(value)
                inputs.update({f"{f.name}.{i}": t for i, t in enumerate(value or [])})
                continue
            if f.metadata.get("tensor"):
                if value is not None and stand_ins and value.numel() > 1 and not any(value.stride()):
                    broadcast[f.name] = {"shape": list(value.shape), "dtype": str(value.dtype).split(".")[-1],
                                         "value": value.reshape(-1)[0].item()}
                elif value is not None:
                    inputs[f.name] = value
                continue
            spec[f.name] = value
        spec["plan"] = self.plan.as_dict()
        spec["loras"] = [[os.path.abspath(p), float(s)] for p, s in self.loras]
        spec["model"] = self.model if self.model.startswith("synthetic:") else os.path.abspath(self.model)
        spec["batch_index"] = list(self.batch_index) if self.batch_index is not None else None
        spec["stage_blocks"] = list(self.stage_blocks) if self.stage_blocks is not None else None
        if not self.negative_pass:  # the sampler never runs the negative pass: its tensors stay home
            for name in ("neg_cond", "neg_pooled", "neg_clip_vision_output", "neg_concat_latent_image",
                         "neg_concat_mask", "neg_byt5"):
                inputs.pop(name, None)
            spec["neg_reference_latents"] = None
            inputs = {k: v for k, v in inputs.items() if not k.startswith("neg_reference_latents.")}
            broadcast = {k: v for k, v in broadcast.items() if not k.startswith("neg_")}
        if broadcast:
            spec[BROADCAST] = broadcast
        return spec, inputs

    @classmethod
    def from_job(cls, spec: dict, inputs: dict[str, torch.Tensor]) -> "GenerateRequest":
        """The request as the client validated it; a document with missing or unknown fields is refused."""
        if not isinstance(spec, dict) or not isinstance(inputs, dict):
            raise ValueError(f"generate job document is malformed: spec is a {type(spec).__name__} and inputs a "
                             f"{type(inputs).__name__}, not objects (client and ranks differ in version?)")
        if BROADCAST in spec:
            spec, inputs = dict(spec), dict(inputs)
            for name, stand_in in (spec.pop(BROADCAST) or {}).items():
                try:
                    dtype = getattr(torch, str(stand_in["dtype"]))
                    if not isinstance(dtype, torch.dtype):
                        raise TypeError(stand_in["dtype"])
                    value = torch.full((), stand_in["value"], dtype=dtype)
                    inputs[name] = value.expand(*[int(d) for d in stand_in["shape"]])
                except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
                    raise ValueError(f"generate job document is malformed: stand-in {name}={stand_in!r} is not a "
                                     f"shape, dtype and value") from None
        scalar = {f.name for f in fields(cls)
                  if not f.metadata.get("tensor") and not f.metadata.get("local")}   # list fields: their length
        tensor = {f.name for f in fields(cls) if f.metadata.get("tensor")}
        lists = {f.name for f in fields(cls) if f.metadata.get("list")}
        missing, unknown = scalar - set(spec), set(spec) - scalar
        for name in lists - missing:
            n = spec[name]
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64):
                raise ValueError(f"generate job document is malformed: {name}={n!r} is not a count of tensors")
        listed = {f"{name}.{i}" for name in lists - missing for i in range(spec[name] or 0)}
        strays = set(inputs) - tensor - listed
        missing |= listed - set(inputs)
        missing |= {f.name for f in fields(cls) if f.metadata.get("tensor") and not f.metadata.get("list")
                    and f.default is MISSING and f.default_factory is MISSING} - set(inputs)
        if missing or unknown or strays:
            raise ValueError(f"generate job document does not match this engine's request: missing {sorted(missing)}, "
                             f"unknown {sorted(unknown | strays)} (client and ranks differ in version?)")
        bad = [k for k, v in inputs.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"generate job document is malformed: inputs {sorted(bad)} are not tensors")
        if not isinstance(spec["plan"], dict):
            raise ValueError(f"generate job document is malformed: plan={spec['plan']!r} is not an object of degrees")
        if not isinstance(spec["loras"], list) or not all(isinstance(x, list) and len(x) == 2 for x in spec["loras"]):
            raise ValueError(f"generate job document is malformed: loras={spec['loras']!r} is not a list of "
                             f"[path, strength] pairs")
        values = dict(spec, plan=ParallelPlan.from_dict(spec["plan"]), loras=[tuple(x) for x in spec["loras"]])
        values.update({name: None if spec[name] is None else [inputs[f"{name}.{i}"] for i in range(spec[name])]
                       for name in lists})
        request = cls(**values, **{k: v for k, v in inputs.items() if k in tensor})
        request.check_scalars()
        if not isinstance(request.model, str):
            raise ValueError(f"generate job document is malformed: model={request.model!r} is not a path")
        return request


def empty_latent(info, width: int, height: int, batch: int = 1, frames: int = 1) -> torch.Tensor:
    """The family's empty LATENT (zeros, as its empty-latent node gives) for a width x height image, or a video of
    `frames` frames (ComfyUI counts 4k + 1: (frames - 1) // 4 + 1 latent frames) for a family that takes frames: one
    zero seen through a broadcast view, so a request too large for the machine is refused before any memory is taken
    (the bridge writes the zeros when the job is sent)."""
    fmt = info.latent
    frames = ((fmt.latent_frames(frames) if info.spec.frames else 1),) if fmt.spatial_dims == 3 else ()
    return torch.zeros(()).expand(batch, fmt.channels, *frames, height // fmt.downscale, width // fmt.downscale)
