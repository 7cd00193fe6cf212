"""Parallel plans on real rank processes (gloo, CPU): each plan's latent equals the single-rank latent of the
same job (fp32, max abs diff printed), and plans that cannot run are refused before any rank starts."""
import pytest
import torch

from engine.errors import PlanError
from engine.generate.request import GenerateRequest
from engine.parallel.plan import ParallelPlan


def bound(reference, family, cfg):
    """A rank split sums in another order: equal to fp32 rounding through the tiny model's blocks (FLUX: 4 double +
    4 single, SD3.5: 4) and the 3 sampling steps of every request here."""
    from tolerance import fp32_bound, sampling_amplification
    return fp32_bound(reference.abs().max(), reduction=4096, depth=8 if family == "flux" else 4,
                      amplification=sampling_amplification(3, cfg))


def request(tiny_models, family, *, batch=1, cfg=1.0, text_tokens=24, plan=ParallelPlan(), sampler="euler",
            latent_hw=(16, 16)):
    g = torch.Generator().manual_seed(11)
    pooled = 768 if family == "flux" else 2048
    r = GenerateRequest(model=tiny_models[family], cond=torch.randn(batch, text_tokens, 4096, generator=g),
                        pooled=torch.randn(batch, pooled, generator=g), latent_raw=torch.zeros(batch, 16, *latent_hw),
                        seed=5, steps=3, cfg=cfg, sampler=sampler, neg_cond=torch.randn(1, text_tokens, 4096, generator=g),
                        neg_pooled=torch.randn(1, pooled, generator=g), plan=plan)
    r = r.validate()
    return r


def run(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], result.ranks[0].get("bytes_sent_per_step", {})


PLANS = [
    # family, plan, batch, cfg, text tokens (24 divides every degree here: text split; 25 does not: text joint)
    ("flux", dict(ulysses=2), 1, 1.0, 24),
    ("flux", dict(ring=2), 1, 1.0, 24),
    ("flux", dict(ulysses=2, ring=2), 1, 1.0, 25),
    ("flux", dict(ulysses=4), 1, 1.0, 25),
    ("flux", dict(ring=4), 1, 1.0, 24),
    ("flux", dict(dp=2), 2, 1.0, 24),
    ("flux", dict(dp=2, ulysses=2), 2, 1.0, 24),
    ("flux", dict(cfg=2), 1, 3.0, 24),
    ("flux", dict(cfg=2, ulysses=2), 1, 3.0, 25),
    ("sd3", dict(ulysses=2), 1, 4.5, 30),
    ("sd3", dict(ring=2), 1, 4.5, 30),
    ("sd3", dict(cfg=2), 1, 4.5, 30),
    ("sd3", dict(cfg=2, ulysses=2), 1, 4.5, 30),
    ("sd3", dict(cfg=2, ring=2), 1, 4.5, 30),
    ("sd3", dict(dp=2, cfg=2), 2, 4.5, 30),
]


@pytest.mark.parametrize("family,plan,batch,cfg,text", PLANS,
                         ids=[f"{f}-{ParallelPlan(**p).describe().replace(' ', '')}-b{b}-cfg{c}-t{t}"
                              for f, p, b, c, t in PLANS])
def test_plan_latent_equals_the_single_rank_latent(tiny_models, engines, family, plan, batch, cfg, text):
    reference, _ = run(engines, request(tiny_models, family, batch=batch, cfg=cfg, text_tokens=text))
    parallel, sent = run(engines, request(tiny_models, family, batch=batch, cfg=cfg, text_tokens=text,
                                          plan=ParallelPlan(**plan)))
    from tolerance import report
    print(f"bytes sent per step by rank 0: { {k: int(v) for k, v in sent.items()} }")
    assert parallel.shape == reference.shape
    assert report(f"{family} {ParallelPlan(**plan).describe()} batch {batch} cfg {cfg} text {text}",
                  (parallel - reference).abs().max(), bound(reference, family, cfg))
    if batch == 2:
        assert (parallel[0] - parallel[1]).abs().max() > 0.1  # different prompts stayed different


PADDED = [
    # family, plan, text tokens: an 18x18 latent is 9x9 = 81 image tokens, which no degree here divides; the last
    # rank's shard ends in pad rows that no softmax sees (24 text tokens: split with the image, 25: joint)
    ("flux", dict(ulysses=2), 24),
    ("flux", dict(ring=2), 24),
    ("flux", dict(ulysses=2, ring=2), 25),
    ("flux", dict(ulysses=2, ring=2), 24),
    ("sd3", dict(ring=2), 30),
    ("flux", dict(ring=3), 24),   # 81 divides 3: a 16x16 latent instead, 64 tokens padded to 66 (2 pad rows)
]


@pytest.mark.parametrize("family,plan,text", PADDED,
                         ids=[f"{f}-{ParallelPlan(**p).describe().replace(' ', '')}-t{t}" for f, p, t in PADDED])
def test_image_tokens_the_degree_does_not_divide_are_padded_and_the_latent_equals_the_single_rank_latent(
        tiny_models, engines, family, plan, text):
    cfg = 4.5 if family == "sd3" else 1.0
    hw = (16, 16) if plan.get("ring") == 3 else (18, 18)
    job = dict(cfg=cfg, text_tokens=text, latent_hw=hw)
    reference, _ = run(engines, request(tiny_models, family, **job))
    parallel, _ = run(engines, request(tiny_models, family, plan=ParallelPlan(**plan), **job))
    from tolerance import report
    assert parallel.shape == reference.shape == (1, 16, *hw)
    assert report(f"{family} {ParallelPlan(**plan).describe()} {hw[0] * hw[1] // 4} image tokens (padded) text {text}",
                  (parallel - reference).abs().max(), bound(reference, family, cfg))


@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_2m_sde"])
def test_data_parallel_keeps_stochastic_samplers_whole_batch_noise(tiny_models, engines, sampler):
    """dp splits each model call, not the sampler: the step noise is drawn for the whole batch on every rank, as
    ComfyUI draws it, so a stochastic sampler under dp gives the single-rank latent."""
    reference, _ = run(engines, request(tiny_models, "flux", batch=2, sampler=sampler))
    parallel, sent = run(engines, request(tiny_models, "flux", batch=2, sampler=sampler, plan=ParallelPlan(dp=2)))
    from tolerance import report
    print(f"rank 0 sent per step {dict(sent)}")
    assert report(f"flux dp2 {sampler} batch 2", (parallel - reference).abs().max(), bound(reference, "flux", 1.0))
    assert set(sent) == {"dp_gather"}


def test_each_rank_records_the_bytes_it_sends_per_collective_kind(tiny_models, engines):
    _, sent = run(engines, request(tiny_models, "sd3", cfg=4.5, text_tokens=30, plan=ParallelPlan(cfg=2, ulysses=2)))
    assert set(sent) == {"ulysses_all_to_all", "ulysses_text_gather", "sp_gather", "cfg_gather"}
    # cfg exchange: each step sends this rank's velocity of one pass, [1, 16, 16, 16] fp32, once per model call
    assert sent["cfg_gather"] == 16 * 16 * 16 * 4


@pytest.mark.parametrize("plan,job,message", [
    (dict(ulysses=3), dict(family="sd3"), "4 heads: ulysses 3 does not divide them; try ring3"),
    (dict(ulysses=8), dict(family="sd3", cfg=4.5), "4 heads: ulysses 8 does not divide them; try cfg2 x "),
    (dict(ulysses=4), dict(family="flux", latent_hw=(4, 6)), "6 image tokens: too few for ulysses x ring = 4"),
    (dict(cfg=2), dict(family="flux", cfg=1.0), "cfg parallel needs a negative pass.*try (ulysses2|ring2)"),
    (dict(dp=2), dict(family="flux", batch=3), "batch has 3 images: dp 2 does not divide it"),
])
def test_invalid_plans_are_refused_before_launch_with_the_numbers_and_a_plan_that_works(tiny_models, plan, job, message):
    with pytest.raises(PlanError, match=message):
        request(tiny_models, job.pop("family"), plan=ParallelPlan(**plan), **job)


def test_a_plan_for_more_ranks_than_the_engine_has_is_refused(tiny_models, engines):
    """(A plan for fewer runs on the first of the engine's ranks: tests/test_subset_ranks.py.)"""
    r = request(tiny_models, "flux", plan=ParallelPlan(ulysses=4))
    from engine.errors import EngineError
    with pytest.raises(EngineError, match="needs 4 ranks but the engine has 2"):
        engines(2).submit("generate", *r.to_job())


@pytest.mark.parametrize("plan,text_tokens,text_split,batch", [
    (dict(ulysses=2), 12, True, 1), (dict(ring=2), 12, True, 1), (dict(ulysses=2), 13, False, 2),
    (dict(ulysses=2, ring=2), 12, True, 1), (dict(ulysses=2, ring=2), 13, False, 1), (dict(cfg=2, ulysses=2), 13, False, 1),
    (dict(ring=4), 13, False, 1),
])
def test_bytes_counted_by_the_collectives_equal_each_methods_analytic_volume(engines, plan, text_tokens, text_split,
                                                                            batch):
    from engine.parallel.comm import analytic_bytes
    m = dict(image_tokens=64, text_tokens=text_tokens, heads=4, head_dim=8, attention_layers=3, out_features=64,
             text_split=text_split, negative_pass=False)
    p = ParallelPlan(**plan)
    spec = dict(m, plan=p.as_dict(), batch_per_forward=batch, latent_h=128, latent_w=128)
    sent = engines(p.world_size).submit("comm_probe", spec).ranks[0]["sent"]
    expected = analytic_bytes(m, p, batch)
    print(f"{p.describe()} text {text_tokens}: counted {sum(sent.values())} bytes, analytic {expected}")
    assert sum(sent.values()) == expected


def test_a_rank_keeps_the_last_plans_meshes_and_destroys_the_others_communicators(engines):
    """Each plan's mesh holds communicators (on GPUs, NCCL's buffers with each): a rank keeps the last MESHES_KEPT
    plans' meshes and destroys the communicators of the one it drops, so cycling through more plans than that never
    grows what it holds. Groups of the same ranks share one communicator: on 2 ranks ulysses, ring, dp and cfg make
    one (of both ranks: never the world's, which carries the jobs and must outlive a mesh torn down after a failed
    job); PipeFusion makes one per link direction besides, none for the stages' group."""
    from engine.runtime.jobs import MESHES_KEPT
    m = dict(image_tokens=64, text_tokens=12, heads=4, head_dim=8, attention_layers=1, out_features=64,
             text_split=True, negative_pass=False)
    plans = [ParallelPlan(ulysses=2), ParallelPlan(ring=2), ParallelPlan(dp=2), ParallelPlan(cfg=2),
             ParallelPlan(pipefusion=2)] * 2
    seen = []
    for p in plans:
        spec = dict(m, plan=p.as_dict(), batch_per_forward=1, latent_h=8, latent_w=8)
        info = engines(2).submit("comm_probe", spec).ranks[0]["meshes"]
        seen.append(info)
        print(f"{p.describe()}: {info}")
    base = {s["process_groups"] - s["communicators"] for s in seen}
    assert len(base) == 1   # what the rank holds beyond its meshes' communicators never changes
    assert all(s["kept"] <= MESHES_KEPT for s in seen) and seen[-1]["kept"] == MESHES_KEPT
    assert seen[-1]["destroyed"] - seen[0]["destroyed"] >= len(plans) - MESHES_KEPT
    # ulysses 2's groups share one of both ranks; PipeFusion 2 makes one per link direction besides (the job's group
    # of both ranks agrees on its cache decisions), none for the stages
    made = {p.describe(): s["plan_communicators"] for p, s in zip(plans, seen)}
    assert made == {"ulysses2": 1, "ring2": 1, "dp2": 1, "cfg2": 1, "pipefusion2": 3}
    assert max(s["process_groups"] for s in seen) <= base.pop() + 3 * MESHES_KEPT

