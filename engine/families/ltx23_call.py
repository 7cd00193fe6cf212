"""LTX-2.3's tokens' positions as ComfyUI 0.33's LTXAV model builds them, and what a call of ComfyUI's model carries
besides x and context, as the engine's tensors (the family module, ltx23.py, runs the forward from these; file and
line in its docstring)."""
from __future__ import annotations

import math

import torch

from .base import PACKED_SHAPE
from .ltx23_guides import guide_extras
from .ltx25 import generated_slots

FPS = 25.0                            # LTXAV.extra_conds' frame_rate when none is set
HOP, SAMPLE_RATE, AUDIO_DOWNSAMPLE = 160, 16000, 4   # AudioPatchifier's defaults


# ---- positions, as ComfyUI builds them -----------------------------------------------------------------------------
def video_coords(frames: int, h: int, w: int, fps: float, rows: int = 1, scale=(8, 32, 32),
                 device=None) -> torch.Tensor:
    """[rows, 3, frames*h*w, 2] float32: each token's (start, end) pixel coordinates (time in seconds) as ComfyUI's
    LTXAV model makes them: latent corners (patch 1, int64) x the VAE's scale factors, the causal fix on time, float32,
    time x (1 / fps)."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames, device=device), torch.arange(h, device=device),
                                      torch.arange(w, device=device), indexing="ij")).reshape(3, -1)
    latent = torch.stack([grid, grid + 1], dim=-1)                       # [3, N, 2]
    pixel = torch.stack([latent[i] * scale[i] for i in range(3)])      # (no host data put on the device)
    pixel[0] = (pixel[0] + 1 - scale[0]).clamp(min=0)
    coords = pixel.to(torch.float32)
    coords[0] = coords[0] * (1.0 / fps)
    return coords.unsqueeze(0).expand(rows, -1, -1, -1).contiguous()


def audio_coords(frames: int, rows: int = 1, device=None) -> torch.Tensor:
    """[rows, 1, frames, 2] float32: each audio latent's (start, end) in seconds as ComfyUI's AudioPatchifier computes
    them (causal: max(0, 4 t + 1 - 4) mel frames x 160 / 16000)."""
    def seconds(start, end):
        mel = torch.arange(start, end, dtype=torch.float32, device=device) * AUDIO_DOWNSAMPLE
        return (mel + 1 - AUDIO_DOWNSAMPLE).clip(min=0) * HOP / SAMPLE_RATE
    coords = torch.stack([seconds(0, frames), seconds(1, frames + 1)], dim=-1)   # [T, 2]
    return coords.reshape(1, 1, frames, 2).expand(rows, -1, -1, -1).contiguous()


def reference_coords(frames: int, rows: int = 1, device=None) -> torch.Tensor:
    """[rows, 1, frames, 2] float32: LTXVReferenceAudio's tokens' (start, end) in seconds as ComfyUI's LTXAV model
    places them (av_model.py:716-732): the audio latents' own times, moved back by the last one's end plus one
    latent's duration (4 x 160 / 16000 s), so the reference ends just before time 0."""
    end = float(audio_coords(frames)[0, 0, -1, 1])   # the last one's end, on the host (float32, as ComfyUI's)
    return audio_coords(frames, rows, device) - (end + AUDIO_DOWNSAMPLE * HOP / SAMPLE_RATE)


# ---- ComfyUI's call <-> the engine's tensors -------------------------------------------------------------------------
# a model call's extra conditioning for this family, each [n, ...] float64 (ComfyUI's values exactly): av_shape (video
# C, F, H, W, audio C, T, bins) of the packed streams; frame_rate; audio_t: the audio timestep ComfyUI's
# process_timestep gives ([n], or [n, T] per token under a mask); gate_t: the (audio, video) timesteps' max over the
# whole call (ComfyUI's crossed gates take it batch-wide). The video timestep is the call's timestep itself ([n], or
# [n, F*H*W] per token under a mask).
# With LTXVAddGuide's guide frames (appended to the video latent): guide: (guide tokens kept, tracked guide tokens,
# video tokens kept); guide_coords: the kept guide tokens' (start, end) pixel coordinates [3 x G x 2] (keyframe_idxs);
# guide_weights: the tracked guide tokens' attention weights; keep: 1 for each video token the model keeps (only when
# a negative noise mask drops some: ComfyUI's grid_mask).
# ref_audio: LTXVReferenceAudio's reference tokens [R x 128] (ID-LoRA), ahead of the audio; stg: the blocks whose
# self-attentions STG's pass perturbs; coupled: 0 for a pass with the audio-video cross-attentions severed
# (LTXVModalityGuidance's); keyframe_slots: (first latent frame, frames) of LTX-2.5's generated keyframes.
EXTRAS = (PACKED_SHAPE, "frame_rate", "audio_t", "gate_t", "guide", "guide_coords", "guide_weights", "keep",
          "ref_audio", "stg", "coupled", "keyframe_slots")
HOST_EXTRAS = (PACKED_SHAPE, "frame_rate", "guide", "keep", "stg", "coupled", "keyframe_slots")   # read on the host
REFUSED_OPTIONS = {   # transformer_options ComfyUI's LTXAV model reads that the engine does not run yet
    "run_vx": "a pass without the video (run_vx off)", "run_ax": "a pass without the audio (run_ax off)"}


def _per_row(t: torch.Tensor, rows: int, tokens: int, what: str) -> torch.Tensor:
    """A timestep of the call ([rows], or per token [rows, tokens, 1]) as [rows] or [rows, tokens]."""
    t = torch.as_tensor(t).detach()
    if t.numel() == 1:
        return t.reshape(1).expand(rows).to("cpu", torch.float32)
    if t.ndim == 1 and t.shape[0] == rows:
        return t.to("cpu", torch.float32)
    if t.shape[0] == rows and t[0].numel() == tokens:
        return t.reshape(rows, tokens).to("cpu", torch.float32)
    raise ValueError(f"an LTX-2.3 {what} timestep of shape {list(t.shape)} fits neither {rows} rows nor their "
                     f"{tokens} tokens")


def comfy_call(shapes: list[tuple], kwargs: dict, transformer_options: dict, timestep, meta=None):
    """What a call of ComfyUI's LTXAVModel reads besides x and context, as the engine's tensors: (extras, the video
    timestep). Reads (and removes from `kwargs`) frame_rate, the noise masks (ComfyUI's model reads them only for a
    memory layout and for guides: their effect is the per-token timesteps process_timestep made) and the guide inputs
    (guide_extras); ValueError, in one line, for what the engine does not run yet."""
    if len(shapes) != 2 or len(shapes[0]) != 5 or len(shapes[1]) != 4:
        raise ValueError(f"latent streams of shapes {[list(s) for s in shapes]}: LTX-2.3 takes a video latent "
                         f"[B, 128, F, H, W] and an audio latent [B, 8, T, 16] (LTXVConcatAVLatent of "
                         f"EmptyLTXVLatentVideo and LTXVEmptyLatentAudio)")
    for name, what in REFUSED_OPTIONS.items():
        if transformer_options.get(name, True) is False:
            raise ValueError(f"the sampling asks for {what}, which the xDiT engine does not run for LTX-2.3 yet: "
                             f"use a plain guider (CFGGuider) on the engine's MODEL")
    a2v, v2a = (transformer_options.get(k, True) is not False for k in ("a2v_cross_attn", "v2a_cross_attn"))
    if a2v != v2a:
        raise ValueError("the sampling severs one direction of LTX-2.3's audio-video cross-attention only "
                         f"(a2v_cross_attn {a2v}, v2a_cross_attn {v2a}), which the xDiT engine does not run: "
                         "LTXVModalityGuidance severs both")
    stg = sorted(int(b) for b in (transformer_options.get("stg_self_attn_blocks") or ()))
    keyframes = kwargs.pop("keyframe_idxs", None)
    entries = kwargs.pop("guide_attention_entries", None)
    video_mask = kwargs.pop("denoise_mask", None)
    reference = kwargs.pop("ref_audio", None)
    generated = kwargs.pop("generated_keyframes", None)   # read only by LTX-2.5's keyframe embedding
    if getattr(meta, "keyframes_abs_pos_embedding", True) is None:   # ComfyUI's model has none (LTX-2.3): unread
        generated = None
    kwargs.pop("audio_denoise_mask", None)
    rate = kwargs.pop("frame_rate", FPS)
    rate = float(rate.reshape(-1)[0]) if torch.is_tensor(rate) else float(rate)
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"frame_rate {rate}: give the clip's frames a second (LTXVConditioning)")
    rows = shapes[0][0]
    v_t, a_t = timestep if isinstance(timestep, (tuple, list)) and len(timestep) == 2 else (timestep, timestep)
    video = _per_row(v_t, rows, math.prod(shapes[0][2:]), "video")
    audio = _per_row(a_t, rows, shapes[1][2], "audio")
    f64 = torch.float64
    extras = {}
    if keyframes is not None and keyframes.shape[2] > 0:   # LTXVAddGuide's guide frames (entries alone: no guides)
        extras, keep = guide_extras(shapes[0], keyframes, entries, video_mask)
        if video.ndim != 2:
            raise ValueError("LTXVAddGuide's guide frames without per-token timesteps: the sampler gave the model no "
                             "noise mask")
        video = video[:, keep]
    if reference is not None:   # LTXVReferenceAudio's tokens [1 or B, R, C x bins]
        tokens = torch.as_tensor(reference["tokens"]).detach().to("cpu", f64)
        width = shapes[1][1] * shapes[1][3]
        if tokens.ndim != 3 or tokens.shape[2] != width or tokens.shape[0] not in (1, rows):
            raise ValueError(f"a reference audio of shape {list(tokens.shape)}: LTX-2.3 takes [1 or {rows}, R, {width}] "
                             f"tokens (LTXVReferenceAudio with the model's audio VAE)")
        extras["ref_audio"] = tokens.reshape(tokens.shape[0], -1).expand(rows, -1)
    if generated is not None:
        extras["keyframe_slots"] = generated_slots(generated, shapes[0][3] * shapes[0][4], rows)
    if stg:
        extras["stg"] = torch.tensor([stg], dtype=f64).expand(rows, -1)
    if not a2v:
        extras["coupled"] = torch.zeros(rows, dtype=f64)
    extras.update({
        PACKED_SHAPE: torch.tensor([list(shapes[0][1:]) + list(shapes[1][1:])], dtype=f64).expand(rows, -1),
        "frame_rate": torch.full((rows,), rate, dtype=f64), "audio_t": audio.to(f64),
        "gate_t": torch.tensor([[float(audio.max()), float(video.max())]], dtype=f64).expand(rows, -1)})
    return {k: v.contiguous() for k, v in extras.items()}, video
