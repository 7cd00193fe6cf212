"""LTX-2.5 (Lightricks, audio + video): what it adds to the LTX family it is a variant of (ltx23.py runs both; its
checkpoints in ltx23_layout.py), read from ComfyUI 0.33.0 (C = the ComfyUI checkout; "Add support for LTX 2.5",
#15499, commit 57ce8e1a, first released in ComfyUI 0.32.0).

Why a variant, not a family: ComfyUI builds LTX-2.5 with LTX-2.3's model class (C/comfy/supported_models.py:945-958
LTXAV, model_base.LTXAV, C/comfy/ldm/lightricks/av_model.py LTXAVModel), found by the same detection branch
(C/comfy/model_detection.py:419-429) and differing only in two settings of the file: ff_bias from the header's config
(false: the video feed-forward has no biases, model.py:305-322, av_model.py:182-187; audio_ff_bias left true) and
use_keyframes_abs_pos_embedding from the presence of the `keyframes_abs_pos_embedding` tensor [1, inner]
(model_detection.py:428, set after the header: no header says otherwise; model.py:788-791). Its latent, sampling,
text conditioning and every node LTX-2.3 takes are LTX-2.3's.

The keyframe embedding (C/comfy/ldm/lightricks/model.py:1171-1227, apply_keyframes_abs_pos_embedding and
keyframes_abs_pos_mask): right after patchify_proj, x + mask x embedding on every video token whose temporal start (its
pixel coordinates after the causal fix: the first latent frame's tokens) is 0, in every call (plain text-to-video
included), but never on LTXVAddGuide's guide tokens (the sequence's last num_guide_tokens, though a frame-0 guide starts
at 0 too); with a `generated_keyframes` conditioning entry (model_base.py:1222-1224; no node of 0.33 sets one) also
every token of its num_keyframes latent frames from first_latent_frame, refused where its tokens_per_frame is not the
latent's; the tokens a negative noise mask drops (grid_mask) are out of the sequence first. diffusers'
LTX2VideoTransformer3DModel adds the same parameter, with the same arithmetic, only to the tokens its caller marks in
`video_keyframes_mask` (transformer_ltx2.py, forward step 2.1): the family gives it the mask ComfyUI's rule implies
(keyframe_mask), split with the video tokens under sequence parallel (the token table).

Its templates (comfyui_workflow_templates_json 0.1.50: video_ltx2_5_t2v.json, video_ltx2_5_i2v.json,
video_ltx2_5_flf2v.json): the distilled int8 ConvRot file through UNETLoader, Gemma 4 12B with the LTX-2.5 text
projection through CLIPLoader (type ltxv), LTXVConditioning at 24 fps, LTXVDualCFGGuider at video 1 / audio 1 (equal
scales: plain CFG at 1, no negative pass; C/comfy_extras/nodes_lt.py:1053-1094), euler_ancestral, the LTX-2.3
templates' two ManualSigmas passes around LTXVLatentUpsampler x2. LTXVDualCFGGuider is ComfyUI's own guider on the
engine's MODEL: at unequal scales it always runs the negative (disable_cfg1_optimization) and applies the audio scale
to the packed tail of the two predictions the engine returns.
"""
from __future__ import annotations

import torch

TEMPLATE_FPS = 24.0   # the LTX-2.5 templates' frame rate (LTXVConditioning, LTXVEmptyLatentAudio, CreateVideo)
TEMPLATE_FILE = "ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors"
TEXT_ENCODER = ("Gemma 4 12B with the LTX-2.5 text projection (CLIPLoader, type ltxv: "
                "gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors)")
COMFYUI_SINCE = "0.32"   # the first release with #15499 (57ce8e1a, an ancestor of v0.32.0's c2bcbecd)


def is_ltx25(config: dict) -> bool:
    """An LTX-2.5 file's config: the one with the keyframe embedding (as ComfyUI tells them apart)."""
    return bool(config.get("use_keyframes_abs_pos_embedding"))


def keyframe_mask(coords: torch.Tensor, guides: int, slots, keep: torch.Tensor | None, tokens_per_frame: int,
                  tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, N, 1] in `dtype`: 1 on the video tokens ComfyUI's keyframes_abs_pos_mask marks, 0 elsewhere. coords: the
    sequence's (start, end) coordinates [n, 3, N, 2] as the forward gives them to the model (time already / fps, so a
    start of 0 is the first latent frame's, the guides' at their own positions); guides: the sequence's last `guides`
    tokens are LTXVAddGuide's; slots: (first latent frame, frames) of generated keyframes, or None; keep: the kept
    tokens' indexes among the video latent's `tokens` (None: all kept)."""
    mask = coords[:, 0, :, 0] == 0
    if guides:
        mask[:, -guides:] = False
    if slots is not None:
        first, count = slots
        marked = torch.zeros(tokens, dtype=torch.bool, device=mask.device)
        marked[first * tokens_per_frame:(first + count) * tokens_per_frame] = True
        mask = mask | (marked if keep is None else marked.index_select(0, keep))
    return mask.unsqueeze(-1).to(dtype)


def generated_slots(generated: dict, tokens_per_frame: int, rows: int) -> torch.Tensor:
    """A `generated_keyframes` entry as the call's extra [rows, 2] float64 (first latent frame, frames); ValueError in
    ComfyUI's words where it was recorded at another size (model.py:1200-1205)."""
    if generated["tokens_per_frame"] != tokens_per_frame:
        raise ValueError(f"the generated keyframes were recorded at {generated['tokens_per_frame']} tokens per latent "
                         f"frame but this latent has {tokens_per_frame}: separate the generated keyframes before "
                         f"upscaling the latent")
    slot = [float(generated["first_latent_frame"]), float(generated["num_keyframes"])]
    return torch.tensor([slot], dtype=torch.float64).expand(rows, -1)
