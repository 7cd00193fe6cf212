"""`python -m engine bench gpu`: full-size transformers (FLUX.1-dev and SD3-medium; Qwen-Image, FLUX.2 [dev] and
[klein] when asked) with random weights on one CUDA rank, through the engine (client -> bridge -> rank -> bridge), per
attention kernel, eager vs compiled, with and without the step cache, fp8 weights and fp8 products, beside the
planner's estimate for the same job on the same GPU. Each figure is a whole generate job after its warm-up job: the
noise, every sampler step (transformer forward(s) and the Euler update), progress and cancel checks, and the latent
returned to the client; not the model build, text encoders or VAE."""
from __future__ import annotations

import statistics

import torch

from ..runtime.client import Engine
from . import args as types
from .args import UsageError
from .tables import markdown

PROBE_THRESHOLD = 1e-9   # a step cache that records every call's change and skips none (changes run ~0.1 to 1)
MODELS = {  # name: (synthetic source, steps, cfg, text tokens)
    "flux-dev": ("synthetic:flux-dev", 28, 1.0, 512),
    "sd3-medium": ("synthetic:sd3-medium", 20, 4.5, 333),
    "qwen-image": ("synthetic:qwen-image", 20, 2.5, 256),   # the stock template: 20 steps, cfg 2.5
    # ComfyUI's FLUX.2 templates: [dev] 20 steps at cfg 1 (FluxGuidance), distilled [klein] 4 steps at cfg 1; the
    # text is padded to 512 tokens either way
    "flux2-dev": ("synthetic:flux2-dev", 20, 1.0, 512),
    "flux2-klein-4b": ("synthetic:flux2-klein-4b", 4, 1.0, 512),
    "flux2-klein-9b": ("synthetic:flux2-klein-9b", 4, 1.0, 512),
}
# qwen-image (41 GiB of bf16 weights) and FLUX.2 (dev: 60 GiB; use the fp8 rows where bf16 does not fit) when asked
DEFAULT_MODELS = "flux-dev,sd3-medium"
ROWS = {  # name: request options (cache: the step cache at --cache-threshold)
    "eager": {},
    "eager-flash": {"attention": "flash"},
    "eager-efficient": {"attention": "efficient"},
    "eager-cudnn": {"attention": "cudnn"},
    "eager-cache": {"cache": True},
    "compiled": {"compile": True},
    "compiled-cache": {"compile": True, "cache": True},
    "fp8-weights": {"fp8_weights": True},
    "fp8-matmul": {"fp8_weights": True, "fp8_matmul": True},
    "fp8-matmul-compiled": {"fp8_weights": True, "fp8_matmul": True, "compile": True},
}


def register(bench, emit) -> None:
    g = bench.add_parser("gpu", help="full-size transformers on one GPU: kernels, compile, cache, fp8, the planner's "
                                     "estimate beside",
                         description=__doc__.split(": ", 1)[1].replace("\n", " "))
    g.add_argument("--gpus", type=types.gpu_list, default=None, help="the CUDA GPU index to run on (default: 0)")
    g.add_argument("--models", type=types.name_list(list(MODELS)), default=DEFAULT_MODELS,
                   help="comma-separated: " + ", ".join(MODELS))
    g.add_argument("--rows", type=types.name_list(list(ROWS)), default=",".join(ROWS),
                   help="comma-separated configurations: " + ", ".join(ROWS))
    g.add_argument("--size", type=types.pixels, default=1024, help="image width and height in pixels")
    g.add_argument("--repeats", type=types.positive_int, default=2, help="timed jobs per row after the warm-up job")
    g.add_argument("--cache-threshold", type=types.request_field("cache_threshold", types.finite_float),
                   help="the step cache's threshold (default: the median change this random model shows, so that "
                        "about half the calls skip; random weights change differently from trained ones)")
    g.set_defaults(run=lambda a: emit(a, "gpu", _run(a)), parser=g)


def _run(a) -> list[dict]:
    if not torch.cuda.is_available():
        raise UsageError("bench gpu needs a CUDA GPU and this torch sees none: run bench generate for CPU figures")
    gpus = a.gpus or [0]
    if len(gpus) != 1:
        raise UsageError(f"argument --gpus: bench gpu runs one rank, give one index (got {len(gpus)})")
    return bench_gpu(gpus, a.models, a.rows, a.size, a.repeats, a.cache_threshold)


def _request(model: str, size: int, options: dict):
    from ..generate.request import GenerateRequest

    source, steps, cfg, tokens = MODELS[model]
    request = GenerateRequest.random_conditioning(source, size, size, text_tokens=tokens, seed=0, steps=steps, cfg=cfg,
                                                  dtype="bf16", **options)
    return request.validate(ranks=1)


def _planned_s(request, gpus) -> float:
    """The cost model's seconds per image for this job on one rank of the GPU it runs on (as detected)."""
    from ..models.load import inspect_model
    from ..parallel import cost
    from ..parallel.devices import detect_hardware
    from ..parallel.plan import ParallelPlan

    return cost.estimate(ParallelPlan(), request.workload(inspect_model(request.model)),
                         detect_hardware(tuple(gpus))).s_per_image


def _options(row: str, threshold: float | None) -> dict:
    options = dict(ROWS[row])
    if options.pop("cache", False):
        options["cache_threshold"] = threshold
    return options


def bench_gpu(gpus, models, rows, size, repeats, threshold) -> list[dict]:
    name = torch.cuda.get_device_name(gpus[0])
    print(f"one rank on {name} (cuda:{gpus[0]}), torch {torch.__version__}, bf16, {size}x{size}, euler, batch 1; "
          f"per row 1 warm-up job (compiles, when compiled) + {repeats} timed jobs, median", flush=True)
    results = []
    with Engine(1, device="cuda", gpus=gpus) as engine:
        for model in models:
            source, steps, cfg, _ = MODELS[model]
            print(f"\n{model} ({source}), {steps} steps, cfg {cfg}", flush=True)
            # the agreed first-block change of each call, from one job whose threshold no change falls below
            probe = engine.submit("generate", *_request(model, size, {"cache_threshold": PROBE_THRESHOLD}).to_job())
            changes = [c for c in probe.ranks[0]["step_cache"]["changes"] if c is not None]
            model_threshold = threshold if threshold is not None else round(statistics.median(changes), 4)
            print(f"first-block change per call: min {min(changes):.3f}, median {statistics.median(changes):.3f}, "
                  f"max {max(changes):.3f}; step cache threshold {model_threshold}", flush=True)
            reference = None
            for row in rows:
                options = _options(row, model_threshold)
                print(f"measuring {model} {row} ...", flush=True)
                try:
                    request = _request(model, size, options)
                    spec, inputs = request.to_job()
                    warm = engine.submit("generate", spec, inputs)
                    runs = [engine.submit("generate", spec, inputs) for _ in range(repeats)]
                except Exception as e:  # a kernel this GPU or torch lacks: report the row, keep measuring
                    print(f"  {row}: failed: {str(e).splitlines()[0][:300]}", flush=True)
                    results.append({"model": model, "row": row, "error": str(e).splitlines()[0][:300]})
                    continue
                samples = runs[-1].outputs["samples"]
                if reference is None and row == "eager":
                    reference = samples
                total = statistics.median(r.timings["total_s"] for r in runs)
                compute = statistics.median(r.timings["compute_s"] for r in runs)
                rank = runs[-1].ranks[0]
                cache = rank.get("step_cache") or {}
                result = {"model": model, "row": row, "gpu": name, "size": size, "steps": steps, "cfg": cfg,
                          "options": options, "job_s": total, "planned_s": _planned_s(request, gpus),
                          "compute_s": compute, "ms_per_step": total / steps * 1e3,
                          "warmup_job_s": warm.timings["total_s"], "peak_gib": rank["memory"].get("peak_gib"),
                          "skipped_calls": cache.get("skipped_calls"), "model_calls": cache.get("model_calls"),
                          "rel_l2_vs_eager": (((samples - reference).norm() / reference.norm()).item()
                                              if reference is not None else None),
                          "graphs_reused": (warm.ranks[0].get("compiled_graphs") == rank.get("compiled_graphs")
                                            if options.get("compile") else None)}
                results.append(result)
                print(f"  {row}: {total:.3f} s per image (planner: {result['planned_s']:.3f}), "
                      f"{result['ms_per_step']:.1f} ms per step, peak {_gib(result['peak_gib'])} GiB, warm-up job "
                      f"{result['warmup_job_s']:.1f} s", flush=True)
    _table(results)
    return results


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(results: list[dict]) -> None:
    header = ("model", "configuration", "s / image", "planner s / image", "ms / step", "vs eager", "peak GiB",
              "skipped", "rel. L2 vs eager", "warm-up job")
    rows = []
    eager = {r["model"]: r["job_s"] for r in results if r["row"] == "eager" and "error" not in r}
    for r in results:
        if "error" in r:
            rows.append((r["model"], r["row"], "failed", "", "", "", "", "", r["error"][:60], ""))
            continue
        base = eager.get(r["model"])
        skipped = f"{r['skipped_calls']}/{r['model_calls']}" if r["model_calls"] else "-"
        rel = f"{r['rel_l2_vs_eager']:.3g}" if r["rel_l2_vs_eager"] is not None else "-"
        rows.append((r["model"], r["row"], f"{r['job_s']:.3f}", f"{r['planned_s']:.3f}", f"{r['ms_per_step']:.1f}",
                     f"{base / r['job_s']:.2f}x" if base else "-", _gib(r["peak_gib"]), skipped, rel,
                     f"{r['warmup_job_s']:.1f} s"))
    print("\n" + markdown(header, rows))
    print("\nEach figure: a whole generate job (noise, every sampler step, the latent back through the bridge), "
          "median after a warm-up job; not the model build, text encoders or VAE. Random weights: the step cache's "
          "skip rate and the differences say nothing about image quality on trained weights. The planner's figure: "
          "its cost model for the same job on one GPU of this kind (python -m engine plan), not a measurement.")
