"""The planner's cost model: for one plan, workload and hardware, the time of a whole denoising job per image and the
memory each GPU needs, from FLOPs, bytes and counted launches, with a few fitted constants.

Per rank and per step (one model call of the whole batch, both passes when cfg != 1):
  compute = the rank's matrix products at the GPU's large-matrix rate, slowed as they shrink (`gemm_slowdown`), plus
            each attention call at a kernel efficiency that falls with short query and key blocks
            (`attention_efficiency`): a ring of r runs r calls a layer on key blocks of 1/r;
  comm    = each collective's real call count x the link's latency + bytes / bandwidth, less what the code overlaps
            (`Code`); an all-to-all across the CPU loses throughput to its concurrent flows (devices.Interconnect);
  host    = eager PyTorch launches every operation from Python: the operations counted per block (launches.py) and
            per sequence-parallel layer and ring hop (`Code`), at LAUNCH_US each; with several ranks the GPU work
            shrinks and the launches do not; torch.compile leaves COMPILED_LAUNCH_SHARE of the blocks' launches, and
            of the communication's only where the code's collectives trace into its graphs (Code.compiled_sp);
            a ring's merges stream the layer's output at the GPU's memory bandwidth (`merge_ms`);
  step    = max(host, compute + comm).
A job = warmup steps + steady steps + PipeFusion's pipeline fill (+ a clip's expert copies when the idle one of several
experts waits in host memory); / batch = seconds per image (transformer only).

The large-matrix rate comes from a one-GPU step: this engine's measured step (calibration.json) when the GPU has one,
else rated x the efficiency table (devices.EFFICIENCY, with its sources); the validation against published runs gives
the published one-GPU step instead (`estimate(one_gpu_ms=...)`). Each rate is the one at which the model's one-GPU
step takes that time. The fitted constants are fitted together (least squares on the log of the time) to the
published rows that engine/published/images.py and video.py mark "fit", and judged on the others (images.py prints
every residual). `TIE` is how close two estimates must be for the planner to call them equal.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from . import calibration, launches
from .code import (MERGE_BYTES, PIPEFUSION_OVERLAP, RING_OVERLAP, SHARD_OVERLAP, SHARD_UNIT_US,  # noqa: F401
                   STREAM_SHARE, ULYSSES_CALLS_PER_LAYER, XDIT, XDIT_USP, Code, engine_code)
from .devices import Hardware, Interconnect, efficiency, memory_gbs
from .memory import expert_placement, host_gib_per_machine, memory_gib, stage_memory_gib, swap_ms  # noqa: F401
from .plan import HOST, ParallelPlan, Workload, items_per_rank, joint_text, shard_tokens, text_split
# what each method sends (traffic.py), read through this module too
from .traffic import (attention_bytes, comm_bytes, patches, pipefusion_attention_bytes,  # noqa: F401
                      pipefusion_step_bytes, sp_gather_bytes, sp_merge_bytes)

FP32_SLOWDOWN = 8        # fp32 matmuls leave the bf16 tensor path: 1/15 of bf16 on H100, 1/2 on GeForce cards
TIE = 0.10               # estimates within 10% of the fastest are a tie: the plan that sends less wins, then the
                         # simpler one; and across rank counts, the fewer GPUs
DUAL_WIDTH = 4           # SD3.5-medium's second, image-only attention: qkv 3 + out 1

# ---- fitted constants (fitting.fit_constants() re-derives them from the rows marked "fit") ----------------------------
# A rank's matrix products run at rate / gemm_slowdown(work), work = GEMM rows x hidden width per model call (rows:
# the tokens of the call x the items of its batch): small products fill the GPU poorly.
GEMM_HALF_WORK = 1.0e4
# An attention call runs at attention_efficiency(rows, keys) of the large-matrix rate: rows = the query rows the
# kernel spreads over the GPU (queries x heads x items), keys = the keys each query meets in this call; each factor
# saturates, x / (x + HALF). Rows: flash attention runs a 128-row query tile per SM at a time, so a call of one wave of
# tiles on a GPU of ~128 SMs (16384 rows) fills it half as well as a long call (not fitted). Keys: a tile's fixed work
# (loading its queries, the softmax's rescaling, writing its output and log-sum-exp) weighs on short key blocks
# (fitted).
ATTN_HALF_ROWS = 16384.0
ATTN_HALF_KEYS = 1024.0
# Host microseconds per launched operation in eager PyTorch (Python, the dispatcher, the CUDA launch).
LAUNCH_US = 13.6
# torch.compile fuses a block's elementwise chains: this share of its eager launches remains.
COMPILED_LAUNCH_SHARE = 0.448


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


def attention_efficiency(rows: float, keys: float) -> float:
    """The share of the large-matrix rate an attention call reaches: rows = query rows x heads x items the kernel
    spreads over the GPU, keys = the keys each query meets in the call."""
    return rows / (rows + ATTN_HALF_ROWS) * keys / (keys + ATTN_HALF_KEYS)


def attention_calls(plan, work) -> list[tuple[float, float, float, float]]:
    """One rank's attention calls per model call, as (calls, FLOPs each, query rows x heads x items, keys each):
    each joint layer once, or r times on key blocks of 1/r under a ring of r; PipeFusion's patches each run their
    stage's layers, a patch's queries against the whole latent's keys; SD3.5-medium's image-only attention; Wan's
    cross-attention to the text. FLOPs add up to rank_flops' attention."""
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
    split = text_split(plan, work)
    n_img, n_txt = work.image_tokens, joint_text(work)
    n_pad = shard_tokens(n_img, p) * p
    items, heads, m = items_per_rank(plan, work), work.heads / u, patches(plan, work)
    layers, dual = work.layers / plan.pipefusion, work.dual_layers / plan.pipefusion
    width = work.heads * work.head_dim / u

    def calls(count, queries, keys):
        queries /= m   # a patch's queries (the whole call's without PipeFusion)
        return (count * m * r, 4 * queries * keys / r * width * items, queries * heads * items, keys / r)
    out = [calls(layers, n_pad / r + (n_txt / r if split else n_txt), n_img + n_txt)]
    if dual:
        out.append(calls(dual, n_pad / r, n_img))
    if work.text_cross:   # the rank's queries, every head, against the whole text: one call a layer
        queries = n_pad / p / m
        out.append((layers * m, 4 * queries * work.text_tokens * work.heads * work.head_dim * items,
                    queries * work.heads * items, work.text_tokens))
    return out


def unit_ms(plan, work) -> tuple[float, float]:
    """(all, attention) milliseconds of one rank's step at a large-matrix rate of 1 TFLOP/s: the matrix products at
    gemm_slowdown of their size, each attention call at its attention_efficiency."""
    flops, attention = rank_flops(plan, work)
    linear = (flops - attention) * gemm_slowdown(gemm_work(plan, work)) / 1e9
    attn = sum(n * f / attention_efficiency(rows, keys) for n, f, rows, keys in attention_calls(plan, work)) / 1e9
    return linear + attn, attn


def step_tflop(work: Workload) -> float:
    """TFLOP of one denoising step on one GPU (FLUX.1-dev at 1024^2: 74.4; SD3-medium with cfg: 17.8)."""
    return rank_flops(ParallelPlan(), work)[0] / 1e12


@functools.lru_cache(maxsize=1)
def _reference_work() -> Workload:
    return Workload.for_variant("flux-dev", 1024, 1024)


def rate_tflops(hw: Hardware, work, one_gpu_ms: float | None = None) -> tuple[float, str]:
    """The GPU's large-matrix rate (TFLOP/s, before gemm_slowdown and attention_efficiency) and where it comes from:
    the rate at which the model's one-GPU step of `work` takes `one_gpu_ms` when given; else the rate at which this
    engine's measured calibration step takes its time; else the rate at which a one-GPU FLUX.1-dev 1024^2 step
    reaches rated x the efficiency table's share."""
    one = ParallelPlan()
    measured = hw.measured.rate(work) if hw.measured is not None and one_gpu_ms is None else None
    if measured:   # this machine's devices, measured at this model's widths (parallel/measured.py)
        return measured
    if one_gpu_ms is not None:
        return unit_ms(one, work)[0] / one_gpu_ms, f"one GPU {one_gpu_ms:.1f} ms/step given"
    entry = calibration.measured(hw.gpu_name, "compiled" if work.compiled else "eager", model=work.variant)
    if entry:
        w = entry["workload"]
        rate = _calibrated_unit_ms(w) / entry["ms_per_step"]
        source = f"measured on {w['model']} {w['width']}x{w['height']} {w['dtype']} {w['mode']}"
    else:
        share, where = efficiency(hw.gpu, work.compiled)
        ref = _reference_work()
        rate = hw.rated_tflops * share * unit_ms(one, ref)[0] / (rank_flops(one, ref)[0] / 1e9)
        source = f"rated {hw.rated_tflops:g} x {share:.3f} ({where})"
    if work.dtype == "fp32":
        return rate / FP32_SLOWDOWN, source + f", fp32 at 1/{FP32_SLOWDOWN}"
    return rate, source


@functools.lru_cache(maxsize=32)
def _calibrated_work(model: str, width: int, height: int, batch: int, cfg: float) -> Workload:
    return Workload.for_variant(model, width, height, batch=batch, negative_pass=cfg != 1)


def _calibrated_unit_ms(w: dict) -> float:
    """unit_ms of a calibration entry's one-GPU step (its model at its size; FLUX.1-dev 1024^2's when the entry names a
    model the planner does not know)."""
    try:
        work = _calibrated_work(w["model"], int(w["width"]), int(w["height"]), int(w.get("batch", 1)),
                                float(w.get("cfg", 1.0)))
    except (ValueError, KeyError):
        work = _reference_work()
    return unit_ms(ParallelPlan(), work)[0]


def throughput_tflops(hw: Hardware, work) -> tuple[float, str]:
    """Effective TFLOP/s of one GPU running this whole workload (its one-GPU step), and where it comes from."""
    rate, source = rate_tflops(hw, work)
    one = ParallelPlan()
    return rank_flops(one, work)[0] / 1e9 / unit_ms(one, work)[0] * rate, source


def compute_ms(plan, work, rate: float) -> tuple[float, float]:
    """(all, attention) GPU milliseconds of one rank's step at `rate` (rate_tflops)."""
    total, attention = unit_ms(plan, work)
    return total / rate, attention / rate


def launches_per_step(plan, work, code: Code | None = None) -> float:
    """Operations the host launches for one rank's step: each block it runs (its stage's, once per PipeFusion patch)
    at the model's count, COMPILED_LAUNCH_SHARE of them compiled; each attention layer's Ulysses exchanges and ring
    setup and hops at the code's counts, compiled only where the code's collectives trace (Code.compiled_sp)."""
    code = code or engine_code()
    runs = work.layers / plan.pipefusion * patches(plan, work)
    ops = runs * launches.ops_per_block(work.variant) * (COMPILED_LAUNCH_SHARE if work.compiled else 1.0)
    layer_runs = (work.layers + work.dual_layers) / plan.pipefusion * patches(plan, work)
    sp = 0.0
    if plan.ulysses > 1:
        sp += layer_runs * code.ulysses_ops
    if plan.ring > 1:
        sp += layer_runs * (code.ring_layer_ops + (plan.ring - 1) * code.ring_hop_ops)
    if plan.pipefusion > 1:
        sp += layer_runs * code.pipefusion_layer_ops
    return ops + sp * (COMPILED_LAUNCH_SHARE if work.compiled and code.compiled_sp else 1.0)


def merge_ms(plan, work, hw: Hardware, code: Code | None = None) -> float:
    """GPU milliseconds of one rank's ring merges a step: r - 1 a layer, each streaming the layer's output (the rank's
    queries x its heads x the head width x its items) at the code's bytes an element, at STREAM_SHARE of the GPU's
    memory bandwidth."""
    if plan.ring == 1:
        return 0.0
    code = code or engine_code()
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
    n_pad = shard_tokens(work.image_tokens, p) * p
    n_txt = joint_text(work)
    queries = n_pad / r + (n_txt / r if text_split(plan, work) else n_txt)
    elements = (queries * work.layers + n_pad / r * work.dual_layers) / plan.pipefusion
    elements *= work.heads / u * work.head_dim * items_per_rank(plan, work)
    return elements * (r - 1) * code.merge_bytes / (memory_gbs(hw.gpu) * STREAM_SHARE * 1e9) * 1e3


def host_ms(plan, work, code: Code | None = None) -> float:
    """The host's launch time of one rank's step: launches_per_step x LAUNCH_US, and a sharded plan's SHARD_UNIT_US per
    unit it gathers (every block and the root, once a forward)."""
    shard = (work.layers + 1) * SHARD_UNIT_US / 1e3 if plan.shard > 1 else 0.0
    return launches_per_step(plan, work, code) * LAUNCH_US / 1e3 + shard


def shard_gather_ms(plan, work, link: Interconnect, compute: float, code: Code | None = None) -> tuple[float, float]:
    """(all, exposed) milliseconds of one forward's weight gathers under a sharded plan: each unit's all-gather moves
    (shard - 1) / shard of its weights through every rank's link (a ring: shard - 1 hops of latency). The root's
    (embedders, final layer) and the first block's are paid before the forward; each later block's hides behind the
    compute of the block before it, up to the code's `shard_overlap` of it. The root once a step (it stays whole for
    the call); the blocks once a forward, `forwards_per_step` of them (the passes batched, or one a CFG group; one a row
    where the family's model takes a batch of one); a clip's experts gather only the one that runs."""
    if plan.shard == 1:
        return 0.0, 0.0
    code = code or engine_code()
    n, blocks, forwards = plan.shard, max(1, work.layers), forwards_per_step(plan, work)
    latency = (n - 1) * link.latency_us / 1e3

    def gather(nbytes: float) -> float:
        return (n - 1) / n * nbytes / (link.bandwidth_gbs * 1e9) * 1e3 + latency
    root, block = gather(work.weight_bytes - work.block_weight_bytes), gather(work.block_weight_bytes / blocks)
    hidden = min(block, code.shard_overlap * compute / forwards / blocks)
    return root + forwards * blocks * block, root + forwards * (block + (blocks - 1) * (block - hidden))


def forwards_per_step(plan, work) -> int:
    """The model forwards one rank makes a step: its rows (items_per_rank) in one, or one a row for a family whose model
    takes a batch of one (Family.forwards: MiniMax-H3)."""
    from ..families import VARIANTS, by_variant
    rows = items_per_rank(plan, work)
    return by_variant(work.variant).forwards(rows) if work.variant in VARIANTS else 1


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
    # a measured link (parallel/measured.py) times point-to-point messages apart from collectives: gloo's differ a lot
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
    if kinds["sp_merge"]:   # one all-gather a block (attention.py local_keys), the block waits on it
        ms += over(kinds["sp_merge"], link.bandwidth_gbs) + work.layers / plan.pipefusion * latency
    if plan.pipefusion > 1:
        p2p = over(kinds["pipefusion_p2p"], link.bandwidth_gbs)
        ms += p2p - code.pipefusion_overlap * min(p2p, compute) + m * p2p_latency
    return ms + shard_gather_ms(plan, work, link, compute, code)[1]


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
    if hw.device == "cuda" or measured is None:   # a ring's merges, at the GPU's memory bandwidth
        compute += merge_ms(plan, work, hw, code)
    host = 0.0 if measured and hw.device == "cpu" else host_ms(plan, work, code)
    return compute, comm_ms(plan, work, hw.link, attention, code, compute), host


def estimate(plan, work, hw: Hardware, *, code: Code | None = None, one_gpu_ms: float | None = None) -> Estimate:
    """The cost model's estimate of `plan` running `work` on `hw` (its own world size of hw's GPUs). code: the
    parallel code (default this engine's); one_gpu_ms: a one-GPU step of this workload to take the rate from."""
    code = code or engine_code()
    if work.text_splits and not code.text_split:
        work = replace(work, text_splits=False)
    rate, _ = rate_tflops(hw, work, one_gpu_ms)
    compute, comm, host = _steady(plan, work, hw, rate, code)
    step = max(host, compute + comm)
    steps = max(1, work.steps)
    placement, memory = expert_placement(plan, work, hw.memory_gib)
    fits = hw.memory_gib is None or memory["total"] <= hw.memory_gib
    exact, job = True, steps * step
    swap = swap_ms(work, hw, plan) if placement == HOST else 0.0
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
