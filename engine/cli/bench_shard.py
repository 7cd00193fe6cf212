"""`bench shard`: weights divided among ranks (the plan's `shard`), on CPU ranks with tiny widths and the model's real
block counts: what each rank reads and holds, and each machine's peak host memory, against whole weights on every
rank; and the host time FSDP2 adds per unit (block or root) and forward, against the cost model's SHARD_UNIT_US."""
from __future__ import annotations

import tempfile
import time
from datetime import timedelta

import torch

from ..generate.request import GenerateRequest
from ..models.load import inspect_model
from ..models.tiny import write_tiny
from ..parallel import cost
from ..parallel.plan import ParallelPlan
from ..runtime.client import Engine
from . import args as types
from .args import UsageError
from .tables import markdown

MiB = 2 ** 20
VARIANTS = {"wan2.1-14b": "wan", "flux-dev": "flux", "qwen-image": "qwen-image", "flux2-dev": "flux2"}


def register(bench, emit) -> None:
    m = bench.add_parser("shard", help="weights divided among ranks: bytes read and held, host-memory peak per machine",
                         description="One job per shard degree on CPU ranks over a checkpoint with tiny widths and the "
                                     "model's real block counts: what each rank reads from the file and holds, its "
                                     "peak resident memory above its memory before the load, and the machine's (all "
                                     "ranks'); then FSDP2's host time per unit and forward.")
    m.add_argument("--model", type=types.model_name(list(VARIANTS)), default="wan2.1-14b", metavar="NAME",
                   help=f"the variant whose block counts are used, by any of its names: {', '.join(VARIANTS)} "
                        f"(default wan2.1-14b: 40 blocks)")
    m.add_argument("--degrees", type=types.int_list, default="1,2,4", help="rank counts, e.g. 1,2,4: each with whole "
                                                                         "weights and with them divided")
    m.set_defaults(run=lambda a: emit(a, "shard", bench_shard(a.model, a.degrees)), parser=m)


def bench_shard(variant: str, degrees: list[int]) -> list[dict]:
    print("each rank's peak resident memory above its memory before the load: the weights it holds and the rest (the "
          "root's weights and two blocks whole while a forward runs, activations, the parallel code's own modules)",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = write_tiny(VARIANTS[variant], d, variant=variant, real_depth=True)
        info = inspect_model(path)
        blocks = sum(info.config.get(k, 0) for k in ("num_layers", "num_single_layers"))
        print(f"{variant}, tiny widths and its {blocks} blocks: {path.rsplit('/', 1)[-1]}; one job per plan on its "
              f"CPU ranks (ulysses N with whole weights on every rank, and with them divided: ulysses N x shard N), "
              f"fp32, 2 steps", flush=True)
        runs = [ParallelPlan()] + [p for n in degrees if n > 1
                                   for p in (ParallelPlan(ulysses=n), ParallelPlan(ulysses=n, shard=n))]
        requests = []
        for plan in runs:   # every job checked before any rank starts
            try:
                requests.append(GenerateRequest.random_conditioning(
                    path, 256, 256, text_tokens=32, steps=2, plan=plan,
                    frames=5 if info.spec.frames else 1).validate(plan.world_size))
            except ValueError as e:
                raise UsageError(f"argument --degrees: {plan.world_size}: {e}") from None
        for r in requests:
            plan, n = r.plan, r.plan.world_size
            with Engine(n, device="cpu") as engine:
                result = engine.submit("generate", *r.to_job())
            ranks = result.ranks
            loaded = [rk["loaded"] for rk in ranks]
            peaks = [(rk["memory"]["peak_rss_gib"] - rk["rss_before_load_gib"]) * 1024 for rk in ranks]
            rows.append({"plan": plan.describe(), "ranks": n,
                         "read MiB per rank": round(max(x["bytes_read"] for x in loaded) / MiB, 1),
                         "held MiB per rank": round(max(x["held_bytes"] for x in loaded) / MiB, 1),
                         "peak above baseline MiB per rank": round(max(peaks), 1),
                         "rest of the peak MiB per rank": round(max(peaks) - max(x["held_bytes"] for x in loaded) / MiB,
                                                                1),
                         "machine peak above baseline MiB": round(sum(peaks), 1)})
        for row in rows:
            row["held / whole"] = round(row["held MiB per rank"] / rows[0]["held MiB per rank"], 3)
        header = tuple(rows[0]) if rows else ()
        print(markdown(header, [tuple(row.get(k, "") for k in header) for row in rows]), flush=True)
    unit = unit_host_us(blocks)
    print(f"\nFSDP2's host time per unit and forward (a 1-rank group, {blocks} units of 3 small Linears, this host): "
          f"{unit:.0f} us; the cost model's SHARD_UNIT_US: {cost.SHARD_UNIT_US:g} us", flush=True)
    rows.append({"unit_host_us": round(unit, 1), "model_unit_us": cost.SHARD_UNIT_US})
    return rows


def unit_host_us(units: int, repeats: int = 200) -> float:
    """Microseconds FSDP2 adds per unit to a forward on this host: a stack of `units` small blocks, each its own unit
    on a 1-rank gloo group (the hooks, the gather's copy-in and copy-out; nothing crosses a link), against the same
    stack whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        def stack():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
                                         for _ in range(units)]).requires_grad_(False)
        whole, divided = stack(), stack()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for block in divided:
            fully_shard(block, mesh=mesh)
        fully_shard(divided, mesh=mesh)
        for block, following in zip(list(divided), list(divided)[1:]):
            block.set_modules_to_forward_prefetch([following])
        x = torch.randn(4, 32)

        def per_forward(m) -> float:
            with torch.no_grad():
                for _ in range(10):
                    m(x)
                t0 = time.perf_counter()
                for _ in range(repeats):
                    m(x)
            return (time.perf_counter() - t0) / repeats
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return (per_forward(divided) - per_forward(whole)) / (units + 1) * 1e6
        finally:
            torch.set_num_threads(threads)
    finally:
        if started:
            dist.destroy_process_group()
