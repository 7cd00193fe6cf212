"""ComfyUI's KSampler end to end for a flow (CONST) model: seed noise, schedule, noise scaling, CFG, sampler, latent format.

The model is only a velocity predictor, predict(x_model, sigma, which) -> one v per entry of which ("pos", "neg");
denoised = x_model - v * sigma. Everything between the raw latent and the sampled raw latent is here, in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .latent_formats import FORMATS, latent_format
from .noise import prepare_noise
from .samplers import SAMPLERS, Denoiser, PercentToSigma, StepCallback, sample
from .schedules import SCHEDULERS, FlowSampling, compute_sigmas

Predict = Callable[[torch.Tensor, torch.Tensor, tuple[str, ...]], tuple[torch.Tensor, ...]]


def _percent_to_sigma(sampling: FlowSampling) -> PercentToSigma:
    # ComfyUI's percent_to_sigma of ModelSamplingFlux / ModelSamplingDiscreteFlow, in Python floats as there; the
    # result is rounded to float32 only when a sampler stores it into its schedule.
    def at(percent: float) -> float:
        t = 1.0 - percent
        if sampling.family == "flux":
            growth = math.exp(sampling.shift)
            return growth / (growth + (1 / t - 1))
        return t if sampling.shift == 1.0 else sampling.shift * t / (1 + (sampling.shift - 1) * t)

    return at


def guided_denoiser(predict: Predict, cfg: float) -> Denoiser:
    """x_model, sigma -> CFG-combined denoised, as ComfyUI's sampling_function / cfg_function compute it."""
    skip_negative = math.isclose(cfg, 1.0)

    def denoise(x_model: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        if skip_negative:
            (v_pos,) = predict(x_model, sigma, ("pos",))
            # ComfyUI leaves the skipped negative at exactly 0, so neg + (pos - neg) * cfg is pos * cfg.
            return (x_model - v_pos.float() * sigma) * cfg
        v_pos, v_neg = predict(x_model, sigma, ("pos", "neg"))
        denoised_pos = x_model - v_pos.float() * sigma
        denoised_neg = x_model - v_neg.float() * sigma
        return denoised_neg + (denoised_pos - denoised_neg) * cfg

    return denoise


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_inputs(latent_raw: torch.Tensor, family: str, seed: int, steps: int, cfg: float, sampler: str, scheduler: str,
                  denoise: float, batch_index: list[int] | None, shift: float | None, noise: torch.Tensor | None) -> None:
    if family not in FORMATS:
        raise ValueError(f"family={family!r} is not a flow family this sampler knows; use one of {sorted(FORMATS)}")
    if not isinstance(latent_raw, torch.Tensor) or latent_raw.ndim != 4 or latent_raw.shape[1] != 16 \
            or not latent_raw.is_floating_point():
        described = (f"a {latent_raw.dtype} tensor of shape {list(latent_raw.shape)}"
                     if isinstance(latent_raw, torch.Tensor) else type(latent_raw).__name__)
        raise ValueError(f"latent_raw is {described}; use a floating-point tensor shaped [batch, 16, height, width]")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed!r} is not supported; use an integer in [0, 2**64)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not supported; use an integer >= 1")
    if not _is_number(cfg) or cfg <= 0:
        raise ValueError(f"cfg={cfg!r} is not supported; use a finite number > 0 (1.0 skips the negative prompt)")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is not supported; use one of {', '.join(SAMPLERS)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r} is not supported; use one of {', '.join(SCHEDULERS)}")
    if not _is_number(denoise) or not 0 < denoise <= 1:
        raise ValueError(f"denoise={denoise!r} is outside (0, 1]; use a number in (0, 1] (1 = from pure noise)")
    if shift is not None and (not _is_number(shift) or shift <= 0):
        raise ValueError(f"shift={shift!r} is not supported; use a finite number > 0 or None for the family default")
    batch = latent_raw.shape[0]
    if batch_index is not None and (not isinstance(batch_index, (list, tuple)) or len(batch_index) != batch
                                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in batch_index)):
        raise ValueError(f"batch_index={batch_index!r} does not fit a batch of {batch}; "
                         f"use None or {batch} non-negative ints")
    if noise is not None and (not isinstance(noise, torch.Tensor) or noise.shape != latent_raw.shape):
        shape = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise ValueError(f"noise has shape {shape}; use None or a tensor shaped like latent_raw {list(latent_raw.shape)}")


@dataclass
class SamplingStart:
    """What a KSampler run starts from: x in model space at the first sigma, the schedule, and how to finish."""
    x_model: torch.Tensor
    sigmas: torch.Tensor
    percent_to_sigma: PercentToSigma
    family: str

    def finish(self, x_model: torch.Tensor) -> torch.Tensor:
        """The sampled x (model space, at the last sigma) back to the raw latent."""
        x_model = x_model / (1.0 - self.sigmas[-1])  # CONST inverse noise scaling; a no-op for schedules ending at 0
        return latent_format(self.family).process_out(x_model.to(torch.float32))


def start_sampling(latent_raw: torch.Tensor, *, family: str, seed: int, steps: int, cfg: float, sampler: str,
                   scheduler: str, denoise: float = 1.0, batch_index: list[int] | None = None,
                   shift: float | None = None, noise: torch.Tensor | None = None) -> SamplingStart:
    """Everything of ksample before the sampler loop: checks, noise, schedule, noise scaling."""
    _check_inputs(latent_raw, family, seed, steps, cfg, sampler, scheduler, denoise, batch_index, shift, noise)
    if noise is None:
        noise = prepare_noise(latent_raw, seed, None if batch_index is None else list(batch_index))
    device = latent_raw.device
    noise = noise.to(device=device, dtype=torch.float32)
    latent = latent_raw.to(dtype=torch.float32)
    fmt = latent_format(family)
    # ComfyUI leaves an all-zero latent (an empty image) unshifted, so denoise < 1 from it starts at pure scaled noise.
    latent_model = fmt.process_in(latent) if torch.count_nonzero(latent) > 0 else latent

    sampling = FlowSampling(family, shift) if shift is not None else {"flux": FlowSampling.flux, "sd3": FlowSampling.sd3}[family]()
    sigmas = compute_sigmas(sampling, scheduler, steps, denoise).to(device)
    # CONST noise scaling: x at sigma is the straight line between the latent and the noise.
    x_model = sigmas[0] * noise + (1.0 - sigmas[0]) * latent_model
    return SamplingStart(x_model, sigmas, _percent_to_sigma(sampling), family)


def ksample(predict: Predict, latent_raw: torch.Tensor, *, family: str, seed: int, steps: int, cfg: float, sampler: str,
            scheduler: str, denoise: float = 1.0, batch_index: list[int] | None = None, shift: float | None = None,
            noise: torch.Tensor | None = None, callback: StepCallback | None = None) -> torch.Tensor:
    """Sample like ComfyUI's KSampler node; returns the float32 latent in raw VAE space, shaped like latent_raw.

    noise, when given, replaces the seeded initial noise (seed still drives the stochastic samplers' step noise).
    callback(step_index, total_steps) runs after every step; raising from it aborts sampling.
    """
    start = start_sampling(latent_raw, family=family, seed=seed, steps=steps, cfg=cfg, sampler=sampler,
                           scheduler=scheduler, denoise=denoise, batch_index=batch_index, shift=shift, noise=noise)
    x_model = sample(sampler, guided_denoiser(predict, cfg), start.x_model, start.sigmas, seed=seed, callback=callback,
                     percent_to_sigma=start.percent_to_sigma)
    return start.finish(x_model)
