"""What a checkpoint is and what it takes, in the words `demo` and `make-tiny` print (each family says its part)."""
from __future__ import annotations

import torch

from ..models.detect import CheckpointInfo

LAYOUTS = {"bfl": "BFL", "sai": "SAI MMDiT", "minimax": "ComfyUI (Comfy-Org)", "diffusers": "diffusers", "synthetic": "synthetic"}


def blocks(info: CheckpointInfo) -> str:
    return info.spec.describe_blocks(info.config)


def summary(info: CheckpointInfo) -> str:
    """e.g. "flux-dev, BFL layout: hidden 128, 4 heads x 32, 4 double + 4 single blocks"."""
    c = info.config
    hidden = c.get("hidden_size") or c["num_attention_heads"] * c["attention_head_dim"]
    return (f"{info.variant}, {LAYOUTS.get(info.layout, info.layout)} layout: hidden "
            f"{hidden}, {info.heads} heads x {c['attention_head_dim']}, "
            f"{blocks(info)}")


def conditioning(info: CheckpointInfo) -> str:
    """The CONDITIONING tensors the model takes, as ComfyUI's text encoders give them."""
    return info.spec.describe_conditioning(info.config)


def latent_rule(info: CheckpointInfo) -> str:
    """The LATENT the model samples, and the image sizes it takes."""
    fmt = info.latent
    video = f", {fmt.frames_formula()}" if info.spec.frames else ""
    rule = (f"{fmt.shape_rule(info.spec.frames)} for a W x H {'video' if video else 'image'}{video}, W and H "
            f"multiples of {info.latent_patch * fmt.downscale} px (raw VAE space)")
    side = info.spec.max_latent_side(info.config)
    if side:  # the position embedding is cropped from a fixed grid
        rule += f", at most {side * fmt.downscale} px a side (position grid {side // info.latent_patch})"
    return rule


def cond_tensors(info: CheckpointInfo, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                                         torch.Tensor | None]:
    """Random (cond, pooled or None) shaped as this model takes them, batch 1, with `tokens` text tokens."""
    pooled = info.spec.pooled_width(info.config)
    return (torch.randn(1, tokens, info.spec.cond_width(info.config), generator=generator),
            torch.randn(1, pooled, generator=generator) if pooled else None)


def conditioning_file(info: CheckpointInfo, width: int, height: int, frames: int = 1, tokens: int = 32,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """Random conditioning `generate --cond` reads for this model (engine/cli/generate.py): cond and pooled where
    the family has one, their negatives for cfg != 1, and an image-to-video model's CLIP-vision features and image
    latent for a width x height video of `frames` frames."""
    from ..generate.request import empty_latent

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for side in ("", "neg_"):
        cond, pooled = cond_tensors(info, tokens, gen)
        tensors[side + "cond"] = cond
        if pooled is not None:
            tensors[side + "pooled"] = pooled
        clip = info.spec.image_context_width(info.config)
        if clip:   # CLIPVisionEncode's penultimate hidden states: 257 tokens
            tensors[side + "clip_vision_output"] = torch.randn(1, 257, clip, generator=gen)
        if info.spec.concat_channels(info.config):   # the image's VAE latent, at the latent's size
            tensors[side + "concat_latent_image"] = 0.5 * torch.randn(empty_latent(info, width, height, 1,
                                                                                   frames).shape, generator=gen)
    return tensors
