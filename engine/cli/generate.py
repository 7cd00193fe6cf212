"""`python -m engine generate`: one KSampler run through the engine, from files to a LATENT file."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..families import TITLES
from ..generate.inputs import check_frames
from ..generate.request import GenerateRequest, default_dtype, empty_latent
from ..models.load import COMPUTE_DTYPES, inspect_model
from ..models.safetensors_file import read_header
from ..models.speed import ATTENTION, CUDA_ONLY
from ..errors import PlanError
from ..parallel import cost
from ..parallel.plan import AUTO, FASTEST, MAX_RANKS, ParallelPlan, feasible
from ..runtime.client import Engine
from ..runtime.machine import Machine
from ..sampling.samplers import SAMPLERS
from ..sampling.schedules import SAMPLING_NODES, SCHEDULERS, FlowSampling
from . import args as types
from . import output
from .args import UsageError

DEGREES = ("dp", "pipefusion", "ulysses", "ring", "shard")  # integer degree flags; --cfg-parallel sets cfg=2
IMAGE_KEYS = ("clip_vision_output", "concat_latent_image", "concat_mask")   # a cond file's image-to-video tensors


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample a LATENT with a model file, as ComfyUI's KSampler does",
                       description="Sample a ComfyUI LATENT (the model family's: [B,16,H/8,W/8]; [B,16,1,H/8,W/8] "
                                   "for Qwen-Image; [B,128,H/16,W/16] for FLUX.2; [B,16,F,H/8,W/8] for Wan video, "
                                   "[B,48,F,H/16,W/16] for Wan 2.2 TI2V-5B) on a group of rank processes. Every input "
                                   "is checked before any rank starts.")
    p.add_argument("--model", required=True, type=types.model_source,
                   help=f"checkpoint file ({TITLES}), diffusers folder, or synthetic:<variant>[:tiny]")
    p.add_argument("--cond", required=True, type=types.existing_file,
                   help="safetensors with cond and pooled (a family without a pooled output: cond only), neg_cond "
                        "and neg_pooled for cfg != 1, reference latents ref_0, ref_1, ... (neg_ref_0, ...) as "
                        "ReferenceLatent appends them, and an image-to-video model's clip_vision_output (CLIP-vision "
                        "penultimate hidden states), concat_latent_image and concat_mask (neg_... for the negative), "
                        "as WanImageToVideo puts them in the CONDITIONING")
    p.add_argument("--out", required=True, type=types.output_file(".safetensors", "a LATENT"),
                   help="output LATENT safetensors ('samples'): a new name or a regular file, which is replaced")
    p.add_argument("--seed", type=types.seed, default=0, help="noise seed, 0 .. 2**64-1")
    p.add_argument("--steps", type=types.request_field("steps", types.integer), default=20, help="sampling steps")
    p.add_argument("--cfg", type=types.request_field("cfg", types.finite_float), default=1.0,
                   help="CFG scale; 1.0 runs no negative pass")
    p.add_argument("--sampler", default="euler", choices=SAMPLERS, metavar="NAME",
                   help=f"ComfyUI sampler: {', '.join(SAMPLERS)}")
    p.add_argument("--scheduler", default="simple", choices=SCHEDULERS, metavar="NAME",
                   help=f"ComfyUI scheduler: {', '.join(SCHEDULERS)}")
    p.add_argument("--width", type=types.pixels, help="image width in pixels (default: 1024, or --latent's)")
    p.add_argument("--height", type=types.pixels, help="image height in pixels (default: 1024, or --latent's)")
    p.add_argument("--batch", type=types.positive_int, help="images per job (default: 1, or --latent's batch)")
    p.add_argument("--frames", type=types.positive_int,
                   help="video frames as ComfyUI's video nodes count them (Wan: 4k + 1, e.g. 81; latent frames "
                        "(frames - 1) // 4 + 1; default: 1, or --latent's)")
    p.add_argument("--denoise", type=types.request_field("denoise", types.finite_float), default=1.0,
                   help="denoise strength; < 1 needs --latent (img2img)")
    p.add_argument("--latent", type=types.existing_file,
                   help="input LATENT safetensors ('samples', and 'noise_mask' where the LATENT has one, e.g. "
                        "Wan22ImageToVideoLatent's) to denoise from")
    p.add_argument("--guidance", type=types.request_field("guidance", types.finite_float), default=3.5,
                   help="FluxGuidance's value (FLUX.1 dev, FLUX.2 [dev]); a model without a guidance embedding "
                        "(SD3, FLUX.2 [klein], Qwen-Image) ignores it")
    p.add_argument("--dtype", choices=list(COMPUTE_DTYPES),
                   help="compute dtype (default: bf16 with --gpus, fp32 on CPU ranks)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", choices=["cpu"], help="run the ranks on the CPU (the default without --gpus)")
    where.add_argument("--gpus", type=types.gpu_list, help="comma-separated CUDA GPU indices, one rank each, e.g. 0,1")
    p.add_argument("--ranks", type=types.ranks, help="rank count, 1 to 8 (default: the explicit plan's product of "
                                                      "degrees, else the number of --gpus, else 1)")
    p.add_argument("--plan", choices=["auto", "fastest", "explicit"],
                   help="auto: choose the fastest exact plan for up to --ranks (the default when no degree flag is "
                        "given); fastest: approximate plans (PipeFusion) too; explicit: the degrees given (1 when "
                        "absent; implied by any degree flag)")
    p.add_argument("--ulysses", type=types.positive_int, help="Ulysses sequence-parallel degree (explicit plan)")
    p.add_argument("--ring", type=types.positive_int, help="Ring sequence-parallel degree (explicit plan)")
    p.add_argument("--cfg-parallel", action="store_true", help="positive and negative passes on different ranks "
                                                                "(explicit plan)")
    p.add_argument("--dp", type=types.positive_int, help="data-parallel degree over the batch (explicit plan)")
    p.add_argument("--pipefusion", type=types.positive_int, help="PipeFusion stages (explicit plan): each rank holds "
                   "and runs only its stage's blocks")
    p.add_argument("--shard", type=types.positive_int, help="divide the weights among groups of this many ranks: "
                   "each rank holds and reads 1/shard of them, a block's whole weights gathered as it runs; alone "
                   "(with --ranks or --gpus), auto chooses the other degrees; with other degree flags, a divisor of "
                   "their product (e.g. --ulysses 4 --shard 4)")
    pf = p.add_argument_group("PipeFusion (with --pipefusion 2 or more)")
    pf.add_argument("--patches", type=types.request_field("patches", types.integer),
                    help="latent row bands, at least the stages (default: one per stage)")
    pf.add_argument("--warmup-steps", type=types.request_field("warmup_steps", types.integer), default=1,
                    help="steps run on the whole latent before patches use the previous step's K/V (default 1; "
                         "the job's steps: exact)")
    pf.add_argument("--stage-blocks", type=lambda t: types.int_list(t, example="30,27"),
                    help="blocks per stage, comma-separated (default: balanced by cost)")
    speed = p.add_argument_group("speed")
    speed.add_argument("--cache-threshold", type=types.request_field("cache_threshold", types.finite_float),
                       metavar="T", help="step cache (First-Block-Cache): skip the remaining blocks when the first "
                                         "block's output changed less than T since the last full step (0.05 to 0.2 "
                                         "are useful; 0 never skips; default: no cache)")
    speed.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks (the first job "
                                                              "of a shape compiles; later ones reuse the graphs)")
    speed.add_argument("--attention", default="auto", choices=list(ATTENTION),
                       help="scaled_dot_product_attention kernel (flash, efficient, cudnn need --gpus)")
    speed.add_argument("--fp8-weights", action="store_true", help="store the Linear weights in float8_e4m3fn")
    speed.add_argument("--fp8-matmul", action="store_true",
                       help="fp8 matrix products for fp8 weights (GPUs of compute capability 8.9+; needs --fp8-weights)")
    sampling = p.add_argument_group("model sampling and CFG (ComfyUI's ModelSampling* and CFGNorm nodes)")
    sampling.add_argument("--sampling", choices=list(SAMPLING_NODES),
                          help="the sampling node the workflow uses (aura_flow: ModelSamplingAuraFlow, as the "
                               "Qwen-Image templates; default: none, the model's own)")
    sampling.add_argument("--shift", type=types.finite_float, help="that node's shift (e.g. 3.1; needs --sampling)")
    sampling.add_argument("--cfg-norm", type=types.request_field("cfg_norm", types.finite_float), default=0.0,
                          metavar="STRENGTH", help="ComfyUI's CFGNorm at this strength (the Qwen-Image edit "
                                                   "template's 1.0; default 0: not applied)")
    sampling.add_argument("--reference-method", choices=["index", "offset", "uxo"],
                          help="how the cond file's reference latents are placed (default: the family's; "
                               "FluxKontextMultiReferenceLatentMethod's choices)")
    p.add_argument("--lora", type=types.lora, action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="apply a LoRA (kohya, ComfyUI/ai-toolkit or diffusers format); repeat to chain")
    p.set_defaults(run=run, parser=p)


def _read(path: str, flag: str, names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of `names` the file holds (only those are read: a model file given by mistake is not loaded),
    and every tensor name in it."""
    try:
        tensors, _ = read_header(path)  # names the file and what is wrong with it (not safetensors, truncated, ...)
    except ValueError as e:
        raise UsageError(f"argument {flag}: {e}") from None
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in names if k in tensors}, sorted(tensors)


def _some(names: list[str], shown: int = 2) -> str:
    """A few of a file's tensor names, for a message that stays one short line."""
    listed = ", ".join(repr(n) for n in names[:shown])
    return f"{len(names)} tensor(s): {listed}" + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def _given_degrees(a) -> list[str]:
    return [f"--{n}" for n in DEGREES if getattr(a, n) is not None] + (["--cfg-parallel"] if a.cfg_parallel else [])


def _shard_only(a) -> bool:
    """--shard without another degree (nor --plan explicit): the user said how to divide the weights, and auto
    chooses the other degrees for the ranks (_shard_plan)."""
    return _given_degrees(a) == ["--shard"] and a.plan != "explicit"


def _plan(a) -> ParallelPlan | str:
    given = _given_degrees(a)
    if a.plan in (AUTO, FASTEST) and given and not _shard_only(a):
        raise UsageError(f"argument --plan: {a.plan} cannot be combined with {', '.join(given)}: drop --plan {a.plan} "
                         f"for the explicit plan those flags give, or drop them to let {a.plan} choose")
    if _shard_only(a) or (not given and a.plan != "explicit"):
        return a.plan or AUTO
    try:
        return ParallelPlan(cfg=2 if a.cfg_parallel else 1, **{n: getattr(a, n) or 1 for n in DEGREES})
    except PlanError as e:   # a shard degree the other degrees' ranks do not divide
        raise UsageError(f"argument --shard: {e}") from None


def _latent(a, info) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LATENT's samples and noise mask (None without one)."""
    if a.frames is not None:
        try:
            check_frames(info, a.frames)
        except ValueError as e:
            raise UsageError(f"argument --frames: {e}") from None
    if a.latent is None:
        if a.denoise < 1:
            raise UsageError(f"argument --denoise: {a.denoise} needs an input --latent to denoise from (img2img)")
        return empty_latent(info, a.width or 1024, a.height or 1024, a.batch or 1, a.frames or 1), None
    found, names = _read(a.latent, "--latent", ("samples", "noise_mask"))
    samples = found.get("samples")
    if samples is None:
        raise UsageError(f"argument --latent: {a.latent} has no 'samples' tensor (it has {_some(names)}): give a "
                         f"ComfyUI LATENT file")
    video = samples.ndim == 5 and info.spec.frames
    if video and a.frames is not None and info.latent.latent_frames(a.frames) != samples.shape[2]:
        raise UsageError(f"argument --frames: {a.frames} frames make {info.latent.latent_frames(a.frames)} latent "
                         f"frames but --latent has {samples.shape[2]}: leave out --frames or match the latent")
    if samples.ndim == 4 or video:  # other shapes: request.validate names what the model takes
        d = info.latent.downscale   # image pixels per latent pixel: 8, or 16 for FLUX.2
        size = (samples.shape[-1] * d, samples.shape[-2] * d)
        if (a.width or size[0], a.height or size[1]) != size:
            raise UsageError(f"argument --latent: {a.latent} is {size[0]}x{size[1]} px but --width/--height say "
                             f"{a.width or size[0]}x{a.height or size[1]}: leave them out or match the latent")
        if a.batch not in (None, samples.shape[0]):
            raise UsageError(f"argument --batch: {a.batch} does not match --latent's batch of {samples.shape[0]}: "
                             f"leave out --batch")
    mask = found.get("noise_mask")
    return samples.float(), (mask.float() if mask is not None and mask.is_floating_point() else mask)


def build_request(a) -> GenerateRequest:
    """The request the flags describe (not yet validated). Raises UsageError for a bad input file."""
    try:
        info = inspect_model(a.model)
    except ValueError as e:   # CheckpointError: the model file is not one the engine reads
        raise UsageError(f"argument --model: {e}") from None
    if info.spec.packed_streams:
        raise UsageError(f"argument --model: {a.model} is {info.spec.title}, which samples audio and video together; "
                         f"generate runs the engine's own loop, which samples one latent: run it in ComfyUI (its "
                         f"KSampler on the xDiT Engine's MODEL), or plan it with `python -m engine plan`")
    cond, names = _read(a.cond, "--cond", ("cond", "pooled", "neg_cond", "neg_pooled") + IMAGE_KEYS
                        + tuple("neg_" + k for k in IMAGE_KEYS))
    refs = {side: [n for n in names if n.startswith(side) and n[len(side):].isdigit()] for side in ("ref_", "neg_ref_")}
    for listed in refs.values():
        listed.sort(key=lambda n: int(n.rsplit("_", 1)[1]))
    found, _ = _read(a.cond, "--cond", tuple(refs["ref_"] + refs["neg_ref_"]))
    pooled = info.spec.pooled_width(info.config) is not None
    missing = [k for k in ("cond",) + (("pooled",) if pooled else ()) if k not in cond]
    if missing:
        raise UsageError(f"argument --cond: {a.cond} has no {' or '.join(map(repr, missing))} tensor (it has "
                         f"{_some(names)}): it needs cond{' and pooled' if pooled else ''}, and neg_cond"
                         f"{' and neg_pooled' if pooled else ''} for cfg != 1")
    latent, noise_mask = _latent(a, info)
    images = {k: cond.get(k) for k in IMAGE_KEYS + tuple("neg_" + k for k in IMAGE_KEYS)}
    return GenerateRequest(model=a.model, cond=cond["cond"], pooled=cond.get("pooled"), latent_raw=latent,
                           noise_mask=noise_mask, **images,
                           seed=a.seed, steps=a.steps, cfg=a.cfg, sampler=a.sampler, scheduler=a.scheduler,
                           denoise=a.denoise, neg_cond=cond.get("neg_cond"), neg_pooled=cond.get("neg_pooled"),
                           guidance=a.guidance, dtype=a.dtype or default_dtype("cuda" if a.gpus else "cpu"),
                           plan=_plan(a), loras=a.lora,
                           cache_threshold=a.cache_threshold or 0.0, compile=a.compile, attention=a.attention,
                           fp8_weights=a.fp8_weights, fp8_matmul=a.fp8_matmul, patches=a.patches,
                           warmup_steps=a.warmup_steps, stage_blocks=a.stage_blocks,
                           reference_latents=[found[n] for n in refs["ref_"]] or None,
                           neg_reference_latents=[found[n] for n in refs["neg_ref_"]] or None,
                           reference_latents_method=a.reference_method or "",
                           neg_reference_latents_method=a.reference_method or "",
                           model_sampling=_sampling(a), cfg_norm=a.cfg_norm)


def _sampling(a) -> dict | None:
    """--sampling/--shift as the request's model sampling (None: the family's default)."""
    if a.sampling is None:
        if a.shift is not None:
            raise UsageError(f"argument --shift: {a.shift:g} needs --sampling (one of {', '.join(SAMPLING_NODES)}) "
                             f"to say which sampling node it is the shift of")
        return None
    if a.shift is None:
        raise UsageError(f"argument --sampling: {a.sampling} needs --shift (e.g. 3.1 for the Qwen-Image "
                         f"template's aura_flow)")
    try:
        return FlowSampling.node(a.sampling, a.shift).as_dict()
    except ValueError as e:
        raise UsageError(f"argument --shift: {e}") from None


def machine_of(a, ranks: int) -> Machine:
    """This machine's stored measurements for the job's ranks (runtime/machine.py)."""
    return Machine("cuda" if a.gpus else "cpu", ranks, a.gpus)


def prepare(a):
    """(request, ranks, PlanChoice): every check that needs no rank, the plan resolved. Raises UsageError."""
    if not a.gpus and a.attention in CUDA_ONLY:
        raise UsageError(f"argument --attention: {a.attention} needs --gpus (a CUDA kernel); on CPU ranks use auto "
                         f"or math")
    if not a.gpus and a.fp8_matmul and a.fp8_weights:
        raise UsageError("argument --fp8-matmul: needs --gpus (fp8 tensor cores, compute capability 8.9+); on CPU "
                         "ranks leave it out (--fp8-weights alone works)")
    request = build_request(a)
    explicit = isinstance(request.plan, ParallelPlan)
    if explicit and not a.ranks and request.plan.world_size > MAX_RANKS:   # the degree flags alone give the ranks
        raise UsageError(f"the degree flags give plan {request.plan.describe()}, which needs "
                         f"{request.plan.world_size} ranks: the engine runs 1 to {MAX_RANKS}; lower the degrees")
    ranks = a.ranks or (request.plan.world_size if explicit else len(a.gpus) if a.gpus else
                        a.shard if _shard_only(a) else 1)
    if a.gpus and len(a.gpus) != ranks:
        raise UsageError(f"argument --gpus: {','.join(map(str, a.gpus))} names {len(a.gpus)} GPUs for {ranks} "
                         f"ranks: give one GPU per rank")
    request = validated(a, request, ranks, machine_of(a, ranks).hardware())
    return request, ranks, request.choice


def validated(a, request: GenerateRequest, ranks: int, hardware) -> GenerateRequest:
    """request.validate, the plan chosen first where only --shard was given; raises UsageError."""
    try:
        if not _shard_only(a):
            return request.validate(ranks, hardware)
        plan = _shard_plan(request, a.shard, ranks, hardware)
        request = replace(request, plan=plan).validate(ranks, hardware)
    except ValueError as e:  # PlanError, CheckpointError, a tensor of the wrong shape ...
        raise UsageError(str(e)) from None
    why = request.choice.reason.split(": ", 1)[-1]
    return replace(request, choice=replace(request.choice, reason=f"auto chose {plan.describe()} for {ranks} rank(s) "
                                                                  f"with the weights divided {a.shard} ways (--shard "
                                                                  f"{a.shard}): {why}"))


def _shard_plan(request: GenerateRequest, shard: int, ranks: int, hardware) -> ParallelPlan:
    """The plan auto would run on `ranks` ranks among those dividing the weights `shard` ways: on CPU ranks the one
    that sends least (as auto there), else the cost model's first (cost.rank, auto's rule on one rank count)."""
    work = request.workload(inspect_model(request.model))
    plans = [p for p in feasible(ranks, work) if p.shard == shard]
    if not plans:
        divisors = [d for d in range(2, ranks + 1) if any(p.shard == d for p in feasible(ranks, work))]
        works = f"give --shard {' or '.join(map(str, divisors))}" if divisors else "give no --shard"
        raise UsageError(f"argument --shard: {shard} on {ranks} rank(s): no plan of {ranks} rank(s) runs this job with "
                         f"the weights divided {shard} ways (a shard degree divides the ranks): {works}, or set "
                         f"--ranks")
    if hardware.device == "cpu" and not (hardware.measured is not None and hardware.measured.covers(work, ranks)):
        return min(plans, key=lambda p: sum(cost.comm_bytes(p, work).values()))
    return cost.rank([cost.estimate(p, work, hardware) for p in plans])[0].plan


class Progress:
    """The engine's on_progress: "\\rstep 3/20" in place on a terminal, whole lines "step 3/20" otherwise."""

    def __init__(self):
        self.tty = sys.stdout.isatty()
        self.pending = False

    def __call__(self, step: int, total: int) -> None:
        print(f"\rstep {step}/{total}" if self.tty else f"step {step}/{total}", end="" if self.tty else "\n",
              flush=True)
        self.pending = self.tty

    def close(self) -> None:
        if self.pending:
            print()
            self.pending = False


def oversubscribed(ranks: int, gpus) -> str | None:
    """A note when CPU ranks outnumber the cores this process may use: the job runs, but slower than on fewer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if gpus or ranks <= cores:
        return None
    return (f"note: {ranks} CPU ranks share {cores} core(s), so each gets a fraction of one and the job runs slower "
            f"than on {cores} rank(s); CPU ranks are for checks, GPUs for speed")


def run(a) -> int:
    request, ranks, choice = prepare(a)
    note = oversubscribed(ranks, a.gpus)
    if note:
        print(f"{a.parser.prog}: {note}", file=sys.stderr, flush=True)
    print(choice.reason, flush=True)
    progress = Progress()
    t0 = time.perf_counter()
    machine = machine_of(a, ranks)
    view = machine.view()
    with Engine(ranks, device="cuda" if a.gpus else "cpu", gpus=a.gpus) as engine:
        t_start = time.perf_counter() - t0
        fresh = machine.ensure(engine, request, view)
        if fresh is not None:   # first start here (or a new model): measured, so planned again
            view = fresh
            print(f"measured this machine ({machine.setup}) in {fresh.measured.figures.get('calibrate_s', 0):.1f} s: "
                  f"{'; '.join(fresh.measured.summary())}; stored in {machine.path}", flush=True)
            request = validated(a, build_request(a), ranks, view.hardware)
            print(request.choice.reason, flush=True)
        try:
            result = request.submit(engine, on_progress=progress)
        finally:
            progress.close()
    machine.record_job(request, result, view)
    samples = result.outputs["samples"]
    written = output.write(a.out, save({"samples": samples.contiguous()}))   # keeps the result if it cannot
    model = result.ranks[0].get("model", {})
    print(f"wrote {written}: samples {list(samples.shape)} {samples.dtype} ({model.get('variant')}, "
          f"{model.get('layout')} layout, {request.dtype})")
    print(f"plan {request.plan.describe()} on {ranks} rank(s); engine start {t_start:.2f} s; "
          + ", ".join(f"{k} {v:.3f} s" for k, v in result.timings.items()))
    stages = sorted((r["pipefusion"] for r in result.ranks if r.get("pipefusion")), key=lambda p: p["stage"])
    if stages:
        first = stages[0]
        print(f"pipefusion: {len(first['stage_blocks'])} stages of {first['stage_blocks']} blocks, {first['patches']} "
              f"patches, {first['warmup_steps']} warmup step(s); weights held per stage rank: "
              + ", ".join(f"{p['held_bytes'] / 2**20:.1f} MiB" for p in {p['stage']: p for p in stages}.values()))
    cache = result.ranks[0].get("step_cache")
    if cache:
        print(f"step cache: skipped {cache['skipped_calls']} of {cache['model_calls']} model calls "
              f"(threshold {request.cache_threshold})")
    sent = result.ranks[0].get("bytes_sent_per_step")
    if sent:
        print("rank 0 sent per step: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sent.items()))
    return 0
