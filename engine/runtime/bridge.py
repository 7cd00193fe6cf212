"""Shared-memory tensor bridge: tensors cross between the client and the ranks as raw bytes in tmpfs.

Each engine owns one private directory under /dev/shm (mode 0700). A segment is one file in it holding
several tensors back to back (64-byte aligned); a small manifest (names, dtypes, shapes, offsets,
crc32) travels over the control channel. Whoever reads a segment last unlinks it; the directory goes
with the engine, and the ranks remove it themselves if the client dies.
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import warnings
import zlib

import torch

from .. import syncs

ALIGN = 64
DIR_PREFIX = "xdit-"
SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensor dtype {dtype} cannot cross the bridge; supported: {sorted(DTYPES)}") from None


def make_engine_dir() -> str:
    """A private (0700) directory for one engine's segments and rendezvous file."""
    path = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=SHM_ROOT)
    with open(os.path.join(path, "owner"), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove_engine_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _dir_owner(path: str) -> int | None:
    """The pid that made engine directory `path` (None when unreadable)."""
    try:
        with open(os.path.join(path, "owner")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def engine_dirs(owner: int | None = None) -> set[str]:
    """Names of the engine directories under SHM_ROOT; with `owner`, only those that process made."""
    names = {n for n in os.listdir(SHM_ROOT) if n.startswith(DIR_PREFIX)}
    if owner is None:
        return names
    return {n for n in names if _dir_owner(os.path.join(SHM_ROOT, n)) == owner}


def sweep_stale_dirs() -> list[str]:
    """Remove engine directories whose owning process is gone (left by a machine-wide crash)."""
    removed = []
    for name in engine_dirs():
        path = os.path.join(SHM_ROOT, name)
        owner = _dir_owner(path)
        try:
            if owner is None or os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _pid_alive(owner):
            remove_engine_dir(path)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _as_bytes(t: torch.Tensor):
    """The tensor's bytes as a flat uint8 view (a copy only if it was not contiguous on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() and t.stride(0) != 1:  # a one-element view of a broadcast value: "contiguous", stride 0
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return t.view(torch.uint8).numpy()


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], int]:
    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bridge input {name!r} is a {type(t).__name__}, not a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def checksum(data, seed: int = 0) -> int:
    return zlib.crc32(data, seed)


def write_segment(path: str, tensors: dict[str, torch.Tensor], *, seed: int = 0) -> dict:
    """Write tensors into a new segment file; return its manifest (crc32 chained from `seed`)."""
    entries, total = layout(tensors)
    crc = seed
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, total)
        for entry, t in zip(entries, tensors.values()):
            data = memoryview(_as_bytes(t))
            crc = zlib.crc32(data, crc)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], entry["offset"] + done)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)
    return {"path": path, "entries": entries, "nbytes": total, "crc32": crc}


def write_segment_in_place(path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """write_segment without a staging copy: the segment is mapped and each tensor copied into it once (from a device,
    that one copy is the download), then its crc32 read from the mapping."""
    entries, total = layout(tensors)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        mapped = mmap.mmap(fd, total, access=mmap.ACCESS_WRITE) if total else None
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)
    crc = 0
    if mapped is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf = syncs.in_host_memory(torch.frombuffer(mapped, dtype=torch.uint8))
        for entry, t in zip(entries, tensors.values()):
            view = buf[entry["offset"]:entry["offset"] + entry["nbytes"]].view(t.dtype).reshape(t.shape)
            view.copy_(t.detach())
        data = buf.numpy()
        for e in entries:
            crc = zlib.crc32(memoryview(data[e["offset"]:e["offset"] + e["nbytes"]]), crc)
    return {"path": path, "entries": entries, "nbytes": total, "crc32": crc}


def map_buffer(manifest: dict, *, unlink: bool = False) -> torch.Tensor:
    """The whole segment as one uint8 CPU tensor, mapped copy-on-write: no copy is made, writes stay
    private, and the memory lives exactly as long as the tensor (unlinking the name does not free it)."""
    size = manifest["nbytes"]
    path = manifest["path"]
    try:
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise EOFError(f"segment {path} holds {actual} bytes, its manifest says {size}")
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
    finally:
        if unlink:
            unlink_quietly(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers; ACCESS_COPY is writable
        return torch.frombuffer(mapped, dtype=torch.uint8)


def tensors_from_buffer(buf: torch.Tensor, manifest: dict) -> dict[str, torch.Tensor]:
    """Typed views into a segment buffer, one per manifest entry."""
    out = {}
    for e in manifest["entries"]:
        raw = buf[e["offset"]:e["offset"] + e["nbytes"]]
        out[e["name"]] = raw.view(DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def payload_crc(buf: torch.Tensor, manifest: dict, seed: int = 0) -> int:
    """crc32 over the tensors' bytes in manifest order (alignment padding excluded)."""
    crc = seed
    data = buf.numpy()
    for e in manifest["entries"]:
        crc = zlib.crc32(memoryview(data[e["offset"]:e["offset"] + e["nbytes"]]), crc)
    return crc


def read_segment(manifest: dict) -> dict[str, torch.Tensor]:
    """Map a segment, unlink its name at once, and return its tensors (views of the mapping)."""
    return tensors_from_buffer(map_buffer(manifest, unlink=True), manifest)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
