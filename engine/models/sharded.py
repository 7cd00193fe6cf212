"""A transformer whose weights are divided among a group of ranks (the plan's `shard` degree), loaded straight into
each rank's share: the model is built on the meta device with the layers its file's storage needs (fp8 matrices,
fp8_scaled scales, GGUF blocks), cut into units by the parallel layer (`ShardSpec.wrap`: torch's FSDP2, parallel/
shard.py), given storage for this rank's rows only, and filled from the file reading only those rows of each tensor
(reader.stream's `rows`; an int8_tensorwise matrix's rows are expanded alone, ConvRot rotating within each row). No
rank holds or reads more of the weights than its share (and the buffers, which every rank keeps whole: an fp8_scaled
file's scales, the small tensors a family rebuilds).

A parameter of n rows is divided as torch.chunk divides it (and FSDP2 with it): ceil(n / size) rows a rank, the last
ranks' shares shorter or empty; the share of a fused source (FLUX's qkv) is its slice's rows."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .reader import (FP8, Holding, LoadedTransformer, held_bytes, install_quantized, int8_count, stream,
                     wrap_quantized_linears)
from .detect import SCALE_KEYS
from .quantized import BLOCKS
from .safetensors_file import TORCH_DTYPES, CheckpointError
from .synthetic import random_values_


@dataclass(frozen=True)
class ShardSpec:
    """How one rank holds a model whose weights a group divides: the group's size, this rank's place in it, the
    group's ranks (what identifies the division) and `wrap(model)`, which cuts a meta model into the units whose
    weights are gathered together (parallel/shard.py)."""
    size: int
    rank: int
    ranks: tuple
    wrap: Callable[[torch.nn.Module], None]


def share(rows: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `rows` that rank `rank` of `size` holds (torch.chunk's division)."""
    per = math.ceil(rows / size) if rows else 0
    start = min(rows, rank * per)
    return start, min(rows, start + per)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: a divided one's local shard, else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def is_divided(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor")


def held_rows(t: torch.Tensor, spec: "ShardSpec | None") -> tuple[int, int]:
    """Rows [start, stop) of a parameter's whole (dim 0) this rank holds under `spec` (the loaded model's division):
    all of an undivided one's."""
    if not is_divided(t) or spec is None:
        return 0, t.shape[0]
    return share(t.shape[0], spec.size, spec.rank)


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """The root unit's weights (embedders, final layer) whole for the duration: a family's forward reaches them outside
    the model's own forward too. Nested, the outermost gathers and lets go (one gather for all the model calls of a
    request: ranks that divide the weights then make the same collectives however their calls are cut). A model
    whose weights are not divided needs nothing."""
    if not hasattr(model, "unshard"):
        yield
        return
    depth = model.__dict__.get("_xdit_gathered", 0)
    if not depth:
        # FSDP2 takes the first unit whose forward runs for its root; a family may run a unit of its own (a text
        # connector, Family.shard_units) before the model's forward: the model is made the root first
        model._get_fsdp_state()._lazy_init()
        model.unshard()
    model.__dict__["_xdit_gathered"] = depth + 1
    try:
        yield
    finally:
        model.__dict__["_xdit_gathered"] = depth
        if not depth:
            model.reshard()


def _storage(where, info, mapping, expected, holding: Holding) -> dict[str, tuple]:
    """{diffusers name: (dtype, shape, kind, qtype)} as the loader stores each tensor of this file: GGUF matrices as
    their block rows (uint8), int8_tensorwise matrices in int8, the rest in the dtype `holding` names (reader.stream
    produces them so)."""
    plan = {}
    for dst, src, _ in mapping:
        tinfo = where[info.prefix + src][1]
        shape = tuple(expected[dst])
        if tinfo.dtype in BLOCKS and len(shape) == 2 and dst.endswith(".weight"):
            _, block, nbytes = BLOCKS[tinfo.dtype]
            plan[dst] = (torch.uint8, (shape[0], shape[1] // block * nbytes), "gguf", tinfo.dtype)
            continue
        if tinfo.dtype == "I8":   # an int8_tensorwise matrix: held as stored (an Int8Linear's)
            plan[dst] = (torch.int8, shape, "int8", None)
            continue
        # a tensor in blocks that is no matrix (a vector, a kernel) is expanded as it is read
        dtype = holding.dtype(dst, None if tinfo.dtype in BLOCKS else TORCH_DTYPES.get(tinfo.dtype))
        plan[dst] = (dtype, shape, "fp8" if dtype in FP8 else "plain", None)
    return plan


def _scale_shapes(where, info, mapping) -> dict[str, tuple]:
    """{diffusers name: its scale's shape} for an fp8_scaled or mixed file's scaled fp8 and int8 matrices: one number,
    or one per output row of the diffusers matrix (whole on every rank)."""
    out = {}
    if info.format not in SCALE_KEYS:
        return out
    for dst, src, op in mapping:
        key = info.prefix + src[:-len("weight")] + SCALE_KEYS[info.format][0][1:] if src.endswith(".weight") else None
        if key in where:
            numel = math.prod(where[key][1].shape)
            rows = op[2][op[1]] if isinstance(op, tuple) else where[info.prefix + src][1].shape[0]
            out[dst] = () if numel == 1 else (rows, 1)
    return out


def load_sharded(path, files, where, info, model, expected, mapping, holding: Holding, device, spec: ShardSpec,
                 stop=None, t0: float | None = None) -> LoadedTransformer:
    """The model (built on the meta device, checked against the file by load.py) loaded into this rank's share of the
    weights under `spec`; see the module."""
    t0 = time.perf_counter() if t0 is None else t0
    compute = holding.compute
    storage = _storage(where, info, mapping, expected, holding)
    gguf = {}
    for name, (dtype, shape, kind, qtype) in storage.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        empty = torch.empty(shape, dtype=dtype, device="meta")
        if kind == "gguf":
            gguf[name] = (empty, qtype)
        elif leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(empty, requires_grad=False)
        else:
            owner._buffers[leaf] = empty
    quantized_layers = install_quantized(model, gguf, compute)
    scales = {name: torch.empty(shape, dtype=torch.float32, device="meta")
              for name, shape in _scale_shapes(where, info, mapping).items()}
    cast_layers = wrap_quantized_linears(model, scales)
    model.requires_grad_(False)
    spec.wrap(model)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    rows = {}
    for name, p in params.items():
        if name in storage and is_divided(p):
            rows[name] = share(storage[name][1][0], spec.size, spec.rank)
            if local(p).shape[0] != rows[name][1] - rows[name][0]:
                raise RuntimeError(f"{name}: this rank holds {local(p).shape[0]} rows of {storage[name][1][0]}, the "
                                   f"division says {rows[name]}")
    tensors = {**params, **dict(model.named_buffers())}
    filled = set()

    def fill(name: str, value: torch.Tensor) -> None:   # each tensor into this rank's storage as it is read
        target = local(tensors[name])
        if target.shape != value.shape or target.dtype != value.dtype:
            raise CheckpointError(f"{path}: {name} reads as {list(value.shape)} {value.dtype}, this rank holds "
                                  f"{list(target.shape)} {target.dtype}")
        target.copy_(value)
        filled.add(name)
    groups: dict = {}
    _, _, scale_values, bytes_read = stream(path, where, info, mapping, expected, holding, device, stop,
                                            rows=rows, sink=fill, int8_groups=groups)
    for name, value in scale_values.items():
        layer = model.get_submodule(name.rpartition(".")[0])
        if name in groups:   # an Int8Linear's scale and ConvRot group
            layer.weight_scale.copy_(value.reshape(scales[name].shape))
            layer.group = groups[name]
        else:
            layer.scale_weight.copy_(value.reshape(scales[name].shape))
    missing = set(storage) - filled
    if missing:
        raise CheckpointError(f"{path}: model tensors left without weights: {', '.join(sorted(missing)[:5])}")
    info.spec.rebuild_off_meta(model)
    model.eval()
    stats = {"load_s": time.perf_counter() - t0, "bytes_read": bytes_read, "fp8_linears": cast_layers,
             "scaled_linears": len(scale_values) - len(groups), "gguf_linears": quantized_layers,
             "int8_linears": int8_count(where, info, mapping), "format": info.format,
             "files": len(files), "ignored_tensors": info.ignored, "held_bytes": held_bytes(model),
             "shard": {"size": spec.size, "rank": spec.rank, "ranks": list(spec.ranks)}}
    if info.quantization:
        stats["quantization"] = info.quantization
    return LoadedTransformer(info=info, model=model, dtype=compute, path=path, stats=stats, mapping=mapping,
                             fp8_weights=holding.fp8_weights, holding=holding, shard=spec)


@torch.no_grad()
def random_sharded(info, source: str, *, compute: torch.dtype, device, seed: int, fp8_weights: bool,
                   spec: ShardSpec) -> LoadedTransformer:
    """A synthetic model's random weights (as load.random_model draws them: the whole of each tensor from its own
    generator, one tensor at a time) divided under `spec`: each rank keeps its rows."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = info.spec.model_class()(**info.config)
    holding = Holding.of(info, model, compute, fp8_weights)
    drawn = replace(holding, fp8_weights=False)   # drawn as load.random_model draws them, then held as it holds them
    stored = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        dtype = drawn.dtype(name) if p.is_floating_point() else p.dtype
        fp8 = p.is_floating_point() and holding.dtype(name) == torch.float8_e4m3fn
        stored[name] = (tuple(p.shape), dtype, fp8)
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        empty = torch.empty(p.shape, dtype=torch.float8_e4m3fn if fp8 else dtype, device="meta")
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(empty, requires_grad=False)
        else:
            module._buffers[leaf] = empty
    cast_layers = wrap_quantized_linears(model)
    model.requires_grad_(False)
    spec.wrap(model)
    model.to_empty(device=device)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, (shape, dtype, fp8) in stored.items():
        if name not in tensors:   # a buffer the family rebuilds
            continue
        whole = torch.empty(shape, dtype=dtype, device=device)
        random_values_(name, whole, seed)
        if fp8:
            whole = whole.to(torch.float8_e4m3fn)
        target = local(tensors[name])
        if is_divided(tensors[name]):
            start, stop = share(shape[0], spec.size, spec.rank)
            whole = whole[start:stop]
        target.copy_(whole)
    info.spec.rebuild_off_meta(model)
    model.eval()
    return LoadedTransformer(info=info, model=model, dtype=compute, path=source, fp8_weights=fp8_weights, shard=spec,
                             holding=holding, stats={"load_s": time.perf_counter() - t0, "fp8_linears": cast_layers,
                                    "held_bytes": held_bytes(model),
                                    "shard": {"size": spec.size, "rank": spec.rank, "ranks": list(spec.ranks)}})
