"""The xDiT Guider: ComfyUI's GUIDER (what SamplerCustomAdvanced takes) with the engine as its model.

ComfyUI's own sampler (any KSamplerSelect name), noise and sigmas run in ComfyUI's process exactly as with
BasicGuider/CFGGuider; each model evaluation is one call to the engine's ranks, which hold the conditioning for the
whole run (engine/generate/guide.py). CFG is combined by ComfyUI's own sampling_function, so CFG++ samplers and
post-CFG hooks work unchanged. ComfyUI's parts come in as arguments (`model_patcher`: a model without weights that
carries ComfyUI's model sampling and latent format; `sampling_function`), so this module imports nothing from
ComfyUI and its logic is tested without it.
"""
from __future__ import annotations

import time

import torch

from ..engine.wording import NODES, speaking

_POSITIVE = [{"xdit": "positive"}]   # stand-ins for ComfyUI's cond lists: sampling_function only passes them on
_NEGATIVE = [{"xdit": "negative"}]


class EngineGuider:
    """A GUIDER. `request_for(latent_raw, cfg)` builds and validates the engine request (core.guide_request);
    `engine_for()` returns the running engine record; `before_job()` makes room on ComfyUI's GPU; `deadlines`: the
    engine job's (None: the engine's own)."""

    def __init__(self, model_patcher, sampling_function, *, cfg: float, has_negative: bool, request_for, engine_for,
                 before_job=None, deadlines=None):
        self.model_patcher = model_patcher
        self.model_options = getattr(model_patcher, "model_options", {}) or {}
        self.inner_model = model_patcher.model
        self.sampling_function = sampling_function
        self.cfg = float(cfg)
        self.has_negative = has_negative
        self.request_for, self.engine_for, self.before_job = request_for, engine_for, before_job
        self.deadlines = deadlines
        self.session: GuideSession | None = None
        self.last_run: dict = {}

    def set_cfg(self, cfg: float) -> None:   # as CFGGuider
        self.cfg = float(cfg)

    # ---- what SamplerCustomAdvanced calls ----------------------------------------------------------------------
    @speaking(NODES)   # the engine's errors name the nodes' inputs
    def sample(self, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
               seed=None):
        if sigmas.shape[-1] == 0:
            return latent_image
        if denoise_mask is not None:
            raise ValueError("latent_image has a noise_mask (inpainting), which the xDiT Guider does not support")
        request = self.request_for(latent_image, self.cfg)
        if self.before_job is not None:
            self.before_job()
        record = self.engine_for()
        device = noise.device
        latent_model = latent_image.to(device)
        if torch.count_nonzero(latent_model) > 0:  # as CFGGuider: an empty latent stays unshifted
            latent_model = self.inner_model.process_latent_in(latent_model)
        model_options = dict(self.model_options)
        model_options["transformer_options"] = dict(model_options.get("transformer_options", {}),
                                                    sample_sigmas=sigmas)
        model_options["sampler_calc_cond_batch_function"] = self._calc_cond_batch
        extra_args = {"model_options": model_options, "seed": seed}
        from ..engine.generate.guide import GuideSession  # rank-side code (the parallel stack): not at load

        t0 = time.perf_counter()
        with GuideSession(record.engine, request, deadlines=self.deadlines) as session:
            self.session = session
            try:
                samples = sampler.sample(self, sigmas.to(device), extra_args, callback, noise, latent_model,
                                         denoise_mask, disable_pbar)
            finally:
                self.session = None
        self.last_run = {"plan": request.plan.describe(), "calls": session.calls, "wall_s": time.perf_counter() - t0,
                         "call_s": list(session.call_s), "ranks": session.result.ranks if session.result else []}
        return self.inner_model.process_latent_out(samples.to(torch.float32))

    # ---- what ComfyUI's samplers call (as they call CFGGuider) -------------------------------------------------
    def __call__(self, x, timestep, model_options={}, seed=None):
        return self.sampling_function(self.inner_model, x, timestep, _NEGATIVE if self.has_negative else None,
                                      _POSITIVE, self.cfg, model_options=model_options, seed=seed)

    def _calc_cond_batch(self, args: dict) -> list[torch.Tensor]:
        """ComfyUI's calc_cond_batch for our two conds: the denoised estimate of each side the sampler asks for, zero
        for a side it skips (cfg 1), from one engine call."""
        if self.session is None:
            raise RuntimeError("the xDiT Guider was called outside its sample(): connect it to SamplerCustomAdvanced")
        conds, x, sigma = args["conds"], args["input"], args["sigma"]
        sides = tuple(side for side, c in zip(("pos", "neg"), conds) if c is not None)
        velocities = dict(zip(sides, self.session.velocity(x, sigma, sides)))
        sampling = self.inner_model.model_sampling
        return [sampling.calculate_denoised(sigma, velocities[side].to(x.dtype), x) if side in velocities
                else torch.zeros_like(x) for side in ("pos", "neg")[:len(conds)]]
