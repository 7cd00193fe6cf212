"""The parallel plan object: degrees, the world-size rule, and messages that name the numbers."""
import pytest

from engine.errors import PlanError
from engine.parallel.plan import ParallelPlan


def test_world_size_is_the_product_of_all_degrees():
    assert ParallelPlan(dp=2, cfg=2, pipefusion=1, ulysses=2, ring=1).world_size == 8
    assert ParallelPlan().world_size == 1


def test_a_plan_that_does_not_match_the_ranks_names_every_factor():
    with pytest.raises(PlanError, match=r"dp=1 x cfg=2 x pipefusion=1 x ulysses=2 x ring=1 needs 4 ranks but "
                                        r"the engine has 2"):
        ParallelPlan(cfg=2, ulysses=2).check_world(2)


@pytest.mark.parametrize("kwargs,message", [({"cfg": 3}, "cfg=3 is invalid.*1 \\(off\\) or 2"),
                                            ({"ulysses": 0}, "ulysses=0 is invalid"),
                                            ({"ring": 1.5}, "ring=1.5 is invalid"),
                                            ({"dp": True}, "dp=True is invalid")])
def test_bad_degrees_are_rejected_with_the_value(kwargs, message):
    with pytest.raises(PlanError, match=message):
        ParallelPlan(**kwargs)


def test_describe_lists_only_the_active_degrees():
    assert ParallelPlan(cfg=2, ring=2).describe() == "cfg2 x ring2"
    assert ParallelPlan().describe() == "single rank"


# ---- resolve_plan: the one place a plan is resolved and validated ---------------------------------------------
from engine.parallel.devices import assumed_hardware, cpu_hardware  # noqa: E402
from engine.parallel.plan import AUTO, Workload  # noqa: E402
from engine.parallel.planner import rank_plans, resolve_plan  # noqa: E402

FLUX_DEV_1024 = dict(variant="flux-dev", heads=24, layers=57, image_tokens=4096)
SD3_MEDIUM_1024 = dict(variant="sd3-medium", heads=24, layers=24, image_tokens=4096)


@pytest.mark.parametrize("model,ranks,batch,negative,expected,used", [
    (SD3_MEDIUM_1024, 2, 1, True, "cfg2", 2),                  # real CFG: the two passes on separate ranks
    # cfg 1.0: nothing to split but the tokens; ring2 and ulysses2 are within 10%, and with the text whole on every
    # rank (this Workload's default) Ulysses also gathers the text's output: ring2 sends less
    (FLUX_DEV_1024, 2, 1, False, "ring2", 2),
    (FLUX_DEV_1024, 4, 2, False, "dp2 x ring2", 4),            # a batch splits before the tokens do
    # eager, 6 GPUs already wait on the host's launches (cfg2 x ulysses4 is no faster): as fast on fewer GPUs
    (SD3_MEDIUM_1024, 8, 1, True, "cfg2 x ulysses3", 6),
    (FLUX_DEV_1024, 1, 1, False, "single rank", 1),
    # 5 heads (ulysses 2 cannot divide them) of a narrow model: ring2's launches cost more than the work it splits
    (dict(FLUX_DEV_1024, heads=5), 2, 1, False, "single rank", 1),
])
def test_auto_picks_the_cheapest_plan_that_fits_and_says_why_in_one_line(model, ranks, batch, negative, expected,
                                                                         used):
    choice = resolve_plan(AUTO, ranks, Workload(batch=batch, negative_pass=negative, **model))
    print(choice.reason)
    assert choice.plan.describe() == expected and choice.plan.world_size == used
    where = f"for {ranks} rank(s)" if used == ranks else f"on {used} of {ranks} ranks (the other {ranks - used} idle)"
    assert choice.reason.startswith(f"auto chose {expected} {where}: ") and "\n" not in choice.reason


def test_an_explicit_plan_is_kept_when_it_fits_and_refused_with_a_working_plan_when_not():
    work = Workload(batch=1, negative_pass=True, **SD3_MEDIUM_1024)
    assert resolve_plan(ParallelPlan(ulysses=2), 2, work).plan == ParallelPlan(ulysses=2)
    with pytest.raises(PlanError, match="ulysses=16 x ring=1 needs 16 ranks but the engine has 8"):
        resolve_plan(ParallelPlan(ulysses=16), 8, work)
    six_heads = Workload(batch=1, negative_pass=True, **dict(SD3_MEDIUM_1024, heads=6))
    with pytest.raises(PlanError, match="6 heads: ulysses 4 does not divide them; try cfg2 x ") as refused:
        resolve_plan(ParallelPlan(ulysses=4), 4, six_heads)
    best_of_4 = rank_plans(4, six_heads, assumed_hardware(4))[0].plan   # an explicit plan's rank count is kept
    assert best_of_4.world_size == 4 and str(refused.value).endswith(f"try {best_of_4.describe()}")
    with pytest.raises(PlanError, match=r"4094 image tokens: ulysses x ring = 4 does not divide them under pipefusion"):
        resolve_plan(ParallelPlan(pipefusion=2, ulysses=2, ring=2), 8,
                     Workload(batch=1, negative_pass=True, **dict(SD3_MEDIUM_1024, image_tokens=4094)))


@pytest.mark.parametrize("degrees,tokens", [(dict(ulysses=2), 6889), (dict(ring=2), 6889),
                                            (dict(ulysses=2, ring=2), 4225), (dict(ulysses=4, ring=2), 4092)])
def test_image_tokens_the_degree_does_not_divide_are_padded_and_the_plan_is_accepted_and_priced(degrees, tokens):
    """Qwen-Image at 1328x1328 (83x83 tokens), FLUX.1 at 1040x1040 (65x65): each rank holds the tokens padded up to a
    multiple of the degree, so the plan runs and is priced on the padded share (at most degree - 1 tokens more)."""
    from engine.parallel.cost import estimate, rank_flops
    from engine.parallel.plan import feasible, plan_problems, shard_tokens
    plan, sp = ParallelPlan(**degrees), degrees.get("ulysses", 1) * degrees.get("ring", 1)
    work = Workload(batch=1, negative_pass=False, **dict(FLUX_DEV_1024, image_tokens=tokens))
    assert tokens % sp and plan_problems(plan, work) == [] and plan in feasible(plan.world_size, work)
    assert resolve_plan(plan, plan.world_size, work).plan == plan
    assert shard_tokens(tokens, sp) * sp - tokens < sp
    padded = Workload(batch=1, negative_pass=False, **dict(FLUX_DEV_1024, image_tokens=shard_tokens(tokens, sp) * sp))
    assert rank_flops(plan, work)[0] < rank_flops(plan, padded)[0]   # the pad rows are no keys
    assert rank_flops(plan, work)[0] > rank_flops(plan, Workload(batch=1, negative_pass=False,
                                                                 **dict(FLUX_DEV_1024, image_tokens=tokens - 1)))[0]
    print(f"{plan.describe()} {tokens} tokens: {estimate(plan, work, assumed_hardware(plan.world_size)).step_ms:.1f} "
          f"ms/step estimated")


def test_too_few_image_tokens_for_the_degree_are_refused_naming_the_numbers():
    work = Workload(batch=1, negative_pass=False, **dict(FLUX_DEV_1024, image_tokens=6))
    with pytest.raises(PlanError, match=r"6 image tokens: too few for ulysses x ring = 4 \(padded to 2 a rank"):
        resolve_plan(ParallelPlan(ring=4), 4, work)


@pytest.mark.parametrize("ranks", [0, 9, -1, True, 2.0])
def test_rank_counts_outside_1_to_8_are_refused(ranks):
    with pytest.raises(PlanError, match=r"ranks=.* is invalid: use 1 to 8"):
        resolve_plan(AUTO, ranks, Workload(batch=1, negative_pass=False, **FLUX_DEV_1024))


def test_auto_runs_a_job_no_plan_of_the_rank_count_can_run_on_fewer_ranks_and_says_so():
    work = Workload(batch=1, negative_pass=False, **dict(FLUX_DEV_1024, heads=7, image_tokens=1))
    choice = resolve_plan(AUTO, 2, work)
    print(choice.reason)
    assert choice.plan == ParallelPlan()
    assert choice.reason.startswith("auto chose single rank on 1 of 2 ranks (the other 1 idle)")
    assert choice.reason.endswith("no plan of 2 ranks runs this job and fits")


def test_cpu_ranks_still_refuse_a_job_no_plan_of_their_count_can_run():
    """CPU ranks exist to run the parallel paths: auto uses them all, or names the numbers."""
    work = Workload(batch=1, negative_pass=False, **dict(FLUX_DEV_1024, heads=7, image_tokens=1))
    with pytest.raises(PlanError, match="no parallel plan runs this job on 2 ranks .*7 heads, 1 image tokens"):
        resolve_plan(AUTO, 2, work, cpu_hardware(2))


def test_a_plan_runs_on_an_engine_with_at_least_its_ranks():
    ParallelPlan(ulysses=2).check_engine(4)   # the first 2 ranks run it, the others idle
    with pytest.raises(PlanError, match=r"needs 4 ranks but the engine has 2: make the product of the degrees at "
                                        r"most the number of ranks"):
        ParallelPlan(ulysses=4).check_engine(2)


@pytest.mark.parametrize("text,plan", [("ulysses4,ring2", ParallelPlan(ulysses=4, ring=2)),
                                       ("ulysses4 x ring2", ParallelPlan(ulysses=4, ring=2)),
                                       ("cfg2, pipefusion2", ParallelPlan(cfg=2, pipefusion=2)),
                                       ("ring=2,dp=2", ParallelPlan(dp=2, ring=2)), ("single rank", ParallelPlan())])
def test_degrees_parse_from_the_text_describe_prints(text, plan):
    assert ParallelPlan.parse(text) == plan and ParallelPlan.parse(plan.describe()) == plan


@pytest.mark.parametrize("text,message", [("ulyses2", "invalid at 'ulyses2'"), ("ring2,ring2", "invalid at 'ring2'"),
                                          ("cfg3", "cfg=3 is invalid"), ("", "invalid")])
def test_bad_degree_text_is_refused_with_the_text(text, message):
    with pytest.raises(PlanError, match=message):
        ParallelPlan.parse(text)
