"""Command line: `python -m engine demo | make-tiny | bench bridge`."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Multi-GPU FLUX/SD3 engine")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the embedded default: 2 CPU ranks, a tiny FLUX model, one job")
    demo.add_argument("--ranks", type=int, default=2)
    demo.add_argument("--model", help="a FLUX checkpoint to inspect instead of the generated tiny one")

    tiny = sub.add_parser("make-tiny", help="write a tiny synthetic checkpoint in a real ComfyUI layout")
    tiny.add_argument("--kind", choices=["flux", "sd3"], required=True)
    tiny.add_argument("--variant", help="flux: flux-dev | flux-schnell; sd3: sd3-medium | sd3.5-medium | sd3.5-large")
    tiny.add_argument("--out", required=True, help="directory to write into")
    tiny.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "fp8_e4m3fn"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--prefix", action="store_true", help="prefix keys with model.diffusion_model.")
    tiny.add_argument("--full", action="store_true", help="full checkpoint: prefix + text encoder / VAE keys")

    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    bb = bench_sub.add_parser("bridge", help="tensor round trips: our bridge vs the xDiT-style pickle path")
    bb.add_argument("--sizes-mb", default="1,16,64")
    bb.add_argument("--repeats", type=int, default=5)
    bb.add_argument("--xdit-repeats", type=int, default=2, help="the xDiT-style path takes seconds per 64 MB")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run
        return run(ranks=args.ranks, model=args.model)
    if args.command == "make-tiny":
        from .tiny import write_tiny
        try:
            path = write_tiny(args.kind, args.out, variant=args.variant, dtype=args.dtype, seed=args.seed,
                              prefix=args.prefix, full=args.full)
        except ValueError as e:
            parser.error(str(e))
        print(f"wrote {path}")
        return 0
    if args.command == "bench" and args.what == "bridge":
        from .bench import bench_bridge
        sizes = [int(s) for s in args.sizes_mb.split(",") if s]
        return bench_bridge(sizes, args.repeats, args.xdit_repeats)
    return 2


if __name__ == "__main__":
    sys.exit(main())
