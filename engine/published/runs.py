"""What a published multi-GPU run is to the cost model: a row (`Run`, marked fit or held out), a scenario (one source's
runs of one model on one machine, with the code that ran them), the published codes priced with xDiT's counts and the
links of xDiT's 8-GPU PCIe servers. The rows themselves are in images.py and video.py."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..parallel import cost
from ..parallel.fitted import value
from ..parallel.plan import Workload


@dataclass(frozen=True)
class Run:
    """One published row: `plan` on `gpus` GPUs took `seconds` (the scenario's unit)."""
    plan: str
    gpus: int
    seconds: float
    fit: bool                # the fitted constants are fitted to it; else held out
    why: str                 # why it is fitted, or what holding it out tests


def fit(plan: str, gpus: int, seconds: float, why: str) -> Run:
    return Run(plan, gpus, seconds, True, why)


def held(plan: str, gpus: int, seconds: float, why: str = "") -> Run:
    return Run(plan, gpus, seconds, False, why)


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str                # what ran where
    source: str              # where it is published
    make: object             # () -> Workload
    gpu: str
    link: object             # a topology class, or ((gpus, class), ...) where the GPUs span more with their count
    one_gpu_s: float | None  # the published one-GPU time (None: base_ms borrowed)
    runs: tuple
    code: cost.Code = cost.XDIT
    outside: object = 0.0    # seconds outside the transformer loop, or the name of a fitted constant (fitting.py)
    computed_share: float = 1.0   # a step cache's share of steps computed, the same on every GPU count
    approximate: bool = False     # the published plans include PipeFusion: the planner is checked with it allowed
    unit: str = "s"          # "s" a whole job, "s/step" one denoising step
    base_ms: float | None = None  # a borrowed one-GPU transformer step when the source has no one-GPU time
    base_note: str = ""
    work: dict = field(default_factory=dict, compare=False, repr=False)   # the built Workload, once

    def workload(self) -> Workload:
        if "w" not in self.work:
            self.work["w"] = self.make()
        return self.work["w"]

    def link_for(self, gpus: int) -> str:
        if isinstance(self.link, str):
            return self.link
        return dict(self.link)[gpus]

    @property
    def outside_s(self) -> float:
        if isinstance(self.outside, str):
            return value(self.outside)
        return self.outside

    @property
    def one_gpu_ms(self) -> float:
        """The transformer step the predictions start from: the published one-GPU time less the seconds outside the
        loop, over the steps computed; or the borrowed step."""
        if self.base_ms is not None:
            return self.base_ms
        steps = self.workload().steps
        return (self.one_gpu_s - self.outside_s) * 1e3 / (steps * self.computed_share)


L40_SERVER = ((1, "pcie-switch"), (2, "pcie-switch"), (3, "pcie-bridge"), (4, "pcie-bridge"), (6, "pcie-socket"),
              (8, "pcie-socket"))

# The other codes, where their sources say less, are priced with xDiT's counts; ParaAttention and diffusers' context
# parallel (cache-dit) split the text with the image tokens.
PARAATTENTION = replace(cost.XDIT, name="ParaAttention (context parallel: Ulysses and Ring over torch's collectives)",
                        text_split=True)
CACHE_DIT = replace(cost.XDIT, name="cache-dit (diffusers' context parallel hooks)", text_split=True)
RAYLIGHT = replace(cost.XDIT, name="Raylight (xDiT's USP in ComfyUI)")
