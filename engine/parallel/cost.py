"""The planner's cost model: for one plan, workload and hardware, the time of one denoising step (compute from
the model's FLOPs and the GPU's throughput, plus the communication left exposed) and the memory each GPU needs.

All figures are per rank and per step (one model call of the whole batch, both passes when cfg != 1). The model
is coarse (FLOPs and bytes, not kernels), good to perhaps 10-20%: `TIE` is how close two estimates must be for
the planner to call them equal.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import calibration
from .devices import Hardware, Interconnect

# Rated throughput reached by an eager bf16 step, from the field notes' one-GPU FLUX.1-dev runs at 1024^2 (74 TFLOP
# per step, 28 steps): H100 6.71 s -> 33% of 989, A100 12.77 s -> 52% of 312, L40 18.36 s -> 62% of 181. A measured
# calibration for the GPU (calibration.json) replaces rated x EFFICIENCY.
EFFICIENCY = 0.4
FP32_SLOWDOWN = 8        # fp32 matmuls leave the bf16 tensor path: 1/15 of bf16 on H100, 1/2 on GeForce cards
# Ring attention can hide each K/V transfer behind the attention of the block in hand. attention.py's `_ring`
# waits for each transfer before computing on it (and on CUDA the send queues behind the attention launched just
# before it), so today nothing is hidden: 0. Posting the next transfer before computing on the current block would
# let up to min(transfer, attention of r-1 blocks) hide; raise this then. Ulysses' all-to-alls are always exposed:
# the attention needs their output.
RING_OVERLAP = 0.0
TIE = 0.10               # estimates within 10% of the fastest are a tie: the plan that sends less wins, then the
                         # simpler one
LINEAR_WIDTH = 12        # weights each token meets per block, in hidden^2: qkv 3 + out 1 + mlp 8 (FLUX single: 7 + 5)
DUAL_WIDTH = 4           # SD3.5-medium's second, image-only attention: qkv 3 + out 1
ACT_WIDTHS = 24          # live activations per token at a block's peak, in hidden widths (input, fused projections,
                         # mlp, attention buffers)
RUNTIME_GIB = 1.5        # CUDA context, cuBLAS/NCCL workspaces, allocator slack
OUT_FEATURES = 64        # velocity values per image token: 16 latent channels x 2x2 patch (FLUX and SD3 alike)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2 ** 30


# ---- what each method sends (the closed forms `bench comm` checks against the engine's own counts) -----------
def attention_bytes(image_tokens: int, text_tokens: int, heads: int, head_dim: int, layers: int, text_split: bool,
                    plan, batch: int, elem_bytes: int = 2) -> dict[str, int]:
    """Bytes one rank sends per model call in `layers` sequence-parallel attention layers, per collective kind."""
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
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


def sp_gather_bytes(image_tokens: int, out_features: int, plan, batch: int, elem_bytes: int = 2) -> int:
    """The velocity tokens each sequence-parallel rank sends to the others after the model's output projection."""
    p = plan.ulysses * plan.ring
    return (p - 1) * batch * (image_tokens // p) * out_features * elem_bytes


def items_per_rank(plan, work) -> int:
    """Images x passes one rank's model call carries: its dp share, both passes unless cfg parallel splits them."""
    return work.batch // plan.dp * (2 if work.negative_pass and plan.cfg == 1 else 1)


def _text_split(plan, work) -> bool:
    """A family's text splits with the image when it may and the degree divides it; PipeFusion keeps it joint."""
    return work.text_splits and plan.pipefusion == 1 and work.text_tokens % (plan.ulysses * plan.ring) == 0


def comm_bytes(plan, work) -> dict[str, int]:
    """Bytes one rank sends per step, per collective kind."""
    items, elem = items_per_rank(plan, work), DTYPE_BYTES[work.dtype]
    kinds = attention_bytes(work.image_tokens, work.text_tokens, work.heads, work.head_dim, work.layers,
                            work.text_splits and plan.pipefusion == 1, plan, items, elem)
    if work.dual_layers:  # SD3.5-medium's image-only attention goes through the same entry point
        dual = attention_bytes(work.image_tokens, 0, work.heads, work.head_dim, work.dual_layers, False, plan, items,
                               elem)
        kinds = {k: v + dual[k] for k, v in kinds.items()}
    if plan.pipefusion > 1:   # a stage's sequence-parallel group runs only its share of the layers
        kinds = {k: v // plan.pipefusion for k, v in kinds.items()}
    kinds["sp_gather"] = sp_gather_bytes(work.image_tokens, OUT_FEATURES, plan, items, elem)
    velocity = items * work.image_tokens * OUT_FEATURES * 4   # fp32, gathered so every rank holds the whole batch
    kinds["cfg_gather"] = velocity if plan.cfg == 2 else 0
    kinds["dp_gather"] = (plan.dp - 1) * velocity
    if plan.pipefusion > 1:   # a stage's activations to the next, per step (text joint, the image share of its SP rank)
        hidden = work.heads * work.head_dim
        kinds["pipefusion_p2p"] = int(items * (work.image_tokens / (plan.ulysses * plan.ring) + work.text_tokens)
                                      * hidden * elem)
    return kinds


# ---- compute -------------------------------------------------------------------------------------------------
def rank_flops(plan, work) -> tuple[float, float]:
    """(all, attention) FLOPs of one rank's model call. Linear layers: 2 x weights x tokens; attention: 4 x
    queries x keys x width. Text tokens held by every rank (joint) are computed by every rank."""
    u, r, p = plan.ulysses, plan.ring, plan.ulysses * plan.ring
    hidden = work.heads * work.head_dim
    split = _text_split(plan, work)
    n_img, n_txt = work.image_tokens, work.text_tokens
    tokens = n_img / p + (n_txt / p if split else n_txt)
    queries = n_img / r + (n_txt / r if split else n_txt)   # after Ulysses' exchange: S/R tokens, H/U heads
    attention = 4 * queries * (n_img + n_txt) * hidden / u * work.layers
    attention += 4 * (n_img / r) * n_img * hidden / u * work.dual_layers
    linear = 2 * hidden * hidden * (LINEAR_WIDTH * tokens * work.layers + DUAL_WIDTH * n_img / p * work.dual_layers)
    items = items_per_rank(plan, work)
    stages = plan.pipefusion   # each stage runs its share of the blocks; pipelined, the stages work at once
    return items * (linear + attention) / stages, items * attention / stages


def throughput_tflops(hw: Hardware, work) -> tuple[float, str]:
    """Effective TFLOP/s of one GPU and where the figure comes from: a measured calibration, else rated x EFFICIENCY."""
    entry = calibration.measured(hw.gpu_name, "compiled" if work.compiled else "eager", model=work.variant)
    if entry:
        w = entry["workload"]
        tflops, source = entry["tflop_per_step"] / entry["ms_per_step"] * 1e3, (
            f"measured on {w['model']} {w['width']}x{w['height']} {w['dtype']} {w['mode']}")
    else:
        tflops, source = hw.rated_tflops * EFFICIENCY, f"rated {hw.rated_tflops:g} x {EFFICIENCY} efficiency"
    if work.dtype == "fp32":
        return tflops / FP32_SLOWDOWN, source + f", fp32 at 1/{FP32_SLOWDOWN}"
    return tflops, source


# ---- communication time ---------------------------------------------------------------------------------------
def comm_ms(plan, work, link: Interconnect, attention_ms: float) -> float:
    """Communication left on the critical path: bytes over the link plus a fixed cost per collective call."""
    kinds = comm_bytes(plan, work)
    u, r = plan.ulysses, plan.ring
    attention_layers = work.layers + work.dual_layers

    def over(nbytes: float, gbs: float) -> float:
        return nbytes / (gbs * 1e9) * 1e3

    ms = 0.0
    if u > 1:
        ms += over(kinds["ulysses_all_to_all"], link.all_to_all_gbs(u)) + over(kinds["ulysses_text_gather"],
                                                                              link.bandwidth_gbs)
        calls = 4 * attention_layers + (0 if _text_split(plan, work) else work.layers)
        ms += calls * link.latency_us / 1e3
    if r > 1:
        ring = over(kinds["ring_p2p"], link.bandwidth_gbs)
        ms += ring - RING_OVERLAP * min(ring, attention_ms * (r - 1) / r)
        ms += (r - 1) * attention_layers * link.latency_us / 1e3
    for kind in ("sp_gather", "cfg_gather", "dp_gather"):
        if kinds[kind]:
            ms += over(kinds[kind], link.bandwidth_gbs) + link.latency_us / 1e3
    return ms


# ---- memory ---------------------------------------------------------------------------------------------------
def memory_gib(plan, work) -> dict[str, float]:
    """GiB one GPU holds: weights (every built method keeps a full copy; PipeFusion stages would each hold their
    share of the blocks), the peak activations of its model call (sequence parallel splits them), the runtime."""
    weights = work.weight_bytes - work.block_weight_bytes + work.block_weight_bytes / plan.pipefusion
    p = plan.ulysses * plan.ring
    tokens = work.image_tokens / p + (work.text_tokens / p if _text_split(plan, work) else work.text_tokens)
    hidden = work.heads * work.head_dim
    activations = items_per_rank(plan, work) * tokens * hidden * ACT_WIDTHS * DTYPE_BYTES[work.dtype]
    parts = {"weights": weights / GiB, "activations": activations / GiB, "runtime": RUNTIME_GIB}
    return dict(parts, total=sum(parts.values()))


# ---- one plan -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    plan: object             # ParallelPlan
    compute_ms: float
    comm_ms: float           # exposed communication
    comm_bytes: int          # what one GPU sends per step
    memory: dict             # GiB: weights, activations, runtime, total
    fits: bool

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.comm_ms


def estimate(plan, work, hw: Hardware) -> Estimate:
    tflops, _ = throughput_tflops(hw, work)
    flops, attention = rank_flops(plan, work)
    memory = memory_gib(plan, work)
    return Estimate(plan=plan, compute_ms=flops / tflops / 1e9,
                    comm_ms=comm_ms(plan, work, hw.link, attention / tflops / 1e9),
                    comm_bytes=sum(comm_bytes(plan, work).values()), memory=memory,
                    fits=hw.memory_gib is None or memory["total"] <= hw.memory_gib)


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Best first: among the plans that fit, those within TIE of the fastest are equal and the one that sends
    least wins (then the earliest in the given order); the rest follow by estimated step time, misfits last."""
    order = {id(e): i for i, e in enumerate(estimates)}
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return sorted(estimates, key=lambda e: e.memory["total"])
    fastest = min(e.step_ms for e in fitting)
    best = min((e for e in fitting if e.step_ms <= fastest * (1 + TIE)), key=lambda e: (e.comm_bytes, order[id(e)]))
    rest = sorted((e for e in estimates if e is not best), key=lambda e: (not e.fits, e.step_ms, order[id(e)]))
    return [best] + rest
