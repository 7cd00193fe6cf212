"""FLUX.1 [dev] and [schnell] (and Kontext's reference latents): everything the engine knows of this family.

ComfyUI's conventions (ComfyUI 0.3.64: comfy/supported_models.py Flux / FluxSchnell, comfy/latent_formats.py Flux,
comfy/model_base.py Flux, comfy/ldm/flux/model.py): latent format Flux (16 channels, scale 0.3611, shift 0.1159);
dev samples with ModelSamplingFlux (shift 1.15), schnell with ModelSamplingDiscreteFlow (shift 1.0, multiplier 1.0);
the model takes sigma as its timestep (it scales timestep and guidance by 1000 inside) and a guidance value
(FluxGuidance, default 3.5) when it has a guidance embedding; CONDITIONING holds T5-XXL [B, N, 4096] and CLIP-L pooled
[B, 768]; latents are packed in 2x2 patches (channels c, ph, pw) with position ids (0, row, col), text ids 0.
Kontext's reference latents (ReferenceLatent) become extra tokens after the image's, placed by
FluxKontextMultiReferenceLatentMethod's method; only the image tokens' output is kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .stage import StageModel
from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import (Family, Marker, StageParams, StockJob, TokenTable, count, fused, grid_ids, linear, linear_shapes,
                   pack_2x2, pre_hook, rope_axes, tile_offsets, unpack_2x2)

REFERENCE_METHODS = ("offset", "index", "uxo")   # FluxKontextMultiReferenceLatentMethod ("uxo/uno": uxo)
HEAD_DIM_AXES = {128: (16, 56, 56)}               # FLUX.1's RoPE split of its 128-wide heads


# ---- dimensions and the BFL single-file layout -----------------------------------------------------------------------
@dataclass(frozen=True)
class FluxDims:
    hidden: int = 3072
    heads: int = 24
    depth: int = 19           # double-stream blocks
    depth_single: int = 38    # single-stream blocks
    mlp_ratio: float = 4.0
    in_channels: int = 64     # 16 latent channels x 2x2 packing
    vec_in: int = 768         # CLIP-L pooled
    context_in: int = 4096    # T5-XXL
    guidance_embed: bool = True  # dev: True, schnell: False
    axes_dim: tuple = (16, 56, 56)

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_TINY = dict(hidden=128, heads=4, depth=4, depth_single=4, axes_dim=(4, 14, 14))
DIMS = {
    "full": {"flux-dev": FluxDims(), "flux-schnell": FluxDims(guidance_embed=False)},
    "tiny": {"flux-dev": FluxDims(**_TINY), "flux-schnell": FluxDims(**_TINY, guidance_embed=False)},
    # a few hundred MB of fp32 weights, so weights dominate a rank's memory (bench memory)
    "small": {"flux-dev": FluxDims(hidden=512, heads=4, depth=4, depth_single=8, axes_dim=(16, 56, 56))},
}


def bfl_shapes(d: FluxDims) -> dict[str, tuple]:
    """Every tensor of a FLUX.1 transformer in the BFL layout, with its shape."""
    h, s = d.hidden, {}
    linear_shapes(s, "img_in", h, d.in_channels)
    linear_shapes(s, "time_in.in_layer", h, 256)
    linear_shapes(s, "time_in.out_layer", h, h)
    linear_shapes(s, "vector_in.in_layer", h, d.vec_in)
    linear_shapes(s, "vector_in.out_layer", h, h)
    if d.guidance_embed:
        linear_shapes(s, "guidance_in.in_layer", h, 256)
        linear_shapes(s, "guidance_in.out_layer", h, h)
    linear_shapes(s, "txt_in", h, d.context_in)
    for i in range(d.depth):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            linear_shapes(s, f"{p}_mod.lin", 6 * h, h)
            linear_shapes(s, f"{p}_attn.qkv", 3 * h, h)
            s[f"{p}_attn.norm.query_norm.scale"] = (d.head_dim,)
            s[f"{p}_attn.norm.key_norm.scale"] = (d.head_dim,)
            linear_shapes(s, f"{p}_attn.proj", h, h)
            linear_shapes(s, f"{p}_mlp.0", d.mlp_hidden, h)
            linear_shapes(s, f"{p}_mlp.2", h, d.mlp_hidden)
    for i in range(d.depth_single):
        p = f"single_blocks.{i}"
        linear_shapes(s, f"{p}.linear1", 3 * h + d.mlp_hidden, h)
        linear_shapes(s, f"{p}.linear2", h, h + d.mlp_hidden)
        s[f"{p}.norm.query_norm.scale"] = (d.head_dim,)
        s[f"{p}.norm.key_norm.scale"] = (d.head_dim,)
        linear_shapes(s, f"{p}.modulation.lin", 3 * h, h)
    linear_shapes(s, "final_layer.adaLN_modulation.1", 2 * h, h)
    linear_shapes(s, "final_layer.linear", d.in_channels, h)
    return s


# ---- detection: the diffusers config from the tensors' shapes --------------------------------------------------------


def _config(hidden, in_channels, head_dim, depth, single, context_in, vec_in, guidance, metadata):
    if hidden % head_dim:
        raise CheckpointError(f"FLUX width {hidden} is not a multiple of its head width {head_dim}")
    if in_channels != 64:
        raise CheckpointError(f"FLUX transformer with {in_channels} input channels (FLUX.1 Fill/Depth/Canny "
                              f"variants); only text-to-image FLUX.1 dev/schnell (64 channels) is supported")
    config = {"patch_size": 1, "in_channels": in_channels, "num_layers": depth, "num_single_layers": single,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": context_in, "pooled_projection_dim": vec_in, "guidance_embeds": guidance,
              "axes_dims_rope": rope_axes(head_dim, metadata, HEAD_DIM_AXES, "FLUX.1")}
    return config, "flux-dev" if guidance else "flux-schnell"


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    if layout == "bfl":
        return _config(s["img_in.weight"][0], s["img_in.weight"][1],
                       s["double_blocks.0.img_attn.norm.query_norm.scale"][0], count(s, r"double_blocks\.(\d+)\."),
                       count(s, r"single_blocks\.(\d+)\."), s["txt_in.weight"][1], s["vector_in.in_layer.weight"][1],
                       "guidance_in.in_layer.weight" in s, metadata)
    return _config(s["x_embedder.weight"][0], s["x_embedder.weight"][1],
                   s["transformer_blocks.0.attn.norm_q.weight"][0],
                   count(s, r"transformer_blocks\.(\d+)\."), count(s, r"single_transformer_blocks\.(\d+)\."),
                   s["context_embedder.weight"][1], s["time_text_embed.text_embedder.linear_1.weight"][1],
                   "time_text_embed.guidance_embedder.linear_1.weight" in s, metadata)


def key_map(layout: str, config: dict) -> list | None:
    """BFL keys -> diffusers' FluxTransformer2DModel keys (None: the diffusers layout needs none)."""
    if layout == "diffusers":
        return None
    h = config["num_attention_heads"] * config["attention_head_dim"]
    m: list = []
    linear(m, "x_embedder", "img_in")
    linear(m, "time_text_embed.timestep_embedder.linear_1", "time_in.in_layer")
    linear(m, "time_text_embed.timestep_embedder.linear_2", "time_in.out_layer")
    linear(m, "time_text_embed.text_embedder.linear_1", "vector_in.in_layer")
    linear(m, "time_text_embed.text_embedder.linear_2", "vector_in.out_layer")
    if config["guidance_embeds"]:
        linear(m, "time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer")
        linear(m, "time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")
    linear(m, "context_embedder", "txt_in")
    for i in range(config["num_layers"]):
        d, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        linear(m, f"{d}.norm1.linear", f"{s}.img_mod.lin")
        linear(m, f"{d}.norm1_context.linear", f"{s}.txt_mod.lin")
        fused(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{s}.img_attn.qkv", (h, h, h))
        fused(m, (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), f"{s}.txt_attn.qkv",
              (h, h, h))
        for dst, src in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):
            m.append((f"{d}.attn.{dst}.weight", f"{s}.{src}.scale", None))
        linear(m, f"{d}.attn.to_out.0", f"{s}.img_attn.proj")
        linear(m, f"{d}.attn.to_add_out", f"{s}.txt_attn.proj")
        linear(m, f"{d}.ff.net.0.proj", f"{s}.img_mlp.0")
        linear(m, f"{d}.ff.net.2", f"{s}.img_mlp.2")
        linear(m, f"{d}.ff_context.net.0.proj", f"{s}.txt_mlp.0")
        linear(m, f"{d}.ff_context.net.2", f"{s}.txt_mlp.2")
    mlp = int(h * 4.0)
    for i in range(config["num_single_layers"]):
        d, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        fused(m, (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"), f"{s}.linear1",
              (h, h, h, mlp))
        m.append((f"{d}.attn.norm_q.weight", f"{s}.norm.query_norm.scale", None))
        m.append((f"{d}.attn.norm_k.weight", f"{s}.norm.key_norm.scale", None))
        linear(m, f"{d}.norm.linear", f"{s}.modulation.lin")
        linear(m, f"{d}.proj_out", f"{s}.linear2")
    linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap")
    linear(m, "proj_out", "final_layer.linear")
    return m


# ---- the one forward, with ComfyUI's conventions ---------------------------------------------------------------------
def reference_positions(method: str, latent_hw: tuple[int, int], shapes) -> list[tuple[int, int, int]]:
    """(index, first row, first column) of each reference's patch grid, in patches, as ComfyUI's Flux model places
    them (offsets are counted in latent pixels, then halved rounding up). "offset": every reference on index 1,
    each next to the ones before it, along the side that keeps the covered area squarer; "index": each its own
    index from 1, at the origin; "uxo": index 0, diagonally past the image and the references before it."""
    if method not in REFERENCE_METHODS:
        raise ValueError(f"reference_latents_method={method!r} is invalid: use one of {list(REFERENCE_METHODS)}")
    shapes = [tuple(s) for s in shapes]
    if method == "index":
        places = [(i + 1, 0, 0) for i in range(len(shapes))]
    elif method == "uxo":
        corners = [(sum(h for h, _ in shapes[:i]), sum(w for _, w in shapes[:i])) for i in range(len(shapes))]
        places = [(0, latent_hw[0] + h, latent_hw[1] + w) for h, w in corners]
    else:
        places = [(1, row, col) for row, col in tile_offsets(shapes)]
    return [(index, (row + 1) // 2, (col + 1) // 2) for index, row, col in places]


def _fp32_embedding(model, timestep: torch.Tensor, guidance: torch.Tensor | None):
    """For one forward: the timestep (and guidance) embedding gets these fp32 values instead of the ones diffusers
    rounded to the compute dtype (ComfyUI embeds them in fp32)."""
    def exact(module, args):
        return (timestep, guidance, args[2]) if len(args) == 3 else (timestep, args[1])
    return pre_hook(model.time_text_embed, exact)


def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 16, h, w] (model space, compute dtype) at ComfyUI's model timestep (float32; sigma itself for
    FLUX.1): one call of the unmodified FluxTransformer2DModel."""
    b, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"FLUX latent {h}x{w} is not a multiple of its 2x2 patches: width and height must be "
                         f"multiples of 16 pixels")
    device = flow.device
    packed, img_ids = pack_2x2(x), grid_ids(h // 2, w // 2, 0, 0, 0, device)
    image_tokens = packed.shape[1]
    if prepared.references:
        places = reference_positions(prepared.reference_method, (h, w), [r.shape[-2:] for r in prepared.references])
        packed = torch.cat([packed] + [pack_2x2(r) for r in prepared.references], dim=1)
        img_ids = torch.cat([img_ids] + [grid_ids(r.shape[-2] // 2, r.shape[-1] // 2, *place, device)
                                         for r, place in zip(prepared.references, places)], dim=0)
    txt_ids = torch.zeros(prepared.cond.shape[1], 3, device=device)
    guidance = prepared.guidance if flow.model.config.guidance_embeds else None
    flow.reference_tokens = packed.shape[1] - image_tokens
    try:
        with _fp32_embedding(flow.model, timestep * 1000.0, guidance * 1000.0 if guidance is not None else None):
            out = flow.model(hidden_states=packed, encoder_hidden_states=prepared.cond,
                             pooled_projections=prepared.pooled, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
                             guidance=guidance, return_dict=False)[0]
    finally:
        flow.reference_tokens = 0
    return unpack_2x2(out[:, :image_tokens], h, w)


# ---- sequence parallel: the attention processor ----------------------------------------------------------------------
class FluxSPProcessor:
    """What diffusers' FluxAttnProcessor computes, with the attention through the sequence-parallel entry point."""

    def __init__(self, attention):
        from diffusers.models.embeddings import apply_rotary_emb   # diffusers loads where the model runs, not in
        self.attention, self.rotary = attention, apply_rotary_emb  # the client (ComfyUI's process)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 joint_text_tokens: int = 0, joint_reference_tokens: int = 0):
        """joint_text_tokens: the text tokens every rank holds in full, at the front of a single block's sequence
        (0: the text is split with the image tokens); joint_reference_tokens: the reference tokens every rank holds
        in full, at the end of the sequence (0: none, or split with the image tokens)."""
        if attention_mask is not None:
            raise ValueError("sequence-parallel FLUX attention takes no attention mask")
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:  # the model computed it from this rank's (sliced) position ids
            q = self.rotary(q, image_rotary_emb, sequence_dim=1)
            k = self.rotary(k, image_rotary_emb, sequence_dim=1)
        if joint_text_tokens or joint_reference_tokens:
            # the sequence is [text | image shard | references]: the joint ones enter the attention together
            n, end = joint_text_tokens, q.shape[1] - joint_reference_tokens
            joint = tuple(torch.cat([t[:, :n], t[:, end:]], dim=1) for t in (q, k, v))
            image, held = self.attention(q[:, n:end], k[:, n:end], v[:, n:end], joint=joint)
            out = torch.cat([held[:, :n], image, held[:, n:]], dim=1)
        else:
            out, _ = self.attention(q, k, v)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        n = encoder_hidden_states.shape[1]
        text_out, image_out = out[:, :n], out[:, n:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


# ---- PipeFusion: a stage's share of the forward ----------------------------------------------------------------------
class FluxStage(StageModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ropes: dict = {}

    def temb(self, prepared, sigma32: torch.Tensor) -> torch.Tensor:
        n = prepared.cond.shape[0]
        t = sigma32.reshape(-1).expand(n) * 1000.0
        embed = self.model.time_text_embed
        if self.model.config.guidance_embeds:
            return embed(t, prepared.guidance * 1000.0, prepared.pooled)
        return embed(t, prepared.pooled)

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        image = self.model.x_embedder(pack_2x2(x)[:, self.band_index(band)])
        text = self.model.context_embedder(prepared.cond) if with_text else image.new_zeros(x.shape[0], 0,
                                                                                            image.shape[2])
        return text, image

    def _rope(self, band, n_text: int, device):
        key = (band, n_text)
        if key not in self._ropes:   # built on the device, once per piece shape
            idx = self.local_index(band)
            rows, cols = idx // self.layout.cols, idx % self.layout.cols
            img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(torch.float32)
            self._ropes[key] = self.model.pos_embed(torch.cat([img_ids.new_zeros(n_text, 3), img_ids]))
        return self._ropes[key]

    def run_blocks(self, text, image, temb, band, with_text: bool):
        n_text = text.shape[1]
        rope = self._rope(band, n_text, image.device)
        kwargs = {"joint_text_tokens": n_text}
        for block in self.blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope,
                                joint_attention_kwargs=kwargs)
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb))

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        rows, cols = self.band_grid(band)
        return unpack_2x2(tokens, 2 * rows, 2 * cols)


def _model_class():
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel


FAMILY = Family(
    name="flux", title="FLUX.1", variants=("flux-dev", "flux-schnell"),
    markers=(Marker("double_blocks.0.img_attn.qkv.weight", "bfl",
                    # FLUX.2's BFL files have it too, and HunyuanVideo's in ComfyUI's names
                    absent=("double_stream_modulation_img.lin.weight",
                            "txt_in.individual_token_refiner.blocks.0.norm1.weight")),
             Marker("single_transformer_blocks.0.attn.to_q.weight", "diffusers")),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("flux",),
    layers=lambda config: config["num_layers"] + config["num_single_layers"],
    latent=LatentFormat("Flux", channels=16, scale_factor=0.3611, shift_factor=0.1159),
    latent_patch=lambda config: 2,
    sampling=lambda variant: FlowSampling.flux(1.15) if variant == "flux-dev" else FlowSampling.discrete_flow(1.0, 1.0),
    comfy_model=lambda config: ("Flux" if config.get("guidance_embeds") else "FluxSchnell",
                                {"image_model": "flux", "guidance_embed": bool(config.get("guidance_embeds"))}),
    cond_width=lambda config: config["joint_attention_dim"],
    pooled_width=lambda config: config["pooled_projection_dim"],
    takes_guidance=lambda config: bool(config.get("guidance_embeds")),
    forward=forward, cfg=1.0, text_tokens=512, reference_methods=REFERENCE_METHODS,
    stock_jobs={"flux-dev": StockJob("flux1-dev", 1024, 1024, 28, 1.0, shift=1.15),
                "flux-schnell": StockJob("flux1-schnell", 1024, 1024, 4, 1.0, shift=1.0)},
    tokens=TokenTable(processor=FluxSPProcessor, gather_after="proj_out",
                      split_inputs=(("hidden_states", 1), ("img_ids", 0)),
                      text_inputs=(("encoder_hidden_states", 1), ("txt_ids", 0)),
                      blocks=("transformer_blocks", "single_transformer_blocks"), reference_tokens=True),
    stage=FluxStage,
    stage_params=StageParams(every=("time_text_embed.",), first=("x_embedder.", "context_embedder."),
                             last=("norm_out.", "proj_out.")),
    text_splits=True,
    native_layout="bfl", dims=DIMS, shapes=bfl_shapes,
    full_extras=("vae.decoder.conv_in.weight",
                 "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight"),
    describe_blocks=lambda c: f"{c['num_layers']} double + {c['num_single_layers']} single blocks",
    describe_conditioning=lambda c: (
        f"cond [B, N, {c['joint_attention_dim']}] (T5-XXL), pooled [B, {c['pooled_projection_dim']}] (CLIP-L)"
        + ("; guidance embedded (FluxGuidance)" if c.get("guidance_embeds") else "; no guidance input")),
    text_encoder=lambda variant: "T5-XXL and CLIP-L (DualCLIPLoader type flux with t5xxl_fp16.safetensors and "
                                 "clip_l.safetensors)",
)
