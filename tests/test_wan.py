"""Wan 2.1 and 2.2: the engine's velocity and sampled latent equal an independent reference built here from ComfyUI's
Wan formulas (ComfyUI 0.3.64 / 0.33.0: comfy/ldm/wan/model.py, comfy/model_base.py WAN21 / WAN22,
comfy/latent_formats.py Wan21 / Wan22, comfy/supported_models.py WAN21_* / WAN22_T2V), text-to-video, image-to-video
(CLIP-vision tokens and the concatenated mask + image latent), first-last-frame, Wan 2.2's A14B image-to-video expert and TI2V-5B (48-channel
latent, the start image through the noise mask, one timestep per latent frame); every plan equals one rank; quantized
files equal their plain copies; LoRAs in the formats people share equal the merged checkpoint; ComfyUI's own WanModel
(when COMFYUI_PATH is set) equals the engine.

The reference restates ComfyUI's model without the engine's code and drives the unmodified diffusers
WanTransformer3DModel's modules (with diffusers' own attention processor) in ComfyUI's order: the latent padded
circularly to whole 2x2 patches, patch-embedded, tokens in (frame, row, column) order; RoPE from EmbedND's float64
angles over (frame, row, column) with head dims d - 4(d/6), 2(d/6), 2(d/6); the time embedding [cos, sin] of
t x 10000^(-k/128) in float32 (t = sigma x 1000), per item or, for TI2V-5B under a noise mask, per latent frame
(each frame's mean mask x t) repeated over the frame's tokens; the text through text_embedding; CLIP features through
img_emb (a first-last-frame model adds emb_pos as ComfyUI does) in front of the text; the head's modulation from the
time embedding; unpatchify. c_concat: 4 channels of 1 - concat_mask, then the image latent process_in'd. Sampling:
ModelSamplingDiscreteFlow shift 8 (x1000), KSampler's simple schedule, euler, CFG on denoised, KSamplerX0Inpaint's
noise mask with WAN22's scale_latent_inpaint (the kept latent enters clean).
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import families
from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import inspect_model, load_model, load_transformer
from engine.models.tiny import make_state_dict, write_tiny
from engine.parallel.plan import ParallelPlan, Workload
from engine.runtime.client import Engine

from conftest import FAST, ROOT
from tolerance import fp32_bound, report, sampling_amplification

WAN21_MEAN = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921])
WAN21_STD = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160])
TEXT_DIM = 4096   # umT5-XXL: ComfyUI's WanModel takes this width, so the tiny files keep it
DEPTH = 4         # the tiny models' blocks
STEPS = 2
SHIFT = 8.0       # supported_models.WAN21_T2V.sampling_settings
VARIANTS = ("wan2.1-1.3b", "wan2.1-i2v-14b", "wan2.1-flf2v-14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b")


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
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan")
    return {v: write_tiny("wan", str(d), variant=v) for v in VARIANTS}


@pytest.fixture(scope="module")
def references(files):
    """Each tiny file in the unmodified diffusers model, with diffusers' own attention processor."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    out = {}
    for variant, path in files.items():
        model = load_transformer(path).model
        model.set_attn_processor(WanAttnProcessor())
        out[variant] = model
    return out


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the independent reference -----------------------------------------------------------------------------------
def process_in(z, mean, std):
    shape = (1, -1) + (1,) * (z.ndim - 2)
    return (z - mean.view(shape)) / std.view(shape)


def process_out(z, mean, std):
    shape = (1, -1) + (1,) * (z.ndim - 2)
    return z * std.view(shape) + mean.view(shape)


def latent_stats(variant):
    """Wan21's per-channel statistics, or Wan22's (TI2V-5B), from ComfyUI's latent_formats.py."""
    if variant != "wan2.2-ti2v-5b":
        return WAN21_MEAN, WAN21_STD
    from engine.families.wan import WAN22_MEAN, WAN22_STD   # ComfyUI's 48 numbers (the ComfyUI test uses its own)
    return torch.tensor(WAN22_MEAN), torch.tensor(WAN22_STD)


def comfy_rope(frames, rows, cols, head_dim):
    """EmbedND over (frame, row, column) ids from 0, axes [d - 4(d/6), 2(d/6), 2(d/6)], theta 10000, float64 angles,
    in the (cos, sin) layout diffusers' processor takes: each frequency for both channels of its pair."""
    third = head_dim // 6
    axes = (head_dim - 4 * third, 2 * third, 2 * third)
    ids = torch.tensor([[f, r, c] for f in range(frames) for r in range(rows) for c in range(cols)],
                       dtype=torch.float64)
    cos, sin = [], []
    for axis, d in enumerate(axes):
        omega = 1.0 / 10000 ** torch.linspace(0, (d - 2) / d, d // 2, dtype=torch.float64)
        angles = ids[:, axis:axis + 1] * omega
        cos.append(torch.cos(angles).float())
        sin.append(torch.sin(angles).float())
    cos, sin = (torch.cat(t, dim=1).repeat_interleave(2, dim=1)[None, :, None] for t in (cos, sin))
    return cos, sin


def comfy_sinusoid(t):
    """sinusoidal_embedding_1d(256, t): [cos, sin] of t x 10000^(-k/128), float32."""
    angles = torch.outer(t.float(), torch.pow(10000, -torch.arange(128).float().div(128)))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


@torch.no_grad()
def reference_velocity(m, x, t, cond, clip=None):
    """ComfyUI's WanModel on the diffusers modules: x [n, in, F, h, w] (model space, c_concat attached), t the model
    timestep [n] or [n, F] -> v [n, out, F, h, w]."""
    n, _, frames, h, w = x.shape
    x = F.pad(x, (0, w % 2, 0, h % 2, 0, 0), mode="circular")
    rows, cols = x.shape[-2] // 2, x.shape[-1] // 2
    tokens = m.patch_embedding(x).flatten(2).transpose(1, 2)
    embed = m.condition_embedder
    temb = embed.time_embedder(comfy_sinusoid(t.reshape(-1)))
    if t.ndim == 2:   # repeat_e: each latent frame's modulation for its tokens
        temb = temb.reshape(n, frames, -1).repeat_interleave(rows * cols, dim=1)
        proj = embed.time_proj(F.silu(temb)).unflatten(2, (6, -1))
    else:
        proj = embed.time_proj(F.silu(temb)).unflatten(1, (6, -1))
    context = embed.text_embedder(cond.expand(n, -1, -1).contiguous())
    if clip is not None:
        image = embed.image_embedder
        clip = clip.expand(n, -1, -1).contiguous()
        if image.pos_embed is not None:   # MLPProj with emb_pos: the first 514 tokens plus as many positions
            clip = clip[:, :image.pos_embed.shape[1]] + image.pos_embed[:, :clip.shape[1]]
        context = torch.cat([image.norm2(image.ff(image.norm1(clip))), context], dim=1)
    rope = comfy_rope(frames, rows, cols, m.config.attention_head_dim)
    for block in m.blocks:
        tokens = block(tokens, context, proj, rope)
    if temb.ndim == 3:
        shift, scale = (m.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
    else:
        shift, scale = (m.scale_shift_table + temb.unsqueeze(1)).unbind(1)
        shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
    out = m.proj_out(m.norm_out(tokens) * (1 + scale) + shift)
    out = out.view(n, frames, rows, cols, 1, 2, 2, -1)
    v = torch.einsum("bfhwpqrc->bcfphqwr", out).reshape(n, -1, frames, rows * 2, cols * 2)
    return v[:, :, :, :h, :w]


def comfy_concat(image_raw, mask):
    """model_base.WAN21.concat_cond: 4 channels of 1 - mask (its channel mean unless 4; later frames 0), then the image
    latent process_in'd."""
    image = process_in(image_raw, WAN21_MEAN, WAN21_STD)
    if mask.shape[1] != 4:
        mask = mask.mean(dim=1, keepdim=True)
    mask = 1.0 - mask
    mask = F.pad(mask, (0, 0, 0, 0, 0, image.shape[2] - mask.shape[2]))
    if mask.shape[1] == 1:
        mask = mask.repeat(1, 4, 1, 1, 1)
    return torch.cat([mask, image], dim=1)


def simple_sigmas(steps, shift=SHIFT):
    """ModelSamplingDiscreteFlow (1000 entries, t = i/1000, shift t / (1 + (shift - 1) t)) and the simple schedule."""
    t = torch.arange(1, 1001, dtype=torch.float32) / 1000
    table = shift * t / (1 + (shift - 1) * t)
    return torch.tensor([float(table[-(1 + int(i * 1000 / steps))]) for i in range(steps)] + [0.0])


@torch.no_grad()
def reference_sample(m, variant, j):
    """KSampler, euler/simple, on the reference model: seeded noise, CFG on denoised, and with a noise mask
    KSamplerX0Inpaint as TI2V-5B's WAN22 has it (the kept latent enters clean; per-frame timesteps)."""
    mean, std = latent_stats(variant)
    latent = j["latent_raw"]
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(j["seed"]))
    x0 = process_in(latent, mean, std) if torch.count_nonzero(latent) else latent
    mask = j.get("noise_mask")
    if mask is not None:
        mask = mask.expand(latent.shape[0], latent.shape[1], *mask.shape[2:])
    sigmas = simple_sigmas(STEPS)
    x = sigmas[0] * noise + (1 - sigmas[0]) * x0

    def v(x_in, sigma, side):
        t = torch.full((x_in.shape[0],), float(sigma) * 1000)
        if mask is not None and variant == "wan2.2-ti2v-5b":
            t = mask.mean(dim=(1, 3, 4)) * t[:, None]
        if side.get("concat") is not None:
            x_in = torch.cat([x_in, side["concat"].expand(x_in.shape[0], -1, -1, -1, -1)], dim=1)
        return reference_velocity(m, x_in, t, side["cond"], side.get("clip"))

    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        x_in = x * mask + x0 * (1 - mask) if mask is not None else x
        denoised = x_in - v(x_in, s, j["pos"]) * s
        if j["cfg"] != 1.0:
            neg = x_in - v(x_in, s, j["neg"]) * s
            denoised = neg + (denoised - neg) * j["cfg"]
        if mask is not None:
            denoised = denoised * mask + x0 * (1 - mask)
        x = x + (x - denoised) / s * (s_next - s)
    return process_out(x, mean, std)


def bound(want, steps=1, cfg=1.0):
    return fp32_bound(want.abs().max(), reduction=TEXT_DIM, depth=DEPTH,
                      amplification=sampling_amplification(steps, cfg))


# ---- files, detection, the layout ------------------------------------------------------------------------------------
def meta_model(**config):
    from diffusers import WanTransformer3DModel
    with torch.device("meta"):
        return WanTransformer3DModel(**config)


@pytest.mark.parametrize("variant", ["wan2.1-1.3b", "wan2.1-14b", "wan2.1-i2v-14b", "wan2.2-i2v-a14b",
                                     "wan2.2-ti2v-5b"])
def test_the_full_size_wan_layout_converts_exactly_into_the_diffusers_transformer(variant):
    """The Wan-AI / ComfyUI key table at full size (meta) through diffusers' own converter is the diffusers model's
    state dict exactly, and the engine's key map is that converter's; parameters as the released models have them."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from engine.families.wan import DIMS, key_map, shapes
    info = inspect_model(f"synthetic:{variant}")
    checkpoint = {k: torch.empty(s, device="meta") for k, s in shapes(DIMS["full"][variant]).items()}
    converted = convert_wan_transformer_to_diffusers(dict(checkpoint))
    model = meta_model(**info.config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected
    ours = {dst: src for dst, src, _ in key_map("wan", info.config)}
    theirs = {k: src for src in checkpoint for k, t in convert_wan_transformer_to_diffusers({src: checkpoint[src]})
              .items()}
    assert ours == theirs
    params = sum(p.numel() for p in model.parameters())
    print(f"{variant}: {params:,} parameters ({info.parameters:,} counted from the Wan layout), {info.layers} blocks, "
          f"{info.heads} heads")
    assert info.parameters == params and info.heads * 128 == model.scale_shift_table.shape[-1]


def test_the_first_last_frame_position_embedding_lands_on_diffusers_pos_embed(files):
    """diffusers' converter leaves img_emb.emb_pos out; the engine maps it to image_embedder.pos_embed."""
    loaded = load_model(files["wan2.1-flf2v-14b"])
    with safe_open(files["wan2.1-flf2v-14b"], "pt") as f:
        emb_pos = f.get_tensor("img_emb.emb_pos")
    assert emb_pos.shape == (1, 514, 1280)
    assert torch.equal(loaded.model.condition_embedder.image_embedder.pos_embed, emb_pos)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tiny_file_is_detected_as_its_variant(files, variant):
    info = inspect_model(files[variant])
    expected = families.get("wan").dims["tiny"][variant]
    assert (info.family, info.variant, info.layout) == ("wan", variant, "wan")
    assert (info.config["in_channels"], info.config["out_channels"], info.heads) == (expected.in_channels,
                                                                                      expected.out_channels, 4)
    assert info.latent.name == ("Wan22" if variant == "wan2.2-ti2v-5b" else "Wan21")


def test_other_wan_models_and_channel_counts_are_refused_in_one_line(tmp_path):
    from engine.models.safetensors_file import CheckpointError
    state = make_state_dict("wan2.1-1.3b")
    vace = str(tmp_path / "vace.safetensors")
    save_file(dict(state, **{"vace_patch_embedding.weight": torch.zeros(512, 96, 1, 2, 2)}), vace)
    fun = str(tmp_path / "fun.safetensors")
    save_file(dict(state, **{"patch_embedding.weight": torch.zeros(512, 48, 1, 2, 2)}), fun)
    for path, words in ((vace, "a Wan VACE transformer"), (fun, "48 input and 16 output channels")):
        with pytest.raises(CheckpointError) as e:
            inspect_model(path)
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_diffusers_folder_and_a_prefixed_full_checkpoint_give_the_wan_files_velocity(files, tmp_path):
    """The same weights as a diffusers folder (config.json + diffusion_pytorch_model.safetensors) and as a ComfyUI
    SaveCheckpoint file (model.diffusion_model. prefix, VAE and text-encoder tensors beside): the same model (to fp32
    rounding: the folder's tensors lie differently in memory)."""
    path = files["wan2.1-i2v-14b"]
    native = load_model(path)
    folder = tmp_path / "transformer"
    native.model.save_pretrained(str(folder))
    full = write_tiny("wan", str(tmp_path), variant="wan2.1-i2v-14b", full=True)
    x, cond, clip = randn(1, 1, 16, 2, 6, 6), randn(2, 1, 9, TEXT_DIM), randn(3, 1, 257, 1280)
    side = Conditioning(cond, image_context=clip, concat_latent=randn(4, 1, 16, 2, 6, 6))
    want = FlowModel(native).velocity(x, torch.tensor(0.5), FlowModel(native).prepare([side], 1))
    for source in (str(tmp_path), full):
        info = inspect_model(source)
        print(f"{source}: {info.variant}, {info.layout} layout, prefix {info.prefix!r}, {info.ignored} other tensors")
        assert info.variant == "wan2.1-i2v-14b" and info.layout == ("diffusers" if source == str(tmp_path) else "wan")
        flow = FlowModel(load_model(source))
        got = flow.velocity(x, torch.tensor(0.5), flow.prepare([side], 1))
        assert report(f"Wan {info.layout} layout vs the Wan file", (got - want).abs().max(), bound(want))


# ---- one forward equals the reference --------------------------------------------------------------------------------
CASES = [
    dict(name="text-to-video, 3 frames 8x8", variant="wan2.1-1.3b", shape=(3, 8, 8)),
    dict(name="text-to-video, odd latent 7x9 (padded)", variant="wan2.1-1.3b", shape=(2, 7, 9)),
    dict(name="image-to-video 2.1 (257 CLIP tokens)", variant="wan2.1-i2v-14b", shape=(3, 8, 6), clip=257),
    dict(name="first-last-frame (514 CLIP tokens, 4-channel mask)", variant="wan2.1-flf2v-14b", shape=(3, 6, 8),
         clip=514, mask_channels=4),
    dict(name="first-last-frame with one image's 257 tokens", variant="wan2.1-flf2v-14b", shape=(2, 6, 8), clip=257),
    dict(name="Wan 2.2 A14B image-to-video expert (no CLIP)", variant="wan2.2-i2v-a14b", shape=(3, 8, 8)),
    dict(name="TI2V-5B, one timestep per latent frame", variant="wan2.2-ti2v-5b", shape=(3, 6, 10), per_frame=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_forward_equals_comfyuis_model_on_the_unmodified_diffusers_modules(files, references, case):
    variant = case["variant"]
    flow = FlowModel(load_model(files[variant]))
    channels = flow.loaded.info.latent.channels
    frames, h, w = case["shape"]
    x = randn(1, 2, channels, frames, h, w)
    # with CLIP tokens diffusers' own processor takes the last 512 context tokens as the text: give it 512, as umT5's
    # tokenizer pads them (zeros after the prompt)
    cond = F.pad(randn(2, 1, 9, TEXT_DIM), (0, 0, 0, 503 if case.get("clip") else 0))
    side = Conditioning(cond)
    clip = randn(3, 1, case["clip"], 1280) if case.get("clip") else None
    side.image_context = clip
    concat = None
    if flow.loaded.info.config["in_channels"] == 36:
        side.concat_latent = randn(4, 1, 16, frames, h, w)
        side.concat_mask = torch.ones(1, case.get("mask_channels", 1), frames, h, w)
        side.concat_mask[:, :, 0] = 0.0
        concat = comfy_concat(side.concat_latent, side.concat_mask)
    sigma = torch.tensor(0.63)
    mask = None
    if case.get("per_frame"):   # Wan22ImageToVideoLatent: the first frame kept; a second one half
        mask = torch.ones(2, channels, frames, h, w)
        mask[:, :, 0] = 0.0
        mask[1, :, 1, : h // 2] = 0.0
    got = flow.velocity(x, sigma, flow.prepare([side], 2, denoise_mask=mask))
    t = torch.full((2,), 630.0)
    if mask is not None:
        t = mask.mean(dim=(1, 3, 4)) * t[:, None]
        print(f"per-frame timesteps: {t.tolist()}")
    x_in = torch.cat([x, concat.expand(2, -1, -1, -1, -1)], dim=1) if concat is not None else x
    want = reference_velocity(references[variant], x_in, t, cond, clip)
    assert got.shape == x.shape
    assert report(f"Wan {case['name']}: engine vs reference", (got - want).abs().max(), bound(want))


def test_the_image_context_and_the_per_frame_timestep_steer_the_result(files, references):
    """The CLIP tokens, the concatenated image and each frame's own timestep move the velocity far beyond rounding."""
    m = references["wan2.1-i2v-14b"]
    x, cond = randn(1, 1, 36, 2, 6, 6), F.pad(randn(2, 1, 9, TEXT_DIM), (0, 0, 0, 503))
    base = reference_velocity(m, x, torch.tensor([500.0]), cond, randn(3, 1, 257, 1280))
    other = reference_velocity(m, x, torch.tensor([500.0]), cond, randn(4, 1, 257, 1280))
    print(f"two CLIP images: max abs diff {(base - other).abs().max():.3g}")
    assert (base - other).abs().max() > 10 * bound(base)
    m5 = references["wan2.2-ti2v-5b"]
    x5 = randn(5, 1, 48, 2, 6, 6)
    whole = reference_velocity(m5, x5, torch.tensor([500.0]), cond[:, :9])
    per_frame = reference_velocity(m5, x5, torch.tensor([[0.0, 500.0]]), cond[:, :9])
    assert (whole[:, :, 0] - per_frame[:, :, 0]).abs().max() > 100 * bound(whole)


def test_diffusers_own_time_embedding_is_not_comfyuis(references):
    """Why the engine replaces diffusers' sinusoid: exp(-ln(10000) k / 128) and 10000^(-k/128) round apart in
    float32, which at t ~ 1000 moves the angles by ~1e-4."""
    from diffusers.models.embeddings import get_timestep_embedding
    t = torch.tensor([999.0, 630.0])
    theirs = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    diff = (theirs - comfy_sinusoid(t)).abs().max()
    print(f"diffusers' sinusoid vs ComfyUI's at t = 999, 630: max abs diff {diff:.3g}")
    assert diff > 1e-6


# ---- ComfyUI's own model (skipped without COMFYUI_PATH) -------------------------------------------------------------
@pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="needs COMFYUI_PATH (a ComfyUI checkout)")
def test_comfyuis_own_detection_and_wan_model_equal_the_engine(files, tmp_path):
    """ComfyUI's model_detection and supported_models pick the class each tiny file is (WAN21_T2V, WAN21_I2V,
    WAN22_T2V); ComfyUI's extra_conds (c_concat from concat_latent_image / concat_mask, clip_fea, denoise_mask),
    _apply_model (process_timestep, the concatenation) and WanModel give the engine's denoised output on an odd 7x9
    latent of 3 frames."""
    folder = tmp_path / "files"
    folder.mkdir()
    for variant, path in files.items():
        os.symlink(path, folder / f"{variant}.safetensors")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    res = subprocess.run([python, os.path.join(ROOT, "tests", "comfyui_wan_check.py"), os.environ["COMFYUI_PATH"],
                          ROOT, str(folder)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    classes = {"wan2.1-1.3b": "WAN21_T2V", "wan2.1-i2v-14b": "WAN21_I2V", "wan2.1-flf2v-14b": "WAN21_I2V",
               "wan2.2-i2v-a14b": "WAN21_T2V", "wan2.2-ti2v-5b": "WAN22_T2V"}
    assert {r["variant"]: r["comfy_class"] for r in rows} == classes
    for r in rows:
        print(r)
        assert report(f"ComfyUI's WanModel ({r['comfy_class']}) vs the engine, {r['variant']}", r["max_abs_diff"],
                      fp32_bound(r["scale"], reduction=TEXT_DIM, depth=DEPTH))


# ---- sampled latents on real ranks --------------------------------------------------------------------------------
def job(variant, *, cfg=5.0, batch=1, shape=(3, 8, 8), seed=7, text=(9, 7), image=True):
    """A request's inputs as the xDiT nodes pass a ComfyUI graph's: the LATENT (EmptyHunyuanLatentVideo, or
    Wan22ImageToVideoLatent's with its noise mask), each side's CONDITIONING (with WanImageToVideo's keys)."""
    frames, h, w = shape
    channels = 48 if variant == "wan2.2-ti2v-5b" else 16
    latent = torch.zeros(batch, channels, frames, h, w)
    j = dict(latent_raw=latent, seed=seed, cfg=cfg, pos={"cond": randn(11, 1, text[0], TEXT_DIM)},
             neg={"cond": randn(12, 1, text[1], TEXT_DIM)})
    if variant in ("wan2.1-i2v-14b", "wan2.1-flf2v-14b") and image:
        clip = randn(13, 1, 257, 1280)
        j["pos"]["clip"] = j["neg"]["clip"] = clip
        for side in ("pos", "neg"):   # diffusers' own processor (the reference's) takes the last 512 tokens as the text
            j[side]["cond"] = F.pad(j[side]["cond"], (0, 0, 0, 512 - j[side]["cond"].shape[1]))
    if variant in ("wan2.1-i2v-14b", "wan2.1-flf2v-14b", "wan2.2-i2v-a14b") and image:
        start, mask = randn(14, 1, 16, frames, h, w), torch.ones(1, 1, frames, h, w)
        mask[:, :, 0] = 0.0
        j["image"] = (start, mask)
        j["pos"]["concat"] = j["neg"]["concat"] = comfy_concat(start, mask)
    if variant == "wan2.2-ti2v-5b" and image:   # Wan22ImageToVideoLatent: the encoded first frame, mask 0 there
        mean, std = latent_stats(variant)
        first = randn(15, batch, 48, 1, h, w)
        latent = torch.cat([first, process_out(torch.zeros(batch, 48, frames - 1, h, w), mean, std)], dim=2)
        mask = torch.ones(1, 1, frames, h, w)
        mask[:, :, 0] = 0.0
        j.update(latent_raw=latent, noise_mask=mask)
    return j


def request(files, variant, j, plan=ParallelPlan(), **extra):
    fields = dict(cond=j["pos"]["cond"], neg_cond=j["neg"]["cond"], clip_vision_output=j["pos"].get("clip"),
                  neg_clip_vision_output=j["neg"].get("clip"), noise_mask=j.get("noise_mask"))
    if "image" in j:
        fields.update(concat_latent_image=j["image"][0], concat_mask=j["image"][1],
                      neg_concat_latent_image=j["image"][0], neg_concat_mask=j["image"][1])
    extra.setdefault("steps", STEPS)
    return GenerateRequest(model=files[variant], latent_raw=j["latent_raw"], seed=j["seed"], cfg=j["cfg"],
                           plan=plan, **fields, **extra).validate(plan.world_size)


def run(engines, r):
    return engines(r.plan.world_size).submit("generate", *r.to_job()).outputs["samples"]


@pytest.mark.parametrize("variant", ["wan2.1-1.3b", "wan2.1-i2v-14b", "wan2.2-ti2v-5b"])
def test_one_rank_sampling_equals_the_reference_ksampler(files, references, engines, variant):
    """Text-to-video with CFG; image-to-video with WanImageToVideo's conditioning; TI2V-5B from
    Wan22ImageToVideoLatent's LATENT: its first frame kept by the noise mask (bitwise, as ComfyUI keeps it)."""
    j = job(variant)
    got = run(engines, request(files, variant, j))
    want = reference_sample(references[variant], variant, j)
    assert got.shape == j["latent_raw"].shape
    assert report(f"Wan {variant} sampled vs reference KSampler", (got - want).abs().max(),
                  bound(want, STEPS, j["cfg"]))
    if variant == "wan2.2-ti2v-5b":
        kept = (got[:, :, 0] - j["latent_raw"][:, :, 0]).abs().max()
        print(f"first frame vs the start image's latent: max abs diff {kept:.3g}")
        assert kept <= 1e-5 * j["latent_raw"].abs().max()


# ---- every plan equals one rank -------------------------------------------------------------------------------------
# 3 frames of 8x8: 48 tokens; 3 frames of 6x10: 45 tokens (padded for 2 and 4 ranks, the shard boundaries inside
# frames, so each token's per-frame modulation must travel with it)
PLANS = [
    ("wan2.1-1.3b", dict(ulysses=2), {}),
    ("wan2.1-1.3b", dict(ring=2), {}),
    ("wan2.1-1.3b", dict(ulysses=4), {}),
    ("wan2.1-1.3b", dict(ulysses=2, ring=2), dict(shape=(3, 6, 10))),
    ("wan2.1-1.3b", dict(cfg=2), {}),
    ("wan2.1-1.3b", dict(dp=2), dict(batch=2)),
    ("wan2.1-1.3b", dict(cfg=2, ulysses=2), dict(shape=(3, 6, 10))),
    ("wan2.1-i2v-14b", dict(ulysses=2), {}),
    ("wan2.1-i2v-14b", dict(cfg=2, ring=2), dict(shape=(3, 6, 10))),
    ("wan2.2-i2v-a14b", dict(ring=2), dict(shape=(3, 6, 10))),
    ("wan2.2-ti2v-5b", dict(ulysses=2), dict(shape=(3, 6, 10))),
    ("wan2.2-ti2v-5b", dict(ring=2), dict(shape=(3, 6, 10))),
    ("wan2.2-ti2v-5b", dict(ulysses=2, ring=2), dict(shape=(3, 6, 10))),
    ("wan2.2-ti2v-5b", dict(dp=2), dict(batch=2)),
]


@pytest.fixture(scope="module")
def one_rank(files, engines):
    seen = {}

    def get(variant, spec):
        key = (variant, repr(sorted(spec.items())))
        if key not in seen:
            seen[key] = run(engines, request(files, variant, job(variant, **spec)))
        return seen[key]
    return get


@pytest.mark.parametrize("variant,degrees,spec", PLANS,
                         ids=[f"{v}-{ParallelPlan(**d).describe().replace(' ', '')}-"
                              f"{'x'.join(map(str, s.get('shape', (3, 8, 8))))}" for v, d, s in PLANS])
def test_every_plan_equals_one_rank(files, engines, one_rank, variant, degrees, spec):
    plan = ParallelPlan(**degrees)
    j = job(variant, **spec)
    many = run(engines, request(files, variant, j, plan))
    one = one_rank(variant, spec)
    assert report(f"Wan {variant} {plan.describe()} {spec.get('shape', (3, 8, 8))} vs one rank",
                  (many - one).abs().max(), bound(one, STEPS, j["cfg"]))


def test_the_step_cache_runs_wans_blocks_and_agrees_across_ranks(files, engines):
    """Wan's blocks take their arguments in order and return the image tokens alone: a cache that skips nothing is
    exact; one that skips (threshold 1) skips the same calls on one rank and on ulysses2, and lands on one rank's
    latent."""
    j, steps = job("wan2.1-1.3b", cfg=1.0), 6
    plain = run(engines, request(files, "wan2.1-1.3b", j, ParallelPlan(ulysses=2), steps=steps))
    never = run(engines, request(files, "wan2.1-1.3b", j, ParallelPlan(ulysses=2), steps=steps,
                                 cache_threshold=1e-9))
    assert torch.equal(never, plain)
    results = {}
    for plan in (ParallelPlan(), ParallelPlan(ulysses=2)):
        r = request(files, "wan2.1-1.3b", j, plan, steps=steps, cache_threshold=1.0)
        result = engines(plan.world_size).submit("generate", *r.to_job())
        results[plan.describe()] = (result.outputs["samples"], [x["step_cache"]["skipped_at"] for x in result.ranks])
    (one, skipped_one), (two, skipped_two) = results.values()
    print(f"skipped calls: one rank {skipped_one}, ulysses2 {skipped_two}")
    assert skipped_one[0] and all(s == skipped_one[0] for s in skipped_one + skipped_two)
    assert report("Wan step cache, ulysses2 vs one rank", (two - one).abs().max(), bound(one, steps))


# ---- files: a second expert, quantized formats, LoRAs ----------------------------------------------------------------
def test_a_second_file_of_the_same_variant_loads_as_a_separate_model(engines, tmp_path):
    """Wan 2.2 A14B's two experts are two files of one structure: alternating them on one engine gives each file's own
    latent (the ranks reload on a changed file, never reuse the other expert's weights)."""
    high = write_tiny("wan", str(tmp_path / "high"), variant="wan2.2-i2v-a14b", seed=1)
    low = write_tiny("wan", str(tmp_path / "low"), variant="wan2.2-i2v-a14b", seed=2)
    paths = {"high": high, "low": low}
    j = job("wan2.2-i2v-a14b", cfg=1.0)
    a1 = run(engines, request(paths, "high", j))
    b = run(engines, request(paths, "low", j))
    a2 = run(engines, request(paths, "high", j))
    print(f"high vs low expert: max abs diff {(a1 - b).abs().max():.3g}")
    assert torch.equal(a1, a2) and (a1 - b).abs().max() > 100 * bound(a1, STEPS)


def dequantized_copy(path, out):
    import gguf
    import numpy as np
    reader = gguf.GGUFReader(path)
    plain = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.array(t.data), t.tensor_type),
                                                           dtype=np.float32)).reshape(
        tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    field = reader.get_field("xdit.synthetic")
    save_file(plain, out, metadata={"xdit.synthetic": str(bytes(field.parts[field.data[-1]]), "utf-8")})
    return out


def test_a_gguf_file_gives_the_latent_of_its_dequantized_plain_copy(engines, tmp_path):
    """ComfyUI-GGUF's Wan files: architecture "wan", the 5-D patch embedding kept F32 (its fix_5d_tensors tool)."""
    path = write_tiny("wan", str(tmp_path), variant="wan2.1-i2v-14b", format="gguf", quant="Q8_0")
    info = inspect_model(path)
    print(f"{info.format}: {info.quantization}")
    assert (info.family, info.format) == ("wan", "gguf") and "Q8_0" in info.quantization
    plain = dequantized_copy(path, str(tmp_path / "plain.safetensors"))
    j = job("wan2.1-i2v-14b")
    paths = {"gguf": path, "plain": plain}
    want, got = run(engines, request(paths, "plain", j)), run(engines, request(paths, "gguf", j))
    assert report("Wan GGUF Q8_0 vs its dequantized plain copy", (got - want).abs().max(), bound(want, STEPS, 5.0))


@pytest.mark.parametrize("fmt", ["fp8_scaled", "fp8_e4m3fn"])
def test_comfy_orgs_fp8_files_equal_their_weights_upcast(engines, tmp_path, fmt):
    """Comfy-Org's *_fp8_scaled files (fp8 matrices with a scale_weight each) and *_fp8_e4m3fn files."""
    path = write_tiny("wan", str(tmp_path), variant="wan2.1-1.3b",
                      **({"format": "fp8_scaled"} if fmt == "fp8_scaled" else {"dtype": "fp8_e4m3fn"}))
    with safe_open(path, "pt") as f:
        raw, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    plain = {}
    for k, t in raw.items():
        if k == "scaled_fp8" or k.endswith((".scale_weight", ".scale_input")):
            continue
        scale = raw.get(k[:-len("weight")] + "scale_weight") if k.endswith(".weight") else None
        plain[k] = t.float() * scale.float() if scale is not None else t.float()
    save_file(plain, str(tmp_path / "upcast.safetensors"), metadata=metadata)
    paths = {"fp8": path, "plain": str(tmp_path / "upcast.safetensors")}
    j = job("wan2.1-1.3b")
    want, got = run(engines, request(paths, "plain", j)), run(engines, request(paths, "fp8", j))
    assert inspect_model(path).stored_fp8
    assert report(f"Wan {fmt} vs its weights upcast", (got - want).abs().max(), bound(want, STEPS, 5.0))


LORA_LAYERS = ["blocks.0.self_attn.q", "blocks.1.cross_attn.k", "blocks.2.ffn.0", "blocks.3.cross_attn.o",
               "blocks.1.cross_attn.k_img", "text_embedding.0", "head.head"]


@pytest.mark.parametrize("fmt", ["diffusers", "kohya", "comfyui"])
def test_a_lora_in_the_formats_people_share_equals_the_merged_checkpoint(files, engines, tmp_path, fmt):
    """kohya / musubi-tuner names (lora_unet_blocks_0_self_attn_q), ComfyUI's (diffusion_model.blocks.0.self_attn.q),
    diffusers' (transformer.blocks.0.attn1.to_q), on an image-to-video file."""
    from engine.families.wan import key_map
    variant = "wan2.1-i2v-14b"
    weights = make_state_dict(variant)
    diffusers_name = {src[:-len(".weight")]: dst[:-len(".weight")]
                      for dst, src, _ in key_map("wan", inspect_model(files[variant]).config)
                      if src.endswith(".weight")}
    g = torch.Generator().manual_seed(9)
    lora, merged = {}, {k: v.clone() for k, v in weights.items()}
    for layer in LORA_LAYERS:
        n_out, n_in = weights[layer + ".weight"].shape
        down, up = torch.randn(4, n_in, generator=g) * 0.1, torch.randn(n_out, 4, generator=g) * 0.1
        if fmt == "kohya":
            name = "lora_unet_" + layer.replace(".", "_")
            lora.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                         f"{name}.alpha": torch.tensor(8.0)})
            scale = 8.0 / 4
        else:
            name = f"transformer.{diffusers_name[layer]}" if fmt == "diffusers" else f"diffusion_model.{layer}"
            lora.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up})
            scale = 1.0
        merged[layer + ".weight"] = weights[layer + ".weight"] + 0.8 * scale * (up @ down)
    with safe_open(files[variant], "pt") as f:
        metadata = f.metadata()
    paths = {"merged": str(tmp_path / "merged.safetensors"), "base": files[variant]}
    save_file(merged, paths["merged"], metadata=metadata)
    save_file(lora, str(tmp_path / "lora.safetensors"))
    j = job(variant)
    want = run(engines, request(paths, "merged", j))
    got = run(engines, request(paths, "base", j, loras=[(str(tmp_path / "lora.safetensors"), 0.8)]))
    assert report(f"Wan {fmt} LoRA vs merged checkpoint", (got - want).abs().max(), bound(want, STEPS, 5.0))


# ---- through the nodes ----------------------------------------------------------------------------------------------
def test_the_sampler_node_takes_wans_conditioning_and_latents_as_comfyui_passes_them(files, references):
    """What ComfyUI's nodes put out: WanImageToVideo's CONDITIONING (clip_vision_output as a CLIPVisionEncode output
    object, concat_latent_image, concat_mask on both sides) with EmptyHunyuanLatentVideo's LATENT; and
    Wan22ImageToVideoLatent's LATENT with its noise_mask for TI2V-5B. The sampler's latents equal the reference's."""
    import importlib
    from types import SimpleNamespace
    from conftest import PACK_NAME, load_pack
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    i2v, ti2v = job("wan2.1-i2v-14b"), job("wan2.2-ti2v-5b", cfg=1.0)

    def conditioning(j, side):
        extras = {"pooled_output": None,
                  "clip_vision_output": SimpleNamespace(penultimate_hidden_states=j[side]["clip"]),
                  "concat_latent_image": j["image"][0], "concat_mask": j["image"][1]}
        return [[j[side]["cond"], extras]]
    kw = dict(seed=7, steps=STEPS, sampler_name="euler", scheduler="simple", denoise=1.0)
    try:
        got_i2v = core.sample(core.EngineSettings(model_path=files["wan2.1-i2v-14b"], gpus=(0,), device="cpu"),
                              conditioning(i2v, "pos"), conditioning(i2v, "neg"),
                              {"samples": torch.zeros(1, 16, 3, 8, 8), "downscale_ratio_spacial": 8}, cfg=5.0,
                              **kw)["samples"]
        got_ti2v = core.sample(core.EngineSettings(model_path=files["wan2.2-ti2v-5b"], gpus=(0,), device="cpu"),
                               [[ti2v["pos"]["cond"], {"pooled_output": None}]], None,
                               {"samples": ti2v["latent_raw"], "noise_mask": ti2v["noise_mask"]}, cfg=1.0,
                               **kw)["samples"]
    finally:
        core.REGISTRY.unload()
    for name, got, variant, j in (("image-to-video", got_i2v, "wan2.1-i2v-14b", i2v),
                                  ("TI2V-5B with the noise mask", got_ti2v, "wan2.2-ti2v-5b", ti2v)):
        want = reference_sample(references[variant], variant, j)
        assert report(f"Wan {name} through the xDiT Sampler vs reference KSampler", (got - want).abs().max(),
                      bound(want, STEPS, j["cfg"]))


# ---- refusals before any rank starts ---------------------------------------------------------------------------------
def refused(files, variant, j, words, **extra):
    with pytest.raises(ValueError) as e:
        request(files, variant, j, **extra)
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_latent_of_the_other_wan_vae_is_refused(files):
    j = job("wan2.1-1.3b")
    refused(files, "wan2.2-ti2v-5b", dict(j, latent_raw=torch.randn(1, 16, 3, 8, 8)),
            "latent of shape [1, 16, 3, 8, 8] is invalid: wan2.2-ti2v-5b takes [B, 48, F, H/16, W/16]")
    refused(files, "wan2.1-1.3b", dict(j, latent_raw=torch.randn(1, 48, 3, 8, 8)),
            "wan2.1-1.3b takes [B, 16, F, H/8, W/8]")


def test_an_image_to_video_file_without_its_image_conditioning_is_refused(files):
    j = job("wan2.1-i2v-14b", image=False)
    refused(files, "wan2.1-i2v-14b", j, "clip_vision_output is missing: wan2.1-i2v-14b is an image-to-video model")
    j["pos"]["clip"] = j["neg"]["clip"] = randn(1, 1, 257, 1280)
    refused(files, "wan2.1-i2v-14b", j, "concat_latent_image is missing")
    refused(files, "wan2.2-i2v-a14b", job("wan2.2-i2v-a14b", image=False), "concat_latent_image is missing")
    j = job("wan2.1-i2v-14b")
    j["image"] = (randn(1, 1, 16, 2, 8, 8), j["image"][1])
    refused(files, "wan2.1-i2v-14b", j, "concat_latent_image of shape [1, 16, 2, 8, 8] is invalid")


def test_pipefusion_is_refused_for_wan_naming_why(files):
    from engine.errors import PlanError
    with pytest.raises(PlanError) as e:
        request(files, "wan2.1-1.3b", job("wan2.1-1.3b"), ParallelPlan(pipefusion=2))
    print(e.value)
    assert "Wan has no PipeFusion stage model yet" in str(e.value)


# ---- the command line ------------------------------------------------------------------------------------------------
def test_generate_samples_an_image_to_video_latent_from_the_command_line(files, references, tmp_path):
    """`python -m engine generate --frames 9` with a cond file holding WanImageToVideo's tensors (cond, neg_cond,
    clip_vision_output, concat_latent_image, concat_mask and their neg_ copies): the LATENT [1, 16, 3, H/8, W/8]
    equals the reference's; a frame count ComfyUI's nodes do not make is refused in one line (exit 2)."""
    j = job("wan2.1-i2v-14b")
    cond = {"cond": j["pos"]["cond"], "neg_cond": j["neg"]["cond"]}
    for prefix in ("", "neg_"):
        cond.update({prefix + "clip_vision_output": j["pos"]["clip"].clone(),
                     prefix + "concat_latent_image": j["image"][0].clone(),
                     prefix + "concat_mask": j["image"][1].clone()})
    save_file(cond, str(tmp_path / "c.safetensors"))
    base = [sys.executable, "-m", "engine", "generate", "--model", files["wan2.1-i2v-14b"], "--cond",
            str(tmp_path / "c.safetensors"), "--seed", "7", "--steps", str(STEPS), "--cfg", "5", "--width", "64",
            "--height", "64", "--out", str(tmp_path / "o.safetensors")]
    bad = subprocess.run(base + ["--frames", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(bad.stderr)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "10 frames is not a count ComfyUI's video nodes make for wan2.1-i2v-14b" in bad.stderr
    res = subprocess.run(base + ["--frames", "9"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = load_file(str(tmp_path / "o.safetensors"))["samples"]
    want = reference_sample(references["wan2.1-i2v-14b"], "wan2.1-i2v-14b", j)
    assert got.shape == (1, 16, 3, 8, 8)
    assert report("Wan image-to-video via python -m engine generate vs reference KSampler", (got - want).abs().max(),
                  bound(want, STEPS, 5.0))


def test_plan_prices_a_video_and_make_tiny_writes_what_comfyui_detects(tmp_path, capsys):
    from engine.cli import main
    assert main(["plan", "--model", "wan2.1-14b", "--frames", "81", "--width", "1280", "--height", "720", "--gpus",
                 "8", "--interconnect", "nvlink", "--cfg", "5"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "1280x720, 81 frames (21 latent)" in out and "75600 video tokens + 512 text tokens" in out
    assert "s/clip" in out and "s/image" not in out and "auto chose" in out
    assert main(["plan", "--model", "flux-dev", "--frames", "5", "--gpus", "2", "--interconnect", "nvlink"]) == 2
    assert "flux-dev makes still images" in capsys.readouterr().err
    assert main(["make-tiny", "--kind", "wan", "--variant", "wan2.2-ti2v-5b", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "wan2.2-ti2v-5b, wan layout" in out and "[B, 48, F, H/16, W/16]" in out and "noise_mask" in out


# ---- the planner: the video's tokens ---------------------------------------------------------------------------------
def test_the_planner_prices_the_videos_tokens():
    """81 frames at 1280x720 are 21 latent frames of 45 x 80 patches: 75,600 tokens; TI2V-5B at 1280x704, 121 frames:
    31 frames of 22 x 40 (16x VAE): 27,280."""
    work = Workload.for_variant("wan2.1-14b", 1280, 720, frames=81, negative_pass=True)
    assert (work.image_tokens, work.heads, work.layers, work.text_tokens) == (75_600, 40, 40, 512)
    assert Workload.for_variant("wan2.2-ti2v-5b", 1280, 704, frames=121).image_tokens == 27_280
    assert Workload.for_variant("wan2.1-1.3b", 832, 480, frames=81).image_tokens == 21 * 30 * 52


# ---- CUDA (skipped where torch sees none) ---------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["wan2.1-i2v-14b", "wan2.2-ti2v-5b"])
def test_the_cuda_velocity_equals_the_cpu_one_in_fp32_and_stays_near_it_in_bf16(files, variant):
    """The tiny image-to-video model (CLIP tokens, concatenated image) and TI2V-5B (per-frame timesteps) on CUDA: fp32
    (no TF32) within the fp32 bound of the CPU's velocity; bf16 within a few percent relative L2."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    j = job(variant, shape=(5, 16, 12))
    channels = j["latent_raw"].shape[1]
    x = randn(1, 1, channels, 5, 16, 12)
    side = Conditioning(j["pos"]["cond"], image_context=j["pos"].get("clip"),
                        concat_latent=j.get("image", (None, None))[0], concat_mask=j.get("image", (None, None))[1])
    mask = None
    if variant == "wan2.2-ti2v-5b":
        mask = torch.ones(1, channels, 5, 16, 12)
        mask[:, :, 0] = 0.0

    def velocity(dtype, device):
        flow = FlowModel(load_model(files[variant], dtype=dtype, device=device))
        return flow.velocity(x, torch.tensor(0.6), flow.prepare([side], 1, denoise_mask=mask)).cpu()
    cpu, gpu, bf16 = velocity("fp32", "cpu"), velocity("fp32", "cuda"), velocity("bf16", "cuda")
    assert report(f"{variant} CUDA vs CPU fp32 velocity", (gpu - cpu).abs().max(), bound(cpu))
    rel = ((bf16 - cpu).norm() / cpu.norm()).item()
    print(f"{variant} CUDA bf16 vs CPU fp32: relative L2 {rel:.3g} (bound {2 ** -8 * math.sqrt(DEPTH * 16):.3g})")
    assert rel <= 2 ** -8 * math.sqrt(DEPTH * 16)
