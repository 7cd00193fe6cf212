"""The cost model against published multi-GPU runs (engine/published/images.py for images, engine/published/video.py for
video; each row's source and the reason it is fitted or held out are there). Each scenario's predictions take its
published one-GPU time as their base and its code's overlap, calls and launches. The fitted constants are fitted to the
rows marked fit (engine/published/fitting.py); every other row is held out. The tests print the tables they judge."""
import math
from dataclasses import replace

import pytest

from engine.families import VARIANTS
from engine.parallel import cost, fits
from engine.published import fitting, images as published, video as published_video
from engine.parallel.devices import stated_hardware
from engine.parallel.plan import Workload
from engine.parallel.planner import survey

SCENARIOS = published.all_scenarios()


@pytest.fixture(scope="module")
def table():
    lines = published.validation_table() + [""] + published.summary()
    print("\n" + "\n".join(lines))
    return lines


def _named(key):
    return next(s for s in SCENARIOS if s.key == key)


# ---- the data and the split ----------------------------------------------------------------------------------------
def test_every_row_is_fit_or_held_out_with_its_source_and_every_fitted_constant_has_rows(table):
    rows = [(s, r) for s in SCENARIOS for r in s.runs]
    assert all(s.source and (r.why or not r.fit) for s, r in rows)
    fit_rows = fitting.fit_rows()
    print(f"{len(rows)} rows, {len(fit_rows)} fit, {len(rows) - len(fit_rows)} held out")
    assert len(rows) - len(fit_rows) >= 100 and len(fit_rows) <= 12
    for name in fitting.names():   # each constant is named by a row it is fitted to
        assert any(name in r.why for _, r in fit_rows), name
    assert all(f"| {r.why} |" in "\n".join(table) for _, r in fit_rows)


def test_each_scenario_predicts_its_published_one_gpu_time():
    for s in SCENARIOS:
        if s.one_gpu_s is not None:
            assert published.predicted_s(s, "single rank", 1) == pytest.approx(s.one_gpu_s, rel=1e-9), s.key


def test_the_shipped_constants_are_the_fit_of_the_fit_rows():
    """Fitted again from the middle of every constant's bounds (not from the shipped values), the constants land within
    2% of the shipped ones."""
    start = {c.name: math.sqrt(c.low * c.high) for c in fitting.CONSTANTS}
    fitted = fitting.fit_constants(rounds=5, steps=12, start=start)
    for c in fitting.CONSTANTS:
        print(f"{c.name}: fitted {fitted[c.name]:.4g}, shipped {fitting.value(c.name):.4g} ({c.low:g} to {c.high:g}: "
              f"{c.bounds})")
        assert fitted[c.name] == pytest.approx(fitting.value(c.name), rel=0.02), c.name
    assert fitting.loss(fitted) == pytest.approx(fitting.loss(), rel=0.01)


# ---- held out ------------------------------------------------------------------------------------------------------
# Held-out speed-ups the model misses by more than 25%, each for a reason docs/planner.md gives.
SPEEDUP_MISSES = {
    ("xdit-flux-schnell-l40", 2, 4),       # published no faster on 4 than on 2 (1.87 s both) with a faster 1 -> 2
    ("paraattention-flux-a100", 2, 4),     # ParaAttention's eager hybrid at 4 scales worse than its ring at 2
    ("xdit-consisid-h100", 2, 3),          # ConsisID's sequence-parallel runs scale worse than their FLOPs and bytes
}


def test_every_held_out_speedup_is_within_25_percent_but_the_named_misses(table):
    keys = {s.name: s.key for s in SCENARIOS}
    ratios = [r for r in published.ratios() if r.held_out]
    misses = {(keys[r.scenario], r.from_gpus, r.to_gpus) for r in ratios if abs(r.residual) > 0.25}
    within = sum(abs(r.residual) <= 0.25 for r in ratios)
    print(f"held-out speed-ups within 25%: {within} of {len(ratios)}; misses: {sorted(misses)}")
    assert len(ratios) >= 70 and misses == set(SPEEDUP_MISSES)


def test_most_held_out_rows_are_within_25_percent_and_every_hunyuanvideo_row_within_15(table):
    held = [r for r in published.validation_rows() if not r.fit]
    within = sum(abs(r.residual) <= 0.25 for r in held)
    print(f"held-out rows within 25%: {within} of {len(held)}")
    assert within >= 0.8 * len(held)
    video = [r for s in published_video.VIDEO_SCENARIOS if s.workload().variant == "HunyuanVideo"
             for r in published.validation_rows([s]) if not r.fit]
    worst = max(video, key=lambda r: abs(r.residual))
    print(f"worst HunyuanVideo row: {worst.scenario} {worst.plan}: {worst.residual:+.1%}")
    assert len(video) >= 19 and abs(worst.residual) <= 0.15


def test_on_8_nvlink_gpus_a_ring_of_8_costs_more_than_ulysses_led_hybrids_as_published():
    """xDiT issue 416 (8xH100, FLUX.1-dev eager): ring8 4.34 s, ulysses2 x ring4 3.55, ulysses4 x ring2 2.81. Each hop
    adds its launches, its merge and its short-block attention: the model orders them so, and their ratios to the
    hybrid of one hop are within 25% (its absolute times borrow another machine's one-GPU step)."""
    s = _named("xdit-issue416-h100x8")
    runs = {r.plan: r.seconds for r in s.runs}
    predicted = {plan: published.predicted_s(s, plan, 8) for plan in runs}
    print({p: f"{runs[p]:g} published, {predicted[p]:.2f} predicted" for p in runs})
    assert predicted["ring8"] > predicted["ulysses2,ring4"] > predicted["ulysses4,ring2"]
    for plan in ("ring8", "ulysses2,ring4"):
        ratio = predicted[plan] / predicted["ulysses4,ring2"]
        assert ratio == pytest.approx(runs[plan] / runs["ulysses4,ring2"], rel=0.25), plan
    a100 = _named("xdit-flux-a100")   # xDiT's 8xA100 figure: ring8 6.70 s against ulysses8 4.13
    assert published.predicted_s(a100, "ring8", 8) > 1.25 * published.predicted_s(a100, "ulysses8", 8)


def test_ulysses8_alone_on_8_pcie_l40s_is_predicted_slower_than_one_l40(table):
    l40 = _named("xdit-flux-l40")
    u8 = published.predicted_s(l40, "ulysses8", 8)
    print(f"ulysses8 {u8:.1f} s (published 26.6), one L40 {l40.one_gpu_s} s")
    assert u8 > l40.one_gpu_s


# ---- the planner on the published scenarios ------------------------------------------------------------------------
def test_each_gpu_counts_pick_among_the_published_plans_is_within_20_percent_of_the_published_best(table):
    rows = published.best_rows()
    for b in rows:
        print(f"{b.scenario}, {b.gpus} GPUs: published best {b.published_plan} {b.published_s:g}; picked "
              f"{b.chosen_plan} on {b.chosen_ranks} ({b.chosen_published_s:g} published, {b.within:+.1%})")
    assert len(rows) >= 20 and all(b.within <= 0.20 for b in rows)
    assert sum(b.within <= 0.05 for b in rows) >= 0.75 * len(rows)


def test_the_published_bests_that_use_pipefusion_are_picked_only_with_approximate_plans_allowed():
    """L40 and SD3's published bests are PipeFusion (approximate): the default, exact-only pick avoids them."""
    for s in published.checked_scenarios():
        if not s.approximate:
            continue
        for gpus in sorted({r.gpus for r in s.runs}):
            exact = survey(gpus, s.workload(), published.hardware(s, gpus), False, code=s.code,
                           one_gpu_ms=s.one_gpu_ms).chosen
            assert exact.exact and exact.plan.pipefusion == 1, (s.name, gpus)


def _auto_against_one_gpu(work, hw, **kw):
    found = survey(hw.gpus, work, hw, **kw)
    one = found.best_on(1)
    return found.chosen, one


def test_auto_is_never_predicted_slower_than_one_gpu_on_the_published_scenarios():
    for s in SCENARIOS:
        for gpus in sorted({r.gpus for r in s.runs}):
            hw = replace(published.hardware(s, gpus), memory_gib=None)   # the runs ran: their memory is not judged
            chosen, one = _auto_against_one_gpu(s.workload(), hw, code=s.code, one_gpu_ms=s.one_gpu_ms)
            assert chosen.job_ms <= one.job_ms, (s.key, gpus, chosen.plan)


@pytest.mark.parametrize("machine", fits.MACHINES, ids=[m.label for m in fits.MACHINES])
def test_auto_is_never_predicted_slower_than_one_gpu_on_the_fit_tables_machines(machine):
    """docs/fit.md's machines (the Wan fit table's) under its image and video jobs."""
    hw = stated_hardware(machine.gpus, machine.gpu, machine.link, memory_gib=500)
    works = [Workload.for_variant(v, negative_pass=v.startswith("sd3")) for v in ("flux-dev", "sd3-medium", "qwen-image")]
    works += [Workload.for_variant("wan2.1-1.3b", w, h, frames=81, negative_pass=True, steps=20)
              for w, h in ((832, 480), (1280, 720))]
    for work in works:
        chosen, one = _auto_against_one_gpu(work, hw)
        assert chosen.job_ms <= one.job_ms, (machine.label, work.variant, chosen.plan)


# ---- video ---------------------------------------------------------------------------------------------------------
def test_the_video_rows_are_priced_through_published_dims_or_the_engines_wan(table):
    for s in published_video.VIDEO_SCENARIOS:
        work = s.workload()
        assert (work.variant in VARIANTS) == work.variant.startswith("wan"), s.key
        assert published.predicted_s(s, "single rank", 1) == pytest.approx(s.one_gpu_s)
    hv = [s for s in published_video.VIDEO_SCENARIOS if s.key.startswith("xdit-hv-")]
    assert {s.workload().image_tokens for s in hv} == {33 * 45 * 80}   # 129 frames at 1280x720 and 960x960


def test_consisid_cfg_parallel_is_predicted_and_its_sequence_parallel_rows_miss(table):
    """xDiT's ConsisID rows: CFG parallel on 2 H100 within 5%; its Ulysses and Ring rows ran slower than the model
    predicts (6 GPUs of sequence parallel slower than 4 with CFG parallel), by more than 25% on 6 GPUs: docs/planner.md
    lists them as misses."""
    rows = {(r.plan, r.gpus): r for r in published.validation_rows([_named("xdit-consisid-h100")])}
    for r in rows.values():
        print(f"{r.plan} on {r.gpus}: {r.residual:+.1%}")
    assert abs(rows[("cfg2", 2)].residual) <= 0.05
    assert all(r.residual < -0.25 for (plan, gpus), r in rows.items() if gpus == 6)


def test_the_ring_pays_per_hop_in_launches_and_merges_and_in_short_blocks():
    """One layer of FLUX.1-dev on 8 H100s: each extra hop adds the code's launches and a merge of the layer's output,
    and splits the keys into shorter blocks, each run at a lower attention efficiency."""
    work = Workload.for_variant("flux-dev")
    hw = stated_hardware(8, "H100 SXM", "nvlink")
    from engine.parallel.plan import ParallelPlan
    ring = {r: ParallelPlan(ulysses=8 // r, ring=r) for r in (2, 4, 8)}
    ops = {r: cost.launches_per_step(p, work) for r, p in ring.items()}
    merges = {r: cost.merge_ms(p, work, hw) for r, p in ring.items()}
    eff = {r: min(cost.attention_efficiency(rows, keys) for _, _, rows, keys in cost.attention_calls(p, work))
           for r, p in ring.items()}
    print(ops, merges, eff)
    code = cost.engine_code()
    assert ops[4] - ops[2] == pytest.approx(work.layers * 2 * code.ring_hop_ops)
    assert merges[2] < merges[4] < merges[8] and eff[2] > eff[4] > eff[8]
