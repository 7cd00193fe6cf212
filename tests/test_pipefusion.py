"""PipeFusion: stages that hold only their own blocks, patches computed against stale K/V, the sampler stepped per
patch on the last stage. Real rank processes (gloo, CPU) and the tiny FLUX.1-dev / SD3.5-medium checkpoints."""
import pytest
import torch

from engine.errors import JobCancelled, PlanError
from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import held_bytes, inspect_model, load_model
from engine.parallel.mesh import Mesh
from engine.parallel.pipefusion.layout import (Layout, balanced_split, block_counts, make_layout, split_rows,
                                               stage_keep)
from engine.parallel.pipefusion.pipeline import Pipeline
from engine.parallel.plan import ParallelPlan
from tolerance import fp32_bound, report, sampling_amplification


def request(tiny_models, family, *, plan=ParallelPlan(), steps=3, cfg=1.0, text=24, batch=1, hw=(16, 16), **kw):
    g = torch.Generator().manual_seed(11)
    pooled = 768 if family == "flux" else 2048
    r = GenerateRequest(model=tiny_models[family], cond=torch.randn(batch, text, 4096, generator=g),
                        pooled=torch.randn(batch, pooled, generator=g), latent_raw=torch.zeros(batch, 16, *hw),
                        seed=5, steps=steps, cfg=cfg, neg_cond=torch.randn(1, text, 4096, generator=g),
                        neg_pooled=torch.randn(1, pooled, generator=g), plan=plan, **kw)
    return r.validate()


def run(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], result


def bound(reference, family, steps, cfg):
    """Whole-latent calls through the stages compute what one rank computes, split differently (fp32 rounding)."""
    return fp32_bound(reference.abs().max(), reduction=4096, depth=8 if family == "flux" else 4,
                      amplification=sampling_amplification(steps, cfg))


# ---- layout (exact) -----------------------------------------------------------------------------------------------

def test_patches_split_rows_evenly_and_stages_split_blocks_by_cost():
    assert split_rows(8, 3) == [3, 3, 2] and split_rows(64, 4) == [16] * 4
    assert balanced_split([1.0] * 57, 4) == [14, 14, 14, 15]
    assert balanced_split([5.0, 1.0, 1.0, 1.0], 2) == [1, 3]
    assert balanced_split([2.0] * 19 + [1.0] * 38, 2) == [19, 38]
    info = inspect_model("synthetic:flux-dev")
    layout = make_layout(info, ParallelPlan(pipefusion=4), 128, 128, None, 1, None)
    # FLUX's double and single blocks cost about the same per token: 57 blocks in 4 nearly equal stages
    assert sum(layout.stage_blocks) == 57 and max(layout.stage_blocks) - min(layout.stage_blocks) <= 2, layout


@pytest.mark.parametrize("rows,cols,patches,ulysses,ring", [(8, 8, 2, 1, 1), (8, 8, 3, 2, 1), (6, 4, 4, 2, 2),
                                                            (16, 16, 8, 4, 1)])
def test_each_rank_holds_the_same_tokens_in_whole_and_patch_calls(rows, cols, patches, ulysses, ring):
    sp = ulysses * ring
    layout = Layout(2, patches, 1, rows, cols, tuple(split_rows(rows, patches)), (1, 1), sp)
    for r in range(sp):
        whole = layout.local_tokens(None, r)
        assert torch.equal(whole, torch.cat([layout.local_tokens(m, r) for m in range(patches)]))
    everything = torch.cat([layout.local_tokens(None, r) for r in range(sp)])
    assert torch.equal(everything.sort().values, torch.arange(rows * cols))
    # a patch's keys land where the whole call put the same tokens' keys (after the Ulysses exchange)
    for ring_rank in range(ring):
        members = range(ring_rank * ulysses, (ring_rank + 1) * ulysses)
        buffer_tokens = torch.cat([layout.local_tokens(None, j) for j in members])
        for m in range(patches):
            arrived = torch.cat([layout.local_tokens(m, j) for j in members])
            assert torch.equal(buffer_tokens[layout.buffer_positions(m, ulysses)], arrived)


# ---- the stage forward and the patch path, in one process ----------------------------------------------------------

def fresh_kv_check(path: str, family: str, device: str = "cpu", dtype: str = "fp32", text: int = 24) -> None:
    """A whole-latent call through the stage code equals diffusers' own forward; then each patch, attending to K/V
    that are all from this same call, equals the whole call's rows (also run on CUDA by test_cuda.py)."""
    loaded = load_model(path, device=device, dtype=dtype)
    flow = FlowModel(loaded)
    info = loaded.info
    layout = Layout(1, 4, 1, 8, 8, tuple(split_rows(8, 4)), (sum(block_counts(info)),), 1)
    g = torch.Generator().manual_seed(3)
    pos = Conditioning(torch.randn(1, text, 4096, generator=g),
                       torch.randn(1, info.config["pooled_projection_dim"], generator=g))
    x = torch.randn(1, 16, 16, 16, generator=g)
    sigma = 0.6
    reference = flow.velocity(x, torch.tensor(sigma), flow.prepare([pos], 1)).cpu()  # diffusers' forward
    pipeline = Pipeline(flow, Mesh(ParallelPlan(), 0, 1))
    try:
        pipeline.setup(layout)
        pipeline.bind(pos, None, x.shape, 1.0)
        whole = pipeline.model.unpatch(pipeline.compute(None, sigma, x, None)[0], None).float().cpu()
        scale = reference.abs().max()
        depth = 8 if family == "flux" else 4
        # fp32: summation order only; bf16: the same ops in the same order on the same device, so the same bound
        # holds scaled to bf16's epsilon (2**-8 vs 2**-23)
        limit = fp32_bound(scale, reduction=4096, depth=depth) * (2 ** 15 if dtype == "bf16" else 1)
        assert report(f"{family} {device} {dtype}: stage forward vs diffusers forward", (whole - reference).abs().max(),
                      limit)
        for m in range(layout.patches):
            rows = pipeline.model.latent_rows(m)
            patch = pipeline.model.unpatch(pipeline.compute(m, sigma, x[:, :, rows], None)[0], m).float().cpu()
            assert report(f"{family} {device} {dtype}: patch {m} with fresh K/V vs the whole call",
                          (patch - whole[:, :, rows]).abs().max(), limit)
    finally:
        pipeline.close()


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_patches_with_fresh_kv_equal_the_whole_call_and_the_whole_call_equals_the_model(tiny_models, family):
    """The patch path is exact: PipeFusion's only approximation is the age of the other patches' K/V."""
    fresh_kv_check(tiny_models[family], family)


def test_a_stalled_stage_names_the_stage_what_it_waited_for_and_the_peer():
    """Both deadlines: a wait the process group times out (CPU ranks, gloo), and the host's bound on how far it runs
    ahead of a transfer that has not arrived (GPU ranks, where a wait only orders the device's stream)."""
    from engine.parallel.pipefusion.transport import Link, StageStall

    class Never:
        def wait(self, timeout=None):
            raise RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete")

        def is_completed(self):
            return False

    link = Link(stage=1, rank=3, deadline_s=0.01)
    for wait in (link.wait, link.bound):
        with pytest.raises(StageStall) as e:
            wait(Never(), "patch 2 activations (step 5)", 2)
        print(e.value)
        message = str(e.value)
        assert "stage 1 (rank 3) waited" in message and "patch 2 activations (step 5) (peer: rank 2)" in message


# ---- stage-only loading ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_stage_reads_and_holds_only_its_blocks_and_the_embedders_it_needs(tiny_models, family):
    full = load_model(tiny_models[family])
    info = full.info
    layout = make_layout(info, ParallelPlan(pipefusion=2), 16, 16, None, 1, None)
    full_state = full.model.state_dict()
    held_total = 0
    for stage in range(2):
        keep = stage_keep(info, layout, stage)
        part = load_model(tiny_models[family], keep=keep)
        held = {n for n, t in part.model.state_dict().items() if not t.is_meta}
        assert held == {n for n in full_state if keep(n)}
        assert ("x_embedder.weight" in held or "pos_embed.proj.weight" in held) == (stage == 0)
        assert ("proj_out.weight" in held) == (stage == 1)
        assert any(n.startswith("time_text_embed.") for n in held)   # every stage modulates with it
        for n in held:
            assert torch.equal(part.model.state_dict()[n], full_state[n]), n
        assert part.stats["bytes_read"] < full.stats["bytes_read"]
        held_total += held_bytes(part.model)
        print(f"{family} stage {stage}: held {held_bytes(part.model)} of {held_bytes(full.model)} bytes, read "
              f"{part.stats['bytes_read']} of {full.stats['bytes_read']}")
    shared = sum(t.numel() * t.element_size() for n, t in full_state.items() if n.startswith("time_text_embed."))
    assert held_total == held_bytes(full.model) + shared   # only the timestep embedder is held twice


def test_a_synthetic_stage_holds_the_values_the_whole_synthetic_model_has():
    full = load_model("synthetic:flux-dev:tiny", seed=4)
    keep = lambda n: n.startswith("transformer_blocks.1.")  # noqa: E731
    part = load_model("synthetic:flux-dev:tiny", seed=4, keep=keep)
    names = [n for n in full.model.state_dict() if keep(n)]
    assert names and all(torch.equal(part.model.state_dict()[n], full.model.state_dict()[n]) for n in names)
    assert held_bytes(part.model) < held_bytes(full.model) / 4


# ---- real ranks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,plan,cfg,text", [
    ("flux", dict(pipefusion=2), 1.0, 24),
    ("sd3", dict(pipefusion=2), 4.5, 30),
    ("flux", dict(pipefusion=4), 1.0, 25),
    ("flux", dict(pipefusion=2, ulysses=2), 1.0, 24),
    ("sd3", dict(pipefusion=2, cfg=2), 4.5, 30),
    ("flux", dict(pipefusion=2, ring=2), 1.0, 25),
], ids=lambda v: str(v))
def test_warmup_over_every_step_equals_the_single_rank_latent(tiny_models, engines, family, plan, cfg, text):
    reference, _ = run(engines, request(tiny_models, family, cfg=cfg, text=text))
    r = request(tiny_models, family, plan=ParallelPlan(**plan), cfg=cfg, text=text, warmup_steps=3)
    out, result = run(engines, r)
    diff = (out - reference).abs().max()
    assert report(f"{family} {r.plan.describe()} W=steps", diff, min(1e-4, bound(reference, family, 3, cfg)))
    info = result.ranks[0]["pipefusion"]
    # a stage, not the whole model (fp32: 4 bytes a parameter); the stage may be resident from an earlier job
    assert info["held_bytes"] < inspect_model(tiny_models[family]).parameters * 4


def test_the_patches_share_one_draw_of_each_steps_brownian_noise(tiny_models, engines):
    """dpmpp_2m_sde's step noise comes from one Brownian tree for the whole latent, drawn once a step (prepared a step
    ahead) and shared by the patches' samplers, each taking its rows: with the warmup over every step the latent
    equals one rank's."""
    reference, _ = run(engines, request(tiny_models, "flux", sampler="dpmpp_2m_sde"))
    r = request(tiny_models, "flux", plan=ParallelPlan(pipefusion=2), sampler="dpmpp_2m_sde", patches=3,
                warmup_steps=3)
    out, _ = run(engines, r)
    assert report(f"flux {r.plan.describe()} dpmpp_2m_sde W=steps", (out - reference).abs().max(),
                  min(1e-4, bound(reference, "flux", 3, 1.0)))


@pytest.mark.parametrize("stages", [3, 4])
def test_three_and_four_stages_post_receives_ahead_on_links_that_each_carry_one_direction(tiny_models, engines,
                                                                                         stages):
    """Every stage posts its receives a step ahead; on NCCL a rank's operations on one communicator run in the order
    posted, so a stage that received and sent over one communicator (the middle stages, with three or more) would
    queue its own sends behind receives waiting for the pipeline to come round. Each link has its own communicator:
    the ranks' instrument (engine/syncs.py) records every point-to-point operation per process group, and no group
    carries both a rank's sends and its receives. The job runs to the end near the single-rank latent (W = 1)."""
    from engine import syncs
    from engine.runtime.client import Engine
    from conftest import FAST
    reference, _ = run(engines, request(tiny_models, "flux"))
    r = request(tiny_models, "flux", plan=ParallelPlan(pipefusion=stages), patches=stages, warmup_steps=1)
    with Engine(stages, device="cpu", deadlines=FAST, env={syncs.ENV: "count"}) as engine:
        result = engine.submit("generate", *r.to_job())
    rel = float((result.outputs["samples"] - reference).norm() / reference.norm())
    print(f"flux {r.plan.describe()} W=1, 3 steps: relative L2 {rel:.4f}")
    assert rel <= 0.15
    for rank in result.ranks:
        p2p = rank["host_syncs"]["p2p"]
        print(f"rank {rank['rank']} (stage {rank['pipefusion']['stage']}): most receives posted ahead "
              f"{rank['pipefusion']['receives_ahead']}; point-to-point per group {p2p}")
        assert rank["pipefusion"]["receives_ahead"] > 1
        assert sorted(tuple(ops) for ops in p2p.values()) == [("recv",), ("send",)]


@pytest.mark.parametrize("family,plan,cfg,text,sampler", [
    ("flux", dict(pipefusion=2), 1.0, 24, "euler"),
    ("sd3", dict(pipefusion=2, cfg=2), 4.5, 30, "dpmpp_2m"),
    ("flux", dict(pipefusion=2, dp=2), 1.0, 24, "euler_ancestral"),
], ids=lambda v: str(v))
def test_one_warmup_step_stays_close_and_closes_in_as_steps_shrink(tiny_models, engines, family, plan, cfg, text,
                                                                     sampler):
    """With W = 1 every patch attends to the other patches' K/V from one call earlier. That staleness is first order
    in the step: at 3 steps each call moves sigma by a third of its range, the coarsest schedule anyone runs, and the
    latent stays within 15% (relative L2) of the exact one (PipeFusion's paper reports images indistinguishable at
    the usual 20-50 steps); at 12 steps the steps are 4x smaller and the difference must fall by at least half. A
    wrong patch position or a stale text stream would not shrink with the step."""
    batch = 2 if plan.get("dp") else 1
    rel = {}
    for steps in (3, 12):
        reference, _ = run(engines, request(tiny_models, family, cfg=cfg, text=text, batch=batch, steps=steps,
                                            sampler=sampler))
        out, _ = run(engines, request(tiny_models, family, plan=ParallelPlan(**plan), cfg=cfg, text=text, batch=batch,
                                      steps=steps, sampler=sampler, warmup_steps=1))
        rel[steps] = float((out - reference).norm() / reference.norm())
        print(f"{family} {ParallelPlan(**plan).describe()} {sampler} W=1, {steps} steps: relative L2 {rel[steps]:.4f}")
    assert rel[3] <= 0.15
    assert rel[12] <= rel[3] / 2


GRID = [(family, hw, p, m) for family in ("flux", "sd3") for hw in [(4, 4), (8, 12), (12, 8), (16, 16)]
        for p in (2, 4) for m in (p, 2 * p)]


@pytest.mark.parametrize("family,hw,stages,patches", GRID, ids=lambda v: str(v))
def test_every_size_runs_to_the_right_shape_or_is_refused_before_launch(tiny_models, engines, family, hw, stages,
                                                                         patches):
    try:
        r = request(tiny_models, family, plan=ParallelPlan(pipefusion=stages), hw=hw, patches=patches, text=25,
                    cfg=1.0 if family == "flux" else 4.5)
    except PlanError as e:
        message = str(e)
        print(f"{family} {hw} P={stages} M={patches}: refused: {message}")
        assert f"patches {patches} exceeds the latent's {hw[0] // 2} token rows" in message
        return
    out, _ = run(engines, r)
    print(f"{family} {hw} P={stages} M={patches}: ran, {list(out.shape)}")
    assert out.shape == (1, 16, *hw) and torch.isfinite(out).all()


@pytest.mark.parametrize("fields,message", [
    (dict(plan=ParallelPlan(pipefusion=2), patches=1), "patches 1 is fewer than the 2 stages"),
    (dict(plan=ParallelPlan(pipefusion=2), patches=9), "patches 9 exceeds the latent's 8 token rows"),
    (dict(plan=ParallelPlan(pipefusion=2), warmup_steps=4), "warmup steps 4 is outside 1..3"),
    (dict(plan=ParallelPlan(pipefusion=2), stage_blocks=[3, 4]), "stage blocks [3, 4] do not split"),
    (dict(plan=ParallelPlan(pipefusion=2, ulysses=4), patches=3, hw=(16, 12)),
     "not divisible by ulysses x ring = 4: use patches 4"),
    (dict(plan=ParallelPlan(pipefusion=2), cache_threshold=0.1), "step cache does not combine with pipefusion"),
    (dict(patches=2), "only apply with pipefusion >= 2"),
])
def test_pipefusion_settings_that_cannot_run_are_refused_with_the_numbers(tiny_models, fields, message):
    with pytest.raises(PlanError, match=None) as e:
        request(tiny_models, "flux", **fields)
    print(e.value)
    assert message in str(e.value)


def test_more_stages_than_blocks_is_refused(tiny_models):
    with pytest.raises(PlanError, match="pipefusion 8 exceeds the model's 4 layers"):
        request(tiny_models, "sd3", plan=ParallelPlan(pipefusion=8), cfg=4.5, patches=8)


def test_a_cancelled_pipeline_drains_and_the_engine_runs_the_next_job(tiny_models, engines):
    r = request(tiny_models, "flux", plan=ParallelPlan(pipefusion=2), steps=30, patches=4)
    seen = []
    with pytest.raises(JobCancelled):
        engines(2).submit("generate", *r.to_job(), on_progress=lambda s, t: seen.append(s),
                          should_cancel=lambda: len(seen) >= 2)
    assert seen and max(seen) < 30
    out, _ = run(engines, request(tiny_models, "flux", plan=ParallelPlan(pipefusion=2), warmup_steps=3))
    reference, _ = run(engines, request(tiny_models, "flux"))
    assert report("flux pipefusion2 after a cancel", (out - reference).abs().max(), 1e-4)


@pytest.mark.parametrize("family,plan,settings", [
    ("flux", dict(pipefusion=2), dict(patches=4)),
    ("flux", dict(pipefusion=2, ulysses=2), dict(patches=2)),
    ("flux", dict(pipefusion=2, ring=2), dict(patches=2)),
    ("flux", dict(pipefusion=2, dp=2), dict(patches=2, batch=2)),
    ("sd3", dict(pipefusion=2, cfg=2), dict(patches=2, cfg=4.5, text=30)),
    ("sd3", dict(pipefusion=2), dict(patches=2, cfg=4.5, text=30)),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_every_kind_of_bytes_each_rank_sends_equals_the_planners_closed_form(tiny_models, engines, family, plan,
                                                                             settings):
    """Counted at the send on every rank of a real job (a warmup call, then patches), per collective kind, against
    the closed forms the planner prices with (cost.pipefusion_attention_bytes, comm.pipefusion_job_bytes): a stage's
    attention layers (Ring's hops carrying the whole stale K/V share for every patch), the last stage's velocity
    gathers, the messages between stages."""
    from engine.parallel.comm import pipefusion_job_bytes
    steps = 3
    settings = dict(settings)
    text, batch = settings.pop("text", 24), settings.get("batch", 1)
    r = request(tiny_models, family, plan=ParallelPlan(**plan), steps=steps, text=text, warmup_steps=1, **settings)
    _, result = run(engines, r)
    config = inspect_model(tiny_models[family]).config
    dual = set(config.get("dual_attention_layers") or ())
    passes = 2 if r.cfg != 1.0 else 1
    passes_mine = passes // r.plan.cfg
    for rank in result.ranks:
        blocks = rank["pipefusion"]["blocks"]
        expected = pipefusion_job_bytes(
            r.plan, stage=rank["pipefusion"]["stage"], layers=len(blocks), dual_layers=len(dual & set(blocks)),
            image_tokens=64, text_tokens=text, heads=config["num_attention_heads"],
            head_dim=config["attention_head_dim"], out_features=64, rows=passes_mine * batch // r.plan.dp,
            passes_mine=passes_mine, passes=passes, images=batch, latent=(16, 16, 16), patches=r.patches,
            calls=steps, warm_calls=1, elem_bytes=4)
        counted = {k: round(v * steps) for k, v in rank["bytes_sent_per_step"].items() if v}
        print(f"{r.plan.describe()} rank {rank['rank']} (stage {rank['pipefusion']['stage']}, blocks {blocks}): "
              f"counted {counted}; closed form {expected}")
        assert counted == expected


# ---- stages that fit the GPUs ---------------------------------------------------------------------------------

def test_stages_balance_compute_unless_a_stage_would_not_fit_then_the_most_balanced_split_that_fits():
    """FLUX.1-dev bf16 at 1024^2 (weights, K/V buffers, activations per stage): compute-balanced stages [28, 29]
    put the 19 double blocks, twice a single block's weights, on the first GPU: 18 GiB. On 24 GiB cards that stays;
    on 16 GiB cards the split moves to [21, 36]; on 12 GiB no two-stage split fits and the job is refused."""
    from engine.parallel.devices import stated_hardware
    from engine.parallel.memory import fit_stages
    from engine.parallel.plan import Workload
    info = inspect_model("synthetic:flux-dev")
    work = Workload.for_variant("flux-dev")
    plan = ParallelPlan(pipefusion=2)
    counts, gib, balanced = fit_stages(info, plan, work, 24)
    print(f"24 GiB: {counts} need {gib}")
    assert counts == [28, 29] and balanced and 17 < gib[0] < 19 and gib[1] < gib[0]
    counts, gib, balanced = fit_stages(info, plan, work, 16)
    print(f"16 GiB: {counts} need {gib}")
    assert counts[0] < 28 and not balanced and sum(counts) == 57 and max(gib) <= 16
    assert fit_stages(info, plan, work, 12)[0] is None
    # the request takes the fitted split to the ranks, and refuses what cannot fit, before any rank starts
    r = GenerateRequest.random_conditioning("synthetic:flux-dev", 1024, 1024, text_tokens=512, steps=20,
                                            plan=ParallelPlan(pipefusion=2), dtype="bf16")
    r = r.validate(2, stated_hardware(2, "RTX 4090", "pcie", memory_gib=16))
    print(r.choice.reason)
    assert r.stage_blocks == counts and "does not fit 16 GiB" in r.choice.reason
    r = GenerateRequest.random_conditioning("synthetic:flux-dev", 1024, 1024, text_tokens=512, steps=20,
                                            plan=ParallelPlan(pipefusion=2), dtype="bf16")
    with pytest.raises(PlanError, match="pipefusion2 does not fit flux-dev in 12 GiB per GPU: its stages need"):
        r = r.validate(2, stated_hardware(2, "RTX 4090", "pcie", memory_gib=12))


def test_xdits_failing_case_flux_dev_1024_pipefusion_4_is_accepted_with_a_layout_that_adds_up():
    """xDiT failed FLUX.1-dev 1024x1024 at pipefusion 4 ("split_with_sizes expected sizes summing to 4096 but got
    [4096, 4096, 4096, 4096]"). Here the patches are row bands computed from the latent: checked before launch."""
    r = GenerateRequest.random_conditioning("synthetic:flux-dev", 1024, 1024, text_tokens=512, steps=28,
                                            plan=ParallelPlan(pipefusion=4), dtype="bf16")
    r = r.validate(4)
    info = inspect_model("synthetic:flux-dev")
    layout = make_layout(info, r.plan, 128, 128, r.patches, r.warmup_steps, r.stage_blocks)
    print(layout)
    assert [layout.band_tokens(m) for m in range(4)] == [1024] * 4 and sum(layout.stage_blocks) == 57
    assert sorted(torch.cat([layout.local_tokens(m, 0) for m in range(4)]).tolist()) == list(range(4096))
