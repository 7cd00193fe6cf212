"""FLUX.2 [dev] (32 B) and [klein] (4 B, 9 B; base and distilled have one structure): how the engine runs this family
(its checkpoints' dims, layout and detection: flux2_layout.py).

ComfyUI's conventions, read from ComfyUI's source at the commit that added FLUX.2 (6b573ae0, "Flux 2", v0.3.72) and at
v0.12.1 (fe251146), the same in both unless said:
- comfy/model_detection.py: a Flux file with `double_stream_modulation_img.lin.weight` is FLUX.2: RoPE axes
  (32, 32, 32, 32), theta 2000, mlp ratio 3 (SwiGLU), no biases, txt_ids_dims [3], patch size 1, default reference
  method "index" with ref_index_scale 10; width, text width and block counts from the tensors; a guidance embedding
  when `guidance_in.in_layer.weight` is there ([dev]; [klein] has none). One class covers dev and klein.
- comfy/supported_models.py Flux2: sampling_settings shift 2.02, model type FLUX (ModelSamplingFlux: sigma(t) =
  e^2.02 / (e^2.02 + 1/t - 1), timestep = sigma); latent format Flux2.
- comfy/latent_formats.py Flux2: 128 channels at 1/16 of the image (the VAE's 32 channels packed 2x2, channels
  (c, ph, pw)); process_in and process_out are the identity (the VAE normalises).
- comfy_extras/nodes_flux.py EmptyFlux2LatentImage: zeros [B, 128, H/16, W/16]. Flux2Scheduler (steps, width,
  height): sigmas with a mu that depends on the image's tokens and the steps (compute_empirical_mu); the plain
  KSampler path uses the fixed shift instead.
- comfy/model_base.py Flux2.extra_conds: the text is padded to 512 tokens by prepending zeros (never truncated);
  Flux.extra_conds gives guidance (FluxGuidance, default 3.5; ignored by a model without a guidance embedding) and
  the reference latents (ReferenceLatent, process_in: identity); the text encoder's attention mask is not used.
- comfy/ldm/flux/model.py: the latent becomes tokens one latent pixel each (patch 1: 128 features); image ids
  (index, row, col, 0), not centred; text ids (0, 0, 0, l) for l = 0..L-1 over the padded text; the sequence is
  [text, image, references]; reference k (1, 2, ...) gets index 10 k at the origin ("index"), or ComfyUI's "offset"
  / "uxo" placements with offsets in latent pixels; only the image tokens' output is kept. The model embeds
  sigma * 1000 and guidance * 1000 in float32 and casts the embedding to the model's dtype.
- comfy/text_encoders/flux.py: [dev]'s Mistral-3 24B gives [B, L, 15360] (three layers' hidden states), [klein]'s
  Qwen3 4B / 8B [B, max(512, L), 7680 / 12288]; no pooled output.
The unmodified diffusers Flux2Transformer2DModel computes all of this given the ids; its timestep embedding gets the
float32 values through hooks.

ComfyUI releases: the Flux2 model class and CLIPLoader type flux2 (Mistral-3) came with 6b573ae0, first released in
0.3.72; [klein]'s Qwen3 text encoders with 3b832231 ("Flux2 Klein support"), first released in 0.9.2.
"""
from __future__ import annotations

import contextlib

import torch

from .stage import StageModel
from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import Family, Marker, StageParams, StockJob, TokenTable, pre_hook, tile_offsets
from .flux2_layout import THETA, DIMS, Flux2Dims, bfl_shapes, infer, key_map  # noqa: F401 (read here)

REFERENCE_METHODS = ("index", "offset", "uxo")   # "index" unless FluxKontextMultiReferenceLatentMethod says else
REF_INDEX_SCALE = 10                              # model_detection: ref_index_scale for FLUX.2
TEXT_TOKENS = 512                                 # model_base.Flux2: the text padded to at least this
SHIFT = 2.02                                      # supported_models.Flux2: sampling_settings
# what a ComfyUI graph loads for each variant's conditioning (CLIPLoader type flux2 reads all three)
TEXT_ENCODERS = {
    "flux2-dev": "Mistral-3 24B (CLIPLoader type flux2 with mistral_3_small_flux2_bf16.safetensors)",
    "flux2-klein-4b": "Qwen3 4B (CLIPLoader type flux2 with qwen_3_4b.safetensors)",
    "flux2-klein-9b": "Qwen3 8B (CLIPLoader type flux2 with the Qwen3 8B text encoder file)",
}


# ---- tokens and positions, as ComfyUI's Flux model builds them -------------------------------------------------------
def pack(x: torch.Tensor) -> torch.Tensor:
    """Latent [b, 128, h, w] -> tokens [b, h*w, 128], rows first (process_img with patch size 1)."""
    return x.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Tokens [b, h*w, c] -> latent [b, c, h, w]."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)


def image_ids(h: int, w: int, index: float = 0, row0: int = 0, col0: int = 0, device=None) -> torch.Tensor:
    """(index, row0 + row, col0 + col, 0) of each latent pixel of an h x w latent, rows first, float32 [h*w, 4]."""
    r = torch.arange(h, device=device).repeat_interleave(w) + row0
    c = torch.arange(w, device=device).repeat(h) + col0
    return torch.stack([torch.full_like(r, index), r, c, torch.zeros_like(r)], dim=1).to(torch.float32)


def text_ids(tokens: int, device=None) -> torch.Tensor:
    """(0, 0, 0, l) for text token l (txt_ids_dims [3])."""
    ids = torch.zeros(tokens, 4, device=device)
    ids[:, 3] = torch.arange(tokens, device=device, dtype=torch.float32)
    return ids


def reference_positions(method: str, latent_hw: tuple[int, int], shapes) -> list[tuple[int, int, int]]:
    """(index, first row, first column) of each reference, in latent pixels (patch size 1: no rounding), as ComfyUI's
    Flux._forward places them: "index" gives reference k index 10 k at the origin; "offset" index 1, tiled side by
    side; "uxo" index 0, diagonally past the image and the references before it."""
    if method not in REFERENCE_METHODS:
        raise ValueError(f"reference_latents_method={method!r} is invalid: use one of {list(REFERENCE_METHODS)}")
    shapes = [tuple(s) for s in shapes]
    if method == "index":
        return [(REF_INDEX_SCALE * (i + 1), 0, 0) for i in range(len(shapes))]
    if method == "uxo":
        corners = [(sum(h for h, _ in shapes[:i]), sum(w for _, w in shapes[:i])) for i in range(len(shapes))]
        return [(0, latent_hw[0] + h, latent_hw[1] + w) for h, w in corners]
    return [(1, row, col) for row, col in tile_offsets(shapes)]


@contextlib.contextmanager
def embedding_in_fp32(model, timestep: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype):
    """For one forward: the timestep (and guidance) embedding gets these float32 values (sigma * 1000, guidance *
    1000) instead of the ones diffusers rounds to the compute dtype, and its sinusoids are cast to the compute dtype
    before the embedders, as ComfyUI's timestep_embedding(...).to(img.dtype) does."""
    embed = model.time_guidance_embed
    with contextlib.ExitStack() as stack:
        stack.enter_context(pre_hook(embed, lambda module, args: (timestep, guidance)))
        for embedder in (embed.timestep_embedder, embed.guidance_embedder):
            if embedder is not None:
                stack.enter_context(pre_hook(embedder, lambda module, args: (args[0].to(dtype),)))
        yield


# ---- the one forward -------------------------------------------------------------------------------------------------
def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 128, h, w] (model space, compute dtype) at ComfyUI's model timestep (float32; sigma itself for
    FLUX.2): one call of the unmodified Flux2Transformer2DModel with ComfyUI's tokens, ids and float32 timestep
    embedding. The text arrives padded (Family.pad_text_to)."""
    b, _, h, w = x.shape
    device = flow.device
    tokens, ids = [pack(x)], [image_ids(h, w, device=device)]
    if prepared.references:
        shapes = [tuple(r.shape[-2:]) for r in prepared.references]
        for r, (index, row, col) in zip(prepared.references,
                                         reference_positions(prepared.reference_method, (h, w), shapes)):
            tokens.append(pack(r))
            ids.append(image_ids(r.shape[-2], r.shape[-1], index, row, col, device))
    guidance = prepared.guidance if flow.model.config.guidance_embeds else None
    flow.reference_tokens = sum(t.shape[1] for t in tokens[1:])
    try:
        with embedding_in_fp32(flow.model, timestep * 1000.0, guidance * 1000.0 if guidance is not None else None,
                               flow.dtype):
            out = flow.model(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=prepared.cond,
                             timestep=timestep, img_ids=torch.cat(ids), txt_ids=text_ids(prepared.cond.shape[1], device),
                             guidance=guidance, return_dict=False)[0]
    finally:
        flow.reference_tokens = 0
    return unpack(out[:, :h * w], h, w)


# ---- sequence parallel: one attention processor for both block kinds ------------------------------------------------
class Flux2SPProcessor:
    """What diffusers' Flux2AttnProcessor (double blocks) and Flux2ParallelSelfAttnProcessor (single blocks: attention
    and MLP from one fused projection) compute, with the attention through the sequence-parallel entry point. The
    two modules call their processor with different positional arguments, so one instance serves both."""

    def __init__(self, attention):
        from diffusers.models.embeddings import apply_rotary_emb   # diffusers loads where the model runs
        self.attention, self.rotary = attention, apply_rotary_emb

    def __call__(self, attn, hidden_states, *args, joint_text_tokens: int = 0, joint_reference_tokens: int = 0):
        """joint_text_tokens: the text tokens every rank holds in full, at the front of the sequence (0: the text is
        split with the image tokens); joint_reference_tokens: the reference tokens every rank holds in full, at its
        end (0: none, or split with the image tokens)."""
        if hasattr(attn, "to_qkv_mlp_proj"):   # Flux2ParallelSelfAttention: (attention_mask, image_rotary_emb)
            mask, rotary = (args + (None, None))[:2]
            encoder = None
        else:                                  # Flux2Attention: (encoder_hidden_states, attention_mask, rotary)
            encoder, mask, rotary = (args + (None, None, None))[:3]
        if mask is not None:
            raise ValueError("sequence-parallel FLUX.2 attention takes no attention mask (ComfyUI uses none)")
        if encoder is None and hasattr(attn, "to_qkv_mlp_proj"):
            fused_out = attn.to_qkv_mlp_proj(hidden_states)
            qkv, mlp = fused_out.split([3 * attn.inner_dim, fused_out.shape[-1] - 3 * attn.inner_dim], dim=-1)
            q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        else:
            mlp = None
            q, k, v = (proj(hidden_states).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k,
                                                                                            attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder is not None:
            eq, ek, ev = (proj(encoder).unflatten(-1, (-1, attn.head_dim))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if rotary is not None:   # the model computed it from this rank's (sliced) position ids, [text; image]
            q, k = self.rotary(q, rotary, sequence_dim=1), self.rotary(k, rotary, sequence_dim=1)
        if joint_text_tokens or joint_reference_tokens:
            # the sequence is [text | image shard | references]: the joint ones enter the attention together
            n, end = joint_text_tokens, q.shape[1] - joint_reference_tokens
            joint = tuple(torch.cat([t[:, :n], t[:, end:]], dim=1) for t in (q, k, v))
            image, held = self.attention(q[:, n:end], k[:, n:end], v[:, n:end], joint=joint)
            out = torch.cat([held[:, :n], image, held[:, n:]], dim=1)
        else:
            out, _ = self.attention(q, k, v)
        out = out.flatten(2, 3).to(q.dtype)
        if mlp is not None:
            return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
        n = encoder.shape[1]
        image_out = attn.to_out[1](attn.to_out[0](out[:, n:].contiguous()))
        return image_out, attn.to_add_out(out[:, :n].contiguous())


# ---- PipeFusion: a stage's share of the forward ----------------------------------------------------------------------
class Flux2Stage(StageModel):
    """Stages run the blocks directly. Every stage computes the timestep embedding and the three shared modulations
    (FLUX.2's blocks hold none of their own); single blocks are called with the text and image apart
    (split_hidden_states), so every stage passes on (text, image) as the others do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ropes: dict = {}

    def temb(self, prepared, sigma32: torch.Tensor):
        n = prepared.cond.shape[0]
        t = sigma32.reshape(-1).expand(n) * 1000.0
        g = prepared.guidance * 1000.0 if self.model.config.guidance_embeds else None
        with embedding_in_fp32(self.model, t, g, self.flow.dtype):
            temb = self.model.time_guidance_embed(t, g)
        return (temb, self.model.double_stream_modulation_img(temb), self.model.double_stream_modulation_txt(temb),
                self.model.single_stream_modulation(temb))

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        image = self.model.x_embedder(pack(x)[:, self.band_index(band)])
        text = self.model.context_embedder(prepared.cond) if with_text else image.new_zeros(x.shape[0], 0,
                                                                                            image.shape[2])
        return text, image

    def _rope(self, band, n_text: int, device):
        key = (band, n_text)
        if key not in self._ropes:   # built on the device, once per piece shape
            idx = self.local_index(band)
            rows, cols = idx // self.layout.cols, idx % self.layout.cols
            ids = torch.stack([torch.zeros_like(rows), rows, cols, torch.zeros_like(rows)], dim=1).to(torch.float32)
            self._ropes[key] = self.model.pos_embed(torch.cat([text_ids(n_text, device=ids.device), ids]))
        return self._ropes[key]

    def run_blocks(self, text, image, temb, band, with_text: bool):
        _, mod_img, mod_txt, mod_single = temb
        rope = self._rope(band, text.shape[1], image.device)
        kwargs = {"joint_text_tokens": text.shape[1]}
        for block in self.blocks:
            if hasattr(block, "ff_context"):   # a double block
                text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod_img=mod_img,
                                    temb_mod_txt=mod_txt, image_rotary_emb=rope, joint_attention_kwargs=kwargs)
            else:
                text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod=mod_single,
                                    image_rotary_emb=rope, joint_attention_kwargs=kwargs, split_hidden_states=True)
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb[0]))

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        return unpack(tokens, *self.band_grid(band))


def _model_class():
    from diffusers import Flux2Transformer2DModel
    return Flux2Transformer2DModel


def _describe_conditioning(c: dict) -> str:
    encoder = {15360: "Mistral-3 24B", 7680: "Qwen3 4B", 12288: "Qwen3 8B"}.get(c["joint_attention_dim"],
                                                                               "its text encoder")
    return (f"cond [B, N, {c['joint_attention_dim']}] ({encoder}; zeros prepended to {TEXT_TOKENS} tokens), no pooled "
            f"output" + ("; guidance embedded (FluxGuidance)" if c.get("guidance_embeds") else "; no guidance input")
            + "; reference latents (ReferenceLatent) at index 10 k")


FAMILY = Family(
    name="flux2", title="FLUX.2", variants=("flux2-dev", "flux2-klein-4b", "flux2-klein-9b"),
    markers=(Marker("double_stream_modulation_img.lin.weight", "bfl"),
             Marker("double_stream_modulation_img.linear.weight", "diffusers")),
    infer=infer, key_map=key_map, model_class=_model_class,
    gguf_arches=("flux",),   # ComfyUI-GGUF has no FLUX.2 architecture: its converter writes FLUX.1's
    layers=lambda config: config["num_layers"] + config["num_single_layers"],
    latent=LatentFormat("Flux2", channels=128, downscale=16),
    latent_patch=lambda config: 1,
    sampling=lambda variant: FlowSampling.flux(SHIFT),
    comfy_model=lambda config: ("Flux2", {"image_model": "flux2", "guidance_embed": bool(config["guidance_embeds"]),
                                          "hidden_size": config["num_attention_heads"] * config["attention_head_dim"]}),
    cond_width=lambda config: config["joint_attention_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: bool(config["guidance_embeds"]),
    forward=forward, cfg=1.0, text_tokens=TEXT_TOKENS, reference_methods=REFERENCE_METHODS, pad_text_to=TEXT_TOKENS,
    stock_jobs={"flux2-dev": StockJob("flux2-dev", 1024, 1024, 20, 1.0),
                "flux2-klein-4b": StockJob("flux2-klein-4b", 1024, 1024, 4, 1.0),
                "flux2-klein-9b": StockJob("flux2-klein-4b", 1024, 1024, 4, 1.0, note="the distilled [klein] 4B "
                                           "workflow's values; klein base: 20 steps, cfg 5")},
    tokens=TokenTable(processor=Flux2SPProcessor, gather_after="proj_out",
                      split_inputs=(("hidden_states", 1), ("img_ids", 0)),
                      text_inputs=(("encoder_hidden_states", 1), ("txt_ids", 0)),
                      blocks=("transformer_blocks", "single_transformer_blocks"), reference_tokens=True),
    stage=Flux2Stage,
    stage_params=StageParams(every=("time_guidance_embed.", "double_stream_modulation_img.",
                                    "double_stream_modulation_txt.", "single_stream_modulation."),
                             first=("x_embedder.", "context_embedder."), last=("norm_out.", "proj_out.")),
    text_splits=True,
    linear_width=13,   # per token and block: qkv 3 + out 1 + SwiGLU in 2 x 3 + out 3 (hidden^2)
    native_layout="bfl", dims=DIMS, shapes=bfl_shapes,
    full_extras=("vae.decoder.conv_in.weight", "text_encoders.qwen3_4b.transformer.model.embed_tokens.weight"),
    describe_blocks=lambda c: f"{c['num_layers']} double + {c['num_single_layers']} single blocks",
    describe_conditioning=_describe_conditioning,
    text_encoder=lambda variant: TEXT_ENCODERS[variant],
    comfyui_since=lambda variant: "0.3.72" if variant == "flux2-dev" else "0.9.2",
)
