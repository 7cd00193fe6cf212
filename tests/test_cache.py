"""The step cache (First-Block-Cache) on real rank processes (gloo, CPU): a cache that skips no call reproduces the
uncached latent bitwise on 1, 2 and 4 ranks (the cached path runs the same operations, exact by construction); at a threshold that
skips, every rank takes the same decisions, and they are the decisions one rank takes (the agreed change differs
across plans only by summation order, far from the threshold: the margin is printed); a call is skipped on the change
its stream's previous call measured (one call late, so the host never waits for the device), and returns the first
block's output plus the cached remainder."""
import pytest
import torch

from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import load_model
from engine.parallel.cache import StepCache
from engine import families
from engine.parallel.plan import ParallelPlan


def request(tiny_models, family, plan, threshold, cfg=1.0, steps=10, latent_hw=(16, 16)):
    g = torch.Generator().manual_seed(11)
    pooled = 768 if family == "flux" else 2048
    r = GenerateRequest(model=tiny_models[family], cond=torch.randn(1, 24, 4096, generator=g),
                        pooled=torch.randn(1, pooled, generator=g), latent_raw=torch.zeros(1, 16, *latent_hw), seed=5,
                        steps=steps, cfg=cfg, neg_cond=torch.randn(1, 30, 4096, generator=g),
                        neg_pooled=torch.randn(1, pooled, generator=g), plan=ParallelPlan(**plan),
                        cache_threshold=threshold)
    return r.validate()


def generate(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], [rank.get("step_cache") for rank in result.ranks]


EXACT = [("flux", {}, 1.0), ("flux", dict(ulysses=2), 1.0), ("flux", dict(ulysses=2, ring=2), 1.0),
         ("sd3", dict(cfg=2), 4.5), ("sd3", dict(cfg=2, ulysses=2), 4.5)]


# a threshold no change of these models comes near (they run 0.1 to 1): the cache runs and records, and skips nothing
NEVER = 1e-9


@pytest.mark.parametrize("family,plan,cfg", EXACT, ids=lambda v: str(v))
def test_a_cache_that_skips_nothing_is_exact(tiny_models, engines, family, plan, cfg):
    uncached, info = generate(engines, request(tiny_models, family, plan, 0.0, cfg, steps=4))
    assert info[0] is None  # threshold 0 is off: no cache ran
    cached, info = generate(engines, request(tiny_models, family, plan, NEVER, cfg, steps=4))
    diff = (cached - uncached).abs().max().item()
    print(f"{family} {ParallelPlan(**plan).describe()}: cache skipping nothing vs no cache, max abs diff {diff:.3g}")
    calls = 4 * (2 if cfg != 1.0 and not plan.get("cfg") else 1)
    assert all(i["model_calls"] == calls and i["skipped_calls"] == 0 for i in info), info
    assert torch.equal(cached, uncached)


# FLUX's tiny model: the agreed relative change of its first block's residual runs 0.52 to 0.93 per step; 0.56 skips
# some steps and leaves the nearest change about 0.02 away (printed), far beyond fp32 summation-order differences.
THRESHOLD = 0.56


@pytest.mark.parametrize("plan", [dict(cfg=2, ulysses=2), dict(cfg=2, ulysses=2, shard=4)],
                         ids=lambda p: ParallelPlan(**p).describe().replace(" ", ""))
def test_cfg_ranks_agree(tiny_models, engines, plan):
    """CFG parallel: each rank runs one pass, and the decision is agreed over both passes and both Ulysses ranks (with
    the weights divided over all four, every rank skips the same blocks' gathers)."""
    _, infos = generate(engines, request(tiny_models, "flux", plan, THRESHOLD, cfg=3.0))
    print(f"{ParallelPlan(**plan).describe()}, per rank:", [(i["model_calls"], i["skipped_at"]) for i in infos])
    assert infos[0]["skipped_calls"] > 0
    assert all(i["skipped_at"] == infos[0]["skipped_at"] and i["changes"] == infos[0]["changes"] for i in infos)


@pytest.mark.parametrize("plan", [dict(ulysses=2), dict(ring=2), dict(ulysses=2, ring=2), dict(ulysses=2, shard=2)],
                         ids=lambda p: ParallelPlan(**p).describe().replace(" ", ""))
def test_ranks_agree_and_match_one_rank(tiny_models, engines, plan):
    cfg = 1.0
    one, (one_info,) = generate(engines, request(tiny_models, "flux", {}, THRESHOLD, cfg))
    many, infos = generate(engines, request(tiny_models, "flux", plan, THRESHOLD, cfg))
    for info in infos[1:]:
        assert info["skipped_at"] == infos[0]["skipped_at"] and info["changes"] == infos[0]["changes"]
    assert one_info["skipped_calls"] > 0
    assert infos[0]["skipped_at"] == one_info["skipped_at"], (one_info, infos[0])
    changes = [c for c in one_info["changes"] if c is not None]
    margin = min(abs(c - THRESHOLD) for c in changes)
    uncached, _ = generate(engines, request(tiny_models, "flux", {}, 0.0, cfg))
    rel = ((one - uncached).norm() / uncached.norm()).item()
    diff = (many - one).abs().max().item()
    print(f"{ParallelPlan(**plan).describe()}: skipped calls {one_info['skipped_at']} of {one_info['model_calls']} "
          f"on every rank; nearest change {margin:.3f} from the threshold; vs one rank cached max abs diff "
          f"{diff:.3g}; cached vs uncached relative L2 {rel:.3g}")
    assert margin > 1e-3
    from tolerance import fp32_bound, sampling_amplification
    assert diff <= fp32_bound(one.abs().max(), reduction=4096, depth=8,
                              amplification=sampling_amplification(10, cfg))


def test_skipped_call_reuses_the_remainder(tiny_models):
    """In process: the same input three times. The decision is taken one call late (the host never waits for the
    device): the second call measures an unchanged first-block residual (change 0), so the third call skips, and its
    output is the first block's output plus the cached remainder: the full output up to rounding."""
    loaded = load_model(tiny_models["flux"])
    flow = FlowModel(loaded)
    cache = StepCache(flow.model, families.get("flux").tokens.blocks, threshold=1e-3)
    g = torch.Generator().manual_seed(3)
    prepared = flow.prepare([Conditioning(torch.randn(1, 24, 4096, generator=g), torch.randn(1, 768, generator=g))], 1)
    x = torch.randn(1, 16, 16, 16, generator=g)
    cache.use_stream("pos")
    full = flow.velocity(x, torch.tensor(0.7), prepared)
    second = flow.velocity(x, torch.tensor(0.7), prepared)
    again = flow.velocity(x, torch.tensor(0.7), prepared)
    assert cache.stats.skipped_at == [2] and cache.stats.changes == [None, None, 0.0]
    assert torch.equal(second, full)   # computed in full: the same operations on the same input
    rel = ((again - full).norm() / full.norm()).item()
    print(f"skipped call vs full call, relative L2 {rel:.3g}")
    assert rel < 1e-5
    cache.close()
    assert type(flow.model.transformer_blocks) is torch.nn.ModuleList
    assert torch.equal(flow.velocity(x, torch.tensor(0.7), prepared), full)  # closed: the model as it was


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.1", None])
def test_bad_threshold_is_refused(value):
    r = GenerateRequest(model="", cond=None, pooled=None, latent_raw=None, cache_threshold=value)
    with pytest.raises(ValueError, match="cache_threshold="):
        r.check_scalars()


@pytest.mark.parametrize("plan", [dict(ring=2), dict(ulysses=2, ring=2)],
                         ids=lambda p: ParallelPlan(**p).describe().replace(" ", ""))
def test_padded_shards_measure_the_change_of_the_real_tokens_only(tiny_models, engines, plan):
    """81 image tokens: the last rank's pad rows (copies of the last token) stay out of the agreed change, so every
    change equals one rank's to fp32 rounding (counting them would weigh the last token twice or more)."""
    one, (one_info,) = generate(engines, request(tiny_models, "flux", {}, THRESHOLD, latent_hw=(18, 18)))
    many, infos = generate(engines, request(tiny_models, "flux", plan, THRESHOLD, latent_hw=(18, 18)))
    pairs = [(a, b) for a, b in zip(one_info["changes"], infos[0]["changes"]) if a is not None]
    gap = max(abs(a - b) for a, b in pairs)
    print(f"{ParallelPlan(**plan).describe()} 81 tokens: agreed changes vs one rank's, max abs diff {gap:.3g}; "
          f"skipped {infos[0]['skipped_at']} (one rank {one_info['skipped_at']})")
    assert [a is None for a in one_info["changes"]] == [b is None for b in infos[0]["changes"]]
    assert gap <= 1e-5 and infos[0]["skipped_at"] == one_info["skipped_at"]
