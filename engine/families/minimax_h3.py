"""MiniMax-H3 (audio + video, one packed-token DiT): how the engine runs this family (its checkpoints' dims, layout
and detection: minimax_h3_layout.py).

ComfyUI's conventions, read from ComfyUI 0.33.0 (file and line in docs/families/minimax-h3.md):
- comfy/model_detection.py: a file with `video_patch_proj.weight` and `audio_patch_proj.weight` is MiniMax-H3; widths,
  heads (qkv rows / 3 / head width), blocks, refiner blocks, time embedder and RoPE length from the tensors.
- comfy/supported_models.py MiniMaxH3: sampling shift 12 (video) and audio_shift 3, model type FLOW_AV
  (comfy/model_sampling.py ModelSamplingAV: discrete flow, multiplier 1000, audio_scale = shift / audio_shift); latent
  format MiniMaxH3AV: a NestedTensor of the video latent [1, 24, T, H/16, W/16] and the stereo audio latent
  [1, 32, 2, T_audio], which the sampler packs into one [1, 1, N] tensor (comfy/utils.py pack_latents: each stream
  flattened, video first) and the model receives unpacked (model_base._apply_model).
- comfy/model_base.py MiniMaxH3: the sampler carries the audio stream scaled by audio_scale (process_latent_in/out).
- comfy/ldm/minimax/model.py MiniMaxH3Model.forward: the carried audio is multiplied by sigma_a / sigma_v before the
  network and the audio velocity converted back after it ((1 - s) x_carried + (1 + (s - 1) sigma_a) v), with sigma_a
  from the video sigma in closed form (time_shift_sigma, shifts from transformer_options' MiniMaxH3SigmaShift values
  or the model's 12 / 3); _forward: the video padded circularly to whole 2x2 patches and patchified to rows of
  (c, pt, ph, pw) features, frames then rows then columns; the audio as rows channel-major (left channel's frames,
  then the right's); the sequence [text | audio | video]; timesteps t = 1 - sigma (video and text) and
  1 - sigma_a (audio), one table row per distinct value, each row's modulation row t_index x 3 + tag (video 0, text 1
  or the text encoder's per-token tags, audio 2); positions (t, h, w): text (l, 0, 0); audio frames from the text
  length on, pinned at the outermost column coordinates; video frames at the text length plus 5/3 x (1, 4, 4, 4, 4)
  cumulated, rows and columns area-normalised (x 32); the output negated.
The unmodified diffusers MiniMaxH3Transformer3DModel computes all of this given the packed sequence's description
(rows, distinct timesteps, per-row indices and tags, positions), which minimax_h3_sequence.py builds as ComfyUI does,
keyframes and guides (MiniMaxH3ImageToVideo, MiniMaxH3AddGuide), reference blocks (MiniMaxH3ReferenceToVideo) and the
noise masks included: their rows join the packed sequence at ComfyUI's positions and timesteps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import PACKED_SHAPE, Family, Marker, StockJob, TokenTable, placed
from .minimax_h3_layout import DIMS, infer, key_map, shapes  # noqa: F401 (read here)
from .minimax_h3_sequence import (  # noqa: F401 (the sequence and the call's extras, read here)
    AUDIO_COND_T, AUDIO_SHIFT, AUDIO_TAG, BLOCK_FIELDS, BLOCK_KINDS, EXTRAS, SHIFT, TEXT_TAG, VIDEO_TAG, VISUAL_COND_T,
    Block, _augmented, _blocks, call_extras, comfy_call, layout, mask_rows, pack_audio, patchify, positions,
    split_streams, time_shift_sigma, unpatchify)

TEXT_TOKENS = 256

# (title, width, height, frames, steps, negative pass): ComfyUI's template preview size with the 8-step turbo LoRA
# (cfg 1), and the native 768p canvas at 5 s and 15 s, turbo and full (cfg > 1, ComfyUI's template's 20 steps)
FIT_JOBS = (("turbo, cfg 1", 864, 480, 124, 8, False), ("turbo, cfg 1", 1344, 768, 124, 8, False),
           ("full, cfg > 1", 1344, 768, 124, 20, True), ("turbo, cfg 1", 1344, 768, 362, 8, False))
GRID, FIRST = 17, 5                    # nodes_minimax_h3.py: lengths snap up to 17k + 5 frames at 24 fps
FPS, AUDIO_FPS = 24, 40                # video frames and audio latent frames a second


@dataclass(frozen=True)
class H3Latent(LatentFormat):
    """The video stream of ComfyUI's MiniMaxH3AV latent, the one the engine plans and checks against (the audio stream
    rides with it in the packed tensor, its rows counted by audio_frames): 24 channels at 1/16 of the frame; frames on
    ComfyUI's 17k + 5 grid (EmptyMiniMaxH3LatentAV snaps a length up to it), 5 frames making 2 latent frames and
    every 17 after them 5 more (video_latent_t). No normalisation: the VAE's latent is the model's."""

    def latent_frames(self, frames: int) -> int:
        return 2 if frames <= FIRST else ((frames - FIRST) // GRID) * 5 + 2

    def pixel_frames(self, latent_frames: int) -> int:
        return FIRST + GRID * max(0, latent_frames - 2) // 5

    def frames_rule(self) -> str:
        return f"{GRID}k + {FIRST} frames ({FIRST}, {FIRST + GRID}, {FIRST + 2 * GRID}, ..., 124 for 5 s at 24 fps)"

    def nearest_frames(self, frames: int) -> tuple[int, int] | None:
        if frames >= FIRST and (frames - FIRST) % GRID == 0:
            return None
        above = FIRST if frames < FIRST else frames + (-(frames - FIRST)) % GRID
        return above - GRID, above

    def frames_formula(self) -> str:
        return f"F = 2 + 5 (frames - {FIRST}) / {GRID} on the {GRID}k + {FIRST} grid"


H3_VIDEO = H3Latent("MiniMaxH3AV", channels=24, spatial_dims=3, downscale=16, temporal_downscale=4)


def audio_frames(pixel_frames: int) -> int:
    """Audio latent frames of a clip (temporal_shape: its duration at 40 a second)."""
    return round(pixel_frames / FPS * AUDIO_FPS)

# ---- the one forward ------------------------------------------------------------------------------------------------
def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """The packed velocity [n, 1, N] for packed latents x [n, 1, N] (ComfyUI's pack_latents of the video and audio
    streams, as ComfyUI's sampler carries them) at ComfyUI's model timestep (sigma x 1000): per row, what ComfyUI's
    MiniMaxH3Model returns (its batch is one), through the unmodified diffusers MiniMaxH3Transformer3DModel."""
    extras = prepared.extras or {}
    if PACKED_SHAPE not in extras:
        raise ValueError("a MiniMax-H3 model call needs the packed streams' shapes (ComfyUI's latent_shapes)")
    outs = [_one(flow, x[i:i + 1], timestep[i], prepared.cond[i:i + 1],
                 {k: v[i] for k, v in extras.items() if v is not None}) for i in range(x.shape[0])]
    return torch.cat(outs)


def _one(flow, x, timestep, context, extras) -> torch.Tensor:
    """One row. What the call's layout is built from (the streams' shapes, blocks, masks, tags, seed: the family's
    host_extras) is read on the host, where the ranks hold it; the index, tag and position tensors and the condition
    rows built from it are placed on the device once per distinct content; the timesteps are computed on the device
    from the call's own. So a call waits for the device nowhere (on ranks that hold the extras on the host)."""
    model, dtype, device = flow.model, flow.dtype, flow.device
    video, audio_carried = split_streams(x.reshape(1, -1), extras[PACKED_SHAPE])
    shift_v, shift_a = (float(v) for v in extras["sigma_shift"].tolist()) if "sigma_shift" in extras \
        else (SHIFT, AUDIO_SHIFT)
    scale = float(extras["audio_scale"]) if "audio_scale" in extras else 1.0
    # ComfyUI computes the two sigmas in float32 from the model timestep
    sigma_v = (timestep.reshape(-1)[0] / 1000.0).float().clamp(min=1e-6)
    sigma_a = time_shift_sigma(sigma_v, shift_v, shift_a)
    audio = audio_carried
    if scale != 1.0:   # the sampler's carried audio -> the stream's own latent
        audio = audio_carried * (sigma_a / sigma_v).to(audio.dtype)
    frames, h0, w0 = video.shape[2:]
    video = F.pad(video, (0, -w0 % 2, 0, -h0 % 2, 0, 0), mode="circular") if h0 % 2 or w0 % 2 else video
    h, w = video.shape[3:]
    text, ta = context.shape[1], audio.shape[-1]
    blocks, cond_videos, cond_audios = _blocks(extras)
    vis_aug, aud_aug = (float(v) for v in extras["cond_aug"].tolist()) if "cond_aug" in extras \
        else (VISUAL_COND_T, AUDIO_COND_T)
    seed = sum(int(v) << s for v, s in zip(extras["cond_seed"].tolist(), (0, 16, 32, 48))) \
        if "cond_seed" in extras else 0
    t_v, t_a = 1.0 - sigma_v, 1.0 - sigma_a   # on the device, float32 as ComfyUI's Python floats hold them
    # the call's timestep levels, a slot each (a value may repeat: each slot is embedded alone): the targets', then
    # the conditions' (noise augmented), then one per distinct value of a noise mask
    levels = [t_v, t_a, t_v.clamp(min=vis_aug), t_a.clamp(min=aud_aug)]
    slot = {"text": 0, "video": 0, "audio": 1, "cond": 2, "ref_img": 2, "cond_audio": 3, "ref_audio": 3}
    tag = {"text": TEXT_TAG, "video": VIDEO_TAG, "cond": VIDEO_TAG, "ref_img": VIDEO_TAG, "audio": AUDIO_TAG,
           "cond_audio": AUDIO_TAG, "ref_audio": AUDIO_TAG}
    # masked rows run at their own strength: a mask value m puts a row at m x its stream's sigma (its timestep 1 - m x
    # sigma), fully kept rows at the condition timestep; per masked stream, each row's slot
    per_row = {}
    masks = {}
    if "video_mask" in extras:
        m = mask_rows(extras["video_mask"].float().cpu().reshape(frames, h0, w0), frames, h, w)
        if m is not None:
            masks["video"] = (m, lambda u: (1.0 - u * sigma_v).clamp(max=t_v.clamp(min=VISUAL_COND_T)))
    if "audio_mask" in extras:
        m = extras["audio_mask"].float().cpu().reshape(-1)
        if not bool((m >= 1.0 - 1e-3).all()):
            masks["audio"] = (m, lambda u: (1.0 - u * (1.0 - t_a)).clamp(max=t_a.clamp(min=AUDIO_COND_T)))
    for kind, (m, level) in masks.items():
        values, inverse = torch.unique(m, return_inverse=True)
        per_row[kind] = inverse + sum(v.numel() for v in levels)
        levels.append(level(placed(model, values, device)))
    segments = layout(text, frames, h, w, ta, blocks)
    # the rows of each stream in sequence order: the conditions' (augmented, each from the same generator stream),
    # then the target's
    video_rows = [placed(model, _augmented(patchify(v), vis_aug, seed), device) for v in cond_videos]
    audio_rows = [placed(model, _augmented(pack_audio(a), aud_aug, seed + 1), device) for a in cond_audios]
    t_index, tags, where = [], [], {"video": [], "audio": [], "text": []}
    start = 0
    for kind, g in segments:
        n = g.shape[0]
        t_index.append(per_row[kind] if kind in per_row else torch.full((n,), slot[kind], dtype=torch.long))
        if kind == "text" and "token_tags" in extras:
            tags.append(extras["token_tags"].reshape(-1)[:n].long().cpu())
        else:
            tags.append(torch.full((n,), tag[kind], dtype=torch.long))
        stream = "text" if kind == "text" else "video" if tag[kind] == VIDEO_TAG else "audio"
        where[stream].append(torch.arange(start, start + n))
        start += n
    v_out, a_out = model(
        hidden_states=torch.cat([r.float() for r in video_rows + [patchify(video)]], dim=1),   # float32, as ComfyUI's
        audio_hidden_states=torch.cat([r.float() for r in audio_rows + [pack_audio(audio)]], dim=1),
        encoder_hidden_states=context.to(device, dtype),
        timestep=torch.cat([v.reshape(-1) for v in levels]).float(),
        timestep_indices=placed(model, torch.cat(t_index), device),
        token_tags=placed(model, torch.cat(tags), device),
        position_ids=placed(model, torch.cat([g for _, g in segments]), device),
        **{f"{k}_indices": placed(model, torch.cat(v), device) for k, v in where.items()}, return_dict=False)
    n_video, n_audio = frames * (h // 2) * (w // 2), 2 * ta   # the target rows: each stream's last
    v = -unpatchify(v_out[:, -n_video:], video.shape[1], frames, h, w)[:, :, :, :h0, :w0].to(x.dtype)
    a = carried_velocity(-a_out[:, -n_audio:].reshape(2, ta, -1).permute(2, 0, 1).unsqueeze(0), audio, scale,
                         sigma_a, x.dtype)
    return torch.cat([v.reshape(1, 1, -1), a.reshape(1, 1, -1)], dim=-1)


def carried_velocity(velocity: torch.Tensor, audio: torch.Tensor, scale: float, sigma_a: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The audio stream's velocity as the sampler carries it (ComfyUI's MiniMaxH3Model.forward: d/d(sigma_v) of the
    carried variable, (1 - s) x audio + (1 + (s - 1) sigma_a) v, audio the stream's own latent the network saw), in
    float32 whatever the model's dtype: its two terms (about 3x the result at the shifts 12 / 3) nearly cancel, which in
    bf16 (ComfyUI computes it in the input's dtype) costs the result a few of its bits. Returned in `dtype`."""
    v = velocity.float()
    if scale != 1.0:
        v = (1.0 - scale) * audio.float() + (1.0 + (scale - 1.0) * sigma_a.float()) * v
    return v.to(dtype)


# ---- attention: the block stack's self-attention local or sequence parallel; the text refiner's always local --------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' MiniMax-H3 RoPE: the leading cos.shape[-1] channels of every head rotated split-half (ComfyUI's
    rms_rope_split_half pairs the same channels), the rest passed through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


class H3Processor:
    """What diffusers' MiniMaxH3AttnProcessor computes, its attention through the sequence-parallel entry point when
    one is given, except in the token refiner (marked `xdit_local` at load), whose text every rank holds whole."""

    def __init__(self, attention=None):
        self.attention = attention

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if attention_mask is not None:
            raise ValueError("MiniMax-H3 attention takes no attention mask (ComfyUI uses none)")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        if self.attention is None or getattr(attn, "xdit_local", False):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        else:
            out = self.attention(q, k, v)[0]
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


class _ComputeDtype:
    """What diffusers' get_parameter_dtype reads first (a layerwise-casting hook's compute dtype): the model's forward
    casts each input to its projection's parameter dtype, which in an fp8 or GGUF file is the stored weights' (fp8
    bytes); the engine's quantized layers take the compute dtype and dequantize themselves."""

    def __init__(self, dtype: torch.dtype):
        self.compute_dtype = dtype

    def get_hook(self, name: str):
        return self if name == "layerwise_casting" else None


# ComfyUI's MiniMax-H3 holds these in float32 whatever the model's dtype (comfy/ldm/minimax/model.py: the patch
# projections and output heads built with dtype=torch.float32, the time embedding's table and MLP, rope.inv_freq), as
# diffusers' _keep_in_fp32_modules for the model lists them
FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")


def _fp32_param(name: str) -> bool:
    """diffusers' rule for _keep_in_fp32_modules: a listed name among the parameter's dotted parts."""
    return any(part in FP32_MODULES for part in name.split("."))


def _after_load(model) -> None:
    for block in model.token_refiner.refiner_blocks:
        block.attn.xdit_local = True
    model.set_attn_processor(H3Processor())
    compute = model.norm_out.norm.weight.dtype   # a norm's weight: held in the compute dtype in every format
    casts = [model.proj_in, model.audio_proj_in, model.context_embedder, model.time_embedder, model.proj_out,
             model.audio_proj_out, model.norm_out.linear] + [b.adaln_proj.linear for b in model.transformer_blocks]
    for module in casts:   # a float32 island (FP32_MODULES) held in float32 computes in it
        held = next((p.dtype for p in module.parameters() if p.is_floating_point()), compute)
        module._diffusers_hook = _ComputeDtype(torch.float32 if held == torch.float32 else compute)


# ---- pruned files: the time embedding read off a table, the modulations without an activation --------------------
class _Timesteps(torch.nn.Module):
    """Stands for diffusers' sinusoid in a pruned model: the distinct timesteps pass through unchanged."""

    def forward(self, t):
        return t


class _CurveTable(torch.nn.Module):
    """Stands for the time embedder in a pruned model (ComfyUI's use_adaln_curves): each timestep t in [0, 1] read off
    the table's rows by linear interpolation, float32, t = 1 on the last interval."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.register_buffer("table", torch.empty(grid, width, dtype=torch.float32))

    def forward(self, t):
        table = self.table.float()
        pos = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
        i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))


def _computes_in(linear) -> torch.dtype:
    """The dtype diffusers casts a Linear's input to: its _ComputeDtype, set at load (a float32 island's float32, else
    the compute dtype, whatever the weight is held in: int8, fp8, GGUF blocks dequantize themselves)."""
    return linear._diffusers_hook.compute_dtype


class _ModulationWithoutActivation(torch.nn.Module):
    """Stands for a block's diffusers modulation (MiniMaxH3AdaLayerNormModulation) in a pruned model: the same
    projection (its `linear`, so the file's weights load under the same names) on the curve as it is, without the SiLU
    (a pruned model's curve is the modulations' input as it is): six [levels x 3, hidden] tensors, one projection a
    block and call."""

    def __init__(self, original):
        super().__init__()
        self.linear, self.hidden_size = original.linear, original.hidden_size
        self.linear.xdit_float32 = True   # ComfyUI's adaln_dtype float32 for a curve-form file (model.py:460-461)

    def forward(self, temb):
        x = self.linear(temb.to(_computes_in(self.linear)))
        return x.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class _NormOutWithoutActivation(torch.nn.Module):
    """Stands for diffusers' output norm (MiniMaxH3AdaLayerNormOut) in a pruned model: the same norm and projection,
    without the SiLU on the curve."""

    def __init__(self, original):
        super().__init__()
        self.norm, self.linear = original.norm, original.linear
        self.linear.xdit_float32 = True   # as the blocks' (ComfyUI's FinalLayer: adaln_dtype, model.py:295-301)

    def forward(self, hidden, temb, index):
        shift, scale = self.linear(temb.to(_computes_in(self.linear))).chunk(2, dim=-1)
        return self.norm(hidden) * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)


def _model_class():
    from diffusers import MiniMaxH3Transformer3DModel

    def build(adaln_curve_grid: int = 0, **config):
        """The unmodified diffusers model, its rope.inv_freq (computed by diffusers, not saved) held in the state dict
        so it loads from the file as ComfyUI reads it (the same forward). A pruned file's model (adaln_curve_grid):
        the time embedding a table lookup and the modulations without their SiLU, as ComfyUI runs it (diffusers'
        modulation modules stood for by ones holding the same projections, whose weights are the file's)."""
        model = MiniMaxH3Transformer3DModel(**config)
        inv_freq = model.rope.inv_freq
        del model.rope.inv_freq
        model.rope.register_buffer("inv_freq", inv_freq, persistent=True)
        if adaln_curve_grid:
            model.time_proj = _Timesteps()
            model.time_embedder = _CurveTable(adaln_curve_grid, config["time_embed_dim"])
            for block in model.transformer_blocks:
                block.adaln_proj = _ModulationWithoutActivation(block.adaln_proj)
            model.norm_out = _NormOutWithoutActivation(model.norm_out)
        return model
    build.model_class = MiniMaxH3Transformer3DModel
    return build


def _comfy_model(config: dict) -> tuple[str, dict]:
    return "MiniMaxH3", {"image_model": "minimax_h3", "hidden_size": config["hidden_size"],
                         "num_layers": config["num_layers"]}


def _linear_width(config: dict) -> float:
    """Weights a token meets per block, in hidden^2: q, k, v and out (heads x head width each), the SwiGLU's up (two
    halves) and down."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return (4 * inner + 3 * config["ffn_dim"]) / config["hidden_size"]


FAMILY = Family(
    name="minimax-h3", title="MiniMax-H3", variants=tuple(DIMS["full"]),
    variant_aliases={"h3": "minimax-h3", "h3-pruned": "minimax-h3-pruned"},
    markers=(Marker("audio_patch_proj.weight", "minimax"),),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("minimax_h3",),
    compute_dtypes=("fp32", "bf16"), compute_dtypes_cite="comfy/supported_models.py:975",
    layers=lambda config: config["num_layers"],
    latent=H3_VIDEO, latent_patch=lambda config: 2, pads_to_patches=True, frames=True,
    sampling=lambda variant: FlowSampling.sd3(SHIFT),
    comfy_model=_comfy_model,
    cond_width=lambda config: config["text_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, forwards=lambda rows: rows, fit_jobs=FIT_JOBS, cfg=1.0, text_tokens=TEXT_TOKENS,
    stock_jobs={v: StockJob("minimax-h3-t2v", 864, 480, 8, 1.0, frames=124, shift=SHIFT, note="with its 8-step "
                            "turbo LoRA; the template's switch off: 20 steps") for v in DIMS["full"]},
    tokens=TokenTable(processor=H3Processor, gather_after="norm_out",
                      split_after=(("rope", 0, 0), ("rope", 1, 0)),
                      split_args=(("transformer_blocks.0", 0, 1), ("transformer_blocks.*", 2, 0), ("norm_out", 2, 0)),
                      blocks=("transformer_blocks",), kwargs_name="attention_kwargs"),
    linear_width=_linear_width, modulation=("adaln_proj",), text_stream=("token_refiner",),
    shard_units=("token_refiner",),
    native_layout="minimax", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load, fp32_params=_fp32_param,
    packed_streams=True, extras=EXTRAS, host_extras=EXTRAS, call_extras=comfy_call, text_splits=True, text_cross=False,
    extra_tokens=lambda config, latent_frames: 2 * audio_frames(H3_VIDEO.pixel_frames(latent_frames)),
    describe_blocks=lambda c: f"{c['num_layers']} blocks over one packed sequence (text, audio, video)",
    describe_conditioning=lambda c: (f"cond [1, N, {c['text_dim']}] (Qwen3-VL hidden states), no pooled output; "
                                     f"latent: ComfyUI's packed video [1, 24, T, H, W] and audio [1, 32, 2, T'] "
                                     f"(EmptyMiniMaxH3LatentAV)"),
    text_encoder=lambda variant: "Qwen3-VL 32B (the MiniMax-H3 text encoder ComfyUI loads)",
    comfyui_since=lambda variant: "0.33",
)
