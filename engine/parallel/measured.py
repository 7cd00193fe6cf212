"""What was measured on this machine, and how the planner uses it in place of its model: one engine setup's figures
(the devices its ranks run on), as `python -m engine calibrate` (or the engine's first start) measured them and as
finished jobs reported them. runtime/machine.py stores them; runtime/calibrate.py measures them.

The figures of a setup (a JSON object, stored as runtime/machine.py writes it):
- `devices`: each rank's device, and on a GPU the memory free once the rank's CUDA context exists (and its total);
- `pairs`: each pair of ranks exchanging messages at once in both directions, at the sizes the plans send: the latency
  and bandwidth fitted to t = latency + bytes / bandwidth; `all_to_all`: the same for an all-to-all of the first n
  ranks (the ranks a plan of n runs on, a Ulysses group), bytes counted as what each rank sends;
- `compute`: for a model at its real widths, each rank's one-device step (the embedders and final layer, and one block
  of each list run as many times as the list has blocks) at the token counts a rank holds under 1, 2, 4, ... ranks: at
  each size of its matrix products, the rate at which the cost model's count of that step (cost.unit_ms) takes the
  measured time;
- `jobs`: per workload, each plan's steady step as the last jobs that ran it measured it, beside the model's estimate.

How the planner reads them (`apply` puts them on `devices.Hardware`): memory per GPU is the measured free memory (the
least over the GPUs); the link is a `MeasuredLink` (the slowest pair, the slowest latency, each group's all-to-all);
compute is `compute_ms` (the plan's step as the cost model counts it, at the rate measured nearest the plan's size,
the slowest of its ranks': mixed GPUs each have their own); a plan that ran has its estimate scaled to its measured step (`observed`), so a plan measured slower than
one GPU's estimate, or than another plan's measurement, is not chosen again. Everything else (what the code overlaps,
host launches on GPUs, memory per plan) stays the model's.
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, replace

from . import cost
from .devices import LINK_NAMES, LINKS, Hardware, Interconnect, link_from_topo
from .plan import ParallelPlan, Workload

SCHEMA = 1


# ---- the link ---------------------------------------------------------------------------------------------------
def fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency us, GB/s) of t = latency + bytes / bandwidth fitted by least squares to (bytes, seconds) points. A fit
    that comes out negative (noise at small sizes) falls back to the smallest message's time as the latency and the
    largest message's rate as the bandwidth."""
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    if len(points) >= 2 and max(xs) > min(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
        if slope > 0 and intercept >= 0:
            return intercept * 1e6, 1 / slope / 1e9
    small, large = min(points), max(points)
    latency = small[1]
    rest = large[1] - latency
    return latency * 1e6, large[0] / (rest if rest > 0 else large[1]) / 1e9


@dataclass(frozen=True)
class MeasuredLink(Interconnect):
    """A link whose rates were measured: `bandwidth_gbs` the slowest pair's (a collective waits for its slowest
    member), `latency_us` the slowest all-to-all's (a collective call's), `p2p_latency_us` the slowest pair's (a
    point-to-point message's), all-to-alls of n ranks at their own measured rate (`a2a`); a group size not measured
    is scaled from the nearest measured one as the modelled link would scale it."""

    a2a: tuple = ()        # ((n, GB/s each rank, latency us), ...)
    p2p_latency_us: float | None = None   # a point-to-point message's (a ring hop's); latency_us is a collective's

    def all_to_all_gbs(self, n: int) -> float:
        if not self.a2a:
            return super().all_to_all_gbs(n)
        for m, gbs, _ in self.a2a:
            if m == n:
                return gbs
        m, gbs, _ = min(self.a2a, key=lambda a: abs(a[0] - n))
        return gbs * super().all_to_all_gbs(n) / super().all_to_all_gbs(m)

    def describe(self) -> str:
        return f"{LINK_NAMES[self.kind]}, measured"


def link_kind(device: str, topology: dict) -> str:
    """The link class (devices.LINKS) of a setup's ranks from what calibration read: gloo between CPU ranks; else the
    worst pair's class by `nvidia-smi topo -m` (devices.link_from_topo), PCIe without peer access where CUDA gives a
    pair none."""
    if device == "cpu":
        return "cpu"
    pairs = topology.get("pairs", {})
    codes = {}
    for key, p in pairs.items():
        a, b = (int(i) for i in key.split("-"))
        codes[(a, b)] = codes[(b, a)] = str(p.get("topo", ""))
    ranks = sorted({i for pair in codes for i in pair})
    found = link_from_topo(codes, ranks) if codes else None
    if found == "nvlink":
        return found
    if not pairs or not all(p.get("peer") for p in pairs.values()):
        return "pcie-no-peer"
    return found or "pcie-bridge"


# ---- compute -----------------------------------------------------------------------------------------------------
def model_key(work: Workload) -> str:
    """What a compute curve is measured for: the model's widths and depth, the compute dtype, fp8 weights. Eager only:
    a compiled job is priced by the model."""
    return (f"{work.variant}/{work.heads}x{work.head_dim}/{work.layers}/{work.dtype}"
            + ("/fp8" if work.fp8_weights else ""))


def job_key(work: Workload) -> str:
    """What a job's measured step is kept for: the model (model_key), the job's tokens, batch and passes."""
    return (f"{model_key(work)}{'/compiled' if work.compiled else ''} {work.image_tokens}+{work.text_tokens} tokens, "
            f"batch {work.batch}{', cfg' if work.negative_pass else ''}")


def _rate(points: list[dict], gemm_work: float) -> float:
    """The large-matrix rate (TFLOP/s, as cost.unit_ms counts a step) at `gemm_work` (rows x width of the matrix
    products): each measured size's own (its step's unit_ms over its measured ms), interpolated between the measured
    sizes in log-log, the nearest measured one outside them (the model's slowdown with size is a GPU's, not this
    device's)."""
    pts = sorted((p["gemm_work"], p["unit_ms"] / p["ms"]) for p in points)
    works = [w for w, _ in pts]
    i = bisect.bisect_left(works, gemm_work)
    if i == 0:
        return pts[0][1]
    if i == len(pts):
        return pts[-1][1]
    (w0, r0), (w1, r1) = pts[i - 1], pts[i]
    a = (math.log(gemm_work) - math.log(w0)) / (math.log(w1) - math.log(w0))
    return math.exp(math.log(r0) + a * (math.log(r1) - math.log(r0)))


class Measured:
    """The figures of one engine setup (see the module's doc), as the planner reads them."""

    def __init__(self, setup: str, figures: dict, machine: str = ""):
        self.setup = setup
        self.figures = figures
        self.machine = machine   # the machine's description (GPUs, driver, torch), for the reports

    # ---- what is there
    @property
    def device(self) -> str:
        return self.figures.get("device", "cpu")

    @property
    def ranks(self) -> int:
        return len(self.figures.get("devices", ()))

    @property
    def calibrated(self) -> bool:
        return bool(self.figures.get("pairs") or self.figures.get("devices"))

    def free_gib(self, ranks: int | None = None) -> float | None:
        """The least memory free on the GPUs of the first `ranks` ranks (all), once a CUDA context exists."""
        free = [d["free_gib"] for d in self.figures.get("devices", [])[:ranks] if d.get("free_gib") is not None]
        return min(free) if free else None

    def curves(self, work: Workload) -> dict[int, list[dict]]:
        """rank -> its measured compute points for this model, eager."""
        if work.compiled:
            return {}
        key = model_key(work)
        return {c["rank"]: c["points"] for c in self.figures.get("compute", []) if c.get("key") == key and c["points"]}

    def covers(self, work: Workload, ranks: int | None = None) -> bool:
        """Every rank (of the first `ranks`) has a compute curve for this workload's model."""
        curves = self.curves(work)
        return bool(curves) and all(r in curves for r in range(ranks or self.ranks))

    # ---- what the cost model reads
    def compute_ms(self, plan: ParallelPlan, work: Workload) -> tuple[float, float] | None:
        """(all, attention) ms of one rank's steady step under `plan` at the measured rates (the slowest of the plan's
        ranks at the plan's size of matrix products), or None when the model was not measured on every one of them."""
        curves = self.curves(work)
        ranks = range(plan.world_size)
        if not curves or any(r not in curves for r in ranks):
            return None
        total, attention = cost.unit_ms(plan, work)
        size = cost.gemm_work(plan, work)
        rate = min(_rate(curves[r], size) for r in ranks)
        return total / rate, attention / rate

    def rate(self, work: Workload) -> tuple[float, str] | None:
        """cost.rate_tflops's figure from the measured one-device step: the large-matrix rate at which the model's
        one-device step takes the measured time (so throughput_tflops gives the measured TFLOP/s), and its source;
        None when not measured."""
        one = ParallelPlan()
        measured = self.compute_ms(one, work)
        if measured is None:
            return None
        return cost.unit_ms(one, work)[0] / measured[0], self.compute_source(work)

    def compute_source(self, work: Workload) -> str:
        curves = self.curves(work)
        sizes = sorted({round(p["tokens"]) for pts in curves.values() for p in pts})
        return (f"measured: a block of {work.variant} at its widths on each of {len(curves)} device(s), at "
                f"{', '.join(map(str, sizes))} tokens")

    def link(self, base: Interconnect) -> MeasuredLink | None:
        """The measured link (None when no pair was measured): `base` (the modelled link) gives what is not measured."""
        pairs = self.figures.get("pairs") or []
        if not pairs:
            return None
        groups = self.figures.get("all_to_all") or []
        kind = link_kind(self.device, self.figures.get("topology", {}))
        p2p = max(p["latency_us"] for p in pairs)
        latency = max(g["latency_us"] for g in groups) if groups else p2p
        return MeasuredLink(kind=kind, bandwidth_gbs=min(p["gbs"] for p in pairs), latency_us=latency,
                            tree=LINKS[kind].tree, contention=base.contention,
                            a2a=tuple((len(g["ranks"]), g["gbs"], g["latency_us"]) for g in groups),
                            p2p_latency_us=p2p)

    def apply(self, hw: Hardware) -> Hardware:
        """`hw` with the measured figures in place of the modelled ones where there are any."""
        link = self.link(hw.link) or hw.link
        memory = self.free_gib() if hw.device == "cuda" and self.free_gib() is not None else hw.memory_gib
        return replace(hw, link=link, memory_gib=memory, measured=self,
                       notes=hw.notes + (f"measured: {'; '.join(self.summary())}",))

    # ---- what finished jobs measured
    def step(self, work: Workload, plan: ParallelPlan) -> dict | None:
        """The last jobs' measured steady step of `plan` on this workload ({"step_ms", "predicted_ms", "jobs"})."""
        return self.figures.get("jobs", {}).get(job_key(work), {}).get(plan.describe())

    def observed(self, estimates: list, work: Workload) -> list:
        """The estimates with each plan that ran on this workload scaled to its measured step (its compute, comm and
        host in proportion; a clip's expert copies as modelled)."""
        out = []
        for e in estimates:
            seen = self.step(work, e.plan)
            if seen and e.step_ms > 0:
                f = seen["step_ms"] / e.step_ms
                e = replace(e, compute_ms=e.compute_ms * f, comm_ms=e.comm_ms * f, host_ms=e.host_ms * f,
                            job_ms=(e.job_ms - e.swap_ms) * f + e.swap_ms)
            out.append(e)
        return out

    def explain(self, chosen, modelled, work: Workload) -> str:
        """What the reason of auto's choice adds: which figures are measured, each plan measured on this workload,
        and why the choice differs from the model's (`modelled`: the estimate the model alone picks)."""
        parts = [", ".join(self.sources(work))]
        runs = self.figures.get("jobs", {}).get(job_key(work), {})
        if runs:
            parts.append("measured steps: " + ", ".join(
                f"{plan} {r['step_ms']:.0f} ms ("
                + (f"est. {r['predicted_ms']:.0f}, " if r.get("predicted_ms") is not None else "")
                + f"{r['jobs']} job{'s' * (r['jobs'] > 1)})" for plan, r in runs.items()))
        if modelled is not None and chosen is not None and modelled.plan != chosen.plan:
            seen = self.step(work, modelled.plan)
            name, mine = modelled.plan.describe(), self.step(work, chosen.plan)
            against = (f"{chosen.plan.describe()}'s measured {mine['step_ms']:.0f}" if mine else
                       f"{chosen.plan.describe()}'s est. {chosen.step_ms:.0f}")
            if seen:
                parts.append(f"the model alone would choose {name} (est. {modelled.step_ms:.0f} ms/step), but a job "
                             f"measured it at {seen['step_ms']:.0f} ms/step, slower than {against}")
            else:
                parts.append(f"the model alone would choose {name} (est. {modelled.step_ms:.0f} ms/step)")
        return "; ".join(parts)

    def sources(self, work: Workload | None = None) -> list[str]:
        """Which of the planner's figures are measured and which modelled, in words."""
        out = []
        if work is not None:
            out.append("compute measured" if self.covers(work) else
                       ("compute modelled (compiled: measured eager only)" if work.compiled else
                        f"compute modelled ({work.variant} not measured here)"))
        out.append("link measured" if self.figures.get("pairs") else "link modelled")
        if self.device == "cuda":
            out.append("memory measured (free once a CUDA context exists)" if self.free_gib() is not None else
                       "memory modelled")
        return out

    def summary(self) -> list[str]:
        """The measured figures in a few phrases (Info node, notes, `calibrate`)."""
        out = []
        free = [d for d in self.figures.get("devices", []) if d.get("free_gib") is not None]
        if free:
            out.append("free GiB per GPU " + ", ".join(f"{d['free_gib']:.1f} of {d['total_gib']:.1f}" for d in free))
        for p in self.figures.get("pairs", []):
            out.append(f"pair {p['ranks'][0]}-{p['ranks'][1]} {p['gbs']:.2f} GB/s, {p['latency_us']:.0f} us")
        for g in self.figures.get("all_to_all", []):
            out.append(f"all-to-all of {len(g['ranks'])} {g['gbs']:.2f} GB/s, {g['latency_us']:.0f} us")
        for c in self.figures.get("compute", []):
            best = max(c["points"], key=lambda p: p["gemm_work"])
            out.append(f"rank {c['rank']} {c['model']} {best['tflop'] / best['ms'] * 1e3:.3g} TFLOP/s at "
                       f"{best['tokens']:.0f} tokens")
        if self.figures.get("calibrate_s") is not None:
            out.append(f"calibrated {self.figures.get('calibrated', '')} in {self.figures['calibrate_s']:.1f} s")
        return out
