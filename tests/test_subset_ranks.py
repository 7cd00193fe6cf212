"""A plan on fewer ranks than the engine has runs on the first of them, the others idle for the job: real rank
processes (gloo, CPU), the result compared with an engine of exactly the plan's ranks (max abs diff printed against
the fp32 bound: the engines' ranks run with different thread counts, so sums may round differently), the idle ranks'
reports checked, and the job's per-step cancel agreed among its own ranks only (an idle rank never enters it: were
it expected, the job would wait for it until the collective timeout)."""
import pytest
import torch

from engine.errors import EngineError, JobCancelled
from engine.generate.request import GenerateRequest
from engine.parallel.devices import stated_hardware
from engine.parallel.plan import AUTO, ParallelPlan

from tolerance import fp32_bound, report, sampling_amplification


def request(tiny_models, family="flux", plan=AUTO, cfg=1.0, steps=3):
    g = torch.Generator().manual_seed(3)
    pooled = 768 if family == "flux" else 2048
    return GenerateRequest(model=tiny_models[family], cond=torch.randn(1, 24, 4096, generator=g),
                           pooled=torch.randn(1, pooled, generator=g), latent_raw=torch.zeros(1, 16, 16, 16), seed=7,
                           steps=steps, cfg=cfg, neg_cond=torch.randn(1, 24, 4096, generator=g),
                           neg_pooled=torch.randn(1, pooled, generator=g), plan=plan)


def bound(reference, family="flux", cfg=1.0):
    return fp32_bound(reference.abs().max(), reduction=4096, depth=8 if family == "flux" else 4,
                      amplification=sampling_amplification(3, cfg))


def test_auto_on_two_pcie_gpus_without_peer_access_runs_a_job_splitting_does_not_help_on_one_rank_and_says_so(
        tiny_models, engines):
    """A tiny model's step is all launches: a second GPU only adds the exchanges' launches and transfers. auto
    picks one rank of the two, says so, and the 2-rank engine runs it on rank 0 while rank 1 idles."""
    r = request(tiny_models).validate(2, stated_hardware(2, "RTX 4090", "pcie-no-peer"))
    choice = r.choice
    print(choice.reason)
    assert choice.plan == ParallelPlan() and r.plan == ParallelPlan()
    assert choice.reason.startswith("auto chose single rank on 1 of 2 ranks (the other 1 idle): est. ")
    assert "fewer GPUs are faster" in choice.reason or "as fast on fewer GPUs" in choice.reason
    result = engines(2).submit("generate", *r.to_job())
    one = request(tiny_models, plan=ParallelPlan())
    one = one.validate()
    reference = engines(1).submit("generate", *one.to_job()).outputs["samples"]
    assert report("single-rank plan on rank 0 of a 2-rank engine vs a 1-rank engine",
                  (result.outputs["samples"] - reference).abs().max(), bound(reference))
    assert result.ranks[1].get("idle") is True and "model" not in result.ranks[1]
    assert "idle" not in result.ranks[0] and result.ranks[0]["model"]["variant"] == "flux-dev"


def test_a_two_rank_plan_on_a_four_rank_engine_runs_on_ranks_0_and_1(tiny_models, engines):
    r = request(tiny_models, "sd3", plan=ParallelPlan(ulysses=2), cfg=4.5)
    r = r.validate()
    on_four = engines(4).submit("generate", *r.to_job())
    on_two = engines(2).submit("generate", *r.to_job())
    reference = on_two.outputs["samples"]
    assert report("ulysses2 on ranks 0-1 of a 4-rank engine vs a 2-rank engine",
                  (on_four.outputs["samples"] - reference).abs().max(), bound(reference, "sd3", 4.5))
    assert [bool(rank.get("idle")) for rank in on_four.ranks] == [False, False, True, True]
    # the two working ranks exchanged what a 2-rank engine's exchange
    assert on_four.ranks[1]["bytes_sent_per_step"] == on_two.ranks[1]["bytes_sent_per_step"]


def test_cancelling_a_job_on_a_subset_stops_its_ranks_and_the_engine_stays_ready(tiny_models, engines):
    engine = engines(4)
    r = request(tiny_models, plan=ParallelPlan(ring=2), steps=6)
    r = r.validate()
    with pytest.raises(JobCancelled) as cancelled:
        engine.submit("generate", *r.to_job(), should_cancel=lambda: True)
    print(cancelled.value)
    again = request(tiny_models, plan=ParallelPlan(ulysses=4))
    again = again.validate()
    after = engine.submit("generate", *again.to_job())
    assert after.outputs["samples"].shape == (1, 16, 16, 16)


def test_a_model_session_on_a_subset_answers_as_an_engine_of_the_plan_ranks(tiny_models, engines):
    from engine.generate.model_call import ModelSession, request_conditioning
    r = request(tiny_models, plan=ParallelPlan())
    r = r.validate()
    x = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for world in (1, 2):
        with ModelSession(engines(world), r) as session:
            out[world] = session.call(x, torch.tensor([0.7]), request_conditioning(r, ("pos",), 1))
            session.call(x, torch.tensor([0.3]), request_conditioning(r, ("pos",), 1))
    assert report("model call, single-rank plan on a 2-rank engine vs a 1-rank engine",
                  (out[2] - out[1]).abs().max(), fp32_bound(out[1].abs().max(), reduction=4096, depth=8))


def test_a_plan_on_more_ranks_than_the_engine_has_is_refused_by_the_ranks(tiny_models, engines):
    r = request(tiny_models, plan=ParallelPlan(ulysses=4))
    r = r.validate()
    with pytest.raises(EngineError, match="needs 4 ranks but the engine has 2"):
        engines(2).submit("generate", *r.to_job())


def test_auto_keeps_the_full_world_on_cpu_ranks(tiny_models):
    """CPU ranks share one host: no plan is faster, so auto uses them all (they exist to run the parallel paths)."""
    r = request(tiny_models)
    from engine.parallel.devices import cpu_hardware
    resolved = r.validate(2, cpu_hardware(2))
    assert resolved.plan.world_size == 2 and r.plan == AUTO   # validate returns a new request: r is unchanged
