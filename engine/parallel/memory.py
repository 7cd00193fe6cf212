"""What a GPU holds under a plan: the weights (every method but PipeFusion keeps a full copy; a PipeFusion stage holds
its share of the blocks), the peak activations of its model call (sequence parallel splits them), the runtime; and,
for PipeFusion, each stage's weights, K/V buffers and extras, and the split of the blocks that fits the GPUs."""
from __future__ import annotations

import functools
import math

from ..families import wan_animate2 as animate2
from ..models.synthetic import synthetic_info
from .pipefusion.layout import balanced_split, block_lists, meta_model, reference_costs
from .devices import host_link_gbs
from .plan import DTYPE_BYTES, HOST, RESIDENT, GiB, items_per_rank, joint_text, shard_tokens, text_split

ACT_WIDTHS = 24          # live activations per token at a block's peak, in hidden widths (input, fused projections,
                         # mlp, attention buffers): an upper bound for the image families, whose activations at their
                         # usual sizes are small next to their weights
# Measured: the peak of live tensor bytes over one forward of diffusers' WanTransformer3DModel with the engine's
# attention processor (bf16, the fused attention kernels: memory linear in the tokens), per token and hidden width
# (2 bytes), as the slope between two token counts (weights and their temporaries drop out), at the variants' FFN
# width over hidden width: 11.3 at 2.70 (the 14B models and the A14B experts), 15.9 at 5.83 (1.3B), 32.6 at 4.67
# (TI2V-5B with a per-frame timestep, which it has whenever a start image sets a noise mask: one modulation of 6
# widths in float32 per token). The peak is in the FFN (its up projection and GELU output, 2 x FFN/hidden widths)
# with the residual stream's float32 copies. `tests/test_planner.py` measures the 14B figure again.
MEASURED_ACT_WIDTHS = {"wan2.1-14b": 11.3, "wan2.1-i2v-14b": 11.3, "wan2.1-flf2v-14b": 11.3, "wan2.2-a14b": 11.3,
                       "wan2.2-i2v-a14b": 11.3, "wan2.1-1.3b": 15.9, "wan2.2-ti2v-5b": 32.6,
                       # not measured: assumed as the I2V file's (families/wan_animate2.py); its tokens count both
                       # branches
                       animate2.ANIMATE2: animate2.ACT_WIDTHS}
# What a GPU gives less than its total (devices.GPU.memory_gib, as torch reports it): the rank's CUDA context (the
# kernels it loads, cuBLAS and cuDNN handles), which torch's allocator does not count, and what the caching allocator
# holds reserved but unallocated at the job's peak (blocks freed between the weights' and the activations' sizes).
# Read from torch's out-of-memory reports (the issues devices.py cites), "this process has X GiB in use" less what
# PyTorch allocated and reserved: 0.41-0.60 GiB outside the allocator (RTX 4090 0.46 pinokiofactory/flux-webui#11,
# 0.49 Phidias-Diffusion#8; RTX 5090 0.60 and 0.58 TrajectoryCrafter#20, Wan-Video/Wan2.1#465; L40S 0.41, L40 0.49,
# A100 0.49; one at 2.15 with other libraries' buffers, VGen#104), and 0.00-0.98 GiB reserved but unallocated. So 0.5
# GiB of context and 1.0 of allocator headroom, about the 1.2 GiB ComfyUI keeps free beside a model beyond its context
# (comfy/model_management.py: 0.8 GiB minimum inference memory + 0.4 reserve on Linux): an RTX 4090 (23.64 GiB) gives
# 22.1 GiB to weights, activations and NCCL's buffers, and a plan fits only when all of it is within the total.
CUDA_CONTEXT_GIB = 0.5
ALLOCATOR_HEADROOM_GIB = 1.0
RUNTIME_GIB = CUDA_CONTEXT_GIB + ALLOCATOR_HEADROOM_GIB
# NCCL's buffers, per channel and per peer a rank connects to in a communicator: the Simple protocol's NCCL_BUFFSIZE
# (4 MiB by default: NCCL user guide, "Environment Variables", NCCL_BUFFSIZE,
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and the LL protocol's 512 KiB (8 lines x 512
# threads x 8 steps x 16 B: NCCL's src/init.cc DEFAULT_LL_BUFFSIZE, 2.30); LL128's 4.7 MiB, used over NVLink only, is
# left out. Channels per peer: 2 between GPUs over PCIe (src/graph/paths.cc ncclTopoGetNchannels); NVLink pairs get
# more, on GPUs that have the memory.
NCCL_BUFFER_BYTES = 4 * 2**20 + 512 * 2**10
NCCL_CHANNELS = 2
# Weights divided among a group (plan.shard, parallel/shard.py: FSDP2): while block i runs a GPU holds, beside its
# share and the root's weights (whole for the call), three blocks' whole weights: block i's unsharded parameters; block
# i's all-gather output, which FSDP2 keeps after the copy-out in a forward until the next block's wait (torch
# 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py wait_for_unshard: "defer free to allow for overlap of this
# copy-out with next all-gather"; a prefetched gather is posted synchronously, so the deferral applies); and block
# i+1's all-gather output, posted ahead (explicit forward prefetch). GPU_CHECKS measures it.
IN_FLIGHT_BLOCKS = 3
# Weights held quantized (fp8, GGUF, int8) are made dense in the compute dtype one layer at a time as each runs (a
# CastLinear's cast, a GGUF or int8 layer's dequantization, a LoRA's product on top): the largest a block holds, its
# 4x feed-forward's first matrix, is live at once beside the rest.
DENSE_LAYER_WIDTH = 4


def act_widths(work) -> float:
    """Live activation bytes per token at the model call's peak, in hidden widths of the compute dtype."""
    return MEASURED_ACT_WIDTHS.get(work.variant, ACT_WIDTHS)


# ---- one GPU's share ---------------------------------------------------------------------------------------------------
def memory_gib(plan, work, placement: str | None = None) -> dict[str, float]:
    """GiB one GPU holds: weights (every method but PipeFusion keeps a full copy; a stage holds its share of the
    blocks), the peak activations of its model call (sequence parallel splits them), the runtime. PipeFusion's
    per-stage totals, with their K/V buffers, are `stage_memory_gib`'s. A clip of several experts (Workload.experts)
    holds all of them with `placement` RESIDENT, one with HOST (the idle one in host memory); None: the workload's,
    its "auto" taken as HOST (the least a GPU must hold; cost.estimate decides which fits)."""
    placement = placement or work.placement
    held = work.experts if placement == RESIDENT else 1
    weights = held * (work.weight_bytes - work.block_weight_bytes + work.block_weight_bytes / plan.pipefusion)
    if plan.shard > 1:   # 1/shard of every expert held; the call's root and IN_FLIGHT_BLOCKS blocks whole
        weights = held * work.weight_bytes / plan.shard + gathered_bytes(work)
    if work.fp8_weights:   # one layer at a time dense in the compute dtype
        weights += dense_layer_bytes(work)
    p = plan.ulysses * plan.ring
    text = joint_text(work)
    tokens = shard_tokens(work.image_tokens, p) + (text / p if text_split(plan, work) else text)
    hidden = work.heads * work.head_dim
    activations = items_per_rank(plan, work) * tokens * hidden * act_widths(work) * DTYPE_BYTES[work.dtype]
    parts = {"weights": weights / GiB, "activations": activations / GiB, "runtime": RUNTIME_GIB,
             "nccl": nccl_gib(plan)}
    return dict(parts, total=sum(parts.values()))


def gathered_bytes(work) -> float:
    """What a GPU of a sharded plan holds whole at most, beside its share: the root's weights (the family's separate
    units, e.g. LTX-2.3's text connectors, left out), and IN_FLIGHT_BLOCKS blocks' while the blocks run, or the largest
    separate unit while it runs (before the blocks)."""
    units = tuple(work.unit_weight_bytes)
    root = work.weight_bytes - work.block_weight_bytes - sum(units)
    return root + max(IN_FLIGHT_BLOCKS * work.block_weight_bytes / max(1, work.layers), max(units, default=0))


def dense_layer_bytes(work) -> float:
    """The largest layer's weights made dense in the compute dtype as it runs (weights held quantized)."""
    hidden = work.heads * work.head_dim
    return DENSE_LAYER_WIDTH * hidden * hidden * DTYPE_BYTES[work.dtype]


def host_gib_per_machine(plan, work) -> float:
    """Host memory the idle experts take on the machine (HOST placement): one expert per rank, as each rank moves its
    own copy out (its share of it under a sharded plan)."""
    return plan.world_size * (work.experts - 1) * work.weight_bytes / plan.shard / GiB


def nccl_gib(plan) -> float:
    """NCCL's buffers on one GPU for the communicators a rank of `plan` uses (parallel/mesh.py; groups of the same
    ranks share one, a group of every rank is the world's): channels x the peers it connects to x one buffer set.
    Ring collectives (gathers, broadcasts, the step cache's all-reduce) and Ring's hops connect a rank to 2 peers,
    Ulysses' all-to-all to every other member, and each of PipeFusion's two links (from the previous stage, to the
    next) to one."""
    world = plan.world_size
    if world == 1:
        return 0.0
    peers = {"world": min(world - 1, 2)}

    def use(name: str, size: int, all_to_all: bool = False) -> None:
        if size > 1:
            name = "world" if size == world else name
            peers[name] = max(peers.get(name, 0), size - 1 if all_to_all else min(size - 1, 2))
    use("dp", plan.dp)
    use("cfg", plan.cfg)
    use("ring", plan.ring)
    use("ulysses", plan.ulysses, all_to_all=True)
    use("ulysses" if plan.ring == 1 else "ring" if plan.ulysses == 1 else "sp", plan.ring * plan.ulysses)
    links = 2 if plan.pipefusion > 1 else 0
    return (sum(peers.values()) + links) * NCCL_CHANNELS * NCCL_BUFFER_BYTES / GiB


@functools.lru_cache(maxsize=256)
def stage_memory_gib(plan, work, memory_gib_limit: float | None) -> tuple[list[float], bool]:
    """PipeFusion: GiB each stage needs (weights of its blocks, their K/V buffers, its embedders or final layer,
    activations, runtime) for the compute-balanced split, or the most balanced split that fits the limit
    (fit_stages); and whether some split fits."""
    info = synthetic_info(f"synthetic:{work.variant}")
    limit = math.inf if memory_gib_limit is None else memory_gib_limit
    counts, stage_gib, _ = fit_stages(info, plan, work, limit)
    return list(stage_gib), counts is not None


# ---- PipeFusion's stages ----------------------------------------------------------------------------------------
def stage_memory(info, plan, work) -> tuple:
    """What a stage holds, in bytes: (per block: weights + its layers' K/V buffers, per stage: the embedders or final
    layer it holds plus the activations and runtime every stage has)."""
    model = meta_model(info)
    held = info.spec.stage_params
    per_parameter = work.weight_bytes / max(1, info.parameters)
    sp = plan.ulysses * plan.ring
    forward = items_per_rank(plan, work)
    kv = 2 * forward * (work.image_tokens + work.text_tokens) / sp * work.heads * work.head_dim \
        * DTYPE_BYTES[work.dtype]
    blocks = []
    for name in block_lists(info):
        for block in model.get_submodule(name):
            attentions = 2 if getattr(block, "attn2", None) is not None else 1
            blocks.append(sum(p.numel() for p in block.parameters()) * per_parameter + attentions * kv)

    def params(prefixes):
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes)) * per_parameter
    m = memory_gib(plan, work)
    base = (m["activations"] + m["runtime"]) * GiB + params(held.every)
    extras = [base] * plan.pipefusion
    extras[0] += params(held.first)
    extras[-1] += params(held.last)
    return blocks, extras


def fit_stages(info, plan, work, memory_gib: float):
    """The compute-balanced split if every stage fits `memory_gib`, else the most compute-balanced split that fits:
    (blocks per stage or None, GiB per stage of that split or of the compute-balanced one, whether the split is the
    compute-balanced one)."""
    costs = reference_costs(info)
    blocks, extras = stage_memory(info, plan, work)
    prefix = [0.0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def need(stage, start, end):
        return (extras[stage] + prefix[end] - prefix[start]) / GiB

    def gib(counts):
        edges = [sum(counts[:k]) for k in range(len(counts) + 1)]
        return [need(k, edges[k], edges[k + 1]) for k in range(len(counts))]
    balanced = balanced_split(costs, plan.pipefusion)
    if max(gib(balanced)) <= memory_gib:
        return balanced, gib(balanced), True
    fitted = balanced_split(costs, plan.pipefusion, lambda st, a, b: need(st, a, b) <= memory_gib)
    return fitted, gib(fitted if fitted else balanced), False


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


def swap_ms(work, hw, plan=None) -> float:
    """HOST placement, per clip after the first (which reads the files): each expert is copied to the GPU once and
    back out once (the first expert returns at the clip's start while the last one leaves, the second replaces the
    first at the switch), every rank over its own link at the host-to-device rate (devices.host_link_gbs); a sharded
    plan's ranks each copy their share."""
    share = plan.shard if plan is not None else 1
    return work.experts * 2 * work.weight_bytes / share / (host_link_gbs(hw.gpu) * 1e9) * 1e3
