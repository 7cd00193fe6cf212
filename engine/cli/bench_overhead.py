"""`bench overhead`: one rank's engine generate job against a plain in-process loop over the same forward, the same
weights and inputs, timed alternately (also the 1-rank baseline `bench project` times its share beside)."""
from __future__ import annotations

import statistics
import time

import torch

from ..generate.inputs import check_frames
from ..generate.request import GenerateRequest
from ..models.flow import Conditioning, FlowModel
from ..models.load import inspect_model, load_model
from ..runtime.client import Engine
from ..sampling.noise import prepare_noise
from ..sampling.schedules import compute_sigmas
from .args import UsageError
from .tables import markdown


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def _plain_loop(flow, noise: torch.Tensor, sigmas: torch.Tensor, positive, negative, cfg: float,
                device: str) -> tuple[torch.Tensor, float]:
    """A plain in-process Euler loop over the family's one forward (FlowModel.velocity, the unmodified diffusers
    transformer): the baseline without any engine around it."""
    sides = [positive] + ([negative] if cfg != 1.0 else [])
    x = (sigmas[0] * noise).to(device)
    prepared = flow.prepare(sides, x.shape[0])
    _sync(device)
    t0 = time.perf_counter()
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        v = flow.velocity(x.repeat(len(sides), *([1] * (x.ndim - 1))), sigma, prepared)
        if cfg != 1.0:
            v_pos, v_neg = v.chunk(2)
            v = v_neg + cfg * (v_pos - v_neg)  # CFG on denoised = x - sigma*v is CFG on v
        x = x + v * (nxt - sigma)
    _sync(device)
    return x.cpu(), time.perf_counter() - t0


def bench_overhead(variant: str, size: str, gpus: list[int] | None, width: int, height: int, steps: int,
                   dtype: str, repeats: int, alongside=None, frames: int = 1) -> list[dict]:
    """One rank: the engine's generate job vs a plain in-process loop over the same forward, same weights and inputs,
    run alternately (engine, loop, engine, loop, ...) so that drift in the machine's speed hits both alike.
    alongside: a third path timed in the same rounds, () -> seconds (`bench project`'s 1-rank share). frames: a
    video's frames (ComfyUI's count) for a family that takes them."""

    device = "cuda" if gpus else "cpu"
    source = f"synthetic:{variant}" + (":tiny" if size == "tiny" else "")
    info = inspect_model(source)
    cfg = info.spec.cfg
    try:
        if frames != 1:
            check_frames(info, frames)
        request = GenerateRequest.random_conditioning(source, width, height, seed=0, steps=steps, cfg=cfg,
                                                      dtype=dtype, frames=frames).validate(ranks=1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec, inputs = request.to_job()
    print(f"{source} {width}x{height}{f' x {frames} frames' if frames > 1 else ''}, {steps} euler steps, cfg {cfg}, {dtype}, device {device}"
          f"{' ' + str(torch.cuda.get_device_name(gpus[0])) if gpus else ''}; a warm-up of each path, then "
          f"{repeats} alternating timed runs of each (median)")
    flow = FlowModel(load_model(source, dtype=dtype, device=device))
    noise = prepare_noise(request.latent_raw, request.seed)
    sigmas = compute_sigmas(request.sampling(info), "simple", steps)
    positive = Conditioning(request.cond, request.pooled, request.guidance)
    negative = Conditioning(request.neg_cond, request.neg_pooled, request.guidance)

    def plain():
        return _plain_loop(flow, noise, sigmas, positive, negative, cfg, device)

    print("measuring: engine (1 rank, model built on the rank) and the plain loop (in this process), alternating ...",
          flush=True)
    with Engine(1, device=device, gpus=gpus) as engine:
        first = engine.submit("generate", spec, inputs)
        plain()  # warm-up
        beside = [alongside()] if alongside else []
        runs, loops = [], []
        for _ in range(repeats):
            runs.append(engine.submit("generate", spec, inputs))
            loops.append(plain())
            beside += [alongside()] if alongside else []
    engine_total = statistics.median(r.timings["total_s"] for r in runs)
    engine_compute = statistics.median(r.timings["compute_s"] for r in runs)
    plain_s = statistics.median(t for _, t in loops)
    diff = (runs[-1].outputs["samples"] - info.latent.process_out(loops[-1][0])).abs().max().item()
    params = first.ranks[0].get("loaded", {}).get("parameters", 0)
    print(markdown(("path", "per image", "per step", "vs plain"), [
        ("engine: generate job, 1 rank", f"{engine_total:.3f} s", f"{engine_total / steps * 1e3:.1f} ms",
         f"{engine_total / plain_s:.3f}x"),
        ("  of which compute on the rank", f"{engine_compute:.3f} s", f"{engine_compute / steps * 1e3:.1f} ms",
         f"{engine_compute / plain_s:.3f}x"),
        ("plain loop over the same forward, in process", f"{plain_s:.3f} s", f"{plain_s / steps * 1e3:.1f} ms",
         "1.000x")]))
    print(f"engine overhead: {(engine_total / plain_s - 1) * 100:+.1f}% ({(engine_total - plain_s) * 1e3:+.1f} ms per "
          f"job); model {params / 1e6:,.1f} M parameters, built on the rank in "
          f"{first.ranks[0].get('loaded', {}).get('load_s', 0):.1f} s; engine breakdown: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in runs[-1].timings.items()))
    print(f"latents: engine vs plain loop max abs diff {diff:.3g}")
    return [{"model": source, "width": width, "height": height, "steps": steps, "dtype": dtype, "device": device,
             "engine_job_s": engine_total, "engine_compute_s": engine_compute, "plain_loop_s": plain_s,
             "ratio": engine_total / plain_s, "max_abs_diff": diff,
             **({"alongside_s": statistics.median(beside[1:])} if alongside else {})}]
