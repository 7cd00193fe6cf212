"""Shared memory that cannot hold a job: a container's /dev/shm is often 64 MB. What the client writes is checked
before anything is written, and refused in one line naming the bytes and how to give a container more; a rank's answer
segment takes its pages before it is written through its mapping, so a full tmpfs is an error report, never a rank
dying of SIGBUS; the rank group stays up either way."""
import errno
import os
import types

import pytest
import torch

from engine.runtime import bridge
from engine.runtime.client import Engine

from conftest import FAST


def small_shm(monkeypatch, free_mib: float, total_mib: float = 64.0):
    """This process sees a shared-memory filesystem of total_mib with free_mib free (the ranks see the real one)."""
    real = os.statvfs

    def statvfs(path):
        if str(path).startswith(bridge.SHM_ROOT):
            return types.SimpleNamespace(f_bavail=int(free_mib * 256), f_frsize=4096, f_blocks=int(total_mib * 256))
        return real(path)
    monkeypatch.setattr(os, "statvfs", statvfs)


def test_a_job_or_call_too_large_for_shared_memory_is_refused_in_one_line_and_the_engine_stays(monkeypatch):
    with Engine(2, device="cpu", deadlines=FAST) as e:
        small_shm(monkeypatch, free_mib=3)
        big = torch.zeros(1024, 1024)   # 4 MiB
        with pytest.raises(bridge.SharedMemoryFull) as info:
            e.submit("echo", {}, {"x": big})
        message = str(info.value)
        print(message)
        assert "\n" not in message and "4.0 MiB" in message and "3.0 MiB free of 64.0 MiB" in message
        assert "--shm-size" in message and not e.restarts
        with e.session("echo_calls", {}, {}) as s:
            with pytest.raises(bridge.SharedMemoryFull, match="a call of job"):
                s.call({"x": big})
            assert s.call({"x": torch.ones(4)}, scale=2.0)["x"].tolist() == [2.0] * 4   # the session goes on
        monkeypatch.undo()
        assert torch.equal(e.submit("echo", {}, {"x": big}).outputs["x"], big) and not e.restarts


def test_an_answer_segment_that_cannot_take_its_pages_raises_one_line(tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    segment = bridge.OutputSegment(str(tmp_path / "answers"))
    with pytest.raises(bridge.SharedMemoryFull) as info:
        segment.write({"out": torch.zeros(256, 256)})
    assert "256.0 KiB" not in str(info.value) and "0.2 MiB" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.undo()
    first = segment.write({"out": torch.full((4,), 3.0)})
    grown = segment.write({"out": torch.arange(1024.0)})
    assert first["reused"] and segment.capacity == grown["nbytes"]
    assert torch.equal(bridge.copy_segment(grown)["out"], torch.arange(1024.0))
    segment.close()
    assert not os.path.exists(tmp_path / "answers")


# Run by the ranks before anything else (a sitecustomize on their path): the OS refuses to give a file pages past
# 2 MiB, as a full tmpfs does (ENOSPC from posix_fallocate), without a tmpfs of that size to mount (which needs root).
FULL_SHM = """import errno, os
_fallocate = os.posix_fallocate
def posix_fallocate(fd, offset, length):
    if offset + length > 2 * 2 ** 20:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _fallocate(fd, offset, length)
os.posix_fallocate = posix_fallocate
"""


def test_a_rank_whose_answer_finds_shared_memory_full_reports_it_and_the_group_stays(tmp_path):
    """A rank's answer segment cannot take its pages (its posix_fallocate fails with ENOSPC past 2 MiB, as on a full
    tmpfs): the call ends in one error naming the shared memory, never a rank dead of SIGBUS, and the same rank group
    answers the next job."""
    from engine.runtime.launch import rank_env
    (tmp_path / "sitecustomize.py").write_text(FULL_SHM)
    path = os.pathsep.join([str(tmp_path), rank_env(None)["PYTHONPATH"]])
    with Engine(2, device="cpu", deadlines=FAST, env={"PYTHONPATH": path}) as e:
        x = torch.randn(640 * 1024)   # 2.5 MiB: the answer does not get its pages
        with e.session("echo_calls", {}, {}) as s:
            with pytest.raises(Exception) as info:
                s.call({"x": x})
        message = str(info.value)
        print(message)
        assert "shared memory" in message and "--shm-size" in message and "SIGBUS" not in message
        assert not e.restarts and e.running
        assert torch.equal(e.submit("echo", {}, {"x": torch.ones(3)}).outputs["x"], torch.ones(3))
