"""Wan-Animate 2: the engine's output equals an independent restatement of ComfyUI 0.33's WanAnimate2Model
(comfy/ldm/wan/model_animate2.py) on a tiny file: the pose branch run block by block at timestep 1 over
[pose | ones(4) | pose] with its own context, its K/V handed to the generation branch, whose frame j attends every
generation token plus pose frame j - 1 in one softmax, frame by frame as ComfyUI loops; the strengths; no pose (a step
outside the pose window). Every plan equals one rank through the model-call route (the one ComfyUI's samplers drive).
Detection follows ComfyUI's: the header's model_type alone makes the image-to-video tensors Animate 2.

The reference drives the unmodified diffusers modules with diffusers' own processors where ComfyUI's math is the plain
Wan block's (the pose branch, every cross-attention) and a processor written here for ComfyUI's per-frame
self-attention of the generation branch; nothing of the engine's Animate 2 code runs in it.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.generate.model_call import ModelSession
from engine.generate.request import GenerateRequest
from engine.models.flow import FlowModel, Prepared
from engine.models.load import inspect_model, load_model, load_transformer
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan

from tolerance import fp32_bound, report

TEXT_DIM, CLIP_DIM, DEPTH = 4096, 1280, 4


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("animate2")
    return {"animate": write_tiny("wan", str(d), variant="wan-animate-2")}


@pytest.fixture(scope="module")
def flow(files):
    return FlowModel(load_model(files["animate"], dtype="fp32", device=torch.device("cpu")))


@pytest.fixture(scope="module")
def reference_model(files):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    model = load_transformer(files["animate"]).model
    model.set_attn_processor(WanAttnProcessor())
    return model


# ---- the independent reference ---------------------------------------------------------------------------------------
def comfy_rope(ids, head_dim):
    """EmbedND at position ids [tokens, 3] (frame, row, column), axes d - 4(d/6), 2(d/6), 2(d/6), theta 10000, float64
    angles; (cos, sin) with each frequency on both channels of its pair, [1, tokens, 1, head_dim]."""
    third = head_dim // 6
    cos, sin = [], []
    for axis, d in enumerate((head_dim - 4 * third, 2 * third, 2 * third)):
        omega = 1.0 / 10000 ** torch.linspace(0, (d - 2) / d, d // 2, dtype=torch.float64)
        angles = ids[:, axis:axis + 1].double() * omega
        cos.append(torch.cos(angles).float())
        sin.append(torch.sin(angles).float())
    return tuple(torch.cat(t, dim=1).repeat_interleave(2, dim=1)[None, :, None] for t in (cos, sin))


def grid(frames, rows, cols, t0=0, c0=0):
    """rope_encode's ids: frames t0.., rows 0.., columns c0.. (shift_x)."""
    return torch.tensor([[t0 + f, r, c0 + c] for f in range(frames) for r in range(rows) for c in range(cols)])


def apply_rope1(x, cos, sin):
    """ComfyUI's apply_rope1 on (batch, tokens, heads, dim): each pair (x0, x1) rotated by its angle."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


def comfy_sinusoid(t):
    angles = torch.outer(t.float(), torch.pow(10000, -torch.arange(128).float().div(128)))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


class PoseKV:
    """Plain self-attention (the pose branch's forward_pose), keeping its roped K and V for the generation branch."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        b, s, _ = hidden_states.shape
        q = apply_rope1(attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)), *rotary_emb)
        k = apply_rope1(attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1)), *rotary_emb)
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        self.k, self.v = k, v
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return attn.to_out[1](attn.to_out[0](out.flatten(2)))


class FrameLoop:
    """forward_gen's self-attention: reference slot values scaled, then frame 0 over the generation keys, frame j >= 1
    over the generation keys and pose frame j - 1's (values times pose_strength), one SDPA a frame."""

    def __init__(self, pose: PoseKV | None, hw, frames, pose_strength, ref_strength):
        self.pose, self.hw, self.frames = pose, hw, frames
        self.pose_strength, self.ref_strength = pose_strength, ref_strength

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        hw = self.hw
        q = apply_rope1(attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)), *rotary_emb)
        k = apply_rope1(attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1)), *rotary_emb)
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if self.ref_strength != 1.0:
            v[:, :hw] *= self.ref_strength
        out = torch.empty_like(q)
        for j in range(self.frames):
            kk, vv = k, v
            if j and self.pose is not None:
                kp, vp = self.pose.k[:, (j - 1) * hw:j * hw], self.pose.v[:, (j - 1) * hw:j * hw]
                kk, vv = torch.cat([k, kp], dim=1), torch.cat([v, vp * self.pose_strength], dim=1)
            out[:, j * hw:(j + 1) * hw] = F.scaled_dot_product_attention(
                q[:, j * hw:(j + 1) * hw].transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)).transpose(1, 2)
        return attn.to_out[1](attn.to_out[0](out.flatten(2)))


@torch.no_grad()
def reference(m, x, t, cond, clip, pose=None, context_pose=None, clip_pose=None, pose_strength=1.0, ref_strength=1.0):
    """WanAnimate2Model on the diffusers modules: x [n, 36, F, h, w] (c_concat attached), t [n]."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    n, _, frames, h, w = x.shape
    pad = (0, w % 2, 0, h % 2, 0, 0)
    x = F.pad(x, pad, mode="circular")
    rows, cols = x.shape[-2] // 2, x.shape[-1] // 2
    hw = rows * cols
    embed, head_dim = m.condition_embedder, m.config.attention_head_dim

    def tokens(z):
        return m.patch_embedding(z).flatten(2).transpose(1, 2)

    def modulation(tv):
        temb = embed.time_embedder(comfy_sinusoid(tv))
        return temb, embed.time_proj(F.silu(temb)).unflatten(1, (6, -1))

    def context(text, image):
        c = embed.text_embedder(text)
        return torch.cat([embed.image_embedder(image), c], dim=1)

    xg = tokens(x)
    temb, proj = modulation(t)
    ctx = context(cond, clip)
    rope = comfy_rope(grid(frames, rows, cols), head_dim)
    xp = None
    if pose is not None:
        pose_in = F.pad(torch.cat([pose, torch.ones_like(pose[:, :4]), pose], dim=1), pad, mode="circular")
        xp = tokens(pose_in)
        _, proj_pose = modulation(torch.ones(n))   # t_pose: ones
        ctx_pose = context(cond if context_pose is None else context_pose, clip if clip_pose is None else clip_pose)
        rope_pose = comfy_rope(grid(frames - 1, rows, cols, t0=1, c0=cols), head_dim)
    for block in m.blocks:
        kv = None
        if xp is not None:
            kv = PoseKV()
            block.attn1.set_processor(kv)
            xp = block(xp, ctx_pose, proj_pose, rope_pose)
        block.attn1.set_processor(FrameLoop(kv, hw, frames, pose_strength, ref_strength))
        xg = block(xg, ctx, proj, rope)
        block.attn1.set_processor(WanAttnProcessor())
    shift, scale = (m.scale_shift_table + temb.unsqueeze(1)).unbind(1)
    out = m.proj_out(m.norm_out(xg) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))
    out = out.view(n, frames, rows, cols, 1, 2, 2, -1)
    v = torch.einsum("bfhwpqrc->bcfphqwr", out).reshape(n, -1, frames, rows * 2, cols * 2)
    return v[:, :, :, :h, :w]


def case(n=2, frames=3, h=6, w=10, seed=0, text=9, pose_text=None):
    """A call's inputs as ComfyUI's WAN_Animate2 hands them over: the latent with c_concat attached (mask 0 on the
    reference slot), the text padded to umT5's 512, CLIP-vision tokens, the pose latent one frame shorter."""
    x = randn(seed, n, 16, frames, h, w)
    image = randn(seed + 1, n, 16, frames, h, w)
    mask = torch.ones(n, 4, frames, h, w)
    mask[:, :, 0] = 0.0
    x = torch.cat([x, 1.0 - mask, image], dim=1)
    cond = F.pad(randn(seed + 2, n, text, TEXT_DIM), (0, 0, 0, 512 - text))
    pose_cond = F.pad(randn(seed + 3, n, pose_text, TEXT_DIM), (0, 0, 0, 512 - pose_text)) if pose_text else None
    return dict(x=x, t=torch.full((n,), 630.0), cond=cond, clip=randn(seed + 4, n, 257, CLIP_DIM),
                pose=randn(seed + 5, n, 16, frames - 1, h, w), context_pose=pose_cond)


def engine_out(flow, c, pose=True, clip_pose=None, pose_strength=None, ref_strength=None):
    n = c["x"].shape[0]
    extras = {}
    if pose:
        extras["pose_latents"] = c["pose"].double()
        if c["context_pose"] is not None:
            extras["context_pose"] = c["context_pose"].double()
        if clip_pose is not None:
            extras["clip_fea_pose"] = clip_pose.double()
    if pose_strength is not None:
        extras["pose_strength"] = torch.full((n,), pose_strength, dtype=torch.float64)
    if ref_strength is not None:
        extras["reference_strength"] = torch.full((n,), ref_strength, dtype=torch.float64)
    prepared = Prepared(c["cond"], None, torch.full((n,), 3.5), image_context=c["clip"], extras=extras or None)
    return flow.output(c["x"], c["t"], prepared)


def bound(want):
    return fp32_bound(want.abs().max(), reduction=TEXT_DIM, depth=2 * DEPTH)


CASES = [
    dict(name="pose, default strengths", shape=(3, 6, 10), kw={}),
    dict(name="pose, odd latent (padded to whole patches), 4 frames", shape=(4, 5, 7), kw={}),
    dict(name="pose with its own prompt and CLIP output, strengths 0.6 / 1.7", shape=(3, 6, 10),
         kw=dict(pose_text=5, clip_pose=True, pose_strength=0.6, ref_strength=1.7)),
    dict(name="no pose (outside the pose window), reference strength 0.5", shape=(3, 6, 10),
         kw=dict(pose=False, ref_strength=0.5)),
]


@pytest.mark.parametrize("spec", CASES, ids=[c["name"] for c in CASES])
def test_one_forward_equals_comfyuis_animate2_model_restated(flow, reference_model, spec):
    kw = dict(spec["kw"])
    frames, h, w = spec["shape"]
    c = case(frames=frames, h=h, w=w, pose_text=kw.pop("pose_text", None))
    clip_pose = randn(9, 2, 257, CLIP_DIM) if kw.pop("clip_pose", False) else None
    pose = kw.pop("pose", True)
    got = engine_out(flow, c, pose=pose, clip_pose=clip_pose, **kw)
    want = reference(reference_model, c["x"], c["t"], c["cond"], c["clip"], c["pose"] if pose else None,
                     c["context_pose"], clip_pose, kw.get("pose_strength", 1.0), kw.get("ref_strength", 1.0))
    assert got.shape == want.shape == (2, 16, frames, h, w)
    assert report(f"Wan-Animate 2 {spec['name']}: engine vs ComfyUI's model restated", (got - want).abs().max(),
                  bound(want))


def test_the_pose_branch_and_the_strengths_steer_the_result(flow):
    """What the reference's agreement rests on is not nothing: the pose latents, the pose prompt and each strength move
    the output far beyond rounding."""
    c = case(pose_text=5)
    base = engine_out(flow, {**c, "context_pose": None})
    for name, other in (("no pose", engine_out(flow, c, pose=False)),
                        ("the pose prompt", engine_out(flow, c)),
                        ("pose strength 0.5", engine_out(flow, {**c, "context_pose": None}, pose_strength=0.5)),
                        ("reference strength 2", engine_out(flow, {**c, "context_pose": None}, ref_strength=2.0))):
        moved = ((other - base).norm() / base.norm()).item()
        print(f"{name}: relative L2 change {moved:.3g}")
        assert moved > 1e-3, name


# ---- detection ---------------------------------------------------------------------------------------------------------
def test_the_header_alone_makes_the_image_to_video_tensors_animate2(files, tmp_path):
    """comfy/model_detection.py:779: model_type from the header's config; without it the same tensors are Wan 2.1
    image-to-video; a header that says Animate 2 over other tensors is refused in one line."""
    path = files["animate"]
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["config"]) == {"transformer": {"model_type": "animate2"}}
    info = inspect_model(path)
    assert (info.variant, info.spec.sampling(info.variant).shift, info.spec.comfyui_since(info.variant)) == \
        ("wan-animate-2", 5.0, "0.31.0")
    tensors = load_file(path)
    bare = tmp_path / "no-header.safetensors"
    save_file(tensors, str(bare), {k: v for k, v in metadata.items() if k != "config"})
    assert inspect_model(str(bare)).variant == "wan2.1-i2v-14b"
    t2v = write_tiny("wan", str(tmp_path), variant="wan2.1-1.3b")
    wrong = tmp_path / "wrong.safetensors"
    save_file(load_file(t2v), str(wrong), {"config": metadata["config"]})
    with pytest.raises(CheckpointError, match="Wan-Animate 2") as e:
        inspect_model(str(wrong))
    assert "\n" not in str(e.value)


def test_a_plain_wan_file_refuses_animate2_inputs_in_one_line(tmp_path):
    flow = FlowModel(load_model(write_tiny("wan", str(tmp_path), variant="wan2.1-i2v-14b"), dtype="fp32",
                                device=torch.device("cpu")))
    c = case()
    with pytest.raises(ValueError, match="model_type animate2") as e:
        engine_out(flow, c)
    assert "\n" not in str(e.value)


def test_a_pose_latent_of_another_length_is_refused_in_one_line(flow):
    c = case()
    c["pose"] = c["pose"][:, :, :1]
    with pytest.raises(ValueError, match="WanAnimate2ToVideo") as e:
        engine_out(flow, c)
    assert "\n" not in str(e.value)


# ---- every plan equals one rank, through the model-call route ---------------------------------------------------------
def conditioning(c, rows=slice(None)):
    out = {"context": c["cond"][rows], "clip_fea": c["clip"][rows], "pose_latents": c["pose"][rows],
           "pose_strength": torch.full((c["x"][rows].shape[0],), 0.8, dtype=torch.float64)}
    if c["context_pose"] is not None:
        out["context_pose"] = c["context_pose"][rows]
    return out


def session_request(path, c, plan):
    x = c["x"]
    batch = plan.dp   # a data-parallel session is planned for a batch it divides
    return GenerateRequest(model=path, cond=c["cond"][:1], latent_raw=torch.zeros(()).expand(batch, 16, *x.shape[2:]),
                           cfg=2.0, neg_cond=c["cond"][1:2], clip_vision_output=c["clip"][:1],
                           neg_clip_vision_output=c["clip"][1:2],
                           concat_latent_image=torch.zeros(()).expand(1, 16, *x.shape[2:]),
                           neg_concat_latent_image=torch.zeros(()).expand(1, 16, *x.shape[2:]),
                           plan=plan).validate(plan.world_size)


# the plans of two ranks: Ulysses x Ring (four) runs Ring's blocks behind Ulysses' exchange, the engine's generic
# composition, which tests/test_wan.py runs for the Wan family
PLANS = [(2, dict(ulysses=2), (3, 5, 7)), (2, dict(ring=2), (3, 5, 5)), (2, dict(cfg=2), (3, 5, 7)),
         (2, dict(dp=2), (3, 5, 7)), (2, dict(ulysses=2, shard=2), (3, 5, 5))]


@pytest.mark.parametrize("world,degrees,shape", PLANS,
                         ids=[f"{ParallelPlan(**d).describe().replace(' ', '')}-{'x'.join(map(str, s))}"
                              for _, d, s in PLANS])
def test_every_plan_equals_one_rank_through_the_model_call_route(engines, files, flow, world, degrees, shape):
    """A positive and a negative batched in one call (the pose values and the pose prompt on both rows, as
    WanAnimate2ToVideo sets them). 3 frames of 5x7: 3 x 12 generation tokens and 2 x 12 pose tokens, 60 in all; 3
    frames of 5x5: 27 + 18 = 45 tokens, which Ring pads for 2 ranks and splits inside a frame and across the two
    branches' boundary."""
    frames, h, w = shape
    c = case(frames=frames, h=h, w=w, pose_text=5)
    plan = ParallelPlan(**degrees)
    want = engine_out(flow, c, pose_strength=0.8)
    with ModelSession(engines(world), session_request(files["animate"], c, plan)) as s:
        got = s.call(c["x"], c["t"], conditioning(c))
    assert report(f"Wan-Animate 2 {plan.describe()} vs one rank", (got - want).abs().max(), bound(want))


# ---- the nodes' side -------------------------------------------------------------------------------------------------
def test_the_xdit_samplers_request_takes_the_pose_inputs_of_both_sides_as_the_node_sets_them():
    """WanAnimate2ToVideo's keys on the xDiT Sampler's conditioning become the request's pose fields (the CLIP output's
    penultimate states); a negative carrying other pose values is refused in one line (the engine's loop gives both
    passes the same pose branch, as the node sets them)."""
    import importlib
    import types
    from conftest import PACK_NAME, load_pack
    load_pack()
    conditioning = importlib.import_module(PACK_NAME + ".xdit_nodes.conditioning")
    pose, text = torch.zeros(1, 16, 2, 4, 4), torch.zeros(1, 9, TEXT_DIM)
    clip = types.SimpleNamespace(penultimate_hidden_states=torch.ones(1, 257, CLIP_DIM))
    keys = {"pose_video_latent": pose, "cross_attn_pose": text, "clip_vision_output_pose": clip, "pose_strength": 0.7}
    positive, negative = [[text, dict(keys)]], [[text, dict(keys)]]
    got = conditioning.conditioning_pose(positive, negative)
    assert got["pose_latent"] is pose and got["pose_cond"] is text and got["pose_strength"] == 0.7
    assert got["pose_clip_vision_output"] is clip.penultimate_hidden_states
    with pytest.raises(ValueError, match="different Wan-Animate 2 pose inputs") as e:
        conditioning.conditioning_pose(positive, [[text, {**keys, "pose_strength": 1.5}]])
    assert "\n" not in str(e.value)
    windowed = [[text, {**keys, "start_percent": 0.0, "end_percent": 0.5}], [text, {"start_percent": 0.5}]]
    with pytest.raises(ValueError, match="pose window .*KSampler on the xDiT Engine's MODEL") as e:
        conditioning.conditioning_tensors(windowed, "positive")
    assert "\n" not in str(e.value)


def comfy_simple_sigmas(steps, shift=5.0):
    """ModelSamplingDiscreteFlow (1000 entries, t = i/1000, shift t / (1 + (shift - 1) t)) and the simple schedule."""
    t = torch.arange(1, 1001, dtype=torch.float32) / 1000
    table = shift * t / (1 + (shift - 1) * t)
    return torch.tensor([float(table[-(1 + int(i * 1000 / steps))]) for i in range(steps)] + [0.0])


WAN21_MEAN = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]).view(1, -1, 1, 1, 1)
WAN21_STD = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]).view(1, -1, 1, 1, 1)


@pytest.mark.parametrize("world,degrees", [(2, dict(cfg=2))], ids=["cfg2"])
def test_the_engines_own_loop_samples_with_the_pose_branch_as_comfyuis_ksampler(engines, files, reference_model,
                                                                                 world, degrees):
    """The xDiT Sampler's route: a request with WanAnimate2ToVideo's inputs (the image latent with the reference slot,
    the pose latent, a pose prompt, strengths) sampled on the ranks equals KSampler restated (euler, simple, shift 5,
    CFG on denoised) around the independent reference model: Wan21's process_in / process_out, c_concat [1 - mask (4
    channels), the image latent process_in'd], the pose latent process_in'd, the pose values on both passes."""
    frames, h, w, steps, cfg = 3, 5, 7, 2, 4.0
    g = torch.Generator().manual_seed(5)
    cond, neg = (F.pad(torch.randn(1, n, TEXT_DIM, generator=g), (0, 0, 0, 512 - n)) for n in (9, 6))
    pose_cond = F.pad(torch.randn(1, 7, TEXT_DIM, generator=g), (0, 0, 0, 505))
    clip, clip_pose = (torch.randn(1, 257, CLIP_DIM, generator=g) for _ in range(2))
    image = torch.randn(1, 16, frames, h, w, generator=g)
    mask = torch.ones(1, 1, frames, h, w)
    mask[:, :, 0] = 0.0
    pose_raw = torch.randn(1, 16, frames - 1, h, w, generator=g)
    latent = torch.zeros(1, 16, frames, h, w)
    r = GenerateRequest(model=files["animate"], cond=cond, neg_cond=neg, latent_raw=latent, seed=3, steps=steps,
                        cfg=cfg, clip_vision_output=clip, neg_clip_vision_output=clip, concat_latent_image=image,
                        concat_mask=mask, neg_concat_latent_image=image, neg_concat_mask=mask, pose_latent=pose_raw,
                        pose_cond=pose_cond, pose_clip_vision_output=clip_pose, pose_strength=0.7,
                        reference_strength=1.2, plan=ParallelPlan(**degrees)).validate(world)
    got = engines(world).submit("generate", *r.to_job()).outputs["samples"]

    concat = torch.cat([(1.0 - mask).repeat(1, 4, 1, 1, 1), (image - WAN21_MEAN) / WAN21_STD], dim=1)
    pose = (pose_raw - WAN21_MEAN) / WAN21_STD
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
    sigmas = comfy_simple_sigmas(steps)
    x = sigmas[0] * noise
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        def denoised(text):
            v = reference(reference_model, torch.cat([x, concat], dim=1), torch.full((1,), float(s) * 1000), text,
                          clip, pose, pose_cond, clip_pose, 0.7, 1.2)
            return x - v * s
        pos_d, neg_d = denoised(cond), denoised(neg)
        d = neg_d + (pos_d - neg_d) * cfg
        x = x + (x - d) / s * (s_next - s)
    want = x * WAN21_STD + WAN21_MEAN
    assert report(f"Wan-Animate 2 own loop {ParallelPlan(**degrees).describe()} vs KSampler restated around the "
                  f"reference", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=TEXT_DIM, depth=2 * DEPTH, amplification=steps * (2 * cfg - 1)))


def test_pose_inputs_on_a_plain_wan_file_are_refused_before_any_rank(tmp_path):
    path = write_tiny("wan", str(tmp_path), variant="wan2.1-i2v-14b")
    frames, h, w = 3, 4, 4
    with pytest.raises(ValueError, match="does not take: load a Wan-Animate 2 file") as e:
        GenerateRequest(model=path, cond=torch.zeros(1, 9, TEXT_DIM), latent_raw=torch.zeros(1, 16, frames, h, w),
                        clip_vision_output=torch.zeros(1, 257, CLIP_DIM),
                        concat_latent_image=torch.zeros(1, 16, frames, h, w),
                        pose_latent=torch.zeros(1, 16, frames - 1, h, w)).validate(1)
    assert "\n" not in str(e.value)
    animate = write_tiny("wan", str(tmp_path), variant="wan-animate-2")
    with pytest.raises(ValueError, match="pose_latent of shape \\[1, 16, 3, 4, 4\\] is invalid") as e:
        GenerateRequest(model=animate, cond=torch.zeros(1, 9, TEXT_DIM), latent_raw=torch.zeros(1, 16, frames, h, w),
                        clip_vision_output=torch.zeros(1, 257, CLIP_DIM),
                        concat_latent_image=torch.zeros(1, 16, frames, h, w),
                        pose_latent=torch.zeros(1, 16, frames, h, w)).validate(1)


def test_the_strengths_comfyui_passes_as_floats_cross_as_one_value_a_row():
    """ComfyUI's WAN_Animate2 passes pose_strength and reference_strength as Python floats (CONDConstant): the link
    hands them to the ranks as one float64 a row, the family's host-side constants."""
    import importlib
    from conftest import PACK_NAME, load_pack
    load_pack()
    link = importlib.import_module(PACK_NAME + ".xdit_nodes.link")
    assert {"pose_latents", "context_pose", "clip_fea_pose", "pose_strength", "reference_strength"} <= \
        set(link.PACKED_KWARGS)
    noted = []
    e = link.EngineLink(settings=None, registry=None, request_for=None)
    e._noting = noted
    x = torch.zeros(2, 36, 3, 4, 4)
    e.call(x, torch.full((2,), 500.0), torch.zeros(2, 9, TEXT_DIM), None, {"cond_or_uncond": [0, 1]},
           {"pose_strength": 0.8, "reference_strength": 1.5, "pose_latents": torch.zeros(2, 16, 2, 4, 4)})
    got = noted[0].conditioning
    assert got["pose_strength"].dtype == torch.float64 and got["pose_strength"].tolist() == [0.8, 0.8]
    assert got["reference_strength"].tolist() == [1.5, 1.5]


# ---- the files users have --------------------------------------------------------------------------------------------
def test_the_templates_int8_convrot_file_is_animate2_and_runs_as_its_dequantized_plain_copy(tmp_path):
    """The template's file is an int8 ConvRot one (wan_animate_2_distill_int8_convrot): its header keeps the model
    type, and its forward with the pose branch equals a float32 file of the reference dequantization to fp32 rounding
    (each layer's sums in another order, the rotation's own sums of its group added)."""
    from test_int8_checkpoints import dequantized_file
    path = write_tiny("wan", str(tmp_path), variant="wan-animate-2", format="int8_convrot")
    info = inspect_model(path)
    assert info.variant == "wan-animate-2" and info.quantized_parameters, info
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    plain = str(tmp_path / "plain.safetensors")
    save_file(dequantized_file(path), plain, metadata={k: metadata[k] for k in ("xdit.synthetic", "config")})
    assert inspect_model(plain).variant == "wan-animate-2"
    c = case(pose_text=5)
    got, want = (engine_out(FlowModel(load_model(p, dtype="fp32", device=torch.device("cpu"))), c, pose_strength=0.8)
                 for p in (path, plain))
    assert report("Wan-Animate 2 int8_convrot vs its dequantized plain copy", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4 * 256, depth=2 * 2 * DEPTH))


# ---- the pose cache --------------------------------------------------------------------------------------------------
def test_later_calls_read_the_pose_branch_from_the_cache_and_give_the_uncached_output(files, flow):
    """The job's first call with pose inputs runs the whole sequence and keeps the pose branch's K/V per block; later
    calls with the same inputs (the same held tensors) run the video's tokens alone: their output equals a forward
    that runs the pose branch again (fp32 rounding: the same products, in a shorter sequence). Other pose inputs make
    a new entry; the job's end lets it go."""
    from engine.families.base import JOB_STATE, end_of_job, job_state
    from engine.families.wan_animate2 import POSE_CACHE
    c = case(pose_text=5)
    n = c["x"].shape[0]
    extras = {"pose_latents": c["pose"].double(), "context_pose": c["context_pose"].double(),
              "pose_strength": torch.full((n,), 0.8, dtype=torch.float64)}
    held = Prepared(c["cond"], None, torch.full((n,), 3.5), image_context=c["clip"], extras=extras)
    tokens = []
    hook = flow.model.patch_embedding.register_forward_hook(lambda m, a, out: tokens.append(out.shape[2]))
    try:
        end_of_job(flow.model)
        outs = [flow.output(c["x"] * (1 + k), c["t"] - 200 * k, held) for k in range(3)]
        entry = job_state(flow.model)[POSE_CACHE]
        assert entry.filled and tokens == [2 * 3 - 1, 3, 3], tokens   # frames of tokens: both branches, then video's
        for k in (1, 2):   # new tensors each time: no entry matches, the pose branch runs again
            fresh = Prepared(c["cond"].clone(), None, torch.full((n,), 3.5), image_context=c["clip"].clone(),
                             extras={name: t.clone() for name, t in extras.items()})
            want = flow.output(c["x"] * (1 + k), c["t"] - 200 * k, fresh)
            assert report(f"Wan-Animate 2 call {k + 1} from the pose cache vs the pose branch run again",
                          (outs[k] - want).abs().max(), bound(want))
        assert job_state(flow.model)[POSE_CACHE] is not entry   # the fresh inputs replaced it
        assert tokens[-1] == 2 * 3 - 1
    finally:
        hook.remove()
        end_of_job(flow.model)
    assert JOB_STATE not in flow.model.__dict__


@pytest.mark.parametrize("world,degrees,cached", [(2, dict(ulysses=2), True), (2, dict(cfg=2), True)],
                         ids=["ulysses2", "cfg2"])
def test_a_sessions_calls_with_the_pose_cache_equal_one_rank_without_it(engines, files, flow, world, degrees, cached):
    """Three calls of a session with the same pose inputs (held once by the ranks): under Ulysses and CFG parallel the
    later ones read the pose cache (Ring runs the pose branch every call, as in the plans' test); each equals one rank
    running the pose branch again."""
    c = case(frames=3, h=5, w=5, pose_text=5)
    plan = ParallelPlan(**degrees)
    with ModelSession(engines(world), session_request(files["animate"], c, plan)) as s:
        got = [s.call(c["x"] * (1 + k), c["t"] - 200 * k, conditioning(c)) for k in range(3)]
        model_s = s.model_s
    for k in range(3):
        want = engine_out(flow, {**c, "x": c["x"] * (1 + k), "t": c["t"] - 200 * k}, pose_strength=0.8)
        assert report(f"Wan-Animate 2 {plan.describe()} call {k + 1} ({'pose cache' if cached and k else 'pose branch'})"
                      f" vs one rank", (got[k] - want).abs().max(), bound(want))
    print(f"{plan.describe()}: model seconds per call {[round(t, 3) for t in model_s]}")


@pytest.mark.parametrize("fmt", ["fp8_scaled", "bf16 compute"])
def test_a_comfy_org_fp8_scaled_file_and_bf16_compute_keep_the_header_and_the_pose_branch(tmp_path, flow, fmt):
    """Comfy-Org's fp8_scaled form keeps the header (Animate 2), and bf16 compute runs the pose branch: finite and near
    the fp32 model's output (fp8 weights round this tiny random model's output by about 4% of its norm, bf16 products
    by under 1%; bound 5e-2). Not a parity check: the fp8_scaled file against its weights upcast is the Wan family's
    (the same tensors), tests/test_wan.py."""
    if fmt == "fp8_scaled":
        path = write_tiny("wan", str(tmp_path), variant="wan-animate-2", format="fp8_scaled")
        assert inspect_model(path).variant == "wan-animate-2" and inspect_model(path).stored_fp8
        other = FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))
    else:
        other = FlowModel(load_model(write_tiny("wan", str(tmp_path), variant="wan-animate-2"), dtype="bf16",
                                     device=torch.device("cpu")))   # the fixture's file: the same seed
    c = case(pose_text=5)
    want = engine_out(flow, c, pose_strength=0.8)
    if fmt == "bf16 compute":
        c = {k: v.bfloat16() if k in ("x", "cond", "clip") else v for k, v in c.items()}
    got = engine_out(other, c, pose_strength=0.8)
    moved = float((got - want).norm() / want.norm())
    print(f"Wan-Animate 2 {fmt} vs the fp32 model: relative L2 {moved:.3g}")
    assert torch.isfinite(got).all() and moved < 5e-2


def test_wan_animate2_cache_at_a_rounding_dtype_is_refused_in_one_line_and_at_default_taken():
    """WanAnimate2Cache at int8 / int4 rounds ComfyUI's pose activations (live: 1.4e-4 from no cache), which the
    engine does not reproduce: refused naming the node; at its default dtype it changes no number (live: 0.0) and
    the engine's MODEL takes it."""
    import importlib
    import types
    from conftest import PACK_NAME, load_pack
    load_pack()
    model = importlib.import_module(PACK_NAME + ".xdit_nodes.model")
    model.check_transformer_options({"animate2_cache": types.SimpleNamespace(dtype="default")})
    for dtype in ("int8", "int4"):
        with pytest.raises(model.ModelPatchError, match=f"WanAnimate2Cache with dtype {dtype}.*set the node's dtype "
                                                        f"to default") as e:
            model.check_transformer_options({"animate2_cache": types.SimpleNamespace(dtype=dtype)})
        assert "\n" not in str(e.value)
