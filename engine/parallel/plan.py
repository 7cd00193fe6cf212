"""The parallel plan, and the one place it is resolved and validated: `resolve_plan` turns `auto` or explicit
degrees into a plan that runs this model and job on this many ranks, or refuses with the numbers and a plan
that works. The client calls it before any rank starts; the ranks only build the mesh it names."""
from __future__ import annotations

from dataclasses import dataclass, asdict

from ..errors import PlanError

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
    """What a plan has to fit: the model's dimensions and the job's shape."""

    variant: str
    heads: int
    layers: int
    image_tokens: int        # per image, after patching (FLUX 2x2, SD3 patch_size)
    batch: int
    negative_pass: bool      # cfg != 1: the sampler evaluates a negative prompt too


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
    if plan.pipefusion > 1:
        problems.append(f"pipefusion {plan.pipefusion} is not built yet: use pipefusion 1")
    if plan.pipefusion > work.layers:
        problems.append(f"pipefusion {plan.pipefusion} exceeds the model's {work.layers} layers")
    return problems


def candidates(world: int) -> list[ParallelPlan]:
    """Every plan for `world` ranks, cheapest communication first: CFG parallel (one velocity per step), data
    parallel (one velocity per step), then Ulysses (all-to-all of Q/K/V/O), then Ring (K/V passed around)."""
    out = []
    for dp in range(1, world + 1):
        for cfg in (1, 2):
            for ulysses in range(1, world + 1):
                for ring in range(1, world + 1):
                    if dp * cfg * ulysses * ring == world:
                        out.append(ParallelPlan(dp=dp, cfg=cfg, ulysses=ulysses, ring=ring))
    return sorted(out, key=lambda p: (-p.cfg, -p.dp, -p.ulysses, p.ring))


def suggest_plan(world: int, work: Workload) -> ParallelPlan | None:
    return next((p for p in candidates(world) if not plan_problems(p, work)), None)


def _why(plan: ParallelPlan, work: Workload) -> str:
    parts = []
    if plan.cfg == 2:
        parts.append("positive and negative passes on separate ranks")
    if plan.dp > 1:
        parts.append(f"batch of {work.batch} split {plan.dp} ways")
    if plan.ulysses > 1:
        parts.append(f"{work.image_tokens} image tokens split {plan.ulysses} ways, {work.heads} heads exchanged")
    if plan.ring > 1:
        parts.append(f"ring of {plan.ring} over the tokens (ulysses {plan.ulysses} is the most that divides "
                     f"{work.heads} heads here)")
    return "; ".join(parts) if parts else "one rank runs the whole job"


def resolve_plan(requested: ParallelPlan | str, ranks: int, work: Workload) -> PlanChoice:
    """The plan that runs `work` on `ranks` ranks: `auto` picks the cheapest that fits; an explicit plan is checked.
    Raises PlanError naming every problem and a plan that works for the same rank count."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise PlanError(f"ranks={ranks!r} is invalid: use 1 to {MAX_RANKS} (one rank per GPU)")
    if isinstance(requested, str):
        if requested != AUTO:
            raise PlanError(f"plan={requested!r} is invalid: use 'auto' or explicit degrees")
        plan = suggest_plan(ranks, work)
        if plan is None:
            raise PlanError(f"no parallel plan runs this job on {ranks} ranks ({work.variant}: {work.heads} heads, "
                            f"{work.image_tokens} image tokens, batch {work.batch}"
                            f"{', cfg 1.0' if not work.negative_pass else ''}): change the rank count or the size")
        return PlanChoice(plan, f"auto chose {plan.describe()} for {ranks} rank(s): {_why(plan, work)}")
    if not isinstance(requested, ParallelPlan):
        raise PlanError(f"plan={requested!r} is invalid: use 'auto' or a ParallelPlan")
    requested.check_world(ranks)
    problems = plan_problems(requested, work)
    if problems:
        better = suggest_plan(ranks, work)
        hint = (f"; try {better.describe()}" if better else
                f"; no plan for this job fits {ranks} ranks: change the rank count")
        raise PlanError(f"plan {requested.describe()} cannot run this job: " + "; ".join(problems) + hint)
    return PlanChoice(requested, f"explicit plan {requested.describe()} on {ranks} rank(s): {_why(requested, work)}")
