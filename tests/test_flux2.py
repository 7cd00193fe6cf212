"""FLUX.2 [dev] and [klein]: the engine's velocity and sampled latent equal an independent reference built here from
ComfyUI's FLUX.2 formulas (ComfyUI 0.3.72 / 0.12.1: comfy/model_base.py Flux2, comfy/ldm/flux/model.py, comfy/
latent_formats.py Flux2, comfy/supported_models.py Flux2), with and without reference latents, on 1 to 4 real rank
processes (gloo, CPU) under every plan; stage-only PipeFusion, the step cache, compile and fp8 weights; LoRAs in the
formats people share; ComfyUI's mixed-precision fp8 files and GGUF files equal their plain copies.

The reference restates ComfyUI's math without the engine's code and drives the unmodified diffusers
Flux2Transformer2DModel: the text zero-padded in front to 512 tokens; the latent one token per latent pixel (patch
size 1) with ids (index, row, col, 0); text ids (0, 0, 0, l); reference k at index 10 k ("index"), or placed by the
"offset" / "uxo" loop of Flux._forward; the output's image tokens kept; sigma as the timestep (the model multiplies
by 1000); guidance only where the model has a guidance embedding; latent format identity; ModelSamplingFlux with
shift 2.02 and KSampler's "simple" schedule over its 10000-entry table; euler.
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import load_model, load_transformer
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan
from engine.runtime.client import Engine

from conftest import FAST
from tolerance import fp32_bound, report, sampling_amplification

SHIFT = 2.02            # supported_models.Flux2.sampling_settings
TEXT = 512              # model_base.Flux2.extra_conds: target_text_len
DEPTH = 8               # the tiny FLUX.2: 4 double + 4 single blocks
STEPS = 3
WIDTH = {"flux2-dev": 96, "flux2-klein-4b": 48, "flux2-klein-9b": 72}   # the tiny models' text widths


@pytest.fixture(scope="module")
def engines():
    """conftest's engines, with a heartbeat deadline that a CPU shared with other test runs does not trip."""
    started = {}

    def get(world):
        if world not in started:
            started[world] = Engine(world, device="cpu", deadlines=dataclasses.replace(FAST, heartbeat_s=60))
        return started[world]
    yield get
    for e in started.values():
        e.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux2")
    return {v: write_tiny("flux2", str(d), variant=v) for v in ("flux2-dev", "flux2-klein-4b")}


@pytest.fixture(scope="module")
def diffusers_models(models):
    return {v: load_transformer(p).model for v, p in models.items()}


def randn(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


# ---- the independent reference ---------------------------------------------------------------------------------
def comfy_places(method, image_hw, ref_shapes):
    """(index, h_offset, w_offset) per reference as Flux._forward's loop chooses them (patch size 1: offsets are
    latent pixels): "index" adds ref_index_scale 10 per reference; "offset" tiles on index 1; "uxo" goes diagonally
    past the image on index 0."""
    places, h, w, index = [], 0, 0, 0
    for rh, rw in ref_shapes:
        if method == "index":
            index += 10
            h_off = w_off = 0
        elif method == "uxo":
            index, h_off, w_off = 0, image_hw[0] + h, image_hw[1] + w
            h, w = h + rh, w + rw
        else:
            index, h_off, w_off = 1, 0, 0
            if rh + h > rw + w:
                w_off = w
            else:
                h_off = h
            h, w = max(h, rh + h_off), max(w, rw + w_off)
        places.append((index, h_off, w_off))
    return places


def process_img(x, index=0, h_off=0, w_off=0):
    """ComfyUI's process_img at patch size 1: tokens "b c h w -> b (h w) c" and ids from linspace, 4 axes."""
    b, c, h, w = x.shape
    tokens = torch.stack([x[:, :, i, j] for i in range(h) for j in range(w)], dim=1)
    ids = torch.zeros(h, w, 4)
    ids[:, :, 0] = index
    ids[:, :, 1] = torch.linspace(h_off, h - 1 + h_off, steps=h).unsqueeze(1)
    ids[:, :, 2] = torch.linspace(w_off, w - 1 + w_off, steps=w).unsqueeze(0)
    return tokens, ids.reshape(h * w, 4)


def reference_velocity(model, x, sigma, cond, refs=(), method="index", guidance=3.5):
    b, c, h, w = x.shape
    if cond.shape[1] < TEXT:
        cond = F.pad(cond, (0, 0, TEXT - cond.shape[1], 0))
    txt_ids = torch.zeros(cond.shape[1], 4)
    txt_ids[:, 3] = torch.linspace(0, cond.shape[1] - 1, steps=cond.shape[1])
    tokens, ids = process_img(x)
    parts, all_ids = [tokens], [ids]
    for r, place in zip(refs, comfy_places(method, (h, w), [r.shape[-2:] for r in refs])):
        t, i = process_img(r.expand(b, -1, -1, -1), *place)
        parts.append(t)
        all_ids.append(i)
    g = torch.full((b,), float(guidance)) if model.config.guidance_embeds else None
    out = model(hidden_states=torch.cat(parts, 1), encoder_hidden_states=cond.expand(b, -1, -1),
                timestep=torch.full((b,), float(sigma)), img_ids=torch.cat(all_ids), txt_ids=txt_ids, guidance=g,
                return_dict=False)[0][:, :h * w]
    v = torch.empty_like(x)
    for n in range(h * w):
        v[:, :, n // w, n % w] = out[:, n]
    return v


def simple_sigmas(steps, shift=SHIFT):
    """ModelSamplingFlux's table (sigma(t) = e^mu / (e^mu + (1/t - 1)), t = k/10000, float32) and KSampler's
    "simple" scheduler: every (len/steps)-th entry from the top, then 0."""
    t = torch.arange(1, 10001) / 10000
    table = math.exp(shift) / (math.exp(shift) + (1 / t - 1))
    stride = len(table) / steps
    return torch.tensor([float(table[-(1 + int(k * stride))]) for k in range(steps)] + [0.0])


def flux2_scheduler_sigmas(steps, width, height):
    """ComfyUI's Flux2Scheduler (comfy_extras/nodes_flux.py, 6b573ae :210 / v0.12.1 :211, compute_empirical_mu and
    get_schedule): mu from the image's tokens (width x height / 256) and the steps; float32 t = linspace(1, 0,
    steps + 1), sigma = e^mu / (e^mu + (1/t - 1)), 0 at t = 0."""
    seq = round(width * height / 256)
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq > 4300:
        mu = a2 * seq + b2
    else:
        m200, m10 = a2 * seq + b2, a1 * seq + b1
        a = (m200 - m10) / 190.0
        mu = a * steps + (m200 - 200.0 * a)
    t = torch.linspace(1, 0, steps + 1)
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


@torch.no_grad()
def reference_sample(model, j, sigmas=None):
    """KSampler, euler on an empty latent (sigmas: the "simple" schedule unless given, e.g. Flux2Scheduler's): noise
    from the seed; CFG on denoised; process_out the identity."""
    x = torch.randn(j["latent_raw"].shape, generator=torch.Generator().manual_seed(j["seed"]))
    sigmas = simple_sigmas(STEPS) if sigmas is None else sigmas
    x = sigmas[0] * x
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        denoised = x - sigma * reference_velocity(model, x, sigma, j["cond"], j.get("reference_latents") or (),
                                                  j.get("reference_latents_method") or "index", j["guidance"])
        if j["cfg"] != 1.0:
            neg = x - sigma * reference_velocity(model, x, sigma, j["neg_cond"], j.get("neg_reference_latents") or (),
                                                 j.get("neg_reference_latents_method") or "index", j["guidance"])
            denoised = neg + j["cfg"] * (denoised - neg)
        x = x + (x - denoised) / sigma * (nxt - sigma)
    return x


def bound(reference, cfg, tokens, steps=STEPS):
    """Another process and another code path (packing, hooks, rank splits): fp32 summation order only. The longest
    dot product is the attention's over every token (text, image, references): at least 512."""
    return fp32_bound(reference.abs().max(), reduction=tokens, depth=DEPTH,
                      amplification=sampling_amplification(steps, cfg))


# ---- the model velocity, one process -----------------------------------------------------------------------------
VELOCITY = [("flux2-dev", 20, (), "index"), ("flux2-dev", 600, (), "index"), ("flux2-klein-4b", 20, (), "index"),
            ("flux2-dev", 20, [(4, 6)], "index"), ("flux2-dev", 20, [(4, 6), (7, 3)], "index"),
            ("flux2-klein-4b", 33, [(4, 6), (7, 3), (5, 5)], "index"), ("flux2-dev", 20, [(4, 6), (7, 3)], "offset"),
            ("flux2-dev", 20, [(4, 6), (7, 3)], "uxo")]


@pytest.mark.parametrize("variant,text,refs,method", VELOCITY, ids=lambda v: str(v))
def test_velocity_equals_comfyuis_formulas(models, diffusers_models, variant, text, refs, method):
    flow = FlowModel(load_model(models[variant]))
    x, cond = randn(3, (2, 128, 6, 5), (1, text, WIDTH[variant]))
    raw = randn(4, *[(1, 128, *s) for s in refs])
    sigma = torch.tensor(0.7)
    got = flow.velocity(x, sigma, flow.prepare([Conditioning(cond, None, 4.0, tuple(raw), method)], 2))
    with torch.no_grad():
        want = reference_velocity(diffusers_models[variant], x, sigma, cond, raw, method, 4.0)
    tokens = max(text, TEXT) + 30 + sum(h * w for h, w in refs)
    assert report(f"{variant} text {text}, references {refs} ({method}): velocity vs ComfyUI's formulas",
                  (got - want).abs().max(), fp32_bound(want.abs().max(), reduction=tokens, depth=DEPTH))
    if refs:   # the references steer the velocity, far beyond rounding
        without = flow.velocity(x, sigma, flow.prepare([Conditioning(cond, None, 4.0)], 2))
        changed = (got - without).abs().max()
        print(f"with vs without references, max abs diff {changed:.3g}")
        assert changed > 100 * fp32_bound(want.abs().max(), reduction=tokens, depth=DEPTH)


def test_dev_embeds_guidance_and_klein_ignores_it(models):
    """FluxGuidance moves [dev]'s velocity (guidance_in); [klein] has no guidance embedding: the value changes nothing
    (ComfyUI gives it to the model, which ignores it)."""
    diffs = {}
    for variant in ("flux2-dev", "flux2-klein-4b"):
        flow = FlowModel(load_model(models[variant]))
        x, cond = randn(5, (1, 128, 4, 4), (1, 12, WIDTH[variant]))
        a, b = (flow.velocity(x, torch.tensor(0.5), flow.prepare([Conditioning(cond, None, g)], 1)) for g in (2.0, 5.0))
        diffs[variant] = (a - b).abs().max().item()
    print(f"guidance 2 vs 5, max abs diff: {diffs}")
    assert diffs["flux2-dev"] > 1e-3 and diffs["flux2-klein-4b"] == 0.0


def test_the_text_is_zero_padded_in_front_to_512_tokens_and_never_truncated(models, diffusers_models):
    """A 20-token prompt gives what the same prompt with 492 zero tokens in front gives; 600 tokens stay 600."""
    flow = FlowModel(load_model(models["flux2-dev"]))
    x, cond = randn(6, (1, 128, 4, 4), (1, 20, 96))
    padded = torch.cat([torch.zeros(1, 492, 96), cond], dim=1)
    prepared = flow.prepare([Conditioning(cond, None, 3.5)], 1)
    assert prepared.cond.shape[1] == 512 and torch.equal(prepared.cond[:, 492:], cond)
    a = flow.velocity(x, torch.tensor(0.4), prepared)
    b = flow.velocity(x, torch.tensor(0.4), flow.prepare([Conditioning(padded, None, 3.5)], 1))
    assert torch.equal(a, b)
    long = randn(7, (1, 600, 96))[0]
    assert flow.prepare([Conditioning(long, None, 3.5)], 1).cond.shape[1] == 600


# ---- sampled latents on real ranks ------------------------------------------------------------------------------
def job(variant="flux2-dev", *, text=20, cfg=1.0, batch=1, refs=(), neg_refs=(), method="", hw=(8, 8), seed=5,
        neg_text=None):
    width = WIDTH[variant]
    cond, neg_cond = randn(11, (1, text, width), (1, neg_text or text, width))
    return dict(latent_raw=torch.zeros(batch, 128, *hw), cond=cond, neg_cond=neg_cond, cfg=cfg, seed=seed,
                guidance=4.0, reference_latents=randn(21, *[(1, 128, *s) for s in refs]) or None,
                neg_reference_latents=randn(31, *[(1, 128, *s) for s in neg_refs]) or None,
                reference_latents_method=method, neg_reference_latents_method=method)


def request(models, variant, j, plan=ParallelPlan(), **extra):
    return GenerateRequest(model=models[variant], steps=STEPS, sampler="euler", scheduler="simple", plan=plan,
                           **j, **extra).validate()


def run(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], result


def tokens_of(j):
    refs = sum(r.shape[-2] * r.shape[-1] for r in (j["reference_latents"] or ()))
    return max(j["cond"].shape[1], TEXT) + j["latent_raw"].shape[-2] * j["latent_raw"].shape[-1] + refs


# The tiny image is 8x8 latent pixels: 64 image tokens. References of 4x4 add 16 (80: split over 2 and 4 ranks), 5x3
# add 15 (79: joint). The text, padded to 512, splits over 2 and 4 ranks; 515 tokens stay joint. `gathered`: the
# output tokens a sequence-parallel rank sends per model call (its image shard plus its share of split references).
PLANS = [
    # variant, plan, job, gathered, what it covers
    ("flux2-dev", {}, dict(), None, "dev, one rank"),
    ("flux2-dev", {}, dict(refs=((4, 4), (5, 3))), None, "dev, one rank, two references"),
    ("flux2-klein-4b", {}, dict(cfg=4.0, text=30, neg_text=7), None, "klein base, one rank, real CFG"),
    ("flux2-dev", dict(ulysses=2), dict(), 32, "ulysses2, text split"),
    ("flux2-dev", dict(ulysses=2), dict(refs=((4, 4),)), 40, "ulysses2, references split"),
    ("flux2-dev", dict(ulysses=2), dict(refs=((5, 3),), text=515), 32, "ulysses2, references and text joint"),
    ("flux2-dev", dict(ring=2), dict(refs=((5, 3), (4, 4)), method="offset"), 32, "ring2, references joint"),
    ("flux2-dev", dict(ulysses=4), dict(refs=((4, 4),)), 20, "ulysses4, references split"),
    ("flux2-dev", dict(ulysses=2, ring=2), dict(text=515), 16, "ulysses2 x ring2, text joint"),
    ("flux2-klein-4b", dict(cfg=2), dict(cfg=4.0, neg_text=7, refs=((4, 4),)), None, "klein base cfg2"),
    ("flux2-klein-4b", dict(cfg=2, ulysses=2), dict(cfg=4.0, refs=((5, 3),), neg_refs=((4, 4),)), None,
     "klein base cfg2 x ulysses2, references joint on one side, split on the other"),
    ("flux2-dev", dict(dp=2), dict(batch=2, refs=((4, 4),)), None, "dp2, one reference for the batch"),
    # 9x7 = 63 image tokens: the last rank's shard padded with a copy of the last token, its keys dropped
    ("flux2-dev", dict(ulysses=2), dict(hw=(9, 7), refs=((4, 4),)), None, "ulysses2, 63 image tokens padded"),
    ("flux2-dev", dict(ulysses=2, ring=2), dict(hw=(9, 7)), None, "ulysses2 x ring2, 63 image tokens padded"),
]


@pytest.fixture(scope="module")
def one_rank(models, engines):
    """Each plan's job on one rank, run once."""
    seen = {}

    def get(variant, spec):
        key = (variant, repr(sorted(spec.items())))
        if key not in seen:
            seen[key] = run(engines, request(models, variant, job(variant, **spec)))[0]
        return seen[key]
    return get


@pytest.mark.parametrize("variant,plan,spec,gathered,what", PLANS, ids=[p[4] for p in PLANS])
def test_every_plan_equals_the_independent_reference_and_one_rank(models, diffusers_models, engines, one_rank,
                                                                  variant, plan, spec, gathered, what):
    j = job(variant, **spec)
    got, result = run(engines, request(models, variant, j, ParallelPlan(**plan)))
    want = reference_sample(diffusers_models[variant], j)
    limit = bound(want, j["cfg"], tokens_of(j))
    assert got.shape == want.shape == j["latent_raw"].shape
    assert report(f"{what}: latent vs ComfyUI-formula reference", (got - want).abs().max(), limit)
    if plan:
        assert report(f"{what}: latent vs one rank", (got - one_rank(variant, spec)).abs().max(), limit)
    if gathered is not None:   # one model call per step, [1, tokens, 128] fp32 to the other ranks
        sent = result.ranks[0]["bytes_sent_per_step"]["sp_gather"]
        print(f"sp_gather per step: {sent:.0f} bytes")
        assert sent == gathered * 128 * 4 * (math.prod(plan.values()) - 1)


# ---- the step cache -----------------------------------------------------------------------------------------------
NEVER = 1e-9     # no change of the model comes near: the cache runs, records and skips nothing


def test_a_step_cache_that_skips_nothing_is_exact(models, engines):
    j = job(refs=((5, 3),))
    plain, _ = run(engines, request(models, "flux2-dev", j, ParallelPlan(ulysses=2)))
    cached, result = run(engines, request(models, "flux2-dev", j, ParallelPlan(ulysses=2), cache_threshold=NEVER))
    print("step cache:", result.ranks[0]["step_cache"])
    assert result.ranks[0]["step_cache"]["model_calls"] == STEPS
    assert torch.equal(cached, plain)


def test_a_skipped_call_adds_the_cached_remainder_to_the_first_blocks_image_tokens(models, diffusers_models):
    """In process: calls a and b run every block (the decision is taken a call late: b measures the change that
    lets c skip); call c (another latent and sigma) runs the first block and skips. Its image tokens after the last
    block (a single block: text and image joined, the image at the end) must be the first block's image output plus
    what the other blocks added in call b, the last fully computed one. The reference records and replaces those
    tokens with hooks on the diffusers model driven by this module's reference."""
    from engine import families
    from engine.parallel.cache import StepCache
    flow = FlowModel(load_model(models["flux2-dev"]))
    cache = StepCache(flow.model, families.get("flux2").tokens.blocks, threshold=1e9)   # skips whatever changed
    xa, xb, xc, cond = randn(8, (1, 128, 4, 6), (1, 128, 4, 6), (1, 128, 4, 6), (1, 20, 96))
    prepared = flow.prepare([Conditioning(cond, None, 3.5)], 1)
    cache.use_stream("pos")
    flow.velocity(xa, torch.tensor(0.8), prepared)
    flow.velocity(xb, torch.tensor(0.6), prepared)
    got = flow.velocity(xc, torch.tensor(0.4), prepared)
    assert cache.stats.skipped_at == [2]
    cache.close()

    model, n = diffusers_models["flux2-dev"], 24
    seen = {}
    first, last = model.transformer_blocks[0], model.single_transformer_blocks[-1]
    handles = [first.register_forward_hook(lambda m, a, out: seen.__setitem__("first", out[1])),
               last.register_forward_hook(lambda m, a, out: seen.__setitem__("last", out[:, -n:]))]
    with torch.no_grad():
        reference_velocity(model, xb, 0.6, cond)
        remainder = seen["last"] - seen["first"]
        handles.pop().remove()
        handles.append(last.register_forward_hook(
            lambda m, a, out: torch.cat([out[:, :-n], seen["first"] + remainder], dim=1)))
        want = reference_velocity(model, xc, 0.4, cond)
    for h in handles:
        h.remove()
    assert report("skipped call vs first block + cached remainder", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=TEXT + n, depth=DEPTH))


def test_a_skipping_step_cache_takes_the_same_path_on_one_and_on_two_ranks(models, engines):
    """12 steps; the threshold sits in the widest gap below 1 between the first block's changes (recorded by a cache
    that skips nothing), so some calls skip and the nearest change is far from it; every rank of ring2 takes one rank's
    decisions and lands on its latent."""
    j, steps = job(), 12

    def cached(plan, threshold):
        r = GenerateRequest(model=models["flux2-dev"], steps=steps, plan=plan, cache_threshold=threshold, **j)
        return run(engines, r.validate())
    _, recorded = cached(ParallelPlan(), NEVER)
    changes = sorted(c for c in recorded.ranks[0]["step_cache"]["changes"] if c is not None)
    print(f"changes without skipping: {changes}")
    low, high = max(zip(changes, changes[1:] + [1.0]), key=lambda pair: min(pair[1], 1.0) - pair[0])
    threshold = (low + min(high, 1.0)) / 2   # a job's threshold is at most 1
    one, result = cached(ParallelPlan(), threshold)
    two, result2 = cached(ParallelPlan(ring=2), threshold)
    skipped = [r["step_cache"]["skipped_at"] for r in result.ranks + result2.ranks]
    margin = min(abs(c - threshold) for c in result.ranks[0]["step_cache"]["changes"] if c is not None)
    print(f"threshold {threshold:.3f}: skipped calls per rank {skipped}, nearest change {margin:.3f} away")
    assert skipped[0] and all(s == skipped[0] for s in skipped) and margin > 1e-3
    assert report("skipping cache, ring2 vs one rank", (two - one).abs().max(), bound(one, 1.0, tokens_of(j), steps))


# ---- PipeFusion: stage-only loading, patches, real ranks --------------------------------------------------------
SHARED = ("time_guidance_embed.", "double_stream_modulation_img.", "double_stream_modulation_txt.",
          "single_stream_modulation.")


def test_a_stage_holds_its_blocks_and_the_shared_modulations_every_block_needs(models):
    from engine.models.load import held_bytes
    from engine.parallel.pipefusion.layout import make_layout, stage_keep
    full = load_model(models["flux2-dev"])
    info, state = full.info, full.model.state_dict()
    layout = make_layout(info, ParallelPlan(pipefusion=2), 8, 8, None, 1, None)
    total = 0
    for stage in range(2):
        keep = stage_keep(info, layout, stage)
        part = load_model(models["flux2-dev"], keep=keep)
        held = {n for n, t in part.model.state_dict().items() if not t.is_meta}
        assert held == {n for n in state if keep(n)}
        assert all(any(n.startswith(p) for n in held) for p in SHARED)
        assert ("x_embedder.weight" in held, "proj_out.weight" in held) == (stage == 0, stage == 1)
        assert all(torch.equal(part.model.state_dict()[n], state[n]) for n in held)
        assert part.stats["bytes_read"] < full.stats["bytes_read"]
        total += held_bytes(part.model)
        print(f"stage {stage}: blocks {list(layout.blocks_of(stage))}, held {held_bytes(part.model)} of "
              f"{held_bytes(full.model)} bytes")
    shared = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith(SHARED))
    assert total == held_bytes(full.model) + shared   # only the shared modulations are held twice


def test_patches_with_fresh_kv_equal_the_whole_call_and_the_whole_call_equals_the_model(models):
    """The patch path is exact: PipeFusion's only approximation is the age of the other patches' K/V."""
    from engine.parallel.mesh import Mesh
    from engine.parallel.pipefusion.layout import Layout, split_rows
    from engine.parallel.pipefusion.pipeline import Pipeline
    flow = FlowModel(load_model(models["flux2-dev"]))
    layout = Layout(1, 4, 1, 8, 6, tuple(split_rows(8, 4)), (8,), 1)
    x, cond = randn(9, (1, 128, 8, 6), (1, 20, 96))
    pos = Conditioning(cond, None, 3.5)
    reference = flow.velocity(x, torch.tensor(0.6), flow.prepare([pos], 1))
    pipeline = Pipeline(flow, Mesh(ParallelPlan(), 0, 1))
    try:
        pipeline.setup(layout)
        pipeline.bind(pos, None, x.shape, 1.0)
        whole = pipeline.model.unpatch(pipeline.compute(None, 0.6, x, None)[0], None)
        limit = fp32_bound(reference.abs().max(), reduction=TEXT + 48, depth=DEPTH)
        assert report("stage forward vs diffusers forward", (whole - reference).abs().max(), limit)
        for m in range(layout.patches):
            rows = pipeline.model.latent_rows(m)
            patch = pipeline.model.unpatch(pipeline.compute(m, 0.6, x[:, :, rows], None)[0], m)
            assert report(f"patch {m} with fresh K/V vs the whole call", (patch - whole[:, :, rows]).abs().max(),
                          limit)
    finally:
        pipeline.close()


@pytest.mark.parametrize("variant,plan,spec", [
    ("flux2-dev", dict(pipefusion=2), dict()),
    ("flux2-dev", dict(pipefusion=4), dict(text=515)),
    ("flux2-dev", dict(pipefusion=2, ulysses=2), dict()),
    ("flux2-klein-4b", dict(pipefusion=2, cfg=2), dict(cfg=4.0, neg_text=7)),
], ids=lambda v: str(v))
def test_pipefusion_with_warmup_over_every_step_equals_one_rank(models, diffusers_models, engines, one_rank, variant,
                                                                plan, spec):
    j = job(variant, **spec)
    got, result = run(engines, request(models, variant, j, ParallelPlan(**plan), warmup_steps=STEPS))
    want = reference_sample(diffusers_models[variant], j)
    limit = bound(want, j["cfg"], tokens_of(j))
    assert report(f"{ParallelPlan(**plan).describe()} W=steps vs reference", (got - want).abs().max(), limit)
    assert report(f"{ParallelPlan(**plan).describe()} W=steps vs one rank", (got - one_rank(variant, spec)).abs().max(),
                  limit)
    stage = result.ranks[0]["pipefusion"]
    print(f"stage 0 holds {stage['held_bytes']} bytes, blocks {stage['blocks']}")
    assert stage["held_bytes"] < result.ranks[0]["loaded"]["bytes_read"] * 2


def test_pipefusion_with_one_warmup_step_stays_close_and_closes_in_as_steps_shrink(models, engines):
    """Stale K/V is first order in the step: the relative L2 to the exact latent falls by half or more at 4x the
    steps (as for FLUX.1, tests/test_pipefusion.py)."""
    rel = {}
    for steps in (3, 12):
        j = job()
        exact, _ = run(engines, GenerateRequest(model=models["flux2-dev"], steps=steps, **j).validate())
        approx, _ = run(engines, GenerateRequest(model=models["flux2-dev"], steps=steps, warmup_steps=1, patches=4,
                                                 plan=ParallelPlan(pipefusion=2), **j).validate())
        rel[steps] = float((approx - exact).norm() / exact.norm())
        print(f"pipefusion2 W=1, {steps} steps: relative L2 {rel[steps]:.4f}")
    assert rel[3] <= 0.15 and rel[12] <= rel[3] / 2


# ---- compile and fp8 weights ---------------------------------------------------------------------------------------
def test_compiled_blocks_match_eager_and_keep_working_under_the_step_cache(models, engines):
    j = job()
    eager, _ = run(engines, request(models, "flux2-dev", j))
    compiled, result = run(engines, request(models, "flux2-dev", j, compile=True))
    cached, _ = run(engines, request(models, "flux2-dev", j, compile=True, cache_threshold=NEVER))
    back, _ = run(engines, request(models, "flux2-dev", j))
    print(f"compiled graphs: {result.ranks[0]['compiled_graphs']}")
    assert result.ranks[0]["compiled_graphs"] > 0
    assert report("compiled vs eager", (compiled - eager).abs().max(), bound(eager, 1.0, tokens_of(j)))
    assert torch.equal(cached, compiled) and torch.equal(back, eager)


def test_fp8_weights_equal_the_reference_with_its_matrices_rounded_to_fp8(models, diffusers_models, engines):
    """fp8_weights stores every Linear weight in float8_e4m3fn (ComfyUI's fp8 weight dtype) and casts it per call:
    the reference model with each Linear weight rounded through fp8 computes the same."""
    import copy
    j = job(refs=((4, 4),))
    got, result = run(engines, request(models, "flux2-dev", j, ParallelPlan(ulysses=2), fp8_weights=True))
    rounded = copy.deepcopy(diffusers_models["flux2-dev"])
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.to(torch.float8_e4m3fn).float())
    want = reference_sample(rounded, j)
    plain = reference_sample(diffusers_models["flux2-dev"], j)
    print(f"fp8 rounding moves the latent by {(want - plain).abs().max():.3g}; fp8 linears "
          f"{result.ranks[0]['loaded']['fp8_linears']}")
    assert report("fp8 weights ulysses2 vs fp8-rounded reference", (got - want).abs().max(),
                  bound(want, 1.0, tokens_of(j)))


# ---- the planner: FLUX.2's real dimensions ----------------------------------------------------------------------
def meta_model(**config):
    from diffusers import Flux2Transformer2DModel
    with torch.device("meta"):
        return Flux2Transformer2DModel(**config)


FULL = {"flux2-dev": {}, "flux2-klein-4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24,
                                                joint_attention_dim=7680, guidance_embeds=False),
        "flux2-klein-9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                               guidance_embeds=False)}   # diffusers' defaults; scripts/convert_flux2_to_diffusers.py


@pytest.mark.parametrize("variant", sorted(FULL))
def test_each_token_meets_13_hidden_squared_weights_per_block_and_the_planner_counts_the_real_model(variant):
    from engine.models.load import inspect_model
    model = meta_model(**FULL[variant])
    h = model.inner_dim
    single = sum(p.numel() for p in model.single_transformer_blocks[0].parameters() if p.ndim == 2)
    double = sum(p.numel() for p in model.transformer_blocks[0].parameters() if p.ndim == 2)
    info = inspect_model(f"synthetic:{variant}")
    params = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for n, p in model.named_parameters() if "transformer_blocks." in n)
    print(f"{variant}: single block {single / 1e6:.2f} M = {single / h ** 2:g} h^2, double {double / 1e6:.2f} M; "
          f"{params:,} parameters ({info.parameters:,} counted from the BFL layout), {blocks:,} in blocks")
    assert single == 13 * h * h and double == 2 * 13 * h * h and info.spec.linear_width == 13
    assert (info.parameters, info.block_parameters) == (params, blocks)


def test_the_cost_models_flops_equal_a_count_over_the_models_matrices():
    """FLUX.2 [dev] at 1024^2: 4096 image + 512 text tokens. Counted here: 2 x weights x the tokens each matrix
    sees (a double block's text-stream matrices the text, the others the image; single blocks all), plus 4 x S^2 x
    width of attention per block. The cost model counts the blocks only (embedders and final layer: 0.1%)."""
    from engine.parallel import cost
    from engine.parallel.plan import Workload
    model, image, text = meta_model(), 4096, 512
    flops = 0.0
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        double = hasattr(block, "ff_context")
        for name, p in block.named_parameters():
            if p.ndim == 2:
                text_side = double and ("context" in name or "add_" in name)
                flops += 2 * p.numel() * (text if text_side else image if double else image + text)
        flops += 4 * (image + text) ** 2 * model.inner_dim
    planned = cost.step_tflop(Workload.for_variant("flux2-dev")) * 1e12
    print(f"flux2-dev 1024^2: counted {flops / 1e12:.1f} TFLOP per step, cost model {planned / 1e12:.1f} "
          f"(residual {planned / flops - 1:+.2%})")
    assert abs(planned / flops - 1) < 1e-3


# A 48 GB workstation card, a 24 GB consumer card, and a 24 GB card's speed with 16 GB (4060 Ti / 4080 class)
FIT_HARDWARE = [(2, "RTX 6000 Ada", 48), (4, "RTX 4090", 24), (4, "RTX 4090", 16)]
FIT_WEIGHTS = {"bf16": {}, "fp8": dict(fp8_weights=True), "GGUF Q4_K": dict(bytes_per_weight=144 / 256)}


def test_the_planner_says_which_plans_fit_flux2_dev_on_the_gpus_people_own():
    """FLUX.2 [dev] at 1024^2, 28 steps, over PCIe: the plan auto picks on 2x48, 4x24 and 4x16 GB in bf16, fp8 and
    GGUF Q4_K, or that none fits. Checked against bounds from the diffusers model's parameter counts alone: a plan
    that keeps the whole model (no PipeFusion) needs every weight on each GPU, a PipeFusion stage at least its
    share of the blocks plus the shared layers, a plan dividing the weights N ways 1/N of them plus the shared layers
    and two blocks whole; nothing fits only where even the smallest share does not."""
    from engine.errors import PlanError
    from engine.parallel import cost
    from engine.parallel.devices import stated_hardware
    from engine.parallel.plan import AUTO, GiB, Workload
    from engine.parallel.planner import resolve_plan
    model = meta_model()
    params = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for n, p in model.named_parameters() if "transformer_blocks." in n)
    rows = ["| GPUs | weights | plan auto picks | est. s/image | GiB per GPU (est.) | weights per GPU (bound) |",
            "|---|---|---|---|---|---|"]
    for gpus, name, memory in FIT_HARDWARE:
        hw = stated_hardware(gpus, name, "pcie", memory_gib=memory)
        for label, option in FIT_WEIGHTS.items():
            per = option.get("bytes_per_weight", 1 if option else 2)
            work = Workload.for_variant("flux2-dev", steps=28, **option)
            smallest = ((params - blocks) + blocks / gpus) * per / GiB   # the most stages there can be
            try:
                plan = resolve_plan(AUTO, gpus, work, hw).plan
            except PlanError as e:
                print(f"{gpus}x{memory} GB {label}: {e}")
                rows.append(f"| {gpus}x {memory} GB | {label} | none fits | - | - | >= {smallest:.1f} |")
                assert smallest + 1.0 > memory   # not even the weights' share and a runtime fit
                continue
            e = cost.estimate(plan, work, hw)
            share = (params - blocks + blocks / plan.pipefusion) * per / GiB
            if plan.shard > 1:
                units = len({".".join(n.split(".")[:2]) for n, _ in model.named_parameters()
                             if "transformer_blocks." in n})
                share = (params / plan.shard + params - blocks + 2 * blocks / units) * per / GiB
            rows.append(f"| {gpus}x {memory} GB | {label} | {plan.describe()} | {e.s_per_image:.1f} | "
                        f"{e.memory['total']:.1f} | {share:.1f} |")
            assert e.fits and share < e.memory["total"] <= memory
    print("\n".join(rows))


# ---- files: the BFL layout, detection, diffusers folders ----------------------------------------------------------
def bfl_state(path):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def diffusers_converted(state, variant):
    """diffusers' own single-file converter (loaders/single_file_utils.py) on a BFL state dict, into a diffusers
    model of the tiny dims: the reference for the engine's key map."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from engine.families.flux2 import DIMS
    d = DIMS["tiny"][variant]
    model = meta_model(num_layers=d.depth, num_single_layers=d.depth_single, attention_head_dim=d.head_dim,
                       num_attention_heads=d.heads, joint_attention_dim=d.context_in, guidance_embeds=d.guidance_embed,
                       axes_dims_rope=d.axes_dim).to_empty(device="cpu")
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(state))
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert (missing, unexpected) == ([], [])
    return model.eval()


@pytest.mark.parametrize("variant,tensors", [("flux2-dev", 299), ("flux2-klein-4b", 149), ("flux2-klein-9b", 201)])
def test_the_full_size_bfl_layout_converts_exactly_into_the_diffusers_transformer(variant, tensors):
    """The BFL key/shape table at full size (on the meta device) through diffusers' converter: exactly the diffusers
    model's state dict, nothing left over; 299 / 149 / 201 tensors as BFL's and ComfyUI's files hold."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from engine.models.tiny import shapes_for
    from engine.families.flux2 import DIMS
    shapes = shapes_for(variant, DIMS["full"][variant])
    checkpoint = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    converted = convert_flux2_transformer_checkpoint_to_diffusers(checkpoint)
    expected = {k: tuple(v.shape) for k, v in meta_model(**FULL[variant]).state_dict().items()}
    assert len(shapes) == tensors and checkpoint == {}
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected


@pytest.mark.parametrize("variant", ["flux2-dev", "flux2-klein-9b"])
def test_make_tiny_writes_the_bfl_layout_and_the_engine_loads_what_diffusers_converter_makes_of_it(tmp_path, variant):
    import subprocess
    import sys
    from conftest import ROOT
    from engine.models.tiny import shapes_for
    out = subprocess.run([sys.executable, "-m", "engine", "make-tiny", "--kind", "flux2", "--variant", variant,
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    path = out.stdout.splitlines()[0].split()[1]
    state = bfl_state(path)
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes_for(variant)
    assert "double_blocks.0.img_attn.qkv.weight" in state and "final_layer.adaLN_modulation.1.weight" in state
    loaded = load_model(path)
    assert (loaded.info.family, loaded.info.variant, loaded.info.layout) == ("flux2", variant, "bfl")
    want = diffusers_converted(state, variant).state_dict()
    got = loaded.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_flux1_and_flux2_files_are_told_apart_in_every_layout_and_prefix(tmp_path):
    from engine.models.load import inspect_model
    cases = {write_tiny("flux", str(tmp_path / "a")): ("flux", "flux-dev"),
             write_tiny("flux2", str(tmp_path / "b")): ("flux2", "flux2-dev"),
             write_tiny("flux2", str(tmp_path / "c"), variant="flux2-klein-4b", prefix=True):
                 ("flux2", "flux2-klein-4b"),
             write_tiny("flux2", str(tmp_path / "d"), full=True): ("flux2", "flux2-dev"),
             write_tiny("flux2", str(tmp_path / "e"), format="gguf"): ("flux2", "flux2-dev")}
    for path, want in cases.items():
        info = inspect_model(path)
        print(f"{path.rsplit('/', 1)[1]}: {info.family} {info.variant} {info.layout} {info.prefix!r} {info.format}")
        assert (info.family, info.variant) == want


def test_a_diffusers_folder_loads_the_same_weights(models, tmp_path):
    """What diffusers' save_pretrained writes (config.json and diffusion_pytorch_model.safetensors) for the model
    its converter made of the BFL file."""
    model = diffusers_converted(bfl_state(models["flux2-klein-4b"]), "flux2-klein-4b")
    model.save_pretrained(str(tmp_path / "transformer"))
    loaded = load_model(str(tmp_path))
    assert (loaded.info.family, loaded.info.variant, loaded.info.layout) == ("flux2", "flux2-klein-4b", "diffusers")
    want, got = model.state_dict(), loaded.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---- LoRAs in the formats people share --------------------------------------------------------------------------
LORA_LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_attn.qkv", "double_blocks.1.txt_mlp.0",
               "double_blocks.2.img_attn.proj", "single_blocks.2.linear1", "single_blocks.3.linear2",
               "final_layer.adaLN_modulation.1", "txt_in", "double_stream_modulation_img.lin"]
RANK, ALPHA = 4, 8.0


def lora_factors(state):
    g = torch.Generator().manual_seed(17)
    out = {}
    for layer in LORA_LAYERS:
        n_out, n_in = state[layer + ".weight"].shape
        out[layer] = (torch.randn(RANK, n_in, generator=g) * 0.1, torch.randn(n_out, RANK, generator=g) * 0.1)
    return out


def diffusers_names(layer, h):
    """(diffusers layer, rows of the BFL layer it takes, swapped halves) for each target of a BFL layer."""
    import re
    m = re.fullmatch(r"double_blocks\.(\d+)\.(img|txt)_attn\.qkv", layer)
    if m:
        names = ("to_q", "to_k", "to_v") if m.group(2) == "img" else ("add_q_proj", "add_k_proj", "add_v_proj")
        return [(f"transformer_blocks.{m.group(1)}.attn.{n}", slice(i * h, (i + 1) * h), False)
                for i, n in enumerate(names)]
    fixed = {"double_blocks.1.txt_mlp.0": "transformer_blocks.1.ff_context.linear_in",
             "double_blocks.2.img_attn.proj": "transformer_blocks.2.attn.to_out.0",
             "single_blocks.2.linear1": "single_transformer_blocks.2.attn.to_qkv_mlp_proj",
             "single_blocks.3.linear2": "single_transformer_blocks.3.attn.to_out",
             "final_layer.adaLN_modulation.1": "norm_out.linear", "txt_in": "context_embedder",
             "double_stream_modulation_img.lin": "double_stream_modulation_img.linear"}
    return [(fixed[layer], slice(None), layer.startswith("final_layer"))]


def write_loras(directory, state, h):
    """The same deltas as ai-toolkit / BFL names (lora_A/B, no alpha: scale 1, so B carries alpha / rank), kohya /
    musubi (lora_down/up/alpha, underscored) and diffusers / PEFT (lora_A/B on diffusers' modules: a fused qkv as
    q, k, v with A copied and B split, adaLN's halves swapped as diffusers orders them)."""
    from safetensors.torch import save_file
    factors, scale = lora_factors(state), ALPHA / RANK
    ai, kohya, peft = {}, {}, {}
    for layer, (a, b) in factors.items():
        ai[f"diffusion_model.{layer}.lora_A.weight"] = a
        ai[f"diffusion_model.{layer}.lora_B.weight"] = b * scale
        k = "lora_unet_" + layer.replace(".", "_")
        kohya.update({f"{k}.lora_down.weight": a, f"{k}.lora_up.weight": b, f"{k}.alpha": torch.tensor(ALPHA)})
        for name, rows, swap in diffusers_names(layer, h):
            up = b[rows] * scale
            if swap:
                up = torch.cat(up.chunk(2)[::-1])
            peft[f"base_model.model.{name}.lora_A.weight"] = a.clone()
            peft[f"base_model.model.{name}.lora_B.weight"] = up
    paths = {}
    for fmt, tensors in (("ai-toolkit", ai), ("kohya", kohya), ("peft", peft)):
        paths[fmt] = str(directory / f"{fmt}.safetensors")
        save_file(tensors, paths[fmt])
    return paths, factors


def test_loras_in_every_shared_format_equal_the_reference_with_the_delta_merged_into_the_bfl_weights(models, engines,
                                                                                                      tmp_path):
    """The reference merges W + B A alpha / rank into the BFL weights and converts them with diffusers' converter;
    each format's file, through the engine, gives its latent (one on two ranks)."""
    state = bfl_state(models["flux2-dev"])
    paths, factors = write_loras(tmp_path, state, 128)
    merged = dict(state)
    for layer, (a, b) in factors.items():
        merged[layer + ".weight"] = state[layer + ".weight"] + (b @ a) * (ALPHA / RANK)
    reference_model = diffusers_converted(merged, "flux2-dev")
    j = job()
    want = reference_sample(reference_model, j)
    base, _ = run(engines, request(models, "flux2-dev", j))
    for fmt, plan in (("ai-toolkit", ParallelPlan(ulysses=2)), ("kohya", ParallelPlan()), ("peft", ParallelPlan())):
        got, result = run(engines, request(models, "flux2-dev", j, plan, loras=[(paths[fmt], 1.0)]))
        print(f"{fmt}: {result.ranks[0].get('lora_layers_touched')} layers touched; the LoRA moves the latent by "
              f"{(got - base).abs().max():.3g}")
        assert report(f"{fmt} LoRA on {plan.describe()} vs merged reference", (got - want).abs().max(),
                      bound(want, 1.0, tokens_of(j)))
        assert (got - base).abs().max() > 100 * bound(want, 1.0, tokens_of(j))


# ---- quantized files: ComfyUI's mixed-precision fp8 and GGUF ------------------------------------------------------
def plain_copy(path, out):
    """The weights a quantized file stores, dequantized into a plain fp32 safetensors file, independently of the
    engine: fp8 x weight_scale for ComfyUI's mixed layers (comfy/ops.py), gguf's own numpy dequantization."""
    import gguf
    import numpy as np
    from safetensors.torch import save_file
    weights = {}
    if path.endswith(".gguf"):
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
            weights[t.name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
                tuple(int(d) for d in reversed(t.shape.tolist())))
        field = reader.get_field("xdit.synthetic")
        metadata = {"xdit.synthetic": str(bytes(field.parts[field.data[-1]]), "utf-8")}
    else:
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            raw, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
        metadata.pop("_quantization_metadata", None)
        for name, t in raw.items():
            if name.endswith((".weight_scale", ".input_scale", ".comfy_quant")):
                continue
            scale = raw.get(name[:-len("weight")] + "weight_scale") if name.endswith(".weight") else None
            weights[name] = t.float() * scale.float() if scale is not None else t.float()
    save_file(weights, out, metadata=metadata)
    return out


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """{name: (quantized file, its plain dequantized copy)}."""
    import json
    from safetensors.torch import save_file
    from engine.models.tiny import make_state_dict, mixed_fp8
    d = tmp_path_factory.mktemp("flux2-quantized")
    files = {"fp8_mixed": write_tiny("flux2", str(d), format="fp8_mixed"),
             "gguf Q8_0": write_tiny("flux2", str(d), format="gguf", quant="Q8_0"),
             "gguf Q4_K": write_tiny("flux2", str(d), format="gguf", quant="Q4_K")}
    # as files saved by newer ComfyUI: each quantized layer's format in a comfy_quant tensor, not the header
    tensors, _ = mixed_fp8(make_state_dict("flux2-dev"), comfy_quant=True)
    files["fp8_mixed comfy_quant"] = str(d / "tiny-flux2-dev-comfy_quant.safetensors")
    synthetic = json.dumps({"variant": "flux2-dev", "seed": 0, "dims": dataclasses.asdict(
        __import__("engine.families.flux2", fromlist=["DIMS"]).DIMS["tiny"]["flux2-dev"])})
    save_file(tensors, files["fp8_mixed comfy_quant"], metadata={"format": "pt", "xdit.synthetic": synthetic})
    return {k: (p, plain_copy(p, str(d / f"{k.replace(' ', '-')}.plain.safetensors"))) for k, p in files.items()}


@pytest.mark.parametrize("name,plan", [("fp8_mixed", ParallelPlan()), ("fp8_mixed comfy_quant", ParallelPlan(ring=2)),
                                       ("gguf Q8_0", ParallelPlan()), ("gguf Q4_K", ParallelPlan(ulysses=2))],
                         ids=lambda v: str(v))
def test_a_quantized_file_gives_the_latent_of_its_dequantized_plain_copy_and_holds_quantized_bytes(quantized, engines,
                                                                                                   name, plan):
    from engine.models.load import inspect_model
    path, plain = quantized[name]
    j = job(refs=((4, 4),))
    want, plain_result = run(engines, GenerateRequest(model=plain, steps=STEPS, plan=plan, **j).validate())
    got, result = run(engines, GenerateRequest(model=path, steps=STEPS, plan=plan, **j).validate())
    info, loaded = inspect_model(path), result.ranks[0]["loaded"]
    held, plain_held = loaded["held_bytes"], plain_result.ranks[0]["loaded"]["held_bytes"]
    print(f"{name}: {info.format} {info.quantization}; {info.quantized_parameters} parameters in "
          f"{info.quantized_bytes} bytes; held {held} vs plain {plain_held}; scaled linears "
          f"{loaded['scaled_linears']}, gguf linears {loaded['gguf_linears']}")
    assert info.family == "flux2" and info.stored_fp8 and held < plain_held / 2
    assert loaded["scaled_linears" if "fp8" in name else "gguf_linears"] > 0
    assert report(f"{name} on {plan.describe()} vs its plain copy", (got - want).abs().max(),
                  bound(want, 1.0, tokens_of(j)))


def test_a_mixed_precision_layer_in_a_format_other_than_fp8_is_refused_in_one_line(quantized, tmp_path):
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    from engine.models.safetensors_file import CheckpointError
    src, _ = quantized["fp8_mixed"]
    with safe_open(src, "pt") as f:
        raw, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    layers = json.loads(metadata["_quantization_metadata"])
    layers["layers"]["double_blocks.0.img_attn.qkv"] = {"format": "nvfp4"}
    header = str(tmp_path / "nvfp4.safetensors")
    save_file(raw, header, metadata=dict(metadata, _quantization_metadata=json.dumps(layers)))
    second = str(tmp_path / "scale2.safetensors")
    save_file(dict(raw, **{"single_blocks.0.linear1.weight_scale_2": torch.ones(())}), second, metadata=metadata)
    per_layer = str(tmp_path / "comfy_quant.safetensors")   # the format in the layer's comfy_quant tensor
    quant = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    save_file(dict(raw, **{"double_blocks.1.txt_mlp.0.comfy_quant": quant}), per_layer, metadata=metadata)
    for path, words in ((header, "layer double_blocks.0.img_attn.qkv is quantized as 'nvfp4'"),
                        (second, "layer single_blocks.0.linear1 is quantized in a format other than fp8"),
                        (per_layer, "layer double_blocks.1.txt_mlp.0 is quantized as 'nvfp4'")):
        with pytest.raises(CheckpointError) as e:
            load_model(path)
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_pipefusion_stage_of_a_gguf_file_holds_only_its_blocks_quantized(quantized, engines, one_rank):
    from engine.models.quantized import GGUFLinear
    from engine.parallel.pipefusion.layout import make_layout, stage_keep
    path, _ = quantized["gguf Q4_K"]
    full = load_model(path)
    layout = make_layout(full.info, ParallelPlan(pipefusion=2), 8, 8, None, 1, None)
    for stage in range(2):
        part = load_model(path, keep=stage_keep(full.info, layout, stage))
        layers = [m for m in part.model.modules() if isinstance(m, GGUFLinear) and not m.weight.is_meta]
        print(f"stage {stage}: {len(layers)} GGUF layers, held {part.stats['held_bytes']} of "
              f"{full.stats['held_bytes']} bytes")
        assert layers and part.stats["held_bytes"] < full.stats["held_bytes"]
    j = job()
    reference, _ = run(engines, GenerateRequest(model=path, steps=STEPS, **j).validate())
    got, _ = run(engines, GenerateRequest(model=path, steps=STEPS, plan=ParallelPlan(pipefusion=2),
                                          warmup_steps=STEPS, **j).validate())
    assert report("GGUF Q4_K pipefusion2 W=steps vs one rank", (got - reference).abs().max(),
                  bound(reference, 1.0, tokens_of(j)))


# ---- the node path --------------------------------------------------------------------------------------------------
def test_a_comfyui_flux2_conditioning_and_an_sd3_empty_latent_reach_the_engine_through_the_sampler_node(
        models, diffusers_models):
    """What ComfyUI's FLUX.2 nodes put out: CLIPTextEncode (flux2 text encoder) -> [[cond, {"pooled_output": None,
    "attention_mask": ...}]], ReferenceLatent x2 -> "reference_latents", FluxGuidance -> "guidance"; a LATENT from
    EmptySD3LatentImage (16 channels at 1/8, "downscale_ratio_spacial": 8) is the empty FLUX.2 latent of that image
    (comfy.sample.fix_empty_latent_channels). The sampler's latent equals the reference; Info describes the job."""
    import importlib
    from conftest import PACK_NAME, load_pack
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    j = job(refs=((4, 4), (5, 3)))
    positive = [[j["cond"], {"pooled_output": None, "attention_mask": torch.ones(1, j["cond"].shape[1]),
                             "reference_latents": list(j["reference_latents"]), "guidance": 4.0}]]
    latent = {"samples": torch.zeros(1, 16, 16, 16), "downscale_ratio_spacial": 8}
    settings = core.EngineSettings(model_path=models["flux2-dev"], gpus=(0, 1), device="cpu", plan="explicit",
                                   ulysses=2)
    registry = core.EngineRegistry()
    try:
        got = core.sample(settings, positive, positive, latent, seed=5, steps=STEPS, cfg=1.0, sampler_name="euler",
                          scheduler="simple", denoise=1.0, registry=registry)["samples"]
        info = core.describe(settings, registry)
    finally:
        registry.unload()
    print(info)
    want = reference_sample(diffusers_models["flux2-dev"], j)
    assert got.shape == (1, 128, 8, 8)
    assert report("node, ulysses2, two references vs reference", (got - want).abs().max(),
                  bound(want, 1.0, tokens_of(j)))
    assert "last job: plan ulysses2" in info


def test_the_guider_runs_flux2_schedulers_sigmas_one_engine_call_a_step_and_equals_the_reference(models,
                                                                                                  diffusers_models):
    """ComfyUI's FLUX.2 templates sample with SamplerCustomAdvanced: Flux2Scheduler's sigmas (mu from the image and
    the steps) and a sampler speaking ComfyUI's protocol (tests/test_model_route.py's stand-ins), here on the xDiT
    Engine's MODEL on ulysses2 with FluxGuidance 4 and two ReferenceLatent images: one engine call per step, and the
    latent equals the reference's euler over the same sigmas."""
    import importlib
    import test_model_route
    from conftest import PACK_NAME, load_pack
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    j = job(refs=((4, 4), (5, 3)))
    positive = [[j["cond"], {"pooled_output": None, "reference_latents": list(j["reference_latents"]),
                             "guidance": 4.0}]]
    sigmas = flux2_scheduler_sigmas(STEPS, 128, 128)
    noise = torch.randn(j["latent_raw"].shape, generator=torch.Generator().manual_seed(j["seed"]))
    settings = core.EngineSettings(model_path=models["flux2-dev"], gpus=(0, 1), device="cpu", plan="explicit",
                                   ulysses=2)
    try:
        model = test_model_route.engine_model(core, settings, "flux2", "flux2-dev")
        got = test_model_route.ksampler(model, "flux2", positive, None, 1.0, noise, j["latent_raw"], sigmas,
                                        seed=j["seed"])
        plan, calls, _ = test_model_route.last_job(core, settings)
    finally:
        core.REGISTRY.unload()
    want = reference_sample(diffusers_models["flux2-dev"], j, sigmas)
    print(f"Flux2Scheduler sigmas at 128x128, {STEPS} steps: {[round(float(x), 4) for x in sigmas]}")
    assert calls == STEPS and plan == "ulysses2"
    assert report("MODEL route, Flux2Scheduler sigmas, ulysses2, two references vs reference", (got - want).abs().max(),
                  bound(want, 1.0, tokens_of(j)))


# ---- the command line -----------------------------------------------------------------------------------------------
def test_generate_takes_two_reference_latents_from_the_cond_file_and_equals_the_reference(models, diffusers_models,
                                                                                         tmp_path):
    """`python -m engine generate` with a cond file holding cond, ref_0 and ref_1 (ReferenceLatent's latents in
    chain order) and --guidance 4 on two ranks (ulysses2): the LATENT file equals the reference sampler's, 128
    channels at 1/16 of the --width x --height image."""
    import subprocess
    import sys
    from safetensors.torch import load_file, save_file
    from conftest import ROOT
    j = job(refs=((4, 4), (5, 3)))
    save_file({"cond": j["cond"], "ref_0": j["reference_latents"][0], "ref_1": j["reference_latents"][1]},
              str(tmp_path / "c.safetensors"))
    res = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", models["flux2-dev"], "--cond",
                          str(tmp_path / "c.safetensors"), "--seed", "5", "--steps", str(STEPS), "--guidance", "4",
                          "--width", "128", "--height", "128", "--ulysses", "2",
                          "--out", str(tmp_path / "o.safetensors")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(res.stdout)
    assert res.returncode == 0, res.stderr
    got = load_file(str(tmp_path / "o.safetensors"))["samples"]
    want = reference_sample(diffusers_models["flux2-dev"], j)
    assert got.shape == (1, 128, 8, 8)
    assert report("python -m engine generate, ulysses2, ref_0 and ref_1 vs reference", (got - want).abs().max(),
                  bound(want, 1.0, tokens_of(j)))


def test_generate_reads_a_flux2_latents_size_at_16_pixels_per_latent_pixel(models, tmp_path):
    """A FLUX.2 --latent [1, 128, 8, 12] is a 192x128 image: --width 192 --height 128 agree with it, --width 96 is
    refused in one line naming both sizes (before any rank starts)."""
    from safetensors.torch import save_file
    from engine.cli import build_parser, generate
    from engine.cli.args import UsageError
    save_file({"cond": torch.zeros(1, 20, WIDTH["flux2-dev"])}, str(tmp_path / "c.safetensors"))
    save_file({"samples": torch.zeros(1, 128, 8, 12)}, str(tmp_path / "l.safetensors"))
    base = ["generate", "--model", models["flux2-dev"], "--cond", str(tmp_path / "c.safetensors"), "--latent",
            str(tmp_path / "l.safetensors"), "--out", str(tmp_path / "o.safetensors"), "--height", "128"]
    parser = build_parser()
    request = generate.build_request(parser.parse_args(base + ["--width", "192"]))
    assert request.latent_raw.shape == (1, 128, 8, 12)
    with pytest.raises(UsageError, match=r"is 192x128 px but --width/--height say 96x128"):
        generate.build_request(parser.parse_args(base + ["--width", "96"]))


# ---- CUDA (skipped where torch sees none) ---------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["flux2-dev", "flux2-klein-4b"])
def test_the_cuda_velocity_equals_the_cpu_one_in_fp32_and_stays_near_it_in_bf16(models, variant):
    """The tiny model with two references on CUDA: fp32 (no TF32) within the fp32 bound of the CPU's velocity; bf16
    within a few percent relative L2 (8 mantissa bits, roundings growing ~sqrt through the blocks)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    x, cond = randn(3, (1, 128, 16, 16), (1, 40, WIDTH[variant]))
    raw = randn(4, (1, 128, 8, 12), (1, 128, 16, 8))

    def velocity(dtype, device):
        flow = FlowModel(load_model(models[variant], dtype=dtype, device=device))
        return flow.velocity(x, torch.tensor(0.6), flow.prepare([Conditioning(cond, None, 4.0, tuple(raw))], 1)).cpu()
    cpu, gpu, bf16 = velocity("fp32", "cpu"), velocity("fp32", "cuda"), velocity("bf16", "cuda")
    tokens = TEXT + 16 * 16 + 8 * 12 + 16 * 8
    assert report(f"{variant} CUDA vs CPU fp32 velocity, two references", (gpu - cpu).abs().max(),
                  fp32_bound(cpu.abs().max(), reduction=tokens, depth=DEPTH))
    rel = ((bf16 - cpu).norm() / cpu.norm()).item()
    print(f"{variant} CUDA bf16 vs CPU fp32: relative L2 {rel:.3g} (bound {2 ** -8 * math.sqrt(DEPTH * 16):.3g})")
    assert rel <= 2 ** -8 * math.sqrt(DEPTH * 16)
