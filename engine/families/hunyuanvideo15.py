"""HunyuanVideo 1.5 (8.3 B, double-stream blocks only, text- and image-to-video): how the engine runs this family (its
checkpoints' dims, layouts and detection: hunyuanvideo15_layout.py).

ComfyUI's conventions, read from ComfyUI 0.33.0 (file and line in docs/families/hunyuanvideo-1.5.md):
- comfy/model_detection.py: `txt_in.individual_token_refiner.blocks.0.norm1.weight` makes a file HunyuanVideo; width and
  input channels from img_in's kernel, the patch (1, 1, 1) from its shape, output channels from final_layer, heads at
  128 wide, the text width from txt_in's input_embedder, RoPE axes (16, 56, 56) at theta 256, a byT5 mapper, condition
  type embeddings and a vision projection (`vision_in`, 1152 wide: supported_models.HunyuanVideo15) from their keys.
  The files carry ComfyUI's module names or the HunyuanVideo names supported_models.HunyuanVideo.process_unet_state_dict
  renames as it loads (`img_attn_qkv`, `img_mod.linear`, `mlp.fc1`, ...): both are read as they are.
- comfy/supported_models.py HunyuanVideo15: model type FLOW (ModelSamplingDiscreteFlow: timestep = 1000 sigma), shift
  7.0; latent format HunyuanVideo15 (comfy/latent_formats.py): 32 channels, 16x spatial and 4x temporal, scale 1.03682,
  no shift: EmptyHunyuanVideo15Latent's zeros [B, 32, (frames - 1) // 4 + 1, H/16, W/16], which KSampler samples.
- comfy/model_base.py HunyuanVideo15.concat_cond: the input is [noise | image latent | mask], 65 channels: the image
  latent (concat_latent_image) process_in'd, zeros without one (text-to-video too); the mask 1 - concat_mask (or 1 -
  the noise mask), zeros without either. extra_conds: the Qwen2.5-VL text (cross_attn), byT5's glyph rows
  (conditioning_byt5small, only for prompts with quoted text) as txt_byt5, and clip_fea = the CLIP-vision output's
  last_hidden_state (SigLIP, image-to-video); a text attention mask only when it masks something (one prompt: none).
  HunyuanVideo.scale_latent_inpaint: under a noise mask the masked-out latent enters the model as it is.
- comfy/ldm/hunyuan_video/model.py: the text through the token refiner, pooled by a plain mean over all its rows (not a
  masked mean), with the timestep; condition-type embeddings 0/1/2 on text, byT5 and vision rows; the text stream
  [vision | byT5 | text], all at position (0, 0, 0); the video's tokens at (frame, row, column) from 0; EmbedND's
  float64 angles; q/k RMSNorm with torch's default eps (F.rms_norm(eps=None): the input dtype's epsilon); the
  timestep embedded as [cos, sin] of t x 10000^(-k/128) in float32, cast to the compute dtype.
The unmodified diffusers HunyuanVideo15Transformer3DModel computes all of this given every row valid (no text mask,
the vision and byT5 rows present only when ComfyUI has them: empty otherwise, where diffusers' own pipeline pads them
and masks the padding). The engine supplies ComfyUI's float64 RoPE table, its RMSNorm epsilon and an attention
processor that never builds diffusers' [tokens x tokens] mask (every row is valid) and takes the sequence-parallel
entry point, the video's tokens split and the text joint (held whole by every rank).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import Family, Marker, StockJob, TokenTable, forward_hook, pre_hook
from .hunyuanvideo15_layout import AXES, DIMS, THETA, infer, key_map, shapes

SHIFT = 7.0           # supported_models.HunyuanVideo15.sampling_settings
TEXT_TOKENS = 256     # a typical prompt's Qwen2.5-VL tokens after the template is cut off (the planner's)
MASK_CHANNELS = 1     # model_base.HunyuanVideo15.concat_cond: the mask's one channel after the image latent
TEXT_ENCODER = ("Qwen2.5-VL 7B and byT5 (DualCLIPLoader type hunyuan_video_15 with qwen_2.5_vl_7b_fp8_scaled and "
                "byt5_small_glyphxl_fp16)")
LATENT = LatentFormat("HunyuanVideo15", channels=32, scale_factor=1.03682, spatial_dims=3, downscale=16,
                      temporal_downscale=4)


# ---- ComfyUI's conditioning: c_concat --------------------------------------------------------------------------------
def concat_cond(flow, side, denoise_mask: torch.Tensor | None) -> torch.Tensor | None:
    """ComfyUI's c_concat for one side (model_base.HunyuanVideo15.concat_cond), float32 [B|1, 33, F, h, w]: the image
    latent process_in'd (zeros without one), then the mask's channel, 1 - concat_mask (or 1 - the noise mask; zeros
    without either; later frames zero). None when the side has neither image nor mask: the forward attaches ComfyUI's
    zeros at the latent's size. The image latent is at the latent's size (the request checks it), so ComfyUI's
    bilinear resize is the identity."""
    config = flow.model.config
    fmt = flow.loaded.info.latent
    image = side.concat_latent
    mask = side.concat_mask if side.concat_mask is not None else denoise_mask
    if image is None and mask is None:
        return None
    if mask is not None:
        mask = mask.to(flow.device, torch.float32)
        if mask.shape[1] != MASK_CHANNELS:
            raise ValueError(f"concat_mask of {mask.shape[1]} channels: HunyuanVideo 1.5 takes one "
                             f"(HunyuanVideo15ImageToVideo's)")
        mask = 1.0 - mask
    if image is None:   # a mask alone: the image latent's zeros at its size
        image = mask.new_zeros(mask.shape[0], config.out_channels, *mask.shape[2:])
    else:
        image = image.to(flow.device, torch.float32)
        image = torch.cat([fmt.process_in(image[:, i:i + fmt.channels]) for i in range(0, image.shape[1],
                                                                                          fmt.channels)], dim=1)
    if mask is None:
        mask = image.new_zeros(image.shape[0], MASK_CHANNELS, *image.shape[2:])
    elif mask.shape[2] < image.shape[2]:   # later frames: padded with zeros, as ComfyUI pads them
        mask = F.pad(mask, (0, 0, 0, 0, 0, image.shape[2] - mask.shape[2]))
    if mask.shape[0] != image.shape[0]:
        mask, image = (t.expand(max(mask.shape[0], image.shape[0]), *t.shape[1:]) for t in (mask, image))
    return torch.cat([image, mask], dim=1)


# ---- positions and the one forward -----------------------------------------------------------------------------------
ROPE_TABLES = 4   # the RoPE tables a model keeps on its device, one per latent grid (the oldest let go)


def rope_for(model, frames: int, rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_table for this grid on `device`, built once and kept with the model (a clip's calls share one grid)."""
    kept = model.__dict__.setdefault("_xdit_rope", {})
    key = (frames, rows, cols, str(device))
    if key not in kept:
        while len(kept) >= ROPE_TABLES:
            kept.pop(next(iter(kept)))
        kept[key] = rope_table(frames, rows, cols, device)
    return kept[key]


def rope_table(frames: int, rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's EmbedND for the video's tokens at (frame, row, column), in diffusers' form: (cos, sin) [tokens, 128],
    each frequency on two channels; per axis omega = 1 / 256^linspace(0, (d - 2)/d, d/2) and the angles in float64."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij"))
    positions = grid.reshape(3, -1).to(torch.float64)
    cos, sin = [], []
    for axis, d in enumerate(AXES):
        omega = 1.0 / THETA ** torch.linspace(0, (d - 2) / d, d // 2, dtype=torch.float64)
        angles = positions[axis][:, None] * omega[None]
        cos.append(angles.cos().to(torch.float32).repeat_interleave(2, dim=1))
        sin.append(angles.sin().to(torch.float32).repeat_interleave(2, dim=1))
    return torch.cat(cos, dim=1).to(device), torch.cat(sin, dim=1).to(device)


def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 65 (or 32), F, h, w] (model space, compute dtype; c_concat attached, else ComfyUI's zeros are) at
    ComfyUI's model timestep (float32 sigma x 1000, [n]): one call of the unmodified HunyuanVideo15Transformer3DModel
    with every text, byT5 and vision row valid."""
    model, config = flow.model, flow.model.config
    n, channels, frames, h, w = x.shape
    if channels == config.out_channels:   # no image and no mask: ComfyUI's c_concat is zeros
        x = torch.cat([x, x.new_zeros(n, config.in_channels - channels, frames, h, w)], dim=1)
    elif channels != config.in_channels:
        raise ValueError(f"a latent of {channels} channels: HunyuanVideo 1.5 takes {config.out_channels} (with "
                         f"{config.in_channels - config.out_channels} more of c_concat attached)")
    text = prepared.cond
    byt5 = (prepared.extras or {}).get("txt_byt5")
    byt5 = (byt5.to(x.dtype) if byt5 is not None else x.new_zeros(n, 0, config.text_embed_2_dim))
    vision = prepared.image_context
    vision = vision.to(x.dtype) if vision is not None else x.new_zeros(n, 0, config.image_embed_dim)
    if byt5.shape[-1] != config.text_embed_2_dim or text.shape[-1] != config.text_embed_dim:
        raise ValueError(f"HunyuanVideo 1.5 takes text [B, N, {config.text_embed_dim}] (Qwen2.5-VL) and byT5 rows "
                         f"[B, N, {config.text_embed_2_dim}], not {text.shape[-1]} and {byt5.shape[-1]} features: "
                         f"encode the prompt with DualCLIPLoader type hunyuan_video_15")
    rope = rope_for(model, frames, h, w, x.device)
    with contextlib.ExitStack() as stack:
        # ComfyUI casts the timestep's sinusoid to the compute dtype before time_in (diffusers to the timestep's)
        stack.enter_context(pre_hook(model.time_embed.timestep_embedder,
                                     lambda module, args: (args[0].to(x.dtype),) + args[1:]))
        stack.enter_context(forward_hook(model.rope, lambda module, args, out: rope, prepend=True))
        out = model(hidden_states=x, timestep=timestep, encoder_hidden_states=text,
                    encoder_attention_mask=text.new_ones(text.shape[:2], dtype=torch.bool),
                    encoder_hidden_states_2=byt5, encoder_attention_mask_2=byt5.new_ones(byt5.shape[:2],
                                                                                         dtype=torch.bool),
                    image_embeds=vision, return_dict=False)[0]
    return out


# ---- attention: the blocks' local or sequence parallel, the token refiner's local ------------------------------------
def rms(t: torch.Tensor, norm) -> torch.Tensor:
    """ComfyUI's QKNorm: torch's RMSNorm at its default epsilon (the input dtype's), the scale in the input's dtype."""
    return F.rms_norm(t, (t.shape[-1],), norm.weight.to(t.dtype), eps=None)


class HunyuanVideo15Processor:
    """What diffusers' HunyuanVideo15AttnProcessor2_0 computes for a double block (q/k RMSNorm, RoPE on the video's
    tokens, one attention over video and text), with ComfyUI's RMSNorm epsilon and no mask (every row the family
    gives is valid), through the sequence-parallel entry point when one is given: the video's tokens this rank's
    shard, the text joint. The token refiner's attention (marked `xdit_local` at load: every rank holds its whole
    text) goes through diffusers' own processor."""

    def __init__(self, attention=None):
        from diffusers.models.attention_processor import AttnProcessor2_0
        from diffusers.models.embeddings import apply_rotary_emb
        self.attention, self.local, self.rotary = attention, AttnProcessor2_0(), apply_rotary_emb

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if getattr(attn, "xdit_local", False):
            return self.local(attn, hidden_states, encoder_hidden_states, attention_mask)
        heads = (attn.heads, -1)
        q, k, v = (attn.to_q(hidden_states).unflatten(2, heads), attn.to_k(hidden_states).unflatten(2, heads),
                   attn.to_v(hidden_states).unflatten(2, heads))
        q, k = rms(q, attn.norm_q), rms(k, attn.norm_k)
        if image_rotary_emb is not None:
            q = self.rotary(q, image_rotary_emb, sequence_dim=1)
            k = self.rotary(k, image_rotary_emb, sequence_dim=1)
        text = encoder_hidden_states
        tq, tk, tv = (attn.add_q_proj(text).unflatten(2, heads), attn.add_k_proj(text).unflatten(2, heads),
                      attn.add_v_proj(text).unflatten(2, heads))
        tq, tk = rms(tq, attn.norm_added_q), rms(tk, attn.norm_added_k)
        if self.attention is None:
            out = local_attention(torch.cat([q, tq], dim=1), torch.cat([k, tk], dim=1), torch.cat([v, tv], dim=1))
            video, text_out = out[:, :q.shape[1]], out[:, q.shape[1]:]
        else:
            video, text_out = self.attention(q, k, v, joint=(tq, tk, tv))
        video, text_out = video.flatten(2, 3).to(q.dtype), text_out.flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text_out)


def local_attention(q, k, v):
    """Attention on (batch, tokens, heads, head_dim) tensors, as diffusers' default backend runs it."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _after_load(model) -> None:
    """The processor that builds no mask, on every attention; the token refiner's marked local (its text is whole on
    every rank under every plan)."""
    model.set_attn_processor(HunyuanVideo15Processor())
    for block in model.context_embedder.token_refiner.refiner_blocks:
        block.attn.xdit_local = True


def _model_class():
    from diffusers import HunyuanVideo15Transformer3DModel
    return HunyuanVideo15Transformer3DModel


def _linear_width(config: dict) -> float:
    """Weights a video token meets per block, in hidden^2: q, k, v, o and the MLP's two matrices."""
    return 4 + 2 * config["mlp_ratio"]


FAMILY = Family(
    name="hunyuanvideo15", title="HunyuanVideo 1.5", variants=("hunyuanvideo-1.5",),
    variant_aliases={"hunyuanvideo1.5": "hunyuanvideo-1.5", "hunyuan-video-1.5": "hunyuanvideo-1.5",
                     "hunyuanvideo15": "hunyuanvideo-1.5", "hv15": "hunyuanvideo-1.5"},
    markers=(Marker("cond_type_embedding.weight", "hunyuan", absent=("double_blocks.0.img_attn.qkv.weight",)),
             Marker("cond_type_embedding.weight", "comfy")),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("hyvid",),
    layers=lambda config: config["num_layers"],
    latent=LATENT, latent_patch=lambda config: 1, frames=True,
    sampling=lambda variant: FlowSampling.sd3(SHIFT),
    comfy_model=lambda config: ("HunyuanVideo15", {"image_model": "hunyuan_video", "vision_in_dim":
                                                   config["image_embed_dim"]}),
    cond_width=lambda config: config["text_embed_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    image_context_width=lambda config: config["image_embed_dim"],
    concat_channels=lambda config: config["in_channels"] - config["out_channels"],
    concat_cond=concat_cond, image_inputs_optional=True, clip_vision_state="last_hidden_state",
    masked_latent_clean=lambda config: True,
    extras=("txt_byt5",),
    forward=forward, cfg=6.0, text_tokens=TEXT_TOKENS,
    stock_jobs={"hunyuanvideo-1.5": StockJob("hunyuanvideo-1.5-t2v", 1280, 720, 20, 6.0, frames=121, shift=SHIFT,
                                             note="the 720p text-to-video template's first pass (its 1080p "
                                                  "super-resolution pass is another model)")},
    # the video's tokens split right after the patch embedding with their RoPE rows (padded where the degree does not
    # divide them), gathered after the output projection; the text stream held whole by every rank
    tokens=TokenTable(processor=HunyuanVideo15Processor, gather_after="proj_out",
                      split_after=(("x_embedder", None, 1), ("rope", 0, 0), ("rope", 1, 0)),
                      blocks=("transformer_blocks",), kwargs_name="attention_kwargs"),
    text_splits=False, text_cross=False, linear_width=_linear_width,
    native_layout="comfy", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load,
    full_extras=("vae.decoder.conv_in.conv.weight", "text_encoders.qwen25_7b.transformer.model.embed_tokens.weight"),
    describe_blocks=lambda c: (f"{c['num_layers']} double-stream blocks ({c['num_attention_heads']} heads), a "
                               f"{c['num_refiner_layers']}-block token refiner"),
    describe_conditioning=lambda c: (f"cond [B, N, {c['text_embed_dim']}] (Qwen2.5-VL), no pooled output, no "
                                     f"guidance; byT5 rows [B, M, {c['text_embed_2_dim']}] for quoted text "
                                     f"(txt_byt5); image-to-video: clip_vision_output's last_hidden_state [B, T, "
                                     f"{c['image_embed_dim']}] (SigLIP), concat_latent_image and concat_mask "
                                     f"(HunyuanVideo15ImageToVideo)"),
    text_encoder=lambda variant: TEXT_ENCODER,
    comfyui_since=lambda variant: "0.3.71",
)
