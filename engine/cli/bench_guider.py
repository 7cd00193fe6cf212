"""`bench guider`: what a sampler that drives the engine one step's model calls at a time (ComfyUI's samplers on the
xDiT Engine's MODEL: KSampler, CFGGuider, the xDiT Guider) pays per round trip beside the model, against the engine's
own loop (xDiT Sampler) for the same job on the same ranks, at any size: per round trip the bytes moved each way,
the time the caller waits, the model's time on rank 0 (`model_s`) and the rest (the bridge's)."""
from __future__ import annotations

import statistics
import time
import types

import torch

from ..generate.inputs import check_frames
from ..generate.model_call import ModelSession, check_per_call, request_conditioning
from ..generate.request import GenerateRequest
from ..models.flow import FORWARD_STUB_ENV, Conditioning
from ..models.load import inspect_model
from ..runtime.client import Engine
from ..sampling.ksampler import guided_denoiser, start_sampling
from ..sampling.samplers import sample
from .args import UsageError
from .tables import markdown

MIB = 2 ** 20


def register(bench, emit) -> None:
    from . import args as types_
    p = bench.add_parser("guider", help="per-call cost of ComfyUI's samplers on the engine's MODEL vs the engine's "
                                        "own loop, at any size",
                         description="The same euler job run by the engine's own loop (one job, xDiT Sampler's route) "
                                     "and by a sampler in this process that sends each step's model calls to the "
                                     "engine in one round trip (the route of ComfyUI's samplers on the xDiT Engine's "
                                     "MODEL; with a negative, one call per pass, as ComfyUI runs passes whose text "
                                     "lengths differ), alternately. Per round trip: the bytes each way, the caller's "
                                     "wait, rank 0's model time and the difference (what the route adds).")
    p.add_argument("--model", default="synthetic:flux-dev:tiny", help="model path or synthetic:<variant>[:tiny]")
    p.add_argument("--ranks", type=types_.positive_int, default=1, help="CPU ranks (without --gpus)")
    p.add_argument("--gpus", type=types_.gpu_list, default=None, help="CUDA GPU indices, one rank each, bf16 (default: "
                                                                      "CPU ranks, fp32)")
    p.add_argument("--plan", type=types_.plan_choice, default="auto", metavar="auto|DEGREES",
                   help="the plan on those ranks, e.g. ulysses2 or cfg2 (default: auto; a model session runs no "
                        "PipeFusion)")
    p.add_argument("--width", type=types_.pixels, default=256, help="image width in pixels")
    p.add_argument("--height", type=types_.pixels, default=256, help="image height in pixels")
    p.add_argument("--frames", type=types_.positive_int, default=1,
                   help="video frames, as ComfyUI counts them (4k + 1; a video family only)")
    p.add_argument("--cfg", type=float, default=None, help="guidance (default: the family's usual; 1 runs no negative)")
    p.add_argument("--steps", type=_steps, default=8,
                   help="euler steps, at least 2 (the first round trip, which carries the conditioning, is not timed)")
    p.add_argument("--repeats", type=types_.positive_int, default=3, help="timed runs of each path (median)")
    p.add_argument("--stub-forward", action="store_true",
                   help="the ranks' forward returns zeros of its output's shape (what surrounds the model, timed at "
                        "real token counts where a tiny model's CPU attention would take minutes a call)")
    p.set_defaults(run=lambda a: emit(a, "guider", bench_guider(
        a.model, len(a.gpus) if a.gpus else a.ranks, a.width, a.height, a.steps, a.repeats, a.plan, frames=a.frames,
        cfg=a.cfg, stub_forward=a.stub_forward, gpus=a.gpus)), parser=p)


def _steps(text: str) -> int:
    from argparse import ArgumentTypeError

    from . import args as types_
    value = types_.integer(text)
    if value < 2:
        raise ArgumentTypeError(f"{text} is invalid: use 2 or more steps (a run's first round trip carries the "
                                f"conditioning and is not timed)")
    return value


def _image_inputs(info, request: GenerateRequest) -> dict:
    """An image-to-video model's image conditioning for the bench (a random image latent, its first frame known, and
    CLIP-vision tokens where the model takes them), as WanImageToVideo would put it on both sides."""
    config = info.config
    if config.get("in_channels", 0) == config.get("out_channels", 0):
        return {}
    g = torch.Generator().manual_seed(7)
    image = torch.randn(request.latent_raw.shape, generator=g)
    mask = torch.ones(1, 1, *request.latent_raw.shape[2:])
    mask[:, :, 0] = 0.0
    clip = torch.randn(1, 257, config["image_dim"], generator=g) if config.get("image_dim") else None
    return dict(concat_latent_image=image, concat_mask=mask, clip_vision_output=clip, neg_concat_latent_image=image,
                neg_concat_mask=mask, neg_clip_vision_output=clip)


def _concat(info, request: GenerateRequest):
    """What ComfyUI's model attaches to the input each call for this request's image (its c_concat), or None."""
    family = info.spec
    if family.concat_cond is None or request.concat_latent_image is None:
        return None
    flow = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(**info.config)),
                                 device=torch.device("cpu"), loaded=types.SimpleNamespace(info=info))
    side = Conditioning(request.cond, concat_latent=request.concat_latent_image, concat_mask=request.concat_mask)
    return family.concat_cond(flow, side, None)


def _route_predictor(session: ModelSession, request: GenerateRequest, timesteps_per_sigma: float, concat, clip):
    """A Predict over a model session: each pass one call (ComfyUI's calls for passes it does not batch), a step's
    passes in one round trip (the MODEL's calc_cond_batch wrapper)."""
    def predict(x_model: torch.Tensor, sigma: torch.Tensor, which: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        rows = x_model.shape[0]
        t = (torch.as_tensor(sigma, dtype=torch.float32).reshape(-1)[:1] * timesteps_per_sigma).expand(rows)
        x = x_model if concat is None else torch.cat([x_model, concat.expand(rows, *concat.shape[1:])], dim=1)
        calls = []
        for w in which:
            conditioning = request_conditioning(request, (w,), rows)
            if clip is not None:
                conditioning["clip_fea"] = clip.expand(rows, *clip.shape[1:])
            calls.append((x, t, conditioning))
        return tuple(session.call_group(calls))
    return predict


def bench_guider(model: str, ranks: int, width: int, height: int, steps: int, repeats: int = 3, plan="auto", *,
                 frames: int = 1, cfg: float | None = None, stub_forward: bool = False, gpus=None) -> list[dict]:
    try:
        info = inspect_model(model)
        check_frames(info, frames)
        cfg = info.spec.cfg if cfg is None else float(cfg)
        request = GenerateRequest.random_conditioning(model, width, height, text_tokens=16, seed=1, steps=steps,
                                                      cfg=cfg, plan=plan, frames=frames,
                                                      **({"dtype": "bf16"} if gpus else {}))
        request = GenerateRequest(**{**{f: getattr(request, f) for f in request.__dataclass_fields__},
                                     **_image_inputs(info, request)}).validate(ranks)
        check_per_call(request)
    except ValueError as e:   # before any rank starts
        raise UsageError(str(e)) from None
    spec, inputs = request.to_job()
    start = start_sampling(request.latent_raw.float(), sampling=request.sampling(info), latent=info.latent, seed=1,
                           steps=steps, cfg=request.cfg, sampler="euler", scheduler="simple")
    concat, clip = _concat(info, request), request.clip_vision_output
    loop_s, route_s, diffs = [], [], []
    trips, models, sent, received = [], [], [], []
    env = {FORWARD_STUB_ENV: "zeros"} if stub_forward else {}
    with (Engine(ranks, device="cuda", gpus=gpus, env=env) if gpus else Engine(ranks, env=env)) as engine:
        for i in range(repeats + 1):  # the first of each warms up (model load, first forward)
            t0 = time.perf_counter()
            want = engine.submit("generate", spec, inputs).outputs["samples"]
            t1 = time.perf_counter()
            with ModelSession(engine, request) as session:
                predict = _route_predictor(session, request, request.sampling(info).timesteps_per_sigma, concat, clip)
                x = sample("euler", guided_denoiser(predict, request.cfg), start.x_model, start.sigmas, seed=1)
            got = start.finish(x)
            t2 = time.perf_counter()
            if i:
                loop_s.append(t1 - t0)
                route_s.append(t2 - t1)
                trips.extend(session.call_s[1:])
                models.extend(session.model_s[1:])
                sent.extend(b for b, _ in session.trip_bytes[1:])   # after the first: the conditioning is held
                received.extend(b for _, b in session.trip_bytes[1:])
                diffs.append(float((got - want).abs().max()))
    loop, route = statistics.median(loop_s), statistics.median(route_s)
    trip, model_ms = statistics.median(trips) * 1e3, statistics.median(models) * 1e3
    added = statistics.median(t - m for t, m in zip(trips, models)) * 1e3
    fmt = info.latent
    latent = f"{width}x{height}" + (f"x{frames}" if info.spec.frames else "")
    tokens = request.workload(info).image_tokens
    row = {"model": model, "device": torch.cuda.get_device_name(gpus[0]) if gpus else "CPU",
           "plan": request.plan.describe(), "latent": latent, "image_tokens": tokens,
           "passes_per_trip": 2 if request.negative_pass else 1, "steps": steps, "forward": "stub" if stub_forward
           else "model", "sent_mib_per_trip": statistics.median(sent) / MIB,
           "received_mib_per_trip": statistics.median(received) / MIB, "trip_ms": trip, "model_ms": model_ms,
           "added_ms_per_trip": added, "engine_loop_ms_per_step": loop / steps * 1e3,
           "model_route_ms_per_step": route / steps * 1e3, "max_abs_diff": max(diffs),
           "latent_shape": list(request.latent_raw.shape), "latent_format": fmt.name}
    print(markdown(("model", "plan", "latent", "tokens", "forward", "passes/trip", "in MiB/trip", "out MiB/trip",
                    "trip ms", "model ms", "added ms/trip", "own loop ms/step", "route ms/step", "max abs diff"),
                   [(row["model"], row["plan"], latent, tokens, row["forward"], row["passes_per_trip"],
                     f"{row['sent_mib_per_trip']:.2f}", f"{row['received_mib_per_trip']:.2f}", f"{trip:.1f}",
                     f"{model_ms:.1f}", f"{added:.1f}", f"{row['engine_loop_ms_per_step']:.1f}",
                     f"{row['model_route_ms_per_step']:.1f}", f"{row['max_abs_diff']:.1e}")]), flush=True)
    return [row]
