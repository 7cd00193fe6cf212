"""Random-weight transformers at real or tiny dims, built directly on the rank's device, for benchmarks at full
FLUX/SD3 size without multi-GB files. A model source "synthetic:<variant>" is full size, "synthetic:<variant>:tiny"
the tiny test size; the same seed gives the same weights on the same device."""
from __future__ import annotations

import zlib

import torch

from .tiny import REAL, SMALL, TINY, FluxDims, shapes_for
from .detect import CheckpointInfo, _flux_config, _sd3_config, count_parameters

PREFIX = "synthetic:"


def is_synthetic(source: str) -> bool:
    return source.startswith(PREFIX)


def _dims(source: str):
    parts = source[len(PREFIX):].split(":")
    variant, size = parts[0], parts[1] if len(parts) > 1 else "full"
    table = {"full": REAL, "small": SMALL, "tiny": TINY}.get(size)
    if table is None or variant not in table or len(parts) > 2:
        raise ValueError(f"model {source!r} is invalid: use synthetic:<variant>[:tiny|:small] with a variant in {sorted(REAL)}")
    return variant, table[variant]


def diffusers_config(dims) -> dict:
    """The same config detect infers from a checkpoint of these dims (one place knows diffusers' config keys)."""
    if isinstance(dims, FluxDims):
        config, _ = _flux_config(dims.hidden, dims.in_channels, dims.head_dim, dims.depth, dims.depth_single,
                                 dims.context_in, dims.vec_in, dims.guidance_embed,
                                 {"stated": {"axes_dims_rope": list(dims.axes_dim)}})
        return config
    config = _sd3_config(dims.hidden, dims.in_channels, dims.patch, dims.depth, dims.pos_embed_max_size ** 2,
                         dims.context_in, dims.pooled_in, dims.patch * dims.patch * dims.in_channels, dims.head_dim,
                         dims.dual_attention_layers)
    config["qk_norm"] = "rms_norm" if dims.qk_norm else None
    return config


def synthetic_info(source: str) -> CheckpointInfo:
    variant, dims = _dims(source)
    family = "flux" if isinstance(dims, FluxDims) else "sd3"
    parameters, in_blocks = count_parameters(shapes_for(variant, dims))
    return CheckpointInfo(family=family, variant=variant, layout="synthetic", prefix="", config=diffusers_config(dims),
                          parameters=parameters, block_parameters=in_blocks)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled like a trained model's (1/sqrt(fan_in)), so activations stay sane through many blocks. Each
    tensor draws from its own generator, seeded from `seed` and its name: a model that holds only some tensors (the
    rest on the meta device) holds the values the whole model has."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            continue
        gen = torch.Generator(device=t.device).manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
        if t.ndim >= 2 and "pos_embed" not in name:
            fan_in = t[0].numel()
            t.normal_(0.0, fan_in ** -0.5, generator=gen)
        elif name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02 if t.ndim == 1 else 0.5, generator=gen)
