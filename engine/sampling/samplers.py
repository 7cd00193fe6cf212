"""The k-diffusion samplers ComfyUI's KSampler runs for flow (CONST) models, step for step and in the same float32 op order.

Every sampler integrates x from sigmas[0] down to sigmas[-1] using denoise_fn(x, sigma) -> denoised (the CFG-combined
x0 estimate). ComfyUI's defaults are fixed here: no churn (euler, heun), eta = 1 and s_noise = 1 (euler_ancestral,
dpmpp_2m_sde), midpoint solver (dpmpp_2m_sde). Scalar coefficients are 0-d float32 tensors computed in ComfyUI's
order, because the aim is the same rounding, not just the same maths.
"""
from __future__ import annotations

from typing import Callable, Generator

import torch

from .noise import NoiseSampler, brownian_noise_sampler, gaussian_noise_sampler

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, sigma 0-d) -> denoised x0 estimate
# A sampler run as a generator: it yields each model request (x, sigma), is sent the denoised estimate, and returns
# the final x. `sample` drives one with a Denoiser; PipeFusion drives one per latent patch, interleaved.
Steps = Generator[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]
NoiseFor = Callable[[Callable[[torch.Tensor], NoiseSampler]], NoiseSampler]
StepCallback = Callable[[int, int], None]  # (step_index, total_steps), after the step's update
PercentToSigma = Callable[[float], float]  # the model sampling's percent_to_sigma

SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde")

ETA = 1.0  # ComfyUI's default for its ancestral and SDE samplers
S_NOISE = 1.0
SNR_OFFSET_PERCENT = 1e-4  # ComfyUI moves a first sigma of 1 (infinite -logSNR) to percent_to_sigma(1e-4)


def _slope(x: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    # k-diffusion's ODE derivative dx/dsigma = (x - x0) / sigma; for CONST models this is the flow velocity.
    return (x - denoised) / sigma


def _euler(x: torch.Tensor, sigmas: torch.Tensor, host: torch.Tensor, seed: int, done: Callable[[int], None],
           noise_for: NoiseFor) -> Steps:
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        x = x + _slope(x, (yield x, sigma), sigma) * (sigma_next - sigma)
        done(i)
    return x


def _heun(x: torch.Tensor, sigmas: torch.Tensor, host: torch.Tensor, seed: int, done: Callable[[int], None],
          noise_for: NoiseFor) -> Steps:
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        slope = _slope(x, (yield x, sigma), sigma)
        dsigma = sigma_next - sigma
        if host[i + 1] == 0:  # the corrector would evaluate the model at sigma 0; ComfyUI ends with a plain Euler step
            x = x + slope * dsigma
        else:
            x_euler = x + slope * dsigma
            slope_next = _slope(x_euler, (yield x_euler, sigma_next), sigma_next)
            x = x + (slope + slope_next) / 2 * dsigma
        done(i)
    return x


def _euler_ancestral_flow(x: torch.Tensor, sigmas: torch.Tensor, host: torch.Tensor, seed: int,
                          done: Callable[[int], None], noise_for: NoiseFor) -> Steps:
    # ComfyUI's sample_euler_ancestral_RF (what euler_ancestral runs for CONST models): step deterministically to a
    # lower sigma_down, then rescale the signal and add fresh noise so the marginal matches sigma_next.
    noise = noise_for(lambda like: gaussian_noise_sampler(like, seed))
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = (yield x, sigma)
        if host[i + 1] == 0:
            x = denoised
        else:
            sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * ETA)
            alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
            renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
            keep = sigma_down / sigma
            x = keep * x + (1 - keep) * denoised
            if ETA > 0:
                x = (alpha_next / alpha_down) * x + noise(host[i], host[i + 1]) * S_NOISE * renoise
        done(i)
    return x


def _dpmpp_2m(x: torch.Tensor, sigmas: torch.Tensor, host: torch.Tensor, seed: int, done: Callable[[int], None],
              noise_for: NoiseFor) -> Steps:
    # DPM-Solver++(2M) in t = -log(sigma); ComfyUI runs the same code for CONST models (no alpha).
    def t_of(sigma: torch.Tensor) -> torch.Tensor:
        return sigma.log().neg()

    def sigma_of(t: torch.Tensor) -> torch.Tensor:
        return t.neg().exp()

    previous: torch.Tensor | None = None
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = (yield x, sigma)
        t, t_next = t_of(sigma), t_of(sigma_next)
        h = t_next - t
        if previous is None or host[i + 1] == 0:  # first order on the first step and onto sigma 0
            target = denoised
        else:
            r = (t - t_of(sigmas[i - 1])) / h
            target = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * previous
        x = (sigma_of(t_next) / sigma_of(t)) * x - (-h).expm1() * target
        previous = denoised
        done(i)
    return x


def _dpmpp_2m_sde_flow(x: torch.Tensor, sigmas: torch.Tensor, host: torch.Tensor, seed: int,
                       done: Callable[[int], None], noise_for: NoiseFor, percent_to_sigma: PercentToSigma | None) -> Steps:
    # ComfyUI's sample_dpmpp_2m_sde (midpoint) for CONST models: steps in half-logSNR lambda = log((1 - sigma) / sigma)
    # with alpha = 1 - sigma, Brownian-tree noise seeded with the plain seed.
    if len(sigmas) <= 1:
        return x
    # The tree spans the schedule as given, before the first sigma is moved off 1.
    tree_span = host[host > 0].min(), host.max()
    if host[0] >= 1:
        if percent_to_sigma is None:
            raise ValueError("dpmpp_2m_sde with a first sigma of 1 needs percent_to_sigma (the model sampling's), "
                             "to move that sigma to percent_to_sigma(1e-4) as ComfyUI does")
        sigmas, host = sigmas.clone(), host.clone()
        sigmas[0] = host[0] = percent_to_sigma(SNR_OFFSET_PERCENT)
    # the steps that draw noise, known before the loop: each draw prepares the next one's
    ahead = [(host[i], host[i + 1]) for i in range(len(host) - 1) if host[i + 1] != 0]
    noise = noise_for(lambda like: brownian_noise_sampler(like, *tree_span, seed, ahead=ahead))

    previous: torch.Tensor | None = None
    h_previous: torch.Tensor | None = None
    h: torch.Tensor | None = None
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = (yield x, sigma)
        if host[i + 1] == 0:
            x = denoised
        else:
            lam, lam_next = sigma.logit().neg(), sigma_next.logit().neg()
            h = lam_next - lam
            h_eta = h * (ETA + 1)
            alpha_next = sigma_next * lam_next.exp()
            x = sigma_next / sigma * (-h * ETA).exp() * x + alpha_next * (-h_eta).expm1().neg() * denoised
            if previous is not None:
                r = h_previous / h
                x = x + 0.5 * alpha_next * (-h_eta).expm1().neg() * (1 / r) * (denoised - previous)
            if ETA > 0 and S_NOISE > 0:
                x = x + noise(host[i], host[i + 1]) * sigma_next * (-2 * h * ETA).expm1().neg().sqrt() * S_NOISE
        previous, h_previous = denoised, h
        done(i)
    return x


def sampler_steps(sampler_name: str, x: torch.Tensor, sigmas: torch.Tensor, *, seed: int,
                  callback: StepCallback | None = None, percent_to_sigma: PercentToSigma | None = None,
                  whole: torch.Tensor | None = None, region: tuple | None = None,
                  host_sigmas: torch.Tensor | None = None, shared_noise: dict | None = None) -> Steps:
    """`sampler_name` as a generator over x (already noise-scaled to sigmas[0]): it yields (x, sigma) for each model
    call, takes the denoised estimate back by `send`, and returns x at sigmas[-1].

    x may be a region of a whole latent (PipeFusion's patches): `whole` is a tensor shaped like the whole latent and
    `region` the index of x within it; the stochastic samplers then draw their step noise for the whole latent and
    take the region, so each patch gets exactly the noise a whole-latent run gives its pixels. host_sigmas: the same
    sigmas in host memory, where the caller has them (PipeFusion runs one generator per patch). shared_noise: a dict
    the patches' generators share, so they draw the whole latent's noise once per step, not once per patch.
    """
    if sampler_name not in SAMPLERS:
        raise ValueError(f"sampler={sampler_name!r} is not supported; use one of {', '.join(SAMPLERS)}")
    total_steps = len(sigmas) - 1

    def done(step_index: int) -> None:
        if callback is not None:
            callback(step_index, total_steps)

    def noise_for(build: Callable[[torch.Tensor], NoiseSampler]) -> NoiseSampler:
        if whole is None:
            return build(x)
        if shared_noise is None:
            draw = build(whole)
        else:
            if sampler_name not in shared_noise:
                shared_noise[sampler_name] = build(whole)
            draw = shared_noise[sampler_name]
        return lambda sigma, sigma_next: draw(sigma, sigma_next)[region]

    # the sigmas in host memory, read once per job: the steps branch on them and the Brownian tree (on the CPU, as
    # ComfyUI's) takes them, and a branch on or a copy of a device tensor makes the host wait for the device
    host = sigmas.detach().cpu() if host_sigmas is None else host_sigmas
    sigmas = sigmas.to(device=x.device)
    if sampler_name == "dpmpp_2m_sde":
        return _dpmpp_2m_sde_flow(x, sigmas, host, seed, done, noise_for, percent_to_sigma)
    run = {"euler": _euler, "euler_ancestral": _euler_ancestral_flow, "heun": _heun, "dpmpp_2m": _dpmpp_2m}[sampler_name]
    return run(x, sigmas, host, seed, done, noise_for)


def sample(sampler_name: str, denoise_fn: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, *, seed: int,
           callback: StepCallback | None = None, percent_to_sigma: PercentToSigma | None = None) -> torch.Tensor:
    """Run `sampler_name` from x (already noise-scaled to sigmas[0]) over `sigmas`; returns x at sigmas[-1].

    seed is the KSampler seed: the per-step noise of the stochastic samplers derives from it as in ComfyUI.
    callback(step_index, total_steps) runs after each step's update; an exception from it aborts sampling.
    percent_to_sigma is only used by dpmpp_2m_sde when sigmas[0] >= 1.
    """
    steps = sampler_steps(sampler_name, x, sigmas, seed=seed, callback=callback, percent_to_sigma=percent_to_sigma)
    with torch.no_grad():
        return drive(steps, denoise_fn)


def drive(steps: Steps, denoise_fn: Denoiser) -> torch.Tensor:
    """Run a sampler generator to its end, answering each request with denoise_fn."""
    try:
        request = next(steps)
        while True:
            request = steps.send(denoise_fn(*request))
    except StopIteration as end:
        return end.value
