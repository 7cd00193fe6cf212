"""Random-weight transformers at real or tiny dims, built directly on the rank's device, for benchmarks at full
FLUX/SD3 size without multi-GB files. A model source "synthetic:<variant>" is full size, "synthetic:<variant>:tiny"
the tiny test size; the same seed gives the same weights on the same device."""
from __future__ import annotations

import torch

from ..tiny import REAL, TINY, FluxDims
from .detect import CheckpointInfo

PREFIX = "synthetic:"


def is_synthetic(source: str) -> bool:
    return source.startswith(PREFIX)


def _dims(source: str):
    parts = source[len(PREFIX):].split(":")
    variant, size = parts[0], parts[1] if len(parts) > 1 else "full"
    table = {"full": REAL, "tiny": TINY}.get(size)
    if table is None or variant not in table or len(parts) > 2:
        raise ValueError(f"model {source!r} is invalid: use synthetic:<variant>[:tiny] with a variant in {sorted(REAL)}")
    return variant, table[variant]


def diffusers_config(dims) -> dict:
    if isinstance(dims, FluxDims):
        return {"patch_size": 1, "in_channels": dims.in_channels, "num_layers": dims.depth,
                "num_single_layers": dims.depth_single, "attention_head_dim": dims.head_dim,
                "num_attention_heads": dims.heads, "joint_attention_dim": dims.context_in,
                "pooled_projection_dim": dims.vec_in, "guidance_embeds": dims.guidance_embed,
                "axes_dims_rope": tuple(dims.axes_dim)}
    return {"sample_size": 128, "patch_size": dims.patch, "in_channels": dims.in_channels, "num_layers": dims.depth,
            "attention_head_dim": dims.head_dim, "num_attention_heads": dims.heads,
            "joint_attention_dim": dims.context_in, "caption_projection_dim": dims.hidden,
            "pooled_projection_dim": dims.pooled_in, "out_channels": dims.in_channels,
            "pos_embed_max_size": dims.pos_embed_max_size, "dual_attention_layers": tuple(dims.dual_attention_layers),
            "qk_norm": "rms_norm" if dims.qk_norm else None}


def synthetic_info(source: str) -> CheckpointInfo:
    variant, dims = _dims(source)
    family = "flux" if isinstance(dims, FluxDims) else "sd3"
    return CheckpointInfo(family=family, variant=variant, layout="synthetic", prefix="", config=diffusers_config(dims))


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled like a trained model's (1/sqrt(fan_in)), so activations stay sane through many blocks."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.ndim >= 2 and "pos_embed" not in name:
            fan_in = t[0].numel()
            t.normal_(0.0, fan_in ** -0.5, generator=gen)
        elif name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02 if t.ndim == 1 else 0.5, generator=gen)
