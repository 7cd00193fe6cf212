"""ComfyUI's values as the engine takes them: a CONDITIONING's tensors (the text, pooled vector, guidance, reference
latents, image-to-video keys), the COND file `generate --cond` reads, and the engine request a node's inputs make
(`job_request`, not yet validated). Without ComfyUI: its values are plain tensors, lists and dicts."""
from __future__ import annotations

import torch

from ..engine.generate.request import GenerateRequest
from ..engine.sampling.ksampler import StepWindow


def conditioning_tensors(conditioning, name: str) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(cond, pooled, guidance) of a CONDITIONING: a list of [cond_tensor, {"pooled_output": ..., "guidance": ...}]."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{name} is not a CONDITIONING (a list of [tensor, dict]); connect a text encoder to it")
    if len(conditioning) > 1 and any("pose_video_latent" in entry[1] for entry in conditioning):
        raise ValueError(f"{name} carries WanAnimate2ToVideo's pose window (pose_start_percent / pose_end_percent), "
                         f"which the xDiT Sampler's own loop does not run: sample with KSampler on the xDiT Engine's "
                         f"MODEL, or set the window to 0 and 1")
    if len(conditioning) > 1:
        raise ValueError(f"{name} holds {len(conditioning)} conditioning entries (combined or area conditioning); the "
                         f"xDiT Sampler takes exactly one: use a single text encode")
    cond, extras = conditioning[0][0], conditioning[0][1]
    pooled = extras.get("pooled_output")   # None for families without one; the request checks it per family
    unsupported = [k for k in ("area", "mask", "control", "gligen") if extras.get(k) is not None]
    if extras.get("strength", 1.0) != 1.0:
        unsupported.append("strength")
    if (extras.get("start_percent", 0.0), extras.get("end_percent", 1.0)) != (0.0, 1.0):
        unsupported.append("start_percent/end_percent")
    if unsupported:
        raise ValueError(f"{name} carries {', '.join(unsupported)} (area, mask, ControlNet, timestep-range or "
                         f"strength conditioning), which the xDiT Sampler does not support")
    return cond, pooled, extras.get("guidance")


# WanAnimate2ToVideo's conditioning keys (comfy_extras/nodes_wan.py:1339-1366) that ComfyUI's WAN_Animate2 turns into
# the pose branch's inputs (comfy/model_base.py:1833-1853), and the request's fields they become
POSE_KEYS = {"pose_video_latent": "pose_latent", "cross_attn_pose": "pose_cond",
             "clip_vision_output_pose": "pose_clip_vision_output", "pose_strength": "pose_strength",
             "reference_strength": "reference_strength"}


def conditioning_pose(positive, negative=None, clip_state: str = "penultimate_hidden_states") -> dict:
    """Wan-Animate 2's pose inputs of a CONDITIONING (WanAnimate2ToVideo's keys) as the request's fields; with a
    negative pass the negative must carry the same ones (the node sets them on both sides; ComfyUI's model would run a
    negative without them without its pose branch, which the engine's loop does not do apart)."""
    def read(conditioning):
        extras = conditioning[0][1]
        out = {}
        for key, field_name in POSE_KEYS.items():
            value = extras.get(key)
            if value is None:
                continue
            if key == "clip_vision_output_pose":
                value = getattr(value, clip_state, value)
            out[field_name] = float(value) if field_name.endswith("strength") else value
        return out
    fields = read(positive)
    if negative is not None:
        other = read(negative)
        same = set(other) == set(fields) and all(
            torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k] for k, v in fields.items())
        if not same:
            raise ValueError("the positive and negative carry different Wan-Animate 2 pose inputs: connect both from "
                             "WanAnimate2ToVideo's outputs (it sets the same pose values on both)")
    return fields


def conditioning_references(conditioning, name: str) -> tuple[list[torch.Tensor] | None, str]:
    """The raw VAE latents ReferenceLatent (FLUX.1 Kontext, FLUX.2) or TextEncodeQwenImageEdit appended to a
    CONDITIONING checked by conditioning_tensors, and the method FluxKontextMultiReferenceLatentMethod set ("": the
    family's default, as ComfyUI's model has it)."""
    extras = conditioning[0][1]
    refs = extras.get("reference_latents")
    if refs is not None and not isinstance(refs, (list, tuple)):
        raise ValueError(f"{name} has reference_latents of type {type(refs).__name__}: connect ReferenceLatent, "
                         f"which gives a list of latents")
    return (list(refs) if refs is not None else None), extras.get("reference_latents_method") or ""


def conditioning_file(positive, negative=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the COND.safetensors file `generate --cond` reads for these CONDITIONINGs: cond, pooled,
    neg_cond, neg_pooled, ref_0.. and neg_ref_0..; the metadata keeps the guidance and reference method, which the
    command line takes as --guidance and --reference-method."""
    tensors, metadata = {}, {}
    for side, conditioning, prefix in (("positive", positive, ""), ("negative", negative, "neg_")):
        if conditioning is None:
            continue
        cond, pooled, guidance = conditioning_tensors(conditioning, side)
        refs, method = conditioning_references(conditioning, side)
        tensors[f"{prefix}cond"] = cond.detach().to("cpu").contiguous()
        if pooled is not None:
            tensors[f"{prefix}pooled"] = pooled.detach().to("cpu").contiguous()
        for i, r in enumerate(refs or ()):
            tensors[f"{prefix}ref_{i}"] = r.detach().to("cpu").contiguous()
        if guidance is not None and side == "positive":
            metadata["guidance"] = f"{float(guidance):g}"
        if method:
            metadata[f"{prefix}reference_latents_method"] = method
    return tensors, metadata


def conditioning_images(conditioning, prefix: str = "", clip_state: str = "penultimate_hidden_states") -> dict:
    """An image-to-video CONDITIONING's keys (WanImageToVideo, WanFirstLastFrameToVideo, HunyuanVideo15ImageToVideo):
    the CLIP-vision features (the clip_vision_output's field the family's model takes: `clip_state`),
    concat_latent_image and concat_mask, as the request's fields."""
    extras = conditioning[0][1]
    clip = extras.get("clip_vision_output")
    return {prefix + "clip_vision_output": getattr(clip, clip_state, clip),
            prefix + "concat_latent_image": extras.get("concat_latent_image"),
            prefix + "concat_mask": extras.get("concat_mask")}


def job_request(settings, positive, negative, latent_raw: torch.Tensor, *, cfg: float,
                seed: int = 0, steps: int = 1, sampler_name: str = "euler", scheduler: str = "simple",
                denoise: float = 1.0, batch_index=None, window: StepWindow = StepWindow(),
                noise_mask=None, clip_state: str = "penultimate_hidden_states") -> GenerateRequest:
    """The engine request for these settings (core.EngineSettings) and ComfyUI values (not yet validated). The
    negative is read when cfg != 1. window: KSamplerAdvanced's steps and noise. clip_state: the CLIP-vision output's
    field the model takes (Family.clip_vision_state)."""
    cond, pooled, guidance = conditioning_tensors(positive, "positive")
    refs, method = conditioning_references(positive, "positive")
    neg_cond = neg_pooled = neg_refs = None
    neg_method = ""
    images = conditioning_images(positive, clip_state=clip_state)
    if cfg != 1.0:
        neg_cond, neg_pooled, _ = conditioning_tensors(negative, "negative")
        neg_refs, neg_method = conditioning_references(negative, "negative")
        images.update(conditioning_images(negative, "neg_", clip_state))
    images.update(conditioning_pose(positive, negative if cfg != 1.0 else None, clip_state))
    # HunyuanVideo 1.5's byT5 rows of a prompt's quoted text, per side (comfy/model_base.py HunyuanVideo15: txt_byt5)
    images["byt5"] = positive[0][1].get("conditioning_byt5small")
    if cfg != 1.0:
        images["neg_byt5"] = negative[0][1].get("conditioning_byt5small")
    return GenerateRequest(model=settings.model_path, cond=cond, pooled=pooled, latent_raw=latent_raw,
                           seed=int(seed), steps=int(steps), cfg=float(cfg), sampler=sampler_name,
                           scheduler=scheduler, denoise=float(denoise), neg_cond=neg_cond, neg_pooled=neg_pooled,
                           guidance=3.5 if guidance is None else float(guidance), dtype=settings.compute_dtype,
                           fp8_weights=settings.weight_dtype == "fp8_e4m3fn",
                           batch_index=list(batch_index) if batch_index is not None else None,
                           loras=list(settings.loras), plan=settings.requested_plan(),
                           cache_threshold=settings.cache_threshold, compile=settings.compile,
                           attention=settings.attention,
                           patches=(settings.patches or None) if settings.pipefusion > 1 else None,
                           warmup_steps=min(settings.warmup_steps, int(steps)),
                           reference_latents=refs, reference_latents_method=method,
                           neg_reference_latents=neg_refs, neg_reference_latents_method=neg_method,
                           model_sampling=settings.model_sampling, cfg_norm=settings.cfg_norm, noise_mask=noise_mask,
                           expert_placement=settings.expert_placement,
                           start_step=window.start_step, last_step=window.last_step,
                           force_full_denoise=window.force_full_denoise, add_noise=window.add_noise, **images)
