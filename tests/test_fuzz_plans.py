"""Fuzzed parallel plans: any degrees (0, negative, huge, not integers), rank counts and workloads. ParallelPlan
refuses bad degrees, and resolve_plan either returns a plan that has no problems (an explicit one on exactly the rank
count; auto's on at most it: fewer GPUs when they are faster, exact unless `fastest`), or raises PlanError in one
line naming the numbers; the CLI's degree flags do the same with exit 2."""

import pytest
from hypothesis import given, strategies as st

from engine.cli import build_parser, main
from engine.cli.args import UsageError
from engine.cli.generate import prepare
from engine.errors import PlanError
from engine.parallel.devices import cpu_hardware, stated_hardware
from engine.parallel.plan import DEGREES, ParallelPlan, Workload, is_exact, plan_problems
from engine.parallel.planner import resolve_plan

from fuzz import Tally, cases, names_any, one_line

DEGREE = st.one_of(st.integers(1, 8), st.integers(-3, 0), st.sampled_from([2 ** 31, 2 ** 63, 10 ** 30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=3))
RANKS = st.one_of(st.integers(1, 8), st.sampled_from([0, -1, 9, 2 ** 40, 2.0, True, None, "2"]))
VARIANTS = ["flux-dev", "flux-schnell", "sd3-medium", "sd3.5-medium", "sd3.5-large"]


@st.composite
def workloads(draw):
    variant = draw(st.sampled_from(VARIANTS))
    side = st.integers(1, 96).map(lambda n: n * 16)
    return Workload.for_variant(variant, draw(side), draw(side), batch=draw(st.integers(1, 8)),
                                negative_pass=draw(st.booleans()), dtype=draw(st.sampled_from(["bf16", "fp32"])),
                                fp8_weights=draw(st.booleans()))


@pytest.mark.timeout(300)
def test_any_degrees_ranks_and_workload_resolve_or_are_refused_with_the_numbers():
    tally = Tally("plans")

    @cases(600)
    @given(degrees=st.one_of(st.sampled_from(["auto", "fastest"]),
                             st.dictionaries(st.sampled_from(DEGREES), DEGREE, max_size=5),
                             st.sampled_from(["Auto", "", 3, None])),
           ranks=RANKS, work=workloads(), hw=st.sampled_from(["assumed", "cpu", "rtx4090", "h100-pcie"]))
    def prop(degrees, ranks, work, hw):
        try:
            requested = ParallelPlan(**degrees) if isinstance(degrees, dict) else degrees
        except PlanError as e:   # names a degree with the value it was given
            assert one_line(str(e)) and any(f"{n}={v!r}" in str(e) for n, v in degrees.items()), str(e)
            tally("degrees refused")
            return
        n = ranks if isinstance(ranks, int) and not isinstance(ranks, bool) and 1 <= ranks <= 8 else 1
        hardware = {"assumed": None, "cpu": cpu_hardware(n), "rtx4090": stated_hardware(n, "RTX 4090", "pcie"),
                    "h100-pcie": stated_hardware(n, "H100 PCIe", "pcie")}[hw]
        try:
            choice = resolve_plan(requested, ranks, work, hardware)
        except PlanError as e:   # names the plan, the rank count or the model it was given
            message = str(e)
            assert one_line(message), message
            given = [repr(requested), f"ranks={ranks!r}", f" {ranks} ranks", work.variant]
            if isinstance(requested, ParallelPlan):
                given += [requested.describe(), " x ".join(f"{n}={getattr(requested, n)}" for n in DEGREES)]
            assert any(g in message for g in given), message
            tally("refused")
            return
        assert not plan_problems(choice.plan, work) and one_line(choice.reason)
        if isinstance(requested, ParallelPlan) or hw == "cpu":
            assert choice.plan.world_size == ranks
        else:
            assert choice.plan.world_size <= ranks
            assert is_exact(choice.plan, work) or requested == "fastest" or "no exact plan fits" in choice.reason
        tally("resolved")

    prop()
    tally.report()
    assert all(tally.counts.get(k, 0) > 20 for k in ("degrees refused", "refused", "resolved")), tally.counts


FLAG_TEXT = st.one_of(st.sampled_from(["1", "2", "1", "2", "4"]), st.sampled_from(["0", "-1", "2", "3", "4", "8", "2.5", "1e3", "99999999999999999999", "",
                                       "two", "0x2", " 2", "٢"]), st.text(max_size=4))


@pytest.mark.timeout(300)
def test_plan_flags_of_the_cli_give_a_plan_or_one_line(tmp_path):
    """--ulysses/--ring/--dp/--pipefusion/--ranks text through the generate parser and its checks (no rank
    starts: prepare() stops before the engine)."""
    import torch
    from safetensors.torch import save_file
    cond = str(tmp_path / "cond.safetensors")
    save_file({"cond": torch.randn(1, 4, 4096), "pooled": torch.randn(1, 768),
               "neg_cond": torch.randn(1, 4, 4096), "neg_pooled": torch.randn(1, 768)}, cond)
    parser = build_parser()
    tally = Tally("CLI plan flags")

    @cases(200)
    @given(flags=st.dictionaries(st.sampled_from(["--ulysses", "--ring", "--dp", "--pipefusion", "--ranks"]),
                                 FLAG_TEXT, min_size=1, max_size=2),
           cfg_parallel=st.booleans(), auto=st.booleans())
    def prop(flags, cfg_parallel, auto):
        argv = ["generate", "--model", "synthetic:flux-dev:tiny", "--cond", cond, "--out",
                str(tmp_path / "out.safetensors"), "--width", "64", "--height", "64", "--cfg", "2", "--batch", "2"]
        for flag, text in flags.items():
            argv += [f"{flag}={text}"]
        argv += ["--cfg-parallel"] * cfg_parallel + ["--plan", "auto"] * auto
        try:
            a, unknown = parser.parse_known_args(argv)
            assert not unknown
            request, ranks, choice = prepare(a)
        except UsageError as e:   # names a flag it was given, its value, or the plan they make
            message = str(e)
            assert one_line(message), message
            given = list(flags) + ["--cfg-parallel"] * cfg_parallel + ["--plan"] * auto
            assert names_any(message, given + [f.lstrip("-") for f in given],
                             [t for t in flags.values() if t.strip()]), message
            tally("refused")
            return
        assert request.plan.world_size == ranks
        tally("planned")

    prop()
    tally.report()
    assert tally.counts.get("refused", 0) > 10 and tally.counts.get("planned", 0) > 5


@pytest.mark.parametrize("flags, expected", [
    (["--ulysses", "0"], "argument --ulysses: 0 is invalid: use an integer >= 1"),
    (["--ring", "two"], "argument --ring: 'two' is not an integer"),
    (["--ranks", "9"], "argument --ranks: 9 is invalid: use 1 to 8 ranks"),
    (["--dp", "3"], "plan dp3 cannot run this job"),
    (["--ulysses", "2", "--ranks", "4"], "ulysses=2 x ring=1 needs 2 ranks but the engine has 4"),
])
def test_bad_plan_flags_exit_2_with_one_line(tmp_path, capsys, flags, expected):
    import torch
    from safetensors.torch import save_file
    cond = str(tmp_path / "cond.safetensors")
    save_file({"cond": torch.randn(1, 4, 4096), "pooled": torch.randn(1, 768)}, cond)
    code = main(["generate", "--model", "synthetic:flux-dev:tiny", "--cond", cond, "--out",
                 str(tmp_path / "o.safetensors"), "--width", "64", "--height", "64"] + flags)
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and err.count("\n") == 1 and expected in err
