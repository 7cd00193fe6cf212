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
from .base import Family, Marker, TokenTable, placed
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

# what a model call's extra conditioning holds for this family, each [n, ...] float64 (ComfyUI's Python floats exactly) (built from ComfyUI's own inputs
# by `call_extras`, on the ComfyUI side): av_shape: (video C, T, H, W, audio C, audio channels, audio T) of the packed
# streams; audio_scale: the sampler's carry factor (ModelSamplingAV.audio_scale); sigma_shift: (video, audio) shifts;
# token_tags: the text encoder's per-token modality tags (absent: all text); blocks: the keyframes and reference blocks
# (BLOCK_FIELDS each), their latents flattened in `cond_latents` (video ones, then audio ones, in block order);
# cond_aug: (video, audio) condition noise augmentation; cond_seed: the sampler's seed in four 16-bit limbs
EXTRAS = ("av_shape", "audio_scale", "sigma_shift", "token_tags", "blocks", "cond_latents", "cond_aug", "cond_seed",
          "video_mask", "audio_mask")   # ComfyUI's denoise_mask / audio_denoise_mask flattened: [T*H*W], [2*T']
VISUAL_COND_T, AUDIO_COND_T = 0.999, 1.0   # model.py VISUAL_COND_TIMESTEP, AUDIO_COND_TIMESTEP
BLOCK_KINDS = ("keyframe", "image", "audio", "video", "video_audio")
BLOCK_FIELDS = 8   # kind, frame index, latent T, H, W, audio T, has video, has audio


def time_shift_sigma(sigma: torch.Tensor, from_shift: float, to_shift: float) -> torch.Tensor:
    """A sigma of one shifted schedule on another: back to the base grid, the other shift applied."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


# ---- the packed sequence: positions, as ComfyUI's PackedLayout builds them ----------------------------------------
def _axis(dim: int, sqrt_area: float) -> torch.Tensor:
    """A frame axis's patch coordinates, area-normalised: dim // 2 points over (1 - r) / 2 .. (1 + r) / 2, x 32."""
    ratio, n = dim / sqrt_area, dim // 2
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def _frame(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) coordinates of one latent frame's patches [h/2 * w/2, 2], and the column axis."""
    area = math.sqrt(h * w)
    rows, cols = _axis(h, area), _axis(w, area)
    hh, ww = torch.meshgrid(rows, cols, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), cols


def _spans(frames: int) -> list[float]:
    return [FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(frames)]


def _video_grid(frames: int, frame: torch.Tensor, t0: float) -> torch.Tensor:
    spans = torch.tensor(_spans(frames), dtype=torch.float64)
    starts = float(t0) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    g = torch.empty(frames, frame.shape[0], 3, dtype=torch.float64)
    g[:, :, 0] = starts[:, None]
    g[:, :, 1:] = frame[None]
    return g.reshape(-1, 3)


def _audio_grid(t0: float, frames: int, w_low: float, w_high: float) -> torch.Tensor:
    """Both channels' rows, left then right: time from t0 a latent frame each, at the outermost column coordinates."""
    g = torch.zeros(2 * frames, 3, dtype=torch.float64)
    g[:, 0] = (t0 + torch.arange(frames, dtype=torch.float64)).repeat(2)
    g[:frames, 2], g[frames:, 2] = w_low, w_high
    return g


@dataclass(frozen=True)
class Block:
    """A keyframe (MiniMaxH3ImageToVideo's first / last frame, MiniMaxH3AddGuide's image, clip or audio at a frame) or a
    reference block (MiniMaxH3ReferenceToVideo: image, audio, video, video with its soundtrack)."""
    kind: str
    frame_index: int = 0
    frames: int = 0           # video latent frames (0: no video latent)
    h: int = 0
    w: int = 0
    audio_frames: int = 0     # audio latent frames (0: no audio latent)
    has_video: bool = False
    has_audio: bool = False


def _ref_span(b: Block) -> float:
    if b.kind == "image":
        return 1.0
    if b.kind == "audio":
        return float(b.audio_frames)
    return max(float(b.audio_frames), sum(_spans(b.frames)))


def layout(text: int, frames: int, h: int, w: int, audio: int, blocks: tuple[Block, ...] = ()) -> list:
    """The packed sequence's segments in order, [(kind, positions [n, 3] float64)]: text, each keyframe's condition
    rows (video, then audio) at its frame, each reference block's rows, the target audio, the target video (ComfyUI's
    PackedLayout for a latent of frames x h x w, whole 2x2 patches, and `audio` audio latent frames)."""
    frame, cols = _frame(h, w)
    low, high = float(cols[0]), float(cols[-1])
    g = torch.zeros(text, 3, dtype=torch.float64)
    g[:, 0] = torch.arange(text, dtype=torch.float64)
    out = [("text", g)]
    keyframes = [b for b in blocks if b.kind == "keyframe"]
    refs = [b for b in blocks if b.kind != "keyframe"]
    cursor = float(text) + sum(_ref_span(b) for b in refs)   # the targets' timeline starts after the references
    for b in keyframes:
        t0 = cursor + FRAME_RESCALE * b.frame_index
        if b.has_video:
            out.append(("cond", _video_grid(b.frames, frame, t0)))
        if b.has_audio:
            out.append(("cond_audio", _audio_grid(t0, b.audio_frames, low, high)))
    ref_cursor = float(text)
    for b in refs:
        if b.kind == "image":
            r, _ = _frame(b.h, b.w)
            g = torch.empty(r.shape[0], 3, dtype=torch.float64)
            g[:, 0], g[:, 1:] = ref_cursor, r
            out.append(("ref_img", g))
        elif b.kind == "audio":
            if b.audio_frames:
                out.append(("ref_audio", _audio_grid(ref_cursor, b.audio_frames, low, high)))
        else:   # a video, with its soundtrack's rows first
            r, rc = _frame(b.h, b.w)
            if b.audio_frames:
                out.append(("ref_audio", _audio_grid(ref_cursor, b.audio_frames, float(rc[0]), float(rc[-1]))))
            out.append(("ref_img", _video_grid(b.frames, r, ref_cursor)))
        ref_cursor += _ref_span(b)
    out.append(("audio", _audio_grid(cursor, audio, low, high)))
    out.append(("video", _video_grid(frames, frame, cursor)))
    return out


def positions(text: int, frames: int, h: int, w: int, audio_frames: int) -> torch.Tensor:
    """[S, 3] float64 (t, h, w) of a text-to-video sequence [text | audio (both channels) | video]."""
    return torch.cat([g for _, g in layout(text, frames, h, w, audio_frames)])


def patchify(video: torch.Tensor) -> torch.Tensor:
    """[1, C, T, H, W] (whole 2x2 patches) -> rows [1, T*H/2*W/2, C*4], features (c, ph, pw)."""
    _, c, t, h, w = video.shape
    x = video.reshape(1, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(1, t * (h // 2) * (w // 2), c * 4)


def unpatchify(rows: torch.Tensor, c: int, t: int, h: int, w: int) -> torch.Tensor:
    x = rows.reshape(1, t, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(1, c, t, h, w)


def pack_audio(audio: torch.Tensor) -> torch.Tensor:
    """[1, C, 2, T] -> rows [1, 2T, C], channel-major (the left channel's frames, then the right's)."""
    return audio[0].permute(1, 2, 0).reshape(1, -1, audio.shape[1])


def split_streams(x: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row [1, N] -> (video [1, C, T, H, W], audio [1, Ca, 2, Ta]) as comfy.utils.unpack_latents cuts it."""
    cv, t, h, w, ca, ch, ta = (int(v) for v in shape.tolist())
    nv, na = cv * t * h * w, ca * ch * ta
    if x.shape[-1] != nv + na:
        raise ValueError(f"a packed MiniMax-H3 latent of {x.shape[-1]} values does not hold a video of "
                         f"{[cv, t, h, w]} and an audio latent of {[ca, ch, ta]}")
    return x[..., :nv].reshape(1, cv, t, h, w), x[..., nv:nv + na].reshape(1, ca, ch, ta)


# ---- ComfyUI's payload <-> the call's float32 tensors -------------------------------------------------------------
def call_extras(shapes: list[tuple], payload: dict, transformer_options: dict, shifts: tuple[float, float],
                rows: int, masks: dict | None = None) -> dict[str, torch.Tensor]:
    """What a call of ComfyUI's MiniMaxH3Model reads besides x, timestep and context, as the engine's float64 tensors
    [rows, ...]: the streams' shapes, the audio carry factor, the sigma shifts (MiniMaxH3SigmaShift's, else the
    model's), the token tags, the keyframes and reference blocks with their latents (ComfyUI's payload), and the noise
    masks ComfyUI's model passes (`masks`: denoise_mask [1, 1, T, H, W] and audio_denoise_mask [1, 1, 2, T'], pooled
    to the token grid by its extra_conds). ValueError for a stream layout the model does not take."""
    if len(shapes) != 2 or len(shapes[0]) != 5 or len(shapes[1]) != 4:
        raise ValueError(f"latent streams of shapes {[list(s) for s in shapes]}: MiniMax-H3 takes a video latent "
                         f"[B, C, T, H, W] and an audio latent [B, C, 2, T] (EmptyMiniMaxH3LatentAV)")

    def per_row(t):
        return t.reshape(1, *t.shape).expand(rows, *t.shape).contiguous()
    shift_v = float(transformer_options.get("minimax_h3_sigma_shift_video", shifts[0]))
    shift_a = float(transformer_options.get("minimax_h3_sigma_shift_audio", shifts[1]))
    f64 = torch.float64
    out = {"av_shape": per_row(torch.tensor(list(shapes[0][1:]) + list(shapes[1][1:]), dtype=f64)),
           "audio_scale": torch.full((rows,), float(payload.get("audio_scale", 1.0)), dtype=f64),
           "sigma_shift": per_row(torch.tensor([shift_v, shift_a], dtype=f64))}
    tags = payload.get("text_token_tags")
    if tags is not None:
        out["token_tags"] = per_row(torch.as_tensor(tags).reshape(-1).to(f64))
    for name, key, size in (("denoise_mask", "video_mask", math.prod(shapes[0][2:])),
                            ("audio_denoise_mask", "audio_mask", math.prod(shapes[1][2:]))):
        mask = (masks or {}).get(name)
        if mask is None:
            continue
        if mask.numel() != size:
            raise ValueError(f"{name} of shape {list(mask.shape)} does not cover the {key.split('_')[0]} latent's "
                             f"{size} values")
        out[key] = per_row(mask.detach().reshape(-1).to(f64))
    blocks, videos, audios = [], [], []
    for kf in payload.get("keyframes") or ():
        v, a = kf.get("latent"), kf.get("audio_latent")
        blocks.append(_block_row("keyframe", int(kf["resolved_frame_index"]), v, a))
        videos += [v] if v is not None else []
        audios += [a] if a is not None else []
    for ref in payload.get("refs") or ():
        v, a = ref.get("latent"), ref.get("audio_latent")
        row = _block_row(ref["kind"], 0, v, a)
        row[3:5] = torch.tensor([float(ref.get("latent_h", row[3])), float(ref.get("latent_w", row[4]))])
        row[5] = float(ref.get("ref_audio_t", row[5]))
        blocks.append(row)
        videos += [v] if v is not None else []
        audios += [a] if a is not None else []
    if blocks:
        out["blocks"] = per_row(torch.stack(blocks))
        out["cond_latents"] = per_row(torch.cat([t.detach().float().reshape(-1) for t in videos + audios]).to(f64))
        out["cond_aug"] = per_row(torch.tensor([float(payload.get("visual_cond_noise_aug", VISUAL_COND_T)),
                                                float(payload.get("audio_cond_noise_aug", AUDIO_COND_T))], dtype=f64))
        seed = int(payload.get("seed", 0)) % 2 ** 64
        out["cond_seed"] = per_row(torch.tensor([(seed >> s) & 0xFFFF for s in (0, 16, 32, 48)], dtype=f64))
    return out


def comfy_call(shapes: list[tuple], kwargs: dict, transformer_options: dict, timestep, meta=None):
    """Family.call_extras: what a call of ComfyUI's MiniMaxH3Model reads besides x and context (its payload, the noise
    masks, the sigma shifts: MiniMaxH3SigmaShift's, else the model's own), removed from `kwargs`, as (the call_extras
    tensors, the timestep as ComfyUI passes it)."""
    payload = dict(kwargs.pop("minimax_payload", None) or {})
    masks = {k: kwargs.pop(k, None) for k in ("denoise_mask", "audio_denoise_mask")}
    shifts = (float(getattr(meta, "sigma_shift_video", SHIFT)), float(getattr(meta, "sigma_shift_audio", AUDIO_SHIFT)))
    return call_extras(shapes, payload, transformer_options, shifts, shapes[0][0], masks), timestep


def _block_row(kind: str, frame_index: int, video, audio) -> torch.Tensor:
    if kind not in BLOCK_KINDS:
        raise ValueError(f"a MiniMax-H3 reference block of kind {kind!r}: ComfyUI's nodes make {BLOCK_KINDS[1:]}")
    if video is not None and (video.ndim != 5 or video.shape[0] != 1):
        raise ValueError(f"a MiniMax-H3 {kind} latent of shape {list(video.shape)}: give one [1, 24, T, H, W]")
    vt, h, w = (video.shape[2:] if video is not None else (0, 0, 0))
    rt = audio.shape[-1] if audio is not None else 0
    return torch.tensor([BLOCK_KINDS.index(kind), frame_index, vt, h, w, rt, video is not None, audio is not None],
                        dtype=torch.float64)


def _blocks(extras: dict) -> tuple[tuple[Block, ...], list[torch.Tensor], list[torch.Tensor]]:
    """The call's keyframes and reference blocks, and their video and audio latents (each on the CPU, float32, as
    ComfyUI's model takes them)."""
    if "blocks" not in extras:
        return (), [], []
    rows = extras["blocks"].reshape(-1, BLOCK_FIELDS).cpu().tolist()
    blocks = tuple(Block(BLOCK_KINDS[int(r[0])], int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), bool(r[6]),
                         bool(r[7])) for r in rows)
    flat, start, videos, audios = extras["cond_latents"].reshape(-1).cpu().float(), 0, [], []
    for b in blocks:
        if b.has_video:
            n = 24 * b.frames * b.h * b.w
            videos.append(flat[start:start + n].reshape(1, 24, b.frames, b.h, b.w))
            start += n
    for b in blocks:
        if b.has_audio:
            n = 32 * 2 * b.audio_frames
            audios.append(flat[start:start + n].reshape(1, 32, 2, b.audio_frames))
            start += n
    if start != flat.numel():
        raise ValueError(f"the MiniMax-H3 condition latents hold {flat.numel()} values, their blocks {start}")
    return blocks, videos, audios


def mask_rows(mask: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor | None:
    """A video noise mask [T, H, W] (1 generates) -> one value per 2x2 patch row (its largest, the frame padded as the
    latent is, replicating its edge), None when every row generates (ComfyUI's mask_row_values)."""
    m = F.pad(mask[None], (0, w - mask.shape[-1], 0, h - mask.shape[-2]), mode="replicate")[0]
    values = m.reshape(frames, h // 2, 2, w // 2, 2).amax(dim=(2, 4)).reshape(-1)
    return None if bool((values >= 1.0 - 1e-3).all()) else values


def _augmented(rows: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    """ComfyUI's condition noise augmentation of one condition's rows: the same CPU generator stream restarted for each
    (aug x rows + (1 - aug) x noise), none at aug 1."""
    if aug >= 1.0:
        return rows
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    return aug * rows + (1.0 - aug) * noise


# ---- the one forward ------------------------------------------------------------------------------------------------
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
    """One row. What the call's layout is built from (the streams' shapes, blocks, masks, tags, seed: the family's
    host_extras) is read on the host, where the ranks hold it; the index, tag and position tensors and the condition
    rows built from it are placed on the device once per distinct content; the timesteps are computed on the device
    from the call's own. So a call waits for the device nowhere (on ranks that hold the extras on the host)."""
    model, dtype, device = flow.model, flow.dtype, flow.device
    video, audio_carried = split_streams(x.reshape(1, -1), extras["av_shape"])
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

    def forward(self, temb):
        x = self.linear(temb.to(_computes_in(self.linear)))
        return x.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class _NormOutWithoutActivation(torch.nn.Module):
    """Stands for diffusers' output norm (MiniMaxH3AdaLayerNormOut) in a pruned model: the same norm and projection,
    without the SiLU on the curve."""

    def __init__(self, original):
        super().__init__()
        self.norm, self.linear = original.norm, original.linear

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
    layers=lambda config: config["num_layers"],
    latent=H3_VIDEO, latent_patch=lambda config: 2, pads_to_patches=True, frames=True,
    sampling=lambda variant: FlowSampling.sd3(SHIFT),
    comfy_model=_comfy_model,
    cond_width=lambda config: config["text_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, forwards=lambda rows: rows, cfg=1.0, text_tokens=TEXT_TOKENS,
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
