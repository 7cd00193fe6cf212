"""LTX-2.5 (Lightricks, audio + video), the LTX-2.3 family's second variant: a tiny file in ComfyUI's layout recognised
and read as ComfyUI 0.33 reads it (ff_bias from the header, the keyframe embedding from its tensor), the keyframe
embedding added where ComfyUI's model adds it (every first-frame token, plain text-to-video included; never a guide
token; generated keyframes' slots), and every plan on real rank processes equal to one rank. ComfyUI's own LTX-2.5
model against the engine is in the live check (tests/comfyui_ltx25_check.py, skipped without COMFYUI_PATH)."""
import json

import pytest
import torch
from safetensors import safe_open

import test_ltx23 as ltx23_tests   # its call builders and bounds (the tiny 2.5 has the tiny 2.3's widths)
from engine.errors import CheckpointError
from engine.families import ltx23, ltx25
from engine.families.ltx23_layout import DIMS, header_config, infer, shapes, tiny_metadata, to_comfy
from engine.generate.model_call import ModelSession
from engine.generate.request import GenerateRequest
from engine.models.flow import FlowModel
from engine.models.load import inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan

from tolerance import fp32_bound, report

TINY = DIMS["tiny"]["ltx-2.5"]
ltx_call, guided_call, reference, bound = (ltx23_tests.ltx_call, ltx23_tests.guided_call, ltx23_tests.reference,
                                           ltx23_tests.bound)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny("ltx23", str(tmp_path_factory.mktemp("ltx25")), variant="ltx-2.5")


@pytest.fixture(scope="module")
def local(path):
    return FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))


# ---- the file --------------------------------------------------------------------------------------------------------
def test_an_ltx25_file_is_recognised_and_read_as_comfyui_reads_it(path, local):
    """The tiny file has the released file's form: the header states ff_bias false (and nothing of the keyframe
    embedding), the video feed-forwards have no biases, the audio ones keep theirs, keyframes_abs_pos_embedding
    [1, inner] is there; it is the LTX family's ltx-2.5 (ComfyUI's one LTXAV model class), every tensor one rename of
    the diffusers model's, and the released dims give LTX-2.3's config but for those two settings."""
    info = inspect_model(path)
    assert (info.family, info.variant, info.layout) == ("ltx23", "ltx-2.5", "ltx")
    assert (info.config["ff_bias"], info.config["audio_ff_bias"], info.config["use_keyframes_abs_pos_embedding"]) == \
        (False, True, True)
    with safe_open(path, "pt") as f:
        header = json.loads(f.metadata()["config"])["transformer"]
        keys = set(f.keys())
        embedding = f.get_tensor("keyframes_abs_pos_embedding")
    assert header == header_config(TINY) and header["ff_bias"] is False
    assert "use_keyframes_abs_pos_embedding" not in header and embedding.shape == (1, TINY.inner)
    assert not [k for k in keys if k.startswith("transformer_blocks.") and ".ff." in k and k.endswith(".bias")]
    assert "transformer_blocks.3.audio_ff.net.2.bias" in keys
    mine = local.model.state_dict()
    assert {to_comfy(k) for k in mine} == keys
    assert torch.equal(mine["keyframes_abs_pos_embedding"], embedding)
    full = {v: infer("ltx", shapes(DIMS["full"][v]), tiny_metadata(DIMS["full"][v])) for v in ("ltx-2.3", "ltx-2.5")}
    assert full["ltx-2.5"][1] == "ltx-2.5" and full["ltx-2.3"][1] == "ltx-2.3"
    differs = {k for k in full["ltx-2.5"][0] if full["ltx-2.5"][0][k] != full["ltx-2.3"][0][k]}
    assert differs == {"ff_bias", "use_keyframes_abs_pos_embedding"}


def test_a_header_its_tensors_contradict_or_comfyui_cannot_build_is_refused_in_one_line():
    s25, s23 = shapes(TINY), shapes(DIMS["tiny"]["ltx-2.3"])
    stated = json.loads(tiny_metadata(TINY)["config"])
    stated["transformer"]["ff_bias"] = True   # the header says biases the file does not hold
    with pytest.raises(CheckpointError, match="sets ff_bias True but whose ff layers have no biases") as e:
        infer("ltx", s25, {"config": json.dumps(stated)})
    assert str(e.value).startswith("an LTX-2.5 transformer") and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="sets ff_bias False but whose ff layers have biases"):
        infer("ltx", s23, tiny_metadata(TINY))
    stated["transformer"].update(ff_bias=False, use_prompt_adaln_single=False)
    with pytest.raises(CheckpointError, match="ComfyUI 0.33 cannot sample it either"):
        infer("ltx", s25, {"config": json.dumps(stated)})


@pytest.mark.parametrize("fmt", ["int8_convrot", "gguf"])
def test_the_templates_int8_convrot_file_and_a_gguf_run_their_dequantized_weights(tmp_path, fmt):
    """The LTX-2.5 templates' file format (ComfyUI's int8_tensorwise layers, ConvRot) and a ComfyUI-GGUF file (arch
    ltxv, Q8_0 matrices, the header's config as a GGUF string): each gives the model of a float32 file of its
    dequantized values (written with the same header config), within fp32 rounding over every Linear, the keyframe
    embedding as stored."""
    from safetensors.torch import save_file
    path = write_tiny("ltx23", str(tmp_path), variant="ltx-2.5", format=fmt)
    if fmt == "gguf":
        import gguf
        import numpy as np
        reader = gguf.GGUFReader(path)
        config = next(str(bytes(f.parts[f.data[-1]]), "utf-8") for k, f in reader.fields.items() if k == "config")
        values = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
                  .reshape(tuple(reversed([int(v) for v in t.shape]))).float() for t in reader.tensors}
    else:
        import test_int8_checkpoints
        with safe_open(path, "pt") as f:
            config = f.metadata()["config"]
        values = test_int8_checkpoints.dequantized_file(path)
    exact = str(tmp_path / "exact.safetensors")
    save_file(values, exact, metadata={"config": config})
    assert inspect_model(path).variant == "ltx-2.5" and "keyframes_abs_pos_embedding" in values
    x, t, c = ltx_call(seed=7, masked=True)
    want = reference(FlowModel(load_model(exact)), x, t, c)
    got = reference(FlowModel(load_model(path)), x, t, c)
    # every Linear sums in another order (the engine rotates the input, not the weight): 8 sequential ones a block
    # (self-, text and audio-video attention, feed-forward: in and out each), 4 a connector block
    linears = 8 * TINY.depth + 4 * TINY.depth_connector
    assert report(f"LTX-2.5 {fmt} file vs its dequantized values", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4 * TINY.inner, depth=linears))


# ---- the keyframe embedding ------------------------------------------------------------------------------------------
def embedded(flow, x, t, c):
    """(the output, the video tokens after proj_in, the tokens the first block receives) of one call."""
    seen = {}
    hooks = [flow.model.proj_in.register_forward_hook(lambda m, a, out: seen.__setitem__("proj_in", out)),
             flow.model.transformer_blocks[0].register_forward_pre_hook(
                 lambda m, a, kw: seen.__setitem__("block", kw["hidden_states"]), with_kwargs=True)]
    try:
        out = reference(flow, x, t, c)
    finally:
        for h in hooks:
            h.remove()
    return out, seen["proj_in"], seen["block"]


def marked(flow, proj_in, tokens):
    """proj_in's output with the embedding added on `tokens` as ComfyUI adds it (x + mask x embedding)."""
    mask = torch.zeros(1, proj_in.shape[1], 1)
    mask[:, tokens] = 1.0
    return proj_in + mask * flow.model.keyframes_abs_pos_embedding


def test_plain_text_to_video_adds_the_keyframe_embedding_to_every_first_frame_token(local):
    """ComfyUI adds it to every token whose temporal start is 0 in every call (model.py:1186-1227), not only where a
    caller marks keyframes (diffusers' video_keyframes_mask): a text-to-video call with no mask, guide or keyframe
    entry gets it on the first latent frame's 2 x 3 tokens, exactly x + embedding, and nowhere else; it moves the
    output."""
    x, t, c = ltx_call(seed=3)
    assert "keyframe_slots" not in c and "guide" not in c
    out, proj_in, block = embedded(local, x, t, c)
    assert torch.equal(block, marked(local, proj_in, slice(0, 6)))
    embedding = local.model.keyframes_abs_pos_embedding
    saved = embedding.detach().clone()
    with torch.no_grad():
        embedding.zero_()
    try:
        unmarked = reference(local, x, t, c)
    finally:
        with torch.no_grad():
            embedding.copy_(saved)
    print(f"LTX-2.5 keyframe embedding's effect on a text-to-video call: {(out - unmarked).abs().max():.3g}")
    assert (out - unmarked).abs().max() > 1e-3


def test_guide_tokens_are_never_marked_dropped_tokens_leave_first_and_generated_keyframes_add_their_frames(local):
    """LTXVAddGuide's first image sits at frame 0 (temporal start 0) but is a guide token: not marked; the second
    guide an IC-LoRA's dilated reference (its tokens off the even rows and columns out of the sequence); a
    generated_keyframes entry for latent frame 2 marks that frame's tokens too; one recorded at another size is refused
    in ComfyUI's words."""
    x, t, c = guided_call(seed=4, dilated=True)
    kept = int(c["guide"][0, 2])
    _, proj_in, block = embedded(local, x, t, c)
    assert proj_in.shape[1] == kept == 3 * 6 + 6 + 2   # 3 frames, the first guide whole, 2 of the dilated one's 6
    assert torch.equal(block, marked(local, proj_in, slice(0, 6)))
    slots = ltx25.generated_slots({"tokens_per_frame": 6, "first_latent_frame": 2, "num_keyframes": 1}, 6, 1)
    _, proj_in, block = embedded(local, x, t, {**c, "keyframe_slots": slots})
    assert torch.equal(block, marked(local, proj_in, [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]))
    video, sound = (1, 128, 3, 2, 3), (1, 8, 7, 16)
    with pytest.raises(ValueError, match="recorded at 24 tokens per latent frame but this latent has 6"):
        ltx23.comfy_call([video, sound], {"generated_keyframes": {"tokens_per_frame": 24, "first_latent_frame": 1,
                                                                 "num_keyframes": 1}}, {}, torch.tensor([0.5]))
    # LTX-2.3's model (ComfyUI's has no embedding: keyframes_abs_pos_embedding None) never reads the entry
    extras, _ = ltx23.comfy_call([video, sound], {"generated_keyframes": {"tokens_per_frame": 24}}, {},
                                 torch.tensor([0.5]), meta=type("Meta", (), {"keyframes_abs_pos_embedding": None})())
    assert "keyframe_slots" not in extras


# ---- every plan ------------------------------------------------------------------------------------------------------
def two_rows(seed=0):
    """One call of two rows (a batch of two clips), as ComfyUI's model gets it: what data parallel splits."""
    (x1, _, c1), (x2, _, c2) = ltx_call(seed=seed), ltx_call(seed=seed + 1)
    extras, ts = ltx23.comfy_call([(2, 128, 3, 2, 3), (2, 8, 7, 16)], {"frame_rate": 24.0}, {}, torch.tensor([0.7] * 2))
    return torch.cat([x1, x2]), ts, {"context": torch.cat([c1["context"], c2["context"]]), **extras}


def request(path, c, plan, neg=None, rows=1):
    frames, h, w = (int(v) for v in c["av_shape"][0, 1:4].tolist())
    return GenerateRequest(model=path, cond=c["context"][:rows],
                           latent_raw=torch.zeros(()).expand(rows, 128, frames, h, w),
                           cfg=2.0 if neg is not None else 1.0, neg_cond=neg, plan=plan).validate(plan.world_size)


@pytest.mark.parametrize("plan,case", [
    (ParallelPlan(ulysses=2), "masked"), (ParallelPlan(ring=2), "nine tokens"), (ParallelPlan(ring=2), "guided"),
    (ParallelPlan(ulysses=2, shard=2), "masked"), (ParallelPlan(cfg=2, shard=2), "negative"),
    (ParallelPlan(dp=2), "two rows")],
    ids=["ulysses2", "ring2-padded", "ring2-guided", "ulysses2-shard2", "cfg2-shard2", "dp2"])
def test_every_plan_equals_one_rank(engines, path, local, plan, case):
    """On 2 ranks: the video tokens and their keyframe marks split together (Ulysses; Ring with 9 tokens padded to 10,
    the first frame's marks all on rank 0; Ring with LTXVAddGuide's guides and a dilated reference, the frame-0 guide
    unmarked), the weights divided, the positive and negative passes side by side (CFG parallel, 9 and 4 text tokens),
    two clips one a rank (data parallel); each equal to one rank within fp32 rounding over the blocks and connectors."""
    neg = None
    if case == "masked":
        calls = [ltx_call(seed=1, masked=True)]
    elif case == "nine tokens":
        calls = [ltx_call(seed=5, frames=3, h=1, w=3, audio=4)]   # 9 video tokens, 5 a rank; the first 3 marked
    elif case == "guided":
        calls = [guided_call(seed=6, dilated=True)]
    elif case == "negative":
        calls = [ltx_call(seed=1, text=9, masked=True), ltx_call(seed=2, text=4, masked=True)]
        calls[1] = (calls[0][0], calls[0][1], calls[1][2])
        neg = calls[1][2]["context"]
    else:
        calls = [two_rows(seed=7)]
    want = [reference(local, *call) for call in calls]
    with ModelSession(engines(2), request(path, calls[0][2], plan, neg, rows=calls[0][0].shape[0])) as s:
        got = s.call_group(calls) if len(calls) > 1 else [s.call(*calls[0])]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert report(f"LTX-2.5 {case}, {plan.describe()}", (g - w).abs().max(), bound(w))


def test_the_planner_prices_the_templates_clip_at_24_fps():
    """LTX-2.5's stock job is its template's first pass (640x352, 121 frames, 8 steps, cfg 1: LTXVDualCFGGuider at
    1 and 1) with 126 audio rows (121 frames at 24 fps, 25 audio latents a second); LTX-2.3's at 25 fps has 121."""
    job = ltx23.FAMILY.stock_jobs["ltx-2.5"]
    assert (job.workflow, job.width, job.height, job.frames, job.steps, job.cfg) == \
        ("ltx-2.5-t2v", 640, 352, 121, 8, 1.0)
    configs = {v: infer("ltx", shapes(DIMS["full"][v]), tiny_metadata(DIMS["full"][v]))[0]
               for v in ("ltx-2.3", "ltx-2.5")}
    assert ltx23.FAMILY.extra_tokens(configs["ltx-2.5"], 16) == 126
    assert ltx23.FAMILY.extra_tokens(configs["ltx-2.3"], 16) == 121
    assert ltx23.FAMILY.comfyui_since("ltx-2.5") == "0.32" and "Gemma 4" in ltx23.FAMILY.text_encoder("ltx-2.5")


def test_the_keyframe_mask_follows_comfyuis_rule_worked_by_hand():
    """keyframes_abs_pos_mask, worked for 2 frames of 1 x 2 tokens then 2 guide tokens at frame 0 and one token
    dropped: starts (time / fps) 0, 0, 1/24, 1/24 for the video, 0, 0 for the guides; the guide tokens unmarked; a
    generated keyframe slot on latent frame 1 counted before the drop (ComfyUI's slots[grid_mask])."""
    coords = ltx23.video_coords(3, 1, 2, 24.0)   # frames 0, 1 and the guides' frame, then the guides placed at 0
    coords[:, 0, 4:] = 0.0
    keep = torch.tensor([0, 2, 3, 4, 5])   # token 1 (frame 0) dropped
    coords = coords.index_select(2, keep)
    got = ltx25.keyframe_mask(coords, 2, None, keep, 2, 6, torch.float32)
    assert got.shape == (1, 5, 1) and got.reshape(-1).tolist() == [1, 0, 0, 0, 0]
    got = ltx25.keyframe_mask(coords, 2, (1, 1), keep, 2, 6, torch.float32)
    assert got.reshape(-1).tolist() == [1, 1, 1, 0, 0]
