"""Published weight-sharded (FSDP) inference runs the cost model's gather and memory terms are checked on: each row's
measured figure beside the model's, and the residual. Nothing is fitted to them.

- lingbot-world pull request #52 (Robbyant/lingbot-world, May 2026): a Wan-based 14B DiT in bf16, sharded over 8 H100
  (FSDP1 FULL_SHARD, no forward prefetch), 480x832, 81 frames, 35 DiT forwards a generate(). Keeping the gathered
  weights after the first forward (SHARD_GRAD_OP) saved 1855 ms: the re-gathers of the other 34 forwards, 54.6 ms
  each. The code the model prices has no overlap (`FSDP_NO_PREFETCH`), and the engine's own Wan 2.1 14B dims.
- Raylight's README (komikndr/raylight, 'Wan T2V 14B (fp8) - 2xRTX 2000 ADA 16G', 480x832x33): Ulysses 11 s/it at
  15.8 GB a device, Ulysses + FSDP2 12 s/it at 10.25 GB. The added second a step is the gather the model prices
  (FSDP2 without explicit prefetch: no overlap) for two forwards a step: at 15.8 GB of 16 ('near OOM') ComfyUI runs
  the positive and negative passes one at a time (comfy/samplers.py calc_cond_batch batches them only while 1.5x
  its memory estimate is free), on the link the image and video rows price that pair with (two RTX 2000 Ada across
  the sockets, priced as an Ada PCIe 4.0 card; the RTX 2000 Ada has 8 lanes, not 16, which the link leaves out);
  the saved memory is the weights' part the model prices, 1/2 of the fp8 weights less a forward's root and blocks
  in flight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..parallel import cost
from ..parallel.devices import stated_hardware
from ..parallel.memory import memory_gib
from ..parallel.plan import GiB, ParallelPlan, Workload

# FSDP without explicit forward prefetch: a block's gather starts when the block does (cost.Code.shard_overlap 0)
FSDP_NO_PREFETCH = replace(cost.XDIT, name="FSDP without explicit forward prefetch", shard_overlap=0.0)


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    source: str
    measured: float
    predicted: float
    unit: str

    @property
    def residual(self) -> float:
        return self.predicted / self.measured - 1


def lingbot_regather() -> Row:
    work = Workload.for_variant("wan2.1-14b", 832, 480, frames=81, negative_pass=True)
    hw = stated_hardware(8, "H100 SXM", "nvlink")
    plan = ParallelPlan(ulysses=8, shard=8)
    compute = cost.estimate(plan, work, hw).compute_ms
    exposed = cost.shard_gather_ms(plan, work, hw.link, compute, FSDP_NO_PREFETCH)[1]
    return Row("lingbot-world-regather", "Wan 14B bf16 over 8 H100 (NVLink): one forward's re-gather",
               "Robbyant/lingbot-world pull request #52 (1855 ms over 34 re-gathers)", 1855 / 34, exposed,
               "ms/forward")


def raylight_pair() -> tuple[Row, Row]:
    work = Workload.for_variant("wan2.1-14b", 832, 480, frames=33, negative_pass=True, fp8_weights=True)
    hw = stated_hardware(2, "RTX 4090", "pcie-socket")
    whole, sharded = ParallelPlan(ulysses=2), ParallelPlan(ulysses=2, shard=2)
    compute = cost.estimate(sharded, work, hw).compute_ms
    forwards = 2   # the passes one at a time on a card near out of memory
    added = forwards * cost.shard_gather_ms(sharded, work, hw.link, compute / forwards, FSDP_NO_PREFETCH)[1] / 1e3
    saved = (memory_gib(whole, work)["weights"] - memory_gib(sharded, work)["weights"]) * GiB / 1e9
    source = "komikndr/raylight README, 'Wan T2V 14B (fp8) - 2xRTX 2000 ADA 16G' (Ulysses vs Ulysses + FSDP2)"
    return (Row("raylight-wan14b-fsdp2-time", "Wan 2.1 14B fp8 480x832x33, 2x RTX 2000 Ada: the s/step FSDP2 adds",
                source, 12.0 - 11.0, added, "s/step"),
            Row("raylight-wan14b-fsdp2-memory", "the same: the memory per GPU FSDP2 saves", source, 15.8 - 10.25,
                saved, "GB"))


def rows() -> list[Row]:
    return [lingbot_regather(), *raylight_pair()]


def table() -> list[str]:
    """Markdown: each published figure, the model's, the residual."""
    lines = ["| published run | measured | model | residual | source |", "|---|---|---|---|---|"]
    for r in rows():
        lines.append(f"| {r.what} | {r.measured:.3g} {r.unit} | {r.predicted:.3g} {r.unit} | {r.residual:+.0%} | "
                     f"{r.source} |")
    return lines
