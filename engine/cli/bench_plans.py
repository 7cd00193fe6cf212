"""`python -m engine bench scaling | cache`: what the plans and the step cache do, on this machine.

scaling: time per step of every plan that runs on 1..N ranks here (the planner's choice for each rank count marked);
on CPU ranks with tiny models the figures measure the engine's parallel machinery, not a GPU's speed-up.
cache: the step cache at several thresholds against the uncached job: calls skipped, time, and the difference."""
from __future__ import annotations

import os
import statistics

from ..parallel.plan import AUTO, ParallelPlan, candidates
from ..runtime.client import Engine
from . import args as types
from .tables import markdown

CACHE_THRESHOLDS = (0.0, 0.3, 0.56, 0.7, 1.0)


def register(bench, emit) -> None:
    s = bench.add_parser("scaling", help="time per step of every plan that runs here, the planner's choice marked",
                         description=__doc__.split("\n\n")[1].split("\n")[0])
    s.add_argument("--size", type=types.pixels, default=128, help="image width and height in pixels")
    s.add_argument("--steps", type=types.positive_int, default=8, help="euler steps per job")
    s.add_argument("--max-ranks", type=types.ranks, default=min(4, os.cpu_count() or 1),
                   help="largest rank count tried (default: the CPU count, at most 4)")
    s.set_defaults(run=lambda a: emit(a, "scaling", bench_scaling(a.size, a.steps, a.max_ranks)), parser=s)
    c = bench.add_parser("cache", help="the step cache at several thresholds vs the uncached job",
                         description="The step cache on the tiny FLUX model (CPU, 1 rank): calls skipped, time and "
                                     "relative L2 difference from the uncached latent, per threshold.")
    c.add_argument("--steps", type=types.positive_int, default=28, help="euler steps per job")
    c.set_defaults(run=lambda a: emit(a, "cache", bench_cache(a.steps)), parser=c)


def _request(size: int, steps: int, plan, cfg: float = 1.0, threshold: float = 0.0, batch: int = 1):
    from ..generate.request import GenerateRequest
    return GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", size, size, text_tokens=24, batch=batch,
                                               seed=0, steps=steps, cfg=cfg, plan=plan, cache_threshold=threshold)


def bench_scaling(size: int, steps: int, max_ranks: int, repeats: int = 3) -> list[dict]:
    print(f"tiny FLUX (synthetic:flux-dev:tiny), {size}x{size}, {steps} euler steps, cfg 3 (a negative pass, so CFG "
          f"parallel applies), batch 2, fp32, CPU ranks (gloo) on {os.cpu_count()} CPUs; median of {repeats} after a "
          f"warm-up; * = auto's choice for that rank count", flush=True)
    rows, out = [], []
    base = None
    for ranks in range(1, max_ranks + 1):
        chosen = _request(size, steps, AUTO, cfg=3.0, batch=2).validate(ranks)
        plans = [p for p in candidates(ranks) if p.pipefusion == 1]
        with Engine(ranks, device="cpu") as engine:
            for plan in plans:
                try:
                    r = _request(size, steps, plan, cfg=3.0, batch=2).validate(ranks)
                except ValueError:
                    continue  # a plan this job cannot run (heads, tokens, batch): not a row
                spec, inputs = r.to_job()
                engine.submit("generate", spec, inputs)
                times = [engine.submit("generate", spec, inputs).timings["compute_s"] for _ in range(repeats)]
                per_step = statistics.median(times) / steps * 1e3
                base = base or per_step
                mark = "*" if plan == chosen.plan else ""
                rows.append((ranks, plan.describe() + mark, f"{per_step:.1f}", f"{base / per_step:.2f}x"))
                out.append({"ranks": ranks, "plan": plan.describe(), "auto": plan == chosen.plan,
                            "ms_per_step": per_step})
                print(f"  {ranks} rank(s) {plan.describe()}{mark}: {per_step:.1f} ms per step", flush=True)
    print(markdown(("ranks", "plan", "ms / step", "vs 1 rank"), rows))
    return out


def bench_cache(steps: int) -> list[dict]:
    print(f"tiny FLUX (synthetic:flux-dev:tiny), 256x256, {steps} euler steps, fp32, 1 CPU rank; the relative change "
          f"of the first block's residual on this random model runs about 0.5 to 0.9 per step, so the thresholds here "
          f"are high (for trained models diffusers' FirstBlockCacheConfig defaults to 0.05 and shows 0.2)", flush=True)
    rows, out = [], []
    with Engine(1, device="cpu") as engine:
        def job(threshold):
            spec, inputs = _request(256, steps, ParallelPlan(), threshold=threshold or 0.0).validate(1).to_job()
            engine.submit("generate", spec, inputs)  # warm-up
            return engine.submit("generate", spec, inputs)

        plain = job(None)
        ref = plain.outputs["samples"]
        for threshold in (None,) + CACHE_THRESHOLDS:
            result = plain if threshold is None else job(threshold)
            info = result.ranks[0].get("step_cache") or {}
            rel = ((result.outputs["samples"] - ref).norm() / ref.norm()).item()
            rows.append(("off" if threshold is None else threshold,
                         f"{info.get('skipped_calls', 0)}/{info.get('model_calls', steps)}",
                         f"{result.timings['compute_s']:.3f}", f"{plain.timings['compute_s'] / result.timings['compute_s']:.2f}x",
                         f"{rel:.3g}"))
            out.append({"threshold": threshold, "skipped_calls": info.get("skipped_calls", 0),
                        "model_calls": info.get("model_calls", steps), "compute_s": result.timings["compute_s"],
                        "rel_l2_vs_uncached": rel})
    print(markdown(("threshold", "skipped calls", "compute s", "vs off", "rel. L2 vs off"), rows))
    print("threshold 0 computes every call through the cache's code path: its difference from off is exactly 0")
    return out
