"""A generate request (one KSampler run): its fields, defaults and checks, declared once and used on both sides of
the process boundary. The client validates it and resolves its plan (`validate`), then `to_job` splits it into a
JSON document and tensors; a rank rebuilds the same object with `from_job`. The CLI and the nodes build one."""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields

import torch

from ..models.flow import REFERENCE_METHODS
from ..models.load import COMPUTE_DTYPES, inspect_model
from ..models.speed import ATTENTION
from ..parallel import cost
from ..parallel.devices import Hardware, assumed_hardware
from ..parallel.plan import AUTO, ParallelPlan, PlanChoice, Workload, feasible, resolve_plan

TENSOR = {"tensor": True}   # field metadata: crosses as a tensor through the bridge, not in the job document
TENSOR_LIST = {"list": True}   # tensors: the document holds the list's length (or None), each crosses as "<name>.<i>"
SEED_LIMIT = 2 ** 64        # ComfyUI's seed widget: 0 .. 2**64 - 1
FINITE_CHUNK = 1 << 22      # elements checked for NaN/inf at a time (the check's own memory stays small)


def default_dtype(device: str) -> str:
    """The compute dtype when none is given, the same for generate, bench, the nodes and plan: bf16 on GPUs (what
    FLUX and SD3 are released in; fp32 doubles the weights), fp32 on CPU ranks (CPUs add bf16 slowly)."""
    return "bf16" if device == "cuda" else "fp32"


def host_memory_gib() -> float | None:
    """The host's RAM in GiB (MemTotal of /proc/meminfo, else sysconf), None when neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / cost.GiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cost.GiB
    except (ValueError, OSError, AttributeError):
        return None


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or inf, naming it and the first such value; read a block of at most
    FINITE_CHUNK elements at a time, so the check's own memory stays small whatever the tensor's size."""
    t = t.reshape(1) if t.ndim == 0 else t
    where = _first_nonfinite(t)
    if where is not None:
        raise ValueError(f"{name} holds {t[tuple(where)].item()} at index {where} (shape {list(t.shape)}): give "
                         f"finite values (check the node or encoder that made it)")


def _first_nonfinite(t: torch.Tensor) -> list[int] | None:
    if t.numel() == 0:
        return None
    per_row = t.numel() // t.shape[0]
    if per_row > FINITE_CHUNK:   # rows too large to check whole: one row at a time, recursively
        for i in range(t.shape[0]):
            inner = _first_nonfinite(t[i])
            if inner is not None:
                return [i] + inner
        return None
    step = max(1, FINITE_CHUNK // per_row)
    for start in range(0, t.shape[0], step):
        bad = ~torch.isfinite(t[start:start + step])
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            return [where[0] + start] + where[1:]
    return None


def check_latent_size(info, latent_h: int, latent_w: int) -> None:
    """A latent of latent_h x latent_w the model can take: sides that patch evenly, within SD3's position grid."""
    if latent_h % 2 or latent_w % 2 or latent_h < 2 or latent_w < 2:
        raise ValueError(f"latent {latent_w * 8}x{latent_h * 8} px is invalid: {info.family} needs width "
                         f"and height that are positive multiples of 16 px")
    grid = info.config.get("pos_embed_max_size")  # SD3 crops its positions from a grid of this many patches
    if grid and max(latent_h, latent_w) // info.latent_patch > grid:
        limit = grid * info.latent_patch * 8
        raise ValueError(f"latent {latent_w * 8}x{latent_h * 8} px is too large for {info.variant}: its "
                         f"position grid allows up to {limit}x{limit} px")


@dataclass
class GenerateRequest:
    model: str                                                 # checkpoint path, or synthetic:<variant>[:tiny]
    cond: torch.Tensor = field(metadata=TENSOR)                # [B|1, N, 4096]
    pooled: torch.Tensor = field(metadata=TENSOR)              # [B|1, 768 (FLUX) | 2048 (SD3)]
    latent_raw: torch.Tensor = field(metadata=TENSOR)          # [B, 16, H/8, W/8], raw VAE space (zeros: empty latent)
    seed: int = 0
    steps: int = 20
    cfg: float = 1.0
    sampler: str = "euler"
    scheduler: str = "simple"
    denoise: float = 1.0
    neg_cond: torch.Tensor | None = field(default=None, metadata=TENSOR)
    neg_pooled: torch.Tensor | None = field(default=None, metadata=TENSOR)
    guidance: float = 3.5                 # FLUX only (FluxGuidance)
    dtype: str = "fp32"
    fp8_weights: bool = False             # store Linear weights as float8_e4m3fn (ComfyUI's fp8 weight dtype)
    batch_index: list[int] | None = None
    plan: ParallelPlan | str = AUTO       # "auto" until validate() resolves it
    loras: list = field(default_factory=list)   # [(path, strength)], applied in order
    cache_threshold: float | None = None  # step cache (First-Block-Cache): None off; 0 never skips; ~0.05-0.2 useful
    compile: bool = False                 # torch.compile the transformer blocks (graphs kept for later jobs)
    attention: str = "auto"               # scaled_dot_product_attention kernel: auto, flash, efficient, cudnn, math
    fp8_matmul: bool = False              # fp8 products for fp8 weights (GPUs with fp8 tensor cores)
    patches: int | None = None            # PipeFusion: latent row bands (None: one per stage)
    warmup_steps: int = 1                 # PipeFusion: steps run whole before patches use stale K/V
    stage_blocks: list[int] | None = None  # PipeFusion: blocks per stage (None: balanced by cost)
    # FLUX.1 Kontext (ReferenceLatent): raw VAE latents [B|1, 16, h, w] per side, placed by the side's method
    reference_latents: list[torch.Tensor] | None = field(default=None, metadata=TENSOR_LIST)
    neg_reference_latents: list[torch.Tensor] | None = field(default=None, metadata=TENSOR_LIST)
    reference_latents_method: str = "offset"
    neg_reference_latents_method: str = "offset"

    @classmethod
    def random_conditioning(cls, model: str, width: int, height: int, *, text_tokens: int, batch: int = 1,
                            draw_seed: int = 0, **fields) -> "GenerateRequest":
        """A request for `model` with random conditioning of the model's widths (cond, pooled, then the negative
        side, drawn in that order from torch.Generator(draw_seed)) and an empty latent: what benchmarks run."""
        config = inspect_model(model).config
        context, pooled = config["joint_attention_dim"], config["pooled_projection_dim"]
        g = torch.Generator().manual_seed(draw_seed)
        return cls(model=model, cond=torch.randn(batch, text_tokens, context, generator=g),
                   pooled=torch.randn(batch, pooled, generator=g),
                   latent_raw=torch.zeros(batch, 16, height // 8, width // 8),
                   neg_cond=torch.randn(1, text_tokens, context, generator=g),
                   neg_pooled=torch.randn(1, pooled, generator=g), **fields)

    # ---- client side -------------------------------------------------------------------------------------------
    def validate(self, ranks: int | None = None, hardware: Hardware | None = None) -> PlanChoice:
        """Every check that needs no rank, then the plan resolved for `ranks` (default: an explicit plan's own rank
        count, 1 for auto) on `hardware` (devices.cpu_hardware / detect_hardware; None: assumed, as resolve_plan
        says) and stored in `plan`. Raises ValueError (PlanError, CheckpointError) naming the input, the value and
        what works."""
        self.check_scalars()
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid: give a checkpoint path, a diffusers folder or "
                             f"synthetic:<variant>[:tiny]")
        info = inspect_model(self.model)  # CheckpointError (a ValueError) for a bad file; cached while unchanged
        lat = self.latent_raw
        if not isinstance(lat, torch.Tensor) or lat.ndim != 4 or lat.shape[1] != 16 or not lat.is_floating_point():
            shape = list(lat.shape) if isinstance(lat, torch.Tensor) else type(lat).__name__
            raise ValueError(f"latent of shape {shape} is invalid: {info.family} takes [batch, 16, height/8, "
                             f"width/8] floats (EmptySD3LatentImage)")
        if lat.shape[0] < 1:
            raise ValueError("latent has an empty batch: give at least one image")
        check_latent_size(info, lat.shape[2], lat.shape[3])
        batch = lat.shape[0]
        self._check_side("cond", self.cond, self.pooled, info, batch)
        if self.negative_pass:
            if self.neg_cond is None or self.neg_pooled is None:
                raise ValueError(f"cfg={self.cfg} needs a negative conditioning (neg_cond and neg_pooled); give one "
                                 f"or use cfg 1.0")
            self._check_side("neg_cond", self.neg_cond, self.neg_pooled, info, batch)
        self._check_references("reference_latents", self.reference_latents, info, batch)
        if self.negative_pass:
            self._check_references("neg_reference_latents", self.neg_reference_latents, info, batch)
        if self.batch_index is not None and len(self.batch_index) != batch:
            raise ValueError(f"batch_index has {len(self.batch_index)} entries for a batch of {batch}")
        if self.loras:
            self._check_loras(info)
        if ranks is None:
            ranks = self.plan.world_size if isinstance(self.plan, ParallelPlan) else 1
        work = self.workload(info)
        self._check_memory(work, ranks, hardware, lat.shape[2], lat.shape[3])  # before any tensor is read
        choice = resolve_plan(self.plan, ranks, work, hardware)
        self._check_pipefusion(info, choice.plan, lat.shape[2], lat.shape[3])
        for name, t in self.tensors_to_check():   # sizes known to fit: now the values are read
            check_finite(name, t)
        if choice.plan.pipefusion > 1 and hardware is not None and hardware.device != "cpu":
            choice = self._fit_stages(info, choice, work, hardware)
        self.plan = choice.plan
        return choice

    def workload(self, info) -> Workload:
        """What the planner and the cost model know of this job."""
        lat = self.latent_raw
        return Workload.from_info(info, lat.shape[2], lat.shape[3], batch=lat.shape[0],
                                  negative_pass=self.negative_pass, text_tokens=self._text_tokens(), dtype=self.dtype,
                                  fp8_weights=self.fp8_weights, compiled=self.compile)

    def submit(self, engine, **kwargs):
        """Run this validated request as a generate job on `engine` (kwargs: Engine.submit's callbacks). A rank that
        runs out of memory fails the job with what it held and the plans and settings that need less."""
        from ..errors import EngineError
        try:
            return engine.submit("generate", *self.to_job(), **kwargs)
        except EngineError as e:
            if not e.oom:
                raise
            raise EngineError(f"{e}; {self.memory_advice(engine.world, e.memory)}", rank=e.rank, phase=e.phase,
                              oom=True, memory=e.memory) from e

    def memory_advice(self, ranks: int, memory: dict | None) -> str:
        """After an out-of-memory failure under this (resolved) plan: the planner's estimate, the plans of `ranks`
        GPUs it expects to need less, and what else would (fp8 weights, PipeFusion, more GPUs), measured against the
        device's size when the rank reported it, else against the estimate that proved too small."""
        from ..parallel import cost
        from ..parallel.plan import feasible, memory_helps
        work = self.workload(inspect_model(self.model))
        estimate = cost.memory_gib(self.plan, work)
        failed = estimate["total"]
        total = (memory or {}).get("device_total_gib")
        budget = total or failed
        lighter = sorted((cost.memory_gib(p, work)["total"], p.describe()) for p in feasible(ranks, work)
                         if p != self.plan)
        lighter = [(g, name) for g, name in lighter if g < min(failed, budget)]
        advice = [f"the planner estimated {failed:.1f} GiB per rank for {self.plan.describe()} (weights "
                  f"{estimate['weights']:.1f}, activations {estimate['activations']:.1f}, runtime "
                  f"{estimate['runtime']:.1f})" + (f" on a {total:.0f} GiB device" if total else "")]
        if lighter:
            advice.append("plans that need less: " + ", ".join(f"{name} (est. {g:.1f} GiB)" for g, name in lighter[:3]))
        advice += memory_helps(ranks, work, budget * (1 if total else 0.99))
        advice.append("a smaller image or batch shrinks the activations")
        return "; ".join(advice)

    def _text_tokens(self) -> int:
        """The longest prompt a pass runs (cond; neg_cond too with a negative pass)."""
        sides = [self.cond] + ([self.neg_cond] if self.negative_pass else [])
        return max(t.shape[1] for t in sides)

    def tensors_to_check(self):
        """(name, tensor) of every input tensor the sampler reads: the negative side only with a negative pass."""
        yield "latent", self.latent_raw
        yield "cond", self.cond
        yield "pooled", self.pooled
        if self.negative_pass:
            yield "neg_cond", self.neg_cond
            yield "neg_pooled", self.neg_pooled
        for name in ("reference_latents",) + (("neg_reference_latents",) if self.negative_pass else ()):
            for i, r in enumerate(getattr(self, name) or ()):
                yield f"{name}[{i}]", r

    def _check_memory(self, work: Workload, ranks: int, hardware: Hardware | None, latent_h: int,
                      latent_w: int) -> None:
        """Refuse a job too large for the machine from the cost model's estimate (cost.memory_gib), before anything
        is allocated. CPU ranks share the host's RAM: weights and activations of every rank must fit it. A GPU must
        hold at least the activations of the best plan (weights that do not fit are the planner's to explain, with
        fp8 and PipeFusion advice)."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 8:
            return   # resolve_plan names a bad rank count
        plans = [self.plan] if isinstance(self.plan, ParallelPlan) and self.plan.world_size == ranks else \
            feasible(ranks, work)
        if not plans:
            return   # resolve_plan says why no plan runs it
        cpu = hardware is not None and hardware.device == "cpu"
        # every rank receives the whole payload (a broadcast view crosses at its full size)
        inputs = sum(t.numel() * t.element_size() for _, t in self.tensors_to_check()) / cost.GiB
        if cpu:
            have = host_memory_gib()
            if have is None:
                return
            parts = min((cost.memory_gib(p, work) for p in plans), key=lambda m: m["weights"] + m["activations"])
            need = (parts["weights"] + parts["activations"] + inputs) * ranks
            where = f"this machine has {have:.0f} GiB of RAM for {ranks} CPU rank(s)"
        else:
            hw = hardware or assumed_hardware(ranks)
            have = hw.memory_gib
            if have is None:
                return
            parts = min((cost.memory_gib(p, work) for p in plans), key=lambda m: m["activations"])
            need = parts["activations"] + inputs
            where = f"the GPUs have {have:.0f} GiB each"
        if need <= have:
            return
        if parts["weights"] * (ranks if cpu else 1) >= have / 2:   # the model itself is the most of it
            help = f"the weights alone need {parts['weights'] * (ranks if cpu else 1):,.1f} GiB: use fp8 weights, " \
                   f"bf16, fewer CPU ranks or a machine with more memory"
        else:
            help = "use a smaller image, batch or prompt"
        raise ValueError(f"{work.variant} with latent {latent_w * 8}x{latent_h * 8} px, batch {work.batch}, {work.text_tokens} text tokens "
                         f"needs about {need:,.0f} GiB {'in all' if cpu else 'per GPU'} (per rank: activations "
                         f"{parts['activations']:,.1f} GiB, inputs {inputs:,.1f} GiB, weights "
                         f"{parts['weights']:,.1f} GiB); {where}: {help}")

    def _fit_stages(self, info, choice: PlanChoice, work: Workload, hardware: Hardware) -> PlanChoice:
        """PipeFusion on GPUs: each stage's weights, K/V buffers and activations must fit a GPU. The stages are
        balanced by compute; when that split does not fit, the most balanced split that fits is taken (and sent to
        the ranks as stage_blocks); when none fits, the job is refused with the numbers."""
        from ..errors import PlanError
        from ..parallel.parallelize import PIPELINE_PARTS
        from ..parallel.pipefusion import fit_stages
        blocks, _ = PIPELINE_PARTS[info.family]
        plan = choice.plan
        if self.stage_blocks is not None:
            return choice
        counts, gib, balanced = fit_stages(info, blocks, plan, work, hardware.memory_gib)
        per_stage = ", ".join(f"{g:.1f}" for g in gib)
        if counts is None:
            raise PlanError(f"plan {plan.describe()} does not fit {work.variant} in {hardware.memory_gib:.0f} GiB per "
                            f"GPU: its stages need {per_stage} GiB (weights, K/V buffers, activations) however the "
                            f"blocks are split; use more stages, fp8 weights or a smaller image")
        if balanced:
            return PlanChoice(plan, f"{choice.reason}; stages of {counts} blocks need {per_stage} GiB")
        self.stage_blocks = counts
        return PlanChoice(plan, f"{choice.reason}; stages of {counts} blocks (the compute-balanced split does not "
                                f"fit {hardware.memory_gib:.0f} GiB) need {per_stage} GiB")

    def _check_pipefusion(self, info, plan: ParallelPlan, latent_h: int, latent_w: int) -> None:
        """The PipeFusion settings against the plan and the job's shapes (parallel/pipefusion.py), before launch."""
        from ..errors import PlanError
        if plan.pipefusion == 1:
            given = [f"{n}={getattr(self, n)!r}" for n in ("patches", "stage_blocks") if getattr(self, n) is not None]
            if given:
                raise PlanError(f"{', '.join(given)} only apply with pipefusion >= 2; the plan is {plan.describe()}: "
                                f"set pipefusion or leave them unset")
            return
        from ..parallel.pipefusion import layout_problems   # with the rank-side stack: only for PipeFusion plans
        problems = layout_problems(info, plan, latent_h, latent_w, self.patches, self.warmup_steps, self.steps,
                                   self.stage_blocks)
        if self.cache_threshold is not None:
            problems.append("the step cache does not combine with pipefusion yet: leave cache_threshold unset")
        if self.reference_latents or (self.negative_pass and self.neg_reference_latents):
            problems.append("reference latents (FLUX.1 Kontext) do not combine with pipefusion yet: use ulysses, ring, "
                            "cfg or dp")
        if problems:
            raise PlanError(f"plan {plan.describe()} cannot run this job: " + "; ".join(problems))

    @property
    def negative_pass(self) -> bool:
        return self.cfg != 1.0

    def check_scalars(self) -> None:
        """The checks that need neither a file nor a tensor; the ranks run them too."""
        from ..sampling.samplers import SAMPLERS
        from ..sampling.schedules import SCHEDULERS

        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed={self.seed!r} is invalid: use an integer in [0, 2**64)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= 10000:
            raise ValueError(f"steps={self.steps!r} is invalid: use an integer from 1 to 10000")
        for name, low in (("cfg", 0.0), ("guidance", None), ("denoise", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} is invalid: use a finite number")
        if not self.cfg > 0:
            raise ValueError(f"cfg={self.cfg} is invalid: use a value > 0 (1.0 for FLUX.1-dev/schnell)")
        if not 0 < self.denoise <= 1:
            raise ValueError(f"denoise={self.denoise} is invalid: use a value in (0, 1]")
        for name, valid in (("dtype", COMPUTE_DTYPES), ("sampler", SAMPLERS), ("scheduler", SCHEDULERS),
                            ("attention", ATTENTION), ("reference_latents_method", REFERENCE_METHODS),
                            ("neg_reference_latents_method", REFERENCE_METHODS)):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use one of {', '.join(valid)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r} is not supported: use one of {list(SAMPLERS)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is not supported: use one of {list(SCHEDULERS)}")
        if self.cache_threshold is not None and (
                isinstance(self.cache_threshold, bool) or not isinstance(self.cache_threshold, (int, float))
                or not 0 <= self.cache_threshold <= 1):
            raise ValueError(f"cache_threshold={self.cache_threshold!r} is invalid: use a number in [0, 1] (0.05 to "
                             f"0.2 skip useful numbers of steps; 0 never skips), or none for no step cache")
        for name in ("compile", "fp8_matmul", "fp8_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use true or false")
        if self.fp8_matmul and not self.fp8_weights:
            raise ValueError("fp8_matmul=True needs fp8 weights: set fp8_weights (weight dtype fp8_e4m3fn)")
        for name in ("patches", "warmup_steps"):
            value = getattr(self, name)
            if (value is not None or name == "warmup_steps") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1")
        if self.stage_blocks is not None and (
                not isinstance(self.stage_blocks, (list, tuple)) or not self.stage_blocks
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.stage_blocks)):
            raise ValueError(f"stage_blocks={self.stage_blocks!r} is invalid: use one block count >= 1 per stage")
        for name in ("reference_latents_method", "neg_reference_latents_method"):
            if getattr(self, name) not in REFERENCE_METHODS:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use one of "
                                 f"{', '.join(REFERENCE_METHODS)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is invalid: use one of {', '.join(ATTENTION)}")
        if not isinstance(self.loras, (list, tuple)) or any(
                not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[0], str) or not e[0]
                or isinstance(e[1], bool) or not isinstance(e[1], (int, float)) or not math.isfinite(e[1])
                for e in self.loras):
            raise ValueError(f"loras={self.loras!r} is invalid: use a list of (path, strength) pairs with finite "
                             f"strengths")
        if self.batch_index is not None and (
                not isinstance(self.batch_index, (list, tuple))
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < SEED_LIMIT
                       for i in self.batch_index)):
            raise ValueError(f"batch_index={self.batch_index!r} is invalid: use a list of non-negative integers")

    def _check_loras(self, info) -> None:
        from ..models.load import build_empty
        from ..models.lora import check_lora

        if self.model.startswith("synthetic:"):
            raise ValueError(f"LoRAs need a model file; {self.model} has random weights")
        shapes = {k: tuple(v.shape) for k, v in build_empty(info).state_dict().items()}   # meta: no memory
        for entry in self.loras:
            path, strength = entry
            if not os.path.isfile(path):
                raise ValueError(f"LoRA file {path!r} does not exist")
            if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
                raise ValueError(f"LoRA strength {strength!r} for {path} is not a finite number")
            check_lora(path, info, set(shapes), shapes)

    @staticmethod
    def _check_side(name, cond, pooled, info, batch) -> None:
        context = info.config["joint_attention_dim"]
        pooled_dim = info.config["pooled_projection_dim"]
        pooled_name = name.replace("cond", "pooled")
        for t, what in ((cond, name), (pooled, pooled_name)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"{what} is {type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}: "
                                 f"give a floating-point tensor")
        if cond.ndim != 3 or cond.shape[2] != context or cond.shape[1] < 1:
            raise ValueError(f"{name} of shape {list(cond.shape)} is invalid: {info.variant} takes "
                             f"[batch, tokens, {context}]")
        if pooled.ndim != 2 or pooled.shape[1] != pooled_dim:
            raise ValueError(f"{pooled_name} of shape {list(pooled.shape)} is invalid: "
                             f"{info.variant} takes [batch, {pooled_dim}]")
        for t, what in ((cond, name), (pooled, pooled_name)):
            if t.shape[0] not in (1, batch):
                raise ValueError(f"{what} has batch {t.shape[0]} but the latent has {batch}: give {what} a batch of "
                                 f"{'1' if batch == 1 else f'1 or {batch}'}")

    @staticmethod
    def _check_references(name, refs, info, batch) -> None:
        if refs is None:
            return
        rows = "1" if batch == 1 else f"1 or {batch}"
        if not isinstance(refs, (list, tuple)):
            raise ValueError(f"{name} is a {type(refs).__name__}: give a list of latents [{rows}, 16, h, w] "
                             f"(what ReferenceLatent puts in the conditioning)")
        if refs and info.family != "flux":
            raise ValueError(f"{name} holds {len(refs)} reference latent(s) but {info.variant} takes none: only "
                             f"FLUX.1 (Kontext) does; remove the ReferenceLatent node or use a FLUX model")
        for i, r in enumerate(refs):
            what = f"{name}[{i}]"
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                kind = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
                raise ValueError(f"{what} is {kind}: give a floating-point latent [{rows}, 16, h, w] (VAEEncode)")
            if r.ndim != 4 or r.shape[1] != 16 or r.shape[0] not in (1, batch) or r.shape[2] < 2 or r.shape[3] < 2:
                raise ValueError(f"{what} of shape {list(r.shape)} is invalid: {info.variant} takes [{rows}, 16, h, w] "
                                 f"(VAEEncode's latent: one image, or one per image of the batch)")
            if r.shape[2] % 2 or r.shape[3] % 2:
                raise ValueError(f"{what} of shape {list(r.shape)} is invalid: its image is {r.shape[3] * 8}x"
                                 f"{r.shape[2] * 8} px; FLUX takes references whose sides are multiples of 16 px "
                                 f"(FluxKontextImageScale gives such sizes)")

    # ---- across the process boundary ---------------------------------------------------------------------------
    def to_job(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON document, tensors) of a validated request: every field, none left to a default on the far side."""
        if not isinstance(self.plan, ParallelPlan):
            raise ValueError("the request's plan is not resolved: call validate(ranks) first")
        spec, inputs = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("list"):
                spec[f.name] = None if value is None else len(value)
                inputs.update({f"{f.name}.{i}": t for i, t in enumerate(value or [])})
                continue
            if f.metadata.get("tensor"):
                if value is not None:
                    inputs[f.name] = value
                continue
            spec[f.name] = value
        spec["plan"] = self.plan.as_dict()
        spec["loras"] = [[os.path.abspath(p), float(s)] for p, s in self.loras]
        spec["model"] = self.model if self.model.startswith("synthetic:") else os.path.abspath(self.model)
        spec["batch_index"] = list(self.batch_index) if self.batch_index is not None else None
        spec["stage_blocks"] = list(self.stage_blocks) if self.stage_blocks is not None else None
        if not self.negative_pass:  # the sampler never runs the negative pass: its tensors stay home
            inputs.pop("neg_cond", None)
            inputs.pop("neg_pooled", None)
            spec["neg_reference_latents"] = None
            inputs = {k: v for k, v in inputs.items() if not k.startswith("neg_reference_latents.")}
        return spec, inputs

    @classmethod
    def from_job(cls, spec: dict, inputs: dict[str, torch.Tensor]) -> "GenerateRequest":
        """The request as the client validated it; a document with missing or unknown fields is refused."""
        if not isinstance(spec, dict) or not isinstance(inputs, dict):
            raise ValueError(f"generate job document is malformed: spec is a {type(spec).__name__} and inputs a "
                             f"{type(inputs).__name__}, not objects (client and ranks differ in version?)")
        scalar = {f.name for f in fields(cls) if not f.metadata.get("tensor")}   # list fields: their length
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
