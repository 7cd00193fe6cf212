"""`python -m engine demo`: the engine on its embedded default - a 2-rank CPU group, a tiny synthetic FLUX
checkpoint, one job through the shared-memory bridge - and a report of what happened."""
from __future__ import annotations

import tempfile
import time

import torch

from ..runtime.client import Engine
from ..models.tiny import TINY, write_tiny


def flux_job_inputs(width: int, height: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors shaped as a FLUX job carries them: noise in ComfyUI's latent shape, T5 cond, CLIP-L pooled."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "noise": torch.randn(1, 16, height // 8, width // 8, generator=gen),
        "cond": torch.randn(1, 256, 4096, generator=gen).to(torch.bfloat16),
        "pooled": torch.randn(1, 768, generator=gen),
        "guidance": torch.tensor([3.5]),
    }


def run(ranks: int = 2, width: int = 256, height: int = 256, model: str | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="xdit-demo-") as tmp:
        path = model or write_tiny("flux", tmp, variant="flux-dev")
        dims = TINY["flux-dev"]
        print(f"model   {path}")
        print(f"        tiny synthetic FLUX.1-dev, BFL layout: hidden {dims.hidden}, {dims.heads} heads, "
              f"{dims.depth} double + {dims.depth_single} single blocks")
        t0 = time.perf_counter()
        with Engine(ranks, device="cpu") as engine:
            t_start = time.perf_counter() - t0
            print(f"engine  {ranks} CPU ranks (gloo over loopback), pids {engine.pids}, started in {t_start:.2f} s")
            print(f"plan    world {ranks}; the inspect job runs on every rank; the client is not a rank")
            inputs = flux_job_inputs(width, height)
            result = engine.submit("inspect", {"path": path}, inputs)
            checks = {
                "every rank verified the same job (id + crc32)":
                    len({(r["job_id"], r["crc32"]) for r in result.ranks}) == 1
                    and result.ranks[0]["crc32"] == result.crc32,
                "every rank read the same checkpoint":
                    len({str(r["checkpoint"]) for r in result.ranks}) == 1,
                "result returned by rank %d, bit-exact" % (ranks - 1):
                    all(torch.equal(result.outputs[k], v) for k, v in inputs.items()),
            }
            summary = result.ranks[0]["checkpoint"]
            nbytes = sum(t.numel() * t.element_size() for t in inputs.values())
            print(f"job     {result.job_id}: inspect + {len(inputs)} tensors ({nbytes / 2**20:.1f} MiB: noise "
                  f"{list(inputs['noise'].shape)}, cond {list(inputs['cond'].shape)} bf16, pooled, guidance)")
            print(f"        each rank saw {summary['tensors']} tensors, {summary['parameters']:,} parameters, "
                  f"{summary.get('double_blocks')} double / {summary.get('single_blocks')} single blocks")
            print("timings " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in result.timings.items()))
            for name, ok in checks.items():
                print(f"check   {'ok  ' if ok else 'FAIL'} {name}")
        checks.update(_generate(path, width, height))
    return 0 if all(checks.values()) else 1


def _generate(path: str, width: int, height: int) -> dict[str, bool]:
    """The generate path: a 4-step euler FLUX latent on one rank (twice: the second reuses the loaded model),
    then the same job under a 2-rank Ulysses plan, compared with the one-rank latent."""
    from ..generate.request import GenerateRequest
    from ..parallel.plan import ParallelPlan

    gen = torch.Generator().manual_seed(1)
    job = dict(model=path, cond=torch.randn(1, 64, 4096, generator=gen), pooled=torch.randn(1, 768, generator=gen),
               latent_raw=torch.zeros(1, 16, height // 8, width // 8), seed=7, steps=4)
    request = GenerateRequest(**job)
    request.validate(ranks=1)
    with Engine(1, device="cpu") as engine:
        first = engine.submit("generate", *request.to_job())
        second = engine.submit("generate", *request.to_job())
    samples = first.outputs["samples"]
    loaded = first.ranks[0].get("loaded", {})
    print(f"generate 1 CPU rank, {request.family} {width}x{height}, seed {request.seed}, {request.steps} steps "
          f"{request.sampler}/{request.scheduler}, cfg {request.cfg}: LATENT {list(samples.shape)}, "
          f"mean {samples.mean():.4f}, std {samples.std():.4f}")
    print(f"        first job {first.timings['total_s']:.2f} s (model loaded in {loaded.get('load_s', 0):.2f} s), "
          f"second job {second.timings['total_s']:.2f} s (model kept loaded)")
    parallel_request = GenerateRequest(**job, plan=ParallelPlan(ulysses=2))
    parallel_request.validate()
    with Engine(2, device="cpu") as engine:
        parallel = engine.submit("generate", *parallel_request.to_job())
    diff = (parallel.outputs["samples"] - samples).abs().max().item()
    sent = parallel.ranks[0].get("bytes_sent_per_step", {})
    print(f"generate 2 CPU ranks, plan ulysses2 (image tokens split, attention heads exchanged): max abs diff from "
          f"1 rank {diff:.2e}; rank 0 sent per step " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sent.items()))
    checks = {
        "generated latent is finite": bool(torch.isfinite(samples).all()),
        "same seed, same latent (bit-exact)": torch.equal(samples, second.outputs["samples"]),
        "second job reused the loaded model": "loaded" not in second.ranks[0],
        "ulysses2 latent equals the 1-rank latent (max abs diff <= 1e-4)": diff <= 1e-4,
    }
    for name, ok in checks.items():
        print(f"check   {'ok  ' if ok else 'FAIL'} {name}")
    return checks
