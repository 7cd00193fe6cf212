"""The fuzz tests' case budgets, case counting and what a refusal must show. The hypothesis profile is chosen in
tests/conftest.py: by default (CI's run too) derandomized, the same cases every run of a commit, with no example
database; HYPOTHESIS_PROFILE=dev draws randomly, a failing case kept in .hypothesis/.

Replaying a failure locally:
- exactly: the failure's log shows the falsifying example and a line `You can reproduce this example by temporarily
  adding @reproduce_failure('6.x.y', b'...')`; put that decorator on the test's inner function (the one under
  @given) and run the test;
- CI's cases: `python -m pytest tests/test_fuzz_requests.py::test_...` runs the default profile. Its draws are the
  same as CI's for the same code and hypothesis version when the same modules are loaded (hypothesis also draws
  constants it finds in the project's loaded modules), so run the same test files, or use the decorator;
- a random run's failure (HYPOTHESIS_PROFILE=dev): run it again; hypothesis replays the case from .hypothesis/ first.
HYPOTHESIS_PROFILE=deep runs ten times the cases, randomly drawn."""
from __future__ import annotations

import os
import time

from hypothesis import settings

from conftest import HYPOTHESIS_PROFILE

SCALE = 10 if HYPOTHESIS_PROFILE == "deep" else 1


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


def shown(value) -> list[str]:
    """How a refusal may show a value it was given: its repr or text (a path also by its file name), a tensor by its
    shape or a size of it of two digits or more."""
    if hasattr(value, "shape"):
        return [str(list(value.shape))] + [str(n) for n in value.shape if n > 9]
    forms = [repr(value)] + ([str(value)] if str(value) else [])
    if isinstance(value, str) and os.sep in value and os.path.basename(value):
        forms.append(os.path.basename(value))
    return forms


def names_any(message: str, names=(), values=()) -> bool:
    """Whether a refusal names one of the inputs (`pooled_output` also as "pooled output") or shows one of the values
    given. What every refusal promises: it says what it refuses, not only that something is wrong."""
    text = message.lower()
    return any(n.lower() in text or n.lower().replace("_", " ") in text for n in names if n) or \
        any(s in message for v in values for s in shown(v) if s)
