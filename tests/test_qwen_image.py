"""Qwen-Image and Qwen-Image-Edit: the engine's latents equal an independent reference built here from ComfyUI 0.3.64's
formulas, on 1 rank and under every plan, text-to-image and edit.

The reference restates ComfyUI's QwenImageTransformer2DModel (comfy/ldm/qwen_image/model.py) without the engine's
code and drives the unmodified diffusers QwenImageTransformer2DModel's own modules in their order: the latent padded
circularly to whole 2x2 patches (common_dit.pad_to_patch_size) and packed per patch (c, ph, pw); position ids
(index, row - rows//2, col - cols//2) over the padded grid (process_img); text ids (s, s, s) from
s = max(rows//2, cols//2) of the output latent; EmbedND's float64 rotary angles over axes (frame, row, col);
reference latents process_in'd (Wan21: per-channel mean and std) and appended after the image tokens, reference i on
frame i (method "index") or all on frame 1 tiled by offsets ("offset"); the timestep embedded from fp32 sigma (the
model scales it by 1000); no text mask; only the image tokens' output kept and cropped. Sampling: ModelSamplingFlux
shift 1.15 by default, ModelSamplingAuraFlow's sigmas s*t/(1+(s-1)*t) (t = i/1000, multiplier 1), CFG on denoised,
CFGNorm after it (comfy_extras/nodes_cfg.py), the LATENT one frame [B, 16, 1, H/8, W/8].
"""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import families
from engine.generate.inputs import fix_empty_latent
from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import inspect_model, load_model, load_transformer
from engine.models.tiny import make_state_dict, write_tiny
from engine.parallel.plan import ParallelPlan
from engine.sampling.schedules import FlowSampling, compute_sigmas

from tolerance import fp32_bound, report, sampling_amplification

MEAN = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921])   # ComfyUI's Wan21
STD = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160])
CONTEXT = 64     # the tiny model's text width (Qwen-Image's: 3584)
DEPTH = 4        # its blocks
STEPS = 3


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_tiny("qwen-image", str(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def model(qwen):
    return load_transformer(qwen).model


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the independent reference -------------------------------------------------------------------------------
def process_in(z):
    shape = (1, 16) + (1,) * (z.ndim - 2)
    return (z - MEAN.view(shape)) / STD.view(shape)


def pad_pack(x):
    """pad_to_patch_size (circular, bottom/right) then process_img's packing, one patch at a time."""
    if x.shape[-2] % 2 or x.shape[-1] % 2:
        x = torch.nn.functional.pad(x, (0, x.shape[-1] % 2, 0, x.shape[-2] % 2), mode="circular")
    b, c, h, w = x.shape
    return torch.stack([x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(b, c * 4)
                        for i in range(h // 2) for j in range(w // 2)], dim=1)


def ids(h, w, index=0, h_off=0, w_off=0):
    rows, cols = (h + 1) // 2, (w + 1) // 2
    r0, c0 = (h_off + 1) // 2, (w_off + 1) // 2
    return torch.tensor([[float(index), r0 + i - rows // 2, c0 + j - cols // 2] for i in range(rows)
                         for j in range(cols)])


def ref_places(method, shapes):
    """(index, h_offset, w_offset) per reference, as _forward in ComfyUI 0.3.64 chooses them."""
    out, h, w = [], 0, 0
    for i, (rh, rw) in enumerate(shapes):
        if method == "index":
            out.append((i + 1, 0, 0))
            continue
        h_off = w_off = 0
        if rh + h > rw + w:
            w_off = w
        else:
            h_off = h
        h, w = max(h, rh + h_off), max(w, rw + w_off)
        out.append((1, h_off, w_off))
    return out


def rope(positions, axes):
    """EmbedND: per axis, omega = 1/10000^(2k/d) and angles in float64, as complex factors."""
    parts = []
    for a, d in enumerate(axes):
        omega = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions[:, a].double()[:, None] * omega[None]
        parts.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return torch.cat(parts, dim=1)


@torch.no_grad()
def reference_velocity(m, x, sigma, cond, refs_raw=(), method="index"):
    """ComfyUI's model on the unmodified diffusers modules: x [b, 16, h, w] model space -> v."""
    b, c, h, w = x.shape
    refs = [process_in(r).expand(b, -1, -1, -1) for r in refs_raw]
    tokens, all_ids = [pad_pack(x)], [ids(h, w)]
    for r, (index, h_off, w_off) in zip(refs, ref_places(method, [r.shape[-2:] for r in refs])):
        tokens.append(pad_pack(r))
        all_ids.append(ids(r.shape[-2], r.shape[-1], index, h_off, w_off))
    n_img = tokens[0].shape[1]
    start = max(((w + 1) // 2) // 2, ((h + 1) // 2) // 2)
    txt_ids = torch.arange(start, start + cond.shape[1]).float()[:, None].expand(-1, 3)
    axes = m.config.axes_dims_rope
    freqs = (rope(torch.cat(all_ids), axes), rope(txt_ids, axes))
    hs = m.img_in(torch.cat(tokens, dim=1))
    e = m.txt_in(m.txt_norm(cond.expand(b, -1, -1)))
    temb = m.time_text_embed(torch.full((b,), float(sigma)), hs)
    for block in m.transformer_blocks:
        e, hs = block(hidden_states=hs, encoder_hidden_states=e, encoder_hidden_states_mask=None, temb=temb,
                      image_rotary_emb=freqs)
    out = m.proj_out(m.norm_out(hs, temb))[:, :n_img]
    rows, cols = (h + 1) // 2, (w + 1) // 2
    v = torch.empty(b, c, rows * 2, cols * 2)
    for n, (i, j) in enumerate((i, j) for i in range(rows) for j in range(cols)):
        v[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] = out[:, n].reshape(b, c, 2, 2)
    return v[:, :, :h, :w]


def aura_flow_sigmas(shift, steps):
    """ModelSamplingAuraFlow's table (1000 entries, t = i/1000, multiplier 1) and the simple scheduler."""
    t = torch.arange(1, 1001, dtype=torch.float32) / 1000
    table = shift * t / (1 + (shift - 1) * t)
    picked = [table[-(1 + int(i * 1000 / steps))] for i in range(steps)]
    return torch.tensor(picked + [0.0])


def reference_sample(m, cond, neg, latent5, seed, steps, cfg, shift, refs=(), cfg_norm=0.0):
    """KSampler, euler/simple, on the reference model; latent5 [b, 16, 1, h, w] raw; returns the raw LATENT."""
    sigmas = aura_flow_sigmas(shift, steps)
    noise = torch.randn(latent5.shape, generator=torch.Generator().manual_seed(seed))[:, :, 0]
    x = sigmas[0] * noise   # an empty latent: not shifted
    for i in range(steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        pos = x - reference_velocity(m, x, s, cond, refs) * s
        neg_d = x - reference_velocity(m, x, s, neg, refs) * s
        x0 = neg_d + (pos - neg_d) * cfg
        if cfg_norm:
            x0 = x0 * (pos.norm(dim=1, keepdim=True) / (x0.norm(dim=1, keepdim=True) + 1e-8)).clamp(0, 1) * cfg_norm
        x = x + (x - x0) / s * (s_next - s)
    return (x * STD.view(1, 16, 1, 1) + MEAN.view(1, 16, 1, 1)).unsqueeze(2)


def bound(reference, steps=1, cfg=1.0):
    return fp32_bound(reference.abs().max(), reduction=max(CONTEXT, 128 * 4), depth=DEPTH,
                      amplification=sampling_amplification(steps, cfg))


# ---- the family, from the files users have ---------------------------------------------------------------------
def test_the_layout_is_diffusers_own_at_full_and_tiny_size_and_detected_by_txt_norm(qwen):
    from diffusers import QwenImageTransformer2DModel
    family = families.get("qwen-image")
    for size in ("full", "tiny"):
        d = family.dims[size]["qwen-image"]
        with torch.device("meta"):
            m = QwenImageTransformer2DModel(num_layers=d.depth, attention_head_dim=d.head_dim,
                                            num_attention_heads=d.heads, joint_attention_dim=d.context_in,
                                            axes_dims_rope=d.axes_dim)
        assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == family.shapes(d)
    real = inspect_model("synthetic:qwen-image")
    print(f"Qwen-Image at full size: {real.parameters:,} parameters, {real.layers} blocks, {real.heads} heads")
    assert real.parameters == 20_430_401_088 and real.layers == 60 and real.heads == 24   # 40.86 GB in bf16
    info = inspect_model(qwen)
    assert (info.family, info.variant, info.layout) == ("qwen-image", "qwen-image", "diffusers")


def test_a_prefixed_file_and_a_gguf_file_are_read(qwen, tmp_path):
    from safetensors import safe_open
    prefixed = str(tmp_path / "prefixed.safetensors")
    with safe_open(qwen, "pt") as f:   # the tiny model's metadata carries its RoPE split (a real file's is fixed)
        metadata = f.metadata()
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(qwen).items()}, prefixed, metadata=metadata)
    assert inspect_model(prefixed).prefix == "model.diffusion_model."
    gguf = write_tiny("qwen-image", str(tmp_path), format="gguf", quant="Q8_0")
    info = inspect_model(gguf)
    assert (info.family, info.format) == ("qwen-image", "gguf") and "Q8_0" in info.quantization


# ---- one forward equals the reference ---------------------------------------------------------------------------
CASES = [
    dict(name="text-to-image 16x16", hw=(16, 16)),
    dict(name="odd patch grid 18x14 (9x7 patches)", hw=(18, 14)),
    dict(name="odd latent 13x11 (padded)", hw=(13, 11)),
    dict(name="edit, two references by index", hw=(16, 12), refs=((12, 16), (9, 10))),
    dict(name="edit, references tiled by offset", hw=(12, 12), refs=((8, 12), (10, 6)), method="offset"),
]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_forward_equals_comfyuis_model_on_the_unmodified_diffusers_modules(qwen, model, case):
    flow = FlowModel(load_model(qwen))
    h, w = case["hw"]
    x, cond = randn(1, 2, 16, h, w), randn(2, 1, 9, CONTEXT)
    refs = tuple(randn(3 + i, 1, 16, 1, *s) for i, s in enumerate(case.get("refs", ())))
    method = case.get("method", "")
    sides = [Conditioning(cond, references=refs, reference_method=method)]
    got = flow.velocity(x, torch.tensor(0.63), flow.prepare(sides, 2))
    want = reference_velocity(model, x, 0.63, cond, [r[:, :, 0] for r in refs], method or "index")
    assert got.shape == x.shape
    assert report(f"Qwen-Image {case['name']}: engine vs reference", (got - want).abs().max(), bound(want))


def test_reference_latents_steer_the_result(model):
    m = model
    x, cond = randn(1, 1, 16, 8, 8), randn(2, 1, 5, CONTEXT)
    plain = reference_velocity(m, x, 0.5, cond)
    edited = reference_velocity(m, x, 0.5, cond, [randn(3, 1, 16, 8, 8)])
    assert (plain - edited).abs().max() > 100 * bound(plain)


# ---- sampling: ComfyUI's schedule, CFG, CFGNorm, the one-frame LATENT --------------------------------------------
def test_aura_flow_sigmas_are_comfyuis():
    """ModelSamplingAuraFlow as the Qwen-Image templates set it: the engine's schedule equals ComfyUI's formula, and the
    values ComfyUI gives (shift 3.1 over 20 steps starts 1.0, 0.983306, 0.965398; shift 3.0 over 4 is 1, .9, .75,
    .5, 0)."""
    for shift, steps in ((3.1, 20), (3.0, 4), (3.0, 20)):
        got = compute_sigmas(FlowSampling.discrete_flow(shift, 1.0), "simple", steps)
        assert torch.allclose(got, aura_flow_sigmas(shift, steps), atol=1e-6), (shift, steps)
    assert torch.allclose(compute_sigmas(FlowSampling.discrete_flow(3.1, 1.0), "simple", 20)[:3],
                          torch.tensor([1.0, 0.983306, 0.965398]), atol=1e-6)
    assert torch.allclose(compute_sigmas(FlowSampling.discrete_flow(3.0, 1.0), "simple", 4),
                          torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-6)
    default = families.get("qwen-image").sampling("qwen-image")
    assert (default.kind, default.shift) == ("flux", 1.15)   # ModelSamplingFlux's, without a sampling node


def job(path, plan=ParallelPlan(), *, refs=(), batch=1, cfg=2.5, steps=STEPS, hw=(16, 16), **kw):
    """A request as the xDiT nodes build it for the stock template: AuraFlow 3.1, a negative of another length."""
    refs = [randn(5 + i, 1, 16, 1, *s) for i, s in enumerate(refs)] or None
    kw.setdefault("neg_cond", randn(12, 1, 4, CONTEXT))
    return GenerateRequest(model=path, cond=randn(11, 1, 9, CONTEXT),
                           latent_raw=fix_empty_latent(inspect_model(path), torch.zeros(batch, 16, *hw)), seed=42,
                           steps=steps, cfg=cfg, reference_latents=refs, neg_reference_latents=refs,
                           model_sampling={"kind": "discrete_flow", "shift": 3.1, "multiplier": 1.0}, plan=plan,
                           **kw).validate(plan.world_size)


def run(engines, r):
    return engines(r.plan.world_size).submit("generate", *r.to_job()).outputs["samples"]


@pytest.mark.parametrize("refs,cfg_norm", [((), 0.0), (((8, 12),), 1.0)], ids=["text-to-image", "edit+CFGNorm"])
def test_one_rank_sampling_equals_the_reference_ksampler(qwen, model, engines, refs, cfg_norm):
    r = job(qwen, refs=refs, cfg_norm=cfg_norm)
    got = run(engines, r)
    want = reference_sample(model, r.cond, r.neg_cond, r.latent_raw, 42, STEPS, 2.5, 3.1,
                            [t[:, :, 0] for t in r.reference_latents or ()], cfg_norm)
    assert got.shape == (1, 16, 1, 16, 16)   # the one-frame LATENT KSampler gives a Wan21 model
    assert report(f"Qwen-Image sampled ({'edit, CFGNorm 1' if refs else 'text-to-image'}) vs reference KSampler",
                  (got - want).abs().max(), bound(want, STEPS, 2.5))


# ---- every plan equals one rank ---------------------------------------------------------------------------------
PLANS = [dict(ulysses=2), dict(ring=2), dict(cfg=2), dict(dp=2), dict(pipefusion=2), dict(ulysses=2, ring=2),
         dict(cfg=2, ulysses=2)]


@pytest.mark.parametrize("degrees", PLANS, ids=lambda d: ParallelPlan(**d).describe().replace(" ", ""))
def test_every_plan_equals_one_rank(qwen, engines, degrees):
    plan = ParallelPlan(**degrees)
    batch = 2 if plan.dp > 1 else 1
    kw = dict(warmup_steps=STEPS) if plan.pipefusion > 1 else {}
    one = run(engines, job(qwen, batch=batch))
    many = run(engines, job(qwen, plan, batch=batch, **kw))
    assert report(f"Qwen-Image {plan.describe()} vs one rank", (many - one).abs().max(), bound(one, STEPS, 2.5))


def test_pipefusion_after_one_warmup_step_stays_close_and_closes_in_as_steps_shrink(qwen, engines):
    """The patch path (stale K/V of the other band, text only with band 0) with a positive and negative of the same
    length, batched into one call: within 15% relative L2 of the exact latent at 3 steps, and at least twice closer at
    12 (the bound and its reason: tests/test_pipefusion.py)."""
    rel = {}
    for steps in (3, 12):
        same = dict(steps=steps, neg_cond=randn(13, 1, 9, CONTEXT))   # as long as the positive: one batched call
        one = run(engines, job(qwen, **same))
        staged = run(engines, job(qwen, ParallelPlan(pipefusion=2), warmup_steps=1, **same))
        rel[steps] = float((staged - one).norm() / one.norm())
        print(f"Qwen-Image pipefusion2 W=1, {steps} steps: relative L2 {rel[steps]:.4f}")
    assert rel[3] <= 0.15 and rel[12] <= rel[3] / 2


@pytest.mark.parametrize("degrees", [dict(ulysses=2), dict(ring=2), dict(cfg=2)],
                         ids=lambda d: ParallelPlan(**d).describe())
def test_every_plan_equals_one_rank_with_reference_latents(qwen, engines, degrees):
    """A 16x16 image (64 tokens) and a 10x14 reference (35): split as one sequence they do not divide, so every rank
    holds the reference tokens whole (joint); the 9-token prompt is joint too."""
    plan = ParallelPlan(**degrees)
    one = run(engines, job(qwen, refs=((10, 14),)))
    many = run(engines, job(qwen, plan, refs=((10, 14),)))
    assert report(f"Qwen-Image edit {plan.describe()} vs one rank", (many - one).abs().max(), bound(one, STEPS, 2.5))


@pytest.mark.parametrize("degrees,refs", [(dict(ulysses=2), ()), (dict(ring=2), ()), (dict(ulysses=2, ring=2), ()),
                                           (dict(ulysses=2), ((10, 12),)), (dict(ring=2), ((10, 12),))],
                         ids=lambda d: ParallelPlan(**d).describe().replace(" ", "") if isinstance(d, dict) else
                         ("edit" if d else "t2i"))
def test_an_image_whose_tokens_the_degree_does_not_divide_is_padded_and_equals_one_rank(qwen, engines, degrees, refs):
    """An 18x18 latent is 9x9 = 81 image tokens: the last rank's shard ends in pad rows no softmax sees. With a
    10x12 reference (30 tokens; 111 in all, odd) the references are joint and the image tokens alone padded. The
    9-token prompt is joint, the 4-token negative split with the image."""
    plan = ParallelPlan(**degrees)
    one = run(engines, job(qwen, refs=refs, hw=(18, 18)))
    many = run(engines, job(qwen, plan, refs=refs, hw=(18, 18)))
    assert many.shape == one.shape == (1, 16, 1, 18, 18)
    assert report(f"Qwen-Image {'edit ' if refs else ''}{plan.describe()} 81 image tokens (padded) vs one rank",
                  (many - one).abs().max(), bound(one, STEPS, 2.5))


# ---- files: quantized, LoRAs ------------------------------------------------------------------------------------
def test_a_gguf_file_gives_the_latent_of_its_dequantized_plain_copy(qwen, engines, tmp_path):
    import gguf
    import numpy as np
    path = write_tiny("qwen-image", str(tmp_path), format="gguf", quant="Q8_0")
    reader = gguf.GGUFReader(path)
    plain = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.array(t.data), t.tensor_type),
                                                           dtype=np.float32)).reshape(
        tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    field = reader.get_field("xdit.synthetic")
    plain_path = str(tmp_path / "plain.safetensors")
    save_file(plain, plain_path, metadata={"xdit.synthetic": str(bytes(field.parts[field.data[-1]]), "utf-8")})
    want, got = run(engines, job(plain_path)), run(engines, job(path))
    assert report("Qwen-Image GGUF Q8_0 vs its dequantized plain copy", (got - want).abs().max(),
                  bound(want, STEPS, 2.5))


def test_a_plain_fp8_file_equals_its_weights_upcast(engines, tmp_path):
    """Comfy-Org's qwen_image_fp8_e4m3fn files are plain fp8 (no scale): the weights cast per call equal the same values
    stored in fp32."""
    path = write_tiny("qwen-image", str(tmp_path), dtype="fp8_e4m3fn")
    plain_path = str(tmp_path / "upcast.safetensors")
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        save_file({k: f.get_tensor(k).float() for k in f.keys()}, plain_path, metadata=f.metadata())
    want, got = run(engines, job(plain_path)), run(engines, job(path))
    assert report("Qwen-Image fp8 vs its weights upcast", (got - want).abs().max(), bound(want, STEPS, 2.5))


LORA_LAYERS = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.0.proj",
               "transformer_blocks.2.txt_mod.1", "transformer_blocks.3.attn.to_add_out", "txt_in", "proj_out"]


@pytest.mark.parametrize("fmt", ["diffusers", "kohya", "comfyui"])
def test_a_lora_in_the_formats_people_share_equals_the_merged_checkpoint(qwen, engines, tmp_path, fmt):
    weights = make_state_dict("qwen-image")
    g = torch.Generator().manual_seed(9)
    lora, merged = {}, {k: v.clone() for k, v in weights.items()}
    for layer in LORA_LAYERS:
        n_out, n_in = weights[layer + ".weight"].shape
        down, up = torch.randn(4, n_in, generator=g) * 0.1, torch.randn(n_out, 4, generator=g) * 0.1
        if fmt == "kohya":
            name = "lora_unet_" + layer.replace(".", "_")
            lora.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(8.0)})
            scale = 8.0 / 4
        else:
            prefix = "transformer." if fmt == "diffusers" else "diffusion_model."
            lora.update({f"{prefix}{layer}.lora_A.weight": down, f"{prefix}{layer}.lora_B.weight": up})
            scale = 1.0
        merged[layer + ".weight"] = weights[layer + ".weight"] + 0.8 * scale * (up @ down)
    lora_path, merged_path = str(tmp_path / f"lora-{fmt}.safetensors"), str(tmp_path / "merged.safetensors")
    save_file(lora, lora_path)
    from safetensors import safe_open
    with safe_open(qwen, "pt") as f:
        metadata = f.metadata()
    save_file(merged, merged_path, metadata=metadata)
    want = run(engines, job(merged_path))
    got = run(engines, job(qwen, loras=[(lora_path, 0.8)]))
    assert report(f"Qwen-Image {fmt} LoRA vs merged checkpoint", (got - want).abs().max(), bound(want, STEPS, 2.5))


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_a_sampling_node_with_another_timestep_scale_is_refused(qwen):
    with pytest.raises(ValueError, match="ModelSamplingDiscreteFlow shift 3, multiplier 1000 gives qwen-image "
                                         "timesteps of sigma x 1000, but it takes sigma x 1"):
        GenerateRequest(model=qwen, cond=randn(1, 1, 4, CONTEXT), latent_raw=torch.zeros(1, 16, 1, 8, 8),
                        model_sampling={"kind": "discrete_flow", "shift": 3.0, "multiplier": 1000.0}).validate(1)


def test_pooled_conditioning_is_refused_and_a_five_d_latent_is_required(qwen):
    with pytest.raises(ValueError, match="pooled is given but qwen-image takes no pooled conditioning"):
        GenerateRequest(model=qwen, cond=randn(1, 1, 4, CONTEXT), pooled=torch.zeros(1, 768),
                        latent_raw=torch.zeros(1, 16, 1, 8, 8)).validate(1)
    with pytest.raises(ValueError, match=r"latent of shape \[1, 16, 8, 8\] is invalid: qwen-image takes "
                                         r"\[B, 16, 1, H/8, W/8\]"):
        GenerateRequest(model=qwen, cond=randn(1, 1, 4, CONTEXT), latent_raw=torch.zeros(1, 16, 8, 8)).validate(1)
    assert fix_empty_latent(inspect_model(qwen), torch.zeros(2, 4, 8, 8)).shape == (2, 16, 1, 8, 8)   # EmptyLatent


def test_pipefusion_refuses_an_odd_latent_naming_the_size(qwen):
    with pytest.raises(ValueError, match="pipefusion's row bands need a latent of whole 2x2 patches"):
        GenerateRequest(model=qwen, cond=randn(1, 1, 4, CONTEXT), latent_raw=torch.zeros(1, 16, 1, 9, 8),
                        plan=ParallelPlan(pipefusion=2)).validate(2)


def test_make_tiny_writes_a_qwen_image_file_and_says_what_it_takes(tmp_path):
    from engine.cli import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["make-tiny", "--kind", "qwen-image", "--out", str(tmp_path)]) == 0
    print(out.getvalue())
    assert "qwen-image, diffusers layout" in out.getvalue() and "[B, 16, 1, H/8, W/8]" in out.getvalue()
    assert math.isclose(inspect_model(str(tmp_path / "tiny-qwen-image.safetensors")).parameters, 2_482_560)


def test_diffusers_own_positions_are_not_comfyuis_on_odd_grids(model):
    """Why the engine replaces the RoPE table: driven with img_shapes alone, diffusers centres an odd patch grid one
    row lower (r - ceil(h/2)) than ComfyUI (r - h//2), far beyond rounding; on even grids the two agree."""
    for hw, differs in (((18, 14), True), ((16, 16), False)):
        x, cond = randn(1, 2, 16, *hw), randn(2, 1, 9, CONTEXT)
        want = reference_velocity(model, x, 0.63, cond)
        rows, cols = (hw[0] + 1) // 2, (hw[1] + 1) // 2
        out = model(hidden_states=pad_pack(x), encoder_hidden_states=cond.expand(2, -1, -1),
                    timestep=torch.full((2,), 0.63), img_shapes=[[(1, rows, cols)]] * 2, return_dict=False)[0]
        v = out.reshape(2, rows, cols, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 16, rows * 2, cols * 2)
        diff = (v[:, :, :hw[0], :hw[1]] - want).abs().max()
        print(f"{hw}: diffusers' own positions vs ComfyUI's: max abs diff {diff:.3g} (bound {bound(want):.3g})")
        assert (diff > 100 * bound(want)) == differs


# ---- through the nodes ----------------------------------------------------------------------------------------
def test_the_nodes_take_qwens_conditioning_and_empty_latent_and_give_the_reference_ksamplers_latent(qwen, model):
    """The edit template's values as ComfyUI passes them: TextEncodeQwenImageEdit's CONDITIONING (no pooled output,
    the VAE's one-frame reference latent appended), EmptySD3LatentImage's 4-D latent, xDiT Model Sampling (aura_flow
    3.1) and xDiT CFGNorm (1.0) on the engine: the LATENT is the reference KSampler's, one frame [B, 16, 1, H/8, W/8]."""
    import importlib
    from conftest import PACK_NAME, load_pack
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    ref = randn(5, 1, 16, 1, 8, 12)
    positive = [[randn(11, 1, 9, CONTEXT), {"pooled_output": None, "reference_latents": [ref]}]]
    negative = [[randn(12, 1, 4, CONTEXT), {"pooled_output": None, "reference_latents": [ref]}]]
    engine = core.EngineSettings(model_path=qwen, gpus=(0,), device="cpu").with_sampling("aura_flow", 3.1)
    try:
        out = core.sample(engine.with_cfg_norm(1.0), positive, negative, {"samples": torch.zeros(1, 16, 16, 16)},
                          seed=42, steps=STEPS, cfg=2.5, sampler_name="euler", scheduler="simple", denoise=1.0)
    finally:
        core.REGISTRY.unload()
    want = reference_sample(model, positive[0][0], negative[0][0], torch.zeros(1, 16, 1, 16, 16), 42, STEPS, 2.5, 3.1,
                            [ref[:, :, 0]], 1.0)
    assert out["samples"].shape == (1, 16, 1, 16, 16)
    assert report("Qwen-Image edit through the xDiT nodes vs reference KSampler", (out["samples"] - want).abs().max(),
                  bound(want, STEPS, 2.5))


def test_generate_takes_references_sampling_node_and_cfg_norm_from_the_command_line(qwen, model, tmp_path):
    """`python -m engine generate` with the edit template's settings: the cond file's ref_0/neg_ref_0, --sampling
    aura_flow --shift 3.0, --cfg-norm 1: the LATENT file equals the reference KSampler; half a flag pair is exit 2."""
    import subprocess
    import sys
    from conftest import ROOT
    cond, neg, ref = randn(11, 1, 9, CONTEXT), randn(12, 1, 4, CONTEXT), randn(5, 1, 16, 1, 6, 8)
    save_file({"cond": cond, "neg_cond": neg, "ref_0": ref, "neg_ref_0": ref.clone()}, str(tmp_path / "c.safetensors"))
    base = [sys.executable, "-m", "engine", "generate", "--model", qwen, "--cond", str(tmp_path / "c.safetensors"),
            "--seed", "42", "--steps", str(STEPS), "--cfg", "2.5", "--width", "96", "--height", "64",
            "--out", str(tmp_path / "o.safetensors")]
    bad = subprocess.run(base + ["--shift", "3.0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(bad.stderr)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--shift: 3 needs --sampling" in bad.stderr
    res = subprocess.run(base + ["--sampling", "aura_flow", "--shift", "3.0", "--cfg-norm", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = load_file(str(tmp_path / "o.safetensors"))["samples"]
    want = reference_sample(model, cond, neg, torch.zeros(1, 16, 1, 8, 12), 42, STEPS, 2.5, 3.0, [ref[:, :, 0]], 1.0)
    assert got.shape == (1, 16, 1, 8, 12)
    assert report("Qwen-Image edit via python -m engine generate vs reference KSampler", (got - want).abs().max(),
                  bound(want, STEPS, 2.5))
