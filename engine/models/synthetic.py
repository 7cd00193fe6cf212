"""Random-weight transformers at real or tiny dims, built directly on the rank's device, for benchmarks at full
size without multi-GB files. A model source "synthetic:<variant>" is full size, "synthetic:<variant>:tiny" the tiny
test size (":small" a few hundred MB); the same seed gives the same weights on the same device."""
from __future__ import annotations

import json
import zlib
from dataclasses import asdict

import torch

from .. import families
from .detect import CheckpointInfo, count_parameters

PREFIX = "synthetic:"
SIZES = ("full", "small", "tiny")


def is_synthetic(source: str) -> bool:
    return source.startswith(PREFIX)


def _dims(source: str):
    parts = source[len(PREFIX):].split(":")
    variant, size = parts[0], parts[1] if len(parts) > 1 else "full"
    try:   # any name of the model (families.resolve): synthetic:ltx23 is synthetic:ltx-2.3
        variant = families.variant(variant)
        family = families.by_variant(variant)
        dims = family.dims[size][variant]
    except (ValueError, KeyError):
        dims = None
    if dims is None or len(parts) > 2:
        raise ValueError(f"model {source!r} is invalid: use synthetic:<variant>[:tiny|:small] with a variant in "
                         f"{sorted(families.VARIANTS)}")
    return family, variant, dims


def synthetic_info(source: str) -> CheckpointInfo:
    """The header info of a synthetic model: its family infers the config from its native layout's shapes, as it
    does for a file of those dims."""
    family, variant, dims = _dims(source)
    shapes = family.shapes(dims)
    metadata = {"xdit.synthetic": json.dumps({"variant": variant, "dims": asdict(dims)})}
    config, _ = family.infer(family.native_layout, shapes, metadata)
    parameters, in_blocks, in_units = count_parameters(family, family.native_layout, config, shapes)
    return CheckpointInfo(family=family.name, variant=variant, layout="synthetic", prefix="", config=config,
                          parameters=parameters, block_parameters=in_blocks, unit_parameters=in_units)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled like a trained model's (1/sqrt(fan_in)), so activations stay sane through many blocks. Each
    tensor draws from its own generator, seeded from `seed` and its name: a model that holds only some tensors (the
    rest on the meta device) holds the values the whole model has."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_meta:
            random_values_(name, t, seed)


@torch.no_grad()
def random_values_(name: str, t: torch.Tensor, seed: int) -> None:
    """Fill the whole tensor `name` as init_random_ does (its values depend only on the seed, its name and shape)."""
    gen = torch.Generator(device=t.device).manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    if t.ndim >= 2 and "pos_embed" not in name:
        fan_in = t[0].numel()
        t.normal_(0.0, fan_in ** -0.5, generator=gen)
    elif name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02 if t.ndim == 1 else 0.5, generator=gen)
