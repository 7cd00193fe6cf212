"""The xDiT Guider without ComfyUI: a sampler that speaks ComfyUI's sampler protocol (KSAMPLER.sample, the guider
called as model_wrap, sampling_function with a calc_cond_batch hook, CONST noise scaling) drives the engine one
model evaluation per call. Its latent must equal the engine's own loop (xDiT Sampler) for the same noise and sigmas,
on 1 and 2 ranks, for FLUX (cfg 1, no negative) and SD3 (cfg > 1, CFG parallel), and across a SplitSigmas edit.

The stand-ins below restate ComfyUI 0.3.64's formulas (comfy/samplers.py sampling_function, cfg_function,
KSAMPLER.sample; comfy/model_sampling.py CONST); the real ones run in tests/test_comfyui_live.py."""
import math

import pytest
import torch

from engine import families
from engine.sampling.noise import prepare_noise
from engine.sampling.samplers import sample as engine_sample
from engine.sampling.schedules import FlowSampling, compute_sigmas

import test_nodes
from test_nodes import empty_latent, flux_conditioning, sd3_conditioning, settings
from tolerance import fp32_bound, report, sampling_amplification


core, models = test_nodes.core, test_nodes.models  # fixtures: the pack's core module, the tiny model files


class ConstSampling:
    """comfy.model_sampling.CONST with a flow model's sigma range."""
    sigma_max = torch.tensor(1.0)

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        return sigma * noise + (1.0 - sigma) * latent_image

    def inverse_noise_scaling(self, sigma, latent):
        return latent / (1.0 - sigma)

    def calculate_denoised(self, sigma, model_output, model_input):
        sigma = sigma.view(sigma.shape[:1] + (1,) * (model_output.ndim - 1))
        return model_input - model_output * sigma


class SamplingModel:
    """What ComfyUI's BaseModel offers a guider: latent format and model sampling."""

    def __init__(self, family):
        self.family, self.format = family, families.get(family).latent
        self.model_sampling = ConstSampling()

    def process_latent_in(self, x):
        return self.format.process_in(x)

    def process_latent_out(self, x):
        return self.format.process_out(x)


class Patcher:
    def __init__(self, family):
        self.model = SamplingModel(family)
        self.model_options = {"transformer_options": {}}


def sampling_function(model, x, timestep, uncond, cond, cond_scale, model_options={}, seed=None):
    """comfy.samplers.sampling_function with its calc_cond_batch hook and cfg_function's plain CFG."""
    uncond_ = None if math.isclose(cond_scale, 1.0) and not model_options.get("disable_cfg1_optimization") else uncond
    out = model_options["sampler_calc_cond_batch_function"](
        {"conds": [cond, uncond_], "input": x, "sigma": timestep, "model": model, "model_options": model_options})
    return out[1] + (out[0] - out[1]) * cond_scale


class Sampler:
    """KSAMPLER.sample: noise scaling, the sampler over model_wrap called with a per-item sigma, inverse scaling."""

    def __init__(self, name):
        self.name = name
        self.steps_seen = []

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        x = model_wrap.inner_model.model_sampling.noise_scaling(sigmas[0], noise, latent_image)

        def denoise(x_in, sigma):
            return model_wrap(x_in, sigma * x_in.new_ones([x_in.shape[0]]), **extra_args)

        def on_step(i, total):
            self.steps_seen.append(i)
            if callback is not None:
                callback(i, None, None, total)

        sampling = FlowSampling.flux() if model_wrap.inner_model.family == "flux" else FlowSampling.sd3()
        x = engine_sample(self.name, denoise, x, sigmas, seed=extra_args["seed"], callback=on_step,
                          percent_to_sigma=sampling.percent_to_sigma)
        return model_wrap.inner_model.model_sampling.inverse_noise_scaling(sigmas[-1], x)


def guided(core, s, family, positive, negative, cfg, latent, sigmas, noise, sampler="euler", seed=0):
    guider = core.guider(s, positive, negative, cfg, model_patcher=Patcher(family), sampling_function=sampling_function)
    out = guider.sample(noise, latent, Sampler(sampler), sigmas, seed=seed)
    return out, guider


CASES = [("flux", 1.0, (0,), {}), ("flux", 1.0, (0, 1), {}), ("sd3", 4.0, (0,), {}), ("sd3", 4.0, (0, 1), {})]


@pytest.mark.parametrize("family,cfg,gpus,kw", CASES, ids=["flux-1rank", "flux-2ranks", "sd3-1rank", "sd3-2ranks"])
def test_guider_driven_by_a_comfyui_protocol_sampler_equals_the_engine_own_loop(core, models, family, cfg, gpus, kw):
    s = settings(core, models[family], gpus=gpus, **kw)
    positive = flux_conditioning(1) if family == "flux" else sd3_conditioning(1)
    negative = None if family == "flux" else sd3_conditioning(2)
    latent, steps, seed = empty_latent(width=64, height=64), 3, 7
    want = core.sample(s, positive, negative, latent, seed=seed, steps=steps, cfg=cfg, sampler_name="euler",
                       scheduler="simple", denoise=1.0)["samples"]
    sigmas = compute_sigmas(FlowSampling.flux() if family == "flux" else FlowSampling.sd3(), "simple", steps, 1.0)
    noise = prepare_noise(latent["samples"], seed)
    got, guider = guided(core, s, family, positive, negative, cfg, latent["samples"], sigmas, noise, seed=seed)
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(steps, cfg))
    report(f"{family} {len(gpus)} rank(s) guider vs engine loop", (got - want).abs().max().item(), bound)
    assert (got - want).abs().max().item() <= bound
    calls = guider.last_run["calls"]
    assert calls == steps, "one engine call per model evaluation"
    assert guider.last_run["plan"] == ("cfg2" if family == "sd3" and len(gpus) == 2 else
                                       "ulysses2" if len(gpus) == 2 else "single rank")
    print(f"per-call time as ComfyUI saw it: {[round(t * 1000, 1) for t in guider.last_run['call_s']]} ms")


def test_a_split_sigmas_edit_gives_the_unsplit_latent(core, models):
    """SplitSigmas at step 2 and a second SamplerCustomAdvanced with DisableNoise (zero noise) on the first's latent:
    ComfyUI's CONST noise scaling makes this the same trajectory as one run."""
    s = settings(core, models["flux"], gpus=(0, 1))
    positive, latent, steps, seed = flux_conditioning(3), empty_latent(width=64, height=64), 4, 5
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", steps, 1.0)
    noise = prepare_noise(latent["samples"], seed)
    whole, _ = guided(core, s, "flux", positive, None, 1.0, latent["samples"], sigmas, noise, seed=seed)
    high, low = sigmas[:3], sigmas[2:]
    first, _ = guided(core, s, "flux", positive, None, 1.0, latent["samples"], high, noise, seed=seed)
    second, _ = guided(core, s, "flux", positive, None, 1.0, first, low, torch.zeros_like(noise), seed=seed)
    assert not torch.equal(first, second)
    bound = fp32_bound(whole.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(steps))
    report("split sigmas vs one run", (second - whole).abs().max().item(), bound)
    assert (second - whole).abs().max().item() <= bound
    want = core.sample(s, positive, None, latent, seed=seed, steps=steps, cfg=1.0, sampler_name="euler",
                       scheduler="simple", denoise=1.0)["samples"]
    assert (second - want).abs().max().item() <= bound


def test_two_model_calls_per_step_and_a_stochastic_sampler_run_through_the_guider(core, models):
    """heun asks the model twice per step; dpmpp_2m_sde draws noise: the guider serves whatever the sampler asks."""
    s = settings(core, models["sd3"], gpus=(0, 1))
    latent, seed, steps = empty_latent(width=64, height=64), 11, 3
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", steps, 1.0)
    noise = prepare_noise(latent["samples"], seed)
    for name, calls in (("heun", 2 * steps - 1), ("dpmpp_2m_sde", steps)):
        want = core.sample(s, sd3_conditioning(1), sd3_conditioning(2), latent, seed=seed, steps=steps, cfg=3.0,
                           sampler_name=name, scheduler="simple", denoise=1.0)["samples"]
        got, guider = guided(core, s, "sd3", sd3_conditioning(1), sd3_conditioning(2), 3.0, latent["samples"],
                             sigmas, noise, sampler=name, seed=seed)
        bound = fp32_bound(want.abs().max(), reduction=4096, depth=4, amplification=sampling_amplification(2 * steps, 3))
        report(f"{name} guider vs engine loop", (got - want).abs().max().item(), bound)
        assert (got - want).abs().max().item() <= bound
        assert guider.last_run["calls"] == calls


def test_cfg_one_with_a_negative_still_sends_it_for_samplers_that_ask(core, models):
    """CFG++ samplers disable ComfyUI's cfg-1 shortcut and ask for the negative at cfg 1: it must be there."""
    s = settings(core, models["sd3"])
    guider = core.guider(s, sd3_conditioning(1), sd3_conditioning(2), 1.0, model_patcher=Patcher("sd3"),
                         sampling_function=sampling_function)
    latent = empty_latent(width=64, height=64)["samples"]
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", 2, 1.0)

    class AsksNegative(Sampler):
        def sample(self, model_wrap, sigmas, extra_args, *a, **k):
            extra_args["model_options"] = dict(extra_args["model_options"], disable_cfg1_optimization=True)
            return super().sample(model_wrap, sigmas, extra_args, *a, **k)

    out = guider.sample(prepare_noise(latent, 0), latent, AsksNegative("euler"), sigmas, seed=0)
    assert torch.isfinite(out).all() and guider.last_run["calls"] == 2


def test_an_interrupt_from_comfyui_callback_ends_the_session_and_the_engine_stays_ready(core, models):
    s = settings(core, models["flux"], gpus=(0, 1))
    latent = empty_latent(width=64, height=64)["samples"]
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", 6, 1.0)
    guider = core.guider(s, flux_conditioning(1), None, 1.0, model_patcher=Patcher("flux"),
                         sampling_function=sampling_function)

    class Interrupted(Exception):
        pass

    def callback(step, x0, x, total):
        if step == 1:
            raise Interrupted("ComfyUI's interrupt")

    with pytest.raises(Interrupted):
        guider.sample(prepare_noise(latent, 0), latent, Sampler("euler"), sigmas, callback=callback, seed=0)
    record = core.REGISTRY.running(s)
    restarts = len(record.engine.restarts)
    out, _ = guided(core, s, "flux", flux_conditioning(1), None, 1.0, latent, sigmas[:3], prepare_noise(latent, 0))
    assert torch.isfinite(out).all() and len(record.engine.restarts) == restarts, "no rank was replaced"


def test_bad_guider_inputs_are_refused_with_one_line(core, models):
    s = settings(core, models["sd3"])
    with pytest.raises(ValueError, match="cfg=4.0 needs a negative conditioning"):
        core.guider(s, sd3_conditioning(1), None, 4.0, model_patcher=Patcher("sd3"),
                    sampling_function=sampling_function)
    with pytest.raises(ValueError, match="pipefusion"):
        core.guider(settings(core, models["sd3"], gpus=(0, 1), plan="explicit", pipefusion=2), sd3_conditioning(1),
                    sd3_conditioning(2), 4.0, model_patcher=Patcher("sd3"), sampling_function=sampling_function)
    guider = core.guider(s, sd3_conditioning(1), sd3_conditioning(2), 4.0, model_patcher=Patcher("sd3"),
                         sampling_function=sampling_function)
    latent = empty_latent(width=64, height=64)["samples"]
    with pytest.raises(ValueError, match="noise_mask"):
        guider.sample(latent, latent, Sampler("euler"), torch.tensor([1.0, 0.0]), denoise_mask=torch.ones(1))
    assert guider.sample(latent, latent, Sampler("euler"), torch.tensor([])) is latent
