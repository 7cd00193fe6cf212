"""`python -m engine demo`: the engine end to end on CPU ranks with a tiny checkpoint, and a report of what happened."""
from __future__ import annotations

import tempfile
import time

import torch

from ..generate.request import GenerateRequest, empty_latent
from ..models.load import inspect_model
from ..models.tiny import write_tiny
from ..parallel.plan import ParallelPlan
from ..runtime.client import Engine
from . import args as types
from . import describe
from .args import UsageError

WIDTH = HEIGHT = 256
STEPS = 4
PARTS = (("an inspect job on {ranks} CPU rank(s): every rank reads the checkpoint's header and "
          "conditioning-shaped tensors cross the shared-memory bridge and come back (3 checks)"),
         (f"a {STEPS}-step {WIDTH}x{HEIGHT} euler generate on 1 CPU rank, run twice: the second reuses the loaded "
          f"model and gives the same latent (3 checks)"),
         "the same generate on 2 CPU ranks under plan ulysses2, compared with the 1-rank latent (1 check)")
DESCRIPTION = ("Check the engine end to end on CPU ranks (gloo over loopback) with a tiny FLUX.1-dev checkpoint "
               "written to a temporary folder, or the model file given by --model: "
               + "; ".join(f"({i}) {p}" for i, p in enumerate(PARTS, 1)).format(ranks="--ranks")
               + ". Ends with one verdict line; exits 0 when all 7 checks pass, 1 otherwise.")


def register(sub) -> None:
    p = sub.add_parser("demo", help="check the engine end to end on CPU ranks with a tiny model (about 20 s)",
                       description=DESCRIPTION)
    p.add_argument("--ranks", type=types.ranks, default=2, help="ranks for the inspect job, 1 to 8")
    p.add_argument("--model", type=types.checkpoint_file,
                   help="a FLUX.1 or SD3/SD3.5 .safetensors file to use instead of the generated tiny FLUX.1-dev "
                        "(it runs on the CPU: practical for small files only)")
    p.set_defaults(run=run, parser=p)


def run(a) -> int:
    with tempfile.TemporaryDirectory(prefix="engine-demo-") as tmp:
        path = a.model or write_tiny("flux", tmp, variant="flux-dev")
        info = inspect_model(path)
        requests = _requests(path, info)  # every check that needs no rank, before any starts
        print(f"demo    {len(PARTS)} parts on CPU ranks (gloo over loopback), 7 checks:")
        for i, part in enumerate(PARTS, 1):
            print(f"        ({i}) {part.format(ranks=a.ranks)}")
        print(f"model   {path}")
        print(f"        {'given file' if a.model else 'tiny synthetic checkpoint'} {describe.summary(info)}")
        print(f"        takes {describe.conditioning(info)}")
        checks = _inspect(path, info, a.ranks)
        checks.update(_generate(info, *requests))
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        print(f"demo: {len(failed)} of {len(checks)} checks FAILED: {'; '.join(failed)}")
        return 1
    print(f"demo: all {len(checks)} checks passed")
    return 0


def _report(checks: dict[str, bool]) -> dict[str, bool]:
    for name, ok in checks.items():
        print(f"check   {'ok  ' if ok else 'FAIL'} {name}")
    return checks


def _inspect(path: str, info, ranks: int) -> dict[str, bool]:
    """Part 1: the inspect job, its inputs shaped as this model's job carries them."""
    gen = torch.Generator().manual_seed(0)
    cond, pooled = describe.cond_tensors(info, info.spec.text_tokens, gen)
    inputs = {"noise": torch.randn(empty_latent(info, WIDTH, HEIGHT).shape, generator=gen),
              "cond": cond.to(torch.bfloat16)}
    if pooled is not None:
        inputs["pooled"] = pooled
    if info.config.get("guidance_embeds"):
        inputs["guidance"] = torch.tensor([3.5])
    t0 = time.perf_counter()
    with Engine(ranks, device="cpu") as engine:
        t_start = time.perf_counter() - t0
        print(f"engine  {ranks} CPU rank(s), pids {engine.pids}, started in {t_start:.2f} s; the client is not a rank")
        result = engine.submit("inspect", {"path": path}, inputs)
    seen = result.ranks[0]["checkpoint"]
    nbytes = sum(t.numel() * t.element_size() for t in inputs.values())
    blocks = ", ".join(f"{n} {name}" for name, n in seen["blocks"].items())
    print(f"job     {result.job_id}: inspect + {len(inputs)} tensors ({nbytes / 2**20:.1f} MiB: "
          + ", ".join(f"{k} {list(t.shape)}" for k, t in inputs.items()) + ")")
    print(f"        each rank saw {seen['tensors']} tensors, {seen['parameters']:,} parameters, {blocks}")
    print("timings " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in result.timings.items()))
    return _report({
        "every rank verified the same job (id + crc32)":
            len({(r["job_id"], r["crc32"]) for r in result.ranks}) == 1 and result.ranks[0]["crc32"] == result.crc32,
        "every rank read the same checkpoint": len({str(r["checkpoint"]) for r in result.ranks}) == 1,
        f"result returned by rank {ranks - 1}, bit-exact":
            all(torch.equal(result.outputs[k], v) for k, v in inputs.items()),
    })


def _requests(path: str, info) -> tuple[GenerateRequest, GenerateRequest]:
    """The 1-rank and the ulysses2 requests of parts 2 and 3, validated (UsageError if this model cannot run them)."""
    gen = torch.Generator().manual_seed(1)
    cond, pooled = describe.cond_tensors(info, 64, gen)
    job = dict(model=path, cond=cond, pooled=pooled, latent_raw=empty_latent(info, WIDTH, HEIGHT), seed=7,
               steps=STEPS)
    try:
        one = GenerateRequest(**job, plan=ParallelPlan()).validate()
        two = GenerateRequest(**job, plan=ParallelPlan(ulysses=2)).validate()
    except ValueError as e:
        raise UsageError(f"argument --model: {path}: {e}") from None
    return one, two


def _generate(info, one: GenerateRequest, two: GenerateRequest) -> dict[str, bool]:
    """Parts 2 and 3: a 1-rank generate twice (the second reuses the loaded model), then under ulysses2."""
    with Engine(1, device="cpu") as engine:
        first = engine.submit("generate", *one.to_job())
        second = engine.submit("generate", *one.to_job())
    samples = first.outputs["samples"]
    loaded = first.ranks[0].get("loaded", {})
    print(f"generate 1 CPU rank, {info.variant} {WIDTH}x{HEIGHT}, seed {one.seed}, {one.steps} steps "
          f"{one.sampler}/{one.scheduler}, cfg {one.cfg}: LATENT {list(samples.shape)}, "
          f"mean {samples.mean():.4f}, std {samples.std():.4f}")
    print(f"        first job {first.timings['total_s']:.2f} s (model loaded in {loaded.get('load_s', 0):.2f} s), "
          f"second job {second.timings['total_s']:.2f} s (model kept loaded)")
    with Engine(2, device="cpu") as engine:
        parallel = engine.submit("generate", *two.to_job())
    diff = (parallel.outputs["samples"] - samples).abs().max().item()
    sent = parallel.ranks[0].get("bytes_sent_per_step", {})
    print(f"generate 2 CPU ranks, plan ulysses2 (image tokens split, attention heads exchanged): max abs diff from "
          f"1 rank {diff:.2e}; rank 0 sent per step " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sent.items()))
    return _report({
        "generated latent is finite": bool(torch.isfinite(samples).all()),
        "same seed, same latent (bit-exact)": torch.equal(samples, second.outputs["samples"]),
        "second job reused the loaded model": "loaded" not in second.ranks[0],
        "ulysses2 latent equals the 1-rank latent (max abs diff <= 1e-4)": diff <= 1e-4,
    })
