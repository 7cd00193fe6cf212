"""Communication volume per denoising step: what each method sends (closed form), and a probe that counts what the
engine's own collectives send at full model size with the attention arithmetic skipped (CPU ranks suffice)."""
from __future__ import annotations

import torch

from .attention import SequenceParallelAttention
from .cost import attention_bytes, sp_gather_bytes
from .mesh import Mesh
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


def probe_step(mesh: Mesh, spec: dict) -> dict[str, int]:
    """One denoising step's collectives at full size: every attention layer sends full-size bf16 Q/K/V through the
    sequence-parallel entry point, then the per-step gathers run as parallelize runs them. Returns the bytes this
    rank sent, per kind."""
    attention = SequenceParallelAttention(mesh, comm_only=True)
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
