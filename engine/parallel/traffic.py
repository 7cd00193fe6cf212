"""What each parallel method sends: the bytes one rank sends per model call and per step, per collective kind, in
closed form (cost.py prices them on a link; `bench comm` checks them against the engine's own counts)."""
from __future__ import annotations

from .pipefusion.layout import analytic_p2p_bytes
from .plan import DTYPE_BYTES, items_per_rank, joint_text, shard_tokens


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


def sp_merge_bytes(queries: int, heads: int, head_dim: int, layers: int, plan, batch: int,
                   elem_bytes: int = 2) -> int:
    """What each sequence-parallel rank sends per model call for `layers` attentions whose queries every rank holds
    whole over its own image tokens (attention.py local_keys): its partial output (the activations' dtype) and
    log-sum-exp (fp32) of every query and head, to every other rank."""
    p = plan.ulysses * plan.ring
    return (p - 1) * batch * queries * heads * (head_dim * elem_bytes + 4) * layers


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
    kinds["sp_merge"] = sp_merge_bytes(work.merge_queries, work.merge_heads, work.merge_head_dim, work.layers, plan,
                                       items, elem)
    if plan.pipefusion > 1:   # a stage's sequence-parallel group runs only its share of the layers
        kinds = {k: v // plan.pipefusion for k, v in kinds.items()}
    kinds["sp_gather"] = sp_gather_bytes(work.image_tokens, work.out_features, plan, items, elem)
    velocity = items * work.image_tokens * work.out_features * 4   # fp32, gathered so every rank holds the batch
    kinds["cfg_gather"] = velocity if plan.cfg == 2 else 0
    kinds["dp_gather"] = (plan.dp - 1) * velocity
    if plan.pipefusion > 1:
        kinds["pipefusion_p2p"] = pipefusion_step_bytes(plan, work)
    # weights divided among ranks: one forward a step gathers every block and the root once; a ring all-gather sends
    # (shard - 1) / shard of them from each rank
    kinds["shard_gather"] = (plan.shard - 1) * work.weight_bytes // plan.shard
    return kinds
