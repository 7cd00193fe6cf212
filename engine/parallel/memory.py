"""What a GPU holds under a plan: the weights (every method but PipeFusion keeps a full copy; a PipeFusion stage holds
its share of the blocks), the peak activations of its model call (sequence parallel splits them), the runtime; and,
for PipeFusion, each stage's weights, K/V buffers and extras, and the split of the blocks that fits the GPUs."""
from __future__ import annotations

import functools
import math

from ..models.synthetic import synthetic_info
from .pipefusion.layout import balanced_split, block_lists, meta_model, reference_costs
from .plan import DTYPE_BYTES, GiB, items_per_rank, shard_tokens, text_split

ACT_WIDTHS = 24          # live activations per token at a block's peak, in hidden widths (input, fused projections,
                         # mlp, attention buffers)
RUNTIME_GIB = 1.5        # CUDA context, cuBLAS workspaces, allocator slack
# NCCL's buffers, per channel and per peer a rank connects to in a communicator: the Simple protocol's NCCL_BUFFSIZE
# (4 MiB by default: NCCL user guide, "Environment Variables", NCCL_BUFFSIZE,
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and the LL protocol's 512 KiB (8 lines x 512
# threads x 8 steps x 16 B: NCCL's src/init.cc DEFAULT_LL_BUFFSIZE, 2.30); LL128's 4.7 MiB, used over NVLink only, is
# left out. Channels per peer: 2 between GPUs over PCIe (src/graph/paths.cc ncclTopoGetNchannels); NVLink pairs get
# more, on GPUs that have the memory.
NCCL_BUFFER_BYTES = 4 * 2**20 + 512 * 2**10
NCCL_CHANNELS = 2


# ---- one GPU's share ---------------------------------------------------------------------------------------------------
def memory_gib(plan, work) -> dict[str, float]:
    """GiB one GPU holds: weights (every method but PipeFusion keeps a full copy; a stage holds its share of the
    blocks), the peak activations of its model call (sequence parallel splits them), the runtime. PipeFusion's
    per-stage totals, with their K/V buffers, are `stage_memory_gib`'s."""
    weights = work.weight_bytes - work.block_weight_bytes + work.block_weight_bytes / plan.pipefusion
    p = plan.ulysses * plan.ring
    tokens = shard_tokens(work.image_tokens, p) + (work.text_tokens / p if text_split(plan, work) else work.text_tokens)
    hidden = work.heads * work.head_dim
    activations = items_per_rank(plan, work) * tokens * hidden * ACT_WIDTHS * DTYPE_BYTES[work.dtype]
    parts = {"weights": weights / GiB, "activations": activations / GiB, "runtime": RUNTIME_GIB,
             "nccl": nccl_gib(plan)}
    return dict(parts, total=sum(parts.values()))


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
