"""Faults with real processes: a killed or stopped rank becomes an EngineError naming it, the ranks are
replaced, and a killed client takes its ranks and shared memory with it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.runtime.client import Deadlines, Engine
from engine.errors import EngineError

from engine.runtime.bridge import engine_dirs
from engine.runtime.launch import pid_gone
from conftest import FAST, ROOT


def run_until_step(engine, step, action, steps=400):
    """Submit a slow job and call action() on the caller's thread when rank 0 reports `step`."""
    def on_progress(s, total):
        if s == step:
            action()
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        engine.submit("echo", {"steps": steps, "step_sleep_s": 0.05}, {"x": torch.zeros(4)}, on_progress=on_progress)
    return info.value, time.monotonic() - t0


def test_kill_9_of_a_rank_mid_job_names_it_within_10_s_and_the_next_job_succeeds(fresh_engine):
    victim = fresh_engine.pids[1]
    t_kill = []
    err, _ = run_until_step(fresh_engine, 3, lambda: (t_kill.append(time.monotonic()), os.kill(victim, signal.SIGKILL)))
    detected_after = time.monotonic() - t_kill[0]
    print(f"kill -9 detected after {detected_after:.2f} s: {str(err).splitlines()[0]}")
    assert detected_after < 10
    assert err.rank == 1 and err.phase == "compute"
    assert "rank 1 died" in str(err) and "SIGKILL" in str(err)
    x = torch.randn(100)
    assert torch.equal(fresh_engine.submit("echo", {"return_rank": 1}, {"x": x}).outputs["x"], x)
    assert victim not in fresh_engine.pids
    assert fresh_engine.restarts and "rank 1 died" in fresh_engine.restarts[0]


def test_sigstop_of_a_rank_gives_a_deadline_error_naming_it_and_the_next_job_succeeds(fresh_engine):
    victim = fresh_engine.pids[0]
    t_stop = []
    err, _ = run_until_step(fresh_engine, 2, lambda: (t_stop.append(time.monotonic()), os.kill(victim, signal.SIGSTOP)))
    detected_after = time.monotonic() - t_stop[0]
    print(f"SIGSTOP detected after {detected_after:.2f} s (heartbeat deadline {FAST.heartbeat_s} s): "
          f"{str(err).splitlines()[0]}")
    assert err.rank == 0 and "stopped answering" in str(err) and "heartbeat_s" in str(err)
    assert detected_after < FAST.heartbeat_s + 3
    assert pid_gone(victim)  # the stopped rank was killed, not left behind
    assert fresh_engine.submit("echo", {}, {"x": torch.ones(2)}).outputs["x"].sum().item() == 2.0


def test_a_phase_that_runs_past_its_deadline_names_the_rank_and_phase():
    deadlines = Deadlines(compute_s=1.0, heartbeat_s=5, error_grace_s=1)
    with Engine(2, device="cpu", deadlines=deadlines) as e:
        with pytest.raises(EngineError, match="exceeded the compute deadline.*compute_s") as info:
            e.submit("echo", {"steps": 100, "step_sleep_s": 0.1}, {"x": torch.zeros(1)})
        assert info.value.phase == "compute" and info.value.rank in (0, 1)
        assert e.submit("echo", {}, {"x": torch.ones(1)}, deadlines=FAST).outputs["x"].item() == 1.0


def test_a_rank_that_died_while_idle_is_replaced_before_the_next_job(fresh_engine):
    victim = fresh_engine.pids[1]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    assert fresh_engine.submit("echo", {}, {"x": torch.ones(3)}).outputs["x"].sum().item() == 3.0
    assert "rank 1 had exited while idle" in fresh_engine.restarts[-1]


CLIENT = r"""
import json, sys, time, torch
from engine.runtime.client import Engine
e = Engine(int(sys.argv[1]), device="cpu")
print(json.dumps({"pids": e.pids, "dir": e.engine_dir}), flush=True)
e.submit("echo", {"steps": 10000, "step_sleep_s": 0.05}, {"x": torch.zeros(1 << 20)},
         on_progress=lambda s, t: print("step", s, flush=True) if s == 2 else None)
"""


@pytest.mark.parametrize("ranks", [4])   # (2 ranks: the same path, one rank fewer)
def test_kill_9_of_the_client_mid_job_takes_all_ranks_and_shared_memory_within_10_s(ranks):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(ranks)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        info = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "step 2"  # mid-job: a segment is in flight
        assert os.path.basename(info["dir"]) in engine_dirs()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and not (all(pid_gone(p) for p in info["pids"])
                                                  and not os.path.exists(info["dir"])):
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        print(f"{ranks} ranks gone and shared memory removed {elapsed:.2f} s after kill -9 of the client")
        assert all(pid_gone(p) for p in info["pids"]), "orphaned ranks"
        assert not os.path.exists(info["dir"]), "shared memory left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill_9_of_the_client_while_idle_takes_all_ranks_too():
    code = ("import json; from engine.runtime.client import Engine; e = Engine(2, device='cpu'); "
            "print(json.dumps({'pids': e.pids, 'dir': e.engine_dir}), flush=True); import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    info = json.loads(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and not all(pid_gone(p) for p in info["pids"]):
        time.sleep(0.05)
    assert all(pid_gone(p) for p in info["pids"])
    assert not os.path.exists(info["dir"])


def test_close_stops_the_ranks_and_removes_shared_memory():
    e = Engine(2, device="cpu", deadlines=FAST)
    pids, path = e.pids, e.engine_dir
    e.submit("echo", {}, {"x": torch.ones(1)})
    e.close()
    assert all(pid_gone(p) for p in pids)
    assert not os.path.exists(path)


def test_a_step_that_stalls_past_step_s_names_the_rank_phase_and_step():
    deadlines = Deadlines(step_s=1.5, heartbeat_s=10, error_grace_s=1)
    with Engine(2, device="cpu", deadlines=deadlines) as e:
        with pytest.raises(EngineError, match=r"made no progress for 1.5 s during phase compute at step \d.*step_s") \
                as info:
            e.submit("echo", {"steps": 4, "step_sleep_s": 0.2}, {"x": torch.zeros(1)})   # fine: 0.2 s steps
            e.submit("echo", {"steps": 4, "step_sleep_s": 30}, {"x": torch.zeros(1)})    # a step that hangs
        print(str(info.value).splitlines()[0])
        assert info.value.phase == "compute" and info.value.rank in (0, 1)
        assert e.submit("echo", {}, {"x": torch.ones(1)}, deadlines=FAST).outputs["x"].item() == 1.0


def test_an_idle_engine_outlives_its_collective_timeout():
    """No collective runs while idle, so a process-group timeout shorter than the idle time ends nothing."""
    with Engine(2, device="cpu", deadlines=FAST, collective_timeout_s=2) as e:
        x = torch.randn(8)
        assert torch.equal(e.submit("echo", {"steps": 2, "return_rank": 1}, {"x": x}).outputs["x"], x)
        time.sleep(5)
        assert torch.equal(e.submit("echo", {"steps": 2, "return_rank": 1}, {"x": x}).outputs["x"], x)
        assert not e.restarts


def test_a_model_load_past_its_deadline_names_the_load_and_its_scaled_limit(tmp_path):
    """The load's deadline is load_s + load_s_per_gib per GiB of the file; a rank stuck in it (stopped here, with a
    heartbeat deadline longer than the load's) fails the job naming the load."""
    from engine.generate.request import GenerateRequest
    from engine.parallel.devices import cpu_hardware
    from engine.runtime.faults import Fault

    assert Deadlines(load_s=300, load_s_per_gib=60).for_phase("load", 23 * 2**30) == 300 + 60 * 23
    fault = Fault(rank=1, point="load", action="stop", marker=str(tmp_path / "fired"))
    deadlines = Deadlines(load_s=1.0, load_s_per_gib=60, heartbeat_s=60, error_grace_s=1)
    request = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=2)
    request = request.validate(2, cpu_hardware(2))   # CPU ranks: auto uses both, so rank 1 loads the model
    with Engine(2, device="cpu", deadlines=deadlines, env=fault.env()) as e:
        with pytest.raises(EngineError, match=r"rank 1 exceeded the load deadline .*\(1 s, 1 s \+ 60 s/GiB") as info:
            request.submit(e)
        print(str(info.value).splitlines()[0])
        assert info.value.phase == "load" and len(fault.firings()) == 1
        assert request.submit(e).outputs["samples"].shape == request.latent_raw.shape


def test_a_second_failure_in_a_row_backs_off_instead_of_restarting_in_a_loop(tmp_path):
    from engine.runtime.faults import Fault

    fault = Fault(rank=1, point="start", action="kill", times=3, marker=str(tmp_path / "fired"))
    e = Engine(2, device="cpu", deadlines=Deadlines(backoff_s=1.5, heartbeat_s=10), env=fault.env(), start=False)
    try:
        for _ in range(2):   # two start-ups in a row fail
            with pytest.raises(EngineError, match="rank 1 exited during start-up"):
                e.submit("echo", {}, {"x": torch.ones(1)})
        with pytest.raises(EngineError, match=r"failed 2 times in a row .*backoff_s") as info:
            e.submit("echo", {}, {"x": torch.ones(1)})
        print(str(info.value))
        assert len(fault.firings()) == 2 and not e.pids   # refused without starting anything
        time.sleep(1.6)
        with pytest.raises(EngineError, match="rank 1 exited during start-up"):   # the third try, after the wait
            e.submit("echo", {}, {"x": torch.ones(1)})
        with pytest.raises(EngineError, match=r"failed 3 times in a row .*in [23] s"):   # the wait doubles
            e.submit("echo", {}, {"x": torch.ones(1)})
        time.sleep(3.1)
        assert e.submit("echo", {}, {"x": torch.ones(1)}).outputs["x"].item() == 1.0   # the fault is spent
        assert e._failures == 0
    finally:
        e.close()


def test_an_out_of_memory_generate_job_names_plans_and_settings_that_need_less(tmp_path):
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan
    from engine.runtime.faults import Fault

    fault = Fault(rank=1, point="step", action="oom", step=1, marker=str(tmp_path / "fired"))
    request = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=3,
                                                  plan=ParallelPlan(ulysses=2))
    request = request.validate(2)
    with Engine(2, device="cpu", deadlines=FAST, env=fault.env()) as e:
        with pytest.raises(EngineError) as info:
            request.submit(e)
        message = str(info.value)
        print(message)
        assert info.value.oom and info.value.rank == 1
        assert "rank 1 (cpu) ran out of memory in phase compute at step 1" in message
        assert "the planner estimated" in message and "for ulysses2 (weights" in message
        assert request.submit(e).outputs["samples"].shape == request.latent_raw.shape


def test_a_rank_out_of_memory_loading_its_weights_stops_the_job_on_every_rank_and_the_others_keep_theirs(tmp_path):
    """Rank 1 runs out of memory while loading the model (injected at its load): every rank stops together where they
    agree before the first step, so none waits in a collective for it and the group stays up (no restart); the error
    names rank 1, its device and what it held, and plans that need less; the next job finds the model resident on
    rank 0 and reads the file on rank 1 only."""
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan
    from engine.runtime.faults import Fault

    fault = Fault(rank=1, point="load", action="oom", marker=str(tmp_path / "fired"))
    request = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=2,
                                                  plan=ParallelPlan(ulysses=2)).validate(2)
    with Engine(2, device="cpu", deadlines=FAST, env=fault.env()) as e:
        pids = e.pids
        with pytest.raises(EngineError) as info:
            request.submit(e)
        message = str(info.value)
        print(message)
        assert info.value.oom and info.value.rank == 1 and "\n" not in message
        assert "rank 1 (cpu) ran out of memory in phase load" in message and "pipefusion2 fits" in message
        assert e.pids == pids and not e.restarts
        again = request.submit(e)
        assert [r["model_source"] for r in again.ranks] == ["resident", "file"]


@pytest.mark.parametrize("shard", [1, 2], ids=["ulysses2", "ulysses2_x_shard2"])
def test_a_rank_out_of_memory_mid_step_costs_one_job_on_the_same_ranks(shard, tmp_path, engines):
    """Rank 1 runs out of memory at step 2 (injected) while rank 0 goes on into step 3's collectives, which rank 1
    never enters: rank 1 tears the job's mesh down, which fails rank 0's wait at once; every rank agrees that the job
    ended, frees the step's tensors and reports. One error names rank 1, its device, the plan and what needs less;
    the group is not replaced (it ended within the error grace: the same processes), and the next identical job gives
    the clean run's latent reading no file for whole weights (weights divided over the torn-down mesh belonged to it,
    and are read again)."""
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan
    from engine.runtime.faults import Fault

    plan = ParallelPlan(ulysses=2, shard=shard)
    fault = Fault(rank=1, point="step", action="oom", step=2, marker=str(tmp_path / "fired"))
    request = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=4,
                                                  plan=plan).validate(2)
    clean = request.submit(engines(2)).outputs["samples"]
    with Engine(2, device="cpu", deadlines=FAST, env=fault.env()) as e:
        pids = e.pids
        with pytest.raises(EngineError) as info:
            request.submit(e)
        detected_s = time.time() - fault.firings()[0]["time"]
        message = str(info.value)
        print(f"{plan.describe()}: detected {detected_s:.2f} s after the injected OOM; {message}")
        assert e.pids == pids and not e.restarts, e.restarts
        assert info.value.oom and info.value.rank == 1 and "\n" not in message
        assert f"rank 1 (cpu) ran out of memory in phase compute at step 2 under {plan.describe()}" in message
        assert "a smaller image or batch shrinks the activations" in message
        assert ("plans that need less: " in message) == (shard == 1)   # divided weights already need the least
        t0 = time.monotonic()
        again = request.submit(e)
        print(f"the next job: {time.monotonic() - t0:.2f} s, model {[r['model_source'] for r in again.ranks]}")
        assert e.pids == pids and not e.restarts
        assert [r["model_source"] for r in again.ranks] == ["resident" if shard == 1 else "file"] * 2
        assert torch.equal(again.outputs["samples"], clean)


def test_after_a_mid_step_out_of_memory_on_a_plan_of_fewer_ranks_every_rank_builds_its_mesh_again(tmp_path):
    """A plan on 2 of 3 ranks: its ranks drop the failed job's mesh, and the rank it leaves idle, which finished its
    part, drops its copy before the next job (building a mesh is a collective of every rank), so the plan runs
    again on the same processes, then another plan too."""
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan
    from engine.runtime.faults import Fault

    fault = Fault(rank=1, point="step", action="oom", step=1, marker=str(tmp_path / "fired"))
    request = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=2,
                                                  plan=ParallelPlan(ulysses=2)).validate()
    with Engine(3, device="cpu", deadlines=FAST, env=fault.env()) as e:
        pids = e.pids
        with pytest.raises(EngineError, match="rank 1 \\(cpu\\) ran out of memory") as info:
            request.submit(e)
        assert info.value.oom and e.pids == pids and not e.restarts
        again = request.submit(e)
        assert again.ranks[2].get("idle") and [r.get("model_source") for r in again.ranks[:2]] == ["resident"] * 2
        ring = GenerateRequest.random_conditioning("synthetic:flux-dev:tiny", 64, 64, text_tokens=8, steps=2,
                                                   plan=ParallelPlan(ring=3)).validate()
        assert ring.submit(e).outputs["samples"].shape == ring.latent_raw.shape
        assert e.pids == pids and not e.restarts


def test_out_of_memory_advice_for_flux_dev_on_24_gib_cards_names_what_would_fit():
    """At FLUX.1-dev's real size (no weights loaded: the planner works from the model's dims) on two 24 GiB GPUs."""
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan

    request = GenerateRequest.random_conditioning("synthetic:flux-dev", 1024, 1024, text_tokens=512, steps=20,
                                                  plan=ParallelPlan(ulysses=2), dtype="bf16")
    request = request.validate(2)
    advice = request.memory_advice(2, {"device_total_gib": 24.0, "peak_gib": 23.5})
    print(advice)
    assert "for ulysses2" in advice and "on a 24 GiB device" in advice
    assert "fp8 weights would fit" in advice and "explicit pipefusion2" in advice
