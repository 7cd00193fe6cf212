"""Sigma schedules against ComfyUI 0.3.64's own numbers (tests/golden/comfyui_sigmas.json) for FLUX.1 and SD3."""
import json
import math
import os

import pytest
import torch

from engine.sampling.schedules import SCHEDULERS, FlowSampling, compute_sigmas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_PATH = os.path.join(ROOT, "tests", "golden", "comfyui_sigmas.json")  # numbers ComfyUI computed
TOLERANCE = 1e-6


def _load_golden() -> dict[str, dict[str, list[float]]]:
    with open(GOLDEN_PATH) as f:
        return json.load(f)["models"]


GOLDEN = _load_golden()
SAMPLINGS = {"flux_shift_1.15": FlowSampling.flux(), "sd3_shift_3.0": FlowSampling.sd3()}
GOLDEN_CASES = [(model, key) for model in GOLDEN for key in GOLDEN[model]]


def _max_abs_diff(got: torch.Tensor, expected: list[float]) -> float:
    """Max |got - expected| over positions; NaN must sit at the same places in both (ComfyUI's kl_optimal/1 is NaN)."""
    want = torch.tensor(expected, dtype=torch.float64)
    have = got.to(torch.float64)
    assert have.shape == want.shape, f"length {tuple(have.shape)} != ComfyUI's {tuple(want.shape)}"
    assert torch.equal(have.isnan(), want.isnan()), f"NaN positions differ: {have.tolist()} vs {expected}"
    return (have - want).nan_to_num(0.0).abs().max().item()


def test_golden_file_covers_every_scheduler_for_both_models():
    assert set(GOLDEN) == set(SAMPLINGS)
    for model in GOLDEN:
        assert {key.split("/")[0] for key in GOLDEN[model]} == set(SCHEDULERS)
    assert len(GOLDEN_CASES) == 2 * len(SCHEDULERS) * 4


@pytest.mark.parametrize("model,key", GOLDEN_CASES, ids=[f"{m}-{k}" for m, k in GOLDEN_CASES])
def test_schedule_equals_comfyui(model, key):
    scheduler, steps = key.split("/")
    sigmas = compute_sigmas(SAMPLINGS[model], scheduler, int(steps))
    assert sigmas.dtype == torch.float32 and sigmas.ndim == 1
    assert sigmas[-1].item() == 0.0
    diff = _max_abs_diff(sigmas, GOLDEN[model][key])
    print(f"{model} {key}: max abs diff {diff:.3e}")
    assert diff <= TOLERANCE


# (steps, denoise, steps ComfyUI actually schedules = int(steps / denoise)), all present in the golden file.
DENOISE_CASES = [(10, 0.5, 20), (2, 0.5, 4), (14, 0.5, 28), (7, 0.25, 28), (1, 0.25, 4), (5, 0.25, 20), (3, 0.75, 4),
                 (21, 0.75, 28)]


@pytest.mark.parametrize("model", list(SAMPLINGS))
@pytest.mark.parametrize("steps,denoise,scheduled", DENOISE_CASES, ids=[f"{s}@{d}" for s, d, _ in DENOISE_CASES])
def test_partial_denoise_keeps_the_tail_of_the_longer_schedule(model, steps, denoise, scheduled):
    worst = 0.0
    for scheduler in SCHEDULERS:
        full = GOLDEN[model][f"{scheduler}/{scheduled}"]
        sigmas = compute_sigmas(SAMPLINGS[model], scheduler, steps, denoise)
        assert len(sigmas) == steps + 1, scheduler
        worst = max(worst, _max_abs_diff(sigmas, full[-(steps + 1):]))
    print(f"{model} steps={steps} denoise={denoise}: max abs diff {worst:.3e}")
    assert worst <= TOLERANCE


def test_denoise_just_below_one_still_gives_the_full_schedule():
    sigmas = compute_sigmas(SAMPLINGS["sd3_shift_3.0"], "beta", 20, denoise=0.99995)
    assert _max_abs_diff(sigmas, GOLDEN["sd3_shift_3.0"]["beta/20"]) <= TOLERANCE


def test_zero_denoise_gives_an_empty_float32_schedule():
    sigmas = compute_sigmas(SAMPLINGS["flux_shift_1.15"], "simple", 20, denoise=0.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (0,)


def test_sigma_tables_and_timestep_conversions_follow_comfyui():
    flux, sd3 = SAMPLINGS["flux_shift_1.15"], SAMPLINGS["sd3_shift_3.0"]
    assert (flux.kind, flux.shift, sd3.kind, sd3.shift, sd3.multiplier) == ("flux", 1.15, "discrete_flow", 3.0, 1000)
    assert flux.sigmas.shape == (10_000,) and sd3.sigmas.shape == (1_000,)
    assert flux.sigmas.dtype == sd3.sigmas.dtype == torch.float32
    assert float(flux.sigma_max) == float(sd3.sigma_max) == 1.0
    assert float(flux.sigma_min) == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 9999), rel=1e-6)
    assert float(sd3.sigma_min) == pytest.approx(3 * 0.001 / (1 + 2 * 0.001), rel=1e-6)
    assert float(sd3.timestep(0.5)) == 500.0 and float(flux.timestep(0.3)) == pytest.approx(0.3)
    assert float(sd3.sigma(500.0)) == pytest.approx(0.75, abs=1e-7)
    assert float(flux.sigma(0.5)) == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 1), abs=1e-7)
    assert torch.all(flux.sigmas[1:] > flux.sigmas[:-1]) and torch.all(sd3.sigmas[1:] > sd3.sigmas[:-1])


def test_unknown_scheduler_is_rejected_with_the_supported_names():
    with pytest.raises(ValueError, match=r"scheduler='foo' is not supported; use one of \['simple', 'normal'"):
        compute_sigmas(SAMPLINGS["sd3_shift_3.0"], "foo", 20)


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_bad_steps_are_rejected(steps):
    with pytest.raises(ValueError, match=rf"steps={steps!r} is not supported; use an integer >= 1"):
        compute_sigmas(SAMPLINGS["sd3_shift_3.0"], "simple", steps)


@pytest.mark.parametrize("denoise", [-0.1, 1.5, float("nan")])
def test_denoise_outside_zero_to_one_is_rejected(denoise):
    with pytest.raises(ValueError, match=rf"denoise={denoise!r} is outside \[0, 1\]; use a number in \[0, 1\]"):
        compute_sigmas(SAMPLINGS["flux_shift_1.15"], "simple", 20, denoise)


@pytest.mark.parametrize("shift", [0, -1.0, float("inf")])
def test_non_positive_or_infinite_shift_is_rejected(shift):
    for factory in (FlowSampling.flux, FlowSampling.sd3):
        with pytest.raises(ValueError, match=rf"shift={shift!r} is not supported; use a finite number > 0"):
            factory(shift)
