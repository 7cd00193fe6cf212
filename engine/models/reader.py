"""A checkpoint's files as the tensors a diffusers transformer takes: the files of a checkpoint and their headers, a
reader per file (safetensors or GGUF: memory-mapped, one tensor or one row range at a time), the stream that turns each
source tensor into the diffusers tensors the family's key map makes of it (plain, fp8 with its scale, GGUF block
rows), and the layers that hold quantized weights. load.py loads a whole model with it, sharded.py each rank's rows."""
from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from .convert import apply_op
from .detect import LOADED_FORMATS, MIXED_FORMATS, SCALE_KEYS, CheckpointInfo, int8_group
from .gguf_file import GGUFTensors, is_gguf, read_gguf_header
from .quantized import BLOCKS, INT8_FORMAT, CastLinear, GGUFLinear, Int8Linear, dequantize
from .safetensors_file import TORCH_DTYPES, CheckpointError, TensorInfo, read_header

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class LoadStopped(Exception):
    """A load cut short because its `stop` callback said so (the job was cancelled): nothing of it is kept."""


# A test instrument, read from the ranks' environment: each tensor read waits this many ms more, as from a slow disk
# (a file of many GB), so that what happens during a long load can be tested on a tiny file. Unset: no wait.
LOAD_DELAY_ENV = "XDIT_LOAD_DELAY_MS"
LOAD_DELAY_S = max(0.0, float(os.environ.get(LOAD_DELAY_ENV) or 0)) / 1e3


@dataclass(frozen=True)
class Holding:
    """The one rule for the dtype a plain tensor (not in GGUF blocks, not int8) is held in, on every load path (a file
    whole or divided among ranks, random weights whole or divided, weights read back after a LoRA):
    - a Linear layer's weight stored in fp8 stays in its fp8 (cast per call: CastLinear, as ComfyUI's fp8 ops do);
    - with the fp8 weight option, every other Linear weight is held in fp8_e4m3fn too, except a family's float32
      islands (Family.fp32_params: ComfyUI builds those layers in float32 whatever the weight dtype);
    - a float32 island is held in float32 where the compute dtype is lower;
    - everything else (biases, norms, modulation tables such as LTX's scale_shift_table, embeddings: tensors that
      are not a Linear's weight, even 2-D ones, and so never take the per-call cast) in the compute dtype, also where
      the file stores it in fp8.
    Built once per load from the model (on the meta device) before any Linear is wrapped."""
    compute: torch.dtype
    fp8_weights: bool
    linear_weights: frozenset
    fp32: Callable[[str], bool]

    @classmethod
    def of(cls, info, model: torch.nn.Module, compute: torch.dtype, fp8_weights: bool) -> "Holding":
        linear = frozenset(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        # islands of one form of a model only (a module the family built marks itself `xdit_float32`, e.g. a pruned
        # MiniMax-H3's modulation projections, which ComfyUI builds in float32 for that form alone)
        marked = frozenset(f"{name}.{p}" for name, m in model.named_modules() if getattr(m, "xdit_float32", False)
                           for p, _ in m.named_parameters())
        named = info.spec.fp32_params
        return cls(compute, fp8_weights, linear, (lambda name: named(name) or name in marked) if marked else named)

    def dtype(self, name: str, stored: torch.dtype | None = None) -> torch.dtype:
        """The held dtype of floating tensor `name` (diffusers name) stored as `stored` (None: no file)."""
        linear = name in self.linear_weights
        if linear and stored in FP8:
            return stored
        island = self.fp32(name)
        if linear and self.fp8_weights and not island:
            return torch.float8_e4m3fn
        if island and self.compute in (torch.bfloat16, torch.float16):
            return torch.float32
        return self.compute


@dataclass
class LoadedTransformer:
    info: CheckpointInfo
    model: torch.nn.Module
    dtype: torch.dtype            # compute dtype
    path: str
    stats: dict = field(default_factory=dict)
    mapping: list | None = None        # (diffusers key, source key, op) for weights that came from a file
    fp8_weights: bool = False
    holding: Holding | None = None     # the dtypes its tensors are held in (a file's: read back by restore_weights)
    shard: object = None               # sharded.ShardSpec: the weights divided among a group of ranks (None: whole)

    @property
    def family(self) -> str:
        return self.info.family


def checkpoint_files(path: str) -> list[str]:
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


def read_headers(files: list[str]) -> tuple[dict[str, tuple[str, TensorInfo]], dict]:
    where: dict[str, tuple[str, TensorInfo]] = {}
    metadata: dict = {}
    for f in files:
        tensors, meta = read_gguf_header(f) if is_gguf(f) else read_header(f)
        metadata.update(meta)
        for k, v in tensors.items():
            where[k] = (f, v)
    return where, metadata


class _Safetensors:
    """safetensors' reader on a file whose header read_header checked; what it still refuses is said in one line."""

    def __init__(self, file: str, infos: dict | None = None):
        self.name = os.path.basename(file)
        self.file, self.infos, self._raw = file, infos or {}, None
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

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor's dim 0, read alone into memory of their own: a plain read of their bytes,
        not a view of the mapped file, so a rank that copies them into its share holds its share and one tensor's
        rows, never the file's pages of them beside its copy."""
        info = self.infos.get(key)
        if info is None or info.dtype not in TORCH_DTYPES:
            return self.handle.get_slice(key)[start:stop]
        rows = info.shape[0]
        row_bytes = (info.end - info.begin) // max(rows, 1)
        out = torch.empty(((stop - start),) + tuple(info.shape[1:]), dtype=TORCH_DTYPES[info.dtype])
        if out.numel() == 0:
            return out
        if self._raw is None:
            self._raw = open(self.file, "rb")
            self._data_start = 8 + int.from_bytes(self._raw.read(8), "little")
        self._raw.seek(self._data_start + info.begin + start * row_bytes)
        view = out.view(torch.uint8).reshape(-1).numpy()
        if self._raw.readinto(memoryview(view)) != view.nbytes:
            raise CheckpointError(f"{self.name}: tensor {key!r} ends before rows {start}:{stop}; the file is "
                                  f"truncated or damaged")
        return out

    def close(self) -> None:
        self.handle.__exit__(None, None, None)
        if self._raw is not None:
            self._raw.close()


def _open(file: str, where: dict):
    if is_gguf(file):
        return GGUFTensors(file, {k: t for k, (f, t) in where.items() if f == file})
    return _Safetensors(file, {k: t for k, (f, t) in where.items() if f == file})


def _scale_of(path, where, key, info, raw, src, dst, op):
    """A scaled fp8 layer's scale, as the float32 factor for `dst` (a scalar, or a column per row)."""
    s = raw.float()
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() == where[info.prefix + src][1].shape[0]:
        return apply_op(s.reshape(-1), op).reshape(-1, 1)
    raise CheckpointError(f"{path}: {key} has shape {list(s.shape)}; a {key.rsplit('.', 1)[1]} is one number or one "
                          f"per output row of {src} ({where[info.prefix + src][1].shape[0]})")


def _layer_config(path, where, info, src, scale_key, read) -> dict | None:
    """A mixed-precision layer's config: the header's (info.layer_quant: ComfyUI's loader puts it over any other), else
    its `comfy_quant` tensor (JSON bytes), as files saved by newer ComfyUI carry it; None for a plain layer. A format
    the engine does not load, in either, is said in one line."""
    if not (scale_key and scale_key.endswith(".weight_scale")):
        return None
    layer = src[:-len(".weight")]
    quant_key = scale_key[:-len("weight_scale")] + "comfy_quant"
    own = None
    if quant_key in where:
        try:
            own = json.loads(bytes(read(quant_key)[0].to(torch.uint8).tolist()))
            own.get("format")
        except (ValueError, AttributeError):
            raise CheckpointError(f"{path}: {quant_key} is not ComfyUI's layer JSON; the file is damaged") from None
    for conf in (own, info.layer_quant.get(layer)):
        if conf is not None and conf.get("format") not in MIXED_FORMATS:
            raise CheckpointError(f"{path}: layer {layer} is quantized as {conf.get('format')!r}; the engine loads "
                                  f"ComfyUI's mixed-precision layers in {LOADED_FORMATS}: use an fp8 or int8 release")
    return info.layer_quant.get(layer, own)


def _int8_layer(path, info, src, tinfo, scale, conf) -> int | None:
    """An int8 weight's ConvRot group (None: not rotated), its layer checked as detect checks the header's (a weight
    scale, a config naming int8_tensorwise, a group that divides its input width), configs from comfy_quant too."""
    layer = src[:-len(".weight")]
    if conf is None or conf.get("format") != INT8_FORMAT:
        raise CheckpointError(f"{path}: layer {layer} stores its weight as int8 but its format is "
                              f"{(conf or {}).get('format', 'not given')!r}, not {INT8_FORMAT}; the file is damaged")
    if scale is None:
        raise CheckpointError(f"{path}: layer {layer} is {INT8_FORMAT} but has no weight_scale; the file is damaged "
                              f"or incomplete")
    return int8_group(path, layer, conf, tuple(tinfo.shape))


def stream(path, where, info, mapping, expected, holding: Holding, device, stop=None,
           rows: dict | None = None, sink=None, int8_groups: dict | None = None) -> tuple[dict, dict, dict, int]:
    """Read each source tensor once (one at a time) and produce the diffusers tensors `mapping` makes of it: plain
    tensors (state), GGUF block rows for Linear weights (quantized: {name: (uint8 rows, type)}), and fp8_scaled
    factors (scales: {name: float32}, whole). rows: {diffusers name: (start, stop)}, the rows of dim 0 a rank holds
    of a tensor (weights divided among ranks, sharded.py): only those rows of its source are read (a fused tensor's
    slice's rows; a GGUF matrix's rows are whole blocks) and the tensor produced holds only them. sink(name, tensor):
    each plain tensor and GGUF block matrix is handed to it as it is read and not kept (a load into storage that
    exists already holds one tensor at a time beside it, not the state). An int8_tensorwise matrix is produced as the
    file stores it (int8; its weight_scale in scales, whole) and its ConvRot group (None: not rotated) put in
    int8_groups: the layer becomes an Int8Linear (wrap_quantized_linears)."""
    by_source: dict[str, list] = {}
    for dst, src, op in mapping:
        by_source.setdefault(src, []).append((dst, op))
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[torch.Tensor, str]] = {}
    scales: dict[str, torch.Tensor] = {}
    bytes_read = 0
    handles = {}

    def keep(into: dict, name: str, value: torch.Tensor) -> None:
        if sink is not None:
            sink(name, value)
        else:
            into[name] = value

    def handle(key):
        file, tinfo = where[key]
        if file not in handles:
            handles[file] = _open(file, where)
        return handles[file], tinfo

    def read(key):
        nonlocal bytes_read
        h, tinfo = handle(key)
        bytes_read += tinfo.end - tinfo.begin
        return h.get(key), tinfo

    def read_rows(key, start, stop):
        nonlocal bytes_read
        h, tinfo = handle(key)
        n = tinfo.shape[0] if tinfo.shape else 1
        bytes_read += (tinfo.end - tinfo.begin) * (stop - start) // max(n, 1)
        return h.get_rows(key, start, stop)

    try:
        for src, outs in by_source.items():
            if stop is not None and stop():
                raise LoadStopped(f"{path}: load stopped after {bytes_read} bytes")
            if LOAD_DELAY_S:
                time.sleep(LOAD_DELAY_S)
            key = info.prefix + src
            tinfo = where[key][1]
            blocks = tinfo.dtype in BLOCKS
            wanted = [None if rows is None else rows.get(dst) for dst, _ in outs]
            # a slice of rows is read alone where the op keeps rows in order (a tensor as it is, a fused tensor's
            # chunk) and the tensor's rows are whole (not a vector or kernel stored in blocks)
            whole = any(w is None for w in wanted) or any(isinstance(op, str) for _, op in outs) or (
                blocks and not (len(tinfo.shape) == 2 and src.endswith(".weight"))) or not tinfo.shape
            raw = read(key)[0] if whole else None
            scale_key = (info.prefix + src[:-len("weight")] + SCALE_KEYS[info.format][0][1:]
                         if src.endswith(".weight") and info.format in SCALE_KEYS else None)
            scale = read(scale_key)[0] if scale_key in where else None
            conf = _layer_config(path, where, info, src, scale_key, read)
            if conf is not None and conf.get("format") == INT8_FORMAT and tinfo.dtype != "I8":
                raise CheckpointError(f"{path}: layer {src[:-len('.weight')]} is {INT8_FORMAT} but its weight is "
                                      f"stored as {tinfo.dtype}, not int8; the file is damaged")
            # ComfyUI's int8_tensorwise: kept int8, with its scale and ConvRot group (see below)
            int8 = _int8_layer(path, info, src, tinfo, scale, conf) if tinfo.dtype == "I8" else False
            for (dst, op), w in zip(outs, wanted):
                try:
                    if raw is not None:
                        t = apply_op(raw, op)
                    else:
                        start = sum(op[2][:op[1]]) if isinstance(op, tuple) else 0
                        if isinstance(op, tuple) and sum(op[2]) != tinfo.shape[0]:
                            raise ValueError(f"cannot split {tinfo.shape[0]} rows into {list(op[2])}")
                        t = read_rows(key, start + w[0], start + w[1])
                except ValueError as e:   # a fused tensor whose rows do not add up
                    raise CheckpointError(f"{path}: tensor {src!r} has shape {list(tinfo.shape)}, which does not "
                                          f"give {dst}: {e}; the file is damaged or not the variant it seems") from None
                shape = ((t.shape[0] if t.ndim else 0,) + tuple(tinfo.shape[1:])) if blocks else tuple(t.shape)
                # what was read: the whole tensor, or only this rank's rows of it
                want = expected[dst] if raw is not None or w is None else (w[1] - w[0],) + tuple(expected[dst][1:])
                if shape != want:
                    raise CheckpointError(f"{path}: tensor {src!r} gives {dst} shape {list(shape)}, the model "
                                          f"expects {list(want)}")
                if blocks and not (len(shape) == 2 and dst.endswith(".weight")):
                    # a vector or a conv kernel in blocks (converters keep them float): expanded once
                    full = dequantize(t.to(device), tinfo.dtype, tuple(expected[dst])).to(holding.dtype(dst))
                    keep(state, dst, full if w is None else full[w[0]:w[1]].contiguous())
                    continue
                if raw is not None and w is not None:   # the whole source was read: this rank's rows of it
                    t = t[w[0]:w[1]]
                if int8 is not False:
                    # q as stored (a rank's rows of it), its weight_scale whole (one per row of the whole, or one)
                    if t.ndim != 2:
                        raise CheckpointError(f"{path}: {scale_key} scales {src}, which is not a matrix (shape "
                                              f"{list(t.shape)}); only Linear weights are int8")
                    scales[dst] = _scale_of(path, where, scale_key, info, scale, src, dst, op).to(device)
                    if int8_groups is not None:
                        int8_groups[dst] = int8
                    keep(state, dst, t.to(device).contiguous())
                    continue
                if blocks:
                    if sink is not None:
                        sink(dst, t.to(device).contiguous())
                    else:
                        quantized[dst] = (t.to(device).contiguous(), tinfo.dtype)
                    continue
                if scale is not None:   # fp8_scaled's scale_weight, fp8_mixed's weight_scale: kept whole
                    if t.ndim != 2:
                        raise CheckpointError(f"{path}: {scale_key} scales {src}, which is not a matrix "
                                              f"(shape {list(t.shape)}); only Linear weights are scaled")
                    scales[dst] = _scale_of(path, where, scale_key, info, scale, src, dst, op).to(device)
                held = holding.dtype(dst, t.dtype) if t.is_floating_point() else t.dtype
                keep(state, dst, t.to(device=device, dtype=held).contiguous())
            del raw
    finally:
        for h in handles.values():
            h.close()
    return state, quantized, scales, bytes_read


def int8_count(where, info, mapping) -> int:
    """The model's matrices read from int8_tensorwise weights (held int8: Int8Linear) of `mapping`'s."""
    return sum(1 for _, src, _ in mapping if where[info.prefix + src][1].dtype == "I8")


def install_quantized(model: torch.nn.Module, quantized: dict, compute: torch.dtype) -> int:
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


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this process holds (meta tensors hold none; of weights divided among ranks, this rank's
    share)."""
    tensors = [getattr(t, "_local_tensor", t) for t in list(model.parameters()) + list(model.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def wrap_quantized_linears(model: torch.nn.Module, scales: dict[str, torch.Tensor] | None = None,
                     int8_groups: dict | None = None) -> int:
    """Every Linear with an fp8 weight, or an fp8_scaled scale, becomes a CastLinear; every Linear with an int8 weight
    an Int8Linear (its weight_scale from `scales`, its ConvRot group from `int8_groups`)."""
    scales, int8_groups = scales or {}, int8_groups or {}
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            key = f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight"
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.int8:
                setattr(parent, name, Int8Linear(child, scales[key], int8_groups.get(key)))
            elif isinstance(child, torch.nn.Linear) and (child.weight.dtype in FP8 or key in scales):
                setattr(parent, name, CastLinear(child, scales.get(key)))
                count += 1
    return count
