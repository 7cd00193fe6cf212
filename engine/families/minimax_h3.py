"""MiniMax-H3 (audio + video, one packed-token DiT): how the engine runs this family (its checkpoints' dims, layout
and detection: minimax_h3_layout.py).

ComfyUI's conventions, read from ComfyUI 0.33.0 (file and line in the README's "MiniMax-H3 conventions"):
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
(rows, distinct timesteps, per-row indices and tags, positions), which this module builds as ComfyUI does.

Conditioning the engine does not take yet (refused in one line on the MODEL route): keyframes and guides
(MiniMaxH3ImageToVideo, MiniMaxH3AddGuide), reference blocks (MiniMaxH3ReferenceToVideo) and noise masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import Family, Marker, TokenTable
from .minimax_h3_layout import DIMS, infer, key_map, shapes  # noqa: F401 (read here)

SHIFT, AUDIO_SHIFT = 12.0, 3.0         # supported_models.MiniMaxH3.sampling_settings
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)      # pixel frames per latent frame, cycling
FRAME_RESCALE = 5.0 / 3.0              # time-axis units per pixel frame
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2
TEXT_TOKENS = 256
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

# what a model call's extra conditioning holds for this family (ComfyUI side: xdit_nodes/link.py): each [n, ...]
# float32. av_shape: (video C, T, H, W, audio C, audio channels, audio T) of the packed streams; audio_scale: the
# sampler's carry factor (ModelSamplingAV.audio_scale); sigma_shift: (video, audio) shifts; token_tags: the text
# encoder's per-token modality tags (absent: all text)
EXTRAS = ("av_shape", "audio_scale", "sigma_shift", "token_tags")


def time_shift_sigma(sigma: torch.Tensor, from_shift: float, to_shift: float) -> torch.Tensor:
    """A sigma of one shifted schedule on another: back to the base grid, the other shift applied."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def _axis(dim: int, sqrt_area: float) -> torch.Tensor:
    """A frame axis's patch coordinates, area-normalised: dim // 2 points over (1 - r) / 2 .. (1 + r) / 2, x 32."""
    ratio, n = dim / sqrt_area, dim // 2
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def positions(text: int, frames: int, h: int, w: int, audio_frames: int) -> torch.Tensor:
    """[S, 3] float64 (t, h, w) of the sequence [text | audio (both channels) | video] for a latent of frames x h x w
    (whole 2x2 patches) and audio_frames audio latent frames."""
    area = math.sqrt(h * w)
    rows, cols = _axis(h, area), _axis(w, area)
    hh, ww = torch.meshgrid(rows, cols, indexing="ij")
    frame = torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1)
    out = torch.zeros(text + 2 * audio_frames + frames * frame.shape[0], 3, dtype=torch.float64)
    out[:text, 0] = torch.arange(text, dtype=torch.float64)
    a = out[text:text + 2 * audio_frames]
    a[:, 0] = (text + torch.arange(audio_frames, dtype=torch.float64)).repeat(2)
    a[:audio_frames, 2], a[audio_frames:, 2] = float(cols[0]), float(cols[-1])
    spans = torch.tensor([FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(frames)], dtype=torch.float64)
    starts = float(text) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    v = out[text + 2 * audio_frames:].view(frames, frame.shape[0], 3)
    v[:, :, 0] = starts[:, None]
    v[:, :, 1:] = frame[None]
    return out


def patchify(video: torch.Tensor) -> torch.Tensor:
    """[1, C, T, H, W] (whole 2x2 patches) -> rows [1, T*H/2*W/2, C*4], features (c, ph, pw)."""
    _, c, t, h, w = video.shape
    x = video.reshape(1, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(1, t * (h // 2) * (w // 2), c * 4)


def unpatchify(rows: torch.Tensor, c: int, t: int, h: int, w: int) -> torch.Tensor:
    x = rows.reshape(1, t, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(1, c, t, h, w)


def split_streams(x: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row [1, N] -> (video [1, C, T, H, W], audio [1, Ca, 2, Ta]) as comfy.utils.unpack_latents cuts it."""
    cv, t, h, w, ca, ch, ta = (int(v) for v in shape.tolist())
    nv, na = cv * t * h * w, ca * ch * ta
    if x.shape[-1] != nv + na:
        raise ValueError(f"a packed MiniMax-H3 latent of {x.shape[-1]} values does not hold a video of "
                         f"{[cv, t, h, w]} and an audio latent of {[ca, ch, ta]}")
    return x[..., :nv].reshape(1, cv, t, h, w), x[..., nv:nv + na].reshape(1, ca, ch, ta)


def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """The packed velocity [n, 1, N] for packed latents x [n, 1, N] (ComfyUI's pack_latents of the video and audio
    streams, as ComfyUI's sampler carries them) at ComfyUI's model timestep (sigma x 1000): per row, what ComfyUI's
    MiniMaxH3Model returns (its batch is one), through the unmodified diffusers MiniMaxH3Transformer3DModel."""
    extras = prepared.extras or {}
    if "av_shape" not in extras:
        raise ValueError("a MiniMax-H3 model call needs the packed streams' shapes (ComfyUI's latent_shapes)")
    outs = [_one(flow, x[i:i + 1], timestep[i], prepared.cond[i:i + 1],
                 {k: v[i] for k, v in extras.items() if v is not None}) for i in range(x.shape[0])]
    return torch.cat(outs)


def _one(flow, x, timestep, context, extras) -> torch.Tensor:
    model, dtype = flow.model, flow.dtype
    video, audio_carried = split_streams(x.reshape(1, -1), extras["av_shape"])
    shift_v, shift_a = (float(v) for v in extras["sigma_shift"].tolist()) if "sigma_shift" in extras \
        else (SHIFT, AUDIO_SHIFT)
    scale = float(extras["audio_scale"]) if "audio_scale" in extras else 1.0
    # ComfyUI computes the two sigmas in float32 from the model timestep
    sigma_v = (timestep.reshape(-1)[0] / 1000.0).float().clamp(min=1e-6)
    sigma_a = time_shift_sigma(sigma_v, shift_v, shift_a)
    audio = audio_carried
    if scale != 1.0:   # the sampler's carried audio -> the stream's own latent
        carry = (sigma_a / sigma_v).to(audio.dtype)
        audio = audio_carried * carry
    frames, h0, w0 = video.shape[2:]
    video = F.pad(video, (0, -w0 % 2, 0, -h0 % 2, 0, 0), mode="circular") if h0 % 2 or w0 % 2 else video
    h, w = video.shape[3:]
    ta = audio.shape[-1]
    text = context.shape[1]
    t_v, t_a = float(1.0 - sigma_v), float(1.0 - sigma_a)
    levels = sorted({t_v, t_a})
    row = {t: i for i, t in enumerate(levels)}
    n_video = frames * (h // 2) * (w // 2)
    seq = text + 2 * ta + n_video
    device = flow.device
    t_index = torch.empty(seq, dtype=torch.long)
    t_index[:text] = row[t_v]
    t_index[text:text + 2 * ta] = row[t_a]
    t_index[text + 2 * ta:] = row[t_v]
    tags = torch.empty(seq, dtype=torch.long)
    tags[:text] = TEXT_TAG if "token_tags" not in extras else extras["token_tags"].reshape(-1)[:text].long().cpu()
    tags[text:text + 2 * ta] = AUDIO_TAG
    tags[text + 2 * ta:] = VIDEO_TAG
    idx = torch.arange(seq)
    video_rows = patchify(video)
    audio_rows = audio[0].permute(1, 2, 0).reshape(1, 2 * ta, audio.shape[1])   # channel-major, as pack_audio
    v_out, a_out = model(
        hidden_states=video_rows.to(device), audio_hidden_states=audio_rows.to(device),
        encoder_hidden_states=context.to(device, dtype),
        timestep=torch.tensor(levels, dtype=torch.float32, device=device),
        timestep_indices=t_index.to(device), token_tags=tags.to(device),
        position_ids=positions(text, frames, h, w, ta).to(device),
        video_indices=idx[text + 2 * ta:].to(device), audio_indices=idx[text:text + 2 * ta].to(device),
        text_indices=idx[:text].to(device), return_dict=False)
    v = -unpatchify(v_out, video.shape[1], frames, h, w)[:, :, :, :h0, :w0].to(x.dtype)
    a = -a_out.reshape(2, ta, -1).permute(2, 0, 1).unsqueeze(0).to(x.dtype)
    if scale != 1.0:   # d/d(sigma_v) of the carried variable, as ComfyUI converts it
        a = (1.0 - scale) * audio + (1.0 + (scale - 1.0) * sigma_a).to(a.dtype) * a
    return torch.cat([v.reshape(1, 1, -1), a.reshape(1, 1, -1)], dim=-1)


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


def _after_load(model) -> None:
    for block in model.token_refiner.refiner_blocks:
        block.attn.xdit_local = True
    model.set_attn_processor(H3Processor())


def _model_class():
    from diffusers import MiniMaxH3Transformer3DModel

    def build(**config):
        """The unmodified diffusers model, its rope.inv_freq (computed by diffusers, not saved) held in the state dict
        so it loads from the file as ComfyUI reads it (the same forward)."""
        model = MiniMaxH3Transformer3DModel(**config)
        inv_freq = model.rope.inv_freq
        del model.rope.inv_freq
        model.rope.register_buffer("inv_freq", inv_freq, persistent=True)
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
    variant_aliases={"h3": "minimax-h3"},
    markers=(Marker("audio_patch_proj.weight", "minimax"),),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("minimax_h3",),
    layers=lambda config: config["num_layers"],
    latent=H3_VIDEO, latent_patch=lambda config: 2, pads_to_patches=True, frames=True,
    sampling=lambda variant: FlowSampling.sd3(SHIFT),
    comfy_model=_comfy_model,
    cond_width=lambda config: config["text_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, cfg=1.0, text_tokens=TEXT_TOKENS,
    tokens=TokenTable(processor=H3Processor, gather_after="norm_out",
                      split_after=(("rope", 0, 0), ("rope", 1, 0)),
                      split_args=(("transformer_blocks.0", 0, 1), ("transformer_blocks.*", 2, 0), ("norm_out", 2, 0)),
                      blocks=("transformer_blocks",), kwargs_name="attention_kwargs"),
    linear_width=_linear_width, modulation=("adaln_proj",), text_stream=("token_refiner",),
    native_layout="minimax", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load,
    packed_streams=True, extras=EXTRAS, text_splits=True, text_cross=False,
    extra_tokens=lambda config, latent_frames: 2 * audio_frames(H3_VIDEO.pixel_frames(latent_frames)),
    describe_blocks=lambda c: f"{c['num_layers']} blocks over one packed sequence (text, audio, video)",
    describe_conditioning=lambda c: (f"cond [1, N, {c['text_dim']}] (Qwen3-VL hidden states), no pooled output; "
                                     f"latent: ComfyUI's packed video [1, 24, T, H, W] and audio [1, 32, 2, T'] "
                                     f"(EmptyMiniMaxH3LatentAV)"),
    text_encoder=lambda variant: "Qwen3-VL 32B (the MiniMax-H3 text encoder ComfyUI loads)",
    comfyui_since=lambda variant: "0.33",
)
