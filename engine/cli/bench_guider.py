"""`bench guider`: the per-call cost of a sampler that drives the engine one model evaluation at a time (ComfyUI's
sampler on the xDiT Engine's MODEL: KSampler, the xDiT Guider, SamplerCustomAdvanced) against the engine's own loop
(xDiT Sampler), for the same job on the same ranks."""
from __future__ import annotations

import statistics
import time


from ..generate.model_call import ModelSession, check_per_call, session_predictor
from ..generate.request import GenerateRequest
from ..models.load import inspect_model
from ..runtime.client import Engine
from ..sampling.ksampler import guided_denoiser, start_sampling
from ..sampling.samplers import sample
from .args import UsageError
from .tables import markdown


def register(bench, emit) -> None:
    from . import args as types
    p = bench.add_parser("guider", help="per-call overhead of ComfyUI's sampler on the engine's MODEL vs the "
                                        "engine's own loop",
                         description="The same euler job run by the engine's own loop (one job, xDiT Sampler's route) "
                                     "and by a sampler in this process that calls the engine once per model evaluation "
                                     "(the route of ComfyUI's samplers on the xDiT Engine's MODEL), alternately; the "
                                     "difference per step is the per-call overhead.")
    p.add_argument("--model", default="synthetic:flux-dev:tiny", help="model path or synthetic:<variant>[:tiny]")
    p.add_argument("--ranks", type=types.positive_int, default=1, help="CPU ranks")
    p.add_argument("--plan", type=types.plan_choice, default="auto", metavar="auto|DEGREES",
                   help="the plan on those ranks, e.g. ulysses2 or cfg2 (default: auto; a model session runs no "
                        "PipeFusion)")
    p.add_argument("--width", type=types.pixels, default=256, help="image width in pixels")
    p.add_argument("--height", type=types.pixels, default=256, help="image height in pixels")
    p.add_argument("--steps", type=types.positive_int, default=8, help="euler steps")
    p.add_argument("--repeats", type=types.positive_int, default=3, help="timed runs of each path (median)")
    p.set_defaults(run=lambda a: emit(a, "guider", bench_guider(a.model, a.ranks, a.width, a.height, a.steps,
                                                                a.repeats, a.plan)), parser=p)


def bench_guider(model: str, ranks: int, width: int, height: int, steps: int, repeats: int = 3,
                 plan="auto") -> list[dict]:
    try:
        info = inspect_model(model)
        request = GenerateRequest.random_conditioning(model, width, height, text_tokens=16, seed=1, steps=steps,
                                                      cfg=info.spec.cfg, plan=plan).validate(ranks)
        check_per_call(request)
    except ValueError as e:   # before any rank starts
        raise UsageError(str(e)) from None
    spec, inputs = request.to_job()
    start = start_sampling(request.latent_raw, sampling=request.sampling(info), latent=info.latent, seed=1,
                           steps=steps, cfg=request.cfg, sampler="euler", scheduler="simple")
    loop_s, guide_s, call_s, diffs = [], [], [], []
    with Engine(ranks) as engine:
        for i in range(repeats + 1):  # the first of each warms up (model load, first forward)
            t0 = time.perf_counter()
            want = engine.submit("generate", spec, inputs).outputs["samples"]
            t1 = time.perf_counter()
            with ModelSession(engine, request) as session:
                predict = session_predictor(session, request, request.sampling(info).timesteps_per_sigma)
                x = sample("euler", guided_denoiser(predict, request.cfg), start.x_model, start.sigmas, seed=1)
            got = start.finish(x)
            t2 = time.perf_counter()
            if i:
                loop_s.append(t1 - t0)
                guide_s.append(t2 - t1)
                call_s.extend(session.call_s)
                diffs.append(float((got - want).abs().max()))
    loop, guide = statistics.median(loop_s), statistics.median(guide_s)
    row = {"model": model, "plan": request.plan.describe(), "latent": f"{width}x{height}", "steps": steps,
           "engine_loop_s": loop, "model_route_s": guide, "overhead_per_call_ms": (guide - loop) / steps * 1000,
           "median_call_ms": statistics.median(call_s) * 1000, "max_abs_diff": max(diffs)}
    print(markdown(("model", "plan", "latent", "steps", "engine loop s", "MODEL route s", "overhead/call ms",
                    "median call ms", "max abs diff"),
                   [(row["model"], row["plan"], row["latent"], steps, f"{loop:.3f}", f"{guide:.3f}",
                     f"{row['overhead_per_call_ms']:.1f}", f"{row['median_call_ms']:.1f}",
                     f"{row['max_abs_diff']:.1e}")]), flush=True)
    return [row]
