"""The cost model against xDiT's published multi-GPU runs (engine/parallel/published.py has the figures and their
sources): FLUX.1-dev 1024^2 28 steps on 1/2/4 H100 (eager and compiled) and on 1/2/4/8 PCIe L40s, SD3-medium 20 steps
with cfg on 1/2/4/8 A100. Each scenario's predictions take its published one-GPU time as their base (xDiT's 6.71 s
for FLUX on an H100, i.e. 240 ms a step), not this engine's calibration (182.6 ms eager / 134.5 ms compiled,
calibration.json), and xDiT's code (its ring and PipeFusion overlap their transfers). Six rows set the model's six
fitted constants; the others are held out. Every test prints the published-vs-predicted table.

Video (engine/parallel/published_video.py): xDiT's HunyuanVideo runs on 1-8 H100, H20 and L20, ParaAttention's on 1-8
L20 with its first-block cache, xDiT's ConsisID on 1-6 H100, priced through the models' published dimensions. One row
sets the seconds outside the transformer loop of xDiT's HunyuanVideo runs; the others are held out."""
import pytest

from engine.families import VARIANTS
from engine.parallel import calibration, cost, devices, published, published_video
from engine.parallel.plan import ParallelPlan


@pytest.fixture(scope="module")
def table():
    lines = published.validation_table()
    print("\n" + "\n".join(lines))
    return lines


def test_each_scenario_predicts_from_its_published_one_gpu_time_not_this_engines_calibration(table):
    flux = published.SCENARIOS[0]
    one = published.predict(flux, "single rank", 1)
    engine = cost.estimate(ParallelPlan(), flux.workload(), devices.stated_hardware(1, "H100 SXM", "nvlink"))
    measured = calibration.measured("H100 SXM", "eager", model="flux-dev")["ms_per_step"]
    print(f"FLUX.1-dev on one H100: xDiT {one.step_ms:.1f} ms/step (base of the scenario), this engine "
          f"{engine.step_ms:.1f} (calibration {measured:.1f})")
    assert one.s_per_image == pytest.approx(flux.one_gpu_s) and engine.step_ms == pytest.approx(measured)
    for s in published.SCENARIOS:
        assert published.predict(s, "single rank", 1).s_per_image == pytest.approx(s.one_gpu_s)


def test_six_rows_set_the_six_fitted_constants_and_the_rest_are_held_out(table):
    roles = [r.role for r in published.validation_rows()]
    fits = sorted(role[len("fit: "):] for role in roles if role.startswith("fit: "))
    assert fits == sorted(published.FITTED)
    assert roles.count("held out") == len(roles) - 6 >= 25


def test_the_fitted_constants_are_what_their_rows_give():
    """Re-fit each constant to its published row (bisection, the others held): the values in cost.py and devices.py
    are these, rounded."""
    fitted = published.fit_constants()
    shipped = {n: getattr(cost, n) for n in published.FITTED if n != "PCIE_A2A_EXPONENT"}
    shipped["PCIE_A2A_EXPONENT"] = devices.PCIE_A2A_EXPONENT
    for name, value in fitted.items():
        print(f"{name}: fitted {value:.4g}, shipped {shipped[name]:.4g}")
        assert shipped[name] == pytest.approx(value, rel=0.02), name


def test_every_held_out_speedup_of_the_checked_scenarios_is_within_20_percent_of_the_published(table):
    names = {s.name for s in published.CHECKED}
    rows = [r for r in published.validation_rows() if r.scenario in names]
    worst = max(rows, key=lambda r: abs(r.speedup_residual))
    print(f"worst: {worst.scenario} {worst.plan}: speed-up {worst.predicted_speedup:.2f} predicted, "
          f"{worst.published_speedup:.2f} published ({worst.speedup_residual:+.1%})")
    assert all(abs(r.speedup_residual) <= 0.20 for r in rows)


def test_each_gpu_counts_pick_is_the_published_best_or_within_10_percent_of_it(table):
    rows = published.best_rows()
    assert {(b.scenario, b.gpus) for b in rows} == {(s.name, g) for s in published.CHECKED for _, g, _, _ in s.rows}
    for b in rows:
        print(f"{b.scenario}, {b.gpus} GPUs: published best {b.published_plan} {b.published_s:.2f} s; picked "
              f"{b.chosen_plan} on {b.chosen_ranks} ({b.chosen_published_s:.2f} s published, {b.within:+.1%})")
        assert b.within <= 0.10
        # the published best's speed-up over one GPU, predicted within 20%
        scenario = next(s for s in published.CHECKED if s.name == b.scenario)
        best = published.predict(scenario, b.published_plan, ParallelPlan.parse(b.published_plan).world_size)
        assert abs(b.published_s / best.s_per_image - 1) <= 0.20   # = predicted / published speed-up - 1


def test_ulysses8_alone_on_8_pcie_l40s_is_predicted_slower_than_one_l40(table):
    l40 = next(s for s in published.SCENARIOS if "L40" in s.name)
    u8, one = published.predict(l40, "ulysses8", 8), published.predict(l40, "single rank", 1)
    print(f"ulysses8 {u8.s_per_image:.1f} s (published ~26.6), one L40 {one.s_per_image:.2f} s (published 18.36)")
    assert u8.s_per_image > one.s_per_image


def test_the_published_bests_that_use_pipefusion_are_picked_only_with_approximate_plans_allowed():
    """L40 and SD3's published bests are PipeFusion (approximate): the default, exact-only pick avoids them."""
    from engine.parallel.planner import survey
    for s in published.CHECKED:
        if not s.approximate:
            continue
        for gpus in sorted({g for _, g, _, _ in s.rows}):
            exact = survey(gpus, s.workload(), published.hardware(s, gpus), False, code=cost.XDIT,
                           one_gpu_ms=s.one_gpu_ms).chosen
            assert exact.exact and exact.plan.pipefusion == 1, (s.name, gpus)


# ---- video --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def video_table():
    lines = published_video.validation_table()
    print("\n" + "\n".join(lines))
    return lines


HUNYUAN = [s for s in published_video.VIDEO_SCENARIOS if s.dims is published_video.HUNYUANVIDEO]


def test_the_video_rows_are_priced_through_published_dims_not_an_engine_family_with_every_row_printed(video_table):
    rows = published_video.validation_rows()
    assert len(rows) == sum(len(s.rows) for s in published_video.VIDEO_SCENARIOS) == 30
    assert all(f"| {r.gpus} | {r.plan} | {r.published_s:.2f} |" in "\n".join(video_table) for r in rows)
    for s in published_video.VIDEO_SCENARIOS:
        assert s.dims.name not in VARIANTS and s.dims.source and s.source
        assert published_video.predicted_s(s, "single rank", 1) == pytest.approx(s.one_gpu_s)
    # 129 frames at 1280x720 and at 960x960: 33 latent frames of 3600 tokens
    assert {s.workload().image_tokens for s in HUNYUAN} == {33 * 45 * 80}


def test_one_row_sets_the_seconds_outside_the_loop_and_the_rest_are_held_out(video_table):
    roles = [r.role for r in published_video.validation_rows()]
    assert roles.count("fit: HUNYUANVIDEO_OUTSIDE_S") == 1 and roles.count("held out") == len(roles) - 1
    fitted = published_video.fit_outside()
    print(f"HUNYUANVIDEO_OUTSIDE_S: fitted {fitted:.2f} s, shipped {published_video.HUNYUANVIDEO_OUTSIDE_S}")
    assert published_video.HUNYUANVIDEO_OUTSIDE_S == pytest.approx(fitted, rel=0.02)


def test_every_held_out_hunyuanvideo_row_is_within_10_percent_of_the_published(video_table):
    rows = [r for r in published_video.validation_rows(HUNYUAN) if r.role == "held out"]
    worst = max(rows, key=lambda r: abs(r.residual))
    print(f"worst: {worst.scenario} {worst.plan}: {worst.predicted_s:.1f} s predicted, {worst.published_s:.1f} "
          f"published ({worst.residual:+.1%})")
    assert len(rows) == 18 and all(abs(r.residual) <= 0.10 for r in rows)


def test_every_held_out_hunyuanvideo_speedup_from_one_gpu_count_to_the_next_is_within_12_percent(video_table):
    ratios = [r for r in published_video.ratios(HUNYUAN) if r.held_out]
    worst = max(ratios, key=lambda r: abs(r.residual))
    print(f"worst: {worst.scenario} {worst.from_gpus} -> {worst.to_gpus}: {worst.predicted:.2f} predicted, "
          f"{worst.published:.2f} published ({worst.residual:+.1%})")
    assert len(ratios) == 18 and all(abs(r.residual) <= 0.12 for r in ratios)


def test_consisid_cfg_parallel_is_predicted_and_its_sequence_parallel_rows_miss(video_table):
    """xDiT's ConsisID rows: CFG parallel on 2 H100 within 5%; its Ulysses and Ring rows ran slower than the model
    predicts (6 GPUs of sequence parallel slower than 4 with CFG parallel), by more than the 25% aimed for on 6 GPUs:
    the README lists them as misses."""
    consisid = next(s for s in published_video.VIDEO_SCENARIOS if s.dims is published_video.CONSISID)
    rows = {(r.plan, r.gpus): r for r in published_video.validation_rows([consisid])}
    for r in rows.values():
        print(f"{r.plan} on {r.gpus}: {r.residual:+.1%}")
    assert abs(rows[("cfg2", 2)].residual) <= 0.05
    assert all(r.residual < -0.25 for (plan, gpus), r in rows.items() if gpus == 6)
