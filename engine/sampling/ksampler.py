"""ComfyUI's KSampler end to end for a flow (CONST) model: seed noise, schedule, noise scaling, CFG, sampler, latent
format.

The model is only a velocity predictor, predict(x_model, sigma, which) -> one v per entry of which ("pos", "neg");
denoised = x_model - v * sigma. Everything between the raw latent and the sampled raw latent is here, in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .latent_formats import LatentFormat
from .noise import prepare_noise
from .samplers import SAMPLERS, Denoiser, PercentToSigma, StepCallback, sample
from .schedules import SCHEDULERS, FlowSampling, compute_sigmas

Predict = Callable[[torch.Tensor, torch.Tensor, tuple[str, ...]], tuple[torch.Tensor, ...]]


def guided_denoiser(predict: Predict, cfg: float, cfg_norm: float = 0.0) -> Denoiser:
    """x_model, sigma -> CFG-combined denoised, as ComfyUI's sampling_function / cfg_function compute it. cfg_norm > 0
    applies ComfyUI's CFGNorm node (a post-CFG function) at that strength: the result scaled per position so its norm
    over the channels does not exceed the positive prediction's."""
    skip_negative = math.isclose(cfg, 1.0)

    def combined(x_model: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if skip_negative:
            (v_pos,) = predict(x_model, sigma, ("pos",))
            denoised_pos = x_model - v_pos.float() * sigma
            # ComfyUI leaves the skipped negative at exactly 0, so neg + (pos - neg) * cfg is pos * cfg.
            return denoised_pos * cfg, denoised_pos
        v_pos, v_neg = predict(x_model, sigma, ("pos", "neg"))
        denoised_pos = x_model - v_pos.float() * sigma
        denoised_neg = x_model - v_neg.float() * sigma
        return denoised_neg + (denoised_pos - denoised_neg) * cfg, denoised_pos

    def denoise(x_model: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        result, denoised_pos = combined(x_model, sigma)
        if cfg_norm:   # ComfyUI's CFGNorm (comfy_extras/nodes_cfg.py), in its operation order
            scale = (torch.norm(denoised_pos, dim=1, keepdim=True)
                     / (torch.norm(result, dim=1, keepdim=True) + 1e-8)).clamp(min=0.0, max=1.0)
            result = result * scale * cfg_norm
        return result

    return denoise


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_inputs(latent_raw: torch.Tensor, sampling: FlowSampling, latent: LatentFormat, seed: int, steps: int,
                  cfg: float, sampler: str, scheduler: str, denoise: float, batch_index: list[int] | None,
                  noise: torch.Tensor | None) -> None:
    if not isinstance(sampling, FlowSampling) or not isinstance(latent, LatentFormat):
        raise ValueError(f"model sampling {sampling!r} and latent format {latent!r} are invalid: give a FlowSampling "
                         f"and a LatentFormat (a family's)")
    if not isinstance(latent_raw, torch.Tensor) or latent_raw.ndim != latent.ndim \
            or latent_raw.shape[1] != latent.channels or not latent_raw.is_floating_point():
        described = (f"a {latent_raw.dtype} tensor of shape {list(latent_raw.shape)}"
                     if isinstance(latent_raw, torch.Tensor) else type(latent_raw).__name__)
        raise ValueError(f"latent_raw is {described}; use a floating-point tensor shaped {latent.shape_rule()}")
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
    batch = latent_raw.shape[0]
    if batch_index is not None and (not isinstance(batch_index, (list, tuple)) or len(batch_index) != batch
                                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in batch_index)):
        raise ValueError(f"batch_index={batch_index!r} does not fit a batch of {batch}; "
                         f"use None or {batch} non-negative ints")
    if noise is not None and (not isinstance(noise, torch.Tensor) or noise.shape != latent_raw.shape):
        shape = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise ValueError(f"noise has shape {shape}; use None or a tensor shaped like latent_raw {list(latent_raw.shape)}")


@dataclass(frozen=True)
class StepWindow:
    """KSamplerAdvanced's part of the schedule and noise (comfy/samplers.py KSampler.sample, nodes.py common_ksampler):
    sample from step start_step to last_step of the full schedule, with the last sigma set to 0 when the window ends
    early and force_full_denoise (return_with_leftover_noise off), and no initial noise without add_noise. The
    default window is KSampler's: the whole schedule, noise added."""
    start_step: int | None = None
    last_step: int | None = None
    force_full_denoise: bool = False
    add_noise: bool = True

    def apply(self, sigmas: torch.Tensor) -> torch.Tensor | None:
        """The window's sigmas, or None when it starts at or past the schedule's end (ComfyUI then returns the
        latent as given)."""
        if self.last_step is not None and self.last_step < len(sigmas) - 1:
            sigmas = sigmas[:self.last_step + 1].clone()
            if self.force_full_denoise:
                sigmas[-1] = 0
        if self.start_step is not None:
            if self.start_step >= len(sigmas) - 1:
                return None
            sigmas = sigmas[self.start_step:]
        return sigmas


def reshape_mask(mask: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A noise mask fitted to a latent of `shape`, as ComfyUI's KSampler fits it (comfy.utils.reshape_mask):
    interpolated to the latent's frames, rows and columns, its channels repeated, its batch repeated or cut."""
    dims = len(shape) - 2
    if dims == 2:
        mask, mode = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]), "bilinear"
    else:
        mask, mode = (mask if mask.ndim == 5 else mask.reshape(1, 1, -1, mask.shape[-2], mask.shape[-1])), "trilinear"
    mask = torch.nn.functional.interpolate(mask.float(), size=tuple(shape[2:]), mode=mode)
    if mask.shape[1] < shape[1]:
        mask = mask.repeat((1, shape[1]) + (1,) * dims)[:, :shape[1]]
    if mask.shape[0] > shape[0]:
        mask = mask[:shape[0]]
    elif mask.shape[0] < shape[0]:
        mask = mask.repeat((math.ceil(shape[0] / mask.shape[0]),) + (1,) * (len(shape) - 1))[:shape[0]]
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"a mask of {mask.shape[1]} channels does not fit a latent of {shape[1]}")
    return mask


def masked_denoiser(denoise: Denoiser, mask: torch.Tensor, latent_model: torch.Tensor, noise: torch.Tensor,
                    clean: bool) -> Denoiser:
    """ComfyUI's KSamplerX0Inpaint: where the mask is 0 the model sees the latent (noised to sigma, or as it is for a
    model whose ComfyUI scale_latent_inpaint keeps it: `clean`) and the result is the latent."""
    keep = 1.0 - mask

    def masked(x_model: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        known = latent_model if clean else sigma * noise + (1.0 - sigma) * latent_model
        out = denoise(x_model * mask + known * keep, sigma)
        return out * mask + latent_model * keep
    return masked


@dataclass
class SamplingStart:
    """What a KSampler run starts from: x in model space at the first sigma, the schedule, and how to finish; the
    latent in model space and the noise, which a noise mask reads."""
    x_model: torch.Tensor
    sigmas: torch.Tensor
    sampling: FlowSampling
    latent: LatentFormat
    latent_model: torch.Tensor | None = None
    noise: torch.Tensor | None = None

    @property
    def percent_to_sigma(self) -> PercentToSigma:
        return self.sampling.percent_to_sigma

    def finish(self, x_model: torch.Tensor) -> torch.Tensor:
        """The sampled x (model space, at the last sigma) back to the raw latent."""
        x_model = x_model / (1.0 - self.sigmas[-1])  # CONST inverse noise scaling; a no-op for schedules ending at 0
        return self.latent.process_out(x_model.to(torch.float32))


def start_sampling(latent_raw: torch.Tensor, *, sampling: FlowSampling, latent: LatentFormat, seed: int, steps: int,
                   cfg: float, sampler: str, scheduler: str, denoise: float = 1.0,
                   batch_index: list[int] | None = None, noise: torch.Tensor | None = None,
                   window: StepWindow = StepWindow()) -> SamplingStart | None:
    """Everything of ksample before the sampler loop: checks, noise, schedule, noise scaling. `sampling` is the
    model's ComfyUI model sampling (its family's default, or what a sampling node set), `latent` its latent format.
    None when the window leaves nothing to sample."""
    _check_inputs(latent_raw, sampling, latent, seed, steps, cfg, sampler, scheduler, denoise, batch_index, noise)
    if not window.add_noise:
        noise = torch.zeros_like(latent_raw, dtype=torch.float32)   # prepare_empty_noise
    elif noise is None:
        noise = prepare_noise(latent_raw, seed, None if batch_index is None else list(batch_index))
    device = latent_raw.device
    noise = noise.to(device=device, dtype=torch.float32)
    raw = latent_raw.to(dtype=torch.float32)
    # ComfyUI leaves an all-zero latent (an empty image) unshifted, so denoise < 1 from it starts at pure scaled noise.
    latent_model = latent.process_in(raw) if torch.count_nonzero(raw) > 0 else raw
    sigmas = window.apply(compute_sigmas(sampling, scheduler, steps, denoise))
    if sigmas is None:
        return None
    sigmas = sigmas.to(device)
    # CONST noise scaling: x at sigma is the straight line between the latent and the noise.
    x_model = sigmas[0] * noise + (1.0 - sigmas[0]) * latent_model
    return SamplingStart(x_model, sigmas, sampling, latent, latent_model, noise)


def ksample(predict: Predict, latent_raw: torch.Tensor, *, sampling: FlowSampling, latent: LatentFormat, seed: int,
            steps: int, cfg: float, sampler: str, scheduler: str, denoise: float = 1.0,
            batch_index: list[int] | None = None, noise: torch.Tensor | None = None,
            callback: StepCallback | None = None, cfg_norm: float = 0.0, denoise_mask: torch.Tensor | None = None,
            masked_latent_clean: bool = False, window: StepWindow = StepWindow()) -> torch.Tensor:
    """Sample like ComfyUI's KSampler node (with `window`, its KSamplerAdvanced); returns the float32 latent in raw
    VAE space, shaped like latent_raw.

    noise, when given, replaces the seeded initial noise (seed still drives the stochastic samplers' step noise).
    callback(step_index, total_steps) runs after every step; raising from it aborts sampling. denoise_mask: the
    LATENT's noise mask fitted to the latent (reshape_mask), applied as KSamplerX0Inpaint applies it;
    masked_latent_clean: the model's ComfyUI scale_latent_inpaint keeps the latent unnoised.
    """
    start = start_sampling(latent_raw, sampling=sampling, latent=latent, seed=seed, steps=steps, cfg=cfg,
                           sampler=sampler, scheduler=scheduler, denoise=denoise, batch_index=batch_index, noise=noise,
                           window=window)
    if start is None:
        return latent_raw.to(torch.float32)
    denoiser = guided_denoiser(predict, cfg, cfg_norm)
    if denoise_mask is not None:
        denoiser = masked_denoiser(denoiser, denoise_mask.to(start.x_model), start.latent_model, start.noise,
                                   masked_latent_clean)
    x_model = sample(sampler, denoiser, start.x_model, start.sigmas, seed=seed,
                     callback=callback,
                     percent_to_sigma=start.percent_to_sigma)
    return start.finish(x_model)
