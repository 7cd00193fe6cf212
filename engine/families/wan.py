"""Wan 2.1 and Wan 2.2 (video DiTs: 1.3B and 14B text-to-video, 14B image-to-video and first-last-frame, the A14B
experts, TI2V-5B): how the engine runs this family (its checkpoints' dims, layout and detection: wan_layout.py).

ComfyUI's conventions, read from ComfyUI 0.3.64 and 0.33.0 (the same in both unless said; file and line in
docs/families/wan.md):
- comfy/model_detection.py: a file with `head.modulation` is Wan: width from it, heads = width / 128, FFN width,
  blocks, input channels from the patch embedding, output channels from the head; `img_emb.proj.0.bias` makes it an
  image-to-video model (CLIP-vision tokens through an MLP, their own K/V in cross-attention), `img_emb.emb_pos` a
  first-last-frame one; patch (1, 2, 2), eps 1e-6, q/k RMSNorm over the whole width, affine norm before the
  cross-attention.
- comfy/supported_models.py: WAN21_T2V (any "t2v" file, Wan 2.2 A14B's experts included: the A14B image-to-video
  experts are "t2v" files with 36 input channels), WAN21_I2V (img_emb, 36 channels), WAN22_T2V (48 output channels:
  TI2V-5B); model sampling discrete flow, shift 8, multiplier 1000 (the model gets sigma x 1000); latent format Wan21
  (16 channels, 8x spatial, 4x temporal) or, for TI2V-5B, Wan22 (48 channels, 16x spatial).
- comfy/model_base.py WAN21: c_concat (concat_cond) = [4 mask channels, the image latent process_in'd], the mask being
  1 - concat_mask (its channel mean unless it has 4), repeated to 4 channels; clip_fea = clip_vision_output's
  penultimate hidden states; WAN22 (TI2V-5B): under a noise mask the timestep becomes one value per latent frame,
  sigma x 1000 x the frame's mask mean (process_timestep), and the masked-out latent enters the model clean
  (scale_latent_inpaint).
- comfy/ldm/wan/model.py: the latent padded circularly to whole 2x2 patches; 3D RoPE over (frame, row, column), head
  dims d - 4(d/6), 2(d/6), 2(d/6), theta 10000, positions 0.. over the padded grid; time embedding [cos, sin] of
  t x 10000^(-k/128) in float32, then time_embedding and time_projection (6 modulations per block, 2 for the head);
  a per-frame timestep gives each latent frame's tokens their frame's modulation (repeat_e); the text context is the
  CONDITIONING as it is (umT5's 512 tokens or more, zero-padded by the tokenizer); image context tokens
  (clip_fea.shape[-2] of them) precede the text, attended with their own K/V and added.
The unmodified diffusers WanTransformer3DModel computes all of this: its RoPE table equals ComfyUI's (positions from
0, float64 angles), its modules and their order are ComfyUI's. The engine supplies ComfyUI's float32 sinusoid (diffusers
rounds its frequencies differently), a per-token timestep built from ComfyUI's per-frame one, the first-last-frame
position embedding added as ComfyUI adds it, and an attention processor that takes the image-context length per forward
(diffusers assumes exactly 512 text tokens behind the image tokens).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import Family, Marker, StockJob, TokenTable, forward_hook, pre_hook
from .qwen_image import WAN21_MEAN, WAN21_STD
from . import wan_animate2 as animate2
from .wan_layout import CLIP_TOKENS, DIMS, FREQ_DIM, WanDims, dims_of, infer, key_map, shapes  # noqa: F401 (read here)

SHIFT = 8.0             # supported_models.WAN21_T2V.sampling_settings
TEXT_TOKENS = 512       # umT5's tokenizer pads to at least this (comfy/text_encoders/wan.py min_length)
MASK_CHANNELS = 4       # model_base.WAN21.concat_cond: the mask's channels before the image latent

WAN22_MEAN = (-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
              -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
              -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
              -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
              -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
              0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_STD = (0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
             0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
             0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
             0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
             0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
             0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)
WAN21 = LatentFormat("Wan21", channels=16, mean=WAN21_MEAN, std=WAN21_STD, spatial_dims=3, temporal_downscale=4)
WAN22 = LatentFormat("Wan22", channels=48, mean=WAN22_MEAN, std=WAN22_STD, spatial_dims=3, downscale=16,
                     temporal_downscale=4)
# ---- ComfyUI's conditioning: c_concat and the per-frame timestep -----------------------------------------------------
def concat_cond(flow, side, denoise_mask: torch.Tensor | None) -> torch.Tensor | None:
    """ComfyUI's c_concat for one side (model_base.WAN21.concat_cond), float32 [B|1, extra, F, h, w]: the mask's 4
    channels (1 - concat_mask, or 1 - the noise mask without one; zeros without either), then the image latent
    process_in'd per 16 channels. None when the model takes no extra channels. The image latent is at the latent's
    size (the request checks it), so ComfyUI's bilinear resize is the identity."""
    config = flow.model.config
    extra = config.in_channels - config.out_channels if config.in_channels != config.out_channels else 0
    if not extra:
        return None
    if side.concat_latent is None:
        raise ValueError("this Wan image-to-video model needs the image latent (concat_latent_image): connect "
                         "WanImageToVideo's conditioning")
    image = side.concat_latent.to(flow.device, torch.float32)
    fmt = flow.loaded.info.latent
    image = torch.cat([fmt.process_in(image[:, i:i + fmt.channels]) for i in range(0, image.shape[1], fmt.channels)],
                      dim=1)[:, :extra - MASK_CHANNELS]
    mask = side.concat_mask if side.concat_mask is not None else denoise_mask
    if mask is None:
        mask = image.new_zeros(image.shape[0], MASK_CHANNELS, *image.shape[2:])
    else:
        mask = mask.to(image.device, torch.float32)
        if mask.shape[1] != MASK_CHANNELS:
            mask = mask.mean(dim=1, keepdim=True)
        mask = 1.0 - mask
        if mask.shape[2] < image.shape[2]:   # later frames: nothing known
            mask = F.pad(mask, (0, 0, 0, 0, 0, image.shape[2] - mask.shape[2]))
        if mask.shape[1] == 1:
            mask = mask.repeat(1, MASK_CHANNELS, 1, 1, 1)
    if mask.shape[0] != image.shape[0]:
        mask, image = (t.expand(max(mask.shape[0], image.shape[0]), *t.shape[1:]) for t in (mask, image))
    return torch.cat([mask, image], dim=1)


def process_timestep(config: dict, timestep: torch.Tensor, denoise_mask: torch.Tensor) -> torch.Tensor:
    """TI2V-5B (ComfyUI's WAN22) under a noise mask: one timestep per latent frame, [n, F], each the model timestep
    times the frame's mask mean (over channels, rows and columns); the other Wan models' timestep is left alone."""
    if config["out_channels"] != 48:
        return timestep
    return (denoise_mask.float().mean(dim=(1, 3, 4)) * timestep.reshape(-1, 1)).reshape(timestep.shape[0], -1)


# ---- the one forward -------------------------------------------------------------------------------------------------
def sinusoid(t: torch.Tensor, dim: int = FREQ_DIM) -> torch.Tensor:
    """ComfyUI's sinusoidal_embedding_1d: [cos, sin] of t x 10000^(-k/half) in float32."""
    half = dim // 2
    position = t.to(torch.float32)
    angles = torch.outer(position, torch.pow(10000, -torch.arange(half, device=t.device).to(position).div(half)))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


@contextlib.contextmanager
def embedding_in_comfys_sinusoid(embedder, dtype: torch.dtype):
    """For one forward: the time embedding takes ComfyUI's float32 sinusoid, cast to the compute dtype as ComfyUI
    casts it (diffusers casts it to its first weight's dtype, which in an fp8 or GGUF file is fp8 or GGUF bytes)."""
    made = {}

    def made_here(module, args, out):
        made["sinusoid"] = sinusoid(args[0], module.num_channels)
        return made["sinusoid"]
    with forward_hook(embedder.timesteps_proj, made_here), \
            pre_hook(embedder.time_embedder,
                     lambda module, args: (made["sinusoid"].reshape(args[0].shape).to(dtype),) + args[1:]):
        yield


def pad_to_patches(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's pad_to_patch_size for (1, 2, 2) patches: circular padding at the bottom and right."""
    ph, pw = x.shape[-2] % 2, x.shape[-1] % 2
    return F.pad(x, (0, pw, 0, ph, 0, 0), mode="circular") if ph or pw else x


def embed_image(embedder, clip: torch.Tensor) -> torch.Tensor:
    """ComfyUI's MLPProj with a first-last-frame position embedding: the first emb_pos tokens of the CLIP features
    plus as much of emb_pos as there are tokens (one image's 257, or both images' 514), then the projection."""
    pos = embedder.pos_embed
    clip = clip[:, :pos.shape[1]] + pos[:, :clip.shape[1]].to(clip.dtype)
    return embedder.norm2(embedder.ff(embedder.norm1(clip)))


def image_tokens(config, image: torch.Tensor | None) -> int:
    """The image-context tokens the cross-attention sees for CLIP features `image` (0: none)."""
    if image is None or config.image_dim is None:
        return 0
    return min(image.shape[1], config.pos_embed_seq_len or image.shape[1])


def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, in_channels, F, h, w] (model space, c_concat attached, compute dtype) at ComfyUI's model timestep
    (float32 sigma x 1000: [n], or [n, F] per latent frame): one call of the unmodified WanTransformer3DModel."""
    model, config = flow.model, flow.model.config
    extras = prepared.extras or {}
    processors = list({id(p): p for p in model.attn_processors.values()}.values())
    if flow.loaded.info.variant == animate2.ANIMATE2:
        if extras.get("pose_latents") is not None or animate2.strength(extras, "reference_strength") != 1.0:
            return animate2.animate_forward(flow, x, timestep, prepared, processors, pad_to_patches,
                                            embedding_in_comfys_sinusoid)
    elif extras:
        raise ValueError(f"this {flow.loaded.info.variant} file got Wan-Animate 2's inputs ({', '.join(sorted(extras))}): "
                         f"ComfyUI takes a file as Wan-Animate 2 only when its header says so (model_type animate2)")
    frames, h, w = x.shape[2:]
    x = pad_to_patches(x)
    if timestep.ndim == 2:   # ComfyUI's per-frame modulation -> diffusers' per-token timestep, frame by frame
        if timestep.shape[1] != frames:
            raise ValueError(f"timestep of shape {list(timestep.shape)} has {timestep.shape[1]} values per item for a "
                             f"latent of {frames} frames: give one per latent frame")
        timestep = timestep.repeat_interleave((x.shape[-2] // 2) * (x.shape[-1] // 2), dim=1)
    image = prepared.image_context
    if config.image_dim is not None and image is None:
        raise ValueError("this Wan image-to-video model needs CLIP-vision features (clip_vision_output): connect "
                         "CLIPVisionEncode to WanImageToVideo")
    if config.image_dim is None:
        image = None   # ComfyUI's model without an image projection ignores clip_fea
    for processor in processors:
        processor.image_tokens = image_tokens(config, image)
    with contextlib.ExitStack() as stack:
        stack.enter_context(embedding_in_comfys_sinusoid(model.condition_embedder, flow.dtype))
        if image is not None and config.pos_embed_seq_len:   # diffusers' view(-1, 514) is not ComfyUI's addition
            embedded = image
            stack.enter_context(forward_hook(model.condition_embedder, lambda module, args, out: out[:3] + (
                embed_image(module.image_embedder, embedded),)))
            image = None
        out = model(hidden_states=x, timestep=timestep, encoder_hidden_states=prepared.cond,
                    encoder_hidden_states_image=image, return_dict=False)[0]
    return out[:, :, :frames, :h, :w]


# ---- attention: one processor for self- and cross-attention, local or sequence parallel -----------------------------
class WanProcessor:
    """What diffusers' WanAttnProcessor computes, with two differences: the image-context tokens at the front of the
    cross-attention context number `image_tokens` (set per forward; diffusers takes all but the last 512), and the
    self-attention goes through the sequence-parallel entry point when one is given. Cross-attention is always local:
    each rank's query tokens attend to the whole text (and image) context, which every rank holds."""

    def __init__(self, attention=None):
        self.attention = attention
        self.image_tokens = 0
        self.animate = None   # Wan-Animate 2's sequence this forward (wan_animate2.AnimateLayout), else None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("Wan attention takes no attention mask (ComfyUI uses none)")
        if self.animate is not None and encoder_hidden_states is not None:
            return animate2.cross_rows(self, attn, hidden_states, encoder_hidden_states, self._attend)
        return self._attend(attn, hidden_states, encoder_hidden_states, rotary_emb)

    def _attend(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None):
        cross = encoder_hidden_states is not None
        context = encoder_hidden_states[:, self.image_tokens:] if cross else hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        if cross:
            out = local_attention(q, k, v)
        elif self.animate is not None:   # Wan-Animate 2: both branches' pairs of queries and keys (wan_animate2.py)
            self.animate.block = attn.xdit_block
            out = animate2.local(self.animate, q, k, v) if self.attention is None else \
                self.attention(q, k, v, bias=self.animate)[0]
        elif self.attention is None:
            out = local_attention(q, k, v)
        else:
            out = self.attention(q, k, v)[0]
        out = out.flatten(2, 3).type_as(q)
        if cross and attn.add_k_proj is not None:
            if not self.image_tokens:
                raise ValueError("this Wan image-to-video model got no CLIP-vision features this forward")
            image = encoder_hidden_states[:, :self.image_tokens]
            k_img = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
            v_img = attn.add_v_proj(image).unflatten(2, (attn.heads, -1))
            out = out + local_attention(q, k_img, v_img).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def local_attention(q, k, v):
    """Attention on (batch, tokens, heads, head_dim) tensors, as diffusers' default backend runs it."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan RoPE on interleaved pairs (ComfyUI's apply_rope1 pairs the same channels)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _after_load(model) -> None:
    """The RoPE table (non-persistent buffers, empty when built on the meta device) built again on the weights'
    device, and the processor that takes the image-context length per forward."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    held = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    config = model.config
    model.rope = WanRotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len).to(held)
    model.set_attn_processor(WanProcessor())


def _model_class():
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel


def _comfy_model(config: dict) -> tuple[str, dict]:
    """ComfyUI's supported_models class and unet config for this file (model_detection's)."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    unet = {"image_model": "wan2.1", "model_type": "i2v" if config.get("image_dim") else "t2v", "dim": dim,
            "in_dim": config["in_channels"], "out_dim": config["out_channels"]}
    if config["out_channels"] == 48:
        return "WAN22_T2V", unet
    return ("WAN21_I2V" if config.get("image_dim") else "WAN21_T2V"), unet


def _linear_width(config: dict) -> float:
    """Weights an image token meets per block, in hidden^2: self-attention q, k, v, o; cross-attention q, o (the text's
    k, v are per text token); the FFN up and down."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return 6 + 2 * config["ffn_dim"] / dim


def _describe_conditioning(c: dict) -> str:
    parts = [f"cond [B, N, {c['text_dim']}] (umT5-XXL, 512 tokens or more), no pooled output"]
    if c.get("image_dim"):
        parts.append(f"clip_vision_output [B, {CLIP_TOKENS}{' or 514' if c.get('pos_embed_seq_len') else ''}, "
                     f"{c['image_dim']}] (CLIPVisionEncode)")
    if c["in_channels"] != c["out_channels"]:
        parts.append("concat_latent_image and concat_mask (WanImageToVideo / WanFirstLastFrameToVideo)")
    if c["out_channels"] == 48:
        parts.append("a start image through the LATENT's noise_mask (Wan22ImageToVideoLatent)")
    return "; ".join(parts)


FAMILY = Family(
    name="wan", title="Wan", variants=tuple(DIMS["full"]),
    variant_aliases={"wan2.1-t2v": "wan2.1-1.3b", "wan2.1-i2v": "wan2.1-i2v-14b", "wan2.1-flf2v": "wan2.1-flf2v-14b",
                     "wan2.2-t2v": "wan2.2-a14b", "wan2.2-i2v": "wan2.2-i2v-a14b"},
    markers=(Marker("head.modulation", "wan"), Marker("condition_embedder.time_proj.weight", "diffusers")),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("wan",),
    layers=lambda config: config["num_layers"],
    latent=WAN21, latent_for=lambda config: WAN22 if config["out_channels"] == 48 else WAN21,
    latent_patch=lambda config: 2, pads_to_patches=True, frames=True,
    sampling=lambda variant: FlowSampling.sd3(animate2.SHIFT if variant == animate2.ANIMATE2 else SHIFT),
    comfy_model=_comfy_model,
    cond_width=lambda config: config["text_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    image_context_width=lambda config: config.get("image_dim"),
    concat_channels=lambda config: config["in_channels"] - config["out_channels"],
    concat_cond=concat_cond, process_timestep=process_timestep,
    masked_latent_clean=lambda config: config["out_channels"] == 48,
    forward=forward, cfg=5.0, text_tokens=TEXT_TOKENS,
    extras=animate2.EXTRAS, host_extras=animate2.HOST_EXTRAS,
    comfyui_since=lambda variant: animate2.COMFYUI_SINCE if variant == animate2.ANIMATE2 else "",
    comfy_class=lambda variant: "WAN_Animate2" if variant == animate2.ANIMATE2 else "",
    tiny_metadata=lambda dims: animate2.header() if dims.animate2 else {},
    extra_frames=lambda variant, latent_frames: latent_frames - 1 if variant == animate2.ANIMATE2 else 0,
    extra_token_kind="pose", reference_frames=lambda variant: 1 if variant == animate2.ANIMATE2 else 0,
    stock_jobs={**{v: StockJob("wan2.1-t2v-1.3b", 832, 480, 30, 6.0, frames=33, shift=SHIFT,
                               note="" if v == "wan2.1-1.3b" else "the Wan 2.1 1.3B workflow's values")
                   for v in ("wan2.1-1.3b", "wan2.1-14b", "wan2.1-i2v-14b", "wan2.1-flf2v-14b")},
                "wan2.2-a14b": StockJob("wan2.2-t2v-a14b", 640, 640, 20, 3.5, frames=81, shift=SHIFT),
                "wan2.2-i2v-a14b": StockJob("wan2.2-i2v-a14b", 640, 640, 20, 3.5, frames=81, shift=SHIFT),
                "wan2.2-ti2v-5b": StockJob("wan2.2-ti2v-5b", 1280, 704, 20, 5.0, frames=121, shift=SHIFT),
                # ComfyUI's "Wan Animate 2 Distilled: Motion Transfer" template: the driving video resized to 482x854,
                # 81 frames a segment, SamplerCustom lcm, 10 steps, cfg 1
                animate2.ANIMATE2: StockJob("wan-animate-2", 482, 854, 10, 1.0, frames=81, shift=animate2.SHIFT,
                                            note="the latent also holds the reference image's frame, and the pose "
                                                 "branch's tokens run with the video's")},
    max_latent_side=lambda config: 2 * config["rope_max_seq_len"],
    tokens=TokenTable(processor=WanProcessor, gather_after="proj_out", split_inputs=(("timestep", 1),),
                      split_grid_after=(("patch_embedding", 2),), split_after=(("rope", 0, 1), ("rope", 1, 1)),
                      blocks=("blocks",), kwargs_name="attention_kwargs"),
    linear_width=_linear_width, modulation=("scale_shift_table",),
    native_layout="wan", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load,
    full_extras=("vae.decoder.conv1.weight", "text_encoders.umt5xxl.transformer.shared.weight"),
    describe_blocks=lambda c: f"{c['num_layers']} blocks (self-attention, cross-attention, FFN)",
    describe_conditioning=_describe_conditioning,
)
