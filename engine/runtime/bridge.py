"""Shared-memory tensor bridge: tensors cross between the client and the ranks as raw bytes in tmpfs.

Each engine owns one private directory under /dev/shm (mode 0700). A segment is one file in it holding
several tensors back to back (64-byte aligned); a small manifest (names, dtypes, shapes, offsets; for a
job's inputs, which every rank verifies, their crc32) travels over the control channel. Whoever reads a
segment last unlinks it; a session's answers reuse one segment (OutputSegment); the directory goes
with the engine, and the ranks remove it themselves if the client dies.
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import warnings
import zlib

import numpy
import torch

from .. import syncs
from ..errors import EngineError

ALIGN = 64
DIR_PREFIX = "xdit-"
SHM_DIR_ENV = "XDIT_SHM_DIR"   # where the engines' segments live, if not /dev/shm (e.g. a larger tmpfs of one's own)
SHM_ROOT = os.environ.get(SHM_DIR_ENV) or (
    "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())

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


class SharedMemoryFull(EngineError):
    """The shared-memory filesystem cannot hold what a job or call must write: one line with the bytes and the fix."""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def shm_full(what: str, nbytes: int, directory: str = SHM_ROOT) -> SharedMemoryFull:
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return SharedMemoryFull(f"{what} needs {_mib(nbytes)} of shared memory in {directory}, which has {_mib(free)} free "
                            f"of {_mib(total)}: give the container more (docker run --shm-size=16g, shm_size in "
                            f"compose, or an emptyDir of medium Memory at /dev/shm on Kubernetes) or free space there",
                            phase="sent")


def check_room(what: str, nbytes: int, directory: str = SHM_ROOT) -> None:
    """Before writing: refuse in one line when the shared-memory filesystem cannot hold `nbytes` more (a container's
    /dev/shm is often 64 MB), instead of a full tmpfs failing the write, or a rank's mapped write dying of SIGBUS."""
    st = os.statvfs(directory)
    if nbytes > st.f_bavail * st.f_frsize:
        raise shm_full(what, nbytes, directory)


def _reserve(fd: int, total: int, path: str) -> None:
    """Give a new segment its pages now (ENOSPC here, as one line, rather than SIGBUS on a mapped write later)."""
    try:
        os.posix_fallocate(fd, 0, total) if total else None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise shm_full(f"segment {os.path.basename(path)}", total, os.path.dirname(path)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # a filesystem without fallocate: truncate as before
            raise
        os.ftruncate(fd, total)


def checksum(data, seed: int = 0) -> int:
    return zlib.crc32(data, seed)


def write_segment(path: str, tensors: dict[str, torch.Tensor], *, seed: int = 0, checksum: bool = True) -> dict:
    """Write tensors into a new segment file; return its manifest (with `checksum`, its crc32 chained from `seed`: a
    job's inputs, which every rank verifies; a session's calls and the ranks' outputs are not checked, so not summed)."""
    entries, total = layout(tensors)
    crc = seed
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        _reserve(fd, total, path)
        for entry, t in zip(entries, tensors.values()):
            data = memoryview(_as_bytes(t))
            if checksum:
                crc = zlib.crc32(data, crc)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], entry["offset"] + done)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)
    return {"path": path, "entries": entries, "nbytes": total, **({"crc32": crc} if checksum else {})}


class OutputSegment:
    """One segment a rank writes a session's answers into, call after call: mapped once and grown when an answer needs
    more, so a call's output costs its one copy (from a device, the download) and no new tmpfs pages. The reader
    copies each answer out before it asks for the next call (`copy_segment`), so nothing is overwritten while read."""

    def __init__(self, path: str):
        self.path = path
        self._mapped: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None
        self._size = 0

    @property
    def capacity(self) -> int:
        """Bytes the segment holds already (an answer up to this size takes no new shared memory)."""
        return self._size

    def write(self, tensors: dict[str, torch.Tensor]) -> dict:
        entries, total = layout(tensors)
        if total > self._size:
            self.close(unlink=False)
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                _reserve(fd, total, self.path)
                self._mapped = mmap.mmap(fd, total, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
            self._size = total
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._buf = syncs.in_host_memory(torch.frombuffer(self._mapped, dtype=torch.uint8))
        for entry, t in zip(entries, tensors.values()):
            view = self._buf[entry["offset"]:entry["offset"] + entry["nbytes"]].view(t.dtype).reshape(t.shape)
            view.copy_(t.detach())
        return {"path": self.path, "entries": entries, "nbytes": total, "reused": True}

    def close(self, unlink: bool = True) -> None:
        self._buf = None
        if self._mapped is not None:
            try:
                self._mapped.close()
            except BufferError:   # a view is still alive somewhere: the mapping goes with it
                pass
            self._mapped = None
        self._size = 0
        if unlink:
            unlink_quietly(self.path)


def copy_segment(manifest: dict) -> dict[str, torch.Tensor]:
    """The tensors of a segment its writer reuses (OutputSegment), each copied out into memory of its own."""
    out = {}
    if not manifest["nbytes"]:
        return {e["name"]: torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in manifest["entries"]}
    fd = os.open(manifest["path"], os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < manifest["nbytes"]:
            raise EOFError(f"segment {manifest['path']} holds {os.fstat(fd).st_size} bytes, its manifest says "
                           f"{manifest['nbytes']}")
        mapped = mmap.mmap(fd, manifest["nbytes"], access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        for e in manifest["entries"]:
            t = torch.empty(e["shape"], dtype=DTYPES[e["dtype"]])
            if e["nbytes"]:
                source = numpy.frombuffer(mapped, dtype=numpy.uint8, count=e["nbytes"], offset=e["offset"])
                t.reshape(-1).view(torch.uint8).numpy()[:] = source
                del source   # no view of the mapping may outlive it
            out[e["name"]] = t
    finally:
        mapped.close()
    return out


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
