"""Published multi-GPU runs the cost model is fitted to and judged on, and the tables of published against predicted.

Each scenario is one source's runs of one model on one machine: its one-GPU time is the base of every prediction in
it (`cost.estimate(one_gpu_ms=...)`), so a row checks how the time scales with GPUs and plans, not the absolute rate.
Each row is marked `fit` (the fitted constants are fitted to it, fitting.fit_constants) or held out, with the reason,
and the split was fixed in this file before the constants were fitted. Image rows are here, video rows in
video.py; `validation_table` prints both with every residual.

What a published time holds beside the transformer loop, `outside_s`: whole-pipeline seconds include the text encoders
and the VAE decode, which more GPUs do not shorten. xDiT publishes FLUX.1-schnell (4 steps) beside FLUX.1-dev (28
steps) on one A100 and one L40, which gives both parts: A100 (12.77 - 2.18) / 24 = 0.441 s a step and 2.18 - 4 x 0.441
= 0.415 s outside; L40 0.633 s a step and 0.65 s outside, 0.94 and 1.03 steps. A FLUX.1 or SD3 pipeline (the same
16-channel VAE at 1024^2, T5-XXL) on another GPU is given OUTSIDE_STEPS one-GPU steps outside; a figure per step
(s/it) has none. Where a source publishes no one-GPU time, its rows borrow another source's one-GPU step (`base_ms`)
and judge the plans against each other.

Machines: xDiT's L40 and L20 servers are 8-GPU, two-socket PCIe 4.0 machines (xDiT: "Using 8xL40 actually slows down
due to the need for QPI communication"; its HunyuanDiT page: "the low communication bandwidth across sockets"). Their
GPU pairs are taken to share a switch, four GPUs to span the socket's host bridges, eight (and six) the two sockets
(`L40_SERVER`). The runs that name no link are taken over NVLink where the GPU has it.

Not used: xDiT's FLUX.1 'Cache Methods' table on H20 (1xH20 6.10 s is faster than FLUX.1-dev's 28 steps at 1024^2
can run on an H20's 148 TFLOP/s, so its job is not that one and the page does not say which it is).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel import cost
from ..parallel.devices import stated_hardware
from ..parallel.fitted import names, value
from ..parallel.plan import ParallelPlan, Workload
from ..parallel.planner import pick, survey
from .video import VIDEO_SCENARIOS
from .runs import CACHE_DIT, L40_SERVER, PARAATTENTION, RAYLIGHT, Scenario, fit, held


OUTSIDE_STEPS = (0.415 / 0.441 + 0.65 / 0.633) / 2   # FLUX.1 pipelines on A100 and L40 (module docstring)
A100_OUTSIDE_S = 0.415
L40_OUTSIDE_S = 0.65


def outside_steps(one_gpu_s: float, steps: int) -> float:
    """Seconds outside the loop of a pipeline that takes one_gpu_s on one GPU: OUTSIDE_STEPS of its one-GPU steps."""
    return one_gpu_s / (steps + OUTSIDE_STEPS) * OUTSIDE_STEPS


def flux(steps: int = 28, compiled: bool = False, variant: str = "flux-dev", **kw):
    return lambda: Workload.for_variant(variant, 1024, 1024, steps=steps, compiled=compiled, **kw)


def sd3(steps: int = 20, compiled: bool = False):
    return lambda: Workload.for_variant("sd3-medium", 1024, 1024, steps=steps, compiled=compiled, negative_pass=True)


XDIT_FLUX = "xDiT docs/performance/flux.md"
H100_EAGER_OUTSIDE = outside_steps(6.71, 28)
FLUX_EAGER_H100_STEP_MS = (6.71 - H100_EAGER_OUTSIDE) * 1e3 / 28

SCENARIOS = (
    Scenario("xdit-flux-h100", "FLUX.1-dev 1024^2 28 steps, H100 NVLink, eager", XDIT_FLUX + ", table 'latency using "
             "different USP strategies on 4xH100' (added with the optimized USP, xDiT pull request 369)", flux(), "H100 SXM", "nvlink", 6.71, (
                 held("ulysses2", 2, 4.38, "Ulysses at 2 GPUs, eager"),
                 fit("ring2", 2, 5.31, "the ring's launches per layer and hop (LAUNCH_US with the code's counts)"),
                 held("ulysses2,ring2", 4, 5.19, "a hybrid's launches"),
                 fit("ulysses4", 4, 4.24, "the eager launch floor: 4 H100s wait on the host (LAUNCH_US)"),
                 held("ring4", 4, 5.11, "three hops a layer against one (ring2)")),
             code=cost.XDIT_USP, outside=H100_EAGER_OUTSIDE),
    Scenario("xdit-flux-h100-compiled", "FLUX.1-dev 1024^2 28 steps, H100 NVLink, torch.compile", XDIT_FLUX + ", the "
             "same table", flux(compiled=True), "H100 SXM", "nvlink", 4.30, (
                 held("ulysses2", 2, 2.68, "compiled Ulysses at 2"),
                 held("ring2", 2, 2.60, "compiled ring at 2"),
                 held("ulysses2,ring2", 4, 1.80, "a compiled hybrid"),
                 fit("ulysses4", 4, 1.63, "the matrix products' fall at a quarter of the tokens (GEMM_HALF_WORK) and "
                                          "the compiled launches (COMPILED_LAUNCH_SHARE)"),
                 fit("ring4", 4, 1.98, "short key blocks (ATTN_HALF_KEYS) and the ring's merges")),
             code=cost.XDIT_USP, outside=H100_EAGER_OUTSIDE),
    Scenario("xdit-flux-a100", "FLUX.1-dev 1024^2 28 steps, A100 NVLink, eager", XDIT_FLUX + ", figure Flux-A100-crop"
             ".png (8xA100, 1024px; labelled points 12.77, 8.16, 5.55, 4.13 s, the rest read from the plot, +-0.05 s)",
             flux(), "A100 80GB", "nvlink", 12.77, (
                 held("ulysses2", 2, 8.45, "another machine's launches and NVLink"),
                 held("ring2", 2, 8.16, "the 2-GPU best (the hybrid's label)"),
                 held("pipefusion2", 2, 8.68, "PipeFusion over NVLink"),
                 held("ulysses4", 4, 5.55, "the 4-GPU best"),
                 held("ring4", 4, 5.93, "ring at 4"),
                 held("pipefusion4", 4, 6.30, "PipeFusion at 4"),
                 held("ulysses8", 8, 4.13, "the 8-GPU best: few heads a GPU"),
                 held("ring8", 8, 6.70, "high-degree ring: 7 hops a layer on key blocks of 1/8"),
                 held("pipefusion8", 8, 5.37, "PipeFusion at 8")),
             outside=A100_OUTSIDE_S, approximate=True),
    Scenario("xdit-flux-schnell-a100", "FLUX.1-schnell 1024^2 4 steps, A100 NVLink, eager", XDIT_FLUX + ", figure "
             "Flux-1K-A100.png (labelled bars; Ulysses over every GPU)", flux(4, variant="flux-schnell"), "A100 80GB",
             "nvlink", 2.18, (
                 held("ulysses2", 2, 1.48, "4 steps: the outside share dominates"),
                 held("ulysses4", 4, 1.12), held("ulysses8", 8, 0.93)),
             outside=A100_OUTSIDE_S),
    Scenario("xdit-flux-schnell-a100-compiled", "FLUX.1-schnell 1024^2 4 steps, A100 NVLink, torch.compile",
             XDIT_FLUX + ", figure Flux-1K-A100.png", flux(4, True, "flux-schnell"), "A100 80GB", "nvlink", 1.88, (
                 held("ulysses2", 2, 1.25), held("ulysses4", 4, 0.96), held("ulysses8", 8, 0.82)),
             outside=A100_OUTSIDE_S),
    Scenario("xdit-flux-l40", "FLUX.1-dev 1024^2 28 steps, L40 PCIe, eager", "xDiT paper (arXiv 2411.01738) figure "
             "'Flux.1-dev Latency on 2x8xL40 (1024px)' (xdit_assets Flux-16L40-crop.png; labelled points 18.36, 11.03, "
             "7.05, 5.53 s on the PipeFusion line, the rest read from the plot, +-0.2 s)", flux(), "L40", L40_SERVER,
             18.36, (
                 held("ulysses2", 2, 12.17, "a pair's exchange under one switch"),
                 held("ring2", 2, 11.31, "a pair's ring"),
                 held("pipefusion2", 2, 11.03, "PipeFusion over PCIe"),
                 fit("ulysses4", 4, 16.94, "all-to-all through the root complex (PCIE_A2A_CONTENTION)"),
                 held("ring4", 4, 7.86, "a ring through the root complex: one flow a GPU"),
                 held("pipefusion4", 4, 7.05, "PipeFusion at 4"),
                 fit("ulysses8", 8, 26.6, "all-to-all across the sockets, slower than one GPU (PCIE_A2A_CONTENTION)"),
                 fit("ring8", 8, 7.37, "a ring across the sockets' link (PCIE_SOCKET_GBS)"),
                 held("pipefusion8", 8, 5.53, "PipeFusion across the sockets")),
             outside=L40_OUTSIDE_S, approximate=True),
    Scenario("xdit-flux-schnell-l40", "FLUX.1-schnell 1024^2 4 steps, L40 PCIe, eager", XDIT_FLUX + ", figure "
             "Flux-1k-L40.png (labelled bars)", flux(4, variant="flux-schnell"), "L40", L40_SERVER, 3.18, (
                 held("ulysses2", 2, 1.87, "the pair"), held("ulysses2,ring2", 4, 1.87, "hybrid at 4"),
                 held("ulysses2,ring4", 8, 1.53, "hybrid across the sockets")),
             outside=L40_OUTSIDE_S),
    Scenario("xdit-flux-schnell-l40-compiled", "FLUX.1-schnell 1024^2 4 steps, L40 PCIe, torch.compile", XDIT_FLUX +
             ", figure Flux-1k-L40.png", flux(4, True, "flux-schnell"), "L40", L40_SERVER, 2.89, (
                 held("ulysses2", 2, 2.07, "compiled pair (slower than eager as published)"),
                 held("ulysses2,ring2", 4, 1.44), held("ulysses2,ring4", 8, 1.45)),
             outside=L40_OUTSIDE_S),
    Scenario("xdit-issue416-h100x8", "FLUX.1-dev 1024^2 25 steps, 8 H100 NVLink, eager, latent output",
             "xDiT issue 416 (github.com/xdit-project/xDiT/issues/416): benchmark/usp_latency_test.py with "
             "examples/flux_example.py on an 8xH100 80GB node", flux(25), "H100 SXM", "nvlink", None, (
                 held("ring8", 8, 4.34, "8 NVLink GPUs: a ring of 8 against Ulysses-led hybrids"),
                 held("ulysses2,ring4", 8, 3.55, "three hops a layer"),
                 held("ulysses4,ring2", 8, 2.81, "one hop a layer")),
             base_ms=FLUX_EAGER_H100_STEP_MS, base_note="no one-GPU time: xDiT's docs' eager H100 step (6.71 s at 28 "
                                                        "steps less its outside seconds); no VAE decode (latent output)"),
    Scenario("xdit-sd3-a100", "SD3-medium 1024^2 20 steps cfg, A100 NVLink, eager", "xDiT docs/performance/sd3.md, "
             "figure A100-SD3.png (the best plan per GPU count, labelled)", sd3(), "A100 80GB", "nvlink", 3.09, (
                 held("cfg2", 2, 1.73, "CFG parallel: one velocity a step"),
                 held("cfg2,pipefusion2", 4, 1.31, "PipeFusion's patches: launches per patch"),
                 fit("cfg2,pipefusion4", 8, 0.90, "launches under PipeFusion (4 patches of 6 blocks): LAUNCH_US on a "
                                                  "second machine")),
             outside=A100_OUTSIDE_S, approximate=True),
    Scenario("xdit-sd3-a100-compiled", "SD3-medium 1024^2 20 steps cfg, A100 NVLink, torch.compile", "xDiT docs/"
             "performance/sd3.md, figure A100-SD3.png", sd3(compiled=True), "A100 80GB", "nvlink", 2.54, (
                 held("cfg2", 2, 1.51), held("cfg2,pipefusion2", 4, 1.17),
                 held("cfg2,pipefusion4", 8, 1.15, "compiled slower than eager at 8 as published")),
             outside=A100_OUTSIDE_S, approximate=True),
    Scenario("xdit-sd3-a100-paper", "SD3-medium 1024^2 20 steps cfg, A100 NVLink, eager (paper run)", "xDiT paper, "
             "figure 'SD3 Latency on 8xA100 (1024px)' (xdit_assets SD3-A100-crop.png; a separate run, one GPU 2.71 s; "
             "single methods read from the plot, +-0.03 s)", sd3(), "A100 80GB", "nvlink", 2.71, (
                 held("pipefusion2", 2, 1.74), held("ulysses2", 2, 2.00), held("ring2", 2, 2.08),
                 held("pipefusion4", 4, 1.25), held("ulysses4", 4, 1.33), held("ring4", 4, 1.69),
                 held("pipefusion8", 8, 1.12),
                 fit("ulysses8", 8, 1.36, "8 GPUs no faster than 4: the launches (LAUNCH_US)"),
                 fit("ring8", 8, 2.22, "key blocks of 512 tokens (ATTN_HALF_KEYS) and 7 hops' launches")),
             outside=A100_OUTSIDE_S, approximate=True),
    Scenario("xdit-sd3-l40", "SD3-medium 1024^2 20 steps cfg, L40 PCIe, eager", "xDiT docs/performance/sd3.md, "
             "figure L40-SD3.png (labelled)", sd3(), "L40", L40_SERVER, 3.92, (
                 held("cfg2", 2, 2.18), held("cfg2,pipefusion2", 4, 1.52), held("cfg2,pipefusion4", 8, 1.26)),
             outside=L40_OUTSIDE_S, approximate=True),
    Scenario("xdit-sd3-l40-compiled", "SD3-medium 1024^2 20 steps cfg, L40 PCIe, torch.compile", "xDiT docs/"
             "performance/sd3.md, figure L40-SD3.png", sd3(compiled=True), "L40", L40_SERVER, 3.59, (
                 held("cfg2", 2, 1.99), held("cfg2,pipefusion2", 4, 1.41), held("cfg2,pipefusion4", 8, 1.20)),
             outside=L40_OUTSIDE_S, approximate=True),
    Scenario("paraattention-flux-a100", "FLUX.1-dev 1024^2 28 steps, A100 NVLink, eager (ParaAttention)",
             "ParaAttention README, table 'Context Parallelism (without First Block Cache)' (its run_flux.py mesh: "
             "ring of at most 2, Ulysses over the rest; it also splits the VAE)", flux(), "A100 80GB", "nvlink", 13.843,
             (held("ring2", 2, 8.307, "another code's ring"), held("ulysses2,ring2", 4, 6.157, "the 4-GPU hybrid")),
             code=PARAATTENTION, outside=A100_OUTSIDE_S),
    Scenario("paraattention-flux-a100-compiled", "FLUX.1-dev 1024^2 28 steps, A100 NVLink, torch.compile "
             "(ParaAttention)", "ParaAttention README, the same table", flux(compiled=True), "A100 80GB", "nvlink",
             9.997, (held("ring2", 2, 5.775), held("ulysses2,ring2", 4, 3.557)),
             code=PARAATTENTION, outside=A100_OUTSIDE_S),
    Scenario("cache-dit-flux-h100", "FLUX.1-dev 1024^2 50 steps, H100, eager (cache-dit)", "cache-dit docs/benchmark/"
             "NVIDIA_GPU.md, table 'NVIDIA H100' (baseline and Ulysses 2; link not stated: NVLink taken)", flux(50),
             "H100 SXM", "nvlink", 9.30, (held("ulysses2", 2, 6.04, "another code's Ulysses"),),
             code=CACHE_DIT, outside=outside_steps(9.30, 50)),
    Scenario("cache-dit-flux-l20", "FLUX.1-dev 1024^2 28 steps, L20 PCIe, eager (cache-dit)", "cache-dit docs/benchmark/"
             "NVIDIA_GPU.md: 'Baseline(L20x1)' 24.85 s (hybrid cache table), 'L20x2 w/ Ulysses' 13.87 s (async "
             "Ulysses table)", flux(), "L20", L40_SERVER, 24.85, (held("ulysses2", 2, 13.87, "a PCIe pair"),),
             code=CACHE_DIT, outside=outside_steps(24.85, 28)),
    Scenario("raylight-flux", "FLUX.1-dev fp8 1024^2, 2x RTX 2000 Ada across sockets, s/it (Raylight)", "Raylight "
             "README, table '5090 vs RTX 2000 ADA' (ComfyUI, 20 steps, s/it; 'P2P is supported but runs over SYS'; "
             "the RTX 2000 Ada is priced as an Ada PCIe 4.0 card, its one-GPU s/it the base)",
             flux(1, fp8_weights=True), "RTX 4090", "pcie-socket", 2.22,
             (held("ulysses2", 2, 1.26, "a pair across the sockets"),), code=RAYLIGHT, unit="s/step"),
)
# The scenarios whose per-GPU-count pick is checked against the published best: those with several published plans
# on some GPU count.
CHECKED = tuple(s for s in SCENARIOS
                if any(sum(r.gpus == g for r in s.runs) > 1 for g in {r.gpus for r in s.runs}))


def all_scenarios() -> tuple:
    return SCENARIOS + VIDEO_SCENARIOS


def hardware(s: Scenario, gpus: int):
    return stated_hardware(gpus, s.gpu, s.link_for(gpus) if gpus > 1 else "nvlink")


def predict(s: Scenario, plan: str, gpus: int) -> cost.Estimate:
    """The transformer loop's estimate (every step computed)."""
    return cost.estimate(ParallelPlan.parse(plan), s.workload(), hardware(s, gpus), code=s.code,
                         one_gpu_ms=s.one_gpu_ms)


def predicted_s(s: Scenario, plan: str, gpus: int) -> float:
    """The published quantity as the model predicts it: the seconds outside the loop + the computed share of it."""
    return s.outside_s + s.computed_share * predict(s, plan, gpus).job_ms / 1e3


@dataclass(frozen=True)
class Row:
    scenario: str
    plan: str
    gpus: int
    published_s: float
    predicted_s: float
    one_gpu_s: float | None
    fit: bool
    why: str
    source: str = ""

    @property
    def role(self) -> str:
        return "fit" if self.fit else "held out"

    @property
    def residual(self) -> float:
        """predicted / published - 1 (of the time; the speed-up's residual is 1 / (1 + this) - 1)."""
        return self.predicted_s / self.published_s - 1

    @property
    def published_speedup(self) -> float:
        return self.one_gpu_s / self.published_s

    @property
    def predicted_speedup(self) -> float:
        return self.one_gpu_s / self.predicted_s

    @property
    def speedup_residual(self) -> float:
        return self.predicted_speedup / self.published_speedup - 1


def validation_rows(scenarios=None) -> list[Row]:
    """Every published row against the model's prediction."""
    return [Row(s.name, ParallelPlan.parse(r.plan).describe(), r.gpus, r.seconds, predicted_s(s, r.plan, r.gpus),
                s.one_gpu_s, r.fit, r.why, s.source)
            for s in (all_scenarios() if scenarios is None else scenarios) for r in s.runs]


@dataclass(frozen=True)
class Ratio:
    """A speed-up from one GPU count to another (the fastest published plan on each, 1 GPU the base), published
    against predicted."""
    scenario: str
    from_gpus: int
    to_gpus: int
    published: float
    predicted: float
    held_out: bool           # neither end is a fitted row

    @property
    def residual(self) -> float:
        return self.predicted / self.published - 1


def ratios(scenarios=None) -> list[Ratio]:
    """Each scenario's speed-ups between consecutive GPU counts (1 GPU first where it is published)."""
    out = []
    for s in (all_scenarios() if scenarios is None else scenarios):
        best = {1: (s.one_gpu_s, s.one_gpu_s, True)} if s.one_gpu_s is not None else {}
        for r in s.runs:
            if r.gpus not in best or r.seconds < best[r.gpus][0]:
                best[r.gpus] = (r.seconds, predicted_s(s, r.plan, r.gpus), not r.fit)
        counts = sorted(best)
        for a, b in zip(counts, counts[1:]):
            (pa, qa, ha), (pb, qb, hb) = best[a], best[b]
            out.append(Ratio(s.name, a, b, pa / pb, qa / qb, ha and hb))
    return out


@dataclass(frozen=True)
class Best:
    scenario: str
    gpus: int
    published_plan: str
    published_s: float
    chosen_plan: str          # the planner's pick among the published plans of at most `gpus` GPUs
    chosen_ranks: int
    chosen_published_s: float
    chosen_predicted_s: float
    auto_plan: str            # auto's pick among every plan of at most `gpus` GPUs (most were never measured)
    auto_ranks: int
    auto_predicted_s: float

    @property
    def within(self) -> float:
        """The chosen plan's published time over the published best's, - 1."""
        return self.chosen_published_s / self.published_s - 1


def best_rows(scenarios=None) -> list[Best]:
    """For each checked scenario and GPU count n: the published best plan on at most n GPUs, the plan the planner picks
    (planner.pick, approximate plans allowed where the published bests use PipeFusion) among the published plans of at
    most n GPUs with that plan's published time, and what auto picks among all plans of at most n GPUs."""
    out = []
    for s in (checked_scenarios() if scenarios is None else scenarios):
        published = {(ParallelPlan.parse(r.plan).describe(), r.gpus): r.seconds for r in s.runs}
        if s.one_gpu_s is not None:
            published[("single rank", 1)] = s.one_gpu_s
        work = s.workload()
        for gpus in sorted({r.gpus for r in s.runs}):
            mine = [(p, g) for (p, g) in published if g <= gpus]
            name, ranks = min(mine, key=lambda key: published[key])
            estimates = [cost.estimate(ParallelPlan.parse(p), work, hardware(s, g), code=s.code,
                                       one_gpu_ms=s.one_gpu_ms) for p, g in mine]
            chosen, _ = pick(estimates, s.approximate)
            auto = survey(gpus, work, hardware(s, gpus), s.approximate, code=s.code, one_gpu_ms=s.one_gpu_ms).chosen
            plan = chosen.plan.describe()
            out.append(Best(s.name, gpus, name, published[(name, ranks)], plan, chosen.ranks,
                            published[(plan, chosen.ranks)], predicted_s(s, plan, chosen.ranks), auto.plan.describe(),
                            auto.ranks, s.outside_s + s.computed_share * auto.job_ms / 1e3))
    return out


def checked_scenarios() -> tuple:
    return CHECKED + tuple(s for s in VIDEO_SCENARIOS
                           if any(sum(r.gpus == g for r in s.runs) > 1 for g in {r.gpus for r in s.runs}))


# ---- the tables -----------------------------------------------------------------------------------------------------
def validation_table() -> list[str]:
    """Markdown: every published row against the model with its residual and split, the speed-ups from one GPU count
    to the next, and each GPU count's published best against the planner's choice."""
    lines = ["Published multi-GPU runs against the cost model (each scenario's published one-GPU time as base, its code's "
             "overlap and launches, its link class per GPU count). Residual = predicted / published - 1; fit: a row "
             "the constants are fitted to (" + ", ".join(f"{n} {value(n):.4g}" for n in names()) +
             "); held out: judged only.", "",
             "| scenario | base: 1 GPU | GPUs | link | plan | published | predicted | residual | split | why | source |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in all_scenarios():
        base = f"{s.one_gpu_s:g} {s.unit}" if s.one_gpu_s is not None else f"{s.base_ms:.0f} ms/step borrowed"
        for r in s.runs:
            p = predicted_s(s, r.plan, r.gpus)
            lines.append(f"| {s.name} | {base} | {r.gpus} | {s.link_for(r.gpus)} | {ParallelPlan.parse(r.plan).describe()}"
                         f" | {r.seconds:g} | {p:.3g} | {p / r.seconds - 1:+.1%} | {'fit' if r.fit else 'held out'} | "
                         f"{r.why} | {s.source} |")
    lines += ["", "Speed-up from one GPU count to the next (the fastest published plan on each), published against "
                  "predicted; held out: neither end is a fitted row.", "",
              "| scenario | GPUs | published speed-up | predicted | residual | held out |", "|---|---|---|---|---|---|"]
    for r in ratios():
        lines.append(f"| {r.scenario} | {r.from_gpus} -> {r.to_gpus} | {r.published:.2f} | {r.predicted:.2f} | "
                     f"{r.residual:+.1%} | {'yes' if r.held_out else 'no'} |")
    lines += ["", "Each GPU count: the published best on at most that many GPUs, the planner's pick among the "
                  "published plans (its published time, and how far from the best), and auto's pick among every plan.",
              "",
              "| scenario | GPUs | published best | published | planner's pick | GPUs used | published | from best | "
              "auto among all plans | GPUs used | predicted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in best_rows():
        lines.append(f"| {b.scenario} | {b.gpus} | {b.published_plan} | {b.published_s:g} | {b.chosen_plan} | "
                     f"{b.chosen_ranks} | {b.chosen_published_s:g} | {b.within:+.1%} | {b.auto_plan} | "
                     f"{b.auto_ranks} | {b.auto_predicted_s:.3g} |")
    return lines


def summary() -> list[str]:
    """The residuals in a few lines: fitted and held-out rows, held-out speed-ups, the worst of each."""
    rows = validation_rows()
    held_rows = [r for r in rows if not r.fit]
    ratio = [r for r in ratios() if r.held_out]
    within = lambda xs, f, t: sum(abs(f(x)) <= t for x in xs)   # noqa: E731
    worst = max(held_rows, key=lambda r: abs(r.residual))
    return [f"rows: {len(rows)} ({len(rows) - len(held_rows)} fit, {len(held_rows)} held out); held out within 25%: "
            f"{within(held_rows, lambda r: r.residual, 0.25)}, within 10%: "
            f"{within(held_rows, lambda r: r.residual, 0.10)}; worst {worst.scenario} {worst.plan} on {worst.gpus}: "
            f"{worst.residual:+.1%}",
            f"held-out speed-ups: {len(ratio)}, within 25%: {within(ratio, lambda r: r.residual, 0.25)}, within "
            f"10%: {within(ratio, lambda r: r.residual, 0.10)}"]
