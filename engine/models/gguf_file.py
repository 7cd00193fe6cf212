"""A GGUF file (city96's ComfyUI-GGUF quantizations of the engine's families), validated before anything is loaded,
then read with the `gguf` package.

The header is parsed here first, byte by byte with bounds checks, so that a truncated, damaged or lying file fails
with one line naming the file, the tensor and the numbers (the gguf package would fail inside numpy, or map
garbage). Only then does gguf.GGUFReader map the file; its view of every tensor must agree with ours.
"""
from __future__ import annotations

import os
import struct
import warnings

import torch

from .. import families
from .quantized import BLOCKS, FLOATS, SUPPORTED, quantized_bytes
from .safetensors_file import CheckpointError, TensorInfo

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 5       # ggml's 4, and ComfyUI-GGUF's 5-D video patch embeddings (tools/fix_5d_tensors.py)
# value type id -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
TYPE_NAMES = {v[0]: k for k, v in {**BLOCKS, **FLOATS}.items()}
KNOWN_TYPES = {**TYPE_NAMES, 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
               18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
               26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


def is_gguf(path: str) -> bool:
    """A .gguf name or the GGUF magic (a .gguf name with another magic is then refused by read_gguf_header)."""
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


MAX_HEADER_BYTES = 64 << 20   # a real transformer file's header is well under a megabyte


class _Bytes:
    """A cursor over the header bytes, read from the file as needed, that names what it was reading when the file
    (or the header limit) ends."""

    def __init__(self, name: str, f, size: int):
        self.name, self.f, self.size, self.at = name, f, size, 0
        self.data = f.read(min(size, 1 << 20))

    def take(self, n: int, what: str) -> bytes:
        if n > 0 and self.at + n > len(self.data) and len(self.data) < min(self.size, MAX_HEADER_BYTES):
            want = min(max(2 * len(self.data), self.at + n), self.size, MAX_HEADER_BYTES)
            self.data += self.f.read(want - len(self.data))
        if n < 0 or self.at + n > len(self.data):
            held = f"the file has {self.size}" if len(self.data) == self.size else \
                f"a header is read only up to {len(self.data)}"
            raise CheckpointError(f"{self.name} is truncated or its header is damaged: reading {what} at byte "
                                  f"{self.at} needs {n} bytes but {held}; download it again")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.name}: the header is damaged: {what} at byte {self.at - n} is not UTF-8 text")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in SCALARS:
            return self.unpack(SCALARS[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9 and depth < 2:
            etype, count = self.unpack("<I", f"the type of {what}"), self.unpack("<Q", f"the length of {what}")
            if etype in SCALARS:  # skipped in one step: arrays (tokenizer tables) can be long
                self.take(count * struct.calcsize(SCALARS[etype]), f"{what} ({count} values)")
                return None
            for _ in range(count):  # each element takes bytes: a lying count runs out of file, which take() names
                self.value(etype, what, depth + 1)
            return None
        raise CheckpointError(f"{self.name}: the header is damaged: {what} has value type {vtype}, which GGUF does not "
                              f"define")


def read_gguf_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a GGUF header; return {name: TensorInfo} (dtype: the GGUF type name, shape in torch order,
    begin/end: absolute file offsets) and the metadata: string values, plus `gguf.architecture`."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"model file {path!r} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24:
            raise CheckpointError(f"{name} is not a GGUF file (or is truncated): it has only {size} bytes, a GGUF "
                                  f"header starts with 24")
        if head[:4] != MAGIC:
            raise CheckpointError(f"{name} is not a GGUF file: it starts with {head[:4]!r}, a GGUF file with "
                                  f"{MAGIC!r}; is it a .safetensors file with the wrong name, or damaged?")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version not in VERSIONS:
            raise CheckpointError(f"{name}: GGUF version {version} is not supported (supported: {list(VERSIONS)}); "
                                  f"the header is damaged or the file is from an old converter")
        # a tensor entry takes at least 8 (name length) + 4 (dims) + 8 (one dim) + 4 (type) + 8 (offset) bytes
        if n_tensors * 32 > size or n_kv * 12 > size:
            raise CheckpointError(f"{name}: the header lies: it declares {n_tensors} tensors and {n_kv} metadata "
                                  f"entries, more than a file of {size} bytes can hold; the file is damaged")
        f.seek(0)
        tensors, metadata = _parse(name, _Bytes(name, f, size), size, n_tensors, n_kv)
    return tensors, metadata


def _parse(name: str, cur: _Bytes, size: int, n_tensors: int, n_kv: int):
    cur.at = 24
    metadata: dict[str, str] = {}
    arrays: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        vtype = cur.unpack("<I", f"the type of {key!r}")
        value = cur.value(vtype, f"metadata {key!r}")
        if vtype == 9:
            arrays.add(key)
        elif key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise CheckpointError(f"{name}: general.alignment is {value!r} (type {vtype}); it must be a uint32 "
                                      f"power of two")
            alignment = value
        elif isinstance(value, str):
            metadata[key] = value
    raw = []
    for i in range(n_tensors):
        tname = cur.string(f"the name of tensor {i}")
        n_dims = cur.unpack("<I", f"the rank of tensor {tname!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{name}: the header lies about tensor {tname!r}: {n_dims} dimensions (GGUF holds "
                                  f"1 to {MAX_DIMS})")
        dims = [cur.unpack("<Q", f"the shape of tensor {tname!r}") for _ in range(n_dims)]
        ttype = cur.unpack("<I", f"the type of tensor {tname!r}")
        offset = cur.unpack("<Q", f"the offset of tensor {tname!r}")
        raw.append((tname, dims, ttype, offset))
    data_start = -(-cur.at // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for tname, dims, ttype, offset in raw:
        if tname in tensors:
            raise CheckpointError(f"{name}: the header names tensor {tname!r} twice; the file is damaged")
        if ttype not in TYPE_NAMES:
            raise CheckpointError(f"{name}: tensor {tname!r} is stored as {KNOWN_TYPES.get(ttype, f'type {ttype}')}, "
                                  f"which is not supported (supported: {', '.join(SUPPORTED)}); use a file quantized "
                                  f"to one of those")
        qtype = TYPE_NAMES[ttype]
        block = BLOCKS[qtype][1] if qtype in BLOCKS else 1
        if dims[0] % block or any(d == 0 for d in dims):
            raise CheckpointError(f"{name}: the header lies about tensor {tname!r}: shape {list(reversed(dims))} in "
                                  f"{qtype} needs rows of whole {block}-value blocks")
        shape = tuple(int(d) for d in reversed(dims))
        nbytes = quantized_bytes(qtype, shape)
        if offset % alignment:
            raise CheckpointError(f"{name}: the header lies about tensor {tname!r}: its offset {offset} is not a "
                                  f"multiple of the file's alignment {alignment}")
        begin = data_start + offset
        if begin + nbytes > size:
            raise CheckpointError(f"{name} is truncated: tensor {tname!r} ({qtype} {list(shape)}, {nbytes} bytes) "
                                  f"ends at byte {begin + nbytes} but the file has {size} bytes; download it again")
        tensors[tname] = TensorInfo(qtype, shape, begin, begin + nbytes)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items())
    for (b0, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{name}: the header lies: tensor {k1!r} starts at byte {b1}, inside tensor {k0!r} "
                                  f"(bytes {b0} to {e0}); the file is damaged")
    if not tensors:
        raise CheckpointError(f"{name} holds no tensors")
    reshaped = sorted(k for k in arrays if k.startswith("comfy.gguf.orig_shape."))
    if reshaped:
        raise CheckpointError(f"{name}: {len(reshaped)} tensors are stored reshaped ({reshaped[0]}); ComfyUI-GGUF "
                              f"does that only for UNet models, not diffusion transformers")
    arch = metadata.get("general.architecture")
    arches = [a for f in families.FAMILIES for a in f.gguf_arches]
    if arch is not None and arch not in arches:
        raise CheckpointError(f"{name} is a GGUF of architecture {arch!r}, not a transformer the engine runs "
                              f"(supported: {', '.join(arches)})")
    metadata["gguf.architecture"] = arch or ""
    return tensors, metadata


class GGUFTensors:
    """Tensors of a validated GGUF file, through gguf.GGUFReader (memory-mapped: only what is asked for is read).
    get() returns float types as torch tensors in their own dtype and block types as uint8 rows of blocks."""

    def __init__(self, path: str, header: dict[str, TensorInfo]):
        import gguf
        self.name, self.path, self._raw = os.path.basename(path), path, None
        try:
            reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # the header was checked above: this is a disagreement, said in one line
            raise CheckpointError(f"{self.name}: the gguf package cannot read it ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in reader.tensors}
        for key, info in header.items():
            t = self.tensors.get(key)
            if t is None or t.tensor_type.name != info.dtype or int(t.data_offset) != info.begin:
                raise CheckpointError(f"{self.name}: the gguf package reads tensor {key!r} differently from its header "
                                      f"({info.dtype} at byte {info.begin}); the file is damaged")
        self.header = header

    def get(self, key: str) -> torch.Tensor:
        info, t = self.header[key], self.tensors[key]
        with warnings.catch_warnings():   # the map is read-only; the copy below is what we keep
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(t.data).clone()
        if info.dtype in FLOATS:
            return raw.view(torch.uint8).view(FLOATS[info.dtype][1]).reshape(info.shape)
        return raw.reshape(*info.shape[:-1], -1)

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor's dim 0 (a block type's: whole rows of blocks), read alone with a plain read
        of their bytes (not through the map: a rank copying them into its share never holds their file pages too)."""
        info, t = self.header[key], self.tensors[key]
        rows = int(info.shape[0]) if info.shape else 1
        row_bytes = int(t.n_bytes) // max(rows, 1)
        raw = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        if raw.numel():
            if self._raw is None:
                self._raw = open(self.path, "rb")
            self._raw.seek(int(t.data_offset) + start * row_bytes)
            if self._raw.readinto(memoryview(raw.numpy())) != raw.numel():
                raise CheckpointError(f"{self.name}: tensor {key!r} ends before rows {start}:{stop}; the file is "
                                      f"truncated or damaged")
        if info.dtype in FLOATS:
            return raw.view(FLOATS[info.dtype][1]).reshape(stop - start, *info.shape[1:])
        return raw.reshape(stop - start, *info.shape[1:-1], -1)

    def close(self) -> None:
        self.tensors = {}   # the reader's memory map goes with its last view
        if self._raw is not None:
            self._raw.close()


def find_gguf_files(folders: list[str]) -> dict[str, str]:
    """{name relative to its folder: full path} of the .gguf files under `folders` (the first folder wins a name),
    for the ComfyUI node's model list: ComfyUI lists only its own extensions in diffusion_models."""
    found: dict[str, str] = {}
    for base in folders:
        if not os.path.isdir(base):
            continue
        for root, dirs, files in os.walk(base, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in sorted(files):
                if f.lower().endswith(".gguf"):
                    full = os.path.join(root, f)
                    found.setdefault(os.path.relpath(full, base).replace(os.sep, "/"), full)
    return found
