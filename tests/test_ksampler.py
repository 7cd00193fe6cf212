"""engine.sampling.ksampler / noise / latent_formats: ComfyUI KSampler behaviour for flow models, checked piece by piece
and end to end against a reference loop written here."""
import pytest
import torch

from engine import families
from engine.sampling.ksampler import ksample
from engine.sampling.latent_formats import LatentFormat
from engine.sampling.noise import prepare_noise
from engine.sampling.schedules import FlowSampling, compute_sigmas

TOLERANCE = 1e-6


def fam(name: str, variant: str | None = None) -> dict:
    """ksample's model sampling and latent format for a family's (first) variant."""
    family = families.get(name)
    return dict(sampling=family.sampling(variant or family.variants[0]), latent=family.latent)


class ToyModel:
    """A velocity predictor that records what it is asked; pos and neg differ so CFG matters. Acts per batch item."""

    def __init__(self):
        generator = torch.Generator().manual_seed(7)
        self.mix = torch.randn(16, 16, generator=generator) / 4
        self.calls = []

    def velocity(self, x, sigma, which):
        base = torch.tanh(torch.einsum("oc,bchw->bohw", self.mix, x)) + 0.2 * x + sigma
        return base if which == "pos" else 0.5 * base - 0.1

    def __call__(self, x_model, sigma, which):
        assert sigma.ndim == 0 and sigma.dtype == torch.float32 and x_model.dtype == torch.float32
        self.calls.append((x_model.clone(), float(sigma), which))
        return tuple(self.velocity(x_model, sigma, w) for w in which)


def raw_latent(batch=2, seed=3):
    return torch.randn(batch, 16, 6, 4, generator=torch.Generator().manual_seed(seed)) * 0.8 + 0.1


# ---- noise ------------------------------------------------------------------------------------------------------------

def test_prepare_noise_is_a_seeded_cpu_draw_in_the_latent_dtype():
    latent = torch.zeros(3, 16, 5, 4)
    rng_before = torch.get_rng_state()
    noise = prepare_noise(latent, 123)
    assert torch.equal(torch.get_rng_state(), rng_before), "must not touch torch's global RNG"
    expected = torch.randn(3, 16, 5, 4, generator=torch.Generator().manual_seed(123))
    assert torch.equal(noise, expected) and noise.device.type == "cpu"
    half = prepare_noise(latent.half(), 123)
    assert half.dtype == torch.float16
    assert torch.equal(half, torch.randn(3, 16, 5, 4, dtype=torch.float16, generator=torch.Generator().manual_seed(123)))
    assert not torch.equal(prepare_noise(latent, 124), noise)


def test_prepare_noise_batch_index_picks_draws_from_one_stream():
    latent = torch.zeros(3, 16, 4, 4)
    stream = torch.Generator().manual_seed(5)
    draws = [torch.randn(1, 16, 4, 4, generator=stream) for _ in range(4)]  # draws 0..3, one item each
    got = prepare_noise(latent, 5, [3, 0, 3])
    assert torch.equal(got, torch.cat([draws[3], draws[0], draws[3]]))
    # consecutive indices from 0 are the same as one batched draw
    assert torch.equal(prepare_noise(latent, 5, [0, 1, 2]), prepare_noise(latent, 5))
    with pytest.raises(ValueError, match=r"batch_index=\[-1\]"):
        prepare_noise(latent[:1], 5, [-1])


# ---- latent formats ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, scale, shift", [("flux", 0.3611, 0.1159), ("sd3", 1.5305, 0.0609)])
def test_latent_format_constants_and_round_trip(family, scale, shift):
    fmt = families.get(family).latent
    x = raw_latent()
    assert torch.equal(fmt.process_in(x), (x - shift) * scale)
    assert torch.equal(fmt.process_out(x), x / scale + shift)
    assert float((fmt.process_out(fmt.process_in(x)) - x).abs().max()) <= 1e-6


def test_per_channel_latent_format_round_trip():
    """A video VAE's format (per-channel mean and std, ComfyUI's Wan21 kind) on a one-frame 5-D latent."""
    g = torch.Generator().manual_seed(4)
    mean, std = tuple(torch.randn(16, generator=g).tolist()), tuple((torch.rand(16, generator=g) + 0.5).tolist())
    fmt = LatentFormat("per-channel", mean=mean, std=std, spatial_dims=3)
    x = torch.randn(2, 16, 1, 6, 4, generator=g)
    m, sd = torch.tensor(mean).view(1, 16, 1, 1, 1), torch.tensor(std).view(1, 16, 1, 1, 1)
    assert torch.equal(fmt.process_in(x), (x - m) * 1.0 / sd)
    assert float((fmt.process_out(fmt.process_in(x)) - x).abs().max()) <= 1e-6


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match=r"family 'sdxl' is unknown: use one of flux, sd3"):
        families.get("sdxl")


# ---- ksample pieces ---------------------------------------------------------------------------------------------------

def first_call(model):
    x, sigma, which = model.calls[0]
    return x, sigma, which


def test_all_zero_latent_is_not_shifted_but_a_real_one_is():
    steps, denoise, seed = 4, 0.5, 11
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", steps, denoise)
    s0 = sigmas[0]
    for latent in (torch.zeros(1, 16, 6, 4), raw_latent(1)):
        model = ToyModel()
        ksample(model, latent, **fam("flux"), seed=seed, steps=steps, cfg=1.0, sampler="euler", scheduler="simple",
                denoise=denoise)
        x_first, sigma_first, _ = first_call(model)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
        latent_model = latent if not latent.any() else (latent - 0.1159) * 0.3611
        assert sigma_first == float(s0) < 1.0
        assert torch.equal(x_first, s0 * noise + (1.0 - s0) * latent_model)


def test_cfg_one_requests_only_the_positive_and_more_requests_both():
    for cfg, expected in ((1.0, ("pos",)), (3.5, ("pos", "neg"))):
        model = ToyModel()
        ksample(model, raw_latent(), **fam("sd3"), seed=1, steps=3, cfg=cfg, sampler="heun", scheduler="normal")
        assert {which for _, _, which in model.calls} == {expected}
        assert len(model.calls) == 5  # heun: two model evaluations per step, one on the last step


def test_denoise_below_one_runs_the_tail_of_the_longer_schedule():
    steps, denoise = 5, 0.6
    model = ToyModel()
    ksample(model, raw_latent(), **fam("sd3"), seed=2, steps=steps, cfg=2.0, sampler="euler", scheduler="simple",
            denoise=denoise)
    longer = compute_sigmas(FlowSampling.sd3(), "simple", int(steps / denoise))  # 8 steps, keep the last 5
    assert len(longer) == 9
    assert [sigma for _, sigma, _ in model.calls] == [float(s) for s in longer[-(steps + 1):-1]]
    x_first, _, _ = first_call(model)
    noise = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(2))
    s0 = longer[-(steps + 1)]
    assert torch.equal(x_first, s0 * noise + (1.0 - s0) * families.get("sd3").latent.process_in(raw_latent()))


def test_shift_changes_the_schedule_the_model_sees():
    default, shifted = ToyModel(), ToyModel()
    latent = families.get("sd3").latent
    ksample(default, raw_latent(), **fam("sd3"), seed=2, steps=4, cfg=1.0, sampler="euler", scheduler="simple")
    ksample(shifted, raw_latent(), sampling=FlowSampling.sd3(6.0), latent=latent, seed=2, steps=4, cfg=1.0,
            sampler="euler", scheduler="simple")
    assert [s for _, s, _ in default.calls] == [float(s) for s in compute_sigmas(FlowSampling.sd3(3.0), "simple", 4)[:-1]]
    assert [s for _, s, _ in shifted.calls] == [float(s) for s in compute_sigmas(FlowSampling.sd3(6.0), "simple", 4)[:-1]]


# ---- end to end -------------------------------------------------------------------------------------------------------

def reference_ksample(model, latent_raw, *, family, seed, steps, cfg, scheduler, denoise, sampler):
    """ComfyUI's KSampler for a flow model written out as one loop: euler or euler_ancestral (RF form, eta = 1)."""
    scale, shift = {"flux": (0.3611, 0.1159), "sd3": (1.5305, 0.0609)}[family]
    sampling = FlowSampling.flux() if family == "flux" else FlowSampling.sd3()
    sigmas = compute_sigmas(sampling, scheduler, steps, denoise)
    noise = torch.randn(latent_raw.shape, generator=torch.Generator().manual_seed(seed))
    latent = (latent_raw - shift) * scale if latent_raw.any() else latent_raw
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent
    step_noise = torch.Generator().manual_seed(seed + 1)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        pos = x - model.velocity(x, s, "pos") * s
        neg = x - model.velocity(x, s, "neg") * s
        x0 = neg + (pos - neg) * cfg
        if sampler == "euler":
            x = x + (x - x0) / s * (s_next - s)
        elif s_next == 0:
            x = x0
        else:
            s_down = s_next * (1 + (s_next / s - 1) * 1.0)
            ratio = s_down / s
            x = ratio * x + (1 - ratio) * x0
            renoise = (s_next ** 2 - s_down ** 2 * (1 - s_next) ** 2 / (1 - s_down) ** 2) ** 0.5
            x = ((1 - s_next) / (1 - s_down)) * x + torch.randn(x.shape, generator=step_noise) * 1.0 * renoise
    x = x / (1.0 - sigmas[-1])
    return x / scale + shift


@pytest.mark.parametrize("family, sampler, scheduler, denoise, zero", [
    ("flux", "euler", "simple", 1.0, True),
    ("sd3", "euler", "sgm_uniform", 0.75, False),
    ("flux", "euler_ancestral", "beta", 0.8, False),
    ("sd3", "euler_ancestral", "simple", 1.0, True),
])
def test_ksample_matches_reference_loop(family, sampler, scheduler, denoise, zero):
    latent = torch.zeros(2, 16, 6, 4) if zero else raw_latent()
    kwargs = dict(seed=424242, steps=6, cfg=3.5, scheduler=scheduler, denoise=denoise)
    steps_seen = []
    got = ksample(ToyModel(), latent, sampler=sampler, callback=lambda i, n: steps_seen.append((i, n)),
                  **fam(family), **kwargs)
    want = reference_ksample(ToyModel(), latent, sampler=sampler, family=family, **kwargs)
    diff = float((got - want).abs().max())
    print(f"ksample {family} {sampler} {scheduler} denoise={denoise}: max abs diff vs reference = {diff:.3g}")
    assert got.shape == latent.shape and got.dtype == torch.float32
    assert diff <= TOLERANCE
    total = len(compute_sigmas(FlowSampling.flux() if family == "flux" else FlowSampling.sd3(), scheduler, 6, denoise)) - 1
    assert steps_seen == [(i, total) for i in range(total)]


def test_given_noise_replaces_the_seeded_noise():
    latent = raw_latent()
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(77))
    with_noise = ksample(ToyModel(), latent, **fam("flux"), seed=1, steps=3, cfg=2.0, sampler="dpmpp_2m",
                         scheduler="simple", noise=noise)
    seeded_77 = ksample(ToyModel(), latent, **fam("flux"), seed=77, steps=3, cfg=2.0, sampler="dpmpp_2m",
                        scheduler="simple")
    assert torch.equal(with_noise, seeded_77)  # dpmpp_2m draws nothing after the initial noise


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m_sde"])
def test_batch_items_get_their_own_noise(sampler):
    latent = torch.zeros(2, 16, 6, 4)
    args = dict(**fam("sd3"), seed=9, steps=4, cfg=2.5, sampler=sampler, scheduler="simple")
    both = ksample(ToyModel(), latent, **args)
    assert not torch.allclose(both[0], both[1])
    from tolerance import fp32_bound, report, sampling_amplification
    # another batch size or item order may take another einsum kernel: equal to fp32 rounding of the toy model's
    # 16-channel mix, through 4 steps at cfg 2.5 (a wrong item's noise differs by far more)
    bound = fp32_bound(both.abs().max(), reduction=16, amplification=sampling_amplification(4, 2.5))
    if sampler == "euler":  # deterministic and per-item: each item equals a one-item run with its batch_index
        for j in range(2):
            alone = ksample(ToyModel(), latent[j:j + 1], batch_index=[j], **args)
            assert report(f"item {j} vs alone with batch_index [{j}]", (alone[0] - both[j]).abs().max(), bound)
    swapped = ksample(ToyModel(), latent, batch_index=[1, 0], **args)
    if sampler == "euler":
        assert report("batch_index [1, 0] vs [0, 1], flipped", (swapped - both.flip(0)).abs().max(), bound)
    assert torch.isfinite(swapped).all()


# ---- errors -------------------------------------------------------------------------------------------------------------

GOOD = dict(**fam("flux"), seed=0, steps=4, cfg=1.0, sampler="euler", scheduler="simple")


@pytest.mark.parametrize("change, pattern", [
    (dict(sampling="flux"), r"model sampling 'flux' and latent format .* are invalid"),
    (dict(sampler="lms"), r"sampler='lms'.*euler, euler_ancestral, heun, dpmpp_2m, dpmpp_2m_sde"),
    (dict(scheduler="cosine"), r"scheduler='cosine'.*simple"),
    (dict(steps=0), r"steps=0.*integer >= 1"),
    (dict(steps=2.5), r"steps=2.5.*integer >= 1"),
    (dict(cfg=0.0), r"cfg=0.0.*> 0"),
    (dict(cfg=-2), r"cfg=-2.*> 0"),
    (dict(denoise=0.0), r"denoise=0.0.*\(0, 1\]"),
    (dict(denoise=1.5), r"denoise=1.5.*\(0, 1\]"),
    (dict(seed=-1), r"seed=-1.*\[0, 2\*\*64\)"),
    (dict(batch_index=[0]), r"batch_index=\[0\].*batch of 2"),
])
def test_bad_inputs_raise_value_error_naming_the_value(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        ksample(ToyModel(), raw_latent(), **{**GOOD, **change})


@pytest.mark.parametrize("latent, pattern", [
    (torch.zeros(2, 4, 8, 8), r"latent_raw .*shape \[2, 4, 8, 8\].*\[B, 16, H/8, W/8\]"),
    (torch.zeros(16, 8, 8), r"latent_raw .*shape \[16, 8, 8\]"),
    (torch.zeros(1, 16, 8, 8, dtype=torch.int64), r"latent_raw is a torch.int64 tensor"),
])
def test_bad_latent_is_named(latent, pattern):
    model = ToyModel()
    with pytest.raises(ValueError, match=pattern):
        ksample(model, latent, **GOOD)
    assert model.calls == []


def test_noise_of_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match=r"noise has shape \[1, 16, 6, 4\].*\[2, 16, 6, 4\]"):
        ksample(ToyModel(), raw_latent(), noise=torch.zeros(1, 16, 6, 4), **GOOD)


# ---- KSamplerAdvanced: a window of the schedule ------------------------------------------------------------------
def test_a_window_takes_comfyuis_steps_of_the_schedule():
    """comfy/samplers.py KSampler.sample: sigmas[:last_step + 1] with the last set to 0 when force_full_denoise and
    the window ends early, then sigmas[start_step:]; a start at or past the last step leaves nothing to sample."""
    from engine.sampling.ksampler import StepWindow
    sigmas = compute_sigmas(FlowSampling.sd3(), "simple", 4, 1.0)   # 5 values ending in 0
    assert torch.equal(StepWindow().apply(sigmas), sigmas)
    assert torch.equal(StepWindow(0, 2).apply(sigmas), sigmas[:3])                       # leftover noise kept
    assert torch.equal(StepWindow(0, 2, force_full_denoise=True).apply(sigmas), torch.cat([sigmas[:2], sigmas[4:]]))
    assert torch.equal(StepWindow(2, 10000).apply(sigmas), sigmas[2:])
    assert torch.equal(StepWindow(2, 10000, force_full_denoise=True).apply(sigmas), sigmas[2:])  # ends at 0 anyway
    assert StepWindow(4, 10000).apply(sigmas) is None and StepWindow(7).apply(sigmas) is None


def test_two_windows_with_leftover_noise_give_the_whole_run():
    """Wan 2.2's two KSamplerAdvanced: steps 0-2 with noise added and the leftover noise returned, then 2-end on that
    latent without adding noise, equal one run of all steps (CONST scaling: the second window starts where the first
    stopped); a window past the end returns the latent as given."""
    from engine.sampling.ksampler import StepWindow
    model, latent = ToyModel(), raw_latent()
    common = dict(**fam("sd3"), seed=5, steps=4, cfg=3.0, sampler="euler", scheduler="simple")
    whole = ksample(model, latent, **common)
    first = ksample(model, latent, **common, window=StepWindow(0, 2))
    second = ksample(model, first, **common, window=StepWindow(2, 10000, force_full_denoise=True, add_noise=False))
    diff = (second - whole).abs().max().item()
    print(f"two windows vs one run: max abs diff {diff:.3g}")
    assert not torch.equal(first, whole) and diff <= TOLERANCE
    assert torch.equal(ksample(model, first, **common, window=StepWindow(4, 10000, add_noise=False)), first)


@pytest.mark.parametrize("clean", [False, True], ids=["noised (BaseModel)", "clean (WAN22)"])
def test_a_noise_mask_is_applied_as_ksamplerx0inpaint_applies_it(clean):
    """comfy/samplers.py KSamplerX0Inpaint around the model: where the mask is 0 the model sees the latent noised to
    sigma (BaseModel.scale_latent_inpaint) or as it is (WAN22's), and the denoised result is the latent there; the
    mask is fitted to the latent as comfy.utils.reshape_mask does (a [1, 1, h, w] mask: repeated over channels and
    batch). The kept region ends bitwise at the input latent."""
    latent = raw_latent()
    mask = torch.ones(1, 1, 6, 4)
    mask[:, :, :3] = 0.0
    kwargs = dict(seed=11, steps=4, cfg=2.0, sampler="euler", scheduler="simple")
    got = ksample(ToyModel(), latent, denoise_mask=mask.expand(2, 16, 6, 4), masked_latent_clean=clean,
                  **fam("flux"), **kwargs)
    model, (scale, shift) = ToyModel(), (0.3611, 0.1159)
    sigmas = compute_sigmas(FlowSampling.flux(), "simple", 4)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(11))
    x0 = (latent - shift) * scale
    x = sigmas[0] * noise + (1 - sigmas[0]) * x0
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        known = x0 if clean else s * noise + (1 - s) * x0
        x_in = x * mask + known * (1 - mask)
        pos, neg = (x_in - model.velocity(x_in, s, w) * s for w in ("pos", "neg"))
        denoised = (neg + (pos - neg) * 2.0) * mask + x0 * (1 - mask)
        x = x + (x - denoised) / s * (s_next - s)
    want = x / scale + shift
    diff = float((got - want).abs().max())
    print(f"noise mask ({'clean' if clean else 'noised'} latent): max abs diff vs reference = {diff:.3g}")
    assert diff <= TOLERANCE and torch.allclose(got[:, :, :3], latent[:, :, :3], atol=1e-6)
    from engine.sampling.ksampler import reshape_mask
    assert torch.equal(reshape_mask(mask, (2, 16, 6, 4)), mask.expand(2, 16, 6, 4))
