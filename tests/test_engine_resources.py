"""Resources: sequential jobs leak no shared memory or descriptors; nothing listens off loopback."""
import os
import stat

import torch

from engine.runtime import bridge
from engine.runtime.client import Engine

from engine.runtime.bridge import engine_dirs
from conftest import FAST


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_200_sequential_jobs_leave_no_growth_in_shared_memory_or_descriptors():
    with Engine(2, device="cpu", deadlines=FAST) as e:
        x = {"noise": torch.randn(1, 16, 32, 32), "cond": torch.randn(1, 256, 512).bfloat16()}
        for _ in range(5):  # warm-up: allocator and gloo buffers settle
            e.submit("echo", {"return_rank": 1}, x)
        before_files = sorted(os.listdir(e.engine_dir))
        before_dirs = engine_dirs(owner=os.getpid())
        before_fds = {pid: open_fds(pid) for pid in [os.getpid()] + e.pids}
        for i in range(200):
            out = e.submit("echo", {"return_rank": i % 2}, x).outputs
            assert torch.equal(out["noise"], x["noise"])
            del out
        after_fds = {pid: open_fds(pid) for pid in [os.getpid()] + e.pids}
        print(f"engine dir before {before_files} after {sorted(os.listdir(e.engine_dir))}; fds before {before_fds} "
              f"after {after_fds}")
        assert sorted(os.listdir(e.engine_dir)) == before_files
        assert engine_dirs(owner=os.getpid()) == before_dirs
        assert after_fds == before_fds


def test_engine_directory_is_private():
    with Engine(1, device="cpu", deadlines=FAST) as e:
        mode = stat.S_IMODE(os.stat(e.engine_dir).st_mode)
        assert mode == 0o700, oct(mode)
        assert os.stat(e.engine_dir).st_uid == os.getuid()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening(inodes: set[str]) -> list[str]:
    """Local addresses (hex, as /proc shows them) of TCP/UDP sockets among `inodes` that listen or are bound."""
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if inode in inodes and (state == "0A" or table.startswith("udp")):
                    found.append(f"{table} {local}")
    return found


def _is_loopback(entry: str) -> bool:
    table, local = entry.split()
    addr = local.split(":")[0]
    if table.endswith("6"):
        return addr in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
    return addr.endswith("7F")  # 127.x.x.x, little-endian hex


def test_nothing_listens_on_a_network_interface_other_than_loopback():
    with Engine(2, device="cpu", deadlines=FAST) as e:
        e.submit("echo", {}, {"x": torch.ones(4)})
        listeners = []
        for pid in [os.getpid()] + e.pids:
            listeners += _listening(_socket_inodes(pid))
        print("listening sockets of client and ranks:", listeners)
        assert all(_is_loopback(entry) for entry in listeners), listeners


def test_stale_directories_of_dead_owners_are_swept():
    path = bridge.make_engine_dir()
    with open(os.path.join(path, "owner"), "w") as f:
        f.write("999999999")  # no such pid
    open(os.path.join(path, "j1-in"), "wb").close()
    assert path in bridge.sweep_stale_dirs()
    assert not os.path.exists(path)
