"""HunyuanVideo 1.5: the engine's velocities and latents equal an independent reference built here from ComfyUI 0.33's
formulas, on one rank and under every plan, text- and image-to-video, from the files users have.

The reference restates ComfyUI's HunyuanVideo (comfy/ldm/hunyuan_video/model.py, comfy/ldm/flux/layers.py and
math.py) in plain torch on the file's tensors in ComfyUI's names, without diffusers or the engine: the input [noise |
image latent | mask] (model_base.HunyuanVideo15.concat_cond: the image process_in'd at scale 1.03682, the mask 1 -
concat_mask, zeros without them); timestep_embedding [cos, sin] in float32 through time_in; the token refiner (its
pooled vector a plain mean over the text's rows, adaLN gates, LayerNorm eps 1e-6); condition-type embeddings; the text
stream [vision | byT5 | text]; the double blocks with Modulation's (shift, scale, gate), q/k F.rms_norm at torch's
default epsilon, the text first in one attention, EmbedND's float64 RoPE over (16, 56, 56) at theta 256 with the text
at (0, 0, 0); LastLayer's (shift, scale). The file's tensors are read as they are, so the family's key map (fused qkv
thirds, the final layer's swapped halves) is checked with the forward. Sampling: ModelSamplingDiscreteFlow at shift 7
(timestep = 1000 sigma), KSampler's simple schedule, CFG on denoised, euler, EmptyHunyuanVideo15Latent's zeros.
"""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine import families
from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan

from tolerance import fp32_bound, report, sampling_amplification

SCALE = 1.03682          # ComfyUI's HunyuanVideo15 latent format
TEXT, BYT5, VISION = 64, 1472, 1152   # the tiny file's text width; byT5's and SigLIP's, fixed by ComfyUI
HEADS = 2
DEPTH = 2 + 2 + 3        # double blocks, refiner blocks, the byT5 mapper's three matrices before them
STEPS = 2
SHIFT = 7.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny("hunyuanvideo15", str(tmp_path_factory.mktemp("hv15")))


@pytest.fixture(scope="module")
def sd(tiny):
    return load_file(tiny)


@pytest.fixture(scope="module")
def flow(tiny):
    return FlowModel(load_model(tiny))


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the independent reference ---------------------------------------------------------------------------------------
def lin(sd, name, x):
    return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))


def sinusoid(t):
    """comfy/ldm/flux/layers.py timestep_embedding (time_factor 1): [cos, sin] of t x 10000^(-k/128), float32."""
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def mlp_embed(sd, name, x):
    return lin(sd, name + ".out_layer", F.silu(lin(sd, name + ".in_layer", x)))


def attend(q, k, v):
    """[n, S, heads, d] -> [n, S, heads x d]."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)


def embed_nd(ids):
    """EmbedND: per axis omega = 1 / 256^linspace(0, (d-2)/d, d/2), float64 angles -> [S, 64, 2, 2] rotations."""
    parts = []
    for a, d in enumerate((16, 56, 56)):
        omega = 1.0 / 256.0 ** torch.linspace(0, (d - 2) / d, d // 2, dtype=torch.float64)
        out = ids[:, a].to(torch.float32).double()[:, None] * omega[None]
        parts.append(torch.stack([out.cos(), -out.sin(), out.sin(), out.cos()], dim=-1).reshape(*out.shape, 2, 2))
    return torch.cat(parts, dim=-3).float()


def apply_rope(x, pe):
    """ComfyUI's apply_rope on x [n, S, heads, d] with pe [S, d/2, 2, 2]."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    pe = pe[None, :, None]
    return (pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]).reshape(x.shape).type_as(x)


def qk_norm(sd, name, t):
    return F.rms_norm(t, (t.shape[-1],), sd[name], eps=None)


@torch.no_grad()
def reference_velocity(sd, x, t, cond, byt5=None, clip=None):
    """ComfyUI's HunyuanVideo._forward for x [n, 65, F, h, w] (model space, c_concat attached) at timestep t [n]."""
    n, _, frames, h, w = x.shape
    img = F.conv3d(x, sd["img_in.proj.weight"], sd["img_in.proj.bias"]).flatten(2).transpose(1, 2)
    vec = mlp_embed(sd, "time_in", sinusoid(t))
    # the token refiner: its pooled vector the plain mean of the text's rows
    pooled = cond.sum(dim=1) / cond.shape[1]
    c = mlp_embed(sd, "txt_in.t_embedder", sinusoid(t)) + mlp_embed(sd, "txt_in.c_embedder", pooled)
    txt = lin(sd, "txt_in.input_embedder", cond)
    for i in range(2):
        b = f"txt_in.individual_token_refiner.blocks.{i}"
        mod1, mod2 = lin(sd, f"{b}.adaLN_modulation.1", F.silu(c)).chunk(2, dim=1)
        normed = F.layer_norm(txt, (txt.shape[-1],), sd[f"{b}.norm1.weight"], sd[f"{b}.norm1.bias"], 1e-6)
        q, k, v = lin(sd, f"{b}.self_attn.qkv", normed).unflatten(-1, (3, HEADS, -1)).unbind(2)
        txt = txt + lin(sd, f"{b}.self_attn.proj", attend(q, k, v)) * mod1[:, None]
        normed = F.layer_norm(txt, (txt.shape[-1],), sd[f"{b}.norm2.weight"], sd[f"{b}.norm2.bias"], 1e-6)
        txt = txt + lin(sd, f"{b}.mlp.2", F.silu(lin(sd, f"{b}.mlp.0", normed))) * mod2[:, None]
    kinds = sd["cond_type_embedding.weight"]
    txt = txt + kinds[0]
    if byt5 is not None:
        b = F.layer_norm(byt5, (BYT5,), sd["byt5_in.layernorm.weight"], sd["byt5_in.layernorm.bias"])
        b = lin(sd, "byt5_in.fc3", F.gelu(lin(sd, "byt5_in.fc2", F.gelu(lin(sd, "byt5_in.fc1", b)))))
        txt = torch.cat([b + kinds[1], txt], dim=1)
    if clip is not None:
        v = F.layer_norm(clip, (VISION,), sd["vision_in.proj.0.weight"], sd["vision_in.proj.0.bias"])
        v = lin(sd, "vision_in.proj.3", F.gelu(lin(sd, "vision_in.proj.1", v)))
        v = F.layer_norm(v, (v.shape[-1],), sd["vision_in.proj.4.weight"], sd["vision_in.proj.4.bias"])
        txt = torch.cat([v + kinds[2], txt], dim=1)
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij"))
    ids = torch.cat([torch.zeros(txt.shape[1], 3), grid.reshape(3, -1).T.float()])
    pe = embed_nd(ids)
    for i in range(sum(k.startswith("double_blocks.") and k.endswith("img_mod.lin.weight") for k in sd)):
        b = f"double_blocks.{i}"
        parts = {}
        for stream, tokens in (("txt", txt), ("img", img)):
            shift1, scale1, gate1, shift2, scale2, gate2 = lin(sd, f"{b}.{stream}_mod.lin", F.silu(vec))[:, None] \
                .chunk(6, dim=-1)
            normed = F.layer_norm(tokens, (tokens.shape[-1],), eps=1e-6) * (1 + scale1) + shift1
            q, k, v = lin(sd, f"{b}.{stream}_attn.qkv", normed).unflatten(-1, (3, HEADS, -1)).unbind(2)
            q = qk_norm(sd, f"{b}.{stream}_attn.norm.query_norm.weight", q)
            k = qk_norm(sd, f"{b}.{stream}_attn.norm.key_norm.weight", k)
            parts[stream] = (q, k, v, gate1, shift2, scale2, gate2)
        q, k, v = (torch.cat([parts["txt"][j], parts["img"][j]], dim=1) for j in range(3))
        out = attend(apply_rope(q, pe), apply_rope(k, pe), v)
        outs = {"txt": out[:, :txt.shape[1]], "img": out[:, txt.shape[1]:]}
        new = {}
        for stream, tokens in (("txt", txt), ("img", img)):
            _, _, _, gate1, shift2, scale2, gate2 = parts[stream]
            tokens = tokens + gate1 * lin(sd, f"{b}.{stream}_attn.proj", outs[stream])
            normed = F.layer_norm(tokens, (tokens.shape[-1],), eps=1e-6) * (1 + scale2) + shift2
            mlp = lin(sd, f"{b}.{stream}_mlp.2", F.gelu(lin(sd, f"{b}.{stream}_mlp.0", normed), approximate="tanh"))
            new[stream] = tokens + gate2 * mlp
        txt, img = new["txt"], new["img"]
    shift, scale = lin(sd, "final_layer.adaLN_modulation.1", F.silu(vec))[:, None].chunk(2, dim=-1)
    img = lin(sd, "final_layer.linear", F.layer_norm(img, (img.shape[-1],), eps=1e-6) * (1 + scale) + shift)
    return img.reshape(n, frames, h, w, -1).permute(0, 4, 1, 2, 3)


def concat(latent_shape, image=None, mask=None):
    """model_base.HunyuanVideo15.concat_cond: [image latent process_in'd | 1 - mask], zeros without them."""
    n, _, frames, h, w = latent_shape
    image = torch.zeros(n, 32, frames, h, w) if image is None else (image * SCALE).expand(n, -1, -1, -1, -1)
    mask = torch.zeros(n, 1, frames, h, w) if mask is None else (1.0 - mask).expand(n, -1, -1, -1, -1)
    return torch.cat([image, mask], dim=1)


def simple_sigmas(steps, shift=SHIFT):
    """ModelSamplingDiscreteFlow (1000 entries, t = i/1000, shift t / (1 + (shift - 1) t)) and the simple schedule."""
    t = torch.arange(1, 1001, dtype=torch.float32) / 1000
    table = shift * t / (1 + (shift - 1) * t)
    return torch.tensor([float(table[-(1 + int(i * 1000 / steps))]) for i in range(steps)] + [0.0])


@torch.no_grad()
def reference_sample(sd, r, image=None, mask=None):
    """KSampler, euler/simple, on the reference: seeded noise from sigma 1, CFG on denoised (each side with its byT5
    rows, if any); returns the raw LATENT."""
    sigmas = simple_sigmas(r.steps)
    x = sigmas[0] * torch.randn(r.latent_raw.shape, generator=torch.Generator().manual_seed(r.seed))
    c = concat(x.shape, image, mask)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), float(s) * 1000)
        x_in = torch.cat([x, c], dim=1)
        denoised = x - reference_velocity(sd, x_in, t, r.cond, r.byt5, clip=r.clip_vision_output) * s
        if r.cfg != 1.0:
            neg = x - reference_velocity(sd, x_in, t, r.neg_cond, r.neg_byt5, clip=r.neg_clip_vision_output) * s
            denoised = neg + r.cfg * (denoised - neg)
        x = x + (x - denoised) / s * (s_next - s)
    return x / SCALE


def bound(reference, steps=1, cfg=1.0):
    """Another code path (diffusers' modules, hooks, rank splits): fp32 summation order only; the longest dot product
    is the byT5 mapper's 2048."""
    return fp32_bound(reference.abs().max(), reduction=2048, depth=DEPTH,
                      amplification=sampling_amplification(steps, cfg))


# ---- the files users have --------------------------------------------------------------------------------------------
def test_both_layouts_map_every_tensor_onto_the_unmodified_diffusers_model(flow, sd, tmp_path):
    """ComfyUI's module names and the HunyuanVideo names ComfyUI renames as it loads: every file tensor is one
    diffusers tensor of the shape HunyuanVideo15Transformer3DModel has; at full size the model is 8.3 B, 54 blocks of
    16 heads; a file in the HunyuanVideo names gives the same velocity."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from engine.families.hunyuanvideo15_layout import hunyuan_name
    family = families.get("hunyuanvideo15")
    for size in ("full", "tiny"):
        shapes = family.shapes(family.dims[size]["hunyuanvideo-1.5"])
        config, _ = family.infer("comfy", shapes, {})
        with torch.device("meta"):
            own = {k: tuple(v.shape) for k, v in HunyuanVideo15Transformer3DModel(**config).state_dict().items()}
        for layout, names in (("comfy", shapes), ("hunyuan", {hunyuan_name(k): s for k, s in shapes.items()})):
            ours = family.key_map(layout, config)
            assert sorted(dst for dst, _, _ in ours) == sorted(own)
            assert {src for _, src, _ in ours} == set(names)
            assert family.infer(layout, names, {})[0] == config
    full = inspect_model("synthetic:hunyuanvideo-1.5")
    print(f"HunyuanVideo 1.5 at full size: {full.parameters:,} parameters, {full.layers} blocks, {full.heads} heads")
    assert round(full.parameters / 1e9, 1) == 8.3 and full.layers == 54 and full.heads == 16
    renamed = str(tmp_path / "hunyuan-names.safetensors")
    save_file({hunyuan_name(k): v for k, v in sd.items()}, renamed)
    x, cond = randn(1, 1, 32, 2, 4, 4), randn(2, 1, 5, TEXT)
    got = {}
    for f in (flow, FlowModel(load_model(renamed))):
        got[f.loaded.info.layout] = f.velocity(x, torch.tensor(0.5), f.prepare([Conditioning(cond)], 1))
    # the same weights in two models: the same arithmetic, but the CPU's matrix kernels may pick another blocking for
    # another allocation (seen under load), so fp32 rounding, not bitwise
    assert set(got) == {"comfy", "hunyuan"}
    assert report("HunyuanVideo 1.5 HunyuanVideo names vs ComfyUI's", (got["hunyuan"] - got["comfy"]).abs().max(),
                  bound(got["comfy"]))


@pytest.mark.parametrize("key,shape,message", [
    ("time_r_in.in_layer.weight", (256, 256), "super-resolution and meanflow files"),
    ("double_blocks.0.img_attn.norm.query_norm.weight", (64,), "128-wide heads only")])
def test_a_file_comfyuis_hunyuanvideo15_class_could_not_build_is_refused_in_one_line(sd, tmp_path, key, shape, message):
    from engine.errors import CheckpointError
    path = str(tmp_path / "odd.safetensors")
    save_file({**sd, key: torch.ones(shape)}, path)
    with pytest.raises(CheckpointError, match=message) as e:
        inspect_model(path)
    assert "\n" not in str(e.value)


# ---- one forward equals the reference --------------------------------------------------------------------------------
CASES = [dict(name="text-to-video, no c_concat attached (ComfyUI's zeros)", grid=(2, 4, 6)),
         dict(name="image-to-video: image latent, mask, SigLIP rows, byT5 rows; batch 2", grid=(2, 4, 4), image=True,
              batch=2)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"].split(":")[0].split(",")[0] for c in CASES])
def test_one_forward_equals_comfyuis_model(flow, sd, case):
    n = case.get("batch", 1)
    x, cond = randn(1, n, 32, *case["grid"]), randn(2, 1, 7, TEXT)
    side, byt5 = Conditioning(cond), None
    image = mask = None
    if case.get("image"):
        image, clip, byt5 = randn(3, 1, 32, *case["grid"]), randn(4, 1, 9, VISION), randn(5, n, 6, BYT5)
        mask = torch.ones(1, 1, *case["grid"])
        mask[:, :, 0] = 0.0   # HunyuanVideo15ImageToVideo: the first latent frame known
        side = Conditioning(cond, image_context=clip, concat_latent=image, concat_mask=mask)
    prepared = flow.prepare([side], n)
    if byt5 is not None:   # the MODEL route's txt_byt5 (the family's extras)
        prepared = replace(prepared, extras={"txt_byt5": byt5.double()})
    got = flow.velocity(x, torch.tensor(0.63), prepared)
    t = torch.full((n,), 630.0)
    want = reference_velocity(sd, torch.cat([x, concat(x.shape, image, mask)], dim=1), t, cond.expand(n, -1, -1),
                              byt5, None if image is None else clip.expand(n, -1, -1))
    assert got.shape == x.shape
    assert report(f"HunyuanVideo 1.5 {case['name']}: engine vs reference", (got - want).abs().max(), bound(want))
    if image is not None:   # the image's inputs steer the velocity, far beyond rounding
        plain = reference_velocity(sd, torch.cat([x, concat(x.shape)], dim=1), t, cond.expand(n, -1, -1))
        assert (plain - want).abs().max() > 100 * bound(want)


# ---- sampling and every plan ----------------------------------------------------------------------------------------
def job(path, plan=ParallelPlan(), *, batch=1, cfg=6.0, grid=(2, 4, 6), image=False, steps=STEPS, **kw):
    """A request as the xDiT nodes build one from ComfyUI's graph: EmptyHunyuanVideo15Latent's zeros, a negative of
    another length; image-to-video with HunyuanVideo15ImageToVideo's keys (SigLIP rows on both sides)."""
    frames, h, w = grid
    if image:
        mask = torch.ones(1, 1, frames, h, w)
        mask[:, :, 0] = 0.0
        kw.update(clip_vision_output=randn(13, 1, 9, VISION), neg_clip_vision_output=randn(13, 1, 9, VISION),
                  concat_latent_image=randn(14, 1, 32, frames, h, w), neg_concat_latent_image=randn(14, 1, 32, frames,
                                                                                                   h, w),
                  concat_mask=mask, neg_concat_mask=mask)
    return GenerateRequest(model=path, cond=randn(11, 1, 9, TEXT), neg_cond=randn(12, 1, 4, TEXT),
                           latent_raw=torch.zeros(batch, 32, frames, h, w), seed=42, steps=steps, cfg=cfg, plan=plan,
                           **kw).validate(plan.world_size)


def run(engines, r):
    return engines(2).submit("generate", *r.to_job()).outputs["samples"]   # one group: one-rank plans run on rank 0


@pytest.mark.parametrize("plan", [ParallelPlan(cfg=2)], ids=["cfg2"])
def test_the_engines_own_loop_takes_a_quoted_prompts_byt5_rows(tiny, sd, engines, plan):
    """The xDiT Sampler's route: the positive's byT5 rows (conditioning_byt5small, a prompt quoting text), a negative
    without any (its own forward, as ComfyUI runs them apart), sampled at cfg 6 equal the reference KSampler."""
    r = job(tiny, plan, byt5=randn(21, 1, 6, BYT5))
    got = run(engines, r)
    want = reference_sample(sd, r)
    plain = reference_sample(sd, job(tiny))
    assert report(f"HunyuanVideo 1.5 byT5 rows in the engine's loop ({plan.describe()}) vs reference KSampler",
                  (got - want).abs().max(), bound(want, STEPS, 6.0))
    assert (plain - want).abs().max() > 100 * bound(want, STEPS, 6.0)   # the rows move the result


def test_one_rank_sampling_equals_the_reference_ksampler(tiny, sd, engines):
    """Image-to-video at cfg 6 (text-to-video's forward is the same with zeros attached, checked above)."""
    r = job(tiny, image=True)
    got = run(engines, r)
    want = reference_sample(sd, r, r.concat_latent_image, r.concat_mask)
    assert got.shape == (1, 32, 2, 4, 6)   # the LATENT KSampler gives on EmptyHunyuanVideo15Latent's
    assert report("HunyuanVideo 1.5 i2v sampled (cfg 6) vs reference KSampler", (got - want).abs().max(),
                  bound(want, STEPS, 6.0))


ONE_RANK: dict = {}
PLANS = [(dict(ulysses=2), (2, 4, 6)), (dict(ring=2), (1, 3, 5)), (dict(cfg=2), (2, 4, 6)), (dict(dp=2), (2, 4, 6)),
         (dict(ulysses=2, shard=2), (1, 3, 5))]


@pytest.mark.parametrize("degrees,grid", PLANS, ids=lambda d: ParallelPlan(**d).describe().replace(" ", "")
                         if isinstance(d, dict) else "x".join(map(str, d)))
def test_every_plan_equals_one_rank(tiny, engines, degrees, grid):
    """cfg 6 with a negative of another length (two forwards a step), image-to-video; a 1 x 3 x 5 latent is 15 video
    tokens, which two ranks split padded (8 and 7 + a pad row no softmax sees). The text is every rank's."""
    plan = ParallelPlan(**degrees)
    batch = 2 if plan.dp > 1 else 1
    if (batch, grid) not in ONE_RANK:   # each one-rank latent once for the module
        ONE_RANK[batch, grid] = run(engines, job(tiny, batch=batch, grid=grid, image=True))
    one = ONE_RANK[batch, grid]
    many = run(engines, job(tiny, plan, batch=batch, grid=grid, image=True))
    assert many.shape == one.shape == (batch, 32, *grid)
    assert report(f"HunyuanVideo 1.5 {plan.describe()} {'x'.join(map(str, grid))} vs one rank",
                  (many - one).abs().max(), bound(one, STEPS, 6.0))


# the tiny model's agreed relative change of its first block's residual runs 0.85 to 1.3 a call at 12 steps and cfg 6;
# 0.95 skips some calls and leaves the nearest change (0.92, 1.0) about 0.03 away, far beyond rounding
CACHE = 0.95


def test_the_step_cache_skips_the_same_calls_under_ulysses_as_on_one_rank(tiny, engines):
    """The blocks' (hidden, encoder) pair in and out through the step cache: a threshold no change reaches leaves
    the latent bitwise as without the cache; at 0.95 both Ulysses ranks skip the calls one rank skips."""
    off = run(engines, job(tiny, ParallelPlan(ulysses=2), steps=12))
    never = engines(2).submit("generate", *job(tiny, ParallelPlan(ulysses=2), steps=12,
                                                 cache_threshold=1e-9).to_job())
    assert torch.equal(never.outputs["samples"], off) and never.ranks[0]["step_cache"]["skipped_calls"] == 0
    one = engines(2).submit("generate", *job(tiny, steps=12, cache_threshold=CACHE).to_job())
    many = engines(2).submit("generate", *job(tiny, ParallelPlan(ulysses=2), steps=12,
                                                cache_threshold=CACHE).to_job())
    skipped = one.ranks[0]["step_cache"]["skipped_at"]
    print(f"HunyuanVideo 1.5 step cache {CACHE}: one rank skipped calls {skipped}, ulysses2 "
          f"{[r['step_cache']['skipped_at'] for r in many.ranks]}")
    assert skipped and all(r["step_cache"]["skipped_at"] == skipped for r in many.ranks)
    assert report("HunyuanVideo 1.5 step cache ulysses2 vs one rank", (many.outputs["samples"] - one.outputs[
        "samples"]).abs().max(), bound(one.outputs["samples"], 12, 6.0))


def test_pipefusion_is_refused_in_one_line(tiny):
    with pytest.raises(ValueError) as e:
        job(tiny, ParallelPlan(pipefusion=2))
    print(e.value)
    assert "pipefusion" in str(e.value).lower() and "\n" not in str(e.value)


# ---- the files users have: ComfyUI's scaled fp8, GGUF ----------------------------------------------------------------
def exact_values(path) -> dict:
    """The file's weights as the exact float32 values its format encodes (ComfyUI's dequantization)."""
    if path.endswith(".gguf"):
        import gguf
        import numpy as np
        reader = gguf.GGUFReader(path)
        return {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.array(t.data), t.tensor_type),
                                                              dtype=np.float32)).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    weights = load_file(path)

    def scale(k):   # fp8_scaled's scale_weight, mixed precision's weight_scale
        return weights.get(k[:-len("weight")] + "scale_weight", weights.get(k[:-len("weight")] + "weight_scale"))
    # the condition-type table is a plain nn.Embedding in ComfyUI's model, not one of its scaled fp8 layers: it takes
    # the stored values as they are (and ignores a scale beside them), as the engine does
    return {k: (v.float() * scale(k).float() if k.endswith("weight") and scale(k) is not None and "cond_type" not in k
                else v.float())
            for k, v in weights.items()
            if not k.endswith(("scale_weight", "scale_input", "weight_scale")) and k != "scaled_fp8"}


@pytest.mark.parametrize("fmt", ["fp8_scaled", "fp8_mixed", "gguf"])
def test_a_stored_format_gives_comfyuis_velocity_on_its_exact_values(tmp_path, fmt):
    """Comfy-Org's fp8_scaled form, ComfyUI's mixed-precision fp8 (the blocks' matrices fp8 with a weight_scale) and a
    ComfyUI-GGUF file (architecture hyvid, as its converter names HunyuanVideo):
    the engine computes with the exact values the file encodes, as ComfyUI's layers do: the reference on them (plain
    bf16 and fp8 files go the loader's generic way, tests/test_tiny_checkpoints.py)."""
    path = write_tiny("hunyuanvideo15", str(tmp_path), format=fmt)
    info = inspect_model(path)
    assert info.family == "hunyuanvideo15" and info.format == fmt
    x, cond = randn(1, 1, 32, 2, 4, 4), randn(2, 1, 5, TEXT)
    f = FlowModel(load_model(path))
    got = f.velocity(x, torch.tensor(0.4), f.prepare([Conditioning(cond)], 1))
    want = reference_velocity(exact_values(path), torch.cat([x, concat(x.shape)], dim=1), torch.tensor([400.0]), cond)
    assert report(f"HunyuanVideo 1.5 {fmt} vs the reference on its exact values", (got - want).abs().max(),
                  bound(want))


LORA_LAYERS = {"double_blocks.0.img_attn.qkv": "transformer_blocks.0.attn.to_q",   # a fused qkv: its first third
               "double_blocks.1.txt_mlp.0": "transformer_blocks.1.ff_context.net.0.proj",
               "txt_in.individual_token_refiner.blocks.0.self_attn.proj":
                   "context_embedder.token_refiner.refiner_blocks.0.attn.to_out.0",
               "vision_in.proj.1": "image_embedder.linear_1"}


def test_a_lora_in_comfyuis_or_diffusers_names_equals_the_merged_file(flow, sd, tmp_path):
    """A LoRA on a fused qkv (ComfyUI's names: the whole qkv; diffusers': its query third), a text-stream MLP, the
    token refiner and the vision projection equals its product merged into the file: the reference on the merged
    tensors, image-to-video (so the vision projection counts). The module's model, the second LoRA replacing the
    first, then none (its weights restored from the file)."""
    from engine.models.lora import apply_loras
    state = {}
    try:
        _lora_cases(flow, sd, tmp_path, state)
    finally:
        apply_loras(flow.loaded, [], state)


def _lora_cases(f, sd, tmp_path, state):
    from engine.models.lora import apply_loras
    x, cond, clip = randn(1, 1, 32, 2, 4, 4), randn(2, 1, 5, TEXT), randn(3, 1, 9, VISION)
    x65 = torch.cat([x, concat(x.shape)], dim=1)
    plain = reference_velocity(sd, x65, torch.tensor([400.0]), cond, clip=clip)
    for fmt in ("comfyui", "diffusers"):
        g = torch.Generator().manual_seed(9)
        lora, merged = {}, dict(sd)
        for comfy, diffusers in LORA_LAYERS.items():
            rows, n_in = sd[comfy + ".weight"].shape
            part = rows // 3 if fmt == "diffusers" and comfy.endswith("qkv") else rows
            down, up = torch.randn(4, n_in, generator=g) * 0.1, torch.randn(part, 4, generator=g) * 0.1
            name = f"diffusion_model.{comfy}" if fmt == "comfyui" else f"transformer.{diffusers}"
            lora.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up})
            merged[comfy + ".weight"] = sd[comfy + ".weight"] + 0.8 * F.pad(up @ down, (0, 0, 0, rows - part))
        path = str(tmp_path / f"lora-{fmt}.safetensors")
        save_file(lora, path)
        apply_loras(f.loaded, [(path, 0.8)], state)
        got = f.velocity(x, torch.tensor(0.4), f.prepare([Conditioning(cond, image_context=clip)], 1))
        want = reference_velocity(merged, x65, torch.tensor([400.0]), cond, clip=clip)
        assert report(f"HunyuanVideo 1.5 {fmt} LoRA vs the reference on the merged tensors",
                      (got - want).abs().max(), bound(want))
        assert (plain - want).abs().max() > 100 * bound(want)   # the LoRA changes the velocity


# ---- the commands -------------------------------------------------------------------------------------------------
def test_make_tiny_writes_a_file_comfyui_detects_and_says_what_it_takes(tmp_path):
    import contextlib
    import io
    from engine.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["make-tiny", "--kind", "hunyuanvideo-1.5", "--out", str(tmp_path)]) == 0
    print(out.getvalue())
    assert "hunyuanvideo-1.5" in out.getvalue() and "[B, 32, F, H/16, W/16]" in out.getvalue()
    keys = load_file(str(tmp_path / "tiny-hunyuanvideo-1.5.safetensors"))
    # what comfy/model_detection.py reads: its marker, 128-wide heads, the 1152-wide vision projection, 65 inputs
    assert "txt_in.individual_token_refiner.blocks.0.norm1.weight" in keys
    assert keys["img_in.proj.weight"].shape[:2] == (256, 65) and keys["vision_in.proj.0.weight"].shape == (VISION,)
