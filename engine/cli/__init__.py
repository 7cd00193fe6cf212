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

    gen = sub.add_parser("generate", help="sample a latent with a FLUX/SD3 checkpoint, as ComfyUI's KSampler does")
    gen.add_argument("--model", required=True, help="checkpoint file or diffusers folder")
    gen.add_argument("--cond", required=True, help="safetensors with cond, pooled [, neg_cond, neg_pooled]")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--steps", type=int, default=20)
    gen.add_argument("--cfg", type=float, default=1.0)
    gen.add_argument("--sampler", default="euler")
    gen.add_argument("--scheduler", default="simple")
    gen.add_argument("--width", type=int, default=1024)
    gen.add_argument("--height", type=int, default=1024)
    gen.add_argument("--batch", type=int, default=1)
    gen.add_argument("--denoise", type=float, default=1.0)
    gen.add_argument("--latent", help="input LATENT safetensors ('samples'), for denoise < 1 (img2img)")
    gen.add_argument("--guidance", type=float, default=3.5, help="FLUX guidance (FluxGuidance)")
    gen.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--device", choices=["cpu"], help="run the ranks on the CPU (default)")
    where.add_argument("--gpus", help="comma-separated GPU indices, one rank each, e.g. 0 or 0,1")
    gen.add_argument("--out", required=True, help="output LATENT safetensors ('samples')")
    gen.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel degree")
    gen.add_argument("--ring", type=int, default=1, help="Ring sequence-parallel degree")
    gen.add_argument("--cfg-parallel", action="store_true", help="positive and negative passes on different ranks")
    gen.add_argument("--dp", type=int, default=1, help="data-parallel degree over the batch")
    gen.add_argument("--pipefusion", type=int, default=1, help="PipeFusion stages (not built yet: 1)")
    gen.add_argument("--ranks", type=int, help="rank count (default: the product of the plan's degrees)")
    gen.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                     help="apply a LoRA (kohya, BFL/ComfyUI or diffusers format); repeat to chain")

    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    bb = bench_sub.add_parser("bridge", help="tensor round trips: our bridge vs the xDiT-style pickle path")
    bb.add_argument("--sizes-mb", default="1,16,64")
    bb.add_argument("--repeats", type=int, default=5)
    bb.add_argument("--xdit-repeats", type=int, default=2, help="the xDiT-style path takes seconds per 64 MB")

    bg = bench_sub.add_parser("generate", help="one-rank generate job vs a plain in-process diffusers loop")
    bg.add_argument("--model", default="flux-dev", help="synthetic variant: flux-dev, flux-schnell, sd3-medium, "
                                                         "sd3.5-medium, sd3.5-large (random weights)")
    bg.add_argument("--size", default="tiny", choices=["tiny", "full"], help="tiny test dims or the real model's")
    bg.add_argument("--gpus", help="one GPU index to run on (default: CPU)")
    bg.add_argument("--width", type=int, default=256)
    bg.add_argument("--height", type=int, default=256)
    bg.add_argument("--steps", type=int, default=28)
    bg.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    bg.add_argument("--repeats", type=int, default=3)

    bc = bench_sub.add_parser("comm", help="bytes sent per rank per step, per plan, measured vs analytic")
    bc.add_argument("--models", default="FLUX.1-dev,SD3-medium")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run
        return run(ranks=args.ranks, model=args.model)
    if args.command == "make-tiny":
        from ..models.tiny import write_tiny
        try:
            path = write_tiny(args.kind, args.out, variant=args.variant, dtype=args.dtype, seed=args.seed,
                              prefix=args.prefix, full=args.full)
        except ValueError as e:
            parser.error(str(e))
        print(f"wrote {path}")
        return 0
    if args.command == "generate":
        from .generate import run_generate
        return run_generate(args, parser)
    if args.command == "bench" and args.what == "bridge":
        from .bench import bench_bridge
        sizes = [int(s) for s in args.sizes_mb.split(",") if s]
        return bench_bridge(sizes, args.repeats, args.xdit_repeats)
    if args.command == "bench" and args.what == "comm":
        from .bench import bench_comm
        return bench_comm(args.models.split(","))
    if args.command == "bench" and args.what == "generate":
        from .bench import bench_generate
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
        return bench_generate(args.model, args.size, gpus, args.width, args.height, args.steps, args.dtype,
                              args.repeats)
    return 2


if __name__ == "__main__":
    sys.exit(main())
