"""Qwen-Image and Qwen-Image-Edit (20 B MMDiT): everything the engine knows of this family.

ComfyUI's conventions (ComfyUI 0.3.64: comfy/model_detection.py detects it by `txt_norm.weight`;
comfy/supported_models.py QwenImage; comfy/model_base.py QwenImage; comfy/ldm/qwen_image/model.py; comfy/latent_formats.py
Wan21):
- the files hold diffusers' own key names (ComfyUI's module mirrors QwenImageTransformer2DModel), with or without the
  `model.diffusion_model.` prefix;
- latent format Wan21: 16 channels, 3-D (a still image is one frame: KSampler makes the LATENT [B, 16, 1, H/8, W/8]),
  process_in (z - mean_c) / std_c with its 16 means and stds;
- model type FLUX: ModelSamplingFlux with shift 1.15 unless a sampling node patches it (the stock templates use
  ModelSamplingAuraFlow, shift 3.1 text-to-image, 3.0 edit: discrete flow, multiplier 1); the model takes sigma and
  embeds sigma * 1000 itself, in fp32; no guidance input;
- CONDITIONING is [[cond [1, L, 3584], {"pooled_output": None}]]; the text mask is not used; positive and negative of
  different lengths run as separate calls;
- the latent is padded circularly to whole 2x2 patches and packed (channels c, ph, pw); image positions are centred,
  (index, row - rows//2, col - cols//2) over the padded patch grid; text tokens sit at (s, s, s) from
  s = max(rows//2, cols//2) of the output latent;
- reference latents (the edit nodes put them on both sides) are process_in'd and follow the image tokens: method
  "index" (the default) gives reference i frame index i, centred on its own grid; any other method puts them all on
  index 1, tiled side by side as FLUX.1 Kontext's "offset" does.
The unmodified diffusers transformer computes all of this but the positions: its RoPE table (`pos_embed`) is replaced
for the forward by one built from ComfyUI's positions, in ComfyUI's float64 angles.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .stage import StageModel
from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import (Family, Marker, StageParams, StockJob, TokenTable, count, forward_hook, linear_shapes,
                   pre_hook, tile_offsets)

REFERENCE_METHODS = ("index", "offset", "uxo")   # "index" unless FluxKontextMultiReferenceLatentMethod says else
THETA = 10000
HEAD_DIM_AXES = {128: (16, 56, 56)}
WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


# ---- dimensions and the file layout (diffusers' names) ---------------------------------------------------------------
@dataclass(frozen=True)
class QwenDims:
    hidden: int = 3072
    heads: int = 24
    depth: int = 60
    context_in: int = 3584     # Qwen2.5-VL 7B hidden states
    in_channels: int = 64      # 16 latent channels x 2x2 packing
    axes_dim: tuple = (16, 56, 56)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


DIMS = {"full": {"qwen-image": QwenDims()},
        "tiny": {"qwen-image": QwenDims(hidden=128, heads=4, depth=4, context_in=64, axes_dim=(8, 12, 12))},
        "small": {"qwen-image": QwenDims(hidden=512, heads=4, depth=8, context_in=256, axes_dim=(16, 56, 56))}}


def shapes(d: QwenDims) -> dict[str, tuple]:
    """Every tensor of a Qwen-Image transformer (ComfyUI's and diffusers' names), with its shape."""
    h, s = d.hidden, {}
    linear_shapes(s, "img_in", h, d.in_channels)
    s["txt_norm.weight"] = (d.context_in,)
    linear_shapes(s, "txt_in", h, d.context_in)
    linear_shapes(s, "time_text_embed.timestep_embedder.linear_1", h, 256)
    linear_shapes(s, "time_text_embed.timestep_embedder.linear_2", h, h)
    for i in range(d.depth):
        b = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):
            linear_shapes(s, f"{b}.{stream}_mod.1", 6 * h, h)
            linear_shapes(s, f"{b}.{stream}_mlp.net.0.proj", 4 * h, h)
            linear_shapes(s, f"{b}.{stream}_mlp.net.2", h, 4 * h)
        for name in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            linear_shapes(s, f"{b}.attn.{name}", h, h)
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            s[f"{b}.attn.{name}.weight"] = (d.head_dim,)
    linear_shapes(s, "norm_out.linear", 2 * h, h)
    linear_shapes(s, "proj_out", d.in_channels, h)
    return s


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    hidden, in_channels = s["img_in.weight"]
    head_dim = s["transformer_blocks.0.attn.norm_q.weight"][0]
    if hidden % head_dim:
        raise CheckpointError(f"Qwen-Image width {hidden} is not a multiple of its head width {head_dim}")
    if in_channels != 64 or s["proj_out.weight"][0] != 64:
        raise CheckpointError(f"Qwen-Image transformer with {in_channels} input channels: only the 16-channel latent "
                              f"(64 packed) of Qwen-Image / Qwen-Image-Edit is supported")
    axes = HEAD_DIM_AXES.get(head_dim)
    synthetic = metadata.get("xdit.synthetic")
    if axes is None and synthetic:   # tiny test models carry their RoPE split; the real model has 128-wide heads
        axes = tuple(json.loads(synthetic)["dims"]["axes_dim"])
    if axes is None or sum(axes) != head_dim:
        raise CheckpointError(f"Qwen-Image transformer with {head_dim}-wide heads: its RoPE axes cannot be inferred "
                              f"(Qwen-Image has 128-wide heads)")
    config = {"patch_size": 2, "in_channels": 64, "out_channels": 16,
              "num_layers": count(s, r"transformer_blocks\.(\d+)\."), "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": s["txt_in.weight"][1], "guidance_embeds": False, "axes_dims_rope": axes}
    return config, "qwen-image"


# ---- positions, as ComfyUI's QwenImageTransformer2DModel builds them -------------------------------------------------
def grid(h: int, w: int) -> tuple[int, int]:
    """Patch rows and columns of a latent h x w (padded circularly up to whole 2x2 patches)."""
    return (h + 1) // 2, (w + 1) // 2


def image_ids(h: int, w: int, index: int = 0, h_offset: int = 0, w_offset: int = 0, device=None) -> torch.Tensor:
    """(index, row, col) of each patch of a latent h x w, rows first: centred on the grid (row - rows//2), offsets in
    latent pixels rounded up to patches."""
    rows, cols = grid(h, w)
    r0, c0 = (h_offset + 1) // 2 - rows // 2, (w_offset + 1) // 2 - cols // 2
    r = torch.arange(rows, device=device).repeat_interleave(cols) + r0
    c = torch.arange(cols, device=device).repeat(rows) + c0
    return torch.stack([torch.full_like(r, index), r, c], dim=1).to(torch.float32)


def text_ids(h: int, w: int, tokens: int, device=None) -> torch.Tensor:
    """(s, s, s) from s = max(rows//2, cols//2) of the output latent h x w."""
    rows, cols = grid(h, w)
    s = torch.arange(tokens, device=device) + max(rows // 2, cols // 2)
    return s.unsqueeze(1).expand(tokens, 3).to(torch.float32)


def reference_ids(method: str, shapes_hw, device=None) -> list[torch.Tensor]:
    """Each reference's ids: "index" gives reference i frame i from 1, each centred on its own grid; any other method
    gives them all index 1, tiled by offsets (base.tile_offsets)."""
    if method == "index":
        return [image_ids(h, w, i + 1, device=device) for i, (h, w) in enumerate(shapes_hw)]
    return [image_ids(h, w, 1, row, col, device) for (h, w), (row, col) in zip(shapes_hw, tile_offsets(shapes_hw))]


def rotary(ids: torch.Tensor, axes_dim: tuple, device) -> torch.Tensor:
    """Complex RoPE factors [n, head_dim/2] of position ids [n, 3], as ComfyUI's EmbedND computes them (float64
    frequencies and angles, rounded to float32), in the complex layout diffusers' Qwen attention takes."""
    parts = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / THETA ** torch.linspace(0, (dim - 2) / dim, dim // 2, dtype=torch.float64, device=device)
        angles = ids[:, axis].to(device=device, dtype=torch.float32).double()[:, None] * omega[None]
        parts.append(torch.complex(torch.cos(angles).float(), torch.sin(angles).float()))
    return torch.cat(parts, dim=1)


def pad_to_patches(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's pad_to_patch_size for 2x2 patches: circular padding at the bottom and right."""
    ph, pw = x.shape[-2] % 2, x.shape[-1] % 2
    return torch.nn.functional.pad(x, (0, pw, 0, ph), mode="circular") if ph or pw else x


def pack(x: torch.Tensor) -> torch.Tensor:
    """Latent [b, 16, h, w] -> tokens [b, rows*cols, 64] (padded, channels c, ph, pw)."""
    x = pad_to_patches(x)
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Tokens [b, rows*cols, 64] -> latent [b, 16, h, w] (the padding cropped)."""
    rows, cols = grid(h, w)
    b = tokens.shape[0]
    x = tokens.reshape(b, rows, cols, -1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, rows * 2, cols * 2)
    return x[:, :, :h, :w]


# ---- the one forward -------------------------------------------------------------------------------------------------
def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """v for x [n, 16, h, w] (model space, compute dtype): one call of the unmodified QwenImageTransformer2DModel with
    ComfyUI's positions (its RoPE table replaced for this forward) and its timestep (ComfyUI's: sigma itself) embedded
    from fp32 values."""
    b, _, h, w = x.shape
    device = flow.device
    refs = prepared.references
    tokens = [pack(x)] + [pack(r) for r in refs]
    image_tokens = tokens[0].shape[1]
    ref_shapes = [tuple(r.shape[-2:]) for r in refs]
    ids = torch.cat([image_ids(h, w, device=device)] + reference_ids(prepared.reference_method or "index", ref_shapes,
                                                                     device), dim=0)
    axes = flow.model.config.axes_dims_rope
    freqs = (rotary(ids, axes, device), rotary(text_ids(h, w, prepared.cond.shape[1], device), axes, device))
    img_shapes = [[(1, *grid(h, w))] + [(1, *grid(*s)) for s in ref_shapes]] * b
    flow.reference_tokens = sum(t.shape[1] for t in tokens) - image_tokens
    try:
        with pre_hook(flow.model.time_text_embed, lambda module, args: (timestep,) + args[1:]), \
                forward_hook(flow.model.pos_embed, lambda module, args, out: freqs, prepend=True):
            out = flow.model(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=prepared.cond,
                             encoder_hidden_states_mask=None, timestep=timestep, img_shapes=img_shapes,
                             return_dict=False)[0]
    finally:
        flow.reference_tokens = 0
    return unpack(out[:, :image_tokens], h, w)


# ---- sequence parallel: the attention processor ----------------------------------------------------------------------
class QwenSPProcessor:
    """What diffusers' QwenDoubleStreamAttnProcessor2_0 computes (RoPE on each stream, then joint attention over
    [text, image]), with the attention through the sequence-parallel entry point. The text stream is this rank's shard
    (split with the image tokens) or, with joint_text_tokens, every rank's whole text; joint_reference_tokens
    reference tokens at the end of the image stream are likewise held in full by every rank."""

    def __init__(self, attention):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
        self.attention, self.rotary = attention, apply_rotary_emb_qwen   # diffusers loads where the model runs

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None, joint_text_tokens: int = 0,
                 joint_reference_tokens: int = 0):
        if attention_mask is not None or encoder_hidden_states_mask is not None:
            raise ValueError("sequence-parallel Qwen-Image attention takes no mask (ComfyUI uses none)")
        head_dim = attn.inner_dim // attn.heads
        img = [proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        img[0], img[1] = attn.norm_q(img[0]), attn.norm_k(img[1])
        txt[0], txt[1] = attn.norm_added_q(txt[0]), attn.norm_added_k(txt[1])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img[0], img[1] = (self.rotary(t, img_freqs, use_real=False) for t in img[:2])
            if txt[0].shape[1]:   # a PipeFusion patch step after the first carries no text
                txt[0], txt[1] = (self.rotary(t, txt_freqs, use_real=False) for t in txt[:2])
        n_txt, m = txt[0].shape[1], joint_reference_tokens
        # the sharded sequence: [text shard] + image shard; the joint part: [whole text] + [references]
        seq = [t[:, :t.shape[1] - m] for t in img]
        joint = [t[:, t.shape[1] - m:] for t in img] if m else None
        if joint_text_tokens:
            joint = [torch.cat([a, b], dim=1) for a, b in zip(txt, joint)] if joint else txt
        else:
            seq = [torch.cat([a, b], dim=1) for a, b in zip(txt, seq)]
        out, held = self.attention(*seq, joint=tuple(joint) if joint else None)
        if joint_text_tokens:
            txt_out, image_out = held[:, :n_txt], out
            refs_out = held[:, n_txt:]
        else:
            txt_out, image_out = out[:, :n_txt], out[:, n_txt:]
            refs_out = held if m else None
        if refs_out is not None and refs_out.shape[1]:
            image_out = torch.cat([image_out, refs_out], dim=1)
        image_out = image_out.flatten(2, 3).to(img[0].dtype)
        txt_out = txt_out.flatten(2, 3).to(img[0].dtype)
        image_out = attn.to_out[0](image_out.contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(txt_out.contiguous())


# ---- PipeFusion: a stage's share of the forward ----------------------------------------------------------------------
class QwenStage(StageModel):
    """Stages run the blocks directly with the positions of the tokens they hold (the model's forward is not called).
    The latent must be whole patches (no circular padding across patch bands)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ropes: dict = {}

    def temb(self, prepared, sigma32: torch.Tensor) -> torch.Tensor:
        n = prepared.cond.shape[0]
        return self.model.time_text_embed(sigma32.reshape(-1).expand(n), prepared.cond)

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        image = self.model.img_in(pack(x)[:, self.band_index(band)])
        text = (self.model.txt_in(self.model.txt_norm(prepared.cond)) if with_text
                else image.new_zeros(x.shape[0], 0, image.shape[2]))
        return text, image

    def _rope(self, band, n_text: int, device):
        key = (band, n_text)
        if key not in self._ropes:   # built on the device, once per piece shape
            h, w = self.layout.rows * 2, self.layout.cols * 2
            axes = self.model.config.axes_dims_rope
            ids = image_ids(h, w, device=device)[self.local_index(band)]
            self._ropes[key] = (rotary(ids, axes, device), rotary(text_ids(h, w, n_text, device), axes, device))
        return self._ropes[key]

    def run_blocks(self, text, image, temb, band, with_text: bool):
        rope = self._rope(band, text.shape[1], image.device)
        kwargs = {"joint_text_tokens": text.shape[1]}
        for block in self.blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                                temb=temb, image_rotary_emb=rope, joint_attention_kwargs=kwargs)
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb))

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        rows, cols = self.band_grid(band)
        return unpack(tokens, 2 * rows, 2 * cols)


def _model_class():
    from diffusers import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel


def _rebuild_rope(model) -> None:
    """diffusers' QwenEmbedRope keeps its tables as plain tensors (not buffers): built on the meta device they hold
    nothing, so the module is built again (its forward runs before ComfyUI's positions replace its output)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
    model.pos_embed = QwenEmbedRope(theta=THETA, axes_dim=list(model.config.axes_dims_rope), scale_rope=True)


FAMILY = Family(
    name="qwen-image", title="Qwen-Image", variants=("qwen-image",),
    markers=(Marker("txt_norm.weight", "diffusers"),),
    infer=infer, key_map=lambda layout, config: None, model_class=_model_class, gguf_arches=("qwen_image",),
    compute_dtypes=("fp32", "bf16"), compute_dtypes_cite="comfy/supported_models.py:2000",
    layers=lambda config: config["num_layers"],
    latent=LatentFormat("Wan21", channels=16, scale_factor=1.0, mean=WAN21_MEAN, std=WAN21_STD, spatial_dims=3),
    latent_patch=lambda config: 2, pads_to_patches=True,
    sampling=lambda variant: FlowSampling.flux(1.15),
    comfy_model=lambda config: ("QwenImage", {"image_model": "qwen_image"}),
    cond_width=lambda config: config["joint_attention_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, cfg=2.5, text_tokens=256, reference_methods=REFERENCE_METHODS,
    stock_jobs={"qwen-image": StockJob("qwen-image", 1328, 1328, 20, 2.5, shift=3.1)},
    tokens=TokenTable(processor=QwenSPProcessor, gather_after="proj_out", split_inputs=(("hidden_states", 1),),
                      text_inputs=(("encoder_hidden_states", 1),), split_after=(("pos_embed", 0, 0),),
                      text_after=(("pos_embed", 1, 0),), blocks=("transformer_blocks",), reference_tokens=True,
                      kwargs_name="attention_kwargs"),
    stage=QwenStage,
    stage_params=StageParams(every=("time_text_embed.",), first=("img_in.", "txt_norm.", "txt_in."),
                             last=("norm_out.", "proj_out.")),
    text_splits=True, text_stream=("txt_", "add_", "to_add_out"), modulation=("_mod.",),
    native_layout="diffusers", dims=DIMS, shapes=shapes, rebuild_off_meta=_rebuild_rope,
    describe_blocks=lambda c: f"{c['num_layers']} MMDiT blocks",
    describe_conditioning=lambda c: (f"cond [B, N, {c['joint_attention_dim']}] (Qwen2.5-VL), no pooled output, no "
                                     f"guidance; reference latents from the edit nodes"),
    text_encoder=lambda variant: "Qwen2.5-VL 7B (CLIPLoader type qwen_image with "
                                 "qwen_2.5_vl_7b_fp8_scaled.safetensors)",
    comfyui_since=lambda variant: "0.3.49",   # its QwenImage model: c0124002, first released in 0.3.49
)
