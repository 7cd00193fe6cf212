"""docs/fit.md's fit tables, every figure the planner's (resolve_plan, cost.estimate), none by hand: the memory each GPU
needs per model, weight format and plan (`memory_table`), and the video fit table: on the usual machines, the plan
`auto` picks for a Wan or HunyuanVideo 1.5 clip, the memory per GPU it needs and its estimated time, for each model,
weight format and video size; Wan 2.2 A14B once with both experts resident and once with the idle one in host memory (`fit_table`)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import families
from ..errors import PlanError
from ..models.quantized import BLOCKS
from . import cost
from .devices import stated_hardware
from .plan import HOST, RESIDENT, ParallelPlan, Workload, feasible, plan_problems
from .planner import resolve_plan


@dataclass(frozen=True)
class Machine:
    label: str
    gpus: int
    gpu: str
    link: str


# 24 GB: GeForce cards, which have no peer access; 48 GB: PCIe server cards, eight across a two-socket server's link;
# 80 GB: SXM over NVLink
MACHINES = (Machine("2x24 GB", 2, "RTX 4090", "pcie-no-peer"), Machine("4x24 GB", 4, "RTX 4090", "pcie-no-peer"),
            Machine("8x48 GB", 8, "L40S", "pcie-socket"), Machine("1x80 GB", 1, "H100 SXM", "nvlink"),
            Machine("2x80 GB", 2, "H100 SXM", "nvlink"), Machine("4x80 GB", 4, "H100 SXM", "nvlink"),
            Machine("8x80 GB", 8, "H100 SXM", "nvlink"))
WEIGHTS = (("bf16", {}), ("fp8", {"fp8_weights": True}),
           ("GGUF Q4_K", {"bytes_per_weight": BLOCKS["Q4_K"][2] / BLOCKS["Q4_K"][1]}))
SIZES = ((832, 480, 81), (1280, 720, 81))
MODELS = (("Wan 2.1 1.3B", "wan2.1-1.3b", "auto"), ("Wan 2.1 14B", "wan2.1-14b", "auto"),
          ("Wan 2.2 A14B, both experts resident", "wan2.2-a14b", RESIDENT),
          ("Wan 2.2 A14B, idle expert in host memory", "wan2.2-a14b", HOST),
          ("Wan 2.2 TI2V-5B", "wan2.2-ti2v-5b", "auto"), ("HunyuanVideo 1.5", "hunyuanvideo-1.5", "auto"),
          ("Wan-Animate 2 (cfg 1)", "wan-animate-2", "auto", {"negative_pass": False}))
STEPS = 20


def cell(work: Workload, m: Machine) -> str:
    """What auto picks for `work` on machine `m`: plan, GiB per GPU, est. seconds a clip (with the host memory per
    machine when the idle expert waits there), or "no" with the least a GPU would need."""
    hw = stated_hardware(m.gpus, m.gpu, m.link)
    try:
        plan = resolve_plan("auto", m.gpus, work, hw).plan
    except PlanError:
        plans = [p for k in range(1, m.gpus + 1) for p in feasible(k, work)]
        least = min((cost.estimate(p, work, hw) for p in plans), key=lambda e: e.memory["total"])
        return f"no ({least.memory['total']:.1f})"
    e = cost.estimate(plan, work, hw)
    host = f", host {e.host_gib:.0f}" if e.placement == HOST else ""
    return f"{plan.describe()}: {e.memory['total']:.1f}, {e.s_per_image:.0f} s{host}"


def header() -> list[str]:
    """What the table assumes, in words."""
    return [f"Each cell: the plan auto picks (it may leave GPUs idle), GiB per GPU, est. seconds a clip ({STEPS} "
            f"steps, cfg > 1 but Wan-Animate 2's 1, eager, bf16 compute; transformer only), and for the idle expert "
            f"in host memory the host GiB per machine; \"no (X)\": no plan fits, the least needs X GiB per GPU. 24 "
            f"GB: RTX 4090 (PCIe, no peer access), 48 GB: L40S (PCIe across sockets), 80 GB: H100 SXM (NVLink).", ""]


def markdown(header: tuple, rows: list[tuple]) -> list[str]:
    """The README's form of a table: a header, its rule and a line a row, cells unpadded."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def fit_rows() -> tuple[tuple, list[tuple]]:
    """The video fit table: (header, rows), one row per model, weights and size, one column per machine."""
    rows = []
    for title, variant, placement, *job in MODELS:
        for weights, kw in WEIGHTS:
            for w, h, frames in SIZES:
                work = Workload.for_variant(variant, w, h, frames=frames, steps=STEPS, placement=placement,
                                            **{"negative_pass": True, **(job[0] if job else {}), **kw})
                rows.append((title, f"{weights} ({work.weight_bytes / 2 ** 30:.1f} GiB)", f"{w}x{h}x{frames}",
                             *(cell(work, m) for m in MACHINES)))
    return ("model", "weights", "video", *(m.label for m in MACHINES)), rows


def fit_table() -> list[str]:
    """Markdown, one row per model, weights and size, one column per machine."""
    return markdown(*fit_rows())


# ---- weights divided among the GPUs (the sharding fit table) ------------------------------------------------------
SHARD_MACHINES = (Machine("2x16 GB", 2, "RTX 4080", "pcie-no-peer"), Machine("2x24 GB", 2, "RTX 4090", "pcie-no-peer"),
                  Machine("4x24 GB", 4, "RTX 4090", "pcie-no-peer"), Machine("8x24 GB", 8, "RTX 4090", "pcie-no-peer"),
                  Machine("2x48 GB", 2, "RTX 6000 Ada", "pcie-bridge"))
SHARD_WEIGHTS = (("bf16", {}), ("fp8", {"fp8_weights": True}),
                 ("GGUF Q8_0", {"bytes_per_weight": BLOCKS["Q8_0"][2] / BLOCKS["Q8_0"][1]}),
                 ("GGUF Q4_K", {"bytes_per_weight": BLOCKS["Q4_K"][2] / BLOCKS["Q4_K"][1]}))
SHARD_MODELS = (("Wan 2.1 14B", "wan2.1-14b", (1280, 720, 81), {}),
                ("Wan 2.2 A14B (both experts)", "wan2.2-a14b", (1280, 720, 81), {}),
                ("Wan 2.2 A14B (both experts)", "wan2.2-a14b", (832, 480, 81), {}),
                ("FLUX.2 [dev]", "flux2-dev", (1024, 1024, 1), {"negative_pass": False}),
                ("Qwen-Image (cfg 2.5)", "qwen-image", (1328, 1328, 1), {}),
                ("Krea 2 Turbo (cfg 1)", "krea-2", (1024, 1024, 1), {"negative_pass": False}),
                ("HunyuanVideo 1.5 (cfg 6)", "hunyuanvideo-1.5", (1280, 720, 121), {}),
                ("Wan-Animate 2 (cfg 1)", "wan-animate-2", (482, 854, 81), {"negative_pass": False}))


def shard_header() -> list[str]:
    return [f"Each cell: the plan auto picks (\"shardN\": each GPU holds 1/N of the weights), GiB per GPU, est. seconds "
            f"an image or clip ({STEPS} steps, cfg > 1 but FLUX.2's, Krea 2 Turbo's and Wan-Animate 2's 1, eager, "
            f"bf16 compute; transformer only), the idle expert's host GiB per machine where auto keeps it there; "
            f"\"no (X)\": no plan fits, the least needs X GiB per GPU. 16 GB: RTX 4080, 24 GB: RTX 4090 (PCIe, no "
            f"peer access), 48 GB: RTX 6000 Ada (PCIe).", ""]


def shard_rows() -> tuple[tuple, list[tuple]]:
    """The sharding fit table: (header, rows), one row per model, size and weights, one column per machine."""
    rows = []
    for title, variant, (w, h, frames), kw in SHARD_MODELS:
        for weights, wkw in SHARD_WEIGHTS:
            work = Workload.for_variant(variant, w, h, frames=frames, steps=STEPS,
                                        **{"negative_pass": True, **kw, **wkw})
            size = f"{w}x{h}x{frames}" if frames > 1 else f"{w}x{h}"
            rows.append((title, f"{weights} ({work.weight_bytes / 2 ** 30:.1f} GiB)", size,
                         *(cell(work, m) for m in SHARD_MACHINES)))
    return ("model", "weights", "size", *(m.label for m in SHARD_MACHINES)), rows


def shard_table() -> list[str]:
    """Markdown, one row per model, size and weights, one column per machine of SHARD_MACHINES."""
    return markdown(*shard_rows())


# ---- memory per GPU (docs/fit.md's first table) ---------------------------------------------------------------------
MEMORY_MODELS = (("FLUX.1-dev / schnell", "flux-dev", False, True), ("SD3-medium", "sd3-medium", True, True),
                 ("SD3.5-medium", "sd3.5-medium", True, True), ("SD3.5-large", "sd3.5-large", True, True),
                 ("Qwen-Image (cfg 2.5)", "qwen-image", True, True), ("FLUX.2 [dev]", "flux2-dev", False, True),
                 ("FLUX.2 [klein] 4B", "flux2-klein-4b", False, False),
                 ("FLUX.2 [klein] 9B", "flux2-klein-9b", False, False),
                 ("Krea 2 Turbo (cfg 1)", "krea-2", False, True))   # (title, variant, cfg, with fp8 row)
MEMORY_PLANS = ("single rank", "ulysses2", "ulysses4", "ulysses8", "cfg2", "pipefusion2", "pipefusion4")


def memory_cell(work: Workload, plan: ParallelPlan) -> str:
    """GiB per GPU of `plan` (the fullest stage under PipeFusion); "-" for CFG parallel without a negative pass,
    "n/a" for a plan the model's dimensions forbid."""
    if plan.cfg == 2 and not work.negative_pass:
        return "-"
    if plan_problems(plan, work):
        return "n/a"
    hw = stated_hardware(plan.world_size, "H100 SXM", "nvlink")
    return f"{cost.estimate(plan, work, hw).memory['total']:.1f}"


def memory_rows() -> tuple[tuple, list[tuple]]:
    """GiB per GPU at 1024x1024, batch 1, bf16 compute, each model's usual text tokens, per plan: (header, rows)."""
    rows = []
    for title, variant, cfg, fp8 in MEMORY_MODELS:
        for weights in (("bf16", False), ("fp8", True))[:2 if fp8 else 1]:
            work = Workload.for_variant(variant, negative_pass=cfg, fp8_weights=weights[1])
            rows.append((title, f"{weights[0]} ({work.weight_bytes / 2 ** 30:.1f} GiB)",
                         *(memory_cell(work, ParallelPlan.parse(p)) for p in MEMORY_PLANS)))
    return ("model", "weights", "1 GPU", *MEMORY_PLANS[1:]), rows


def memory_table() -> list[str]:
    """Markdown: GiB per GPU at 1024x1024, batch 1, bf16 compute, each model's usual text tokens, per plan."""
    return markdown(*memory_rows())


# ---- MiniMax-H3 (audio + video): with and without the weights divided ----------------------------------------------
AV_MACHINES = (Machine("2x24 GB", 2, "RTX 4090", "pcie-no-peer"), Machine("4x24 GB", 4, "RTX 4090", "pcie-no-peer"),
               Machine("8x24 GB", 8, "RTX 4090", "pcie-no-peer"), Machine("2x48 GB", 2, "RTX 6000 Ada", "pcie-bridge"),
               Machine("4x48 GB", 4, "RTX 6000 Ada", "pcie-bridge"), Machine("1x80 GB", 1, "H100 SXM", "nvlink"),
               Machine("2x80 GB", 2, "H100 SXM", "nvlink"), Machine("4x80 GB", 4, "H100 SXM", "nvlink"),
               Machine("8x80 GB", 8, "H100 SXM", "nvlink"))


def whole_cell(work: Workload, m: Machine) -> str:
    """The fastest plan that keeps the whole weights on every GPU (no shard) and fits, or "no (X)" with the least a GPU
    would need."""
    hw = stated_hardware(m.gpus, m.gpu, m.link)
    plans = [p for k in range(1, m.gpus + 1) for p in feasible(k, work) if p.shard == 1]
    estimates = [cost.estimate(p, work, hw) for p in plans]
    fitting = [e for e in estimates if e.memory["total"] <= hw.memory_gib]
    if not fitting:
        return f"no ({min(e.memory['total'] for e in estimates):.1f})"
    best = min(fitting, key=lambda e: e.s_per_image)
    return f"{best.plan.describe()}: {best.memory['total']:.1f}, {best.s_per_image:.0f} s"


def av_header() -> list[str]:
    return ["Each cell: the plan, GiB per GPU, est. seconds a clip (eager, bf16 compute; transformer only): first as "
            "auto picks it (\"shardN\": each GPU holds 1/N of the weights, where whole weights do not fit), then the "
            "fastest with whole weights on every GPU; \"no (X)\": no plan fits, the least needs X GiB per GPU. 24 GB: "
            "RTX 4090 (PCIe, no peer access), 48 GB: RTX 6000 Ada (PCIe), 80 GB: H100 SXM (NVLink). A clip's tokens "
            "count its audio rows (both channels, 40 a second) and its text with the video's.", ""]


# the audio-video families whose clips the tables price (Family.fit_jobs), each in every divided-weights format
AV_MODELS = {v: (families.by_variant(v).fit_jobs, SHARD_WEIGHTS) for v in ("minimax-h3", "ltx-2.3", "ltx-2.5")}
AV_JOBS, LTX_JOBS = AV_MODELS["minimax-h3"][0], AV_MODELS["ltx-2.3"][0]


def ltx_header() -> list[str]:
    return ["LTX-2.3, the same columns. A clip's tokens count its audio rows (25 a second) with the video's, where the "
            "ranks hold the audio whole and compute it alike (the planner's split share of it is an under-count of "
            "what each rank computes, small beside the video: 121 audio rows to 14,080 video rows at 1280x704); the "
            "text is the connectors' 1024 tokens.", ""]


def ltx25_header() -> list[str]:
    return ["LTX-2.5 (the LTX-2.3 block without the video feed-forward's biases, with the keyframe embedding), the "
            "same columns and jobs: its templates sample the same two passes at 24 fps (126 audio rows) with "
            "LTXVDualCFGGuider at video 1 and audio 1 (no negative pass); the full model at cfg > 1 runs it.", ""]


def av_rows(variant: str = "minimax-h3") -> tuple[tuple, list[tuple]]:
    """(header, rows): one row per job, weights and placement (auto / whole), one column per machine of
    AV_MACHINES."""
    rows = []
    jobs, formats = AV_MODELS[variant]
    for title, w, h, frames, steps, negative in jobs:
        for weights, wkw in formats:
            work = Workload.for_variant(variant, w, h, frames=frames, steps=steps, negative_pass=negative, **wkw)
            job = f"{w}x{h}x{frames}, {steps} steps, {title}"
            for label, fn in (("where needed (auto)", cell), ("never", whole_cell)):
                rows.append((job, f"{weights} ({work.weight_bytes / 2 ** 30:.1f} GiB)", label,
                             *(fn(work, m) for m in AV_MACHINES)))
    return ("job", "weights", "weights divided", *(m.label for m in AV_MACHINES)), rows


def av_table(variant: str = "minimax-h3") -> list[str]:
    """Markdown, one row per job, weights and placement (auto / whole), one column per machine of AV_MACHINES."""
    return markdown(*av_rows(variant))
