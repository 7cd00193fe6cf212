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
