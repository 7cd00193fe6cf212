"""MiniMax-H3's packed sequence as ComfyUI 0.33's model lays it out (comfy/ldm/minimax/model.py: PackedLayout, its
positions, patchify and the audio rows) and what a call of ComfyUI's MiniMaxH3Model carries besides x, timestep and
context (its payload: keyframes, reference blocks, token tags; the noise masks; the sigma shifts), as the engine's
tensors. The family module (minimax_h3.py) runs the forward from these."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import PACKED_SHAPE

FRAME_PER_TOKEN = (1, 4, 4, 4, 4)      # pixel frames per latent frame, cycling
FRAME_RESCALE = 5.0 / 3.0              # time-axis units per pixel frame
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2
SHIFT, AUDIO_SHIFT = 12.0, 3.0         # supported_models.MiniMaxH3.sampling_settings


# what a model call's extra conditioning holds for this family, each [n, ...] float64 (ComfyUI's Python floats exactly) (built from ComfyUI's own inputs
# by `call_extras`, on the ComfyUI side): av_shape: (video C, T, H, W, audio C, audio channels, audio T) of the packed
# streams; audio_scale: the sampler's carry factor (ModelSamplingAV.audio_scale); sigma_shift: (video, audio) shifts;
# token_tags: the text encoder's per-token modality tags (absent: all text); blocks: the keyframes and reference blocks
# (BLOCK_FIELDS each), their latents flattened in `cond_latents` (video ones, then audio ones, in block order);
# cond_aug: (video, audio) condition noise augmentation; cond_seed: the sampler's seed in four 16-bit limbs
EXTRAS = (PACKED_SHAPE, "audio_scale", "sigma_shift", "token_tags", "blocks", "cond_latents", "cond_aug", "cond_seed",
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
    out = {PACKED_SHAPE: per_row(torch.tensor(list(shapes[0][1:]) + list(shapes[1][1:]), dtype=f64)),
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
