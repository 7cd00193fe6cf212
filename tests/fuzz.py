"""The fuzz tests' hypothesis profile and case counting.

Profile "ci" (the default): derandomized (the same cases every run), no per-case deadline (the box is shared), no
example database; each fuzz test sets its own max_examples so that all of them together stay near a minute on two
cores. HYPOTHESIS_PROFILE=deep runs ten times the cases with random draws."""
from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.register_profile("deep", derandomize=False, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
SCALE = 10 if PROFILE == "deep" else 1


def cases(n: int) -> settings:
    """A test's case budget under the active profile."""
    return settings(max_examples=n * SCALE)


class Tally:
    """Counts a fuzz test's cases by outcome and prints them (with the time taken) when the test ends."""

    def __init__(self, name: str):
        self.name, self.counts, self.t0 = name, {}, time.perf_counter()

    def __call__(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        line = f"{self.name}: {self.total} cases in {time.perf_counter() - self.t0:.1f} s ({parts})"
        print(line)
        return line


def one_line(message: str) -> bool:
    return bool(message) and "\n" not in message and "Traceback" not in message
