"""The planner's cost model: for one plan, workload and hardware, the time of a whole denoising job per image and the
memory each GPU needs, from FLOPs, bytes, launches and a few fitted constants.

Per rank and per step (one model call of the whole batch, both passes when cfg != 1):
  compute = the rank's FLOPs at the GPU's one-GPU rate, slowed as the rank's matrix products shrink (`gemm_slowdown`);
  comm    = each collective's real call count x latency + bytes / bandwidth, less what the code overlaps (`Code`);
  host    = eager PyTorch launches every op from Python, so a step takes at least the launches (`host_ms`); with
            several ranks the GPU work shrinks and the launches do not;
  step    = max(host, compute + comm).
A job = warmup steps + steady steps + PipeFusion's pipeline fill (+ a clip's expert copies when the idle one of several
experts waits in host memory); / batch = seconds per image (transformer only).

The one-GPU rate is this engine's measured step (calibration.json) when the GPU has one, else rated x the efficiency
table (devices.EFFICIENCY, with its sources); the validation against published runs gives the published one-GPU
step instead (`estimate(one_gpu_ms=...)`). Constants fitted to published runs are named with the run that set them;
published.fit_constants re-derives them and published.validation_table prints every published row against the model
with its residual, the rows not used for fitting marked held out. The model is coarse (FLOPs and bytes, not
kernels), good to perhaps 10-20%: `TIE` is how close two estimates must be for the planner to call them equal.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from . import calibration
from .devices import Hardware, Interconnect, efficiency, host_link_gbs
from .memory import host_gib_per_machine, memory_gib, stage_memory_gib
from .pipefusion.layout import analytic_p2p_bytes
from .plan import (DTYPE_BYTES, HOST, RESIDENT, ParallelPlan, Workload, items_per_rank, joint_text, shard_tokens,
                   text_split)

FP32_SLOWDOWN = 8        # fp32 matmuls leave the bf16 tensor path: 1/15 of bf16 on H100, 1/2 on GeForce cards
TIE = 0.10               # estimates within 10% of the fastest are a tie: the plan that sends less wins, then the
                         # simpler one; and across rank counts, the fewer GPUs
DUAL_WIDTH = 4           # SD3.5-medium's second, image-only attention: qkv 3 + out 1

# ---- what the code overlaps and how many calls it makes (change these when the code changes) ------------------
# Ring attention hides each K/V transfer behind the attention of the block in hand: attention.py's `_ring` posts the
# next hop before computing the current block (double buffering), so up to min(transfer, attention of r-1 blocks)
# hides: 1. Ulysses' all-to-alls are always exposed: the attention needs their output.
RING_OVERLAP = 1.0
# PipeFusion's stage-to-stage transfer of patch m+1 hides behind the compute of patch m: pipeline.py posts a step's
# receives ahead and waits on each in the device's stream order when it needs it: 1.
PIPEFUSION_OVERLAP = 1.0
ULYSSES_CALLS_PER_LAYER = 2   # all-to-alls per attention layer: q, k and v out in one, the output back (attention.py)


@dataclass(frozen=True)
class Code:
    """The parallel code whose time is estimated: what it overlaps and how many calls it makes. `engine_code()` is
    this engine's (read at call time, so a test may change RING_OVERLAP); XDIT is the code that produced the
    published runs the model is checked against."""
    name: str
    ring_overlap: float          # share of a ring hop's transfer hidden behind the attention of the block in hand
    pipefusion_overlap: float    # share of a patch's stage-to-stage transfer hidden behind the next patch's compute
    ulysses_calls_per_layer: int


def engine_code() -> Code:
    return Code("this engine", RING_OVERLAP, PIPEFUSION_OVERLAP, ULYSSES_CALLS_PER_LAYER)


# yunchang's ring (xDiT's) posts the next hop's send/recv before computing the current block and waits after it;
# xDiT's PipeFusion pre-posts its receives; its Ulysses exchanges q, k, v and the output: 4 all-to-alls a layer.
XDIT = Code("xDiT (yunchang ring with the next hop posted ahead, PipeFusion with receives posted ahead)", 1.0, 1.0, 4)

# ---- fitted constants (each names the published run that set it; published.fit_constants() re-derives them) ----
# A rank's matrix products run at rate / gemm_slowdown(work), work = GEMM rows x hidden width per model call (rows:
# the tokens of the call x the items of its batch): small products fill the GPU poorly. 1 + GEMM_HALF_WORK / work is
# 1.13 for a one-GPU FLUX.1-dev 1024^2 step and 1.53 at a quarter of its tokens. Set by xDiT's FLUX.1-dev compiled
# Ulysses-4 on 4xH100 (1.63 s against 4.30 s on one).
GEMM_HALF_WORK = 1.88e6
# Eager host time per transformer block and model call (ms): every op is launched from Python. Set by xDiT's
# SD3-medium cfg2 x pipefusion4 on 8xA100 (0.90 s: 4 patches x 6 blocks a step, launch-bound).
HOST_MS_BLOCK = 1.72
# Extra host time per block when the block is sequence parallel (the exchanges' reshapes and calls). Set by xDiT's
# FLUX.1-dev eager Ulysses-4 on 4xH100 (4.24 s: GPU work ~85 ms a step, the step ~150).
HOST_MS_SP = 0.94
# Extra host time per block with a ring (per-block log-sum-exp merges in eager fp32). Set by xDiT's FLUX.1-dev eager
# Ring-2 on 2xH100 (5.31 s).
HOST_MS_RING = 0.67
# torch.compile fuses elementwise chains: the host launches a share of the eager kernels. Set by xDiT's FLUX.1-dev
# compiled Ring-4 on 4xH100 (1.98 s: slower than Ulysses-4's 1.63 with less GPU work, so launch-bound).
COMPILED_HOST_SHARE = 0.37
# The rows the efficiency table's shares were measured at: a one-GPU FLUX.1-dev 1024^2 step (4096 + 512 tokens).
REFERENCE_GEMM_WORK = (4096 + 512) * 3072


# ---- what each method sends (the closed forms `bench comm` checks against the engine's own counts) -----------
def attention_bytes(image_tokens: int, text_tokens: int, heads: int, head_dim: int, layers: int, text_split: bool,
                    plan, batch: int, elem_bytes: int = 2) -> dict[str, int]:
    """Bytes one rank sends per model call in `layers` sequence-parallel attention layers, per collective kind
    (image tokens the degree does not divide travel padded to a multiple of it)."""
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
    image_tokens = shard_tokens(image_tokens, p) * p
    width = heads * head_dim * elem_bytes   # bytes per token per Q/K/V
    split = text_split and text_tokens % p == 0
    seq = image_tokens + (text_tokens if split else 0)
    a2a = text = ring = 0
    if u > 1:  # Q, K, V out and O back, each keeping 1/U of the rank's S/R tokens
        a2a = 4 * batch * (seq // r) * width * (u - 1) // (u * u)
        if not split:  # the text output of this rank's heads, to every other Ulysses rank
            text = batch * text_tokens * (width // u) * (u - 1)
    if r > 1:  # K and V of this rank's block, passed on R-1 times
        ring = 2 * batch * (seq // p) * width * (r - 1)
    return {"ulysses_all_to_all": a2a * layers, "ulysses_text_gather": text * layers, "ring_p2p": ring * layers}


def pipefusion_attention_bytes(image_tokens: int, text_tokens: int, heads: int, head_dim: int, layers: int, plan,
                               batch: int, patches: int, elem_bytes: int = 2) -> dict[str, int]:
    """attention_bytes for a PipeFusion model call of `patches` patches (1: a warmup call on the whole latent). The
    text is joint (it travels with patch 0). Ulysses exchanges each patch's own tokens, which add up to the whole
    latent's; Ring's hops carry the layer's whole stale K/V share for every patch, since a patch's queries attend to
    every patch's keys and a rank keeps only its own share of them: `patches` times a whole call's ring bytes."""
    kinds = attention_bytes(image_tokens, text_tokens, heads, head_dim, layers, False, plan, batch, elem_bytes)
    kinds["ring_p2p"] *= patches
    return kinds


def sp_gather_bytes(image_tokens: int, out_features: int, plan, batch: int, elem_bytes: int = 2) -> int:
    """The velocity tokens each sequence-parallel rank sends to the others after the model's output projection."""
    p = plan.ulysses * plan.ring
    return (p - 1) * batch * shard_tokens(image_tokens, p) * out_features * elem_bytes


def patches(plan, work) -> int:
    """PipeFusion's patches per model call (1 without PipeFusion): the job's, else one per stage."""
    return (work.patches or plan.pipefusion) if plan.pipefusion > 1 else 1


def pipefusion_step_bytes(plan, work) -> int:
    """What a PipeFusion stage before the last sends per steady step: each patch's header and its share of the
    activations (pipefusion.layout.analytic_p2p_bytes, per model call after the warmup)."""
    shape = dict(stages=plan.pipefusion, image_tokens=work.image_tokens, text_tokens=work.text_tokens,
                 hidden=work.heads * work.head_dim, batch=items_per_rank(plan, work), latent=(16, 1, 1),
                 patches=patches(plan, work), act_bytes=DTYPE_BYTES[work.dtype], warm_calls=1,
                 sp=plan.ulysses * plan.ring)
    return analytic_p2p_bytes(0, calls=2, **shape) - analytic_p2p_bytes(0, calls=1, **shape)


def comm_bytes(plan, work) -> dict[str, int]:
    """Bytes one rank sends per step, per collective kind."""
    items, elem = items_per_rank(plan, work), DTYPE_BYTES[work.dtype]
    if plan.pipefusion > 1:   # a steady step's patches
        m = patches(plan, work)
        kinds = pipefusion_attention_bytes(work.image_tokens, joint_text(work), work.heads, work.head_dim,
                                           work.layers, plan, items, m, elem)
        dual = pipefusion_attention_bytes(work.image_tokens, 0, work.heads, work.head_dim, work.dual_layers, plan,
                                          items, m, elem)
    else:
        kinds = attention_bytes(work.image_tokens, joint_text(work), work.heads, work.head_dim, work.layers,
                                work.text_splits, plan, items, elem)
        # SD3.5-medium's image-only attention goes through the same entry point
        dual = attention_bytes(work.image_tokens, 0, work.heads, work.head_dim, work.dual_layers, False, plan, items,
                               elem)
    kinds = {k: v + dual[k] for k, v in kinds.items()}
    if plan.pipefusion > 1:   # a stage's sequence-parallel group runs only its share of the layers
        kinds = {k: v // plan.pipefusion for k, v in kinds.items()}
    kinds["sp_gather"] = sp_gather_bytes(work.image_tokens, work.out_features, plan, items, elem)
    velocity = items * work.image_tokens * work.out_features * 4   # fp32, gathered so every rank holds the batch
    kinds["cfg_gather"] = velocity if plan.cfg == 2 else 0
    kinds["dp_gather"] = (plan.dp - 1) * velocity
    if plan.pipefusion > 1:
        kinds["pipefusion_p2p"] = pipefusion_step_bytes(plan, work)
    return kinds


# ---- compute -------------------------------------------------------------------------------------------------
def rank_flops(plan, work) -> tuple[float, float]:
    """(all, attention) FLOPs of one rank's model call. Linear layers: 2 x weights x tokens; attention: 4 x
    queries x keys x width. Text tokens held by every rank (joint) are computed by every rank. Image tokens the
    degree does not divide are padded to a multiple of it: the pad rows are computed as tokens and queries, not as
    keys."""
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
    hidden = work.heads * work.head_dim
    split = text_split(plan, work)
    n_img, n_txt = work.image_tokens, joint_text(work)
    n_pad = shard_tokens(n_img, p) * p   # image tokens padded
    tokens = n_pad / p + (n_txt / p if split else n_txt)
    queries = n_pad / r + (n_txt / r if split else n_txt)   # after Ulysses' exchange: S/R tokens, H/U heads
    attention = 4 * queries * (n_img + n_txt) * hidden / u * work.layers
    attention += 4 * (n_pad / r) * n_img * hidden / u * work.dual_layers
    linear = 2 * hidden * hidden * (work.linear_width * tokens * work.layers
                                    + DUAL_WIDTH * n_pad / p * work.dual_layers)
    if work.text_cross:   # the rank's queries, every head, against the whole text; the text's K and V per block
        attention += 4 * (n_pad / p) * work.text_tokens * hidden * work.layers
        linear += 2 * hidden * hidden * 2 * work.text_tokens * work.layers
    items = items_per_rank(plan, work)
    stages = plan.pipefusion   # each stage runs its share of the blocks; pipelined, the stages work at once
    return items * (linear + attention) / stages, items * attention / stages


def gemm_work(plan, work) -> float:
    """Rows x hidden width of one rank's matrix products per model call (per patch under PipeFusion)."""
    p = plan.ulysses * plan.ring
    split = text_split(plan, work)
    tokens = shard_tokens(work.image_tokens, p) + (joint_text(work) / p if split else joint_text(work))
    return items_per_rank(plan, work) * tokens / patches(plan, work) * work.heads * work.head_dim


def gemm_slowdown(work_size: float) -> float:
    return 1 + GEMM_HALF_WORK / work_size


def step_tflop(work: Workload) -> float:
    """TFLOP of one denoising step on one GPU (FLUX.1-dev at 1024^2: 74.4; SD3-medium with cfg: 17.8)."""
    return rank_flops(ParallelPlan(), work)[0] / 1e12


def rate_tflops(hw: Hardware, work, one_gpu_ms: float | None = None) -> tuple[float, str]:
    """The GPU's rate on large matrix products (TFLOP/s, before gemm_slowdown) and where it comes from: a one-GPU step
    given (`one_gpu_ms`), this engine's measured calibration, else rated x the efficiency table."""
    one = ParallelPlan()
    measured = hw.measured.rate(work) if hw.measured is not None and one_gpu_ms is None else None
    if measured:   # this machine's devices, measured at this model's widths (parallel/measured.py)
        return measured
    if one_gpu_ms is not None:
        flops = rank_flops(one, work)[0]
        return flops / one_gpu_ms / 1e9 * gemm_slowdown(gemm_work(one, work)), \
            f"one GPU {one_gpu_ms:.1f} ms/step given"
    entry = calibration.measured(hw.gpu_name, "compiled" if work.compiled else "eager", model=work.variant)
    if entry:
        w = entry["workload"]
        rate = entry["tflop_per_step"] / entry["ms_per_step"] * 1e3 * gemm_slowdown(_calibrated_work(w))
        source = f"measured on {w['model']} {w['width']}x{w['height']} {w['dtype']} {w['mode']}"
    else:
        share, where = efficiency(hw.gpu, work.compiled)
        rate = hw.rated_tflops * share * gemm_slowdown(REFERENCE_GEMM_WORK)
        source = f"rated {hw.rated_tflops:g} x {share:.3f} ({where})"
    if work.dtype == "fp32":
        return rate / FP32_SLOWDOWN, source + f", fp32 at 1/{FP32_SLOWDOWN}"
    return rate, source


@functools.lru_cache(maxsize=32)
def _calibrated_work_cached(model: str, width: int, height: int, batch: int, cfg: float) -> float:
    return gemm_work(ParallelPlan(), Workload.for_variant(model, width, height, batch=batch, negative_pass=cfg != 1))


def _calibrated_work(w: dict) -> float:
    """The GEMM work of a calibration entry's one-GPU step (its model at its size; FLUX.1-dev 1024^2's when the
    entry names a model the planner does not know)."""
    try:
        return _calibrated_work_cached(w["model"], int(w["width"]), int(w["height"]), int(w.get("batch", 1)),
                                       float(w.get("cfg", 1.0)))
    except (ValueError, KeyError):
        return REFERENCE_GEMM_WORK


def throughput_tflops(hw: Hardware, work) -> tuple[float, str]:
    """Effective TFLOP/s of one GPU running this whole workload (its one-GPU matrix sizes), and where it comes from."""
    rate, source = rate_tflops(hw, work)
    return rate / gemm_slowdown(gemm_work(ParallelPlan(), work)), source


def compute_ms(plan, work, rate: float) -> tuple[float, float]:
    """(all, attention) GPU milliseconds of one rank's step at `rate` (rate_tflops)."""
    flops, attention = rank_flops(plan, work)
    per_flop = gemm_slowdown(gemm_work(plan, work)) / rate / 1e9
    return flops * per_flop, attention * per_flop


def host_ms(plan, work) -> float:
    """The host's launch time of one rank's step: blocks run x per-block launches (more with sequence parallel,
    more with a ring), COMPILED_HOST_SHARE of it compiled. PipeFusion runs its stage's blocks once per patch."""
    per_block = HOST_MS_BLOCK + (HOST_MS_SP if plan.ulysses * plan.ring > 1 else 0) + (
        HOST_MS_RING if plan.ring > 1 else 0)
    runs = work.layers / plan.pipefusion * patches(plan, work)
    return runs * per_block * (COMPILED_HOST_SHARE if work.compiled else 1.0)


# ---- communication time ---------------------------------------------------------------------------------------
def comm_ms(plan, work, link: Interconnect, attention_ms: float, code: Code | None = None,
            compute: float = 0.0) -> float:
    """Communication left on the critical path: each collective's calls x latency + bytes / bandwidth, less what the
    code overlaps. attention_ms and compute: the rank's attention and whole step on the GPU (what can hide it)."""
    code = code or engine_code()
    kinds = comm_bytes(plan, work)
    u, r = plan.ulysses, plan.ring
    m = patches(plan, work)
    attention_layers = (work.layers + work.dual_layers) / plan.pipefusion * m   # layer runs a step, on this rank
    latency = link.latency_us / 1e3
    # a measured link (parallel/measured.py) times point-to-point messages apart from collectives: gloo's differ ten-fold
    p2p_latency = (getattr(link, "p2p_latency_us", None) or link.latency_us) / 1e3

    def over(nbytes: float, gbs: float) -> float:
        return nbytes / (gbs * 1e9) * 1e3

    ms = 0.0
    if u > 1:
        ms += over(kinds["ulysses_all_to_all"], link.all_to_all_gbs(u)) + over(kinds["ulysses_text_gather"],
                                                                              link.bandwidth_gbs)
        calls = code.ulysses_calls_per_layer * attention_layers
        calls += 0 if text_split(plan, work) or work.text_cross else work.layers / plan.pipefusion * m
        ms += calls * latency
    if r > 1:
        ring = over(kinds["ring_p2p"], link.bandwidth_gbs)
        ms += ring - code.ring_overlap * min(ring, attention_ms * (r - 1) / r)
        ms += (r - 1) * attention_layers * p2p_latency
    for kind in ("sp_gather", "cfg_gather", "dp_gather"):
        if kinds[kind]:
            ms += over(kinds[kind], link.bandwidth_gbs) + latency
    if plan.pipefusion > 1:
        p2p = over(kinds["pipefusion_p2p"], link.bandwidth_gbs)
        ms += p2p - code.pipefusion_overlap * min(p2p, compute) + m * p2p_latency
    return ms


# ---- one plan -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    plan: object             # ParallelPlan
    compute_ms: float        # GPU work of a steady step
    comm_ms: float           # exposed communication of a steady step
    comm_bytes: int          # what one GPU sends per step
    memory: dict             # GiB: weights, activations, runtime, total (the fullest stage under PipeFusion)
    fits: bool
    host_ms: float = 0.0     # the host's launch time of a step
    exact: bool = True       # the result equals one GPU's (PipeFusion: only with warmup = steps)
    job_ms: float = 0.0      # the whole job: warmup steps, steady steps, pipeline fill, expert copies
    steps: int = 1
    batch: int = 1
    placement: str = ""      # a clip of several experts: RESIDENT (all on every GPU) or HOST (the idle one in host
    #                          memory); "" for one model
    swap_ms: float = 0.0     # HOST: the experts' copies between host and GPU memory per clip
    host_gib: float = 0.0    # HOST: host memory the idle experts take per machine

    @property
    def step_ms(self) -> float:
        """A steady step: the GPU's work and exposed communication, or the host's launches when they take longer."""
        return max(self.host_ms, self.compute_ms + self.comm_ms)

    @property
    def s_per_image(self) -> float:
        return self.job_ms / 1e3 / self.batch

    @property
    def ranks(self) -> int:
        return self.plan.world_size


def _steady(plan, work, hw: Hardware, rate: float, code: Code) -> tuple[float, float, float]:
    """(compute, exposed comm, host) ms of one steady step. Measured compute (parallel/measured.py) replaces the
    modelled where there is one; on CPU ranks it holds the host's own work, which the GPU launch model does not."""
    measured = hw.measured.compute_ms(plan, work) if hw.measured is not None else None
    compute, attention = measured or compute_ms(plan, work, rate)
    host = 0.0 if measured and hw.device == "cpu" else host_ms(plan, work)
    return compute, comm_ms(plan, work, hw.link, attention, code, compute), host


def estimate(plan, work, hw: Hardware, *, code: Code | None = None, one_gpu_ms: float | None = None) -> Estimate:
    """The cost model's estimate of `plan` running `work` on `hw` (its own world size of hw's GPUs). code: the
    parallel code (default this engine's); one_gpu_ms: a one-GPU step of this workload to take the rate from."""
    code = code or engine_code()
    rate, _ = rate_tflops(hw, work, one_gpu_ms)
    compute, comm, host = _steady(plan, work, hw, rate, code)
    step = max(host, compute + comm)
    steps = max(1, work.steps)
    placement, memory = expert_placement(plan, work, hw.memory_gib)
    fits = hw.memory_gib is None or memory["total"] <= hw.memory_gib
    exact, job = True, steps * step
    swap = swap_ms(work, hw) if placement == HOST else 0.0
    if plan.pipefusion > 1:
        stage_gib, fits = stage_memory_gib(plan, work, hw.memory_gib)
        memory = dict(memory, total=max(stage_gib), stages=stage_gib)
        warm = min(work.warmup_steps, steps)
        exact = warm >= steps
        # a warmup step runs the whole latent through the stages in turn: the plan without PipeFusion, plus the
        # activations handed from stage to stage
        whole = type(plan)(dp=plan.dp, cfg=plan.cfg, ulysses=plan.ulysses, ring=plan.ring)
        w_compute, w_comm, w_host = _steady(whole, work, hw, rate, code)
        hop = pipefusion_step_bytes(plan, work) / (hw.link.bandwidth_gbs * 1e9) * 1e3 + hw.link.latency_us / 1e3
        warm_ms = max(w_host, w_compute + w_comm) + (plan.pipefusion - 1) * hop
        fill = (plan.pipefusion - 1) / patches(plan, work) * step if steps > warm else 0.0
        job = warm * warm_ms + (steps - warm) * step + fill
    return Estimate(plan=plan, compute_ms=compute, comm_ms=comm, comm_bytes=sum(comm_bytes(plan, work).values()),
                    memory=memory, fits=fits, host_ms=host, exact=exact, job_ms=job + swap, steps=steps,
                    batch=work.batch, placement=placement, swap_ms=swap,
                    host_gib=host_gib_per_machine(plan, work) if placement == HOST else 0.0)


# ---- a clip of several experts ------------------------------------------------------------------------------------
def expert_placement(plan, work, memory_gib_limit: float | None) -> tuple[str, dict]:
    """Where a clip's idle expert waits under `plan`, and the memory per GPU that takes: the workload's placement when
    it names one; else both resident when they fit `memory_gib_limit` (no copies), else the idle one in host memory.
    ("", the model's memory) for one model."""
    if work.experts < 2:
        return "", memory_gib(plan, work)
    if work.placement != "auto":
        return work.placement, memory_gib(plan, work, work.placement)
    resident = memory_gib(plan, work, RESIDENT)
    if memory_gib_limit is None or resident["total"] <= memory_gib_limit:
        return RESIDENT, resident
    return HOST, memory_gib(plan, work, HOST)


def swap_ms(work, hw: Hardware) -> float:
    """HOST placement, per clip after the first (which reads the files): each expert is copied to the GPU once and
    back out once (the first expert returns at the clip's start while the last one leaves, the second replaces the
    first at the switch), every rank over its own link at the host-to-device rate (devices.host_link_gbs)."""
    return work.experts * 2 * work.weight_bytes / (host_link_gbs(hw.gpu) * 1e9) * 1e3


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Best first: among the plans that fit, those within TIE of the fastest job are equal and the one that sends
    least wins (then the earliest in the given order); the rest follow by estimated job time, misfits last."""
    order = {id(e): i for i, e in enumerate(estimates)}
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return sorted(estimates, key=lambda e: e.memory["total"])
    fastest = min(e.job_ms for e in fitting)
    best = min((e for e in fitting if e.job_ms <= fastest * (1 + TIE)), key=lambda e: (e.comm_bytes, order[id(e)]))
    rest = sorted((e for e in estimates if e is not best), key=lambda e: (not e.fits, e.job_ms, order[id(e)]))
    return [best] + rest
