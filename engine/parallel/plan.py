"""The parallel plan, and the one place it is resolved and validated: `resolve_plan` turns `auto` or explicit
degrees into a plan that runs this model and job on this many ranks, or refuses with the numbers and a plan
that works. `auto` ranks the plans that can run by the cost model (cost.py) on the ranks' hardware (devices.py).
The client calls it before any rank starts; the ranks only build the mesh it names."""
from __future__ import annotations

from dataclasses import dataclass, asdict

from ..errors import PlanError
from . import cost
from .devices import Hardware, assumed_hardware

DEGREES = ("dp", "cfg", "pipefusion", "ulysses", "ring")
MAX_RANKS = 8
AUTO = "auto"


@dataclass(frozen=True)
class ParallelPlan:
    """world = dp x cfg x pipefusion x ulysses x ring (the xDiT rule). cfg is 1 or 2."""

    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ulysses: int = 1
    ring: int = 1

    def __post_init__(self):
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan degree {name}={value!r} is invalid: every degree is an integer >= 1")
        if self.cfg not in (1, 2):
            raise PlanError(f"plan degree cfg={self.cfg} is invalid: CFG parallel splits the positive and "
                            f"negative passes, so cfg is 1 (off) or 2")

    @classmethod
    def from_dict(cls, degrees: dict) -> "ParallelPlan":
        unknown = sorted(set(degrees) - set(DEGREES))
        if unknown:
            raise PlanError(f"plan has unknown degrees {unknown}: use {', '.join(DEGREES)}")
        return cls(**degrees)

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ulysses * self.ring

    def check_world(self, ranks: int) -> None:
        if self.world_size != ranks:
            factors = " x ".join(f"{n}={getattr(self, n)}" for n in DEGREES)
            raise PlanError(f"plan {factors} needs {self.world_size} ranks but the engine has {ranks}: "
                            f"make the product of the degrees equal the number of ranks")

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in DEGREES if getattr(self, n) > 1]
        return " x ".join(parts) if parts else "single rank"


@dataclass(frozen=True)
class Workload:
    """What a plan has to fit, and what it costs: the model's dimensions and the job's shape. `from_info` builds one
    from a checkpoint's header, `for_variant` from a known variant; the defaults after `negative_pass` are FLUX.1's
    head width and T5 length, with weights unknown (0)."""

    variant: str
    heads: int
    layers: int              # attention layers: FLUX double + single blocks, SD3 joint blocks
    image_tokens: int        # per image, after patching (FLUX 2x2, SD3 patch_size)
    batch: int
    negative_pass: bool      # cfg != 1: the sampler evaluates a negative prompt too
    head_dim: int = 128
    text_tokens: int = 512   # FLUX: T5 tokens; SD3: 77 CLIP + T5 tokens
    dual_layers: int = 0     # SD3.5-medium blocks with a second, image-only attention
    weight_bytes: int = 0    # the transformer's weights as each rank holds them (fp8 matrices: a byte a parameter)
    block_weight_bytes: int = 0   # of which in the transformer blocks (what PipeFusion stages would divide)
    dtype: str = "bf16"      # compute dtype (activations)
    fp8_weights: bool = False     # weight_bytes counts fp8 matrices (the file's, or the fp8 weight option)
    compiled: bool = False   # torch.compile: the planner uses the GPU's compiled calibration when it has one
    text_splits: bool = True  # the family's text tokens may split with the image tokens (else every rank holds them)

    @property
    def step_tflop(self) -> float:
        """TFLOP of one denoising step (FLUX.1-dev at 1024^2: 74.4; SD3-medium with cfg: 17.8)."""
        return cost.rank_flops(ParallelPlan(), self)[0] / 1e12

    @classmethod
    def from_info(cls, info, latent_h: int, latent_w: int, *, batch: int, negative_pass: bool, text_tokens: int,
                  dtype: str = "bf16", fp8_weights: bool = False, compiled: bool = False) -> "Workload":
        """From a checkpoint's header info (models.detect.CheckpointInfo) and a latent of latent_h x latent_w."""
        patch = info.latent_patch
        fp8 = fp8_weights or info.stored_fp8   # an fp8 file's matrices stay fp8 (models/load.py)
        per_parameter = 1 if fp8 else cost.DTYPE_BYTES[dtype]
        return cls(variant=info.variant, heads=info.heads, layers=info.layers, batch=batch,
                   image_tokens=(latent_h // patch) * (latent_w // patch), negative_pass=negative_pass,
                   head_dim=info.config["attention_head_dim"], text_tokens=text_tokens,
                   dual_layers=len(info.config.get("dual_attention_layers") or ()),
                   weight_bytes=info.parameters * per_parameter,
                   block_weight_bytes=info.block_parameters * per_parameter,
                   dtype=dtype, fp8_weights=fp8, compiled=compiled, text_splits=info.spec.text_splits)

    @classmethod
    def for_variant(cls, variant: str, width: int = 1024, height: int = 1024, *, batch: int = 1,
                    negative_pass: bool = False, text_tokens: int | None = None, dtype: str = "bf16",
                    fp8_weights: bool = False) -> "Workload":
        """A known variant at full size (models.tiny.REAL) and width x height pixels; text tokens default to what
        ComfyUI's encoders give: 512 T5 tokens for FLUX, 77 CLIP + 256 T5 for SD3."""
        from ..models.synthetic import synthetic_info
        info = synthetic_info(f"synthetic:{variant}")
        down = info.spec.latent.downscale
        return cls.from_info(info, height // down, width // down, batch=batch, negative_pass=negative_pass,
                             text_tokens=text_tokens or info.spec.text_tokens, dtype=dtype, fp8_weights=fp8_weights)


@dataclass(frozen=True)
class PlanChoice:
    plan: ParallelPlan
    reason: str              # one line: why this plan (auto) or that the caller chose it (explicit)


def plan_problems(plan: ParallelPlan, work: Workload) -> list[str]:
    """Why `plan` cannot run this workload, each naming the numbers (empty when it can)."""
    problems = []
    if work.heads % plan.ulysses:
        problems.append(f"the model has {work.heads} heads: ulysses {plan.ulysses} does not divide them")
    sp = plan.ulysses * plan.ring
    if work.image_tokens % sp:
        problems.append(f"the latent has {work.image_tokens} image tokens: ulysses x ring = {sp} does not divide them "
                        f"(pick a size whose tokens divide, or a smaller degree)")
    if plan.cfg == 2 and not work.negative_pass:
        problems.append("cfg parallel needs a negative pass, and this job has none (cfg 1.0)")
    if work.batch % plan.dp:
        problems.append(f"the batch has {work.batch} images: dp {plan.dp} does not divide it")
    if plan.pipefusion > work.layers:
        problems.append(f"pipefusion {plan.pipefusion} exceeds the model's {work.layers} layers")
    return problems


def candidates(world: int) -> list[ParallelPlan]:
    """Every plan for `world` ranks, simplest first (the order ties are broken in): CFG parallel (one velocity per
    step), data parallel (one velocity per step), then Ulysses (all-to-all of Q/K/V/O), then Ring (K/V passed
    around)."""
    out = []
    for dp in range(1, world + 1):
        for cfg in (1, 2):
            for ulysses in range(1, world + 1):
                for ring in range(1, world + 1):
                    if dp * cfg * ulysses * ring == world:
                        out.append(ParallelPlan(dp=dp, cfg=cfg, ulysses=ulysses, ring=ring))
    return sorted(out, key=lambda p: (-p.cfg, -p.dp, -p.ulysses, p.ring))


def feasible(world: int, work: Workload) -> list[ParallelPlan]:
    """The plans for `world` ranks that can run this workload, in `candidates` order."""
    return [p for p in candidates(world) if not plan_problems(p, work)]


def _why(plan: ParallelPlan, work: Workload) -> str:
    parts = []
    if plan.cfg == 2:
        parts.append("positive and negative passes on separate ranks")
    if plan.dp > 1:
        parts.append(f"batch of {work.batch} split {plan.dp} ways")
    if plan.ulysses > 1:
        parts.append(f"{work.image_tokens} image tokens split {plan.ulysses} ways, {work.heads} heads exchanged")
    if plan.ring > 1:
        parts.append(f"K/V passed around a ring of {plan.ring}")
    if plan.pipefusion > 1:
        parts.append(f"{work.layers} blocks in {plan.pipefusion} pipelined stages, each GPU holding its own")
    return "; ".join(parts) if parts else "one rank runs the whole job"


def _fmt_estimate(e: cost.Estimate) -> str:
    return f"est. {e.step_ms:.0f} ms/step (compute {e.compute_ms:.0f}, comm {e.comm_ms:.0f})"


def memory_helps(ranks: int, work: Workload, gib: float) -> list[str]:
    """What would bring `work` on `ranks` GPUs under `gib` per GPU: fp8 weights, an explicit PipeFusion plan (it
    divides the blocks' weights between the GPUs), more GPUs. Empty when none of these would."""
    helps = []
    if work.weight_bytes and not work.fp8_weights:
        per = cost.DTYPE_BYTES[work.dtype]
        light = Workload(**{**asdict(work), "weight_bytes": work.weight_bytes // per,
                            "block_weight_bytes": work.block_weight_bytes // per, "fp8_weights": True})
        if min(cost.memory_gib(p, light)["total"] for p in feasible(ranks, light)) <= gib:
            helps.append(f"fp8 weights would fit ({light.weight_bytes / cost.GiB:.1f} GiB of weights)")
    if ranks > 1:
        from ..models.synthetic import synthetic_info
        from .pipefusion.layout import fit_stages
        info = synthetic_info(f"synthetic:{work.variant}")
        for p in range(2, min(ranks, work.layers) + 1):
            plan = ParallelPlan(pipefusion=p, dp=ranks // p) if ranks % p == 0 else None
            if plan is None or plan_problems(plan, work):
                continue
            counts, stage_gib, _ = fit_stages(info, plan, work, gib)
            if counts:
                helps.append(f"explicit {plan.describe()} fits (stages of {counts} blocks need "
                             f"{', '.join(f'{g:.1f}' for g in stage_gib)} GiB)")
                break
    more = next((n for n in range(ranks + 1, MAX_RANKS + 1)
                 if any(cost.memory_gib(p, work)["total"] <= gib for p in feasible(n, work))), None)
    if more:
        helps.append(f"{more} GPUs would fit (sequence parallel splits the activations)")
    return helps


def _no_fit(ranks: int, work: Workload, hw: Hardware, best: cost.Estimate) -> str:
    """Why no plan fits the GPUs' memory, with the numbers and what would help."""
    m = best.memory
    helps = memory_helps(ranks, work, hw.memory_gib)
    helps.append("a smaller image or batch shrinks the activations" if m["activations"] > 1 else
                 "GPUs with more memory")
    return (f"no parallel plan fits {work.variant} in {hw.memory_gib:.0f} GiB per GPU on {hw.describe()}: the least "
            f"needs {m['total']:.1f} GiB ({best.plan.describe()}: weights {m['weights']:.1f}, activations "
            f"{m['activations']:.1f}, runtime {m['runtime']:.1f}; auto's methods keep a full copy of the weights on "
            f"every GPU); " + "; ".join(helps))


def rank_plans(ranks: int, work: Workload, hardware: Hardware) -> list[cost.Estimate]:
    """Every feasible plan for `ranks` GPUs with its estimate, the planner's choice first (cost.rank)."""
    return cost.rank([cost.estimate(p, work, hardware) for p in feasible(ranks, work)])


def _auto(ranks: int, work: Workload, hw: Hardware) -> PlanChoice:
    plans = feasible(ranks, work)
    if not plans:
        raise PlanError(f"no parallel plan runs this job on {ranks} ranks ({work.variant}: {work.heads} heads, "
                        f"{work.image_tokens} image tokens, batch {work.batch}"
                        f"{', cfg 1.0' if not work.negative_pass else ''}): change the rank count or the size")
    if hw.device == "cpu":  # the ranks share the host's cores: no plan computes faster, so send the least
        plan = min(plans, key=lambda p: sum(cost.comm_bytes(p, work).values()))
        return PlanChoice(plan, f"auto chose {plan.describe()} for {ranks} rank(s): {_why(plan, work)}")
    ranked = rank_plans(ranks, work, hw)
    best = ranked[0]
    if not best.fits:
        raise PlanError(_no_fit(ranks, work, hw, best))
    reason = f"auto chose {best.plan.describe()} for {ranks} rank(s): {_fmt_estimate(best)} on {hw.describe()}"
    if len(ranked) > 1:
        nxt = ranked[1]
        reason += f"; {nxt.plan.describe()} est. {nxt.step_ms:.0f}"
        if nxt.fits and nxt.step_ms < best.step_ms:
            reason += (f" (within {cost.TIE:.0%}: a tie, and {best.plan.describe()} "
                       + ("sends less)" if best.comm_bytes < nxt.comm_bytes else "is the simpler plan)"))
    if ranks > 1:
        one = cost.estimate(ParallelPlan(), work, hw)
        if one.fits and one.step_ms < best.step_ms:
            reason += f"; 1 GPU est. {one.step_ms:.0f}: fewer GPUs would be faster"
    return PlanChoice(best.plan, reason)


def resolve_plan(requested: ParallelPlan | str, ranks: int, work: Workload,
                 hardware: Hardware | None = None) -> PlanChoice:
    """The plan that runs `work` on `ranks` ranks: `auto` picks the fastest that fits by the cost model (cost.py)
    on `hardware` (None: assumed, see devices.assumed_hardware); an explicit plan is only checked, never replaced.
    Raises PlanError naming every problem and a plan that works for the same rank count."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise PlanError(f"ranks={ranks!r} is invalid: use 1 to {MAX_RANKS} (one rank per GPU)")
    hw = hardware or assumed_hardware(ranks)
    if isinstance(requested, str):
        if requested != AUTO:
            raise PlanError(f"plan={requested!r} is invalid: use 'auto' or explicit degrees")
        return _auto(ranks, work, hw)
    if not isinstance(requested, ParallelPlan):
        raise PlanError(f"plan={requested!r} is invalid: use 'auto' or a ParallelPlan")
    requested.check_world(ranks)
    problems = plan_problems(requested, work)
    if problems:
        try:
            hint = f"; try {_auto(ranks, work, hw).plan.describe()}"
        except PlanError:
            hint = f"; no plan for this job fits {ranks} ranks: change the rank count"
        raise PlanError(f"plan {requested.describe()} cannot run this job: " + "; ".join(problems) + hint)
    reason = f"explicit plan {requested.describe()} on {ranks} rank(s): {_why(requested, work)}"
    if hw.device != "cpu":
        reason += f"; {_fmt_estimate(cost.estimate(requested, work, hw))} on {hw.describe()}"
    return PlanChoice(requested, reason)
