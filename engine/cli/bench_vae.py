"""`python -m engine bench vae`: a VAE's decode and encode on 1, 2, 4 ... ranks in one run (CPU ranks, or GPUs with
--gpus): seconds per job as the ranks measured them (the slowest rank's compute) and as the caller waited, the
speed-up over one rank, the bytes rank 0 sent (halo rows and the attention's K/V gather) and the result against one
rank's (relative L2). The VAE is a file (--vae) or a random one of the kind's, at make-tiny's widths (CPU ranks) or the
released ones (--widths full, for GPUs), at the clip size asked."""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from ..runtime.client import Engine
from ..vae import client
from ..vae import load
from ..vae.load import DTYPES, NAMES, inspect_vae, write_tiny_vae
from . import args as types
from .args import UsageError
from .tables import markdown


def register(bench, emit) -> None:
    p = bench.add_parser("vae", help="a VAE decode and encode on 1, 2, 4 ranks: s per job, speed-up, bytes exchanged",
                         description=__doc__.split(": ", 1)[1].replace("\n", " "))
    p.add_argument("--kind", choices=NAMES, default="wan2.1", help="the tiny VAE's kind when --vae is not given")
    p.add_argument("--vae", type=types.existing_file, help="a VAE file (default: a random one of --kind)")
    p.add_argument("--widths", choices=["tiny", "full"], default="tiny",
                   help="the random VAE's widths: make-tiny's, or the released VAE's (written in --dtype first)")
    p.add_argument("--ranks", type=lambda t: types.int_list(t, types.ranks, "1,2,4"), default="1,2,4",
                   help="comma-separated rank counts")
    p.add_argument("--width", type=types.pixels, default=832, help="clip width in pixels")
    p.add_argument("--height", type=types.pixels, default=480, help="clip height in pixels")
    p.add_argument("--frames", type=types.positive_int, default=9,
                   help="clip frames: tk + 1 for a VAE of temporal ratio t (Wan 4, LTX 8); any for MiniMax-H3")
    p.add_argument("--dtype", choices=list(DTYPES), help="compute dtype (default: bf16 with --gpus, fp32 on the CPU)")
    p.add_argument("--ops", type=types.name_list(["decode", "encode"]), default="decode,encode",
                   help="comma-separated: decode, encode")
    p.add_argument("--repeats", type=types.positive_int, default=2, help="timed jobs per row after one warm-up")
    p.add_argument("--gpus", type=types.gpu_list, default=None, help="CUDA GPU indices, one rank each (default: CPU)")
    p.set_defaults(run=lambda a: emit(a, "vae", bench_vae(a.vae, a.kind, a.ranks, a.width, a.height, a.frames,
                                                          a.dtype, a.ops, a.repeats, a.gpus, a.widths)), parser=p)


def bench_vae(path, kind, ranks, width, height, frames, dtype, ops, repeats, gpus, widths="tiny") -> list[dict]:
    if gpus is not None and max(ranks) > len(gpus):
        raise UsageError(f"argument --ranks: {max(ranks)} ranks need as many GPUs and --gpus lists {len(gpus)}")
    dtype = dtype or ("bf16" if gpus else "fp32")
    vae_kind = inspect_vae(path).kind if path else load.kind(kind)
    s, t = vae_kind.spatial, vae_kind.temporal
    if (frames - 1) % t and not vae_kind.pool:
        raise UsageError(f"argument --frames: {frames} is not {t}k + 1 frames ({vae_kind.title}'s clips): e.g. "
                         f"{(frames - 1) // t * t + 1}")
    if width % s or height % s:
        raise UsageError(f"argument --width/--height: {width}x{height} is not whole latent pixels of "
                         f"{vae_kind.title}'s {s} px: use multiples of {s}")
    folder = tempfile.TemporaryDirectory(prefix="xdit-bench-vae-")
    path = path or write_tiny_vae(kind, folder.name, dtype=dtype, full=widths == "full")
    info = inspect_vae(path)
    g = torch.Generator().manual_seed(0)
    time_axis = () if info.kind.latent_dim == 2 else (frames,)   # an image VAE: one image, --frames not used
    latent = info.encoded_shape((1, info.image_channels) + time_axis + (height, width))
    inputs = {"decode": torch.randn(latent, generator=g),
              "encode": torch.rand((1, info.image_channels) + time_axis + (height, width), generator=g) * 2 - 1}
    noise = {"noise": torch.randn(latent, generator=g)} if info.decode_noise else {}   # LTX, timestep-conditioned
    widths = {k: "the header's" if isinstance(v, dict) else v for k, v in info.widths.items()}
    clip = f"clip of {frames} frames" if time_axis else "image"
    print(f"{info.describe()} ({widths}), a {width}x{height} {clip} (latent "
          f"{list(inputs['decode'].shape)}), {dtype}, on {'GPUs ' + ','.join(map(str, gpus)) if gpus else 'CPU ranks'}",
          flush=True)
    rows, first = [], {}
    for n in ranks:
        with Engine(n, device="cuda" if gpus else "cpu", gpus=gpus[:n] if gpus else None) as engine:
            for op in ops:
                extra = noise if op == "decode" else {}
                out, _ = client.run(engine, op, path, inputs[op], dtype, **extra)   # loads the weights on the ranks
                compute, wall = [], []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    out, result = client.run(engine, op, path, inputs[op], dtype, **extra)
                    wall.append(time.perf_counter() - t0)
                    compute.append(result.timings["compute_s"])
                vae = result.ranks[0]["vae"]
                sent = vae.get("sent", {})   # a tile pool (MiniMax-H3) exchanges nothing: its pieces are whole
                first.setdefault(op, (out.float(), statistics.median(compute)))
                ref, base = first[op]
                rows.append({"op": op, "ranks": n, "bands": vae["rows"] if "rows" in vae else
                             [len(r["vae"]["pieces"]) for r in result.ranks],
                             "compute_s": statistics.median(compute), "wall_s": statistics.median(wall),
                             "speedup": base / statistics.median(compute), "halo_mib": sent.get("halo", 0) / 2**20,
                             "gather_mib": sent.get("gather", 0) / 2**20,
                             "rel_l2": float((out.float() - ref).norm() / ref.norm())})
                print(f"  {op} on {n} rank(s): {rows[-1]['compute_s']:.3f} s", flush=True)
    folder.cleanup()
    print(markdown(("op", "ranks", "latent rows (or pieces) a rank", "compute s", "wall s", "speed-up",
                    "rank 0 halo MiB", "rank 0 K/V gather MiB", "rel L2 vs 1st"),
                   [(r["op"], r["ranks"], r["bands"], f"{r['compute_s']:.3f}", f"{r['wall_s']:.3f}",
                     f"{r['speedup']:.2f}", f"{r['halo_mib']:.1f}", f"{r['gather_mib']:.2f}", f"{r['rel_l2']:.2g}")
                    for r in rows]), flush=True)
    return rows
