"""Krea 2 (12.8 B, one stream of text and image tokens): how the engine runs this family (its checkpoints' dims,
layout and detection: krea2_layout.py).

ComfyUI's conventions, read from ComfyUI 0.33.0 (file and line in docs/families/krea-2.md):
- comfy/model_detection.py: a file with `txtfusion.projector.weight` is Krea 2; width and input channels from `first`,
  heads and key/value heads from the first block's wq / wk at 128 a head, the tapped text layers from the projector,
  the text width from the first layerwise block's norm; 20 text heads, two layerwise and two refiner text blocks,
  RoPE theta 1000 and axes (32, 48, 48) are fixed in comfy/ldm/krea2/model.py.
- comfy/supported_models.py Krea2: model type FLUX with sampling_settings shift 1.15 (ModelSamplingFlux: timestep =
  sigma) unless a sampling node patches the model; latent format Wan21 (comfy/latent_formats.py): 16 channels, 3-D,
  per-channel process_in, so a still image is the one-frame LATENT [B, 16, 1, H/8, W/8] in and out.
- comfy/model_base.py Krea2.extra_conds: the text as CONDRegular (positive and negative of different lengths run as
  separate calls), no attention mask; reference latents process_in'd, and the method (reference_latents_method,
  FluxKontextMultiReferenceLatentMethod) passed only when the conditioning names one.
- comfy/text_encoders/krea2.py: the conditioning [B, L, 12 x 2560] is twelve tapped Qwen3-VL 4B layers flattened;
  comfy/ldm/krea2/model.py _unpack_context makes them [B, L, 12, 2560] again and the text fusion (two layerwise blocks
  across the layers of each token, the projector, two refiner blocks across the tokens, no mask) runs inside the
  diffusion model's forward, every call, before txtmlp.
- comfy/ldm/krea2/model.py SingleStreamDiT._forward: the latent padded circularly to whole 2x2 patches and packed
  (c, ph, pw); the sequence [text | image | references]; positions (0, 0, 0) for every text token, (0, row, col) for
  the image's patches (not centred), (k, row, col) for reference k = 1, 2, ... on its own grid; references count only
  when a method is set (the model's default is none: without FluxKontextMultiReferenceLatentMethod they are ignored),
  each method places them so, and "index_timestep_zero" modulates the reference tokens with the embedding of
  timestep 0; the timestep embedded from sigma x 1000 in float32, cast to the model's dtype; RMSNorm scales
  zero-centred (1 + scale, in float32); GQA with the key/value heads repeated, a sigmoid gate on the attention
  output, SwiGLU; only the image tokens' output kept, the padding cropped.
The unmodified diffusers Krea2Transformer2DModel computes all of this given the packed tokens, the four-axis text
stack and the position ids; index_timestep_zero's second modulation goes in as a per-token modulation (its blocks add
their table to whatever the time projection gives, a row a token or one for all).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import Family, Marker, StageParams, StockJob, TokenTable, forward_hook, grid_ids
from .krea2_layout import DIMS, infer, key_map, shapes
from .qwen_image import WAN21_MEAN, WAN21_STD, pack, unpack
from .stage import StageModel

# ComfyUI's reference methods for Krea 2: "none" (the conditioning names none) ignores the reference latents; every
# other places them by index, "index_timestep_zero" also modulating them at timestep 0
NONE, ZERO = "none", "index_timestep_zero"
REFERENCE_METHODS = (NONE, "index", ZERO, "offset", "uxo")
SHIFT = 1.15            # supported_models.Krea2: sampling_settings
TEXT_TOKENS = 256
TEXT_ENCODER = "Qwen3-VL 4B (CLIPLoader type krea2 with qwen3vl_4b_fp8_scaled.safetensors)"


def text_stack(flow, cond: torch.Tensor) -> torch.Tensor:
    """ComfyUI's conditioning [n, L, layers x width] as the model's four-axis text [n, L, layers, width]
    (_unpack_context); a width of another model's encoder is refused in one line."""
    config = flow.model.config
    layers, width = config.num_text_layers, config.text_hidden_dim
    if cond.shape[-1] != layers * width:
        raise ValueError(f"Krea 2 takes conditioning of {layers} x {width} = {layers * width} features a token (its "
                         f"Qwen3-VL stack), not {cond.shape[-1]}: encode the prompt with CLIPLoader type krea2")
    return cond.unflatten(-1, (layers, width))


def positions(rows: int, cols: int, ref_grids, text_tokens: int, device) -> torch.Tensor:
    """Position ids [text + image + references, 3]: text at (0, 0, 0), the image's patches at (0, row, col),
    reference k's at (k, row, col)."""
    ids = [torch.zeros(text_tokens, 3, device=device), grid_ids(rows, cols, 0, 0, 0, device)]
    ids += [grid_ids(r, c, k, 0, 0, device) for k, (r, c) in enumerate(ref_grids, 1)]
    return torch.cat(ids)


def _grid(x: torch.Tensor) -> tuple[int, int]:
    return (x.shape[-2] + 1) // 2, (x.shape[-1] + 1) // 2


def timestep_zero_modulation(model, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks' shared modulation at timestep 0 (index_timestep_zero's for the reference tokens), [n, 1, 6 width]."""
    zero = model.time_embed(torch.zeros_like(timestep), dtype=dtype)
    return model.time_mod_proj(F.gelu(zero, approximate="tanh"))


# ---- the one forward -------------------------------------------------------------------------------------------------
def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 16, h, w] (model space, compute dtype) at ComfyUI's model timestep (sigma, float32): one call of the
    unmodified Krea2Transformer2DModel with ComfyUI's tokens, positions and text stack (its text fusion runs in it).

    The model takes the image's and references' tokens and their positions (what a sequence-parallel plan splits,
    TokenTable.split_inputs); the text's positions, all (0, 0, 0), are prepended as the forward starts, so each rank
    holds the whole text (joint: the attention processors are told how many tokens it is) and its shard of the rest.
    Under index_timestep_zero the blocks' modulation becomes one row a token, the timestep's for the text and the
    image, timestep 0's for the references (the tokens whose position index is 1 or more)."""
    model = flow.model
    h, w = x.shape[-2:]
    refs = prepared.references if prepared.reference_method != NONE else ()
    tokens = [pack(x)] + [pack(r) for r in refs]
    image_tokens = tokens[0].shape[1]
    text = text_stack(flow, prepared.cond)
    n_text = text.shape[1]
    ids = positions(*_grid(x), [_grid(r) for r in refs], 0, flow.device)
    for block in model.transformer_blocks:   # the sequence-parallel processors' joint tokens (one rank: none set)
        if isinstance(block.attn.processor, Krea2SPProcessor):
            block.attn.processor.joint_text = n_text
    seen = {}

    def with_text(module, args, kwargs):   # after the plan's split: this rank's rows
        seen["ids"] = kwargs["position_ids"]
        text_ids = seen["ids"].new_zeros(n_text, 3)
        return args, {**kwargs, "position_ids": torch.cat([text_ids, seen["ids"]])}

    with contextlib.ExitStack() as stack:
        handle = model.register_forward_pre_hook(with_text, with_kwargs=True)
        stack.callback(handle.remove)
        if refs and prepared.reference_method == ZERO:
            zero = timestep_zero_modulation(model, timestep, x.dtype)

            def per_token(module, args, out):
                reference = (seen["ids"][:, 0] > 0)[None, :, None]
                return torch.cat([out.expand(-1, n_text, -1), torch.where(reference, zero, out)], dim=1)
            stack.enter_context(forward_hook(model.time_mod_proj, per_token))
        out = model(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=text, timestep=timestep,
                    position_ids=ids, return_dict=False)[0]
    return unpack(out[:, :image_tokens], h, w)


# ---- attention: the blocks' sequence parallel, the text fusion's local ---------------------------------------------
class Krea2SPProcessor:
    """What diffusers' Krea2AttnProcessor computes (GQA with the key/value heads repeated, q/k RMSNorm, RoPE, the
    sigmoid gate on the output) with the blocks' attention through the sequence-parallel entry point; the text
    fusion's (marked `xdit_local` at load: every rank holds its whole text) through diffusers' own processor. The
    text tokens lead every rank's sequence whole and attend as joint tokens: the family's forward (under PipeFusion,
    a stage) sets `joint_text` to their count, as the blocks pass the attention no keyword of their own."""

    def __init__(self, attention):
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_krea2 import Krea2AttnProcessor
        self.attention, self.rotary, self.local = attention, apply_rotary_emb, Krea2AttnProcessor()
        self.joint_text = 0

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if getattr(attn, "xdit_local", False):
            return self.local(attn, hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise ValueError("sequence-parallel Krea 2 attention takes no attention mask (ComfyUI uses none)")
        q = attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        k = attn.to_k(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = attn.to_v(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        gate = attn.to_gate(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = self.rotary(q, image_rotary_emb, sequence_dim=1), self.rotary(k, image_rotary_emb, sequence_dim=1)
        groups = attn.num_heads // attn.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        n = self.joint_text
        if n:
            out, held = self.attention(q[:, n:], k[:, n:], v[:, n:], joint=(q[:, :n], k[:, :n], v[:, :n]))
            out = torch.cat([held, out], dim=1)
        else:
            out = self.attention(q, k, v)[0]
        out = out.flatten(2, 3).to(q.dtype) * torch.sigmoid(gate)
        return attn.to_out[0](out)


# ---- PipeFusion: a stage's share of the forward ----------------------------------------------------------------------
class Krea2Stage(StageModel):
    """Stages run the blocks directly on [text | the piece's image tokens] (text with the first patch only), the text
    attending as joint tokens; every stage computes the timestep embedding and the blocks' shared modulation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ropes: dict = {}

    def temb(self, prepared, sigma32: torch.Tensor):
        n = prepared.cond.shape[0]
        temb = self.model.time_embed(sigma32.reshape(-1).expand(n), dtype=self.flow.dtype)
        return temb, self.model.time_mod_proj(F.gelu(temb, approximate="tanh"))

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        image = self.model.img_in(pack(x)[:, self.band_index(band)])
        if not with_text:
            return image.new_zeros(x.shape[0], 0, image.shape[2]), image
        return self.model.txt_in(self.model.text_fusion(text_stack(self.flow, prepared.cond))), image

    def _rope(self, band, n_text: int, device):
        key = (band, n_text)
        if key not in self._ropes:   # built on the device, once per piece shape
            ids = positions(self.layout.rows, self.layout.cols, (), n_text, device)
            keep = torch.cat([torch.arange(n_text, device=device), n_text + self.local_index(band)])
            self._ropes[key] = self.model.rotary_emb(ids[keep])
        return self._ropes[key]

    def run_blocks(self, text, image, temb, band, with_text: bool):
        rope = self._rope(band, text.shape[1], image.device)
        x = torch.cat([text, image], dim=1)
        for block in self.blocks:
            block.attn.processor.joint_text = text.shape[1]
            x = block(x, temb[1], rope)
        return x[:, :text.shape[1]], x[:, text.shape[1]:]

    def final(self, image, temb):
        return self.model.final_layer(image, temb[0])

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        rows, cols = self.band_grid(band)
        return unpack(tokens, 2 * rows, 2 * cols)


def _model_class():
    from diffusers import Krea2Transformer2DModel
    return Krea2Transformer2DModel


def _after_load(model) -> None:
    """The text fusion's attention stays local under every plan (its text is whole on every rank)."""
    for block in list(model.text_fusion.layerwise_blocks) + list(model.text_fusion.refiner_blocks):
        block.attn.xdit_local = True


def _fp32_param(name: str) -> bool:
    """ComfyUI's RMSNorm adds 1 to its scale in float32 (cast_to(scale, float32) + 1.0), as diffusers'
    _keep_in_fp32_modules holds the norms: a norm's weight stays float32 whatever the compute dtype."""
    leaf = name.rsplit(".", 2)
    return name.endswith(".weight") and len(leaf) > 1 and leaf[-2] in ("norm", "norm1", "norm2", "norm_q", "norm_k")


def _linear_width(config: dict) -> float:
    """Block weights each token meets, in width^2: q, gate, out (1 each), k and v (the key/value heads' share), the
    SwiGLU's three matrices."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    kv = config["num_key_value_heads"] * config["attention_head_dim"]
    return 3 + 2 * kv / hidden + 3 * config["intermediate_size"] / hidden


FAMILY = Family(
    name="krea2", title="Krea 2", variants=("krea-2",),
    markers=(Marker("txtfusion.projector.weight", "comfy"), Marker("text_fusion.projector.weight", "diffusers")),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("krea2",),
    layers=lambda config: config["num_layers"],
    latent=LatentFormat("Wan21", channels=16, scale_factor=1.0, mean=WAN21_MEAN, std=WAN21_STD, spatial_dims=3),
    latent_patch=lambda config: 2, pads_to_patches=True,
    sampling=lambda variant: FlowSampling.flux(SHIFT),
    comfy_model=lambda config: ("Krea2", {"image_model": "krea2"}),
    cond_width=lambda config: config["num_text_layers"] * config["text_hidden_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, cfg=1.0, text_tokens=TEXT_TOKENS, reference_methods=REFERENCE_METHODS,
    stock_jobs={"krea-2": StockJob("krea-2", 1024, 1024, 8, 1.0, shift=SHIFT,
                                   note="Krea 2 Turbo's template; Krea 2 Raw: about 28 steps at cfg 4 to 5")},
    # the image's and references' tokens split as one sequence (padded where the degree does not divide them), the text
    # held whole by every rank: the model slices the text off the blocks' output by its whole length
    tokens=TokenTable(processor=Krea2SPProcessor, gather_after="final_layer",
                      split_inputs=(("hidden_states", 1), ("position_ids", 0)), blocks=("transformer_blocks",)),
    stage=Krea2Stage,
    stage_params=StageParams(every=("time_embed.", "time_mod_proj."),
                             first=("img_in.", "text_fusion.", "txt_in."), last=("final_layer.",)),
    text_splits=False, text_cross=False, text_stream=(), modulation=("scale_shift_table",),
    linear_width=_linear_width,
    native_layout="comfy", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load, fp32_params=_fp32_param,
    variant_aliases={"krea2": "krea-2", "krea-2-turbo": "krea-2", "krea-2-raw": "krea-2"},
    full_extras=("vae.decoder.conv1.weight", "text_encoders.qwen3vl_4b.transformer.model.embed_tokens.weight"),
    describe_blocks=lambda c: (f"{c['num_layers']} single-stream blocks ({c['num_attention_heads']} heads, "
                               f"{c['num_key_value_heads']} key/value heads), a {2 * c['num_layerwise_text_blocks']}-"
                               f"block text fusion"),
    describe_conditioning=lambda c: (f"cond [B, N, {c['num_text_layers']} x {c['text_hidden_dim']}] (Qwen3-VL's "
                                     f"tapped layers), no pooled output, no guidance; reference latents with a "
                                     f"reference method"),
    text_encoder=lambda variant: TEXT_ENCODER,
    comfyui_since=lambda variant: "0.26.0",   # 2a610155 "feat: Support Krea2", first released in 0.26.0
)
