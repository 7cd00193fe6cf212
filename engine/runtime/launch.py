"""Rank processes: their environment, how one is spawned with its control channel, and the hard stop."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from . import bridge
from .protocol import Channel

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MMAP_THRESHOLD_BYTES = 2 ** 20


# benchmark switches a rank reads from its environment, which change what a job computes: taken only from what the
# caller hands the engine (Engine(env=...): `bench guider`), never inherited from the environment it runs in
BENCHMARK_SWITCHES = ("XDIT_FORWARD_STUB",)


def rank_env(gpus: list[int] | None) -> dict[str, str]:
    """The ranks' environment: the engine importable by path, collectives on loopback, the engine's GPUs only, no
    benchmark switch the caller's environment holds, and on GPUs the CUDA allocator set against fragmentation."""
    env = {k: v for k, v in os.environ.items() if k not in BENCHMARK_SWITCHES}
    # Subprocesses must find the engine even when the pack is not on sys.path (ComfyUI imports by path).
    env["PYTHONPATH"] = os.pathsep.join([PACK_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")   # a local engine talks over loopback only
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # glibc raises its mmap threshold to the size of each large block freed, after which blocks of that size come from
    # the heap and their memory is kept when freed: a rank that gathers each block's weights (a sharded plan) and frees
    # them after would keep growing to the whole model's size in host memory. A fixed threshold (1 MiB) gives every
    # larger buffer back when it is freed. A value the user set is kept.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        # a rank's allocations change size from block to block (divided weights gathered and freed, a ring's buffers,
        # per-call dense copies of quantized layers): segments that grow in place instead of new fixed blocks keep the
        # freed memory usable for the next size. A setting the user made is kept.
        if "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def cpu_sets(ranks: int) -> list[list[int]]:
    """Disjoint sets of this process's allowed CPU cores, one per rank, as even as possible (the first ranks get the
    extra cores): what `Engine(pin_cpus=True)` pins its CPU ranks to. Raises ValueError with fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"pin_cpus needs a core per rank: {ranks} ranks, {len(cores)} core(s) allowed here "
                         f"({','.join(map(str, cores))}); use at most {len(cores)} ranks or pin_cpus=False")
    base, extra = divmod(len(cores), ranks)
    out, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        out.append(cores[start:start + n])
        start += n
    return out


def pin_process(cores: list[int]) -> None:
    """Every thread of this process, and every thread it starts later, on `cores` only. The threads already running
    (torch's pools) are pinned one by one: a process's affinity is per thread on Linux."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass   # a thread that ended meanwhile
    os.sched_setaffinity(0, cores)


def spawn_rank(env: dict[str, str], pgid: int, log_path: str | None) -> tuple[subprocess.Popen, Channel]:
    """Start `python -m engine.runtime.rank` in process group `pgid` (0: a new one it leads), its control channel an
    inherited socketpair; stdout and stderr go to `log_path` (None: inherited)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log = open(log_path, "wb") if log_path else None
    stdio = {"stdout": log, "stderr": subprocess.STDOUT} if log else {}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "engine.runtime.rank", "--fd", str(child_sock.fileno())],
                                pass_fds=(child_sock.fileno(),), env=env, cwd=PACK_ROOT, stdin=subprocess.DEVNULL,
                                process_group=pgid, **stdio)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
        if log:
            log.close()
    return proc, Channel(parent_sock)


def log_tail(engine_dir: str | None, rank: int, lines: int = 15) -> str:
    """The last lines of a rank's log, for an error message ("" when there is none)."""
    if not engine_dir:
        return ""
    try:
        with open(os.path.join(engine_dir, f"rank{rank}.log"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n--- rank %d log (last lines) ---\n" % rank + "\n".join(text)) if text else ""


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of `pid` from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[2])


def pid_gone(pid: int) -> bool:
    """True once pid is gone or a zombie (killed, waiting only to be reaped)."""
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def kill_all(procs: list, chans: list, engine_dir: str | None) -> None:
    """Hard stop: SIGKILL every rank we have not reaped (a zombie keeps its pid, so this never hits a
    stranger), close channels, remove shared memory. Also the finalizer for a forgotten Engine."""
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    for c in chans:
        c.close()
    if engine_dir:
        bridge.remove_engine_dir(engine_dir)


