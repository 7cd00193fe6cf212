"""The parallel code the cost model prices (cost.py): what it overlaps, how many calls it makes and what the host
launches for it; this engine's, read from its code (launches.py counts the operations), and xDiT's, read from its
source, which produced most of the published runs the model is checked against."""
from __future__ import annotations

from dataclasses import dataclass

from . import launches

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
    """The parallel code whose time is estimated: what it overlaps, how many calls it makes and what the host launches
    for it. `engine_code()` is this engine's (read at call time, so a test may change RING_OVERLAP); XDIT is the code
    that produced most of the published runs the model is checked against."""
    name: str
    ring_overlap: float          # share of a ring hop's transfer hidden behind the attention of the block in hand
    pipefusion_overlap: float    # share of a patch's stage-to-stage transfer hidden behind the next patch's compute
    ulysses_calls_per_layer: int
    ulysses_ops: int = 29        # operations Ulysses adds to an attention layer (its exchanges and reshapes)
    ring_layer_ops: int = 4      # operations a ring adds to an attention layer once
    ring_hop_ops: int = 18       # and per hop: post and wait, the block's attention, the log-sum-exp merge
    merge_bytes: int = 18        # bytes a hop's merge streams per output element (the block's output widened to
    #                              fp32, the running output read and written)
    pipefusion_layer_ops: int = 2   # operations a PipeFusion patch adds to an attention layer (its stale K/V written)
    text_split: bool = True      # the text splits with the image tokens where the model and degree allow (False:
    #                              every rank computes the whole text in every block)
    compiled_sp: bool = False    # torch.compile takes the sequence-parallel operations into its graphs too
    shard_overlap: float = 0.0   # share of the compute of the block before it that a block's weight gather can hide
    #                              behind (0: gathered when the block starts, as FSDP without explicit prefetch)


def engine_code() -> Code:
    ops = launches.ENGINE_SP_OPS
    return Code("this engine", RING_OVERLAP, PIPEFUSION_OVERLAP, ULYSSES_CALLS_PER_LAYER, ops["ulysses"],
                ops["ring_layer"], ops["ring_hop"], MERGE_BYTES, ops["pipefusion_layer"], shard_overlap=SHARD_OVERLAP)


# Weights divided among ranks (parallel/shard.py, FSDP2): each block's gather is posted when the block before it
# starts (explicit forward prefetch), on the shard group's own communicator, so it may take the whole of that block's
# compute to arrive: 1. This is the design's figure, not a measurement (no GPU here; GPU_CHECKS measures it); the
# contention of NCCL's kernels with the compute for SMs is left out. Without explicit prefetch a block's gather starts
# when the block does: the published FSDP inference runs the model is checked on (engine/published/sharding.py) fit
# no overlap, and a public FSDP measurement found 5% of the gathers overlapped without prefetch and 80% with one
# block of it (mindspore-ai/hyper-parallel issue #705, 8 NPUs, training).
SHARD_OVERLAP = 1.0
# Host time FSDP2 adds per unit (a block, or the root) and forward: its pre- and post-forward hooks, the gather's
# copy-in and copy-out, measured on this project's CPU host (a 1-rank group of 40 units: `bench shard` measures it
# again and prints it beside this figure).
SHARD_UNIT_US = 73.0


# attention.py's _merge: the block's bf16 output widened to fp32 (2 read, 4 written), lerp reading it and the running
# fp32 output and writing that (12): 18 bytes an element. Streaming kernels reach ~80% of the datasheet bandwidth.
MERGE_BYTES = 18
STREAM_SHARE = 0.8


# xDiT (xfuser's xFuserLongContextAttention over yunchang, read from their source): Ulysses exchanges q, k, v packed
# and the output back (yunchang's all_to_all_4D: reshape, transpose, copy, all_to_all_single, reshape, transpose, copy
# each way; 4 all-to-alls a layer counting the packed one as three, as its latency is paid per tensor in older
# releases), ~34 operations with the text's concatenations; its ring posts each hop's send/recv ahead of the block
# (RingComm: two buffers and a batched send/recv pair, 6), runs flash-attn's forward (4) and yunchang's log-sum-exp
# update (11): ~21 a hop, and ~10 a layer (the text's concatenation, the output's cast, the LSE's reshape); the update
# streams ~38 bytes an output element (widen 6, out - block_out 12, x sigmoid 8, out - that 12). Its PipeFusion writes a
# patch's K/V into the layer's buffer through its cache manager (~6 operations a layer). The whole attention is
# excluded from torch.compile (torch.compiler.disable).
XDIT = Code("xDiT (xFuser over yunchang: ring with the next hop posted ahead, PipeFusion with receives posted ahead)",
            1.0, 1.0, 4, ulysses_ops=34, ring_layer_ops=10, ring_hop_ops=21, merge_bytes=38, pipefusion_layer_ops=6,
            text_split=False)
# xDiT's "optimized USP" for FLUX.1 (examples/flux_usp_example.py and xfuser/model_executor/layers/usp.py, November
# 2024, the code of its 4xH100 table): the text split with the image tokens; Ulysses through torch's functional
# all_to_all_single, each of q, k, v and the output permuted, copied, exchanged, waited on and reshaped (~9 operations
# each, 36 a layer); the ring is torch's _templated_ring_attention (per hop a rotation, the flash kernel and its
# merger, ~16; ~5 a layer). Functional collectives trace, so torch.compile takes them into its graphs.
XDIT_USP = Code("xDiT's optimized USP (torch's functional all-to-all and templated ring attention)", 1.0, 1.0, 4,
                ulysses_ops=36, ring_layer_ops=5, ring_hop_ops=16, merge_bytes=38, text_split=True, compiled_sp=True)

