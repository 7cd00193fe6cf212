"""MiniMax-H3 (audio + video in one packed sequence): a file in ComfyUI's layout detected and loaded as ComfyUI reads
it, the packed sequence laid out as ComfyUI's model lays it out, the engine's MODEL packing ComfyUI's two streams and
reading its payload, and every plan on real rank processes equal to one rank. ComfyUI's own MiniMaxH3Model against
the engine is in the live checks (tests/comfyui_h3_check.py, skipped without COMFYUI_PATH)."""
import inspect
import math
import types

import pytest
import torch

from engine.families import minimax_h3
from engine.families.minimax_h3_layout import DIMS, infer, shapes
from engine.generate.model_call import ModelSession
from engine.generate.request import GenerateRequest
from engine.models.flow import FlowModel, Prepared
from engine.models.load import inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan

from conftest import RecordingLink
from tolerance import fp32_bound, report

TEXT = DIMS["tiny"]["minimax-h3"].text_dim


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny("minimax-h3", str(tmp_path_factory.mktemp("h3")))


@pytest.fixture(scope="module")
def local(path):
    return FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))


def test_the_released_models_shapes_give_diffusers_own_config_and_a_tiny_file_loads_every_tensor(path, local):
    """ComfyUI's detection reads heads as qkv rows / 3 / head width, the text width from condition_proj and the RoPE
    length from rope.inv_freq: the released model's shapes give diffusers' defaults (its config is the released one)."""
    from diffusers import MiniMaxH3Transformer3DModel
    config, variant = infer("minimax", shapes(DIMS["full"]["minimax-h3"]), {})
    defaults = {k: p.default for k, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
                if k != "self"}
    assert {k: defaults[k] for k in config} == config and variant == "minimax-h3"
    assert (config["num_attention_heads"], config["hidden_size"], config["num_layers"]) == (56, 5376, 50)
    info = inspect_model(path)
    assert (info.family, info.variant, info.layout) == ("minimax-h3", "minimax-h3", "minimax")
    # the file's RoPE frequencies are what the model uses (ComfyUI reads them from the file; they load here too)
    assert torch.equal(local.model.rope.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert all(not p.is_meta for p in local.model.parameters())


def test_diffusers_own_single_file_converter_gives_the_weights_the_engine_loads(path, local):
    """diffusers' converter for Comfy-Org's MiniMax-H3 files (stacked q, k, v rows; fc1's gate half first) is an
    independent reading of the layout: every tensor it makes equals the engine's, bit for bit (both only move the
    file's values). It drops rope.inv_freq to recompute it; the engine loads the file's, as ComfyUI does."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(load_file(path), dict(local.model.config))
    mine = {k: v for k, v in local.model.state_dict().items() if k != "rope.inv_freq"}
    assert set(converted) == set(mine)
    assert all(torch.equal(converted[k], mine[k]) for k in mine)


def test_the_packed_sequence_is_laid_out_as_comfyuis_model_lays_it_out():
    """[text | audio left, audio right | video]: text at (l, 0, 0); audio frames from the text length on, pinned at
    the outermost column coordinates; video frames 5/3 x (1, 4, ...) pixel frames apart, rows and columns
    area-normalised x 32. The figures below are worked by hand for 2 text tokens, 2 audio frames and a 2-frame latent
    of 2 x 4 pixels (one row of two patches): area sqrt(8); row axis ratio 2/sqrt(8), one point; column axis ratio
    4/sqrt(8), two points."""
    r = 2 / math.sqrt(8)
    row = (1 - r) / 2 * 32
    c = 4 / math.sqrt(8)
    cols = [((1 - c) / 2) * 32, (c / 2 + (1 - c) / 2) * 32]
    want = torch.tensor([[0, 0, 0], [1, 0, 0],
                         [2, 0, cols[0]], [3, 0, cols[0]], [2, 0, cols[1]], [3, 0, cols[1]],
                         [2, row, cols[0]], [2, row, cols[1]], [2 + 5 / 3, row, cols[0]], [2 + 5 / 3, row, cols[1]]],
                        dtype=torch.float64)
    assert torch.allclose(minimax_h3.positions(2, 2, 2, 4, 2), want, atol=1e-12, rtol=0)
    # rows: frames, then patch rows, then patch columns; features (channel, patch row, patch column)
    video = torch.arange(3 * 2 * 4 * 6, dtype=torch.float32).reshape(1, 3, 2, 4, 6)
    rows = minimax_h3.patchify(video)
    for t, i, j in ((0, 0, 0), (1, 1, 2), (0, 1, 1)):
        token = rows[0, t * 2 * 3 + i * 3 + j]
        assert torch.equal(token, video[0, :, t, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(-1))
    assert torch.equal(minimax_h3.unpatchify(rows, 3, 2, 4, 6), video)
    # the audio schedule from the video sigma: shift 12 -> base grid -> shift 3, and identity at the ends
    sigma = torch.tensor([0.0, 0.5, 1.0])
    base = 0.5 / (12 - 0.5 * 11)
    assert torch.allclose(minimax_h3.time_shift_sigma(sigma, 12.0, 3.0),
                          torch.tensor([0.0, 3 * base / (1 + 2 * base), 1.0]))
    # a first frame (at the target's timeline origin) and an image reference (before it, one time unit): the
    # reference moves the targets' timeline by its span; the keyframe's rows share the target frame grid
    first = minimax_h3.Block("keyframe", 0, frames=1, h=2, w=4, has_video=True)
    ref = minimax_h3.Block("image", h=2, w=2, has_video=True)
    segments = minimax_h3.layout(2, 2, 2, 4, 2, (first, ref))
    assert [k for k, _ in segments] == ["text", "cond", "ref_img", "audio", "video"]
    cond, ref_rows, video = segments[1][1], segments[2][1], segments[4][1]
    assert cond[:, 0].tolist() == [3.0, 3.0] and ref_rows[:, 0].tolist() == [2.0]   # text 2 + reference span 1
    assert torch.equal(cond[:, 1:], video[:2, 1:]) and video[0, 0] == 3.0


def h3_call(seed=0, text=9, frames=3, h=4, w=6, audio=7, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    video, sound = torch.randn(1, 24, frames, h, w, generator=g), torch.randn(1, 32, 2, audio, generator=g)
    x = torch.cat([video.reshape(1, 1, -1), sound.reshape(1, 1, -1)], dim=-1)
    conditioning = {"context": torch.randn(1, text, TEXT, generator=g),
                    "av_shape": torch.tensor([[24, frames, h, w, 32, 2, audio]], dtype=torch.float32),
                    "audio_scale": torch.tensor([scale]), "sigma_shift": torch.tensor([[12.0, 3.0]])}
    return x, torch.tensor([700.0]), conditioning


def reference(flow, x, t, c):
    extras = {k: v for k, v in c.items() if k in minimax_h3.EXTRAS}
    return flow.output(x, t, Prepared(c["context"], None, torch.ones(1), extras=extras))


def request(path, c, plan, neg=None):
    frames, h, w = (int(v) for v in c["av_shape"][0, 1:4].tolist())
    return GenerateRequest(model=path, cond=c["context"], latent_raw=torch.zeros(()).expand(1, 24, frames, h, w),
                           cfg=2.0 if neg is not None else 1.0, neg_cond=neg, plan=plan).validate(plan.world_size)


def bound(want):
    d = DIMS["tiny"]["minimax-h3"]
    return fp32_bound(want.abs().max(), reduction=max(d.ffn, d.inner), depth=d.depth + d.refiner)


@pytest.mark.parametrize("world,plan", [
    (1, ParallelPlan()), (2, ParallelPlan(ulysses=2)), (2, ParallelPlan(ring=2)),
    (2, ParallelPlan(ulysses=2, shard=2)), (4, ParallelPlan(ulysses=2, ring=2))],
    ids=["single", "ulysses2", "ring2", "ulysses2-shard2", "ulysses2-ring2"])
def test_every_sequence_plan_splits_the_packed_sequence_and_equals_one_rank(engines, path, local, world, plan):
    """9 text + 14 audio + 18 video rows = 41, which no degree divides: the last rank's share is padded (the padded
    keys dropped before every softmax), every row of the three streams split with the video's."""
    x, t, c = h3_call()
    want = reference(local, x, t, c)
    with ModelSession(engines(world), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    assert got.shape == want.shape == x.shape
    assert report(f"MiniMax-H3 model call, {plan.describe()}", (got - want).abs().max(), bound(want))


def guided_call(seed=3, masked=True):
    """A call with ComfyUI's payload of a first frame, a 2-latent-frame guide clip with its soundtrack at frame 5, an
    image reference and a video reference with its soundtrack, and noise masks keeping the first latent frame and two
    audio frames, half regenerating part of another frame (call_extras builds what the ranks take)."""
    x, t, c = h3_call(seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 6, generator=g)},
                             {"resolved_frame_index": 5, "latent": torch.randn(1, 24, 2, 4, 6, generator=g),
                              "audio_latent": torch.randn(1, 32, 2, 4, generator=g)}],
               "refs": [{"kind": "image", "latent_h": 2, "latent_w": 4,
                         "latent": torch.randn(1, 24, 1, 2, 4, generator=g)},
                        {"kind": "video_audio", "latent_t": 2, "latent_h": 2, "latent_w": 2, "ref_audio_t": 3,
                         "latent": torch.randn(1, 24, 2, 2, 2, generator=g),
                         "audio_latent": torch.randn(1, 32, 2, 3, generator=g)}],
               "seed": 77, "audio_scale": 4.0, "visual_cond_noise_aug": 0.9}
    video_mask, audio_mask = torch.ones(1, 1, 3, 4, 6), torch.ones(1, 1, 2, 7)
    video_mask[:, :, 0], video_mask[:, :, 1, :2], audio_mask[..., :2] = 0.0, 0.5, 0.0
    masks = {"denoise_mask": video_mask, "audio_denoise_mask": audio_mask} if masked else None
    extras = minimax_h3.call_extras([(1, 24, 3, 4, 6), (1, 32, 2, 7)], payload, {}, (12.0, 3.0), 1, masks)
    return x, t, {"context": c["context"], **extras}


@pytest.mark.parametrize("world,plan", [(2, ParallelPlan(ulysses=2)), (2, ParallelPlan(ring=2))],
                         ids=["ulysses2", "ring2"])
def test_keyframes_references_and_masks_join_the_split_sequence_and_equal_one_rank(engines, path, local, world, plan):
    """Condition rows (a first frame, a guide clip and its audio) and reference blocks (an image, a video with its
    soundtrack) lengthen the packed sequence; they are split with it and the target rows come back whole."""
    x, t, c = guided_call()
    want = reference(local, x, t, c)
    plain = reference(local, x, t, {k: v for k, v in c.items() if k in ("context", "av_shape", "audio_scale")})
    assert (want - plain).abs().max() > 1e-3   # the conditions reach the model
    unmasked = reference(local, *guided_call(masked=False))
    assert (want - unmasked).abs().max() > 1e-3   # and the masks' per-row timesteps
    with ModelSession(engines(world), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    assert report(f"MiniMax-H3 with keyframes, references and masks, {plan.describe()}", (got - want).abs().max(),
                  bound(want))


def test_a_pruned_file_reads_its_time_embedding_off_the_curve_table_on_every_plan(engines, tmp_path):
    """Comfy-Org's pruned files carry adaln_t_table instead of a time embedder: t in [0, 1] read off its rows by
    linear interpolation (t = 1 on the last interval), the modulations taking it without an activation (ComfyUI's
    use_adaln_curves), each block's modulation projection once a call; the same split sequence on two ranks equals
    one."""
    pruned = write_tiny("minimax-h3", str(tmp_path), variant="minimax-h3-pruned")
    info = inspect_model(pruned)
    assert (info.variant, info.config["adaln_curve_grid"], info.config["time_embed_dim"]) == ("minimax-h3-pruned",
                                                                                              33, 16)
    flow = FlowModel(load_model(pruned, dtype="fp32", device=torch.device("cpu")))
    table = flow.model.time_embedder.table
    got = flow.model.time_embedder(torch.tensor([0.0, 0.5, 1.0, 0.51]))
    frac = 0.51 * 32 - 16
    want = torch.stack([table[0], table[16], table[32], table[16] + frac * (table[17] - table[16])])
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    x, t, c = h3_call(seed=4)
    calls = []   # each block's modulation projection, and the output norm's, run once a call
    for linear in [b.adaln_proj.linear for b in flow.model.transformer_blocks] + [flow.model.norm_out.linear]:
        linear.register_forward_hook(lambda m, a, o: calls.append(m))
    want = reference(flow, x, t, c)
    assert len(calls) == len(set(calls)) == len(flow.model.transformer_blocks) + 1
    with ModelSession(engines(2), request(pruned, c, ParallelPlan(ulysses=2))) as s:
        out = s.call(x, t, c)
    assert report("MiniMax-H3 pruned file, ulysses2", (out - want).abs().max(), bound(want))


def test_the_audio_velocity_is_converted_in_float32_whatever_the_models_dtype():
    """The carried audio's velocity, (1 - s) x audio + (1 + (s - 1) sigma_a) v at s = 4, from bf16 inputs whose two
    terms nearly cancel: computed in float32 and rounded once it is the exact value to bf16's rounding (relative L2
    within 2^-8, one bf16 ulp), where the same sum in bf16 is off by far more."""
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(1, 32, 2, 64, generator=g).to(torch.bfloat16)
    sigma_a = torch.tensor(0.37)
    v = ((3.0 * audio.double() + 1e-2 * torch.randn(audio.shape, generator=g, dtype=torch.float64))
         / (1.0 + 3.0 * 0.37)).to(torch.bfloat16)   # the result about 1/300 of each term
    exact = -3.0 * audio.double() + (1.0 + 3.0 * sigma_a.double()) * v.double()
    got = minimax_h3.carried_velocity(v, audio, 4.0, sigma_a, torch.bfloat16)
    in_bf16 = (1.0 - 4.0) * audio + (1.0 + 3.0 * sigma_a).to(torch.bfloat16) * v
    err = float((got.double() - exact).norm() / exact.norm())
    err_bf16 = float((in_bf16.double() - exact).norm() / exact.norm())
    print(f"carried audio velocity from bf16 inputs: in float32 relative L2 {err:.3g} (bound 2^-8 = 0.0039); the "
          f"sum in bf16: {err_bf16:.3g}")
    assert err <= 2.0 ** -8 and err_bf16 > 2.0 ** -8


@pytest.mark.parametrize("variant", ["minimax-h3", "minimax-h3-pruned"])
def test_the_fp8_weight_option_leaves_the_float32_islands_in_float32(tmp_path, variant):
    """The fp8 weight option on MiniMax-H3 in bf16 holds the blocks' Linear weights in fp8 and the float32 islands
    (patch projections, time embedding or curve table, output heads) in float32, as ComfyUI builds them whatever the
    weight dtype. The call stays within fp8's rounding of the fp32 result (e4m3: each weight off by up to 2^-4, about
    3.6% RMS, over the tiny model's few layers: bound 0.15 relative L2; with the islands in fp8 as before, the tiny
    model measured 0.057 where this measures about 0.03)."""
    source = write_tiny("minimax-h3", str(tmp_path), variant=variant)
    loaded = load_model(source, dtype="bf16", fp8_weights=True)
    assert loaded.model.proj_out.weight.dtype == loaded.model.proj_in.weight.dtype == torch.float32
    assert loaded.model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    # a pruned (curve-form) file's modulation projections are islands too: ComfyUI builds them with adaln_dtype
    # float32 for that form alone (comfy/ldm/minimax/model.py:460-461); the full form's take the weight dtype
    island = torch.float32 if variant == "minimax-h3-pruned" else torch.float8_e4m3fn
    assert {b.adaln_proj.linear.weight.dtype for b in loaded.model.transformer_blocks} == {island}
    assert loaded.model.norm_out.linear.weight.dtype == island
    if variant == "minimax-h3-pruned":
        plain = load_model(source, dtype="bf16").model   # and in bf16 without the option
        assert plain.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.float32
        assert plain.transformer_blocks[0].adaln_proj.linear._diffusers_hook.compute_dtype == torch.float32
    x, t, c = h3_call()
    want = reference(FlowModel(load_model(source, dtype="fp32")), x, t, c)
    got = reference(FlowModel(loaded), x, t, c)
    rel = float((got.float() - want).norm() / want.norm())
    print(f"{variant} fp8 weights, bf16 compute vs fp32: relative L2 {rel:.3g} (bound 0.15)")
    assert torch.isfinite(got).all() and rel < 0.15


@pytest.mark.parametrize("fmt", ["fp8_mixed", "fp8_scaled"])
def test_fp8_files_run_their_exact_dequantized_weights(tmp_path, fmt):
    """ComfyUI's fp8 files (the blocks' matrices fp8 with a scale each): the engine's model from the fp8 file equals
    the model from a float32 file of its dequantized values (fp8 x scale, written here), within fp32 rounding. (The
    family's forward casts each input to its layer's compute dtype, not to the fp8 bytes diffusers' get_parameter_dtype
    would name.)"""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    path = write_tiny("minimax-h3", str(tmp_path), format=fmt)
    stored = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k == "xdit.synthetic"}
    scales = {k: v for k, v in stored.items() if k.endswith(("weight_scale", "scale_weight"))}
    exact = {}
    for k, v in stored.items():
        if k in scales or k.endswith("scale_input") or k == "scaled_fp8":
            continue
        layer = k[:-len("weight")]
        scale = scales.get(layer + "weight_scale", scales.get(layer + "scale_weight")) if k.endswith("weight") else None
        exact[k] = v.float() * scale.float() if scale is not None else v.float()
    save_file(exact, str(tmp_path / "exact.safetensors"), metadata=metadata)
    x, t, c = h3_call(seed=5)
    want = reference(FlowModel(load_model(str(tmp_path / "exact.safetensors"))), x, t, c)
    got = reference(FlowModel(load_model(path)), x, t, c)
    assert report(f"MiniMax-H3 {fmt} file vs its dequantized values", (got - want).abs().max(), bound(want))


def test_bf16_models_hold_comfyuis_float32_islands_in_float32_on_every_load_path(engines, path):
    """ComfyUI's MiniMax-H3 keeps its patch projections, time embedding, output heads and RoPE frequencies in float32
    whatever the model's dtype (diffusers' _keep_in_fp32_modules lists the same): a bf16 model from the file, a
    synthetic one and one whose weights are divided hold exactly those in float32 and the rest in bf16; the forward
    feeds each island float32 (the shim diffusers' dtype lookup reads), and the divided model's call equals one
    rank's within bf16 rounding (relative L2 2e-2: a few bf16 roundings of values of order 1; measured 0)."""
    islands = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")
    for source in (path, "synthetic:minimax-h3:tiny"):
        model = load_model(source, dtype="bf16").model
        held = {n: t.dtype for n, t in model.state_dict().items() if t.is_floating_point()}
        assert {n for n, d in held.items() if d == torch.float32} == \
            {n for n in held if n.split(".")[0] in islands}, source
        assert {d for n, d in held.items() if n.split(".")[0] not in islands} == {torch.bfloat16}, source
        assert model.proj_out._diffusers_hook.compute_dtype == torch.float32
        assert model.context_embedder._diffusers_hook.compute_dtype == torch.bfloat16
    x, t, c = h3_call()
    outs = []
    for plan in (ParallelPlan(), ParallelPlan(ulysses=2, shard=2)):
        r = GenerateRequest(model=path, cond=c["context"], latent_raw=torch.zeros(()).expand(1, 24, 3, 4, 6),
                            plan=plan, dtype="bf16").validate(plan.world_size)
        with ModelSession(engines(2), r) as s:
            outs.append(s.call(x, t, c))
    assert torch.isfinite(outs[0]).all()
    rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
    print(f"MiniMax-H3 bf16, ulysses2 x shard2 vs one rank: relative L2 {rel:.2e} (bound 2e-2)")
    assert rel <= 2e-2


def test_cfg_parallel_runs_the_two_passes_at_their_own_text_lengths_side_by_side(engines, path, local):
    """ComfyUI calls H3's positive and negative one at a time (its model takes a batch of one): the step's two calls
    reach the ranks as one request, each on its CFG group, with the text encoder's token tags on the positive."""
    x, t, pos = h3_call(seed=1, text=9)
    _, _, neg = h3_call(seed=2, text=5)
    pos["token_tags"] = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    want = [reference(local, x, t, c) for c in (pos, neg)]
    with ModelSession(engines(2), request(path, pos, ParallelPlan(cfg=2), neg=neg["context"])) as s:
        got = s.call_group([(x, t, pos), (x, t, neg)])
    for name, g, w in zip(("positive (9 tokens, tagged)", "negative (5 tokens)"), got, want):
        assert report(f"MiniMax-H3 cfg2: {name}", (g - w).abs().max(), bound(w))
    tagged = reference(local, x, t, {**pos, "token_tags": torch.ones(1, 9)})
    assert (tagged - want[0]).abs().max() > 1e-3   # the tags reach the modulation


def test_calls_of_unequal_rows_on_divided_weights_across_cfg_groups_keep_every_shard_group_in_step(engines, path,
                                                                                                    local):
    """H3's model runs one forward a row, and on cfg2 x shard2 every forward gathers each block over both CFG groups:
    a positive call of two rows and a negative of one (group 0 two forwards, group 1 one) would leave group 0 in a
    gather group 1 never enters. Group 1 makes the forward it is short (its output dropped); each output equals the
    one-rank model's, twice in a row (the group stays in step)."""
    calls = [h3_call(seed=s) for s in (1, 2, 3)]
    pos = (torch.cat([calls[0][0], calls[1][0]]), torch.cat([calls[0][1], calls[1][1]]),
           {k: torch.cat([calls[0][2][k], calls[1][2][k]]) for k in calls[0][2]})
    neg = calls[2]
    want = [torch.cat([reference(local, *calls[0]), reference(local, *calls[1])]), reference(local, *neg)]
    with ModelSession(engines(2), request(path, calls[0][2], ParallelPlan(cfg=2, shard=2), neg=neg[2]["context"])) as s:
        for round in range(2):
            got = s.call_group([pos, neg])
            for name, g, w in zip(("positive (2 rows)", "negative (1 row)"), got, want):
                assert report(f"MiniMax-H3 cfg2 x shard2, round {round}: {name}", (g - w).abs().max(), bound(w))


# ---- the ComfyUI side: the engine's MODEL receives ComfyUI's two streams and payload --------------------------------
def test_the_engines_model_packs_comfyuis_streams_and_reads_its_payload_and_shift_options(model_parts):
    link = RecordingLink()
    meta = types.SimpleNamespace(sigma_shift_video=12.0, sigma_shift_audio=3.0)
    t = model_parts.EngineTransformer(link, {}, meta=meta, family=minimax_h3.FAMILY)
    video, audio = torch.randn(1, 24, 2, 4, 6), torch.randn(1, 32, 2, 5)
    context = torch.randn(1, 7, TEXT)
    assert t.preprocess_text_embeds(context) is context   # the ranks refine the text in each forward
    tags = torch.tensor([[1, 0, 0, 1, 1, 1, 1]])
    out = t([video, audio], torch.tensor([500.0]), context,
            transformer_options={"minimax_h3_sigma_shift_video": 10.0, "minimax_h3_sigma_shift_audio": 2.5},
            minimax_payload={"audio_scale": 4.0, "seed": 3, "text_token_tags": tags, "layout": object()})
    x, _, _, _, kwargs = link.calls[0]
    assert torch.equal(x, torch.cat([video.reshape(1, 1, -1), audio.reshape(1, 1, -1)], dim=-1))
    assert kwargs["av_shape"].tolist() == [[24, 2, 4, 6, 32, 2, 5]]
    assert kwargs["audio_scale"].tolist() == [4.0] and kwargs["sigma_shift"].tolist() == [[10.0, 2.5]]
    assert torch.equal(kwargs["token_tags"], tags.float())
    assert isinstance(out, list) and torch.equal(out[0], -video) and torch.equal(out[1], -audio)
    assert "blocks" not in kwargs   # no keyframes, no references
    # a first frame and an audio guide at frame 5 (MiniMaxH3ImageToVideo, MiniMaxH3AddGuide), then an image reference
    first, sound = torch.randn(1, 24, 1, 4, 6), torch.randn(1, 32, 2, 3)
    ref = torch.randn(1, 24, 1, 2, 4)
    payload = {"keyframes": [{"resolved_frame_index": 0, "latent": first},
                             {"resolved_frame_index": 5, "audio_latent": sound}],
               "refs": [{"kind": "image", "latent_h": 2, "latent_w": 4, "latent": ref}], "seed": 2 ** 63 + 12345}
    t([video, audio], torch.tensor([500.0]), context, minimax_payload=payload)
    kwargs = link.calls[-1][4]
    assert kwargs["blocks"][0].tolist() == [[0, 0, 1, 4, 6, 0, 1, 0], [0, 5, 0, 0, 0, 3, 0, 1], [1, 0, 1, 2, 4, 0, 1, 0]]
    assert torch.equal(kwargs["cond_latents"][0], torch.cat([first.reshape(-1), ref.reshape(-1), sound.reshape(-1)]))
    assert sum(int(v) << s for v, s in zip(kwargs["cond_seed"][0].tolist(), (0, 16, 32, 48))) == 2 ** 63 + 12345
    assert kwargs["cond_aug"].tolist() == [[0.999, 1.0]]
    mask = torch.rand(1, 1, 2, 4, 6)
    t([video, audio], torch.tensor([500.0]), context, denoise_mask=mask)
    assert torch.equal(link.calls[-1][4]["video_mask"][0], mask.reshape(-1).double())
    with pytest.raises(model_parts.ModelPatchError, match="does not cover"):
        t([video, audio], torch.tensor([500.0]), context, audio_denoise_mask=torch.ones(1, 1, 2, 4))
    with pytest.raises(model_parts.ModelPatchError, match="takes a video latent"):
        t([video, audio, audio], torch.tensor([500.0]), context)
