"""FLUX.1 Kontext reference latents (ComfyUI's ReferenceLatent): the engine's velocity and sampled latent equal an
independent reference built here from ComfyUI 0.3.64's formulas, on 1 and 2 real rank processes (gloo, CPU), with
the reference tokens split with the image tokens and held joint by every rank; a job with reference latents differs
from the same job without them; bad reference latents are refused before any rank starts; a CONDITIONING shaped as
ComfyUI passes it reaches the engine.

The reference restates ComfyUI's math without the engine's code: Flux.extra_conds takes each reference to model space
(process_latent_in); Flux._forward packs it like the image (process_img: 2x2 patches, channels (c, ph, pw)) with ids
(index, row + h_offset, col + w_offset), the offsets in latent pixels rounded up to patches, placed per method; the
tokens follow the image tokens and only the image tokens' output is kept. The unmodified diffusers transformer is
called directly, with 2D ids [txt; img] as diffusers takes them.
"""
import dataclasses
import importlib
import json
import os

import pytest
import torch

from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import load_model, load_transformer
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan
from engine.runtime.client import Engine

from conftest import FAST, PACK_NAME, ROOT, load_pack
from tolerance import fp32_bound, report, sampling_amplification

SCALE, SHIFT = 0.3611, 0.1159   # ComfyUI's Flux latent format
DEPTH = 8                       # the tiny FLUX: 4 double + 4 single blocks
STEPS = 4                       # ComfyUI's golden FLUX sigmas hold simple/4


@pytest.fixture(scope="module")
def engines():
    """conftest's engines, with a heartbeat deadline that a CPU shared with other test runs does not trip (a rank
    busy in a forward can go silent for seconds when the cores are oversubscribed)."""
    started = {}

    def get(world):
        if world not in started:
            started[world] = Engine(world, device="cpu", deadlines=dataclasses.replace(FAST, heartbeat_s=60))
        return started[world]
    yield get
    for e in started.values():
        e.close()


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny("flux", str(tmp_path_factory.mktemp("kontext")))


@pytest.fixture(scope="module")
def diffusers_model(flux):
    return load_transformer(flux).model


def latents(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


# ---- the independent reference -------------------------------------------------------------------------------
def comfy_places(method, image_hw, ref_shapes):
    """(index, h_offset, w_offset) per reference, offsets in latent pixels, as Flux._forward in ComfyUI 0.3.64 chooses
    them: offset (default) tiles the references on index 1 next to each other, growing whichever side keeps the
    covered box squarer; index puts reference i at index i; uxo puts them on index 0 past the image's corner."""
    places = []
    box_h = box_w = 0
    for i, (h, w) in enumerate(ref_shapes):
        if method == "index":
            places.append((i + 1, 0, 0))
        elif method == "uxo":
            places.append((0, image_hw[0] + box_h, image_hw[1] + box_w))
            box_h, box_w = box_h + h, box_w + w
        else:
            right = h + box_h > w + box_w
            h_off, w_off = (0, box_w) if right else (box_h, 0)
            places.append((1, h_off, w_off))
            box_h, box_w = max(box_h, h + h_off), max(box_w, w + w_off)
    return places


def pack(x):
    """process_img's tokens, one 2x2 patch at a time, rows first."""
    b, c, h, w = x.shape
    return torch.stack([x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(b, c * 4)
                        for i in range(h // 2) for j in range(w // 2)], dim=1)


def ids(h, w, index=0, h_off=0, w_off=0):
    """process_img's position ids for a latent h x w placed at (h_off, w_off) latent pixels."""
    r0, c0 = (h_off + 1) // 2, (w_off + 1) // 2
    return torch.tensor([[float(index), r0 + i, c0 + j] for i in range(h // 2) for j in range(w // 2)])


def reference_velocity(model, x, sigma, cond, pooled, refs_raw=(), method="offset", guidance=3.5):
    b, c, h, w = x.shape
    tokens, img_ids = [pack(x)], [ids(h, w)]
    refs = [((r - SHIFT) * SCALE).expand(b, -1, -1, -1) for r in refs_raw]        # process_latent_in, batch repeat
    for r, (index, h_off, w_off) in zip(refs, comfy_places(method, (h, w), [r.shape[-2:] for r in refs])):
        tokens.append(pack(r))
        img_ids.append(ids(r.shape[2], r.shape[3], index, h_off, w_off))
    out = model(hidden_states=torch.cat(tokens, 1), encoder_hidden_states=cond.expand(b, -1, -1),
                pooled_projections=pooled.expand(b, -1), timestep=torch.full((b,), float(sigma)),
                img_ids=torch.cat(img_ids), txt_ids=torch.zeros(cond.shape[1], 3),
                guidance=torch.full((b,), guidance), return_dict=False)[0]
    out = out[:, :(h // 2) * (w // 2)]
    v = torch.empty_like(x)
    for n, (i, j) in enumerate((i, j) for i in range(h // 2) for j in range(w // 2)):
        v[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] = out[:, n].reshape(b, c, 2, 2)
    return v


def golden_sigmas(steps):
    with open(os.path.join(ROOT, "tests", "golden", "comfyui_sigmas.json")) as f:
        return torch.tensor(json.load(f)["models"]["flux_shift_1.15"][f"simple/{steps}"], dtype=torch.float32)


@torch.no_grad()
def reference_sample(model, job):
    """ComfyUI's KSampler, euler/simple on an empty latent: noise from the seed, CFG on denoised."""
    shape = job["latent_raw"].shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(job["seed"]))
    sigmas = golden_sigmas(STEPS)
    x = sigmas[0] * x
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        denoised = x - sigma * reference_velocity(model, x, sigma, job["cond"], job["pooled"],
                                                  job.get("reference_latents") or (),
                                                  job.get("reference_latents_method", "offset"))
        if job["cfg"] != 1.0:
            neg = x - sigma * reference_velocity(model, x, sigma, job["neg_cond"], job["neg_pooled"],
                                                 job.get("neg_reference_latents") or (),
                                                 job.get("neg_reference_latents_method", "offset"))
            denoised = neg + job["cfg"] * (denoised - neg)
        x = x + (x - denoised) / sigma * (nxt - sigma)
    return x / SCALE + SHIFT


# ---- jobs ------------------------------------------------------------------------------------------------------
def job(*, text=24, cfg=1.0, batch=1, refs=((8, 8),), neg_refs=(), method="offset", seed=5):
    cond, pooled, neg_cond, neg_pooled = latents(11, (1, text, 4096), (1, 768), (1, text, 4096), (1, 768))
    return dict(latent_raw=torch.zeros(batch, 16, 16, 16), cond=cond, pooled=pooled, neg_cond=neg_cond,
                neg_pooled=neg_pooled, cfg=cfg, seed=seed, reference_latents=latents(21, *[(1, 16, *s) for s in refs]),
                neg_reference_latents=latents(31, *[(1, 16, *s) for s in neg_refs]) or None,
                reference_latents_method=method)


def engine_request(flux, j, plan=ParallelPlan(), **extra):
    r = GenerateRequest(model=flux, steps=STEPS, sampler="euler", scheduler="simple", plan=plan,
                        **{k: v for k, v in j.items()}, **extra)
    r = r.validate()
    return r


def run(engines, r):
    return engines(r.plan.world_size).submit("generate", *r.to_job()).outputs["samples"]


def bound(reference, cfg):
    """Another process and another code path (packing, embedding hook, rank split): fp32 summation order only."""
    return fp32_bound(reference.abs().max(), reduction=4096, depth=DEPTH,
                      amplification=sampling_amplification(STEPS, cfg))


# ---- the model velocity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,refs", [("offset", [(8, 8)]), ("offset", [(8, 12), (6, 4), (4, 10)]),
                                         ("index", [(8, 8), (6, 10)]), ("uxo", [(8, 8), (6, 10)])])
def test_velocity_equals_comfyuis_formulas_and_differs_without_references(flux, diffusers_model, method, refs):
    flow = FlowModel(load_model(flux))
    x, cond, pooled = latents(3, (2, 16, 10, 12), (1, 24, 4096), (1, 768))
    raw = latents(4, *[(1, 16, *s) for s in refs])
    sigma = torch.tensor(0.7)
    side = Conditioning(cond, pooled, 3.5, tuple(raw), method)
    got = flow.velocity(x, sigma, flow.prepare([side], 2))
    with torch.no_grad():
        want = reference_velocity(diffusers_model, x, sigma, cond, pooled, raw, method)
    without = flow.velocity(x, sigma, flow.prepare([Conditioning(cond, pooled, 3.5)], 2))
    changed = (got - without).abs().max()
    print(f"{method} {refs}: with vs without reference latents, max abs diff {changed:.3g}")
    assert report(f"{method} {refs}: velocity vs ComfyUI's formulas", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4096, depth=DEPTH))
    assert changed > 100 * fp32_bound(want.abs().max(), reduction=4096, depth=DEPTH)


def test_reference_placements_are_comfyuis():
    """The engine's placements (in patches) against the restatement above, on shapes where the methods differ."""
    from engine.families.flux import reference_positions
    shapes = [(8, 12), (6, 4), (4, 10), (10, 6)]
    for method in ("offset", "index", "uxo"):
        want = [(i, (h + 1) // 2, (w + 1) // 2) for i, h, w in comfy_places(method, (16, 14), shapes)]
        got = reference_positions(method, (16, 14), shapes)
        print(method, got)
        assert got == want


# ---- sampled latents on 1 and 2 ranks --------------------------------------------------------------------------
# The tiny image is 16x16 latent pixels: 64 image tokens. References of 8x8 add 16 tokens (80 in all: split over 2
# ranks), 6x10 add 15 (79: joint). Text of 24 tokens splits over 2, 25 stays joint. `gathered`: the output tokens a
# sequence-parallel rank sends per model call (its image shard, plus its share of split references), which tells the
# split path (40) from the joint one (32).
PLANS = [
    # plan, job, gathered, what it covers
    ({}, dict(), None, "one rank"),
    ({}, dict(cfg=3.0, neg_refs=((6, 10),)), None, "one rank, both sides with references of other shapes"),
    ({}, dict(cfg=3.0, refs=((8, 8), (6, 10)), neg_refs=((8, 8), (6, 10)), method="index"), None,
     "one rank, both sides in one forward"),
    (dict(ulysses=2), dict(), 40, "ulysses2, references split"),
    (dict(ulysses=2), dict(refs=((6, 10),), text=25), 32, "ulysses2, references and text joint"),
    (dict(ring=2), dict(refs=((6, 10),)), 32, "ring2, references joint, text split"),
    (dict(ring=2), dict(refs=((8, 8), (4, 4)), text=25), 42, "ring2, two references split, text joint"),
    (dict(cfg=2), dict(cfg=3.0), None, "cfg2, references on the positive side only"),
    (dict(dp=2), dict(batch=2, refs=((6, 10),)), None, "dp2, one reference for the batch"),
    (dict(cfg=2, ulysses=2), dict(cfg=3.0, refs=((6, 10),), neg_refs=((8, 8),), text=25), None,
     "cfg2 x ulysses2, positive references joint, negative split"),
]


@pytest.mark.parametrize("plan,spec,gathered,what", PLANS, ids=[p[3] for p in PLANS])
def test_sampled_latent_equals_the_independent_reference(flux, diffusers_model, engines, plan, spec, gathered, what):
    j = job(**spec)
    r = engine_request(flux, j, ParallelPlan(**plan))
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    got, sent = result.outputs["samples"], result.ranks[0].get("bytes_sent_per_step", {})
    want = reference_sample(diffusers_model, j)
    assert got.shape == want.shape
    assert report(f"{what}: latent vs ComfyUI-formula reference", (got - want).abs().max(), bound(want, j["cfg"]))
    if gathered is not None:   # one model call per step, [1, tokens, 64] fp32 to the other rank
        print(f"sp_gather per step: {sent['sp_gather']:.0f} bytes")
        assert sent["sp_gather"] == gathered * 64 * 4


def test_a_job_with_reference_latents_differs_from_the_same_job_without(flux, diffusers_model, engines):
    j = job(refs=((6, 10),))
    with_refs = run(engines, engine_request(flux, j, ParallelPlan(ulysses=2)))
    without = run(engines, engine_request(flux, dict(j, reference_latents=None), ParallelPlan(ulysses=2)))
    want_without = reference_sample(diffusers_model, dict(j, reference_latents=None))
    diff = (with_refs - without).abs().max()
    print(f"ulysses2: with vs without reference latents, max abs diff {diff:.3g}")
    assert report("ulysses2 without references vs reference", (without - want_without).abs().max(),
                  bound(want_without, 1.0))
    assert diff > 100 * bound(want_without, 1.0)   # far beyond rounding: the references steer the result


def test_a_step_cache_that_skips_nothing_is_exact_with_joint_references(flux, engines):
    j = job(refs=((6, 10),), text=25)
    plain = run(engines, engine_request(flux, j, ParallelPlan(ulysses=2)))
    never = 1e-9   # a threshold no change of this model comes near: the cache runs, records, and skips nothing
    cached = engines(2).submit("generate", *engine_request(flux, j, ParallelPlan(ulysses=2),
                                                           cache_threshold=never).to_job())
    print("step cache with references:", cached.ranks[0]["step_cache"])
    assert cached.ranks[0]["step_cache"]["model_calls"] == STEPS
    assert torch.equal(cached.outputs["samples"], plain)


# ---- refusals --------------------------------------------------------------------------------------------------
BAD = [
    (dict(reference_latents=[torch.zeros(1, 16, 7, 8)]), r"reference_latents\[0\] of shape \[1, 16, 7, 8\] is invalid: "
     r"its image is 64x56 px; flux-dev takes references whose sides are multiples of 16 px"),
    (dict(reference_latents=[torch.zeros(1, 4, 8, 8)]), r"reference_latents\[0\] of shape \[1, 4, 8, 8\] is invalid: "
     r"flux-dev takes \[1, 16, h/8, w/8\]"),
    (dict(reference_latents=[torch.zeros(3, 16, 8, 8)]), r"reference_latents\[0\] of shape \[3, 16, 8, 8\] is invalid"),
    (dict(reference_latents=torch.zeros(1, 16, 8, 8)), r"reference_latents is a Tensor: give a list of latents"),
    (dict(reference_latents=[torch.zeros(1, 16, 8, 8, dtype=torch.int64)]),
     r"reference_latents\[0\] is torch.int64: give a floating-point latent"),
    (dict(cfg=3.0, neg_cond=torch.zeros(1, 24, 4096), neg_pooled=torch.zeros(1, 768),
          neg_reference_latents=[torch.zeros(1, 16, 8, 9)]), r"neg_reference_latents\[0\] of shape \[1, 16, 8, 9\]"),
    (dict(reference_latents=[torch.zeros(1, 16, 8, 8)], reference_latents_method="uno"),
     r"reference_latents_method='uno' is invalid: use one of offset, index, uxo"),
    (dict(reference_latents=[torch.zeros(1, 16, 8, 8)], plan=ParallelPlan(pipefusion=2)),
     r"plan pipefusion2 cannot run this job: reference latents do not combine with pipefusion yet: "
     r"use ulysses, ring, cfg or dp"),
]


@pytest.mark.parametrize("fields,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_reference_latents_are_refused_before_launch_in_one_line(flux, fields, message):
    fields = dict(fields)
    plan = fields.pop("plan", ParallelPlan())
    r = GenerateRequest(model=flux, cond=torch.zeros(1, 24, 4096), pooled=torch.zeros(1, 768),
                        latent_raw=torch.zeros(1, 16, 16, 16), plan=plan, **fields)
    with pytest.raises(ValueError, match=message) as e:
        r = r.validate(plan.world_size)
    print(e.value)
    assert "\n" not in str(e.value)


def test_sd3_refuses_reference_latents():
    r = GenerateRequest(model="synthetic:sd3.5-medium:tiny", cond=torch.zeros(1, 30, 4096), pooled=torch.zeros(1, 2048),
                        latent_raw=torch.zeros(1, 16, 16, 16), reference_latents=[torch.zeros(1, 16, 8, 8)])
    with pytest.raises(ValueError, match=r"reference_latents holds 1 reference latent\(s\) but sd3.5-medium takes "
                                         r"none: remove the ReferenceLatent node") as e:
        r = r.validate()
    print(e.value)
    assert "\n" not in str(e.value)


def test_reference_latents_cross_to_the_ranks_and_back():
    """to_job sends each reference as its own tensor and the lists' lengths in the document (none of the negative
    side's when there is no negative pass); from_job rebuilds the lists in order and refuses a job missing one."""
    refs, neg = latents(1, (1, 16, 8, 8), (1, 16, 6, 4)), latents(2, (1, 16, 4, 4))
    r = GenerateRequest(model="synthetic:flux-dev:tiny", cond=torch.zeros(1, 8, 4096), pooled=torch.zeros(1, 768),
                        latent_raw=torch.zeros(1, 16, 8, 8), reference_latents=refs, reference_latents_method="index",
                        neg_cond=torch.zeros(1, 8, 4096), neg_pooled=torch.zeros(1, 768), neg_reference_latents=neg)
    r = r.validate()
    spec, inputs = r.to_job()
    assert sorted(inputs) == ["cond", "latent_raw", "pooled", "reference_latents.0", "reference_latents.1"]
    assert (spec["reference_latents"], spec["neg_reference_latents"]) == (2, None)
    with pytest.raises(ValueError, match=r"missing \['reference_latents.1'\]"):
        GenerateRequest.from_job(spec, {k: v for k, v in inputs.items() if k != "reference_latents.1"})
    back = GenerateRequest.from_job(spec, inputs)
    assert [t.shape for t in back.reference_latents] == [t.shape for t in refs]
    assert all(torch.equal(a, b) for a, b in zip(back.reference_latents, refs))
    assert back.reference_latents_method == "index" and back.neg_reference_latents is None
    back = GenerateRequest.from_job(*dataclasses.replace(r, cfg=2.0).to_job())
    assert torch.equal(back.neg_reference_latents[0], neg[0])


# ---- the node path ---------------------------------------------------------------------------------------------
def test_a_conditioning_with_reference_latents_reaches_the_engine(flux, diffusers_model):
    """What CLIPTextEncode -> ReferenceLatent -> FluxGuidance put out: [[t5, {"pooled_output", "reference_latents":
    [VAEEncode's samples], "guidance"}]]; the sampler's latent equals the reference, and differs without them."""
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    j = job(refs=((6, 10),), seed=7)
    positive = [[j["cond"], {"pooled_output": j["pooled"], "reference_latents": list(j["reference_latents"]),
                             "guidance": 3.5}]]
    plain = [[j["cond"], {"pooled_output": j["pooled"], "guidance": 3.5}]]
    settings = core.EngineSettings(model_path=flux, gpus=(0,), device="cpu")
    registry = core.EngineRegistry()
    try:
        common = dict(seed=7, steps=STEPS, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0,
                      registry=registry)
        got = core.sample(settings, positive, plain, {"samples": j["latent_raw"]}, **common)["samples"]
        without = core.sample(settings, plain, plain, {"samples": j["latent_raw"]}, **common)["samples"]
    finally:
        registry.unload()
    want = reference_sample(diffusers_model, j)
    print(f"node: with vs without reference latents, max abs diff {(got - without).abs().max():.3g}")
    assert report("node with reference latents vs reference", (got - want).abs().max(), bound(want, 1.0))
    assert (got - without).abs().max() > 100 * bound(want, 1.0)
