"""The fault matrix with real rank processes (engine/cli/bench_faults.py, faults armed by engine/runtime/faults.py):
kill -9 and SIGSTOP of each rank role at start-up, as the job is broadcast, mid-step and during the result's return;
an out-of-memory error; the client killed at each point; an interrupt storm. Each must end in an error naming the rank
and the cause, and leave the engine usable (the next job returns its data, nothing of the old group or its shared
memory left) or, with the client dead, cleanly stopped."""
import pytest

from engine.cli.bench_faults import MATRIX_DEADLINES, PHASES, ROLES, client_death, interrupt_storm, rank_fault

CAUSE = {"kill": ("died", "exited during start-up"), "stop": ("stopped answering",)}


# every role at every point, each with one of the two faults, alternating so that each fault meets every role and
# every point too (12 of the 24 combinations: all pairs covered; `python -m engine bench faults` runs all 24)
PAIRS = [(role, ("kill", "stop")[(i + j) % 2], point) for i, role in enumerate(ROLES) for j, point in enumerate(PHASES)]


@pytest.mark.parametrize("role,action,point", PAIRS)
def test_a_killed_or_stopped_rank_is_named_and_the_engine_recovers(role, action, point, tmp_path):
    row = rank_fault(role, point, action, str(tmp_path))
    print(f"{row['fault']} of the {row['role']} at {row['phase']}: detected in {row['detected_s']:.2f} s; "
          f"{row['error']}")
    assert row["recovered"], row["error"]
    assert any(cause in row["error"] for cause in CAUSE[action]), row["error"]
    assert f"rank {ROLES[role]}" in row["error"]
    # kill -9 is seen as the channel closing; a stopped rank at its heartbeat deadline
    bound = 10 if action == "kill" else MATRIX_DEADLINES.heartbeat_s + 10
    assert row["detected_s"] < bound


@pytest.mark.parametrize("point", ["broadcast", "step"])
def test_an_out_of_memory_rank_is_named_and_the_engine_recovers(point, tmp_path):
    row = rank_fault("other", point, "oom", str(tmp_path))
    print(f"OOM of rank 2 at {row['phase']}: detected in {row['detected_s']:.2f} s; {row['error']}")
    assert row["recovered"], row["error"]
    assert "rank 2 (cpu) ran out of memory" in row["error"]


@pytest.mark.parametrize("point", list(PHASES))
def test_a_killed_client_takes_every_rank_and_its_shared_memory(point, tmp_path):
    row = client_death(point, str(tmp_path))
    print(f"client kill -9 at {row['phase']}: ranks gone and shared memory removed {row['detected_s']:.2f} s later")
    assert row["recovered"], row["error"]
    assert row["detected_s"] < 15


def test_an_interrupt_storm_of_50_cancels_leaves_the_engine_ready_without_a_restart():
    row = interrupt_storm(50)
    print(f"interrupt storm: slowest cancel {row['detected_s']:.3f} s; {row['error']}")
    assert row["recovered"], row["error"]
    assert "50 JobCancelled" in row["error"]
