"""The planner learns the machine it runs on: calibration over real gloo ranks (link, compute, memory) stored per
machine, a link made slow on purpose switching auto's plan, finished jobs' measured steps changing auto's next choice
(and the reason saying why), measured free memory refusing what a card does not hold, mixed devices at their own
rates, and where the figures are stored. Timings are printed; what is asserted is what any 2-core machine gives."""
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import types

import pytest

from conftest import PACK_NAME, load_pack
from engine.cli import main
from engine.generate.request import GenerateRequest
from engine.parallel import cost
from engine.parallel.devices import cpu_hardware, stated_hardware
from engine.parallel.measured import Measured, MeasuredLink, fit_link, job_key, model_key
from engine.parallel.mesh import LINK_DELAY_ENV
from engine.parallel.plan import ParallelPlan, Workload
from engine.parallel.planner import resolve_plan
from engine.models.load import inspect_model
from engine.runtime.machine import Machine, default_folder, job_of

TINY = "synthetic:flux-dev:tiny"
SLOW_MS = 30   # the injected delay of each collective: far above what a step of the tiny model computes


def tiny_request(**fields) -> GenerateRequest:
    return GenerateRequest.random_conditioning(TINY, 128, 128, steps=3, dtype="fp32", **fields)


def tiny_work() -> Workload:
    return tiny_request().validate(1).workload(inspect_model(TINY))


def plan_json(folder, side: int, setup="cpu:2:pinned") -> dict:
    """`plan --measured` on the stored figures: what auto chooses for the tiny job at side x side and why."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", "--measured", setup, "--folder", str(folder), "--model", TINY, "--width", str(side),
                     "--height", str(side), "--dtype", "fp32", "--steps", "3", "--json"])
    assert code == 0
    return json.loads(out.getvalue())


# ---- end to end: real ranks --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_calibration_over_gloo_ranks_and_a_slow_link_switch_autos_plan(tmp_path, monkeypatch, capsys):
    """`python -m engine calibrate` on 2 CPU ranks (pinned where there is a core each) measures the pair, the all-to-all
    and the model on each rank; the same with every collective delayed by SLOW_MS (the cause this test controls)
    measures that delay and makes auto leave the 2-rank plan for one rank, saying the link is measured. Nothing here
    depends on how fast this machine is or how busy: its times are printed, and what only a quiet machine shows (two
    ranks computing a step faster than one) is the planner's, on stated figures
    (test_plans_measured_slower_than_one_ranks_estimate_...), and the benchmarks'."""
    cores = len(os.sched_getaffinity(0))
    pin = ["--pin-cpus"] if cores >= 2 else []   # pinning needs a core per rank
    setup = "cpu:2:pinned" if pin else "cpu:2"
    normal, slow = tmp_path / "normal", tmp_path / "slow"
    size = ["--width", "256", "--height", "256"]
    assert main(["calibrate", "--ranks", "2", *pin, "--folder", str(normal)] + size) == 0
    monkeypatch.setenv(LINK_DELAY_ENV, str(SLOW_MS))   # the ranks read it from their environment
    assert main(["calibrate", "--ranks", "2", *pin, "--folder", str(slow)] + size) == 0
    monkeypatch.delenv(LINK_DELAY_ENV)
    print(capsys.readouterr().out)

    fast_fig = Machine("cpu", 2, folder=str(normal), pinned=bool(pin)).figures()
    slow_fig = Machine("cpu", 2, folder=str(slow), pinned=bool(pin)).figures()
    for name, figures in (("normal", fast_fig), ("slow", slow_fig)):
        print(f"{name} link: calibrated in {figures['calibrate_s']:.1f} s, all-to-all latency "
              f"{figures['all_to_all'][0]['latency_us']:.0f} us, pair latency {figures['pairs'][0]['latency_us']:.0f} us")
        assert [p["ranks"] for p in figures["pairs"]] == [[0, 1]] and [g["ranks"] for g in figures["all_to_all"]] == \
            [[0, 1]]
        assert {c["rank"] for c in figures["compute"]} == {0, 1}
        assert all([p["share"] for p in c["points"]] == [1, 2] and all(p["ms"] > 0 for p in c["points"])
                   for c in figures["compute"])
    # each delayed collective sleeps SLOW_MS at least: its measured latency cannot be less, however busy the machine
    assert slow_fig["all_to_all"][0]["latency_us"] > SLOW_MS * 1e3 * 0.9
    assert slow_fig["pairs"][0]["latency_us"] > SLOW_MS * 1e3 * 0.9

    fast, slow_choice = plan_json(normal, 256, setup), plan_json(slow, 256, setup)
    print("normal:", fast["reason"], "\nslow:", slow_choice["reason"])
    assert "link measured" in fast["reason"] and "compute measured" in fast["reason"]
    assert slow_choice["chosen"]["gpus"] == 1 and slow_choice["chosen"]["plan"] == "single rank"
    assert "on 1 of 2 ranks" in slow_choice["reason"] and "link measured" in slow_choice["reason"]
    assert "compute measured" in slow_choice["reason"]


@pytest.mark.timeout(300)
def test_a_job_records_its_measured_step_and_the_next_auto_weighs_it(tmp_path, engines):
    """A generate job reports its steady step; the machine keeps it for the plan it ran beside the estimate, and the
    next plan of the same workload carries it in its reason."""
    engine = engines(2)
    machine = Machine("cpu", 2, folder=str(tmp_path))
    store(machine, figures({0: 100.0, 1: 100.0}))
    request = tiny_request().validate(2, machine.hardware())
    result = request.submit(engine)
    print(result.timings, request.choice.reason)
    assert 0 < result.timings["step_s"] < result.timings["compute_s"]
    entry = machine.record_job(request, result)
    assert entry["jobs"] == 1 and entry["step_ms"] == pytest.approx(result.timings["step_s"] * 1e3)
    again = tiny_request().validate(2, machine.hardware())
    print(again.choice.reason)
    assert f"measured steps: {request.plan.describe()} {entry['step_ms']:.0f} ms" in again.choice.reason


# ---- the planner on measured figures (no ranks) ------------------------------------------------------------------
def figures(step_ms: dict[int, float], *, latency_us=300.0, gbs=2.0, free_gib=None, device="cpu", jobs=None) -> dict:
    """A setup's figures for the tiny FLUX job: rank r's one-rank step `step_ms[r]` (ms), half of it on half the image
    tokens; a link."""
    work, one = tiny_work(), ParallelPlan()
    shares = {s: dataclasses.replace(work, image_tokens=work.image_tokens // s) for s in (1, 2)}   # a rank's tokens
    points = lambda ms: [{"share": s, "tokens": w.image_tokens + w.text_tokens, "gemm_work": cost.gemm_work(one, w),
                          "tflop": cost.rank_flops(one, w)[0] / 1e12, "unit_ms": cost.unit_ms(one, w)[0],
                          "ms": ms / s} for s, w in shares.items()]   # twice as fast on half the tokens
    return {"device": device,
            "devices": [{"device": device, **({"free_gib": free_gib, "total_gib": 24.0} if free_gib else {})}
                        for _ in step_ms],
            "pairs": [{"ranks": [0, 1], "latency_us": latency_us, "gbs": gbs, "points": []}],
            "all_to_all": [{"ranks": [0, 1], "latency_us": latency_us, "gbs": gbs, "points": []}],
            "compute": [{"rank": r, "key": model_key(work), "model": "flux-dev", "points": points(ms)}
                        for r, ms in step_ms.items()],
            "jobs": jobs or {}}


def store(machine: Machine, fig: dict) -> None:
    os.makedirs(machine.folder, exist_ok=True)
    with open(machine.path, "w") as f:
        json.dump({"schema": 1, "machine": machine.facts, "setups": {machine.setup: fig}}, f)


def measured_cpu(fig) -> object:
    return Measured("cpu:2", fig).apply(cpu_hardware(2))


def test_plans_measured_slower_than_one_ranks_estimate_are_not_chosen_again_and_the_reason_says_why():
    work = tiny_work()

    def auto(runs: dict):
        jobs = {job_key(work): {plan: {"step_ms": ms, "predicted_ms": 55.0, "jobs": 1, "last_ms": [ms]}
                                for plan, ms in runs.items()}}
        return resolve_plan("auto", 2, work, measured_cpu(figures({0: 100.0, 1: 100.0}, jobs=jobs)))
    first = auto({})
    assert first.plan == ParallelPlan(ulysses=2), first.reason          # the model's choice on measured figures
    second = auto({"ulysses2": 400.0})
    assert second.plan == ParallelPlan(ring=2), second.reason           # the next best estimate
    assert "but a job measured it at 400 ms/step, slower than ring2's est. " in second.reason
    third = auto({"ulysses2": 400.0, "ring2": 380.0})
    print(first.reason, "\n", second.reason, "\n", third.reason)
    assert third.plan == ParallelPlan() and "on 1 of 2 ranks" in third.reason
    assert re.search(r"the model alone would choose ulysses2 \(est. \d+ ms/step\), but a job measured it at 400 "
                     r"ms/step, slower than single rank's est. 100$", third.reason)


def test_a_plan_measured_slower_than_another_plans_measurement_gives_way_to_it():
    work = tiny_work()
    runs = {job_key(work): {"ulysses2": {"step_ms": 90.0, "predicted_ms": 56.0, "jobs": 2, "last_ms": [90.0]},
                            "ring2": {"step_ms": 70.0, "predicted_ms": 53.0, "jobs": 1, "last_ms": [70.0]},
                            "single rank": {"step_ms": 150.0, "predicted_ms": 100.0, "jobs": 1, "last_ms": [150.0]}}}
    choice = resolve_plan("auto", 2, work, measured_cpu(figures({0: 100.0, 1: 100.0}, jobs=runs)))
    print(choice.reason)
    assert choice.plan == ParallelPlan(ring=2)
    assert ("measured steps: ulysses2 90 ms (est. 56, 2 jobs), ring2 70 ms (est. 53, 1 job), single rank 150 ms "
            "(est. 100, 1 job)") in choice.reason
    assert "but a job measured it at 90 ms/step, slower than ring2's measured 70" in choice.reason


def test_cpu_ranks_without_measured_compute_keep_sending_the_least():
    work = tiny_work()
    fig = figures({0: 100.0, 1: 100.0})
    fig["compute"] = []
    assert resolve_plan("auto", 2, work, measured_cpu(fig)).reason == resolve_plan("auto", 2, work,
                                                                                  cpu_hardware(2)).reason


def test_measured_free_memory_refuses_a_plan_that_the_cards_size_would_fit():
    """FLUX.1-dev bf16 under ulysses2 needs 24.0 GiB: a card stated at 24 GiB fits it on paper, not with the 23.4 GiB
    it has free once a CUDA context exists; then no plan with whole weights fits, and auto divides them."""
    flux = Workload.for_variant("flux-dev")
    stated = stated_hardware(2, "RTX 4090", "pcie", memory_gib=24)
    assert resolve_plan("auto", 2, flux, stated).plan == ParallelPlan(ulysses=2)
    fig = {"device": "cuda", "devices": [{"device": "cuda", "free_gib": 23.4, "total_gib": 23.99}] * 2}
    measured = Measured("cuda:0,1", fig).apply(stated)
    choice = resolve_plan("auto", 2, flux, measured)
    print(choice.reason)
    assert measured.memory_gib == 23.4 and choice.plan.shard == 2 and "no plan with whole weights on every GPU fits 23.4 GiB" in choice.reason
    assert "memory measured (free once a CUDA context exists)" in choice.reason
    assert "link modelled" in choice.reason and "compute modelled" in choice.reason


def test_mixed_devices_are_priced_each_at_its_own_measured_rate():
    work, u2 = tiny_work(), ParallelPlan(ulysses=2)
    mixed = Measured("cpu:2", figures({0: 100.0, 1: 300.0}))
    one, two = mixed.compute_ms(ParallelPlan(), work)[0], mixed.compute_ms(u2, work)[0]
    print(f"one rank {one:.1f} ms, ulysses2 {two:.1f} ms")
    assert one == pytest.approx(100.0)                    # rank 0 alone: its own rate
    assert two == pytest.approx(Measured("cpu:2", figures({0: 300.0, 1: 300.0})).compute_ms(u2, work)[0])
    assert two > Measured("cpu:2", figures({0: 100.0, 1: 100.0})).compute_ms(u2, work)[0] * 2.9   # the slower rank's


def test_a_measured_link_prices_all_to_alls_and_point_to_point_messages_at_their_own_latency():
    link = Measured("cpu:2", dict(figures({0: 1.0, 1: 1.0}), pairs=[
        {"ranks": [0, 1], "latency_us": 3000.0, "gbs": 1.5, "points": []}])).link(cpu_hardware(2).link)
    assert isinstance(link, MeasuredLink) and link.latency_us == 300.0 and link.p2p_latency_us == 3000.0
    assert link.all_to_all_gbs(2) == 2.0 and link.bandwidth_gbs == 1.5 and "measured" in link.describe()


@pytest.mark.parametrize("pairs,kind", [
    ({"0-1": {"peer": True, "topo": "NV12"}}, "nvlink"),
    ({"0-1": {"peer": True, "topo": "PIX"}, "0-2": {"peer": True, "topo": "SYS"}, "1-2": {"peer": True, "topo": "PIX"}},
     "pcie-socket"),
    ({"0-1": {"peer": False, "topo": "PHB"}}, "pcie-no-peer"),
    ({"0-1": {"peer": True}}, "pcie-bridge"),
])
def test_a_measured_gpu_link_takes_the_class_of_its_worst_pair(pairs, kind):
    fig = {"device": "cuda", "topology": {"pairs": pairs},
           "pairs": [{"ranks": [0, 1], "latency_us": 20.0, "gbs": 18.0, "points": []}],
           "all_to_all": [{"ranks": [0, 1], "latency_us": 25.0, "gbs": 17.0, "points": []}]}
    link = Measured("cuda:0,1", fig).link(stated_hardware(2, "L40", "pcie").link)
    assert link.kind == kind and link.bandwidth_gbs == 18.0 and link.all_to_all_gbs(2) == 17.0
    if link.tree:   # a group size not measured: scaled from the measured one as the modelled link scales it
        assert link.all_to_all_gbs(4) < 17.0


def test_the_link_fit_recovers_latency_and_bandwidth():
    points = [(b, 20e-6 + b / 10e9) for b in (4096, 2**20, 16 * 2**20)]
    latency, gbs = fit_link(points)
    assert latency == pytest.approx(20, rel=1e-6) and gbs == pytest.approx(10, rel=1e-6)


# ---- where figures live -----------------------------------------------------------------------------------------
def test_figures_live_in_the_folder_given_else_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_folder() == str(tmp_path / "cache" / "comfyui-xdit")
    assert Machine("cpu", 2).path.startswith(str(tmp_path / "cache" / "comfyui-xdit" / "machine-"))
    inside = Machine("cpu", 2, folder=str(tmp_path / "user" / "comfyui-xdit"))
    assert os.path.dirname(inside.path) == str(tmp_path / "user" / "comfyui-xdit")
    assert Machine("cpu", 2).setup == "cpu:2" and Machine("cpu", 2, pinned=True).setup == "cpu:2:pinned"


def test_a_folder_that_cannot_be_written_keeps_the_figures_in_memory_and_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    machine = Machine("cpu", 2, folder=str(blocker / "sub"))
    request = tiny_request().validate(2, machine.hardware())
    entry = machine.record_job(request, types.SimpleNamespace(timings={"step_s": 0.25}))
    assert entry["step_ms"] == 250.0 and "could not be written" in machine.unsaved
    assert machine.measured().step(tiny_work(), request.plan)["step_ms"] == 250.0


def test_the_info_node_says_whether_the_planners_figures_are_measured(tmp_path):
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    registry = core.EngineRegistry()
    registry.machine_folder = lambda: str(tmp_path)
    settings = core.EngineSettings(model_path=TINY, gpus=(0, 1), device="cpu")
    assert "measured: nothing yet for cpu:2; the planner's figures are modelled" in core.describe(settings, registry)
    store(registry.machine(settings), figures({0: 100.0, 1: 100.0}))
    shown = core.describe(settings, registry)
    print(shown)
    assert "measured (cpu:2, " in shown and "all-to-all of 2 2.00 GB/s, 300 us" in shown


@pytest.mark.timeout(300)
def test_generate_records_the_jobs_measured_step_for_this_machine(tmp_path, monkeypatch, capsys):
    """`generate` keeps the step it measured in the per-user cache; CPU ranks nobody calibrated are not measured
    before the job (their plans stay the tests' and the demos')."""
    from safetensors.torch import save_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    request = tiny_request()
    save_file({"cond": request.cond.contiguous(), "pooled": request.pooled.contiguous()}, str(tmp_path / "c.st"))
    assert main(["generate", "--model", TINY, "--cond", str(tmp_path / "c.st"), "--steps", "3", "--width", "128",
                 "--height", "128", "--out", str(tmp_path / "out.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "measured this machine" not in out
    machine = Machine("cpu", 1)
    assert machine.path.startswith(str(tmp_path / "cache" / "comfyui-xdit"))
    seen = machine.measured().step(tiny_work(), ParallelPlan())
    print(out, seen)
    assert seen["jobs"] == 1 and seen["step_ms"] > 0 and seen["predicted_ms"] is None
    assert not machine.measured().calibrated


def test_cpu_ranks_with_only_job_records_are_not_calibrated_before_a_job(tmp_path):
    """Job records alone make no calibration: a CPU setup is measured only when asked (the engine is not touched)."""
    machine = Machine("cpu", 2, folder=str(tmp_path))
    request = tiny_request().validate(2, machine.hardware())
    machine.record_step(request, 0.1)
    assert machine.measured() is not None and not machine.measured().calibrated
    assert machine.ensure(None, request, machine.view()) is None
