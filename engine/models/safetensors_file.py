"""A safetensors file, validated before anything is loaded: magic, header, dtypes, offsets, file size.

safetensors' own reader fails late and vaguely on a truncated or lying file (or maps garbage); these
checks name the file, the tensor and the numbers, before any rank spends time on it.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What a file that is not safetensors often is, by its first bytes (said instead of a nonsense header size)
OTHER_FORMATS = ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"RIFF", "a RIFF (WebP/WAV) file"),
                 (b"PK\x03\x04", "a zip archive (a .pt/.ckpt PyTorch file is one; use the .safetensors release)"),
                 (b"\x80", "a Python pickle (a .pt/.ckpt file; use the .safetensors release)"))


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header; return {name: TensorInfo} and the metadata."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"model file {path!r} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{name} is not a safetensors file: it has only {size} bytes")
        (n_header,) = struct.unpack("<Q", head)
        if n_header > MAX_HEADER_BYTES or n_header > size - 8:
            kind = next((k for magic, k in OTHER_FORMATS if head.startswith(magic)), None)
            raise CheckpointError(
                f"{name} is {kind}, not a safetensors file" if kind else
                f"{name} is not a safetensors file (or is truncated): its first 8 bytes declare a "
                f"{n_header}-byte header but the file has {size} bytes; checkpoints are read from .safetensors and "
                f".gguf files (.ckpt/.pt are not)")
        raw = f.read(n_header)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name} is not a safetensors file: its header is not JSON ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{name}: the header's __metadata__ is not an object of strings: {str(metadata)[:80]}; "
                              f"the file is damaged")
    data_bytes = size - 8 - n_header
    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        try:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) \
                    or len(offsets) != 2 or not all(_is_int(v) for v in shape + offsets):
                raise TypeError
            shape, (begin, end) = tuple(shape), offsets
        except (KeyError, TypeError):
            raise CheckpointError(f"{name}: header entry {key!r} is malformed: {str(entry)[:120]}; the file is "
                                  f"damaged") from None
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{name}: tensor {key!r} has dtype {dtype!r}, which is not supported "
                                  f"(supported: {sorted(TORCH_DTYPES)})")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{name}: header lies about tensor {key!r}: shape {list(shape)} has a negative size")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * DTYPE_SIZES[dtype] or begin < 0:
            raise CheckpointError(f"{name}: header lies about tensor {key!r}: shape {list(shape)} {dtype} needs "
                                  f"{numel * DTYPE_SIZES[dtype]} bytes but its offsets [{begin}, {end}] span {end - begin}")
        if end > data_bytes:
            raise CheckpointError(f"{name} is truncated: tensor {key!r} ends at byte {end} of the data section but "
                                  f"the file holds only {data_bytes} data bytes ({size} bytes in all); download it again")
        tensors[key] = TensorInfo(dtype, shape, begin, end)
    at = 0   # the tensors tile the data section exactly, in offset order (what safetensors' own reader requires)
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            what = f"overlaps the previous tensor (which ends at {at})" if t.begin < at else \
                f"leaves a gap of {t.begin - at} bytes after byte {at}"
            raise CheckpointError(f"{name}: header lies about tensor {key!r}: its data starts at byte {t.begin} and "
                                  f"{what}; the file is damaged")
        at = t.end
    if tensors and at != data_bytes:
        raise CheckpointError(f"{name}: the header accounts for {at} data bytes but the file holds {data_bytes} "
                              f"after it; the file is damaged or has bytes appended")
    if not tensors:
        raise CheckpointError(f"{name} holds no tensors")
    return tensors, metadata
