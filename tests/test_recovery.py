"""Recovery without races: a job submitted while a rank group is being torn down (a rank that lost its client removes
the engine directory, then kills its group) is never handed to that group; the client waits for it to go and starts a
new one, and the job succeeds. Repeated, with the machine's cores kept busy, and at each point of the teardown."""
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from engine.runtime.client import Engine
from engine.runtime.launch import pid_gone

from conftest import FAST
from test_fuzz_protocol import frame

REPEATS = 2
GOING = ("had exited while idle", "engine directory was removed while idle")


@pytest.fixture
def busy_cores():
    """As many busy-looping processes as the machine has cores, for the test's duration: a loaded machine, where
    the ranks' teardown and the client's next job interleave in every order."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield len(procs)
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def engine():
    """One 2-rank engine for both tests: each round replaces its ranks, as a user's engine would be. Its ranks get 2 s
    to exit by themselves when the client finds them going."""
    with Engine(2, device="cpu", deadlines=replace(FAST, shutdown_s=2)) as e:
        yield e


def until(condition, timeout_s=60.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.001)
    return time.monotonic() - start


@pytest.mark.timeout(300)
def test_a_job_submitted_as_the_group_tears_itself_down_goes_to_a_new_group_repeatedly_under_load(engine, busy_cores):
    x = torch.randn(64)
    restarts = len(engine.restarts)
    assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
    for i in range(REPEATS):
        old, old_dir = engine.pids, engine.engine_dir
        engine._chans[1].sock.sendall(frame(b"\x00garbage\xff"))   # rank 1 takes its group down
        waited = until(lambda: not os.path.isdir(old_dir))          # its first act: the directory goes
        result = engine.submit("echo", {}, {"x": x})                 # while the ranks may still be alive
        print(f"round {i + 1} ({busy_cores} busy cores): directory gone after {waited * 1000:.1f} ms, then the job "
              f"ran on new ranks; restart reason: {engine.restarts[-1]}")
        assert torch.equal(result.outputs["x"], x)
        assert all(pid_gone(p) for p in old) and not set(old) & set(engine.pids)
        assert any(reason in engine.restarts[-1] for reason in GOING), engine.restarts[-1]
    assert len(engine.restarts) == restarts + REPEATS


@pytest.mark.timeout(300)
def test_a_group_whose_directory_vanished_while_its_ranks_live_is_replaced_before_the_next_job(engine, busy_cores):
    """The moment between the directory's removal and the group's death, held open: the ranks are alive and say
    nothing wrong, yet a job written into the removed directory would fail. The client replaces them first."""
    x = torch.randn(8)
    assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
    old = engine.pids
    for name in os.listdir(engine.engine_dir):
        os.unlink(os.path.join(engine.engine_dir, name))
    os.rmdir(engine.engine_dir)
    assert not any(pid_gone(p) for p in old)
    assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
    assert "engine directory was removed while idle" in engine.restarts[-1]
    assert all(pid_gone(p) for p in old) and not set(old) & set(engine.pids)
