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
