"""`python -m engine plan`: every parallel plan that can run a job on up to N GPUs, ranked by the planner's cost
model, the plan `auto` (or `fastest`) would choose and why, or the price of one plan (`--plan ulysses4,ring2`); the job
the model's stock workflow's where flags leave it out (plan_job.py); `--json` for the same as data, `--markdown` for
the README's tables (plan_view.py); `--validate` for the model against published multi-GPU runs. No rank starts."""
from __future__ import annotations

import json
from argparse import ArgumentTypeError

from ..errors import PlanError
from .. import families
from ..families import VARIANTS
from ..generate.inputs import check_dtype, check_frames, check_latent
from ..generate.request import empty_latent
from ..models.load import COMPUTE_DTYPES, inspect_model
from ..models.quantized import BLOCKS
from ..parallel import cost
from ..published import images as published
from ..published import sharding
from ..parallel.devices import GPUS, LINK_ALIASES, LINKS, find_gpu, stated_hardware
from ..parallel.plan import (AUTO, EXPERT_PLACEMENTS, FASTEST, TWO_EXPERTS, ParallelPlan, Workload, candidates,
                             feasible, plan_problems)
from ..parallel.planner import resolve_plan, survey
from ..runtime.machine import Machine
from . import args as types
from ..published import vae as published_vae
from . import plan_job, plan_vae, plan_view
from .args import UsageError

# an H100 of the kind the link has: H100 PCIe over any PCIe class, else H100 SXM
DEFAULT_GPU = {k: "H100 PCIe" for k in list(LINKS) + list(LINK_ALIASES) if k.startswith("pcie")}
STATED_LINKS = [k for k in LINKS if k != "cpu"] + list(LINK_ALIASES)   # CPU ranks share one host: nothing to estimate


def model_or_variant(text: str) -> str:
    """A known variant (its full-size dims) or a checkpoint, as a model source inspect_model reads."""
    try:   # any name of a model (ltx23 or ltx-2.3, h3): its one canonical variant
        return f"synthetic:{families.variant(text)}"
    except ValueError:
        pass
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
                       description="Estimate every parallel plan that can run the job on up to --gpus GPUs (seconds "
                                   "per image or clip and per step: compute, exposed communication, host launches; "
                                   "memory per GPU) and print them ranked, with the plan auto chooses and why. The job "
                                   "is the model's stock ComfyUI workflow's (workflows/) unless flags say otherwise. "
                                   "Nothing runs: the figures are the cost model's.")
    p.add_argument("--model", type=model_or_variant,
                   help=f"a known model ({', '.join(VARIANTS)}) or a checkpoint file or diffusers folder "
                        f"(required unless --validate)")
    p.add_argument("--gpus", type=types.ranks, help="number of GPUs, 1 to 8, one rank each (required unless "
                                                    "--validate)")
    p.add_argument("--interconnect", choices=STATED_LINKS,
                   help="the topology class of the link between the GPUs, the worst path between any two of them as "
                        "nvidia-smi topo -m shows it: nvlink (NV#), pcie-switch (PIX, PXB), pcie-bridge (PHB, NODE), "
                        "pcie-socket (SYS), pcie-no-peer (no peer access, e.g. GeForce cards), network; pcie means "
                        "pcie-bridge (required unless --validate)")
    stock = "(default: the model's stock workflow's, e.g. FLUX.1-dev's 1024x1024, 28 steps, cfg 1; Wan 2.2 A14B's " \
            "640x640, 81 frames, 20 steps, cfg 3.5)"
    p.add_argument("--width", type=types.pixels, help=f"image width in pixels {stock}")
    p.add_argument("--height", type=types.pixels, help="image height in pixels (default: the stock workflow's)")
    p.add_argument("--frames", type=types.positive_int,
                   help="video frames as ComfyUI's video nodes count them (Wan: 4k + 1, e.g. 81 at 1280x720: 21 "
                        "latent frames of 45x80 tokens; default: the stock workflow's, 1 for an image model)")
    p.add_argument("--cfg", type=types.request_field("cfg", types.finite_float),
                   help="CFG scale; != 1.0 adds the negative pass (default: the stock workflow's)")
    p.add_argument("--batch", type=types.positive_int, default=1, help="images per job")
    p.add_argument("--dtype", default="bf16", choices=list(COMPUTE_DTYPES), help="compute dtype")
    p.add_argument("--fp8", action="store_true", help="fp8 weights (ComfyUI's fp8_e4m3fn weight dtype)")
    p.add_argument("--quant", choices=list(BLOCKS),
                   help="price the weights as a GGUF file of this block type holds them (e.g. Q4_K: 144 bytes per 256 "
                        "weights); a GGUF or fp8 checkpoint given as --model is priced as it is stored")
    p.add_argument("--gpu-name", type=gpu_name, help=f"one of {', '.join(GPUS)} (default: an H100 of the kind the "
                                                     f"interconnect has: H100 PCIe over PCIe, else H100 SXM)")
    p.add_argument("--gpu-memory-gb", type=types.positive_float,
                   help="GiB per GPU, the total torch reports (default: the GPU's, e.g. 23.64 for an RTX 4090)")
    p.add_argument("--steps", type=types.positive_int, help="denoising steps per image or clip (PipeFusion's warmup "
                                                            "and pipeline fill are per job; default: the stock "
                                                            "workflow's)")
    p.add_argument("--warmup-steps", type=types.positive_int, default=1,
                   help="PipeFusion: steps run whole before patches use stale activations (= --steps: exact)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks")
    p.add_argument("--experts", type=types.positive_int,
                   help=f"transformers a clip runs one after the other, each of the model's size (default: 2 for "
                        f"{', '.join(TWO_EXPERTS)}, whose clips run a high-noise and a low-noise expert; else 1)")
    p.add_argument("--placement", choices=EXPERT_PLACEMENTS, default="auto",
                   help="with several experts: where the idle one waits; resident: every expert on every GPU; host: "
                        "the idle one in host memory, copied back once per clip; auto: resident where it fits")
    p.add_argument("--plan", type=types.plan_choice, default=AUTO, metavar="auto|fastest|DEGREES",
                   help="auto: the fastest exact plan (the result equals one GPU's); fastest: approximate plans "
                        "(PipeFusion) too; DEGREES: price that one plan, e.g. ulysses4,ring2 or cfg2,pipefusion2")
    p.add_argument("--measured", type=_setup, metavar="cuda:0,1|cpu:N[:pinned]",
                   help="plan for this machine's devices as `python -m engine calibrate` (or the engine's first job) "
                        "measured them: memory, link and compute measured, plans that ran at their measured step "
                        "(replaces --gpus, --interconnect, --gpu-name and --gpu-memory-gb)")
    p.add_argument("--folder", help="where the machine's measurements are stored (default: the per-user cache)")
    p.add_argument("--json", action="store_true", help='print {"chosen": ..., "one_gpu": ..., "candidates": [...]} '
                                                       "instead of the tables")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown, as the README has them "
                                                           "(default: aligned columns for a terminal)")
    p.add_argument("--validate", action="store_true", help="print the cost model against published multi-GPU runs "
                                                           "(every residual; which rows its constants are fitted to, "
                                                           "which are held out) and exit")
    p.add_argument("--memory-table", action="store_true",
                   help="print the GiB per GPU of each model, weight format and plan at 1024x1024 (docs/fit.md's "
                        "first table) and exit")
    p.add_argument("--fit-table", action="store_true",
                   help="print the Wan video fit table (the plan auto picks, GiB per GPU and est. seconds a clip for "
                        "each model, weight format and size on 2x24, 4x24, 8x48 and 1-8x80 GB machines) and exit")
    p.add_argument("--av-table", action="store_true",
                   help="print the MiniMax-H3 and LTX-2.3 fit tables (audio + video: the plan auto picks, dividing the "
                        "weights where whole weights do not fit, and the fastest with whole weights, GiB per GPU and "
                        "est. seconds a clip, in bf16, fp8 and (MiniMax-H3) GGUF on 2x24, 4x24, 8x24, 2x48, 4x48 and "
                        "1-8x80 GB machines) and exit")
    p.add_argument("--shard-table", action="store_true",
                   help="print the sharding fit table (the plan auto picks, dividing the weights among the GPUs where "
                        "that fits or is faster, for Wan 2.1 14B, the Wan 2.2 A14B pair, FLUX.2 [dev] and Qwen-Image "
                        "in bf16, fp8 and GGUF on 2x16, 2x24, 4x24, 8x24 and 2x48 GB machines) and exit")
    p.set_defaults(run=run, parser=p)


def _setup(text: str) -> tuple:
    """cuda:0,1 | cpu:N | cpu:N:pinned -> (device, ranks, gpus, pinned)."""
    device, _, rest = text.strip().partition(":")
    try:
        if device == "cuda":
            gpus = types.gpu_list(rest)
            return "cuda", len(gpus), gpus, False
        if device == "cpu":
            count, _, pinned = rest.partition(":")
            if pinned not in ("", "pinned"):
                raise ArgumentTypeError(f"{text} is invalid")
            return "cpu", types.ranks(count), None, pinned == "pinned"
    except ArgumentTypeError as e:
        raise ArgumentTypeError(f"{text!r}: {e}; give cuda:0,1 or cpu:2 (cpu:2:pinned)") from None
    raise ArgumentTypeError(f"{text!r} is invalid: give cuda:0,1 or cpu:2 (cpu:2:pinned)")


def _required(a) -> None:
    missing = [f"--{n}" for n in ("model", "gpus", "interconnect") if getattr(a, n) is None]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)} (or give --validate, "
                         f"--memory-table, --fit-table, --shard-table or --av-table alone)")


def _validate() -> int:
    print("\n".join(published.validation_table() + [""]))
    print("Weights divided among GPUs (FSDP): the gathers and memory against published runs (nothing fitted)")
    print("\n".join(sharding.table() + [""]))
    print("The VAE decode (engine/vae/cost.py) against published decode times (one row fitted: CONV_SHARE)")
    print("\n".join(published_vae.table() + [""] + published.summary()))
    return 0


def run(a) -> int:
    plan_job.check_flags(a)
    if a.validate:
        return _validate()
    if a.fit_table or a.memory_table or a.shard_table or a.av_table:
        print("\n".join(plan_view.fixed_table(a)))
        return 0
    if a.measured:
        if a.model is None:
            raise UsageError("the following arguments are required: --model (with --measured)")
        device, ranks, gpus, pinned = a.measured
        machine = Machine(device, ranks, gpus, folder=a.folder, pinned=pinned)
        if machine.measured() is None:
            raise UsageError(f"argument --measured: nothing is measured for {machine.setup} on this machine (looked in "
                             f"{machine.path}): run python -m engine calibrate "
                             + (f"--gpus {','.join(map(str, gpus))}" if gpus else
                                f"--ranks {ranks}{' --pin-cpus' if pinned else ''}") + " first")
        a.gpus = ranks
    else:
        _required(a)
    info = inspect_model(a.model)
    defaults = plan_job.fill_job(a, info)
    if a.warmup_steps > a.steps:
        raise UsageError(f"argument --warmup-steps: {a.warmup_steps} is more than --steps {a.steps}: use 1 to "
                         f"{a.steps} ({a.steps}: PipeFusion exact)")
    try:
        check_frames(info, a.frames)
    except ValueError as e:
        raise UsageError(f"argument --frames: {e}") from None
    try:
        check_dtype(info, a.dtype)
    except ValueError as e:
        raise UsageError(f"argument --dtype: {e}") from None
    latent = empty_latent(info, a.width, a.height, frames=a.frames)
    try:
        latent_h, latent_w = check_latent(info, latent)
    except ValueError as e:
        raise UsageError(f"argument --width/--height: {e}") from None
    experts = a.experts or (2 if info.variant in TWO_EXPERTS else 1)
    plan_job.check_experts(a, experts, info.variant)
    work = Workload.from_info(info, latent_h, latent_w, batch=a.batch, negative_pass=a.cfg != 1.0,
                              frames=latent.shape[2] + info.spec.reference_frames(info.variant)
                              if info.spec.frames else 1,
                              text_tokens=info.spec.text_tokens, dtype=a.dtype, fp8_weights=a.fp8,
                              compiled=a.compile, steps=a.steps, warmup_steps=a.warmup_steps,
                              bytes_per_weight=BLOCKS[a.quant][2] / BLOCKS[a.quant][1] if a.quant else None,
                              experts=experts, placement=a.placement)
    notes = [line for line in (defaults, plan_job.size_note(info, a.width, a.height, work.token_rows,
                                                            _token_cols(work))) if line]
    hw = machine.hardware() if a.measured else stated_hardware(
        a.gpus, a.gpu_name or DEFAULT_GPU.get(a.interconnect, "H100 SXM"), a.interconnect, a.gpu_memory_gb)
    one = cost.estimate(ParallelPlan(), work, hw)
    if isinstance(a.plan, ParallelPlan):
        return _price(a, info, work, hw, one, notes)
    found = survey(a.gpus, work, hw, approximate=a.plan == FASTEST, pipefusion=True)
    try:
        choice = resolve_plan(a.plan, a.gpus, work, hw)
    except PlanError as e:  # nothing fits: the numbers are in the table, the verdict is the one error line
        choice = e
    chosen = found.chosen if not isinstance(choice, PlanError) else None
    decode = plan_vae.decode(info, (a.batch,) + tuple(latent.shape[1:]), hw, chosen, a.dtype)
    if a.json:
        if isinstance(choice, PlanError):
            raise UsageError(_refusal(choice, a, work, found)) from None
        print(json.dumps({"chosen": plan_view.entry(found.chosen, work), "one_gpu": plan_view.entry(one, work),
                          "reason": choice.reason, "job": _job(a, work), "decode": decode,
                          "candidates": [plan_view.entry(e, work) for e in sorted(found.estimates,
                                                                                  key=lambda e: e.job_ms)]},
                         indent=1))
        return 0
    print("\n".join(plan_view.header(info, work, hw, a) + notes) + "\n")
    mine = sorted((e for e in found.estimates if e.ranks == a.gpus or e is chosen),
                  key=lambda e: (not e.fits, e.job_ms))
    # plans that divide the weights are listed where no plan with whole weights fits (or one of them is the choice)
    whole_fits = any(e.fits and e.plan.shard == 1 and e.plan.pipefusion == 1 for e in mine)
    divided = [e for e in mine if e.plan.shard > 1 and e is not chosen]
    if whole_fits and divided:
        mine = [e for e in mine if e not in divided]
    if mine:
        print("\n".join(plan_view.table(mine, work, chosen, a.markdown)))
    if chosen is not None and chosen in mine:
        print(plan_view.choice_note(mine, chosen, found, a.plan == FASTEST))
    if whole_fits and divided:
        fastest = min(divided, key=lambda e: e.job_ms)
        print(f"not listed: {len(divided)} plan(s) dividing the weights (shard), since whole weights fit; the fastest, "
              f"{fastest.plan.describe()}, est. {fastest.s_per_image:.2f} s/{work.per}, "
              f"{fastest.memory['total']:.1f} GiB (--json lists them all)")
    relevant = [p for p in candidates(a.gpus, pipefusion=True) if (p.cfg == 1 or work.negative_pass)
                and work.batch % p.dp == 0]
    runs = feasible(a.gpus, work, pipefusion=True)
    left_out = [f"{p.describe()} ({'; '.join(plan_problems(p, work))})" for p in relevant
                if p not in runs]   # the heads, tokens or layout forbid it (cfg and batch go unsaid)
    if left_out:
        print("cannot run: " + ", ".join(left_out))
    for k in range(a.gpus - 1, 0, -1):
        best = found.best_on(k, exact_only=a.plan == AUTO)
        if best is not None:
            gpus = f"{k} GPU{'s' if k > 1 else ''}"
            print(f"best on {gpus}: {best.plan.describe()}, est. {best.s_per_image:.2f} s/{work.per}, "
                  f"{best.step_ms:.1f} ms/step, {best.memory['total']:.1f} GiB")
    if not one.fits:
        print(f"1 GPU does not fit: it needs {one.memory['total']:.1f} GiB of {hw.memory_gib:.4g}")
    if work.experts > 1:
        print("\n".join(plan_view.experts_lines(work, hw, chosen or min(found.estimates,
                                                                          key=lambda e: e.memory["total"]))))
    print("\n".join(plan_vae.lines(decode, work.per)))
    print()
    if isinstance(choice, PlanError):
        raise UsageError(_refusal(choice, a, work, found)) from None
    print(choice.reason)
    return 0


def _token_cols(work: Workload) -> int:
    return (work.image_tokens - work.audio_tokens) // max(1, work.latent_frames) // max(1, work.token_rows)


def _job(a, work: Workload) -> dict:
    """The job priced, as --json gives it (the stock workflow's values where the flags left them out)."""
    return {"width": a.width, "height": a.height, "frames": a.frames, "steps": a.steps, "cfg": a.cfg,
            "batch": a.batch, "per": work.per, "tokens": work.image_tokens, "audio_tokens": work.audio_tokens}


def _refusal(error: PlanError, a, work: Workload, found) -> str:
    """The no-fit line, led by the flag whose value drives the memory when a clip's activations outweigh its weights
    (the frames)."""
    least = min(found.estimates, key=lambda e: e.memory["total"])
    if work.video and least.memory["activations"] > least.memory["weights"]:
        return f"argument --frames: {a.frames} frames at {a.width}x{a.height}: {error}"
    return str(error)


def _price(a, info, work: Workload, hw, one: cost.Estimate, notes: list[str]) -> int:
    """`--plan DEGREES`: that plan's estimate on its own ranks (at most --gpus), against one GPU."""
    plan = a.plan
    if plan.world_size > a.gpus:
        raise UsageError(f"argument --plan: {plan.describe()} needs {plan.world_size} GPUs but --gpus is {a.gpus}: "
                         f"give degrees whose product is at most {a.gpus}, or more --gpus")
    problems = plan_problems(plan, work)
    if problems:
        raise UsageError(f"argument --plan: {plan.describe()} cannot run this job: " + "; ".join(problems))
    e = cost.estimate(plan, work, hw)
    if a.json:
        print(json.dumps({"chosen": plan_view.entry(e, work), "one_gpu": plan_view.entry(one, work),
                          "job": _job(a, work), "candidates": [plan_view.entry(e, work)]}, indent=1))
        return 0
    print("\n".join(plan_view.header(info, work, hw, a) + notes) + "\n")
    print("\n".join(plan_view.table([e] + ([one] if plan.world_size > 1 else []), work, markdown=a.markdown)))
    if work.experts > 1:
        print("\n".join(plan_view.experts_lines(work, hw, e)))
    print()
    print(f"{plan.describe()} on {plan.world_size} of {a.gpus} GPU(s): est. {e.s_per_image:.2f} s/{work.per} "
          f"({one.s_per_image / e.s_per_image:.2f}x one GPU's {one.s_per_image:.2f})"
          + ("" if e.fits else f"; does not fit {hw.memory_gib:.4g} GiB per GPU")
          + ("" if e.exact else "; approximate (PipeFusion: stale activations after the warmup steps)"))
    return 0
