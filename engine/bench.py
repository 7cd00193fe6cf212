"""`python -m engine bench bridge`: tensor round trips through our shared-memory bridge vs the xDiT-style
path (pickle -> torch.ByteTensor(list(bytes)) -> dist.send over gloo), printed as a table."""
from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .client import Engine, PACK_ROOT


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
    payload = torch.ByteTensor(list(pickle.dumps(t)))  # what xDiT's service did with its output
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst)
    dist.send(payload, dst=dst)


def _xdit_recv(src: int) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src)
    return pickle.loads(payload.numpy().tobytes())


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
        code = "import sys; from engine.bench import xdit_worker; xdit_worker(int(sys.argv[1]), sys.argv[2], " \
               "[int(s) for s in sys.argv[3].split(',')], int(sys.argv[4]))"
        args = [store, ",".join(map(str, sizes_mb)), str(repeats)]
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), *args], env=env, stdout=subprocess.PIPE,
                                  text=True) for r in range(2)]
        out, _ = procs[0].communicate(timeout=1800)
        procs[1].wait(timeout=60)
        if procs[0].returncode or procs[1].returncode:
            raise RuntimeError("xDiT-style benchmark processes failed")
    return {int(mb): float(t) for mb, t in (line.split() for line in out.strip().splitlines())}


def bench_bridge(sizes_mb: list[int], repeats: int = 5, xdit_repeats: int = 2) -> int:
    print(f"tensor round trip, float32, median of {repeats} (xDiT-style: {xdit_repeats}); machine: {os.cpu_count()} CPUs, torch {torch.__version__}")
    ours: dict[int, dict[int, float]] = {}
    for world in (1, 2):
        with Engine(world, device="cpu") as engine:
            for mb in sizes_mb:
                tensor = torch.randn(mb * 2**20 // 4)
                _bridge_times(engine, tensor, 1, world - 1)  # warm-up
                ours.setdefault(mb, {})[world] = _bridge_times(engine, tensor, repeats, world - 1)
    xdit = _xdit_times(sizes_mb, xdit_repeats)
    header = ("size", "bridge, 1 rank", "bridge, 2 ranks*", "xDiT-style, 2 ranks", "xDiT / bridge(1)", "xDiT / bridge(2)")
    rows = [(f"{mb} MB", f"{ours[mb][1] * 1e3:.1f} ms", f"{ours[mb][2] * 1e3:.1f} ms", f"{xdit[mb] * 1e3:.1f} ms",
             f"{xdit[mb] / ours[mb][1]:.1f}x", f"{xdit[mb] / ours[mb][2]:.1f}x") for mb in sizes_mb]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
    print("bridge: client -> shared memory -> rank 0 (crc32 verify) -> result from the last rank -> shared memory "
          "-> client, a whole engine job.\n* 2 ranks adds rank 0's gloo broadcast of the job to rank 1 and the "
          "all-gather check.\nxDiT-style: rank 0 -> rank 1 -> rank 0, each way pickle.dumps -> "
          "torch.ByteTensor(list(bytes)) -> dist.send (gloo) -> pickle.loads.")
    return 0
