"""`python -m engine plan`: every parallel plan that can run a job on N GPUs, ranked by the planner's cost model,
and the plan `auto` would choose, with why; no rank starts."""
from __future__ import annotations

from argparse import ArgumentTypeError

from ..errors import PlanError
from ..families import VARIANTS
from ..generate.inputs import check_latent
from ..generate.request import empty_latent
from ..models.load import COMPUTE_DTYPES, inspect_model
from ..parallel import cost
from ..parallel.devices import GPUS, LINKS, find_gpu, stated_hardware
from ..parallel.plan import AUTO, ParallelPlan, Workload, candidates, feasible, plan_problems, \
    rank_plans, resolve_plan
from . import args as types
from . import describe
from .args import UsageError

DEFAULT_GPU = {"pcie": "H100 PCIe", "pcie-no-peer": "H100 PCIe"}   # else H100 SXM: an H100 of the kind that link has
STATED_LINKS = [k for k in LINKS if k != "cpu"]                    # CPU ranks share one host: nothing to estimate


def model_or_variant(text: str) -> str:
    """A known variant (its full-size dims) or a FLUX/SD3 checkpoint, as a model source inspect_model reads."""
    if text in VARIANTS:
        return f"synthetic:{text}"
    try:
        inspect_model(text)
    except (ValueError, OSError) as e:
        raise ArgumentTypeError(f"{text!r} is not a known model ({', '.join(VARIANTS)}) and not a checkpoint: "
                                f"{e}") from None
    return text


def gpu_name(text: str) -> str:
    gpu = find_gpu(text)
    if gpu is None:
        raise ArgumentTypeError(f"{text!r} is not in the planner's GPU table: use one of {', '.join(GPUS)}")
    return gpu.name


def register(sub) -> None:
    p = sub.add_parser("plan", help="rank the parallel plans for a model on N GPUs (no rank starts)",
                       description="Estimate every parallel plan that can run the job on --gpus GPUs (step time: "
                                   "compute and exposed communication; memory per GPU) and print them ranked, with "
                                   "the plan auto chooses and why. Nothing runs: the figures are the cost model's.")
    p.add_argument("--model", required=True, type=model_or_variant,
                   help=f"a known model ({', '.join(VARIANTS)}) or a checkpoint file or diffusers folder")
    p.add_argument("--gpus", required=True, type=types.ranks, help="number of GPUs, 1 to 8 (one rank each)")
    p.add_argument("--interconnect", required=True, choices=STATED_LINKS, help="the link between the GPUs")
    p.add_argument("--width", type=types.pixels, default=1024, help="image width in pixels")
    p.add_argument("--height", type=types.pixels, default=1024, help="image height in pixels")
    p.add_argument("--cfg", type=types.request_field("cfg", types.finite_float), default=1.0,
                   help="CFG scale; != 1.0 adds the negative pass")
    p.add_argument("--batch", type=types.positive_int, default=1, help="images per job")
    p.add_argument("--dtype", default="bf16", choices=list(COMPUTE_DTYPES), help="compute dtype")
    p.add_argument("--fp8", action="store_true", help="fp8 weights (ComfyUI's fp8_e4m3fn weight dtype)")
    p.add_argument("--gpu-name", type=gpu_name, help=f"one of {', '.join(GPUS)} (default: an H100 of the kind the "
                                                     f"interconnect has: H100 PCIe over PCIe, else H100 SXM)")
    p.add_argument("--gpu-memory-gb", type=types.positive_float, help="GiB per GPU (default: the GPU's)")
    p.set_defaults(run=run, parser=p)


def _header(info, work: Workload, hw, a) -> list[str]:
    tflops, source = cost.throughput_tflops(hw, work)
    weights = "fp8" if work.fp8_weights else work.dtype
    cfg = f"cfg {a.cfg:g}" + ("" if work.negative_pass else " (no negative pass)")
    link = hw.link
    lines = [f"model     {describe.summary(info)}",
             f"job       {a.width}x{a.height}, batch {a.batch}, {cfg}, {work.image_tokens} image + {work.text_tokens} "
             f"text tokens, {work.dtype} compute, {weights} weights ({work.weight_bytes / cost.GiB:.1f} GiB): "
             f"{work.step_tflop:.1f} TFLOP per step",
             f"hardware  {hw.gpus}x {hw.gpu_name}, {hw.memory_gib:g} GiB each, {tflops:.0f} TFLOP/s effective "
             f"({source})"]
    if hw.gpus > 1:
        lines.append(f"link      {link.describe()}: {link.bandwidth_gbs:g} GB/s per GPU, {link.latency_us:g} us per "
                     f"call" + ("; an all-to-all of n GPUs gets 2/n of that (shared PCIe tree)" if link.tree else ""))
    return lines


def _table(ranked: list[cost.Estimate]) -> list[str]:
    rows = [("#", "plan", "est. step ms", "compute ms", "comm ms", "comm GB/step per GPU", "memory GiB per GPU",
             "fits")]
    for i, e in enumerate(ranked, 1):
        rows.append((str(i), e.plan.describe(), f"{e.step_ms:.1f}", f"{e.compute_ms:.1f}", f"{e.comm_ms:.1f}",
                     f"{e.comm_bytes / 1e9:.3f}", f"{e.memory['total']:.1f}", "yes" if e.fits else "no"))
    return ["| " + " | ".join(r) + " |" for r in rows[:1]] + ["|" + "---|" * len(rows[0])] + \
        ["| " + " | ".join(r) + " |" for r in rows[1:]]


def run(a) -> int:
    info = inspect_model(a.model)
    try:
        latent_h, latent_w = check_latent(info, empty_latent(info, a.width, a.height))
    except ValueError as e:
        raise UsageError(f"argument --width/--height: {e}") from None
    work = Workload.from_info(info, latent_h, latent_w, batch=a.batch, negative_pass=a.cfg != 1.0,
                              text_tokens=info.spec.text_tokens, dtype=a.dtype, fp8_weights=a.fp8)
    hw = stated_hardware(a.gpus, a.gpu_name or DEFAULT_GPU.get(a.interconnect, "H100 SXM"), a.interconnect,
                         a.gpu_memory_gb)
    print("\n".join(_header(info, work, hw, a)) + "\n")
    ranked = rank_plans(a.gpus, work, hw)
    if ranked:
        print("\n".join(_table(ranked)))
    relevant = [p for p in candidates(a.gpus) if (p.cfg == 1 or work.negative_pass) and work.batch % p.dp == 0]
    left_out = [f"{p.describe()} ({'; '.join(plan_problems(p, work))})" for p in relevant
                if p not in feasible(a.gpus, work)]   # the heads or tokens forbid it (cfg and batch go unsaid)
    if left_out:
        print("cannot run: " + ", ".join(left_out))
    if a.gpus > 1:
        one = cost.estimate(ParallelPlan(), work, hw)
        print(f"1 GPU for comparison: est. {one.step_ms:.1f} ms/step, {one.memory['total']:.1f} GiB"
              + ("" if one.fits else " (does not fit)"))
    print()
    try:
        choice = resolve_plan(AUTO, a.gpus, work, hw)
    except PlanError as e:  # nothing runs or nothing fits: the numbers are above, the verdict is the one error line
        raise UsageError(str(e)) from None
    print(choice.reason)
    return 0
