"""`python -m engine generate`: one KSampler run through the engine, from files to a LATENT file."""
from __future__ import annotations

import os
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..runtime.client import Engine
from ..errors import EngineError
from ..generate.request import GenerateRequest
from ..parallel.plan import ParallelPlan


def _read(path: str, what: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise ValueError(f"{what} file {path!r} does not exist")
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _lora_arg(entry: str) -> tuple[str, float]:
    """PATH or PATH:STRENGTH (strength 1.0 when absent)."""
    path, sep, strength = entry.rpartition(":")
    if sep:
        try:
            return path, float(strength)
        except ValueError:
            pass
    return entry, 1.0


def build_request(args) -> GenerateRequest:
    cond = _read(args.cond, "--cond")
    for key in ("cond", "pooled"):
        if key not in cond:
            raise ValueError(f"--cond {args.cond} has no {key!r} tensor (it has {sorted(cond)}); it needs cond and "
                             f"pooled, and neg_cond and neg_pooled for cfg != 1")
    if args.width % 16 or args.height % 16 or args.width <= 0 or args.height <= 0:
        raise ValueError(f"--width {args.width} --height {args.height} is invalid: use positive multiples of 16")
    if args.batch < 1:
        raise ValueError(f"--batch {args.batch} is invalid: use 1 or more")
    if args.latent:
        latent_file = _read(args.latent, "--latent")
        if "samples" not in latent_file:
            raise ValueError(f"--latent {args.latent} has no 'samples' tensor (it has {sorted(latent_file)})")
        latent = latent_file["samples"].float()
        expected = (args.height // 8, args.width // 8)
        if tuple(latent.shape[2:]) != expected:
            raise ValueError(f"--latent is {latent.shape[3] * 8}x{latent.shape[2] * 8} px but --width/--height say "
                             f"{args.width}x{args.height}")
    else:
        if args.denoise < 1:
            raise ValueError(f"--denoise {args.denoise} needs an input --latent to denoise from (img2img)")
        latent = torch.zeros(args.batch, 16, args.height // 8, args.width // 8)
    loras = [_lora_arg(entry) for entry in args.lora]
    degrees = dict(dp=args.dp, cfg=2 if args.cfg_parallel else 1, pipefusion=args.pipefusion, ulysses=args.ulysses,
                   ring=args.ring)
    plan = ParallelPlan(**degrees) if any(v > 1 for v in degrees.values()) else "auto"
    return GenerateRequest(plan=plan, loras=loras, model=args.model, cond=cond["cond"], pooled=cond["pooled"], latent_raw=latent,
                           seed=args.seed, steps=args.steps, cfg=args.cfg, sampler=args.sampler,
                           scheduler=args.scheduler, denoise=args.denoise, neg_cond=cond.get("neg_cond"),
                           neg_pooled=cond.get("neg_pooled"), guidance=args.guidance, dtype=args.dtype)


def run_generate(args, parser) -> int:
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    try:
        request = build_request(args)
        ranks = args.ranks or (request.plan.world_size if request.plan != "auto" else len(gpus or [0]))
        if gpus and len(gpus) != ranks:
            raise ValueError(f"--gpus {args.gpus} names {len(gpus)} GPUs for {ranks} ranks: give one GPU per rank")
        choice = request.validate(ranks)
    except ValueError as e:
        parser.error(str(e))
    spec, inputs = request.to_job()
    t0 = time.perf_counter()
    with Engine(ranks, device="cuda" if gpus else "cpu", gpus=gpus) as engine:
        t_start = time.perf_counter() - t0

        def progress(step: int, total: int) -> None:
            print(f"\rstep {step}/{total}", end="", flush=True)
        try:
            result = engine.submit("generate", spec, inputs, on_progress=progress)
        except EngineError as e:
            print()
            print(f"error: {e}")
            return 1
    print()
    samples = result.outputs["samples"]
    save_file({"samples": samples.contiguous()}, args.out)
    model = result.ranks[0].get("model", {})
    print(f"wrote {args.out}: samples {list(samples.shape)} {samples.dtype} ({model.get('variant')}, "
          f"{model.get('layout')} layout, {args.dtype})")
    print(f"plan {choice.reason}")
    print(f"plan {request.plan.describe()} on {ranks} rank(s); engine start {t_start:.2f} s; "
          + ", ".join(f"{k} {v:.3f} s" for k, v in result.timings.items()))
    sent = result.ranks[0].get("bytes_sent_per_step")
    if sent:
        print("rank 0 sent per step: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sent.items()))
    return 0
