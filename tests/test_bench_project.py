"""`bench project` on the CPU: a row per plan with its projected s/image beside the planner's estimate, the link its
collectives are priced on measured over two pinned gloo ranks, the 1-rank projection beside `bench overhead`'s 1-rank
engine job, the 2-rank check against a real pinned run; and the share's
stand-in collectives, which must send exactly what a real rank sends; and CPU ranks pinned to their own cores, as the
2-rank check runs them. Timings are printed, never asserted."""
import json
import math
import os

import pytest

from engine.cli import main
from engine.cli.bench_project import ShareWorker, _command
from engine.models.load import inspect_model
from engine.parallel.plan import ParallelPlan, feasible
from engine.runtime.projection import share_request
from engine.runtime.client import Engine
from tests.conftest import FAST

FIELDS = dict(model="synthetic:flux-dev:tiny", width=128, height=128, steps=2, cfg=1.0, dtype="fp32", seed=0)


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.timeout(600)
def test_bench_project_prints_every_plan_beside_the_planner_and_the_one_rank_row_beside_bench_overhead(tmp_path,
                                                                                                       capsys):
    out = tmp_path / "project.json"
    code = main(["bench", "--json", str(out), "project", "--steps", "2", "--width", "128", "--height", "128",
                 "--ranks", "2", "--repeats", "1", "--validate", "ulysses2"])
    printed = capsys.readouterr()
    print(printed.out[-6000:], printed.err[-2000:])
    assert code == 0, printed.err
    rows = json.loads(out.read_text())["project"]
    work = share_request(FIELDS, ParallelPlan()).workload(inspect_model(FIELDS["model"]))
    expected = ["single rank"] + [p.describe() for p in feasible(2, work, pipefusion=True)]
    plans = [r for r in rows if r["kind"] == "plan"]
    assert [r["plan"] for r in plans] == expected            # ulysses2, ring2, pipefusion2 for this tiny job
    for r in plans:
        assert positive(r["projected_s_per_image"]) and positive(r["planner_s_per_image"]) and positive(r["share_s"])
        assert (r["link_s"] == 0) == (r["ranks"] == 1)        # the link model prices every collective, and 1 rank has none
    table = printed.out.split("| ranks | plan")[1].split("\n\n")[0]
    assert "projected s/image" in table and "planner s/image" in table
    for name in expected:
        assert f"| {name} " in table

    one = next(r for r in rows if r["kind"] == "one_rank")
    assert positive(one["projected_s_per_image"]) and positive(one["overhead_engine_compute_s"])
    assert one["projected_s_per_image"] == plans[0]["projected_s_per_image"]
    assert "| projection, 1 rank" in printed.out and "| bench overhead: engine job, compute on the rank" in printed.out

    link = next(r for r in rows if r["kind"] == "link")
    print("link:", link)
    checked = [r for r in rows if r["kind"] == "validation"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert link["measured"] and "measured now over 2 pinned gloo ranks" in link["source"]
        assert positive(link["latency_us"]) and positive(link["p2p_latency_us"]) and positive(link["bandwidth_gbs"])
        assert "measured now over 2 pinned gloo ranks" in printed.out.split("| ranks | plan")[0]
        assert [r["plan"] for r in checked] == ["ulysses2"]
        assert positive(checked[0]["real_s_per_image"]) and math.isfinite(checked[0]["residual"])
        assert "| ulysses2 " in printed.out.split("validation:")[1]
    else:
        assert checked == [] and "pinning 2 ranks needs 2" in printed.out
        assert not link["measured"] and "pinning 2 CPU ranks needs 2 cores" in link["source"]


@pytest.fixture(scope="module")
def worker():
    w = ShareWorker("cpu", 1, None, None, 240)
    yield w
    w.close()


@pytest.mark.parametrize("name", ["ulysses2", "ring2"])
def test_a_share_sends_per_collective_exactly_the_bytes_a_real_rank_sends(name, worker, engines):
    plan = ParallelPlan.parse(name)
    share = worker.ask(_command(plan, FIELDS, 1, warmups=0), name)["bytes_sent_per_step"]
    real = engines(2).submit("generate", *share_request(FIELDS, plan).to_job()).ranks[0]["bytes_sent_per_step"]
    print(f"{name}: share {share}, real rank 0 {real}")
    assert share and share == real


def test_pinned_cpu_ranks_each_run_every_thread_on_their_own_cores():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        with pytest.raises(ValueError, match="pin_cpus needs a core per rank: 2 ranks, 1 core"):
            Engine(2, device="cpu", pin_cpus=True, deadlines=FAST)
        return
    with Engine(2, device="cpu", pin_cpus=True, deadlines=FAST) as engine:
        engine.submit("echo", {})
        per_rank = [{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}
                    for pid in engine.pids]
    print("threads' cores per rank:", per_rank)
    assert all(len(cores) == 1 for cores in per_rank)                # every thread of a rank on the same cores
    first, second = (set(next(iter(cores))) for cores in per_rank)
    assert first and second and not first & second and first | second <= set(allowed)
