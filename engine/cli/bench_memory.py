"""`bench memory`: what each rank holds under PipeFusion 1, 2 and 4, next to weights / P, on a synthetic model large
enough for weights to dominate (a few hundred MB of fp32); and `bench comm`'s PipeFusion rows: every kind of bytes
each rank sends under PipeFusion and its hybrids, counted at the send in a real pipelined job, against the closed forms
the planner prices with."""
from __future__ import annotations

import dataclasses

from .. import families
from ..generate.request import GenerateRequest
from ..models.load import inspect_model
from ..parallel.pipefusion.layout import balanced_split, block_lists, meta_model
from ..parallel.plan import ParallelPlan
from ..runtime.client import Engine
from . import args as types
from .tables import markdown

MiB = 2 ** 20
SMALL = [v for f in families.FAMILIES for v in f.dims.get("small", {})]   # the variants with a small size


def register(bench, emit) -> None:
    m = bench.add_parser("memory", help="weights and peak memory per rank under PipeFusion 1, 2, 4",
                         description="One job per PipeFusion degree on CPU ranks (and GPU memory with --gpus): each "
                                     "rank's weights held, its peak resident memory above what it had before loading, "
                                     "next to weights / P.")
    m.add_argument("--models", type=types.name_list(SMALL), default="flux-dev,sd3-medium",
                   help=f"synthetic variants at the small size (a few hundred MB): {', '.join(SMALL)}")
    m.add_argument("--gpus", type=types.gpu_list, help="CUDA GPUs, one per rank (default: CPU ranks)")
    m.add_argument("--stages", type=types.int_list, default="1,2,4", help="PipeFusion degrees")
    m.add_argument("--splits", type=types.name_list(["compute", "weights"]), default="compute,weights",
                   help="stage splits: balanced by compute (the default a job gets) and by weights (--stage-blocks)")
    m.set_defaults(run=lambda a: emit(a, "memory", bench_memory(a.models, a.stages, a.gpus, a.splits)), parser=m)


def _job(source: str, plan: ParallelPlan, steps: int = 2, size: int = 256, **fields) -> GenerateRequest:
    r = GenerateRequest.random_conditioning(source, size, size, text_tokens=64, steps=steps, plan=plan,
                                            cfg=inspect_model(source).spec.cfg, **fields)
    return r.validate(plan.world_size)


def weight_split(source: str, stages: int) -> list[int]:
    """Blocks per stage balanced by the blocks' weights (what --stage-blocks can ask for)."""
    info = inspect_model(source)
    model = meta_model(info)
    sizes = [float(sum(p.numel() for p in block.parameters())) for name in block_lists(info)
             for block in model.get_submodule(name)]
    return balanced_split(sizes, stages)


def bench_memory(models: list[str], stages: list[int], gpus: list[int] | None = None,
                 splits: tuple[str, ...] = ("compute",)) -> list[dict]:
    print("per rank: weights held (parameters and buffers it owns; the rest of the model is on the meta device), "
          "peak resident memory above the rank's memory before loading (weights + activations + stale K/V + "
          "allocator), fp32, 256x256, 2 steps", flush=True)
    rows, out = [], []
    for variant in models:
        source = f"synthetic:{variant}:small"
        for p, split in [(p, split) for p in stages for split in (splits if p > 1 else ["-"])]:
            plan = ParallelPlan(pipefusion=p)
            ranks = p
            if gpus and len(gpus) < ranks:
                print(f"{variant} pipefusion {p}: skipped, needs {ranks} GPUs", flush=True)
                continue
            fields = {"stage_blocks": weight_split(source, p)} if split == "weights" else {}
            with Engine(ranks, device="cuda" if gpus else "cpu", gpus=gpus[:ranks] if gpus else None) as engine:
                result = engine.submit("generate", *_job(source, plan, **fields).to_job())
            for rank in result.ranks:
                held = rank["loaded"]["held_bytes"]
                mem = rank["memory"]
                grown = (mem["peak_rss_gib"] - rank["rss_before_load_gib"]) * 2 ** 30
                stage = rank.get("pipefusion", {})
                blocks = stage.get("blocks")
                row = {"model": variant, "pipefusion": p, "split": split, "rank": rank["rank"], "blocks": blocks,
                       "held_bytes": held,
                       "peak_rss_growth_bytes": grown, "gpu_peak_gib": mem.get("peak_gib")}
                out.append(row)
                rows.append((variant, p, split, rank["rank"], f"{blocks[0]}-{blocks[-1]}" if blocks else "all",
                             f"{held / MiB:.0f}", f"{grown / MiB:.0f}",
                             f"{mem['peak_gib'] * 1024:.0f}" if "peak_gib" in mem else "-"))
            print(f"{variant} pipefusion {p}{f' ({split} split)' if p > 1 else ''}: measured", flush=True)
    wholes = {r["model"]: r["held_bytes"] for r in out if r["pipefusion"] == 1}
    table = []
    for row, r in zip(rows, out):
        whole = wholes.get(r["model"])
        share = f"{whole / r['pipefusion'] / MiB:.0f}" if whole else "-"
        ratio = f"{r['held_bytes'] / (whole / r['pipefusion']):.2f}" if whole else "-"
        table.append(row[:6] + (share, ratio) + row[6:])
    print(markdown(("model", "P", "split", "rank", "blocks", "held MiB", "weights/P MiB", "held/(w/P)",
                    "peak RSS growth MiB", "GPU peak MiB"), table))
    print("split compute: the default (on GPUs a job moves to the most balanced split that fits when this one does "
          "not); FLUX's double blocks cost what a single block costs per token but hold twice the weights. split "
          "weights: --stage-blocks balanced by the blocks' weights. The first stage also holds the image and text "
          "embedders (and SD3's position table), every stage the timestep embedder (FLUX.2: and the three "
          "modulations its blocks share).")
    return out


def bench_comm_pipefusion(quick: bool = False) -> list[dict]:
    """Every kind of bytes each rank sends under PipeFusion and its hybrids, counted at the send in a real job (tiny
    synthetic model, CPU ranks) vs the closed forms the planner prices with (comm.pipefusion_job_bytes), and the
    planner's price per step for the real model at 1024x1024 bf16 (cost.comm_bytes)."""
    from ..parallel.comm import pipefusion_job_bytes
    from ..parallel.cost import comm_bytes
    from ..parallel.plan import Workload

    print("\nPipeFusion and its hybrids: bytes each rank sends per step, every kind, counted in a real pipelined job "
          "(tiny synthetic, 128x128, 4 steps, 1 warmup) vs the closed forms the planner prices with; and the "
          "planner's price per rank and step for the real model at 1024x1024, bf16 (SD3: positive and negative "
          "pass)", flush=True)
    table, out = [], []
    cases = [("flux-dev", dict(pipefusion=2), 2, 1), ("flux-dev", dict(pipefusion=2, ring=2), 2, 1)]
    if not quick:
        cases += [("flux-dev", dict(pipefusion=2), 4, 1), ("flux-dev", dict(pipefusion=4), 4, 1),
                  ("flux-dev", dict(pipefusion=2, ulysses=2), 2, 1), ("flux-dev", dict(pipefusion=2, ring=2), 4, 1),
                  ("flux-dev", dict(pipefusion=2, dp=2), 2, 2), ("sd3-medium", dict(pipefusion=2), 4, 1),
                  ("sd3-medium", dict(pipefusion=2, cfg=2), 2, 1)]
    for variant, degrees, m, batch in cases:
        source = f"synthetic:{variant}:tiny"
        info = inspect_model(source)
        plan, steps = ParallelPlan(**degrees), 4
        r = _job(source, plan, steps=steps, size=128, patches=m, batch=batch)
        with Engine(plan.world_size, device="cpu") as engine:
            result = engine.submit("generate", *r.to_job())
        passes = 2 if r.negative_pass else 1
        passes_mine = passes // plan.cfg
        dual = set(info.config.get("dual_attention_layers") or ())
        real = dataclasses.replace(Workload.for_variant(variant, 1024, 1024, negative_pass=r.negative_pass),
                                   patches=m)
        price = sum(comm_bytes(plan, real).values())
        for rank in result.ranks:
            stage, blocks = rank["pipefusion"]["stage"], rank["pipefusion"]["blocks"]
            counted = {k: round(v * steps) for k, v in rank["bytes_sent_per_step"].items() if v}
            expected = pipefusion_job_bytes(
                plan, stage=stage, layers=len(blocks), dual_layers=len(dual & set(blocks)),
                image_tokens=(128 // 8 // info.latent_patch) ** 2, text_tokens=64,
                heads=info.config["num_attention_heads"], head_dim=info.config["attention_head_dim"],
                out_features=16 * info.latent_patch ** 2, rows=passes_mine * batch // plan.dp,
                passes_mine=passes_mine, passes=passes, images=batch, latent=(16, 16, 16), patches=m, calls=steps,
                warm_calls=1, elem_bytes=4)
            total, analytic = sum(counted.values()), sum(expected.values())
            kinds = ", ".join(f"{k} {v / steps / 1e3:.1f}" for k, v in sorted(counted.items()))
            table.append((variant, f"{plan.describe()}, {m} patches", rank["rank"], stage,
                          f"{total / steps / 1e3:.1f} kB", f"{analytic / steps / 1e3:.1f} kB",
                          f"{total / analytic:.3f}", "yes" if counted == expected else "NO", kinds,
                          f"{price / 1e9:.3f} GB"))
            out.append({"model": variant, "plan": plan.describe(), "patches": m, "rank": rank["rank"],
                        "stage": stage, "measured_bytes": total, "analytic_bytes": analytic,
                        "by_kind": counted, "analytic_by_kind": expected, "every_kind_equal": counted == expected,
                        "priced_bytes_per_step_1024": price})
    print(markdown(("model", "plan", "rank", "stage", "measured/step", "analytic/step", "ratio", "every kind equal",
                    "measured by kind (kB/step)", "priced, real model 1024^2/step"), table))
    return out
