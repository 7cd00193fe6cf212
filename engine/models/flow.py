"""An unmodified diffusers FLUX/SD3 transformer seen the way ComfyUI's sampler sees a flow model.

`velocity(x_model, sigma, prepared)` is one forward pass with ComfyUI's conventions: FLUX packs 2x2 latent patches
with (c, ph, pw) channel order and position ids (0, row, col), takes sigma as its timestep and a guidance value;
SD3 takes sigma * 1000. The timestep and guidance embeddings are computed from fp32 values whatever the compute
dtype (ComfyUI does; diffusers' FLUX would first round timestep * 1000 to the weights' dtype), through a pre-hook
on the embedding module that lives for exactly one forward. Nothing here knows about ranks: parallel methods are
applied around this class by engine/parallel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .load import LoadedTransformer


@dataclass
class Conditioning:
    """One side of the conditioning, as ComfyUI's CONDITIONING holds it: cond [B|1, N, 4096] and pooled
    [B|1, D]; FLUX adds guidance (FluxGuidance, default 3.5)."""
    cond: torch.Tensor
    pooled: torch.Tensor
    guidance: float | None = None


@dataclass(frozen=True)
class Prepared:
    """Conditioning for one forward, on the model's device and dtype: the sides stacked along the batch."""
    cond: torch.Tensor
    pooled: torch.Tensor
    guidance: torch.Tensor        # fp32, one value per batch row


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

    def prepare(self, sides: list[Conditioning], batch: int, items: slice = slice(None)) -> Prepared:
        """The sides' conditioning for latent items `items` of a batch of `batch`, stacked side after side."""
        cond = torch.cat([_rows(s.cond, batch, items) for s in sides]).to(self.device, self.dtype)
        pooled = torch.cat([_rows(s.pooled, batch, items) for s in sides]).to(self.device, self.dtype)
        per_side = len(range(batch)[items])
        guidance = torch.tensor([3.5 if s.guidance is None else float(s.guidance) for s in sides],
                                dtype=torch.float32, device=self.device).repeat_interleave(per_side)
        return Prepared(cond, pooled, guidance)

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
        packed = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        rows = torch.arange(h // 2, device=self.device).repeat_interleave(w // 2)
        cols = torch.arange(w // 2, device=self.device).repeat(h // 2)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(torch.float32)
        txt_ids = torch.zeros(prepared.cond.shape[1], 3, device=self.device)
        guidance = prepared.guidance if self.model.config.guidance_embeds else None
        with self._fp32_embedding(sigma32 * 1000.0, guidance * 1000.0 if guidance is not None else None):
            out = self.model(hidden_states=packed, encoder_hidden_states=prepared.cond,
                             pooled_projections=prepared.pooled, timestep=sigma32, img_ids=img_ids, txt_ids=txt_ids,
                             guidance=guidance, return_dict=False)[0]
        return out.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def _fp32_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None):
        """For one forward: the timestep (and guidance) embedding gets these fp32 values instead of the ones diffusers
        rounded to the compute dtype."""
        def exact(module, args):
            if len(args) == 3:  # FLUX with guidance: (timestep, guidance, pooled)
                return (timestep, guidance, args[2])
            return (timestep, args[1])
        return _Hooked(self.model.time_text_embed, exact)


class _Hooked:
    """A forward pre-hook on `module` for the duration of a with-block."""

    def __init__(self, module: torch.nn.Module, hook):
        self.module, self.hook, self.handle = module, hook, None

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self.hook)

    def __exit__(self, *exc):
        self.handle.remove()
