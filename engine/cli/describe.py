"""What a FLUX/SD3 checkpoint is and what it takes, in the words `demo` and `make-tiny` print."""
from __future__ import annotations

import torch

from ..models.detect import CheckpointInfo

LAYOUTS = {"bfl": "BFL", "sai": "SAI MMDiT", "diffusers": "diffusers", "synthetic": "synthetic"}
CLIP_TOKENS = 77  # SD3's CLIP-L+G tokens, padded to the T5 width and put before T5's


def blocks(info: CheckpointInfo) -> str:
    c = info.config
    if info.family == "flux":
        return f"{c['num_layers']} double + {c['num_single_layers']} single blocks"
    return f"{c['num_layers']} joint blocks"


def summary(info: CheckpointInfo) -> str:
    """e.g. "flux-dev, BFL layout: hidden 128, 4 heads x 32, 4 double + 4 single blocks"."""
    c = info.config
    return (f"{info.variant}, {LAYOUTS.get(info.layout, info.layout)} layout: hidden "
            f"{c['num_attention_heads'] * c['attention_head_dim']}, {info.heads} heads x {c['attention_head_dim']}, "
            f"{blocks(info)}")


def conditioning(info: CheckpointInfo) -> str:
    """The CONDITIONING tensors the model takes, as ComfyUI's text encoders give them."""
    c = info.config
    width, pooled = c["joint_attention_dim"], c["pooled_projection_dim"]
    if info.family == "flux":
        guidance = "; guidance embedded (FluxGuidance)" if c.get("guidance_embeds") else "; no guidance input"
        return f"cond [B, N, {width}] (T5-XXL), pooled [B, {pooled}] (CLIP-L){guidance}"
    return (f"cond [B, {CLIP_TOKENS}+N, {width}] (CLIP-L+G padded to {width}, then T5-XXL), pooled [B, {pooled}] "
            f"(CLIP-L+G)")


def latent_rule(info: CheckpointInfo) -> str:
    """The LATENT the model samples, and the image sizes it takes."""
    rule = "[B, 16, H/8, W/8] for a W x H image, W and H multiples of 16 px (raw VAE space)"
    if info.family == "sd3":  # the position embedding is cropped from a fixed grid
        grid = info.config["pos_embed_max_size"]
        rule += f", at most {grid * info.config['patch_size'] * 8} px a side (position grid {grid}x{grid})"
    return rule


def cond_tensors(info: CheckpointInfo, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (cond, pooled) shaped as this model takes them, batch 1, with `tokens` T5 tokens."""
    c = info.config
    n = tokens + (CLIP_TOKENS if info.family == "sd3" else 0)
    return (torch.randn(1, n, c["joint_attention_dim"], generator=generator),
            torch.randn(1, c["pooled_projection_dim"], generator=generator))
