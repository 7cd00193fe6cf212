"""ComfyUI's own samplers on the xDiT Engine's MODEL, without ComfyUI: the stand-ins below restate what ComfyUI 0.3.64
does between its sampler and its diffusion model (comfy/samplers.py: KSAMPLER.sample, sampling_function, cfg_function,
calc_cond_batch batching the positive and negative passes into one call when their shapes agree; comfy/model_base.py:
BaseModel._apply_model handing the diffusion model the model-space input, model_sampling.timestep(sigma) and the
conditioning; comfy/model_sampling.py: CONST), around the pack's real EngineTransformer and engine. The latent must
equal the engine's own loop (xDiT Sampler) for the same noise and sigmas, on 1 and 2 ranks, for FLUX (cfg 1) and SD3
(cfg > 1, CFG parallel over the batched passes), across a SplitSigmas edit, and for samplers that call the model
twice a step or draw noise. The real ComfyUI runs these graphs in tests/test_comfyui_live.py."""
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
    """comfy.model_sampling CONST with a flow model's sampling (ModelSamplingFlux / ModelSamplingDiscreteFlow)."""

    def __init__(self, flow: FlowSampling):
        self.flow = flow

    def timestep(self, sigma):
        return self.flow.timestep(sigma)

    def noise_scaling(self, sigma, noise, latent_image):
        return sigma * noise + (1.0 - sigma) * latent_image

    def inverse_noise_scaling(self, sigma, latent):
        return latent / (1.0 - sigma)

    def calculate_denoised(self, sigma, model_output, model_input):
        sigma = sigma.view(sigma.shape[:1] + (1,) * (model_output.ndim - 1))
        return model_input - model_output * sigma


class BaseModel:
    """comfy.model_base.BaseModel around the engine's diffusion model: _apply_model's conversions, the latent format,
    and the sampling patcher ComfyUI's pre_run sets (current_patcher)."""

    def __init__(self, family, diffusion_model, variant=None):
        spec = families.get(family)
        self.family, self.format, self.diffusion_model = family, spec.latent, diffusion_model
        self.model_sampling = ConstSampling(spec.sampling(variant or spec.variants[0]))
        self.current_patcher = None

    def apply_model(self, x, sigma, conds, transformer_options):
        t = self.model_sampling.timestep(sigma).float()
        kwargs = {k: v for k, v in conds.items() if k != "context" and v is not None}
        out = self.diffusion_model(x, t, context=conds["context"], control=None,
                                   transformer_options=transformer_options, **kwargs).float()
        return self.model_sampling.calculate_denoised(sigma, out, x)


def calc_cond_batch(model, conds, x, sigma, model_options):
    """comfy.samplers.calc_cond_batch: _calc_cond_batch_outer runs it through the CALC_COND_BATCH wrappers that
    prepare_model_patcher copied from the MODEL into model_options (the engine's MODEL has one), each called as
    wrapper(executor, model, conds, x_in, timestep, model_options), the executor calling the next."""
    wrappers = [w for ws in model_options.get("transformer_options", {}).get("wrappers", {})
                .get("calc_cond_batch", {}).values() for w in ws]

    class Executor:
        def __init__(self, i):
            self.i = i

        def __call__(self, *args):
            return wrappers[self.i](Executor(self.i + 1), *args) if self.i < len(wrappers) else _calc_cond_batch(*args)
    return Executor(0)(model, conds, x, sigma, model_options)


def _calc_cond_batch(model, conds, x, sigma, model_options):
    """comfy.samplers._calc_cond_batch for one entry per side: sides whose shapes agree run as one call
    (cond_or_uncond lists them) when its memory estimate fits (`fits` here: model_options' "batch_fits", default
    True), a skipped side (None) stays zero."""
    out = [torch.zeros_like(x) for _ in conds]
    sides = [(i, c) for i, c in enumerate(conds) if c is not None]
    batch = len({c["context"].shape for _, c in sides}) == 1 and model_options.get("batch_fits", True)
    groups = [sides] if batch else [[s] for s in sides]
    for group in groups:
        rows = x.shape[0]

        def cat(values):   # each side's rows repeated to the batch (repeat_to_batch_size), sides concatenated
            if values[0] is None or isinstance(values[0], str):
                return values[0]
            if isinstance(values[0], list):
                return [cat([v[i] for v in values]) for i in range(len(values[0]))]
            return torch.cat([v.expand(rows, *v.shape[1:]) for v in values])
        options = dict(model_options.get("transformer_options", {}), cond_or_uncond=[i for i, _ in group],
                       sigmas=sigma)
        conds_ = {key: cat([c[key] for _, c in group]) for key in group[0][1]}
        output = model.apply_model(torch.cat([x] * len(group)), torch.cat([sigma] * len(group)), conds_,
                                   options).chunk(len(group))
        for (i, _), o in zip(group, output):
            out[i] += o   # accumulated onto zeros, as ComfyUI's out_conds
    return out


def sampling_function(model, x, sigma, uncond, cond, cfg, model_options):
    """comfy.samplers.sampling_function with cfg_function's plain CFG and its cfg-1 shortcut."""
    uncond_ = None if math.isclose(cfg, 1.0) and not model_options.get("disable_cfg1_optimization") else uncond
    pos, neg = calc_cond_batch(model, [cond, uncond_], x, sigma, model_options)
    return neg + (pos - neg) * cfg


def comfy_conds(conditioning, family):
    """What ComfyUI's extra_conds make of a CONDITIONING entry: context (FLUX.2: zeros prepended up to 512 tokens), y
    (the pooled vector), guidance (FLUX.1 and FLUX.2: the value or 3.5), ref_latents (each process_in'd)."""
    if conditioning is None:
        return None
    spec = families.get(family)
    cond, extras = conditioning[0]
    if spec.pad_text_to and cond.shape[1] < spec.pad_text_to:
        cond = torch.nn.functional.pad(cond, (0, 0, spec.pad_text_to - cond.shape[1], 0))
    refs = extras.get("reference_latents")
    return {"context": cond, "y": extras.get("pooled_output"),
            "guidance": torch.tensor([extras.get("guidance", 3.5)]) if family in ("flux", "flux2") else None,
            "ref_latents": [spec.latent.process_in(r) for r in refs] if refs else None,
            "ref_latents_method": extras.get("reference_latents_method")}


def ksampler(model, family, positive, negative, cfg, noise, latent, sigmas, sampler="euler", seed=0, callback=None,
             model_options=None):
    """KSAMPLER.sample through CFGGuider: noise scaling, the sampler over sampling_function, inverse scaling; the
    cleanup after the run (ModelPatcher.cleanup's callbacks) ends the engine's session."""
    link = model.diffusion_model.link
    options = dict(model_options or {"transformer_options": {}})
    options["transformer_options"] = dict(options["transformer_options"],   # prepare_model_patcher: the MODEL's
                                          wrappers=model.wrappers)           # wrappers into the options
    pos, neg = comfy_conds(positive, family), comfy_conds(negative, family)
    latent_model = model.format.process_in(latent) if torch.count_nonzero(latent) else latent
    x = model.model_sampling.noise_scaling(sigmas[0], noise, latent_model)
    try:
        x = engine_sample(sampler, lambda x_in, s: sampling_function(model, x_in, s * x_in.new_ones([x_in.shape[0]]),
                                                                     neg, pos, cfg, options),
                          x, sigmas, seed=seed, callback=callback,
                          percent_to_sigma=model.model_sampling.flow.percent_to_sigma)
    finally:
        link.on_cleanup()
    return model.format.process_out(model.model_sampling.inverse_noise_scaling(sigmas[-1], x))


def engine_model(core, s, family, variant=None):
    """The xDiT Engine's MODEL as nodes.py builds it, with the BaseModel stand-in for ComfyUI's model class."""
    from conftest import PACK_NAME
    import importlib
    parts = importlib.import_module(PACK_NAME + ".xdit_nodes.model")
    link = core.model_link(s)
    model = BaseModel(family, parts.EngineTransformer(link, {}), variant)
    model.wrappers = {"calc_cond_batch": {parts.OWN_CALLBACK: [link.calc_cond_batch]}}   # as nodes.py adds it
    link.owner = lambda: model
    return model


def last_job(core, s):
    record = core.REGISTRY.running(s)
    return record.last_plan, record.last_timings.get("model_calls"), record.last_route


CASES = [("flux", 1.0, (0,)), ("flux", 1.0, (0, 1)), ("sd3", 4.0, (0,)), ("sd3", 4.0, (0, 1))]


@pytest.mark.parametrize("family,cfg,gpus", CASES, ids=["flux-1rank", "flux-2ranks", "sd3-1rank", "sd3-2ranks"])
def test_comfyuis_sampler_on_the_engines_model_equals_the_engines_own_loop(core, models, family, cfg, gpus):
    s = settings(core, models[family], gpus=gpus)
    positive = flux_conditioning(1) if family == "flux" else sd3_conditioning(1)
    negative = flux_conditioning(2) if family == "flux" else sd3_conditioning(2)
    latent, steps, seed = empty_latent(width=64, height=64), 3, 7
    want = core.sample(s, positive, negative, latent, seed=seed, steps=steps, cfg=cfg, sampler_name="euler",
                       scheduler="simple", denoise=1.0)["samples"]
    sigmas = compute_sigmas(FlowSampling.flux() if family == "flux" else FlowSampling.sd3(), "simple", steps, 1.0)
    got = ksampler(engine_model(core, s, family), family, positive, negative, cfg,
                   prepare_noise(latent["samples"], seed), latent["samples"], sigmas, seed=seed)
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(steps, cfg))
    assert report(f"{family} {len(gpus)} rank(s): ComfyUI's sampler on the MODEL vs the engine's loop",
                  (got - want).abs().max(), bound)
    plan, calls, route = last_job(core, s)
    assert calls == steps, "one engine call per model evaluation: the two passes batched into one"
    assert plan == ("cfg2" if family == "sd3" and len(gpus) == 2 else "ulysses2" if len(gpus) == 2 else "single rank")
    assert route.startswith("ComfyUI's sampler on the engine's MODEL")


@pytest.mark.parametrize("plan,tokens,fits", [("explicit", (30, 45), True), ("auto", (30, 30), False)],
                         ids=["cfg2-unequal-lengths", "auto-memory-says-no-batch"])
def test_passes_comfyui_runs_as_separate_calls_reach_the_ranks_together_under_cfg_parallel(core, models, plan,
                                                                                          tokens, fits):
    """ComfyUI runs the positive and the negative as two calls when their text lengths differ or its memory estimate
    says the batch does not fit: the MODEL's calc_cond_batch wrapper sends both in one request a step, and CFG parallel
    (explicit, or auto's choice) runs them side by side; the latent equals the engine's own loop."""
    s = settings(core, models["sd3"], gpus=(0, 1), plan=plan, cfg_parallel=plan == "explicit")
    positive, negative = sd3_conditioning(1, tokens=tokens[0]), sd3_conditioning(2, tokens=tokens[1])
    latent, steps, seed, cfg = empty_latent(width=64, height=64), 3, 9, 4.0
    want = core.sample(s, positive, negative, latent, seed=seed, steps=steps, cfg=cfg, sampler_name="euler",
                       scheduler="simple", denoise=1.0)["samples"]
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", steps, 1.0)
    got = ksampler(engine_model(core, s, "sd3"), "sd3", positive, negative, cfg, prepare_noise(latent["samples"], seed),
                   latent["samples"], sigmas, seed=seed, model_options={"transformer_options": {}, "batch_fits": fits})
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(steps, cfg))
    assert report(f"SD3 {tokens} tokens, batch fits {fits}: two calls a step on the MODEL vs the engine's loop",
                  (got - want).abs().max(), bound)
    record = core.REGISTRY.running(s)
    timings = record.last_timings
    print(f"plan {record.last_plan}: {timings}")
    assert record.last_plan == "cfg2" and timings["model_calls"] == 2 * steps and timings["round_trips"] == steps


def test_a_split_sigmas_edit_gives_the_unsplit_latent(core, models):
    """SplitSigmas at step 2 and a second run with zero noise (DisableNoise) on the first's latent: ComfyUI's CONST
    noise scaling makes this the same trajectory as one run; each run is its own session."""
    s = settings(core, models["flux"], gpus=(0, 1))
    model = engine_model(core, s, "flux")
    positive, latent, steps, seed = flux_conditioning(3), empty_latent(width=64, height=64), 4, 5
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", steps, 1.0)
    noise = prepare_noise(latent["samples"], seed)
    whole = ksampler(model, "flux", positive, None, 1.0, noise, latent["samples"], sigmas, seed=seed)
    first = ksampler(model, "flux", positive, None, 1.0, noise, latent["samples"], sigmas[:3], seed=seed)
    second = ksampler(model, "flux", positive, None, 1.0, torch.zeros_like(noise), first, sigmas[2:], seed=seed)
    bound = fp32_bound(whole.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(steps))
    assert not torch.equal(first, second)
    assert report("split sigmas vs one run", (second - whole).abs().max(), bound)


def test_two_model_calls_a_step_and_a_stochastic_sampler_run_on_the_model(core, models):
    """heun asks the model twice per step; dpmpp_2m_sde draws noise: the MODEL serves whatever the sampler asks."""
    s = settings(core, models["sd3"], gpus=(0, 1))
    model = engine_model(core, s, "sd3")
    latent, seed, steps = empty_latent(width=64, height=64), 11, 3
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", steps, 1.0)
    noise = prepare_noise(latent["samples"], seed)
    for name, calls in (("heun", 2 * steps - 1), ("dpmpp_2m_sde", steps)):
        want = core.sample(s, sd3_conditioning(1), sd3_conditioning(2), latent, seed=seed, steps=steps, cfg=3.0,
                           sampler_name=name, scheduler="simple", denoise=1.0)["samples"]
        got = ksampler(model, "sd3", sd3_conditioning(1), sd3_conditioning(2), 3.0, noise, latent["samples"], sigmas,
                       sampler=name, seed=seed)
        bound = fp32_bound(want.abs().max(), reduction=4096, depth=4, amplification=sampling_amplification(2 * steps, 3))
        assert report(f"{name} on the MODEL vs the engine's loop", (got - want).abs().max(), bound)
        assert last_job(core, s)[1] == calls


def test_cfg_one_with_a_negative_asked_for_runs_both_passes(core, models):
    """CFG++ samplers disable ComfyUI's cfg-1 shortcut and ask for the negative at cfg 1: both passes run."""
    s = settings(core, models["sd3"], gpus=(0, 1))
    latent = empty_latent(width=64, height=64)["samples"]
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", 2, 1.0)
    out = ksampler(engine_model(core, s, "sd3"), "sd3", sd3_conditioning(1), sd3_conditioning(2), 1.0,
                   prepare_noise(latent, 0), latent, sigmas,
                   model_options={"transformer_options": {}, "disable_cfg1_optimization": True})
    assert torch.isfinite(out).all() and last_job(core, s)[:2] == ("cfg2", 2)


def test_an_interrupt_from_comfyuis_callback_ends_the_session_and_the_engine_stays_ready(core, models):
    s = settings(core, models["flux"], gpus=(0, 1))
    model = engine_model(core, s, "flux")
    latent = empty_latent(width=64, height=64)["samples"]
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", 6, 1.0)

    class Interrupted(Exception):
        pass

    def callback(step, total):
        if step == 1:
            raise Interrupted("ComfyUI's interrupt")

    with pytest.raises(Interrupted):
        ksampler(model, "flux", flux_conditioning(1), None, 1.0, prepare_noise(latent, 0), latent, sigmas,
                 callback=callback)
    record = core.REGISTRY.running(s)
    restarts = len(record.engine.restarts)
    assert record.open_session is None
    out = ksampler(model, "flux", flux_conditioning(1), None, 1.0, prepare_noise(latent, 0), latent, sigmas[:3])
    assert torch.isfinite(out).all() and len(record.engine.restarts) == restarts, "no rank was replaced"
