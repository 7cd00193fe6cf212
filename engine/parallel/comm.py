"""Communication volume per denoising step: what each method sends (closed form), and a probe that counts what the
engine's own collectives send at full model size with the attention arithmetic skipped (CPU ranks suffice)."""
from __future__ import annotations

import torch

from .attention import SequenceParallelAttention
from .cost import attention_bytes, pipefusion_attention_bytes, sp_gather_bytes
from .mesh import Mesh
from .pipefusion.layout import analytic_p2p_bytes
from .plan import ParallelPlan

# FLUX.1-dev and SD3-medium at 1024x1024 (bf16 activations)
MODELS = {
    "FLUX.1-dev": dict(image_tokens=4096, text_tokens=512, heads=24, head_dim=128, attention_layers=19 + 38,
                       out_features=64, text_split=True, negative_pass=False),
    "SD3-medium": dict(image_tokens=4096, text_tokens=333, heads=24, head_dim=64, attention_layers=24,
                       out_features=64, text_split=False, negative_pass=True),
}
PLANS = {
    "FLUX.1-dev": ["ulysses=2", "ulysses=4", "ulysses=8", "ring=2", "ring=4", "ring=8", "ulysses=2,ring=2",
                   "ulysses=4,ring=2"],
    "SD3-medium": ["ulysses=2", "ulysses=4", "ring=2", "ring=4", "cfg=2", "cfg=2,ulysses=2", "cfg=2,ulysses=4",
                   "cfg=2,ring=2"],
}


def analytic_bytes(m: dict, plan: ParallelPlan, batch: int) -> int:
    """Closed-form bytes one rank sends per step (one model call): the method's textbook volume, from the same
    formulas the planner's cost model uses (cost.py)."""
    kinds = attention_bytes(m["image_tokens"], m["text_tokens"], m["heads"], m["head_dim"], m["attention_layers"],
                            m["text_split"], plan, batch)
    total = sum(kinds.values()) + sp_gather_bytes(m["image_tokens"], m["out_features"], plan, batch)
    if plan.cfg == 2:
        total += 16 * 128 * 128 * 4  # this rank's velocity of its pass
    return total


def pipefusion_job_bytes(plan: ParallelPlan, *, stage: int, layers: int, dual_layers: int, image_tokens: int,
                         text_tokens: int, heads: int, head_dim: int, out_features: int, rows: int, passes_mine: int,
                         passes: int, images: int, latent: tuple[int, int, int], patches: int, calls: int,
                         warm_calls: int, elem_bytes: int) -> dict[str, int]:
    """Closed-form bytes one rank of PipeFusion stage `stage` sends over a job of `calls` model calls (the first
    `warm_calls` on the whole latent), per kind, from the formulas the planner prices with (cost.py): its stage's
    `layers` attention layers (and `dual_layers` image-only ones) per call (pipefusion_attention_bytes); on the last
    stage the velocities gathered each call (sequence-parallel shares, then data-parallel shares and CFG passes, in
    float32); and the messages between stages (pipefusion.layout.analytic_p2p_bytes). rows: the rows of one forward
    on this rank (its passes in one forward x its images); passes_mine / passes: the CFG passes this rank computes /
    the job has; images: the job's batch."""
    kinds: dict[str, int] = {}
    for m, n in ((1, warm_calls), (patches, calls - warm_calls)):
        for text, count in ((text_tokens, layers), (0, dual_layers)):
            for kind, b in pipefusion_attention_bytes(image_tokens, text, heads, head_dim, count, plan, rows, m,
                                                      elem_bytes).items():
                kinds[kind] = kinds.get(kind, 0) + b * n
    last = stage == plan.pipefusion - 1
    c, h, w = latent
    share = images // plan.dp
    velocity = passes_mine * share * c * h * w * 4   # this rank's passes of its images, float32
    kinds["sp_gather"] = calls * sp_gather_bytes(image_tokens, out_features, plan, rows, elem_bytes) if last else 0
    kinds["dp_gather"] = calls * velocity * (plan.dp - 1) if last else 0
    kinds["cfg_gather"] = calls * velocity * plan.dp * (plan.cfg - 1) if last and passes_mine < passes else 0
    kinds["pipefusion_p2p"] = analytic_p2p_bytes(
        stage, plan.pipefusion, calls=calls, image_tokens=image_tokens, text_tokens=text_tokens,
        hidden=heads * head_dim, batch=rows, latent=latent, patches=patches, act_bytes=elem_bytes,
        warm_calls=warm_calls, sp=plan.ulysses * plan.ring, batch_share=share, images=images)
    return {k: v for k, v in kinds.items() if v}


class CommOnlyAttention(SequenceParallelAttention):
    """The sequence-parallel entry point with its local arithmetic left out (the output is the queries) and every
    collective kept: the communication benchmark at full model size on CPU ranks."""

    def _local(self, queries, keys, values, bias=None):
        return queries.clone()

    def _block(self, q, k, v, q0, k0, bias=None):
        return q, torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)


def probe_step(mesh: Mesh, spec: dict) -> dict[str, int]:
    """One denoising step's collectives at full size: every attention layer sends full-size bf16 Q/K/V through the
    sequence-parallel entry point, then the per-step gathers run as parallelize runs them. Returns the bytes this
    rank sent, per kind."""
    attention = CommOnlyAttention(mesh)
    sp = mesh["sp"].size
    batch = spec["batch_per_forward"]
    image, text, heads, head_dim = spec["image_tokens"], spec["text_tokens"], spec["heads"], spec["head_dim"]
    text_split = spec["text_split"] and text % sp == 0
    gen = torch.Generator().manual_seed(mesh.rank)

    def shard(n: int) -> torch.Tensor:
        return torch.randn(batch, n, heads, head_dim, generator=gen).to(torch.bfloat16)

    for _ in range(spec["attention_layers"]):
        if text_split:
            q, k, v = (shard((image + text) // sp) for _ in range(3))
            attention(q, k, v)
        else:
            q, k, v = (shard(image // sp) for _ in range(3))
            joint = tuple(shard(text) for _ in range(3))
            attention(q, k, v, joint=joint)
    out = torch.zeros(batch, image // sp, spec["out_features"], dtype=torch.bfloat16)
    mesh.all_gather(out, "sp", dim=1, kind="sp_gather")
    if mesh.plan.cfg == 2:
        mesh.all_gather(torch.zeros(1, 1, 16, spec["latent_h"], spec["latent_w"]), "cfg", dim=0, kind="cfg_gather")
    return dict(mesh.stats.sent)
