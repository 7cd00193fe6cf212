"""engine.sampling.samplers against plain reference loops written here from ComfyUI's published k-diffusion formulas.

The references draw their noise the way ComfyUI does (a CPU generator seeded seed + 1 for the ancestral sampler, a
torchsde Brownian tree seeded with the seed for the SDE sampler) so both sides see the same noise.
"""
import math

import pytest
import torch
import torchsde

from engine.sampling.samplers import SAMPLERS, sample
from engine.sampling.schedules import FlowSampling, compute_sigmas

SEED = 20251009
TOLERANCE = 1e-6


def toy_denoiser():
    """A fixed nonlinear x0 estimate: channel mixing + tanh as the velocity, denoised = x - sigma * v (CONST)."""
    generator = torch.Generator().manual_seed(1234)
    mix = torch.randn(16, 16, generator=generator) / 4
    bias = torch.randn(16, 1, 1, generator=generator) / 10

    def denoise(x, sigma):
        velocity = torch.tanh(torch.einsum("oc,bchw->bohw", mix, x) + bias) + 0.3 * x
        return x - sigma * velocity

    return denoise


def start_latent(sigma0):
    generator = torch.Generator().manual_seed(99)
    noise = torch.randn(2, 16, 8, 8, generator=generator)
    clean = torch.randn(2, 16, 8, 8, generator=generator) * 0.5
    return sigma0 * noise + (1 - sigma0) * clean


def sd3_percent_to_sigma(percent):
    t = 1.0 - percent
    return 3.0 * t / (1 + 2.0 * t)


# ---- reference samplers: one step per loop iteration, ComfyUI's formulas written out -------------------------------

def ref_euler(denoise, x, sigmas):
    for i in range(len(sigmas) - 1):
        d = (x - denoise(x, sigmas[i])) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def ref_heun(denoise, x, sigmas):
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        d = (x - denoise(x, s)) / s
        if s_next == 0:
            x = x + d * (s_next - s)
            continue
        x_try = x + d * (s_next - s)
        d_try = (x_try - denoise(x_try, s_next)) / s_next
        x = x + (d + d_try) / 2 * (s_next - s)
    return x


def ref_euler_ancestral_rf(denoise, x, sigmas, seed):
    # sample_euler_ancestral_RF with eta = 1, s_noise = 1; default_noise_sampler on the CPU seeds with seed + 1.
    step_noise = torch.Generator().manual_seed(seed + 1)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        x0 = denoise(x, s)
        if s_next == 0:
            x = x0
            continue
        s_down = s_next * (1 + (s_next / s - 1) * 1.0)
        a_next = 1 - s_next
        a_down = 1 - s_down
        coeff = (s_next ** 2 - s_down ** 2 * a_next ** 2 / a_down ** 2) ** 0.5
        ratio = s_down / s
        x = ratio * x + (1 - ratio) * x0
        z = torch.randn(x.shape, generator=step_noise)
        x = (a_next / a_down) * x + z * 1.0 * coeff
    return x


def ref_dpmpp_2m(denoise, x, sigmas):
    x0_prev = None
    for i in range(len(sigmas) - 1):
        x0 = denoise(x, sigmas[i])
        t = -torch.log(sigmas[i])
        t_next = -torch.log(sigmas[i + 1])
        h = t_next - t
        scale = torch.exp(-t_next) / torch.exp(-t)
        if x0_prev is not None and sigmas[i + 1] != 0:
            r = (t - (-torch.log(sigmas[i - 1]))) / h
            x0_mix = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev
        else:
            x0_mix = x0
        x = scale * x - torch.expm1(-h) * x0_mix
        x0_prev = x0
    return x


def ref_dpmpp_2m_sde_rf(denoise, x, sigmas, seed, percent_to_sigma):
    # sample_dpmpp_2m_sde (midpoint, eta = 1, s_noise = 1) for CONST models: half-logSNR lambda = -logit(sigma), the
    # Brownian tree spans the given schedule and only then is a first sigma >= 1 moved to percent_to_sigma(1e-4).
    positive = sigmas[sigmas > 0]
    tree = torchsde.BrownianTree(positive.min(), torch.zeros_like(x), sigmas.max(), entropy=seed)
    if sigmas[0] >= 1:
        sigmas = torch.cat([torch.tensor([percent_to_sigma(1e-4)], dtype=torch.float32), sigmas[1:]])
    x0_prev, h_prev = None, None
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        x0 = denoise(x, s)
        if s_next == 0:
            x = x0
            continue
        lam, lam_next = -torch.logit(s), -torch.logit(s_next)
        h = lam_next - lam
        alpha_next = s_next * torch.exp(lam_next)
        one_minus_decay = torch.expm1(-(h * 2.0)).neg()
        x = s_next / s * torch.exp(-h * 1.0) * x + alpha_next * one_minus_decay * x0
        if x0_prev is not None:
            x = x + 0.5 * alpha_next * one_minus_decay * (1 / (h_prev / h)) * (x0 - x0_prev)
        z = -tree(s_next, s) / (s - s_next).sqrt()  # the tree increment runs upward in sigma; the step runs down
        x = x + z * s_next * torch.expm1(-2 * h * 1.0).neg().sqrt() * 1.0
        x0_prev, h_prev = x0, h
    return x


SCHEDULES = {
    # sd3 simple from sigma 1 (exercises the dpmpp_2m_sde first-sigma offset); flux normal at denoise 0.6 (sigma0 < 1).
    "sd3_simple_full": lambda: compute_sigmas(FlowSampling.sd3(), "simple", 10),
    "flux_normal_denoise06": lambda: compute_sigmas(FlowSampling.flux(), "normal", 9, denoise=0.6),
}


def reference(sampler, denoise, x, sigmas):
    if sampler == "euler":
        return ref_euler(denoise, x, sigmas)
    if sampler == "heun":
        return ref_heun(denoise, x, sigmas)
    if sampler == "euler_ancestral":
        return ref_euler_ancestral_rf(denoise, x, sigmas, SEED)
    if sampler == "dpmpp_2m":
        return ref_dpmpp_2m(denoise, x, sigmas)
    return ref_dpmpp_2m_sde_rf(denoise, x, sigmas, SEED, sd3_percent_to_sigma)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sampler_matches_reference(sampler, schedule):
    sigmas = SCHEDULES[schedule]()
    assert sigmas.dtype == torch.float32 and float(sigmas[-1]) == 0.0
    denoise = toy_denoiser()
    x = start_latent(sigmas[0])
    rng_before = torch.get_rng_state()
    got = sample(sampler, denoise, x.clone(), sigmas, seed=SEED, percent_to_sigma=sd3_percent_to_sigma)
    assert torch.equal(torch.get_rng_state(), rng_before), "sampling must not touch torch's global RNG"
    want = reference(sampler, denoise, x.clone(), sigmas)
    diff = float((got - want).abs().max())
    print(f"{sampler} on {schedule}: max abs diff vs reference = {diff:.3g}")
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert diff <= TOLERANCE
    # the result really moved from the start, and the stochastic ones really used their noise
    assert float((got - x).abs().max()) > 0.1


def test_stochastic_samplers_depend_on_seed_and_deterministic_ones_do_not():
    sigmas = SCHEDULES["sd3_simple_full"]()
    denoise, x = toy_denoiser(), start_latent(sigmas[0])
    for sampler in SAMPLERS:
        a = sample(sampler, denoise, x, sigmas, seed=1, percent_to_sigma=sd3_percent_to_sigma)
        b = sample(sampler, denoise, x, sigmas, seed=2, percent_to_sigma=sd3_percent_to_sigma)
        again = sample(sampler, denoise, x, sigmas, seed=1, percent_to_sigma=sd3_percent_to_sigma)
        assert torch.equal(a, again), sampler
        assert torch.equal(a, b) == (sampler in ("euler", "heun", "dpmpp_2m")), sampler


def test_dpmpp_2m_sde_evaluates_the_model_at_the_offset_first_sigma():
    sigmas = SCHEDULES["sd3_simple_full"]()
    seen = []
    denoise = toy_denoiser()

    def recording(x, sigma):
        seen.append(float(sigma))
        return denoise(x, sigma)

    sample("dpmpp_2m_sde", recording, start_latent(sigmas[0]), sigmas, seed=SEED, percent_to_sigma=sd3_percent_to_sigma)
    assert float(sigmas[0]) == 1.0
    assert seen[0] == float(torch.tensor(sd3_percent_to_sigma(1e-4), dtype=torch.float32)) < 1.0
    assert seen[1:] == [float(s) for s in sigmas[1:-1]]
    with pytest.raises(ValueError, match="percent_to_sigma"):
        sample("dpmpp_2m_sde", denoise, start_latent(sigmas[0]), sigmas, seed=SEED)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_callback_runs_once_per_step_after_the_update(sampler):
    sigmas = SCHEDULES["flux_normal_denoise06"]()
    total = len(sigmas) - 1
    events = []
    denoise = toy_denoiser()

    def recording(x, sigma):
        events.append("model")
        return denoise(x, sigma)

    sample(sampler, recording, start_latent(sigmas[0]), sigmas, seed=SEED,
           callback=lambda i, n: events.append((i, n)))
    assert [e for e in events if e != "model"] == [(i, total) for i in range(total)]
    # each step's model calls (two for heun's corrector steps) come before that step's callback
    per_step, calls = [], 0
    for e in events:
        if e == "model":
            calls += 1
        else:
            per_step.append(calls)
            calls = 0
    assert calls == 0
    expected = [2] * (total - 1) + [1] if sampler == "heun" else [1] * total
    assert per_step == expected


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_raising_callback_aborts_sampling(sampler):
    sigmas = SCHEDULES["sd3_simple_full"]()
    calls = []
    denoise = toy_denoiser()

    def recording(x, sigma):
        calls.append(float(sigma))
        return denoise(x, sigma)

    class Cancelled(Exception):
        pass

    def cancel(i, n):
        if i == 2:
            raise Cancelled("cancelled at step 2")

    with pytest.raises(Cancelled, match="step 2"):
        sample(sampler, recording, start_latent(sigmas[0]), sigmas, seed=SEED, callback=cancel,
               percent_to_sigma=sd3_percent_to_sigma)
    assert len(calls) == (6 if sampler == "heun" else 3)


def test_unknown_sampler_is_named():
    sigmas = SCHEDULES["sd3_simple_full"]()
    with pytest.raises(ValueError, match=r"sampler='lms'.*euler, euler_ancestral, heun, dpmpp_2m, dpmpp_2m_sde"):
        sample("lms", toy_denoiser(), start_latent(sigmas[0]), sigmas, seed=SEED)


def test_single_step_schedules_end_at_the_denoised_estimate():
    sigmas = torch.tensor([1.0, 0.0])
    denoise = toy_denoiser()
    x = start_latent(sigmas[0])
    for sampler in SAMPLERS:
        got = sample(sampler, denoise, x, sigmas, seed=SEED, percent_to_sigma=sd3_percent_to_sigma)
        # a one-step flow sample from sigma 1 lands on the model's x0 estimate at sigma 1 (or its offset for the SDE)
        sigma_used = torch.tensor(sd3_percent_to_sigma(1e-4)) if sampler == "dpmpp_2m_sde" else sigmas[0]
        assert float((got - denoise(x, sigma_used)).abs().max()) <= TOLERANCE, sampler
    assert math.isclose(float(sigmas[0]), 1.0)
