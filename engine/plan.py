"""The parallel plan: one object holding every degree, validated against the world size on construction."""
from __future__ import annotations

from dataclasses import dataclass, asdict

from .errors import PlanError

DEGREES = ("dp", "cfg", "pipefusion", "ulysses", "ring")


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


STOCHASTIC_SAMPLERS = ("euler_ancestral", "dpmpp_2m_sde")


def _factorizations(world: int) -> list[dict]:
    out = []
    for dp in range(1, world + 1):
        for cfg in (1, 2):
            for ulysses in range(1, world + 1):
                for ring in range(1, world + 1):
                    if dp * cfg * ulysses * ring == world:
                        out.append({"dp": dp, "cfg": cfg, "ulysses": ulysses, "ring": ring})
    return out


def plan_problems(plan: ParallelPlan, *, heads: int, image_tokens: int, batch: int, negative_pass: bool,
                  sampler: str, layers: int) -> list[str]:
    """Why `plan` cannot run this model and job, each naming the numbers (empty when it can)."""
    problems = []
    if heads % plan.ulysses:
        problems.append(f"the model has {heads} heads: ulysses {plan.ulysses} does not divide them")
    sp = plan.ulysses * plan.ring
    if image_tokens % sp:
        problems.append(f"the latent has {image_tokens} image tokens: ulysses x ring = {sp} does not divide them "
                        f"(pick a size whose tokens divide, or a smaller degree)")
    if plan.cfg == 2 and not negative_pass:
        problems.append("cfg parallel needs a negative pass, and this job has none (cfg 1.0)")
    if plan.dp > 1 and batch % plan.dp:
        problems.append(f"the batch has {batch} images: dp {plan.dp} does not divide it")
    if plan.dp > 1 and sampler in STOCHASTIC_SAMPLERS:
        problems.append(f"sampler {sampler} draws step noise for the whole batch, which dp {plan.dp} would change; "
                        f"use dp 1 or a deterministic sampler (euler, heun, dpmpp_2m)")
    if plan.pipefusion > 1:
        problems.append(f"pipefusion {plan.pipefusion} is not built yet: use pipefusion 1")
    if plan.pipefusion > layers:
        problems.append(f"pipefusion {plan.pipefusion} exceeds the model's {layers} layers")
    return problems


def suggest_plan(world: int, **job) -> ParallelPlan | None:
    """A plan for the same rank count that passes, preferring CFG parallel, then dp, then Ulysses, then Ring
    (cheapest communication first)."""
    def cost(p):
        return (-p["cfg"], -p["dp"], -p["ulysses"], p["ring"])
    for candidate in sorted(_factorizations(world), key=cost):
        plan = ParallelPlan(**candidate)
        if not plan_problems(plan, **job):
            return plan
    return None


def validate_plan(plan: ParallelPlan, world: int, **job) -> None:
    """Raise PlanError naming every problem of `plan` for this model and job, with a plan that works."""
    plan.check_world(world)
    problems = plan_problems(plan, **job)
    if problems:
        better = suggest_plan(world, **job)
        hint = (f"; try {better.describe()}" if better else "; no plan for this job fits "
                f"{world} ranks: change the rank count")
        raise PlanError(f"plan {plan.describe()} cannot run this job: " + "; ".join(problems) + hint)
