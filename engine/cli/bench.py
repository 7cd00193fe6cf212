"""`python -m engine bench [--quick] [--json PATH] [overhead | bridge | comm | scaling | cache | gpu | soak ...]`:
benchmarks that print markdown tables, saying what they measure as they go. Without a name, every benchmark runs (gpu where
CUDA is present), with --quick at sizes that take a few minutes on a CPU.

overhead: the 1-rank engine's generate job vs the same Euler loop in process, alternating; bridge: tensor round trips
through our shared-memory bridge vs the xDiT-style path (pickle -> torch.ByteTensor(list(bytes)) -> dist.send over
gloo); comm: bytes one rank sends per step, per plan, measured vs analytic; scaling and cache: engine/cli/bench_plans.py;
gpu: engine/cli/bench_gpu.py; soak (jobs with interrupts, resources before and after): engine/cli/bench_soak.py; project
(every plan projected from one rank's share on one device): engine/cli/bench_project.py."""
from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..families import VARIANTS
from ..generate.request import default_dtype
from ..parallel.comm import MODELS, PLANS, analytic_bytes
from ..runtime.client import Engine
from ..runtime.launch import PACK_ROOT
from . import args as types
from .tables import markdown
from . import (bench_av, bench_faults, bench_gpu, bench_guider, bench_memory, bench_plans, bench_project, bench_shard,
               bench_soak, bench_vae, output)
from .bench_overhead import bench_overhead
from .args import UsageError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print tables",
                       description="Benchmarks that print markdown tables. Without a name every benchmark runs.")
    p.add_argument("--quick", action="store_true", help="the whole suite at sizes for a CPU run of a few minutes")
    p.add_argument("--json", type=types.output_file(".json", "the rows"),
                   help="also write every row as JSON to this file")
    p.set_defaults(run=_run_suite, parser=p)
    bench = p.add_subparsers(dest="what",
                             metavar="{overhead,bridge,comm,scaling,cache,memory,shard,project,gpu,guider,av,faults,soak,vae}")

    b = bench.add_parser("bridge", help="tensor round trips: our bridge vs the xDiT-style pickle path",
                         description="Round trips of float32 tensors: client -> shared memory -> ranks -> client "
                                     "through the engine, vs xDiT's pickle -> ByteTensor -> gloo send between two "
                                     "processes.")
    b.add_argument("--sizes-mb", type=types.int_list, default="1,16,64", help="tensor sizes in MB, comma-separated")
    b.add_argument("--repeats", type=types.positive_int, default=5, help="timed round trips per size (median)")
    b.add_argument("--xdit-repeats", type=types.positive_int, default=2,
                   help="xDiT-style round trips per size (it takes seconds per 64 MB)")
    b.set_defaults(run=lambda a: _emit(a, "bridge", bench_bridge(a.sizes_mb, a.repeats, a.xdit_repeats)), parser=b)

    g = bench.add_parser("overhead", aliases=["generate"],
                         help="one-rank generate job vs the same loop in process (alternating)",
                         description="One rank's generate job against a plain in-process diffusers Euler loop with "
                                     "the same random weights and inputs, run alternately after a warm-up of each.")
    g.add_argument("--model", default="flux-dev", type=types.model_name(), metavar="NAME",
                   help=f"synthetic variant (random weights), by any of its names: {', '.join(VARIANTS)}")
    g.add_argument("--size", default="tiny", choices=["tiny", "full"], help="tiny test dims or the real model's")
    g.add_argument("--gpus", type=types.gpu_list, help="one CUDA GPU index to run on (default: the CPU)")
    g.add_argument("--width", type=types.pixels, default=256, help="image width in pixels")
    g.add_argument("--height", type=types.pixels, default=256, help="image height in pixels")
    g.add_argument("--steps", type=types.request_field("steps", types.integer), default=28, help="euler steps")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype (default: bf16 with --gpus, fp32 on the CPU)")
    g.add_argument("--repeats", type=types.positive_int, default=3, help="timed runs of each path (median)")
    g.add_argument("--frames", type=types.positive_int, default=1,
                   help="video frames as ComfyUI counts them (4k + 1) for a video model such as wan2.1-1.3b")
    g.set_defaults(run=_run_overhead, parser=g)

    c = bench.add_parser("comm", help="bytes sent per rank per step, per plan, measured vs analytic",
                         description="Bytes one rank sends per denoising step under each plan, counted by the "
                                     "engine's collectives at full model size on CPU ranks, vs the closed form. "
                                     "About 90 s per model.")
    c.add_argument("--models", type=types.name_list(list(MODELS)), default=",".join(MODELS),
                   help="comma-separated model names")
    c.set_defaults(run=lambda a: _emit(a, "comm", bench_comm(a.models)), parser=c)
    bench_plans.register(bench, _emit)
    bench_memory.register(bench, _emit)
    bench_shard.register(bench, _emit)
    bench_project.register(bench, _emit)
    bench_gpu.register(bench, _emit)
    bench_guider.register(bench, _emit)
    bench_av.register(bench, _emit)
    bench_faults.register(bench, _emit)
    bench_soak.register(bench, _emit)
    bench_vae.register(bench, _emit)


def _emit(a, name: str, rows: list[dict]) -> int:
    """A benchmark's rows: printed already; written as JSON when asked."""
    if getattr(a, "json", None):
        output.write(a.json, json.dumps({name: rows}, indent=1).encode())
    return 0


def _run_suite(a) -> int:
    """Every benchmark in turn (gpu when CUDA is present); --quick: sizes for a few minutes on a CPU."""
    q = a.quick
    results = {}
    print(f"# benchmark suite{' (--quick)' if q else ''}: torch {torch.__version__}, {os.cpu_count()} CPUs"
          f"{', CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else ', no CUDA'}\n", flush=True)
    steps = 4 if q else 28
    print("## overhead", flush=True)
    results["overhead"] = bench_overhead("flux-dev", "tiny", None, 256, 256, steps, "fp32", 3 if q else 5)
    print("\n## overhead, video", flush=True)
    results["overhead_video"] = bench_overhead("wan2.1-1.3b", "tiny", None, 128, 128, steps, "fp32", 3 if q else 5,
                                               frames=9 if q else 33)
    print("\n## bridge", flush=True)
    results["bridge"] = bench_bridge([1, 16] if q else [1, 16, 64], 3 if q else 5, 1 if q else 2)
    print("\n## comm", flush=True)
    results["comm"] = bench_comm(["FLUX.1-dev"] if q else list(MODELS), quick=q)
    print("\n## scaling", flush=True)
    results["scaling"] = bench_plans.bench_scaling(64 if q else 128, 4 if q else 8, 2 if q else 3)
    print("\n## cache", flush=True)
    results["cache"] = bench_plans.bench_cache(12 if q else 28)
    print("\n## memory", flush=True)
    results["memory"] = bench_memory.bench_memory(["flux-dev"] if q else ["flux-dev", "sd3-medium"],
                                                  [1, 2] if q else [1, 2, 4], splits=("compute", "weights"))
    print("\n## shard", flush=True)
    results["shard"] = bench_shard.bench_shard("wan2.1-14b", [1, 2] if q else [1, 2, 4])
    print("\n## project", flush=True)
    results["project"] = bench_project.bench_project("flux-dev", "tiny", None, 256, 256, steps, "fp32",
                                                     [2] if q else [2, 4], 3 if q else 5,
                                                     validate=("ulysses2", "ring2") if q else
                                                     ("ulysses2", "ring2", "pipefusion2"))
    if torch.cuda.is_available():
        print("\n## gpu", flush=True)
        results["gpu"] = bench_gpu.bench_gpu([0], list(bench_gpu.MODELS), list(bench_gpu.ROWS), 1024, 2, None)
    else:
        print("\n## gpu\nskipped: this torch sees no CUDA device", flush=True)
    print("\n## soak", flush=True)
    results["soak"] = bench_soak.bench_soak(bench_soak.QUICK_JOBS if q else bench_soak.DEFAULT_JOBS)
    if a.json:
        output.write(a.json, json.dumps(results, indent=1).encode())
    if results["soak"]["problems"]:
        print(f"{a.parser.prog}: soak failed: {'; '.join(results['soak']['problems'])}", file=sys.stderr, flush=True)
        return 1
    return 0


def _run_overhead(a) -> int:
    if a.gpus and len(a.gpus) > 1:
        raise UsageError(f"argument --gpus: {','.join(map(str, a.gpus))} names {len(a.gpus)} GPUs: bench {a.what} "
                         f"runs one rank, give one index")
    dtype = a.dtype or default_dtype("cuda" if a.gpus else "cpu")
    return _emit(a, "overhead", bench_overhead(a.model, a.size, a.gpus, a.width, a.height, a.steps, dtype, a.repeats,
                                               frames=a.frames))


def _bridge_times(engine: Engine, tensor: torch.Tensor, repeats: int, return_rank: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = engine.submit("echo", {"return_rank": return_rank}, {"x": tensor})
        times.append(time.perf_counter() - t0)
        if not torch.equal(result.outputs["x"], tensor):
            raise AssertionError("bridge returned different bytes")
    return statistics.median(times)


def _xdit_send(t: torch.Tensor, dst: int) -> None:
    # What xDiT's service did with its output (pickle.dumps); torch.save writes the same pickle format, and the receiver
    # reads it with torch.load(weights_only=True), so the engine holds no unrestricted unpickler anywhere.
    buffer = io.BytesIO()
    torch.save(t, buffer)
    payload = torch.ByteTensor(list(buffer.getvalue()))
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst)
    dist.send(payload, dst=dst)


def _xdit_recv(src: int) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def xdit_worker(rank: int, store_path: str, sizes_mb: list[int], repeats: int) -> None:
    """Two gloo processes: rank 0 sends each tensor to rank 1 and gets it back, the xDiT way."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=600))
    for mb in sizes_mb:
        tensor = torch.randn(mb * 2**20 // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                _xdit_send(tensor, 1)
                back = _xdit_recv(1)
                times.append(time.perf_counter() - t0)
                assert torch.equal(back, tensor)
            else:
                _xdit_send(_xdit_recv(0), 0)
        if rank == 0:
            print(f"{mb} {statistics.median(times)}", flush=True)
    dist.destroy_process_group()


def _xdit_times(sizes_mb: list[int], repeats: int) -> dict[int, float]:
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ, PYTHONPATH=PACK_ROOT, GLOO_SOCKET_IFNAME="lo")
        code = "import sys; from engine.cli.bench import xdit_worker; xdit_worker(int(sys.argv[1]), sys.argv[2], " \
               "[int(s) for s in sys.argv[3].split(',')], int(sys.argv[4]))"
        args = [store, ",".join(map(str, sizes_mb)), str(repeats)]
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), *args], env=env, stdout=subprocess.PIPE,
                                  text=True, process_group=0) for r in range(2)]  # Ctrl-C reaches us, not them
        try:
            out, _ = procs[0].communicate(timeout=1800)
            procs[1].wait(timeout=60)
        finally:  # Ctrl-C or a timeout: leave no worker behind
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if procs[0].returncode or procs[1].returncode:
            raise RuntimeError("xDiT-style benchmark processes failed")
    return {int(mb): float(t) for mb, t in (line.split() for line in out.strip().splitlines())}


def bench_bridge(sizes_mb: list[int], repeats: int = 5, xdit_repeats: int = 2) -> list[dict]:
    print(f"tensor round trip, float32, median of {repeats} (xDiT-style: {xdit_repeats}); machine: "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    ours: dict[int, dict[int, float]] = {}
    listed = ", ".join(map(str, sizes_mb))
    for world in (1, 2):
        print(f"measuring: bridge, {world} CPU rank(s), {listed} MB ...", flush=True)
        with Engine(world, device="cpu") as engine:
            for mb in sizes_mb:
                tensor = torch.randn(mb * 2**20 // 4)
                _bridge_times(engine, tensor, 1, world - 1)  # warm-up
                ours.setdefault(mb, {})[world] = _bridge_times(engine, tensor, repeats, world - 1)
    print(f"measuring: xDiT-style, 2 gloo processes, {listed} MB ...", flush=True)
    xdit = _xdit_times(sizes_mb, xdit_repeats)
    header = ("size", "bridge, 1 rank", "bridge, 2 ranks*", "xDiT-style, 2 ranks", "xDiT / bridge(1)", "xDiT / bridge(2)")
    print(markdown(header, [(f"{mb} MB", f"{ours[mb][1] * 1e3:.1f} ms", f"{ours[mb][2] * 1e3:.1f} ms",
                             f"{xdit[mb] * 1e3:.1f} ms", f"{xdit[mb] / ours[mb][1]:.1f}x",
                             f"{xdit[mb] / ours[mb][2]:.1f}x") for mb in sizes_mb]))
    print("bridge: client -> shared memory -> rank 0 (crc32 verify) -> result from the last rank -> shared memory "
          "-> client, a whole engine job.\n* 2 ranks adds rank 0's gloo broadcast of the job to rank 1 and the "
          "all-gather check.\nxDiT-style: rank 0 -> rank 1 -> rank 0, each way torch.save (pickle "
          "format) -> torch.ByteTensor(list(bytes)) -> dist.send (gloo) -> torch.load(weights_only=True).")
    return [{"size_mb": mb, "bridge_1_rank_s": ours[mb][1], "bridge_2_ranks_s": ours[mb][2], "xdit_style_s": xdit[mb]}
            for mb in sizes_mb]


def bench_comm(models: list[str], quick: bool = False) -> list[dict]:
    from ..parallel.plan import ParallelPlan

    print("bytes one rank sends per denoising step (one model call), 1024x1024, bf16 activations; measured = counted "
          "by the engine's collectives\nwith full-size tensors on CPU ranks (gloo), attention arithmetic skipped",
          flush=True)
    widths = (17, 10, 10, 6, 21)
    out = []

    def line(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |", flush=True)

    for name in models:
        plans = PLANS[name][:2] if quick else PLANS[name]
        m = MODELS[name]
        print(f"\n{name}: {m['image_tokens']} image + {m['text_tokens']} text tokens "
              f"({'split with the image' if m['text_split'] else 'joint, on every rank'}), {m['heads']} heads x "
              f"{m['head_dim']}, {m['attention_layers']} attention layers; {len(plans)} plans, one engine "
              f"each, a row as each is measured", flush=True)
        line(("plan", "measured", "analytic", "ratio", "measured by kind (GB)"))
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|", flush=True)
        for text in plans:
            plan = ParallelPlan(**{k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})
            batch = 2 if m["negative_pass"] and plan.cfg == 1 else 1  # SD3's pos+neg batched in one forward
            spec = dict(m, plan=plan.as_dict(), batch_per_forward=batch, latent_h=128, latent_w=128)
            with Engine(plan.world_size, device="cpu") as engine:
                result = engine.submit("comm_probe", spec)
            sent = result.ranks[0]["sent"]
            measured = sum(sent.values())
            expected = analytic_bytes(m, plan, batch)
            kinds = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in sorted(sent.items()))
            line((plan.describe(), f"{measured / 1e9:.3f} GB", f"{expected / 1e9:.3f} GB",
                  f"{measured / expected:.3f}", kinds))
            out.append({"model": name, "plan": plan.describe(), "measured_bytes": measured, "analytic_bytes": expected,
                        "by_kind": sent})
    return out + bench_memory.bench_comm_pipefusion(quick)
