"""LTX-2.3 (Lightricks, audio + video): a file in ComfyUI's layout recognised and read as ComfyUI reads it (its header's
config required), the positions ComfyUI's LTXAV model gives the tokens, the engine's MODEL receiving ComfyUI's inputs
(the (video, audio) timestep tuple, frame_rate, the noise masks) and refusing what it does not run, and every plan on
real rank processes equal to one rank. ComfyUI's own LTXAV model against the engine is in the live check
(tests/comfyui_ltx_check.py, skipped without COMFYUI_PATH)."""
import contextlib
import dataclasses
import importlib
import itertools
import json
import math
import types

import pytest
import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.families import ltx23
from engine.families.ltx23_layout import DIMS, header_config, infer, shapes, tiny_metadata, to_comfy, to_diffusers
from engine.generate.model_call import ModelSession
from engine.generate.request import GenerateRequest
from engine.models.flow import FlowModel, Prepared
from engine.models.load import inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan
from engine.parallel.traffic import sp_gather_bytes, sp_merge_bytes

from conftest import PACK_NAME, RecordingLink
from tolerance import fp32_bound, report

TINY = DIMS["tiny"]["ltx-2.3"]
TEXT = TINY.inner + TINY.audio_inner   # the raw text: video inner + audio inner (the LTX-2.3 text projection's)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny("ltx23", str(tmp_path_factory.mktemp("ltx")))


@pytest.fixture(scope="module")
def local(path):
    return FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))


# ---- the file --------------------------------------------------------------------------------------------------------
def test_the_header_config_gives_the_config_and_every_tensor_is_one_rename(path, local):
    """The released header (32 x 128 video heads, 32 x 64 audio, 48 blocks, 8-block connectors) gives diffusers' own
    defaults for those (its LTX2VideoTransformer3DModel defaults are LTX-2.x's); the tiny file is recognised from its
    keys, its config read from its header, and every tensor of the file is one rename of a diffusers tensor, the
    connectors' included."""
    from diffusers import LTX2VideoTransformer3DModel
    import inspect
    full = shapes(DIMS["full"]["ltx-2.3"])
    config, variant = infer("ltx", full, tiny_metadata(DIMS["full"]["ltx-2.3"]))
    defaults = {k: p.default for k, p in inspect.signature(LTX2VideoTransformer3DModel.__init__).parameters.items()}
    for key in ("num_attention_heads", "attention_head_dim", "cross_attention_dim", "audio_num_attention_heads",
                "audio_attention_head_dim", "audio_cross_attention_dim", "num_layers", "in_channels",
                "audio_in_channels", "caption_channels", "pos_embed_max_pos", "base_height", "base_width",
                "audio_pos_embed_max_pos", "rope_theta"):
        assert config[key] == defaults[key], key
    assert variant == "ltx-2.3" and config["connector_num_layers"] == 8
    assert (config["gated_attn"], config["cross_attn_mod"], config["rope_type"], config["use_prompt_embeddings"]) == \
        (True, True, "split", False)
    info = inspect_model(path)
    assert (info.family, info.variant, info.layout) == ("ltx23", "ltx-2.3", "ltx")
    assert info.config["num_layers"] == TINY.depth and info.config["connector_num_layers"] == TINY.depth_connector
    with safe_open(path, "pt") as f:
        header = json.loads(f.metadata()["config"])["transformer"]
        keys = set(f.keys())
    assert header == header_config(TINY) and header["rope_type"] == "split"
    mine = local.model.state_dict()
    assert {to_comfy(k) for k in mine} == keys and all(to_diffusers(to_comfy(k)) == k for k in mine)
    assert {k.split(".")[0] for k in mine} >= {"video_connector", "audio_connector", "prompt_adaln"}
    assert to_diffusers("video_embeddings_connector.transformer_1d_blocks.1.attn1.q_norm.weight") == \
        "video_connector.transformer_blocks.1.attn1.norm_q.weight"
    assert to_diffusers("transformer_blocks.3.scale_shift_table_a2v_ca_audio") == \
        "transformer_blocks.3.audio_a2v_cross_attn_scale_shift_table"
    with safe_open(path, "pt") as f:   # loaded as the file holds them
        for key in ("av_ca_v2a_gate_adaln_single.linear.weight", "audio_embeddings_connector.learnable_registers"):
            assert torch.equal(mine[to_diffusers(key)], f.get_tensor(key))
    # ComfyUI's q/k eps on every attention, the connectors' included
    eps = {m.eps for n, m in local.model.named_modules() if n.endswith(("norm_q", "norm_k"))}
    assert eps == {1e-5}


def test_files_ltx_23_is_not_are_refused_in_one_line():
    s = shapes(TINY)
    metadata = tiny_metadata(TINY)
    with pytest.raises(CheckpointError, match="without the `config`"):
        infer("ltx", s, {})
    with pytest.raises(CheckpointError, match="LTX-2.0"):
        infer("ltx", {**s, "caption_projection.linear_1.weight": (64, 3840)}, metadata)
    stated = json.loads(metadata["config"])
    stated["transformer"].pop("cross_attention_adaln")
    with pytest.raises(CheckpointError, match="LTX-2.0"):
        infer("ltx", s, {"config": json.dumps(stated)})
    stated = json.loads(metadata["config"])
    stated["transformer"]["rope_type"] = "interleaved"
    with pytest.raises(CheckpointError, match="rope_type"):
        infer("ltx", s, {"config": json.dumps(stated)})
    stated["transformer"].update(rope_type="split", audio_num_attention_heads=2, audio_attention_head_dim=16)
    with pytest.raises(CheckpointError, match="equal counts"):
        infer("ltx", s, {"config": json.dumps(stated)})


# ---- positions -------------------------------------------------------------------------------------------------------
def test_positions_are_comfyuis_worked_by_hand():
    """Video: latent corners x (8, 32, 32), time max(0, t + 1 - 8) then / fps; audio: max(0, 4 t - 3) x 160 / 16000
    seconds. Worked for 2 frames of 1 x 2 latent pixels at 24 fps and 3 audio latents."""
    v = ltx23.video_coords(2, 1, 2, 24.0)
    assert v.shape == (1, 3, 4, 2) and v.dtype == torch.float32
    # tokens (f, h, w): (0,0,0) (0,0,1) (1,0,0) (1,0,1); time: frame 0 [0, 1] latent -> [0, 8] px -> [0, 1] causal;
    # frame 1 [1, 2] -> [8, 16] -> [1, 9]
    fps32 = torch.tensor(1 / 24, dtype=torch.float32)   # ComfyUI multiplies by the float32 of 1 / fps
    assert torch.equal(v[0, 0], torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 9.0], [1.0, 9.0]]) * fps32)
    assert v[0, 1].tolist() == [[0, 32]] * 4 and v[0, 2].tolist() == [[0, 32], [32, 64], [0, 32], [32, 64]]
    a = ltx23.audio_coords(3)
    # latent t: start mel max(0, 4t - 3) = 0, 1, 5; end (t + 1): 1, 5, 9; x 160 / 16000 = / 100
    assert torch.allclose(a[0, 0], torch.tensor([[0.0, 0.01], [0.01, 0.05], [0.05, 0.09]]), rtol=0, atol=1e-9)
    assert a.shape == (1, 1, 3, 2) and a.dtype == torch.float32


# ---- one call --------------------------------------------------------------------------------------------------------
def ltx_call(seed=0, text=7, frames=3, h=2, w=3, audio=7, fps=24.0, masked=False, sigma=0.7):
    """A model call as ComfyUI's LTXAV model makes it: the packed streams, the text, and what call_extras reads of
    its inputs (frame_rate; with `masked` the first latent frame kept by a noise mask at 0.3, ComfyUI's per-token
    timesteps)."""
    g = torch.Generator().manual_seed(seed)
    video, sound = torch.randn(1, 128, frames, h, w, generator=g), torch.randn(1, 8, audio, 16, generator=g)
    x = torch.cat([video.reshape(1, 1, -1), sound.reshape(1, 1, -1)], dim=-1)
    t = torch.tensor([sigma])
    timestep = t
    if masked:
        per_frame = torch.ones(frames)
        per_frame[0] = 0.3
        v_t = (per_frame[:, None].expand(frames, h * w).reshape(1, -1, 1) * t)
        timestep = (v_t, t.reshape(1, 1, 1).expand(1, audio, 1))
    extras, ts = ltx23.comfy_call([tuple(video.shape), tuple(sound.shape)], {"frame_rate": fps}, {}, timestep)
    return x, ts, {"context": torch.randn(1, text, TEXT, generator=g), **extras}


def guide_coords(frame_idx: int, h: int, w: int) -> torch.Tensor:
    """[1, 3, h*w, 2]: the pixel coordinates LTXVAddGuide records for a one-image guide at pixel frame frame_idx
    (worked by hand: a one-frame latent's corners x (8, 32, 32), the causal fix on time (t + 1 - 8, at least 0: start
    0, end 1), frame_idx added to time; tokens rows then columns)."""
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    t = torch.tensor([0.0, 1.0]).expand(h * w, 2) + frame_idx
    return torch.stack([t, torch.stack([ys * 32, ys * 32 + 32], -1), torch.stack([xs * 32, xs * 32 + 32], -1)])[None]


def guided_call(seed=0, text=7, frames=3, h=2, w=3, audio=7, fps=24.0, sigma=0.7, strengths=(0.7, 0.7),
                last=None, pixel_mask=None, dilated=False):
    """A model call as ComfyUI's LTX model gets it after LTXVAddGuide with a first image (frame 0) then a last image
    (frame -1, which resolves to (frames - 1) x 8, unless `last` names another), each one latent frame appended to the
    video latent with noise mask max(0, 1 - strength) and one guide_attention_entry; pixel_mask: the last guide's
    attention mask [1, 1, F', H', W']; dilated: the last guide as an IC-LoRA's reference at downscale 2 (its latent
    spread over every other row and column, the others under mask -1 - strength: not in the sequence)."""
    g = torch.Generator().manual_seed(seed)
    total = frames + 2
    video, sound = torch.randn(1, 128, total, h, w, generator=g), torch.randn(1, 8, audio, 16, generator=g)
    x = torch.cat([video.reshape(1, 1, -1), sound.reshape(1, 1, -1)], dim=-1)
    mask = torch.ones(1, 1, total, h, w)
    for i, s in enumerate(strengths):
        mask[:, :, frames + i] = max(0.0, 1.0 - s)
    last = (frames - 1) * 8 if last is None else last
    coords = torch.cat([guide_coords(0, h, w), guide_coords(last, h, w)], dim=2)
    entries = [{"pre_filter_count": h * w, "strength": s, "pixel_mask": None, "latent_shape": [1, h, w]}
               for s in strengths]
    if pixel_mask is not None:
        entries[1]["pixel_mask"] = pixel_mask
    if dilated:   # LTXVAddGuide.dilate_latent at 2: kept where row and column are even, -1 elsewhere, less strength
        spread = torch.full((h, w), -1.0)
        spread[::2, ::2] = 1.0
        mask[0, 0, -1] = spread - strengths[1]
        entries[1]["latent_shape"] = [1, -(-h // 2), -(-w // 2)]
        coords[:, 1:, h * w:, 1] += torch.tensor([32.0, 32.0]).view(1, 2, 1)   # the reference's end, one grid step on
    timestep = (mask.reshape(1, -1, 1) * sigma, torch.tensor([sigma]).reshape(1, 1, 1).expand(1, audio, 1))
    extras, ts = ltx23.comfy_call([tuple(video.shape), tuple(sound.shape)],
                                  {"frame_rate": fps, "denoise_mask": mask, "keyframe_idxs": coords,
                                   "guide_attention_entries": entries}, {}, timestep)
    return x, ts, {"context": torch.randn(1, text, TEXT, generator=g), **extras}


def reference(flow, x, t, c):
    extras = {k: v for k, v in c.items() if k in ltx23.EXTRAS}
    return flow.output(x, t, Prepared(c["context"], None, torch.ones(1), extras=extras))


def request(path, c, plan, neg=None):
    frames, h, w = (int(v) for v in c["av_shape"][0, 1:4].tolist())
    return GenerateRequest(model=path, cond=c["context"], latent_raw=torch.zeros(()).expand(1, 128, frames, h, w),
                           cfg=2.0 if neg is not None else 1.0, neg_cond=neg, plan=plan).validate(plan.world_size)


def bound(want):
    return fp32_bound(want.abs().max(), reduction=4 * TINY.inner, depth=TINY.depth + TINY.depth_connector)


@pytest.mark.parametrize("fmt", ["fp8_mixed", "fp8_scaled"])
def test_fp8_files_run_their_exact_dequantized_weights(tmp_path, fmt):
    """ComfyUI's fp8 files (the blocks' matrices fp8 with a scale each; the fp8 files LTX-2.3's templates load hold
    fp8 weights with a weight_scale each): the engine's model from the fp8 file equals the model from a float32 file of
    its dequantized values (fp8 x scale, written here with the same header config), within fp32 rounding, with the
    text connectors and the three compensations in place."""
    from safetensors.torch import load_file, save_file
    path = write_tiny("ltx23", str(tmp_path), format=fmt)
    stored = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k in ("xdit.synthetic", "config")}
    scales = {k: v for k, v in stored.items() if k.endswith(("weight_scale", "scale_weight"))}
    assert scales and any(v.dtype == torch.float8_e4m3fn for v in stored.values())
    exact = {}
    for k, v in stored.items():
        if k in scales or k.endswith(("scale_input", "input_scale", "comfy_quant")) or k == "scaled_fp8":
            continue
        layer = k[:-len("weight")]
        scale = scales.get(layer + "weight_scale", scales.get(layer + "scale_weight")) if k.endswith("weight") else None
        exact[k] = v.float() * scale.float() if scale is not None else v.float()
    save_file(exact, str(tmp_path / "exact.safetensors"), metadata=metadata)
    x, t, c = ltx_call(seed=5, masked=True)
    want = reference(FlowModel(load_model(str(tmp_path / "exact.safetensors"))), x, t, c)
    got = reference(FlowModel(load_model(path)), x, t, c)
    assert report(f"LTX-2.3 {fmt} file vs its dequantized values", (got - want).abs().max(), bound(want))


def test_a_gguf_file_with_its_config_runs_its_dequantized_weights_and_one_without_is_refused(tmp_path):
    """ComfyUI-GGUF's LTX-2.3 files carry the header's `config` as a GGUF string, which its loader hands ComfyUI as the
    metadata LTX-2.3's detection reads (ComfyUI-GGUF since its "load model config from metadata" change): such a file
    (make-tiny, Q8_0 matrices) gives the model of a float32 file of the values the gguf package's own dequantizer reads
    from it, within fp32 rounding; without the config it is refused in one line, as ComfyUI cannot build it either."""
    import gguf
    import numpy as np
    from safetensors.torch import save_file
    from engine.models.tiny import write_gguf
    path = write_tiny("ltx23", str(tmp_path), format="gguf")
    reader = gguf.GGUFReader(path)
    fields = {k: str(bytes(f.parts[f.data[-1]]), "utf-8") for k, f in reader.fields.items()
              if k in ("config", "xdit.synthetic")}
    assert set(fields) == {"config", "xdit.synthetic"}
    values = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
              .reshape(tuple(reversed([int(v) for v in t.shape]))).float() for t in reader.tensors}
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}
    exact = str(tmp_path / "exact.safetensors")
    save_file(values, exact, metadata={"config": fields["config"]})
    x, t, c = ltx_call(seed=7, masked=True)
    want = reference(FlowModel(load_model(exact)), x, t, c)
    got = reference(FlowModel(load_model(path)), x, t, c)
    assert load_model(path).stats["gguf_linears"] > 20
    assert report("LTX-2.3 GGUF Q8_0 file vs its dequantized values", (got - want).abs().max(), bound(want))
    bare = str(tmp_path / "no-config.gguf")
    write_gguf(bare, "ltxv", {k: v for k, v in values.items()}, "F32", {})
    with pytest.raises(CheckpointError, match="without the `config` -> `transformer` entry") as e:
        load_model(bare)
    assert "\n" not in str(e.value)


@contextlib.contextmanager
def without_pre_hooks(modules):
    """The modules' forward pre-hooks taken off for a with-block (the family's compensations), then put back."""
    saved = [(m, dict(m._forward_pre_hooks)) for m in modules]
    for m, _ in saved:
        m._forward_pre_hooks.clear()
    try:
        yield
    finally:
        for m, hooks in saved:
            m._forward_pre_hooks.update(hooks)


def test_the_compensations_and_the_per_token_timesteps_reach_the_model(local):
    """Each of ComfyUI's conventions the unmodified diffusers modules are given moves the output: the per-token
    timesteps of a noise mask, the crossed gate timesteps (with a mask the video's own per-token timestep differs from
    the audio's max), the v2a re-normalisation and the frame rate; with the hooks back the output is the same."""
    x, t, c = ltx_call(masked=True)
    want = reference(local, x, t, c)
    assert (want - reference(local, *ltx_call(masked=False))).abs().max() > 1e-3
    assert (reference(local, *ltx_call(fps=12.0, masked=True)) - want).abs().max() > 1e-4
    model = local.model
    gates = [model.av_cross_attn_video_a2v_gate, model.av_cross_attn_audio_v2a_gate]
    v2a = [b.video_to_audio_attn for b in model.transformer_blocks]
    assert all(m._forward_pre_hooks for m in gates + v2a)
    for modules in (gates, v2a):
        with without_pre_hooks(modules):
            assert (reference(local, x, t, c) - want).abs().max() > 1e-4
    assert torch.equal(reference(local, x, t, c), want)


@pytest.mark.parametrize("world,plan,masked", [
    (1, ParallelPlan(), True), (2, ParallelPlan(ulysses=2), True), (2, ParallelPlan(ring=2), False),
    (2, ParallelPlan(ulysses=2, shard=2), True), (4, ParallelPlan(ulysses=2, ring=2), True)],
    ids=["single", "ulysses2-masked", "ring2", "ulysses2-shard2-masked", "ulysses2-ring2-masked"])
def test_every_sequence_plan_splits_the_video_and_equals_one_rank(engines, path, local, world, plan, masked):
    """3 x 2 x 3 = 18 video tokens split across the ranks (Ulysses: the heads exchanged; Ring: the K/V passed on;
    ulysses2 x ring2: 5 a rank, the last ending in 2 pad rows), with their positions and per-token timesteps (masked:
    the first latent frame at 0.3 sigma); the audio (7 rows) and the text held whole on every rank, v2a's audio
    queries attending to each rank's own video keys, merged across the ranks."""
    x, t, c = ltx_call(masked=masked)
    want = reference(local, x, t, c)
    with ModelSession(engines(world), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    assert got.shape == want.shape == x.shape
    assert report(f"LTX-2.3 model call, {plan.describe()}{' masked' if masked else ''}", (got - want).abs().max(),
                  bound(want))


def test_a_video_the_degree_does_not_divide_is_padded_and_its_pad_rows_never_reach_v2a(engines, path, local):
    x, t, c = ltx_call(seed=5, frames=1, h=1, w=5, audio=4, masked=False)
    want = reference(local, x, t, c)
    with ModelSession(engines(2), request(path, c, ParallelPlan(ring=2))) as s:
        got = s.call(x, t, c)
    assert report("LTX-2.3, 5 video tokens on ring2", (got - want).abs().max(), bound(want))


def test_v2a_sends_only_its_partial_audio_results_never_the_video(engines, path, local):
    """Under sequence parallel the video-to-audio attention attends the audio (whole on every rank) to each rank's own
    video keys and exchanges only each rank's partial output and log-sum-exp (7 audio rows x 4 heads x (8 values +
    1 lse) fp32 a block, to 3 other ranks); the only video that travels is the output gathered after proj_out (18
    tokens padded to 20, 5 a rank, x 128 values, to 3 others), counted per call against the planner's formulas."""
    x, t, c = ltx_call(seed=6)
    plan = ParallelPlan(ulysses=2, ring=2)
    want = reference(local, x, t, c)
    with ModelSession(engines(4), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    sent = s.result.ranks[0]["bytes_sent_per_step"]   # per call on the MODEL route
    merge = sp_merge_bytes(7, TINY.audio_heads, TINY.audio_head_dim, TINY.depth, plan, 1, elem_bytes=4)
    gather = sp_gather_bytes(18, 128, plan, 1, elem_bytes=4)
    print(f"LTX-2.3 ulysses2 x ring2, rank 0 per call: {dict(sent)}; v2a merge {merge} B, output gather {gather} B")
    assert sent["sp_merge"] == merge and sent["sp_gather"] == gather
    assert report("LTX-2.3 ulysses2 x ring2, v2a merged", (got - want).abs().max(), bound(want))


def test_the_v2a_merge_of_split_keys_equals_one_softmax_over_all_of_them_on_every_rank_alike():
    """attention.py local_keys on each rank's share of the keys (the last share ending in 2 pad rows, copies of the
    last key, which must not enter the softmax), merged through the ranks' log-sum-exps, equals one attention over the
    real keys, the same to the bit on every rank (the audio stream stays identical across the ranks). Four stand-in
    ranks: each one's part is posted first, then each all-gather answers with all four."""
    from engine.parallel.attention import SequenceParallelAttention
    from engine.parallel.mesh import CommStats
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, n, 4, 8, generator=g) for n in (7, 18, 18))
    size, per = 4, 5
    padded = [torch.cat([t, t[:, -1:].expand(-1, 2, -1, -1)], dim=1) for t in (k, v)]
    parts = {}

    class Posted(Exception):
        pass

    class Stand:   # one rank of the sequence group
        def __init__(self, rank):
            self.rank, self.stats = rank, CommStats()

        def __getitem__(self, name):
            return types.SimpleNamespace(rank=self.rank, size=size)

        def all_gather(self, t, group, dim, kind):
            if len(parts) < size:
                parts[self.rank] = t
                raise Posted
            self.stats.add(kind, t.numel() * t.element_size() * (size - 1))
            return torch.cat([parts[r] for r in range(size)], dim=dim)

    ranks = []
    for r in range(size):
        attention = SequenceParallelAttention.__new__(SequenceParallelAttention)
        attention.mesh, attention.pad_tokens = Stand(r), 2
        ranks.append((attention, *(t[:, r * per:(r + 1) * per] for t in padded)))
    for attention, keys, values in ranks:
        with pytest.raises(Posted):
            attention.local_keys(q, keys, values)
    outs = [attention.local_keys(q, keys, values) for attention, keys, values in ranks]
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert report("local_keys over 4 ranks with 2 pad rows vs one softmax", (outs[0] - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=18 * 8, depth=2))
    assert ranks[0][0].mesh.stats.sent["sp_merge"] == 3 * 2 * 7 * 4 * (8 * 4 + 4)   # (out + lse) fp32, 3 others


def test_cfg_parallel_runs_the_two_passes_at_their_own_text_lengths_side_by_side(engines, path, local):
    x, t, pos = ltx_call(seed=1, text=9, masked=True)
    _, _, neg = ltx_call(seed=2, text=4, masked=True)
    want = [reference(local, x, t, c) for c in (pos, neg)]
    with ModelSession(engines(2), request(path, pos, ParallelPlan(cfg=2), neg=neg["context"])) as s:
        got = s.call_group([(x, t, pos), (x, t, neg)])
    for name, g, w in zip(("positive (9 tokens)", "negative (4 tokens)"), got, want):
        assert report(f"LTX-2.3 cfg2: {name}", (g - w).abs().max(), bound(w))


def test_a_forward_given_the_held_connectors_output_runs_no_connector_and_gives_the_same_bits(local):
    """What the ranks hold with a context (the family's hold: both text connectors' output, ComfyUI's
    preprocess_text_embeds) stands in for the connectors: a call carrying it runs neither connector and gives the
    same output as one that runs them itself (the same arithmetic on the same rows)."""
    x, t, c = ltx_call(seed=7)
    extras = {k: v for k, v in c.items() if k in ltx23.EXTRAS}
    held = ltx23.FAMILY.hold(local, "context", c["context"])
    assert set(held) == {"video_text", "audio_text"} and ltx23.FAMILY.hold(local, "y", c["context"]) is None
    runs = []
    connectors = (local.model.video_connector, local.model.audio_connector)
    handles = [m.register_forward_hook(lambda *a: runs.append(1)) for m in connectors]
    try:
        got = local.output(x, t, Prepared(c["context"], None, torch.ones(1), extras=extras, held=held))
        assert not runs
        want = local.output(x, t, Prepared(c["context"], None, torch.ones(1), extras=extras))
        assert len(runs) == 2
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(got, want)


@pytest.mark.parametrize("world,plan", [(2, ParallelPlan(ulysses=2, shard=2)), (2, ParallelPlan(cfg=2, shard=2))],
                         ids=["ulysses2-shard2", "cfg2-shard2"])
def test_the_connectors_run_once_per_held_context_over_a_sessions_calls(engines, path, local, world, plan):
    """Three rounds of a session: a positive (9 tokens) and a negative (4 tokens) context cross once and every rank
    runs the connectors once for each, when it is first held, whatever rows its CFG group computes (cfg2 x shard2: the
    connectors' weights are gathered over both CFG groups, so each rank must run them for both contexts at the same
    point); each call equals one rank's."""
    x, t, pos = ltx_call(seed=1, text=9, masked=True)
    _, _, neg = ltx_call(seed=2, text=4, masked=True)
    rounds = [(x, t), (x * 0.5, t * 0.8), (-x, t * 0.6)]
    with ModelSession(engines(world), request(path, pos, plan, neg=neg["context"])) as s:
        got = [s.call_group([(xi, ti, pos), (xi, ti, neg)]) for xi, ti in rounds]
    held = [r["model_calls"]["held"] for r in s.result.ranks]
    print(f"LTX-2.3 {plan.describe()}: 3 rounds of 2 calls, connectors run for {held} contexts on each rank")
    assert held == [2] * world
    for (xi, ti), outs in zip(rounds, got):
        for name, g, c in zip(("positive", "negative"), outs, (pos, neg)):
            w = reference(local, xi, ti, c)
            assert report(f"LTX-2.3 {plan.describe()} held connectors, {name}", (g - w).abs().max(), bound(w))


# ---- LTXVAddGuide's guides -------------------------------------------------------------------------------------------
def dense_guide_mask(total, start, log_w):
    """ComfyUI's guide attention as one dense additive mask [1, 1, total, total] (GuideAttentionMask's two groups
    written into the whole matrix: the queries before `start` get each tracked guide key's log weight, each tracked
    guide query its own log weight on every key before `start`)."""
    count = log_w.shape[0]
    mask = torch.zeros(1, 1, total, total, dtype=log_w.dtype)
    mask[..., :start, start:start + count] = log_w
    mask[..., start:start + count, :start] = log_w[:, None]
    return mask


GUIDES = dict(total=23, start=14, count=7)   # 14 generated tokens, 7 tracked guide tokens, 2 untracked after them


def guide_case(weights, seed=3):
    """q, k, v over GUIDES' sequence, the guides' log weights as the family makes them, and attention under the dense
    mask (the reference)."""
    from engine.families.ltx23_guides import log_weights
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, GUIDES["total"], 3, 8, generator=g) for _ in range(3))
    log_w = log_weights(torch.tensor(weights, dtype=torch.float64), torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        attn_mask=dense_guide_mask(GUIDES["total"], GUIDES["start"], log_w)).transpose(1, 2)
    return q, k, v, log_w, want


def split_attention(bias, q, k, v, shards, kernel):
    """Each query shard over the key blocks in turn (as the ring hands them), merged through the log-sum-exp."""
    from engine.kernels import merge
    worst_rows = []
    for a, b in itertools.pairwise(shards):
        out = lse = None
        for c, d in itertools.pairwise(shards):
            out, lse = merge(out, lse, *bias.attend(q[:, a:b], k[:, c:d], v[:, c:d], a, c, kernel))
        worst_rows.append(out)
    return torch.cat(worst_rows, dim=1)


def test_the_guide_bias_equals_the_dense_mask_however_the_sequence_is_split():
    """GuideBias over the whole sequence, and over the key blocks and query shards sequence parallel hands it (each
    block's part merged through its log-sum-exp as the ring merges, the noisy / guide boundary inside a block, a block
    of guide keys alone, untracked guide tokens after the tracked ones), equals attention under the dense mask. Weights
    0 (the guide not seen), 0.7 and 2.5."""
    from engine.families.ltx23 import GuideBias
    from engine.kernels import attention_with_lse
    q, k, v, log_w, want = guide_case([0.7, 0.7, 0.0, 2.5, 0.7, 0.7, 1.0])
    bias = GuideBias(GUIDES["start"], GUIDES["count"], log_w)
    worst = (bias.attend(q, k, v, 0, 0)[0] - want).abs().max()
    for shards in ((0, 12, 23), (0, 6, 12, 18, 23), (0, 14, 23), (0, 15, 21, 23)):
        worst = max(worst, (split_attention(bias, q, k, v, shards, attention_with_lse) - want).abs().max())
    assert (want - torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)).abs().max() > 1e-2   # the mask matters here
    # two fp32 reductions in a row (the scores over the head width, the weighted values over the keys)
    assert report("guide bias vs the dense mask, whole and split", worst,
                  fp32_bound(v.abs().max(), reduction=GUIDES["total"] * 8, depth=2))


LOG2E = 1.4426950408889634


def cuda_efficient_convention(reported):
    """What torch's CUDA memory-efficient kernel computes for a masked block (aten/src/ATen/native/transformers/cuda/
    mem_eff_attention/kernel_forward.h: iterative_softmax scales scores and bias by log2(e) in fp32, so the dtype's
    lowest becomes -inf; a row whose keys are all -inf then keeps mi = -inf and s_prime = 0, its output 0), with the
    log-sum-exp such a row reports given as `reported` (that kernel's mi / log2(e) + log(s_prime); 0 and +inf are what
    other kernels report for it). No mask: the plain softmax."""
    def kernel(q, k, v, mask):
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s + mask[..., :k.shape[1]].float()
        s = s * LOG2E
        mi = s.amax(dim=-1, keepdim=True)
        dead = torch.isneginf(mi)
        p = torch.exp2(s - torch.where(dead, 0.0, mi))
        total = p.sum(dim=-1, keepdim=True)
        out = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(dead, 1.0, total), v.float())
        lse = torch.where(dead, reported, mi / LOG2E + torch.log(total)).squeeze(-1)
        return out.to(q.dtype), lse
    return kernel


def garbage_for_removed_rows(q, k, v, mask):
    """A kernel that gives a NaN output and a log-sum-exp of 0 for every row whose keys a bias removes entirely."""
    from engine.kernels import attention_with_lse, removed_bias
    out, lse = attention_with_lse(q, k, v, mask)
    if mask is None:
        return out, lse
    removed = (mask[..., :k.shape[1]].amax(dim=-1) <= removed_bias(mask.dtype))   # [1, 1, rows or 1]
    return torch.where(removed.transpose(1, 2).unsqueeze(-1), float("nan"), out), torch.where(removed, 0.0, lse)


@pytest.mark.parametrize("kernel", ["efficient-lse-0", "efficient-lse-inf", "efficient-lse--inf", "garbage"])
def test_a_ring_block_of_guides_the_bias_removes_merges_exactly_whatever_the_kernel_reports_for_it(kernel):
    """Under Ring a key block can hold only tracked guide tokens of weight 0 (an IC-LoRA reference's, a pixel mask's
    zero region): every generated query's keys in that block are removed. With the CUDA efficient kernel's arithmetic
    (the bias x log2(e) in fp32), the dtype's lowest would become -inf and such a row would report a log-sum-exp the
    merge weighs as real (0: the output shrunk). The guides' bias stays finite there and a piece whose keys it removes
    counts as empty, so the split equals the dense mask with each convention, and with a kernel giving NaN for it."""
    from engine.families.ltx23 import GuideBias
    kernels = {"efficient-lse-0": cuda_efficient_convention(0.0),
               "efficient-lse-inf": cuda_efficient_convention(float("inf")),
               "efficient-lse--inf": cuda_efficient_convention(float("-inf")), "garbage": garbage_for_removed_rows}
    q, k, v, log_w, want = guide_case([0.0, 0.0, 0.0, 0.7, 0.0, 2.5, 0.0])
    bias = GuideBias(GUIDES["start"], GUIDES["count"], log_w)
    shards = (0, 7, 14, 17, 23)   # the third block: guide tokens 0-2, all of weight 0
    got = split_attention(bias, q, k, v, shards, kernels[kernel])
    assert report(f"ring blocks under the guides' bias, a block removed whole, kernel {kernel}",
                  (got - want).abs().max(), fp32_bound(v.abs().max(), reduction=GUIDES["total"] * 8, depth=2))


def test_the_guides_bias_runs_the_generated_queries_unmasked_but_for_the_guide_keys_and_never_catches_oom(
        monkeypatch):
    """The generated queries meet the guides' weights only on the guide keys: their attention over every other key
    takes no mask (the fast kernels), the masked piece holds the guide keys alone, the tracked queries' pieces none;
    and an out-of-memory error inside a kernel reaches the caller as it was (no retry on the written-out kernel)."""
    from engine import kernels
    from engine.families.ltx23 import GuideBias
    q, k, v, log_w, want = guide_case([0.7, 0.7, 0.0, 2.5, 0.7, 0.7, 1.0])
    seen = []

    def recording(q, k, v, mask=None):
        seen.append((q.shape[1], k.shape[1], None if mask is None else mask.shape[-1]))
        return kernels.attention_with_lse(q, k, v, mask)
    GuideBias(GUIDES["start"], GUIDES["count"], log_w).attend(q, k, v, 0, 0, recording)
    masked = [s for s in seen if s[2] is not None]
    assert masked == [(14, 7, 16)]   # 14 generated queries over the 7 guide keys (their row stored 16 wide)
    assert sum(nq * nk for nq, nk, _ in seen) == GUIDES["total"] ** 2   # every query over every key once

    # on a device that is not the CPU (meta tensors stand for CUDA's: the same branch, no data): the masked kernel and
    # the half-precision kernels running out of memory stop there, without trying another kernel
    def short_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
    tried = []
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", short_of_memory)
    monkeypatch.setattr(kernels, "_math_with_lse", lambda *a: tried.append("math"))
    monkeypatch.setattr(kernels, "HALF_KERNELS", {"first": short_of_memory, "second": lambda *a: tried.append("2nd")})
    meta = [t.to("meta", torch.bfloat16) for t in (q, k, v)]
    for mask in (torch.zeros(1, 1, 1, 23, device="meta", dtype=torch.bfloat16), None):
        with pytest.raises(torch.OutOfMemoryError):
            kernels.attention_with_lse(*meta, mask)
    assert tried == []


def test_guided_calls_keep_the_guides_positions_strengths_and_dropped_tokens(local):
    """Each part of a guide reaches the model: its position (the last image at frame 16 against 8), its strength in
    the attention (0.7 against the bias left out, the noise mask the same), an attention mask over its pixels; the
    tokens an IC-LoRA reference leaves out of the sequence (a negative noise mask) come out as zeros."""
    x, t, c = guided_call()
    want = reference(local, x, t, c)
    assert (reference(local, *guided_call(last=8)) - want).abs().max() > 1e-4
    unbiased = {k: v for k, v in c.items() if k != "guide_weights"}
    unbiased["guide"] = c["guide"].clone()
    unbiased["guide"][:, 1] = 0
    assert (reference(local, x, t, unbiased) - want).abs().max() > 1e-3
    pixels = torch.ones(1, 1, 1, 64, 96)
    pixels[..., 32:, :] = 0.25
    assert (reference(local, *guided_call(pixel_mask=pixels)) - want).abs().max() > 1e-4
    x, t, c = guided_call(h=2, w=4, dilated=True)
    assert c["guide"][0].tolist() == [10, 10, 34] and c["keep"][0, -8:].tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    out = reference(local, x, t, c)[0, 0, :128 * 5 * 8].reshape(128, 5, 2, 4)
    assert torch.equal(out[:, 4][:, [0, 0, 1, 1, 1, 1], [1, 3, 0, 1, 2, 3]], torch.zeros(128, 6))
    assert out[:, 4, 0, 0].abs().max() > 0


def test_the_fp8_weight_option_runs_a_bf16_model_with_its_modulation_tables_in_bf16(path, local):
    """The fp8 weight option (ComfyUI's weight_dtype fp8_e4m3fn) on LTX-2.3 in bf16: the Linear weights in fp8, the
    48 scale_shift_tables (2-D, cast by no Linear) in bf16, so a guided call runs (an fp8 table stops diffusers:
    "Promotion for Float8 Types is not supported") and stays within fp8's rounding of the fp32 result: e4m3 keeps 3
    mantissa bits (each weight off by up to 2^-4, about 3.6% RMS) over the tiny model's few layers, bound 0.15 relative
    L2 (bf16 alone measured 0.009)."""
    x, t, c = guided_call()
    want = reference(local, x, t, c)
    fp8 = FlowModel(load_model(path, dtype="bf16", fp8_weights=True))
    assert fp8.model.transformer_blocks[0].scale_shift_table.dtype == torch.bfloat16
    got = reference(fp8, x, t, c)
    rel = float((got.float() - want).norm() / want.norm())
    print(f"LTX-2.3 fp8 weights, bf16 compute vs fp32: relative L2 {rel:.3g} (bound 0.15)")
    assert torch.isfinite(got).all() and rel < 0.15


def test_guides_on_one_rank_never_hand_torchs_attention_a_mask(local, monkeypatch):
    """On a plan without sequence parallel (one GPU, or CFG parallel alone) the guides' bias goes through the engine's
    mask-taking kernels, never torch's attention with a mask (which raises under the engine's attention setting
    `flash` on CUDA, and writes out the whole [b, h, s, s] matrix under `math`): a guided call with a pixel mask on one
    rank hands scaled_dot_product_attention no mask, and gives what it gave before the spy (the same kernels: 0)."""
    x, t, c = guided_call(pixel_mask=torch.linspace(0, 1, 64 * 96).reshape(1, 1, 1, 64, 96))
    want = reference(local, x, t, c)
    real, masks = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask is not None)
        return real(*args, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = reference(local, x, t, c)
    assert masks and not any(masks)
    assert report("LTX-2.3 guided call on one rank, torch's attention spied", (got - want).abs().max(), 0.0)


@pytest.mark.parametrize("world,plan,kw", [
    (2, ParallelPlan(ulysses=2), {}), (2, ParallelPlan(ring=2), {}),
    (2, ParallelPlan(ring=2), {"h": 2, "w": 4, "dilated": True}),
    (2, ParallelPlan(ulysses=2, shard=2), {"pixel_mask": torch.linspace(0, 1, 64 * 96).reshape(1, 1, 1, 64, 96)}),
    (4, ParallelPlan(ulysses=2, ring=2), {})],
    ids=["ulysses2", "ring2", "ring2-dilated", "ulysses2-shard2-pixel-mask", "ulysses2-ring2"])
def test_every_sequence_plan_runs_the_guides_and_equals_one_rank(engines, path, local, world, plan, kw):
    """Two guide frames ending the video tokens (the first and the last image at strength 0.7): split across the
    ranks with the generated tokens, their positions and per-token timesteps, each rank's attention taking its part of
    the guides' bias (ring2: the second member holds the boundary; dilated: 34 of 40 tokens kept, padded to 17 a rank;
    a pixel attention mask on the last guide; ulysses2 x ring2: 30 tokens, 8 a rank, the last ending in 2 pad rows)."""
    x, t, c = guided_call(seed=4, **kw)
    want = reference(local, x, t, c)
    with ModelSession(engines(world), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    assert report(f"LTX-2.3 guided call, {plan.describe()} {kw.get('dilated') and 'dilated' or ''}",
                  (got - want).abs().max(), bound(want))


def test_compiled_blocks_compile_once_for_every_block_and_guided_call_and_equal_eager(path):
    """torch.compile of each block (the engine's compile option): three guided calls whose guides' weights differ (a
    new bias object each forward, its layouts laid out on first use) run on graphs compiled once for all four blocks
    (Dynamo set to raise on any recompile; before, each block's STG index and the bias's layout cache sent every block
    to a graph of its own, past Dynamo's limit of 8 on the 48-block model), each call equal to eager within the bound
    (a compiled block may fuse and reorder the same arithmetic)."""
    import torch._dynamo
    from engine.models.speed import compiled_graphs, set_compiled
    flow = FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))
    calls = [guided_call(seed=4, strengths=s) for s in ((0.7, 0.7), (0.5, 0.9), (0.3, 0.6))]
    want = [reference(flow, *c) for c in calls]
    torch._dynamo.reset()
    set_compiled(flow.model, ("transformer_blocks",), True)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = [reference(flow, *c) for c in calls]
        graphs = compiled_graphs()
    finally:
        set_compiled(flow.model, ("transformer_blocks",), False)
        torch._dynamo.reset()
    print(f"{len(flow.model.transformer_blocks)} compiled blocks, 3 guided calls: {graphs} graphs, no recompile")
    assert graphs
    for i, (g, w) in enumerate(zip(got, want)):
        assert report(f"LTX-2.3 compiled guided call {i} vs eager", (g - w).abs().max(), bound(w))


# ---- the guidance nodes' extra passes ----------------------------------------------------------------------------------
def guidance_call(seed=2, stg=(), severed=False, reference=0):
    """A masked call (ltx_call) as the pass an LTX guidance node adds: STG's (`stg` blocks), modality guidance's
    (`severed`: both audio-video cross-attentions off), or with `reference` tokens of LTXVReferenceAudio's."""
    x, t, c = ltx_call(seed=seed, masked=True)
    options = {"stg_self_attn_blocks": frozenset(stg)} if stg else {}
    if severed:
        options.update(a2v_cross_attn=False, v2a_cross_attn=False)
    kwargs = {"frame_rate": 24.0}
    if reference:
        kwargs["ref_audio"] = {"tokens": torch.randn(1, reference, 128, generator=torch.Generator().manual_seed(9))}
    video = c["av_shape"][0, :4].long().tolist()
    extras, _ = ltx23.comfy_call([(1, *video), (1, 8, 7, 16)], kwargs, options, (t.reshape(1, -1, 1),
                                                                              torch.full((1, 7, 1), 0.7)))
    return x, t, {**c, **{k: v for k, v in extras.items() if k in ("stg", "coupled", "ref_audio")}}


def test_the_reference_audio_is_placed_before_time_zero_and_each_guidance_pass_moves_the_output(local):
    """LTXVReferenceAudio's tokens sit ahead of the audio at (start, end) seconds of their own latents moved back by
    the last end plus one latent's 0.04 s (worked by hand for 5: ends 0.01, 0.05, ... 0.17, so back by 0.21); STG's
    value passthrough, the severed audio-video coupling and the reference tokens each change the call's output, and
    the output keeps the audio's own length."""
    coords = ltx23.reference_coords(5)[0, 0]
    want = torch.tensor([[0.0, 0.01], [0.01, 0.05], [0.05, 0.09], [0.09, 0.13], [0.13, 0.17]]) - 0.21
    assert torch.allclose(coords, want, rtol=0, atol=1e-6)
    x, t, c = guidance_call()
    plain = reference(local, x, t, c)
    for kw in ({"stg": (1,)}, {"severed": True}, {"reference": 5}):
        out = reference(local, *guidance_call(**kw))
        assert out.shape == plain.shape and (out - plain).abs().max() > 1e-3, kw


@pytest.mark.parametrize("plan,kw", [(ParallelPlan(ulysses=2), {"stg": (0, 2), "reference": 5}),
                                     (ParallelPlan(ring=2), {"severed": True}),
                                     (ParallelPlan(ulysses=2, ring=2), {"stg": (1,), "reference": 3})],
                         ids=["ulysses2-stg-reference", "ring2-severed", "ulysses2-ring2-stg-reference"])
def test_the_guidance_passes_on_a_sequence_plan_equal_one_rank(engines, path, local, plan, kw):
    x, t, c = guidance_call(**kw)
    want = reference(local, x, t, c)
    with ModelSession(engines(plan.world_size), request(path, c, plan)) as s:
        got = s.call(x, t, c)
    assert report(f"LTX-2.3 guidance pass {sorted(kw)}, {plan.describe()}", (got - want).abs().max(), bound(want))


# ---- the ComfyUI side: the engine's MODEL receives ComfyUI's inputs --------------------------------------------------
def test_the_engines_model_takes_comfyuis_timestep_tuple_frame_rate_and_masks(model_parts):
    link = RecordingLink()
    t = model_parts.EngineTransformer(link, {}, meta=types.SimpleNamespace(), family=ltx23.FAMILY)
    video, audio = torch.randn(2, 128, 3, 2, 3), torch.randn(2, 8, 5, 16)
    context = torch.randn(2, 6, TEXT)
    assert t.preprocess_text_embeds(context, unprocessed=True) is context   # the ranks run the connectors
    with pytest.raises(model_parts.ModelPatchError, match="unprocessed_ltxav_embeds"):
        t.preprocess_text_embeds(context, unprocessed=False)
    # no mask: process_timestep gives (t, t), each [B]
    sigma = torch.tensor([0.6, 0.6])
    out = t([video, audio], (sigma, sigma), context, frame_rate=24.0)
    x, ts, _, _, kwargs = link.calls[-1]
    assert torch.equal(x, torch.cat([video.reshape(2, 1, -1), audio.reshape(2, 1, -1)], dim=-1))
    assert torch.equal(ts, sigma) and kwargs["av_shape"].tolist() == [[128, 3, 2, 3, 8, 5, 16]] * 2
    assert kwargs["frame_rate"].tolist() == [24.0, 24.0] and torch.equal(kwargs["audio_t"], sigma.double())
    assert kwargs["gate_t"].tolist() == [[0.6000000238418579] * 2] * 2
    assert all(v.dtype == torch.float64 for k, v in kwargs.items() if k in ltx23.EXTRAS)
    assert isinstance(out, list) and torch.equal(out[0], -video) and torch.equal(out[1], -audio)
    # a noise mask on the first frame (LTXVImgToVideoInplace, strength 0.7): per-token timesteps [B, N, 1] for video,
    # the masks themselves used by ComfyUI's model for a memory layout only: taken, not sent
    v_t = torch.full((2, 18, 1), 0.6)
    v_t[:, :6] = 0.3 * 0.6
    a_t = torch.full((2, 5, 1), 0.6)
    t([video, audio], (v_t, a_t), context, frame_rate=25, denoise_mask=torch.ones(2, 1, 3, 2, 3),
      audio_denoise_mask=torch.ones(2, 8, 5, 16), keyframe_idxs=torch.zeros(2, 3, 0, 2), generated_keyframes=None)
    x, ts, _, _, kwargs = link.calls[-1]
    assert torch.equal(ts, v_t.reshape(2, 18)) and torch.equal(kwargs["audio_t"], a_t.reshape(2, 5).double())
    assert kwargs["gate_t"][0].tolist() == [float(torch.tensor(0.6)), float(torch.tensor(0.6))]
    assert "denoise_mask" not in kwargs and "keyframe_idxs" not in kwargs and kwargs["frame_rate"][0] == 25.0
    # LTXVAddGuide's guides: the last latent frame a guide (keyframe_idxs: its 6 tokens' positions), its tokens kept
    # (no negative mask), no bias at strength 1; entries without guide frames are no guides (ComfyUI's model too)
    v_t = torch.full((2, 18, 1), 0.6)
    v_t[:, 12:] = 0.0
    coords = guide_coords(16, 2, 3).expand(2, -1, -1, -1)
    entry = {"pre_filter_count": 6, "strength": 1.0, "pixel_mask": None, "latent_shape": [1, 2, 3]}
    t([video, audio], (v_t, sigma), context, denoise_mask=(v_t > 0).float().reshape(2, 1, 3, 2, 3),
      keyframe_idxs=coords, guide_attention_entries=[entry])
    x, ts, _, _, kwargs = link.calls[-1]
    assert kwargs["guide"].tolist() == [[6, 0, 18]] * 2 and torch.equal(ts, v_t.reshape(2, 18))
    assert torch.equal(kwargs["guide_coords"], coords.reshape(2, -1).double())
    assert "guide_weights" not in kwargs and "keep" not in kwargs and "guide_attention_entries" not in kwargs
    t([video, audio], (sigma, sigma), context, guide_attention_entries=[entry])
    assert "guide" not in link.calls[-1][4]
    # what the engine does not run yet, and guides it cannot place: one line each
    for extra, match in ((dict(keyframe_idxs=torch.zeros(2, 3, 6, 2)), "without the latent's noise mask"),
                         (dict(keyframe_idxs=torch.zeros(2, 3, 4, 2), denoise_mask=torch.ones(2, 1, 3, 2, 3)),
                          "not a whole number of 6-token latent frames"),
                         (dict(keyframe_idxs=torch.zeros(2, 3, 6, 2), denoise_mask=torch.ones(2, 1, 3, 2, 3),
                               guide_attention_entries=[{**entry, "pre_filter_count": 12}]), "token counts"),
                         (dict(ref_audio={"tokens": torch.zeros(1, 3, 64)}), "a reference audio of shape")):
        with pytest.raises(model_parts.ModelPatchError, match=match):
            t([video, audio], (sigma, sigma), context, **extra)
    for options, match in (({"a2v_cross_attn": False}, "one direction"), ({"run_ax": False}, "without the audio")):
        with pytest.raises(model_parts.ModelPatchError, match=match):
            t([video, audio], (sigma, sigma), context, transformer_options=options)
    with pytest.raises(model_parts.ModelPatchError, match="takes a video latent"):
        t([video, audio, audio], sigma, context)
    with pytest.raises(model_parts.ModelPatchError, match="fits neither"):
        t([video, audio], (torch.ones(2, 7, 1), sigma), context)
    # the guidance nodes' extra passes: STG's blocks, modality guidance's severed coupling, ID-LoRA's reference tokens
    tokens = torch.randn(1, 4, 128)
    t([video, audio], (sigma, sigma), context, ref_audio={"tokens": tokens},
      transformer_options={"stg_self_attn_blocks": frozenset({3, 1}), "a2v_cross_attn": False,
                           "v2a_cross_attn": False})
    kwargs = link.calls[-1][4]
    assert kwargs["stg"].tolist() == [[1, 3]] * 2 and kwargs["coupled"].tolist() == [0, 0]
    assert torch.equal(kwargs["ref_audio"], tokens.reshape(1, -1).double().expand(2, -1))
    assert len(link.calls) == 5


def test_the_link_refuses_an_attention_mask_that_masks(model_parts):
    """ComfyUI's LTX text encoder gives no attention mask; one that masks nothing passes, one that masks is refused
    (the link's own check, before anything crosses)."""
    link_module = importlib.import_module(PACK_NAME + ".xdit_nodes.link")
    calls = []

    class Probe(link_module.EngineLink):
        def run(self, calls_):
            calls.extend(calls_)
            return [c.x for c in calls_]
    probe = Probe(settings=None, registry=None, request_for=None)
    t = model_parts.EngineTransformer(probe, {}, meta=None, family=ltx23.FAMILY)
    video, audio = torch.randn(1, 128, 1, 2, 2), torch.randn(1, 8, 3, 16)
    sigma = torch.tensor([0.5])
    t([video, audio], (sigma, sigma), torch.randn(1, 4, TEXT), attention_mask=torch.ones(1, 4))
    assert len(calls) == 1 and "attention_mask" not in calls[0].conditioning
    with pytest.raises(model_parts.ModelPatchError, match="attention mask"):
        t([video, audio], (sigma, sigma), torch.randn(1, 4, TEXT), attention_mask=torch.tensor([[1, 1, 0, 0]]))


def test_the_planner_counts_the_audio_rows_and_the_engines_own_loop_refuses():
    from engine.parallel.plan import Workload
    info = inspect_model("synthetic:ltx-2.3")
    assert info.config["num_layers"] == 48 and info.parameters > 20e9
    work = Workload.from_info(info, 11, 20, batch=1, negative_pass=False, text_tokens=1024, frames=16)
    # 16 latent frames = 121 pixel frames at 25 fps: 121 audio latents besides 16 x 11 x 20 video tokens
    assert work.image_tokens == 16 * 11 * 20 + 121
    assert math.isclose(ltx23.FAMILY.linear_width(info.config), 16.0)
    latent = torch.zeros(1, 128, 2, 2, 2)
    with pytest.raises(ValueError, match="samples audio and video together"):
        GenerateRequest(model="synthetic:ltx-2.3:tiny", cond=torch.zeros(1, 4, TEXT), latent_raw=latent).submit(None)


def test_the_planner_prices_the_v2a_merge_each_block_sends_at_full_size():
    """1280 x 704 x 121 frames (14080 video tokens, 121 audio latents), 48 blocks: under ulysses2 each rank sends per
    forward its partial v2a output and log-sum-exp to the other, 121 x 32 heads x (64 bf16 + 1 fp32) x 48 =
    24,532,992 bytes (where gathering the video's keys-and-values input and its fp32 RoPE keys whole sent 7040 x
    (4096 x 2 + 2 x 32 x 32 x 4) x 48 = 5.5 GB); the planner prices it on the link, one all-gather a block."""
    from engine.parallel import cost
    from engine.parallel.devices import Interconnect
    from engine.parallel.plan import Workload
    work = Workload.for_variant("ltx-2.3", 1280, 704, frames=121)
    assert (work.merge_queries, work.merge_heads, work.merge_head_dim) == (121, 32, 64)
    plan = ParallelPlan(ulysses=2)
    assert cost.comm_bytes(plan, work)["sp_merge"] == 121 * 32 * (64 * 2 + 4) * 48 == 24_532_992
    assert cost.comm_bytes(ParallelPlan(ring=4), work)["sp_merge"] == 3 * 24_532_992
    assert cost.comm_bytes(ParallelPlan(cfg=2), work)["sp_merge"] == 0
    link = Interconnect("nvlink", bandwidth_gbs=100.0, latency_us=10.0)
    priced = cost.comm_ms(plan, work, link, 0.0) - cost.comm_ms(plan, dataclasses.replace(work, merge_queries=0), link,
                                                                0.0)
    assert math.isclose(priced, 24_532_992 / 100e9 * 1e3 + 48 * 10e-3)
