"""Load the transformer of a checkpoint into its family's unmodified diffusers transformer, streaming one
tensor at a time (no full-file read, no text encoders or VAE, no hub). fp8 weights stay fp8 in memory and
are cast to the compute dtype per layer call, as ComfyUI does with fp8 files; fp8_scaled layers keep their
scale_weight (ComfyUI's mixed-precision fp8 layers their weight_scale) and GGUF block-quantized layers their blocks,
all dequantized per layer call (models/quantized.py). ComfyUI's int8_tensorwise layers (ConvRot or not) are
dequantized once, as they are read, into the compute dtype (fp8 with fp8_weights), as a plain file's matrices are
held."""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Callable

import torch

from .convert import key_map
from .detect import SCALE_KEYS, CheckpointInfo, detect
from .reader import (FP8, LOAD_DELAY_ENV, LoadedTransformer, LoadStopped, checkpoint_files,  # noqa: F401 (also
                     Holding, held_bytes, install_quantized, int8_count, read_headers,     # read through here)
                     stream, wrap_quantized_linears)
from .safetensors_file import TORCH_DTYPES, CheckpointError
from .sharded import held_rows, is_divided, load_sharded, local, random_sharded
from .synthetic import init_random_, is_synthetic, synthetic_info

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def header_tensors(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{key: (dtype, shape)} of every tensor a checkpoint's headers list, keys as stored (prefix kept): what a loader
    that detects models from keys and shapes (ComfyUI's) needs, without reading a weight. GGUF blocks are given as
    float16 tensors of their logical shape, as ComfyUI-GGUF presents them."""
    where, _ = read_headers(checkpoint_files(path))
    return {k: (TORCH_DTYPES.get(v.dtype, torch.float16), tuple(v.shape)) for k, (_, v) in where.items()}


def inspect_checkpoint(path: str) -> CheckpointInfo:
    """Family, layout and config of a checkpoint from its headers alone (cheap: reads no weights)."""
    files = checkpoint_files(path)
    return _detect(path, files, *read_headers(files))


def _detect(path: str, files: list[str], where: dict, metadata: dict) -> CheckpointInfo:
    stated = None
    folder_config = os.path.join(os.path.dirname(files[0]), "config.json")
    if os.path.isdir(path) and os.path.isfile(folder_config):
        with open(folder_config) as f:
            stated = json.load(f)
    return detect(path, {k: v for k, (_, v) in where.items()}, metadata, stated)


def build_empty(info: CheckpointInfo) -> torch.nn.Module:
    """The diffusers transformer for `info`, on the meta device (no memory until weights are assigned)."""
    with torch.device("meta"):
        return info.spec.model_class()(**info.config)


def _build_checked(path: str, info: CheckpointInfo) -> torch.nn.Module:
    """build_empty, with a config diffusers refuses (shapes no real model has) said as the file's fault."""
    try:
        return build_empty(info)
    except Exception as e:
        raise CheckpointError(f"{path}: its tensor shapes give a {info.family} config diffusers cannot build "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); the file is damaged or an "
                              f"unsupported variant") from None


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


Keep = Callable[[str], bool]   # diffusers parameter name -> whether this rank holds it


def load_transformer(path: str, *, dtype: str = "fp32", device: str | torch.device = "cpu",
                     fp8_weights: bool = False, keep: Keep | None = None,
                     stop: Callable[[], bool] | None = None, shard=None) -> LoadedTransformer:
    """Load the transformer in `path` for compute in `dtype` (fp32 | bf16 | fp16) on `device`. fp8_weights stores
    every Linear weight matrix as float8_e4m3fn (ComfyUI's fp8 weight dtype), whatever the file holds.

    keep: only the parameters it accepts are read from the file and held (a PipeFusion stage's blocks and the
    embedders or final layer it needs); the rest of the model stays on the meta device, holding no memory, and
    fails loudly if ever called. The whole file is still checked against the model (from its header). stop: asked
    before each tensor is read; True ends the load (LoadStopped). shard: a sharded.ShardSpec: the weights divided
    among a group of ranks, this rank reading and holding only its share (sharded.py)."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
    compute = COMPUTE_DTYPES[dtype]
    t0 = time.perf_counter()
    files = checkpoint_files(path)
    where, metadata = read_headers(files)
    info = _detect(path, files, where, metadata)
    model = _build_checked(path, info)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapping = key_map(info) or [(k, k, None) for k in expected]
    sources = {src for _, src, _ in mapping}
    present = set(info.keys)
    missing = sources - present
    if missing:
        raise CheckpointError(f"{path}: {info.variant} ({info.layout} layout) is missing {len(missing)} keys: "
                              f"{_few(missing)}; the file is incomplete or not the variant its shapes suggest")
    unexpected = present - sources
    if unexpected:
        raise CheckpointError(f"{path}: {info.variant} ({info.layout} layout) has {len(unexpected)} unexpected keys: "
                              f"{_few(unexpected)}; merged files and quantized formats other than fp8_scaled, "
                              f"ComfyUI's mixed precision (fp8, int8) and GGUF (e.g. bitsandbytes NF4) are not "
                              f"supported: use a plain, fp8_scaled, fp8 or int8 mixed or GGUF release")
    orphans = [k for k in where if info.format in SCALE_KEYS and k.startswith(info.prefix)
               and k.endswith(SCALE_KEYS[info.format])
               and k[len(info.prefix):].rsplit(".", 1)[0] + ".weight" not in present]
    if orphans:
        raise CheckpointError(f"{path}: {len(orphans)} {info.format} scales belong to no weight of the model: "
                              f"{_few(orphans)}; the file is damaged or not a transformer the engine runs")
    targets = {dst for dst, _, _ in mapping}
    if targets != set(expected):
        raise CheckpointError(f"{path}: conversion does not cover the diffusers model: "
                              f"{_few(set(expected) ^ targets)}")
    holding = Holding.of(info, model, compute, fp8_weights)
    if shard is not None:
        if keep is not None:
            raise ValueError("a PipeFusion stage's blocks are not divided among ranks as well: give keep or shard")
        return load_sharded(path, files, where, info, model, expected, mapping, holding, device, shard, stop, t0)
    wanted = mapping if keep is None else [(d, s_, o) for d, s_, o in mapping if keep(d)]
    groups: dict = {}
    state, quantized, scales, bytes_read = stream(path, where, info, wanted, expected, holding, device, stop,
                                                   int8_groups=groups)
    model.requires_grad_(False)   # (an int8 weight cannot be a parameter that takes gradients)
    model.load_state_dict(state, strict=False, assign=True)  # what is absent is found by the meta check below
    del state
    quantized_layers = install_quantized(model, quantized, compute)
    cast_layers = wrap_quantized_linears(model, scales, groups)
    # tensors outside the state dict (non-persistent buffers, e.g. a RoPE table) are the family's rebuild_off_meta's
    leftovers = [n for n, b in list(model.named_parameters()) + list(model.named_buffers())
                 if b.is_meta and n in expected and (keep is None or keep(n))]
    if leftovers:
        raise CheckpointError(f"{path}: model tensors left without weights: {_few(leftovers)}")
    info.spec.rebuild_off_meta(model)
    model.eval().requires_grad_(False)
    stats = {"load_s": time.perf_counter() - t0, "bytes_read": bytes_read, "fp8_linears": cast_layers,
             "scaled_linears": len(scales) - len(groups), "gguf_linears": quantized_layers,
             "int8_linears": int8_count(where, info, wanted), "format": info.format,
             "files": len(files), "ignored_tensors": info.ignored, "held_bytes": held_bytes(model)}
    if info.quantization:
        stats["quantization"] = info.quantization
    return LoadedTransformer(info=info, model=model, dtype=compute, path=path, stats=stats, mapping=mapping,
                             fp8_weights=fp8_weights, holding=holding)


@torch.no_grad()
def restore_weights(loaded: LoadedTransformer, names: set[str]) -> int:
    """Put the file's values back into the parameters `names` (diffusers names), e.g. to remove a LoRA; returns
    the bytes read. Only the source tensors behind those parameters are read."""
    mapping = getattr(loaded, "mapping", None)
    if mapping is None:
        raise ValueError(f"{loaded.path}: weights that did not come from a file cannot be restored")
    on_top = {n for n in names if getattr(lora_owner(loaded.model, n), "lora_on_top", False)}
    for name in on_top:   # held quantized, never written: dropping the LoRA factors restores them
        lora_owner(loaded.model, name).clear_loras()
    params = dict(loaded.model.named_parameters())
    subset = [(dst, src, op) for dst, src, op in mapping if dst in names and dst not in on_top]
    if not subset:
        return 0
    expected = {dst: tuple(params[dst].shape) for dst, _, _ in subset}
    # weights divided among ranks: this rank reads back only the rows it holds
    rows = {dst: held_rows(params[dst], loaded.shard) for dst, _, _ in subset if is_divided(params[dst])}
    where, _ = read_headers(checkpoint_files(loaded.path))
    state, quantized, _, bytes_read = stream(loaded.path, where, loaded.info, subset, expected, loaded.holding,
                                              local(params[subset[0][0]]).device, rows=rows)
    if quantized:
        raise ValueError(f"{loaded.path}: {_few(quantized)} are held quantized and cannot be written to")
    for name, value in state.items():
        local(params[name]).copy_(value)
    return bytes_read


def lora_owner(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module holding parameter `name`."""
    return model.get_submodule(name.rpartition(".")[0])


_INFO_CACHE: dict[tuple, CheckpointInfo] = {}  # (path, files' mtime and size) -> info: one header read per file


def inspect_model(source: str) -> CheckpointInfo:
    """inspect_checkpoint for a path, or the info of a synthetic model source. A file's headers are read once and
    reused until the file changes (mtime or size)."""
    if is_synthetic(source):
        return synthetic_info(source)
    files = checkpoint_files(source)
    key = (os.path.abspath(source),) + tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files)
    info = _INFO_CACHE.get(key)
    if info is None:
        info = inspect_checkpoint(source)
        if len(_INFO_CACHE) >= 32:
            _INFO_CACHE.clear()
        _INFO_CACHE[key] = info
    return info


def diffusers_keys(info: CheckpointInfo) -> set[str]:
    """The parameter and buffer names of the diffusers transformer for `info` (built on the meta device)."""
    return set(build_empty(info).state_dict())


def _materialize(model: torch.nn.Module, keep: Keep | None, device, holding: Holding) -> None:
    """Give the kept meta tensors storage on `device`, floating ones in the dtype `holding` names; the rest stay
    meta."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_meta or (keep is not None and not keep(name)):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        new = torch.empty(t.shape, dtype=holding.dtype(name) if t.is_floating_point() else t.dtype, device=device)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(new, requires_grad=False)
        else:
            module._buffers[leaf] = new


def load_model(source: str, *, dtype: str = "fp32", device: str | torch.device = "cpu", seed: int = 0,
               fp8_weights: bool = False, keep: Keep | None = None,
               stop: Callable[[], bool] | None = None, shard=None) -> LoadedTransformer:
    """load_transformer for a path (stop, shard: see there); for a synthetic source, random weights built directly on
    `device` in `dtype` (each tensor's values depend only on the seed and its name, so a stage that holds part of the
    model, or a rank a share of its weights, holds the values the whole model has)."""
    if not is_synthetic(source):
        return load_transformer(source, dtype=dtype, device=device, fp8_weights=fp8_weights, keep=keep, stop=stop,
                                shard=shard)
    if shard is not None:
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
        return random_sharded(synthetic_info(source), source, compute=COMPUTE_DTYPES[dtype], device=device,
                              seed=seed, fp8_weights=fp8_weights, spec=shard)
    return random_model(synthetic_info(source), source, dtype=dtype, device=device, seed=seed,
                        fp8_weights=fp8_weights, keep=keep)


def random_model(info: CheckpointInfo, source: str, *, dtype: str = "fp32", device: str | torch.device = "cpu",
                 seed: int = 0, fp8_weights: bool = False, keep: Keep | None = None) -> LoadedTransformer:
    """The transformer `info` describes (a file's header, or a synthetic variant's), with random weights built directly
    on `device` in `dtype`, nothing read from a file."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
    t0 = time.perf_counter()
    model = build_empty(info)
    holding = Holding.of(info, model, COMPUTE_DTYPES[dtype], fp8_weights)
    # drawn in the compute dtype (never materialised in fp32 but its islands), then held as a file's would be
    _materialize(model, keep, device, replace(holding, fp8_weights=False))
    init_random_(model, seed)
    for name, p in list(model.named_parameters()):
        if not p.is_meta and holding.dtype(name) == torch.float8_e4m3fn:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(p.to(torch.float8_e4m3fn),
                                                                              requires_grad=False)
    cast_layers = wrap_quantized_linears(model)
    info.spec.rebuild_off_meta(model)
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    return LoadedTransformer(info=info, model=model, dtype=COMPUTE_DTYPES[dtype], path=source, fp8_weights=fp8_weights,
                             holding=holding,
                             stats={"load_s": time.perf_counter() - t0, "parameters": params,
                                    "fp8_linears": cast_layers, "held_bytes": held_bytes(model)})


