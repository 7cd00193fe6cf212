"""What the host launches per denoising step: the operations a transformer block dispatches and what each
sequence-parallel method adds per attention layer, counted from the code (torch's dispatcher sees every operation, so
a count is what eager PyTorch launches from Python, views included).

The counts are data here, and `count_block_ops` / `count_sp_ops` recount them on the CPU (tests/test_planner.py
checks the table against them), so a change to the code or to diffusers shows up as a failing count, not a silent
drift of the cost model.
"""
from __future__ import annotations

import warnings

# Operations one transformer block dispatches per model call, the mean over the model's blocks: diffusers' stock
# blocks (diffusers 0.42.1) counted by `count_block_ops`. FLUX.1: 19 double blocks of 158 and 38 single of 83; FLUX.2
# [dev]: 8 double of 148 and 48 single of 68; HunyuanVideo: 20 double of 162 and 40 single of 98.
OPS_PER_BLOCK = {
    "flux": (19 * 158 + 38 * 83) / 57,
    "flux2": (8 * 148 + 48 * 68) / 56,
    "sd3": 115.0,
    "qwen-image": 170.0,
    "wan": 129.0,
    "HunyuanVideo": (20 * 162 + 40 * 98) / 60,
    "CogVideoX": 86.0,      # ConsisID runs CogVideoX-5B's blocks (its face cross-attention every second block uncounted)
}
DEFAULT_FAMILY = "flux"

# What this engine's sequence-parallel entry point (attention.py) adds to an attention layer, counted by
# `count_sp_ops` in bf16 with the text split: Ulysses' exchange of q, k and v and the output's way back; a ring's
# setup per layer, and per hop its post, wait, block attention and log-sum-exp merge; a PipeFusion patch's write of
# its fresh K/V into the layer's stale buffer (families/stage.py StaleKV.update: two index copies, read).
ENGINE_SP_OPS = {"ulysses": 29, "ring_layer": 4, "ring_hop": 18, "pipefusion_layer": 2}


def ops_per_block(variant: str) -> float:
    """The table's count for a model variant (its family's), FLUX.1's for a model it does not know."""
    if variant in OPS_PER_BLOCK:
        return OPS_PER_BLOCK[variant]
    from ..families import VARIANTS, by_variant
    name = by_variant(variant).name if variant in VARIANTS else DEFAULT_FAMILY
    return OPS_PER_BLOCK.get(name, OPS_PER_BLOCK[DEFAULT_FAMILY])


# ---- counting (CPU, tiny models) ---------------------------------------------------------------------------------
def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))
    return Count()


def _per_block(model, groups: dict, run) -> dict[str, int]:
    """Operations each named group of blocks dispatches in one forward (`run`), the last block of each group (the
    first may build caches)."""
    counts = {}
    hooks = []
    for name, blocks in groups.items():
        block = blocks[-1]

        def pre(mod, args, kwargs, name=name):
            mod._count = _counter()
            mod._count.__enter__()

        def post(mod, args, kwargs, out, name=name):
            mod._count.__exit__(None, None, None)
            counts[name] = mod._count.n
        hooks += [block.register_forward_pre_hook(pre, with_kwargs=True),
                  block.register_forward_hook(post, with_kwargs=True)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return counts


def count_block_ops(family: str) -> dict[str, int]:
    """Operations per block of diffusers' stock model of `family` ("flux" or "sd3"), by block kind, on a tiny CPU
    model (the count does not depend on the widths)."""
    import torch
    torch.manual_seed(0)
    with torch.no_grad():
        if family == "flux":
            from diffusers import FluxTransformer2DModel
            m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
            return _per_block(m, {"double": m.transformer_blocks, "single": m.single_transformer_blocks}, lambda: m(
                hidden_states=torch.randn(1, 64, 16), encoder_hidden_states=torch.randn(1, 8, 32),
                pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]), img_ids=torch.zeros(64, 3),
                txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]), return_dict=False))
        if family == "sd3":
            from diffusers import SD3Transformer2DModel
            m = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
                                      num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                      pooled_projection_dim=16, out_channels=16, pos_embed_max_size=16).eval()
            return _per_block(m, {"joint": m.transformer_blocks[:2]}, lambda: m(
                hidden_states=torch.randn(1, 16, 16, 16), encoder_hidden_states=torch.randn(1, 8, 32),
                pooled_projections=torch.randn(1, 16), timestep=torch.tensor([500.0]), return_dict=False))
    raise ValueError(f"family {family!r} is not counted here: use flux or sd3")


def count_sp_ops() -> dict[str, int]:
    """What the engine's sequence-parallel attention adds to one layer, in bf16 on the CPU inside torch's fake process
    group (every collective a local operation of the same shapes): {"ulysses": per layer, "ring_layer": per layer,
    "ring_hop": per hop}, each against the same layer without sequence parallel."""
    import torch
    import torch.distributed as dist

    from .attention import SequenceParallelAttention
    from .mesh import Mesh
    from .plan import ParallelPlan

    def ops(**degrees) -> int:
        plan = ParallelPlan(**degrees)
        if dist.is_initialized():
            dist.destroy_process_group()
        if plan.world_size > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dist.init_process_group("fake", rank=0, world_size=plan.world_size)
        attention = SequenceParallelAttention(Mesh(plan, 0, plan.world_size))
        q, k, v = (torch.randn(1, 32, 8, 16, dtype=torch.bfloat16) for _ in range(3))
        attention(q, k, v)   # first call: anything built once
        count = _counter()
        with count:
            attention(q, k, v)
        return count.n

    try:
        local, ulysses, ring2, ring3 = ops(), ops(ulysses=2), ops(ring=2), ops(ring=3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hop = ring3 - ring2
    return {"ulysses": ulysses - local, "ring_layer": ring2 - local - hop, "ring_hop": hop}
