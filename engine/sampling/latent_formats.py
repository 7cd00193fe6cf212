"""Latent formats of the flow families: the affine map between raw VAE latents and the model's latent space (ComfyUI's Flux / SD3)."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class LatentFormat:
    """x_model = (latent_raw - shift_factor) * scale_factor, and back."""

    family: str
    scale_factor: float
    shift_factor: float
    channels: int = 16

    def process_in(self, latent_raw: torch.Tensor) -> torch.Tensor:
        return (latent_raw - self.shift_factor) * self.scale_factor

    def process_out(self, x_model: torch.Tensor) -> torch.Tensor:
        return (x_model / self.scale_factor) + self.shift_factor


FORMATS = MappingProxyType({
    "flux": LatentFormat("flux", scale_factor=0.3611, shift_factor=0.1159),
    "sd3": LatentFormat("sd3", scale_factor=1.5305, shift_factor=0.0609),
})


def latent_format(family: str) -> LatentFormat:
    try:
        return FORMATS[family]
    except (KeyError, TypeError):
        raise ValueError(f"family={family!r} has no latent format; use one of {sorted(FORMATS)}") from None
