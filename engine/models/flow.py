"""An unmodified diffusers FLUX/SD3 transformer seen the way ComfyUI's sampler sees a flow model.

`velocity(x_model, sigma, prepared)` is one forward pass with ComfyUI's conventions: FLUX packs 2x2 latent patches
with (c, ph, pw) channel order and position ids (0, row, col), takes sigma as its timestep and a guidance value;
SD3 takes sigma * 1000. FLUX.1 Kontext reference latents (ComfyUI's ReferenceLatent) become extra tokens after the
image tokens, packed the same way, with the position ids ComfyUI's Flux model gives them; only the image tokens'
output is kept. The timestep and guidance embeddings are computed from fp32 values whatever the compute
dtype (ComfyUI does; diffusers' FLUX would first round timestep * 1000 to the weights' dtype), through a pre-hook
on the embedding module that lives for exactly one forward. Nothing here knows about ranks: parallel methods are
applied around this class by engine/parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.latent_formats import latent_format
from .load import LoadedTransformer

REFERENCE_METHODS = ("offset", "index", "uxo")   # ComfyUI's FluxKontextMultiReferenceLatentMethod ("uxo/uno": uxo)


@dataclass
class Conditioning:
    """One side of the conditioning, as ComfyUI's CONDITIONING holds it: cond [B|1, N, 4096] and pooled
    [B|1, D]; FLUX adds guidance (FluxGuidance, default 3.5) and Kontext's reference latents (raw VAE latents
    [B|1, 16, h, w], ReferenceLatent) with the method that places them (FluxKontextMultiReferenceLatentMethod)."""
    cond: torch.Tensor
    pooled: torch.Tensor
    guidance: float | None = None
    references: tuple[torch.Tensor, ...] = ()
    reference_method: str = "offset"

    @property
    def forward_shape(self) -> tuple:
        """What must agree for two sides to share one forward: their token counts and reference positions."""
        refs = tuple(tuple(r.shape[1:]) for r in self.references)
        return self.cond.shape[1], refs, self.reference_method if refs else None


@dataclass(frozen=True)
class Prepared:
    """Conditioning for one forward, on the model's device and dtype: the sides stacked along the batch."""
    cond: torch.Tensor
    pooled: torch.Tensor
    guidance: torch.Tensor        # fp32, one value per batch row
    references: tuple[torch.Tensor, ...] = ()   # model space, one row per batch row, like cond
    reference_method: str = "offset"


def _rows(t: torch.Tensor, batch: int, items: slice) -> torch.Tensor:
    if t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])[items]
    if t.shape[0] == batch:
        return t[items]
    raise ValueError(f"conditioning batch {t.shape[0]} does not match the latent batch {batch}: give 1 or {batch}")


class FlowModel:
    def __init__(self, loaded: LoadedTransformer):
        self.loaded = loaded
        self.model = loaded.model
        self.family = loaded.family
        self.dtype = loaded.dtype
        self.device = next(p for p in self.model.parameters() if not p.is_meta).device  # a stage holds part
        # reference tokens at the end of the current forward's image tokens: the parallel token hooks read it
        self.reference_tokens = 0

    def prepare(self, sides: list[Conditioning], batch: int, items: slice = slice(None)) -> Prepared:
        """The sides' conditioning for latent items `items` of a batch of `batch`, stacked side after side."""
        cond = torch.cat([_rows(s.cond, batch, items) for s in sides]).to(self.device, self.dtype)
        pooled = torch.cat([_rows(s.pooled, batch, items) for s in sides]).to(self.device, self.dtype)
        per_side = len(range(batch)[items])
        guidance = torch.tensor([3.5 if s.guidance is None else float(s.guidance) for s in sides],
                                dtype=torch.float32, device=self.device).repeat_interleave(per_side)
        if len({s.forward_shape[1:] for s in sides}) > 1:
            raise ValueError("sides with different reference latents cannot share one forward: run one per side")
        # as ComfyUI's Flux.extra_conds: each reference to model space in its own dtype, then to the compute dtype
        fmt = latent_format(self.family) if sides[0].references else None
        references = tuple(
            torch.cat([_rows(fmt.process_in(s.references[i]), batch, items) for s in sides]).to(self.device, self.dtype)
            for i in range(len(sides[0].references)))
        return Prepared(cond, pooled, guidance, references, sides[0].reference_method)

    @torch.no_grad()
    def velocity(self, x_model: torch.Tensor, sigma: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        """v for latents x_model [n, 16, h, w] (model space) at `sigma`, float32, shaped like x_model."""
        n = x_model.shape[0]
        sigma32 = sigma.detach().to(torch.float32).reshape(-1).expand(n).to(self.device)
        x = x_model.to(self.device, self.dtype)
        if self.family == "flux":
            return self._flux(x, sigma32, prepared).to(torch.float32)
        with self._fp32_embedding(sigma32 * 1000.0, None):
            v = self.model(hidden_states=x, encoder_hidden_states=prepared.cond, pooled_projections=prepared.pooled,
                           timestep=sigma32 * 1000.0, return_dict=False)[0]
        return v.to(torch.float32)

    def _flux(self, x: torch.Tensor, sigma32: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        b, c, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"FLUX latent {h}x{w} is not a multiple of its 2x2 patches: width and height must be "
                             f"multiples of 16 pixels")
        packed, img_ids = self._patches(x, 0, 0, 0)
        image_tokens = packed.shape[1]
        if prepared.references:
            places = reference_positions(prepared.reference_method, (h, w), [r.shape[-2:] for r in prepared.references])
            parts = [self._patches(r, *place) for r, place in zip(prepared.references, places)]
            packed = torch.cat([packed] + [p for p, _ in parts], dim=1)
            img_ids = torch.cat([img_ids] + [i for _, i in parts], dim=0)
        txt_ids = torch.zeros(prepared.cond.shape[1], 3, device=self.device)
        guidance = prepared.guidance if self.model.config.guidance_embeds else None
        self.reference_tokens = packed.shape[1] - image_tokens
        try:
            with self._fp32_embedding(sigma32 * 1000.0, guidance * 1000.0 if guidance is not None else None):
                out = self.model(hidden_states=packed, encoder_hidden_states=prepared.cond,
                                 pooled_projections=prepared.pooled, timestep=sigma32, img_ids=img_ids,
                                 txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
        finally:
            self.reference_tokens = 0
        out = out[:, :image_tokens]
        return out.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def _patches(self, x: torch.Tensor, index: int, row0: int, col0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """2x2 patches of x [b, c, h, w] as tokens [b, h/2 * w/2, c*4] (channel order c, ph, pw) and their position
        ids (index, row0 + row, col0 + col), rows first."""
        b, c, h, w = x.shape
        packed = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        rows = torch.arange(h // 2, device=self.device).repeat_interleave(w // 2) + row0
        cols = torch.arange(w // 2, device=self.device).repeat(h // 2) + col0
        ids = torch.stack([torch.full_like(rows, index), rows, cols], dim=1).to(torch.float32)
        return packed, ids

    def _fp32_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None):
        """For one forward: the timestep (and guidance) embedding gets these fp32 values instead of the ones diffusers
        rounded to the compute dtype."""
        def exact(module, args):
            if len(args) == 3:  # FLUX with guidance: (timestep, guidance, pooled)
                return (timestep, guidance, args[2])
            return (timestep, args[1])
        return _Hooked(self.model.time_text_embed, exact)


def reference_positions(method: str, latent_hw: tuple[int, int], shapes) -> list[tuple[int, int, int]]:
    """(index, first row, first column) of each reference's patch grid, in patches, as ComfyUI's Flux model places
    them (offsets are counted in latent pixels, then halved rounding up). "offset": every reference on index 1,
    each next to the ones before it, along the side that keeps the covered area squarer; "index": each its own
    index from 1, at the origin; "uxo": index 0, diagonally past the image and the references before it."""
    places, h, w, index = [], 0, 0, 0
    for ref_h, ref_w in shapes:
        if method == "index":
            index, row, col = index + 1, 0, 0
        elif method == "uxo":
            index, row, col = 0, latent_hw[0] + h, latent_hw[1] + w
            h, w = h + ref_h, w + ref_w
        elif method == "offset":
            index, row, col = 1, 0, 0
            if ref_h + h > ref_w + w:
                col = w
            else:
                row = h
            h, w = max(h, ref_h + row), max(w, ref_w + col)
        else:
            raise ValueError(f"reference_latents_method={method!r} is invalid: use one of {list(REFERENCE_METHODS)}")
        places.append((index, (row + 1) // 2, (col + 1) // 2))
    return places


class _Hooked:
    """A forward pre-hook on `module` for the duration of a with-block."""

    def __init__(self, module: torch.nn.Module, hook):
        self.module, self.hook, self.handle = module, hook, None

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self.hook)

    def __exit__(self, *exc):
        self.handle.remove()
