"""Load the transformer of a checkpoint into its family's unmodified diffusers transformer, streaming one
tensor at a time (no full-file read, no text encoders or VAE, no hub). fp8 weights stay fp8 in memory and
are cast to the compute dtype per layer call, as ComfyUI does with fp8 files; fp8_scaled layers keep their
scale_weight (ComfyUI's mixed-precision fp8 layers their weight_scale) and GGUF block-quantized layers their blocks,
all dequantized per layer call (models/quantized.py)."""
from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors import safe_open

from .convert import apply_op, key_map
from .detect import SCALE_KEYS, CheckpointInfo, detect
from .gguf_file import GGUFTensors, is_gguf, read_gguf_header
from .quantized import BLOCKS, CastLinear, GGUFLinear, dequantize
from .safetensors_file import TORCH_DTYPES, CheckpointError, TensorInfo, read_header
from .synthetic import init_random_, is_synthetic, synthetic_info

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LoadStopped(Exception):
    """A load cut short because its `stop` callback said so (the job was cancelled): nothing of it is kept."""


# A test instrument, read from the ranks' environment: each tensor read waits this many ms more, as from a slow disk
# (a file of many GB), so that what happens during a long load can be tested on a tiny file. Unset: no wait.
LOAD_DELAY_ENV = "XDIT_LOAD_DELAY_MS"
LOAD_DELAY_S = max(0.0, float(os.environ.get(LOAD_DELAY_ENV) or 0)) / 1e3
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class LoadedTransformer:
    info: CheckpointInfo
    model: torch.nn.Module
    dtype: torch.dtype            # compute dtype
    path: str
    stats: dict = field(default_factory=dict)
    mapping: list | None = None        # (diffusers key, source key, op) for weights that came from a file
    fp8_weights: bool = False

    @property
    def family(self) -> str:
        return self.info.family


def _files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: one file, or a diffusers folder (transformer/ or its own)."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        folder = os.path.join(path, "transformer") if os.path.isdir(os.path.join(path, "transformer")) else path
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if files:
            return files
        raise CheckpointError(f"model folder {path!r} holds no .safetensors files (a diffusers transformer folder "
                              f"has diffusion_pytorch_model*.safetensors and config.json)")
    raise CheckpointError(f"model path {path!r} does not exist")


def _headers(files: list[str]) -> tuple[dict[str, tuple[str, TensorInfo]], dict]:
    where: dict[str, tuple[str, TensorInfo]] = {}
    metadata: dict = {}
    for f in files:
        tensors, meta = read_gguf_header(f) if is_gguf(f) else read_header(f)
        metadata.update(meta)
        for k, v in tensors.items():
            where[k] = (f, v)
    return where, metadata


def header_tensors(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{key: (dtype, shape)} of every tensor a checkpoint's headers list, keys as stored (prefix kept): what a loader
    that detects models from keys and shapes (ComfyUI's) needs, without reading a weight. GGUF blocks are given as
    float16 tensors of their logical shape, as ComfyUI-GGUF presents them."""
    where, _ = _headers(_files(path))
    return {k: (TORCH_DTYPES.get(v.dtype, torch.float16), tuple(v.shape)) for k, (_, v) in where.items()}


def inspect_checkpoint(path: str) -> CheckpointInfo:
    """Family, layout and config of a checkpoint from its headers alone (cheap: reads no weights)."""
    files = _files(path)
    return _detect(path, files, *_headers(files))


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
                     stop: Callable[[], bool] | None = None) -> LoadedTransformer:
    """Load the transformer in `path` for compute in `dtype` (fp32 | bf16 | fp16) on `device`. fp8_weights stores
    every Linear weight matrix as float8_e4m3fn (ComfyUI's fp8 weight dtype), whatever the file holds.

    keep: only the parameters it accepts are read from the file and held (a PipeFusion stage's blocks and the
    embedders or final layer it needs); the rest of the model stays on the meta device, holding no memory, and
    fails loudly if ever called. The whole file is still checked against the model (from its header). stop: asked
    before each tensor is read; True ends the load (LoadStopped)."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
    compute = COMPUTE_DTYPES[dtype]
    t0 = time.perf_counter()
    files = _files(path)
    where, metadata = _headers(files)
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
                              f"{_few(unexpected)}; merged files and quantized formats other than fp8_scaled, fp8 "
                              f"mixed and GGUF (e.g. bitsandbytes NF4) are not supported: use a plain, fp8_scaled or "
                              f"GGUF release")
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
    wanted = mapping if keep is None else [(d, s_, o) for d, s_, o in mapping if keep(d)]
    state, quantized, scales, bytes_read = _stream(path, where, info, wanted, expected, compute, device, fp8_weights,
                                                   stop)
    model.load_state_dict(state, strict=False, assign=True)  # what is absent is found by the meta check below
    del state
    quantized_layers = _install_quantized(model, quantized, compute)
    cast_layers = _wrap_fp8_linears(model, scales)
    # tensors outside the state dict (non-persistent buffers, e.g. a RoPE table) are the family's rebuild_off_meta's
    leftovers = [n for n, b in list(model.named_parameters()) + list(model.named_buffers())
                 if b.is_meta and n in expected and (keep is None or keep(n))]
    if leftovers:
        raise CheckpointError(f"{path}: model tensors left without weights: {_few(leftovers)}")
    info.spec.rebuild_off_meta(model)
    model.eval().requires_grad_(False)
    stats = {"load_s": time.perf_counter() - t0, "bytes_read": bytes_read, "fp8_linears": cast_layers,
             "scaled_linears": len(scales), "gguf_linears": quantized_layers, "format": info.format,
             "files": len(files), "ignored_tensors": info.ignored, "held_bytes": held_bytes(model)}
    if info.quantization:
        stats["quantization"] = info.quantization
    return LoadedTransformer(info=info, model=model, dtype=compute, path=path, stats=stats, mapping=mapping,
                             fp8_weights=fp8_weights)


class _Safetensors:
    """safetensors' reader on a file whose header read_header checked; what it still refuses is said in one line."""

    def __init__(self, file: str):
        self.name = os.path.basename(file)
        try:
            self.handle = safe_open(file, "pt", device="cpu").__enter__()
        except Exception as e:
            raise CheckpointError(f"{self.name}: safetensors cannot open it ({type(e).__name__}: {e}); the file is "
                                  f"damaged") from None

    def get(self, key: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{self.name}: safetensors cannot read tensor {key!r} ({type(e).__name__}: {e}); "
                                  f"the file is damaged") from None

    def close(self) -> None:
        self.handle.__exit__(None, None, None)


def _open(file: str, where: dict):
    if is_gguf(file):
        return GGUFTensors(file, {k: t for k, (f, t) in where.items() if f == file})
    return _Safetensors(file)


def _scale_of(path, where, key, info, raw, src, dst, op):
    """A scaled fp8 layer's scale, as the float32 factor for `dst` (a scalar, or a column per row)."""
    s = raw.float()
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() == where[info.prefix + src][1].shape[0]:
        return apply_op(s.reshape(-1), op).reshape(-1, 1)
    raise CheckpointError(f"{path}: {key} has shape {list(s.shape)}; a {key.rsplit('.', 1)[1]} is one number or one "
                          f"per output row of {src} ({where[info.prefix + src][1].shape[0]})")


def _check_layer_format(path, where, scale_key, read) -> None:
    """ComfyUI's mixed-precision files may name each layer's format in a `comfy_quant` tensor (JSON bytes) instead
    of the header: an fp8 format is what the engine loads."""
    quant_key = scale_key[:-len("weight_scale")] + "comfy_quant" if scale_key and scale_key.endswith(
        ".weight_scale") else None
    if quant_key not in where:
        return
    try:
        fmt = json.loads(bytes(read(quant_key)[0].to(torch.uint8).tolist())).get("format")
    except (ValueError, AttributeError):
        raise CheckpointError(f"{path}: {quant_key} is not ComfyUI's layer JSON; the file is damaged") from None
    if fmt not in ("float8_e4m3fn", "float8_e5m2"):
        raise CheckpointError(f"{path}: layer {quant_key[:-len('.comfy_quant')]} is quantized as {fmt!r}; the engine "
                              f"loads ComfyUI's mixed-precision layers in float8_e4m3fn or float8_e5m2: use an fp8 "
                              f"release")


def _stream(path, where, info, mapping, expected, compute, device, fp8_weights,
            stop=None) -> tuple[dict, dict, dict, int]:
    """Read each source tensor once (one at a time) and produce the diffusers tensors `mapping` makes of it: plain
    tensors (state), GGUF block rows for Linear weights (quantized: {name: (uint8 rows, type)}), and fp8_scaled
    factors (scales: {name: float32})."""
    by_source: dict[str, list] = {}
    for dst, src, op in mapping:
        by_source.setdefault(src, []).append((dst, op))
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[torch.Tensor, str]] = {}
    scales: dict[str, torch.Tensor] = {}
    bytes_read = 0
    handles = {}

    def read(key):
        nonlocal bytes_read
        file, tinfo = where[key]
        if file not in handles:
            handles[file] = _open(file, where)
        bytes_read += tinfo.end - tinfo.begin
        return handles[file].get(key), tinfo

    try:
        for src, outs in by_source.items():
            if stop is not None and stop():
                raise LoadStopped(f"{path}: load stopped after {bytes_read} bytes")
            if LOAD_DELAY_S:
                time.sleep(LOAD_DELAY_S)
            raw, tinfo = read(info.prefix + src)
            scale_key = (info.prefix + src[:-len("weight")] + SCALE_KEYS[info.format][0][1:]
                         if src.endswith(".weight") and info.format in SCALE_KEYS else None)
            scale = read(scale_key)[0] if scale_key in where else None
            _check_layer_format(path, where, scale_key, read)
            blocks = tinfo.dtype in BLOCKS
            for dst, op in outs:
                try:
                    t = apply_op(raw, op)
                except ValueError as e:   # a fused tensor whose rows do not add up
                    raise CheckpointError(f"{path}: tensor {src!r} has shape {list(tinfo.shape)}, which does not "
                                          f"give {dst}: {e}; the file is damaged or not the variant it seems") from None
                shape = (t.shape[0],) + tuple(tinfo.shape[1:]) if blocks else tuple(t.shape)
                if shape != expected[dst]:
                    raise CheckpointError(f"{path}: tensor {src!r} gives {dst} shape {list(shape)}, the model "
                                          f"expects {list(expected[dst])}")
                if blocks:
                    if len(shape) == 2 and dst.endswith(".weight"):
                        quantized[dst] = (t.to(device).contiguous(), tinfo.dtype)
                    else:   # a vector or a conv kernel in blocks (converters keep them float): expanded once
                        state[dst] = dequantize(t.to(device), tinfo.dtype, shape).to(compute)
                    continue
                if scale is not None:   # fp8_scaled's scale_weight, fp8_mixed's weight_scale
                    if t.ndim != 2:
                        raise CheckpointError(f"{path}: {scale_key} scales {src}, which is not a matrix "
                                              f"(shape {list(t.shape)}); only Linear weights are scaled")
                    scales[dst] = _scale_of(path, where, scale_key, info, scale, src, dst, op).to(device)
                keep_fp8 = t.ndim == 2 and (t.dtype in FP8 or fp8_weights)
                if keep_fp8 and t.dtype not in FP8:
                    t = t.to(torch.float8_e4m3fn)
                state[dst] = t.to(device=device, dtype=t.dtype if keep_fp8 else compute).contiguous()
            del raw
    finally:
        for h in handles.values():
            h.close()
    return state, quantized, scales, bytes_read


def _install_quantized(model: torch.nn.Module, quantized: dict, compute: torch.dtype) -> int:
    """Put each GGUF block weight into its layer: a Linear becomes a GGUFLinear; any other owner gets the expanded
    weight (no diffusers transformer matrix here is outside a Linear, so this is a safeguard)."""
    count = 0
    for name, (data, qtype) in quantized.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if isinstance(owner, torch.nn.Linear) and leaf == "weight":
            parent_name, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, GGUFLinear(owner, data, qtype))
            count += 1
        else:
            value = dequantize(data, qtype, tuple(getattr(owner, leaf).shape)).to(compute)
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    return count


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
    where, _ = _headers(_files(loaded.path))
    state, quantized, _, bytes_read = _stream(loaded.path, where, loaded.info, subset, expected, loaded.dtype,
                                              params[subset[0][0]].device, loaded.fp8_weights)
    if quantized:
        raise ValueError(f"{loaded.path}: {_few(quantized)} are held quantized and cannot be written to")
    for name, value in state.items():
        params[name].copy_(value)
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
    files = _files(source)
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


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this process holds (meta tensors hold none)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta)


def _materialize(model: torch.nn.Module, keep: Keep | None, device, dtype: torch.dtype) -> None:
    """Give the kept meta tensors storage on `device` (floating ones in `dtype`); the rest stay meta."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_meta or (keep is not None and not keep(name)):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(new, requires_grad=False)
        else:
            module._buffers[leaf] = new


def load_model(source: str, *, dtype: str = "fp32", device: str | torch.device = "cpu", seed: int = 0,
               fp8_weights: bool = False, keep: Keep | None = None,
               stop: Callable[[], bool] | None = None) -> LoadedTransformer:
    """load_transformer for a path (stop: see there); for a synthetic source, random weights built directly on
    `device` in `dtype` (each tensor's values depend only on the seed and its name, so a stage that holds part of the
    model holds the same values as a rank that holds all of it)."""
    if not is_synthetic(source):
        return load_transformer(source, dtype=dtype, device=device, fp8_weights=fp8_weights, keep=keep, stop=stop)
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
    _materialize(model, keep, device, COMPUTE_DTYPES[dtype])  # never materialised in fp32
    init_random_(model, seed)
    if fp8_weights:  # as a file's matrices would be stored: every Linear weight in fp8, cast per call
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.is_meta:
                module.weight = torch.nn.Parameter(module.weight.to(torch.float8_e4m3fn), requires_grad=False)
    cast_layers = _wrap_fp8_linears(model)
    info.spec.rebuild_off_meta(model)
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    return LoadedTransformer(info=info, model=model, dtype=COMPUTE_DTYPES[dtype], path=source, fp8_weights=fp8_weights,
                             stats={"load_s": time.perf_counter() - t0, "parameters": params,
                                    "fp8_linears": cast_layers, "held_bytes": held_bytes(model)})


def _wrap_fp8_linears(model: torch.nn.Module, scales: dict[str, torch.Tensor] | None = None) -> int:
    """Every Linear with an fp8 weight, or an fp8_scaled scale, becomes a CastLinear."""
    scales = scales or {}
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            key = f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight"
            if isinstance(child, torch.nn.Linear) and (child.weight.dtype in FP8 or key in scales):
                setattr(parent, name, CastLinear(child, scales.get(key)))
                count += 1
    return count
