"""Latent formats: the map between a LATENT's raw VAE values and the model's latent space, as ComfyUI's latent format
classes define it (each family names its own in engine/families)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class LatentFormat:
    """x_model = (latent_raw - shift_factor) * scale_factor, or with per-channel statistics (video VAEs such as
    Wan 2.1's): x_model = (latent_raw - mean_c) * scale_factor / std_c; and back.

    spatial_dims: 2 for image latents [B, C, H, W]; 3 for video latents [B, C, T, H, W] (ComfyUI gives a 3-D format's
    model a one-frame 5-D LATENT for a still image)."""

    name: str                              # ComfyUI's latent format class, e.g. "Flux", "SD3", "Wan21"
    channels: int = 16
    scale_factor: float = 1.0
    shift_factor: float = 0.0
    mean: tuple[float, ...] | None = None  # per channel
    std: tuple[float, ...] | None = None
    spatial_dims: int = 2
    downscale: int = 8                     # image pixels per latent pixel
    temporal_downscale: int = 1            # video frames per latent frame after the first (ComfyUI's
    #                                        temporal_downscale_ratio: a video of 4k + 1 frames has k + 1)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.channels) + (1,) * (like.ndim - 2)
        mean, std = _stats_on(self.mean, self.std, like.device, like.dtype)
        return mean.view(shape), std.view(shape)

    def process_in(self, latent_raw: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            mean, std = self._stats(latent_raw)
            return (latent_raw - mean) * self.scale_factor / std
        return (latent_raw - self.shift_factor) * self.scale_factor

    def process_out(self, x_model: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            mean, std = self._stats(x_model)
            return x_model * std / self.scale_factor + mean
        return (x_model / self.scale_factor) + self.shift_factor

    def image(self) -> "LatentFormat":
        """This format for the image latent [B, C, H, W] of a one-frame video latent [B, C, 1, H, W] (the same
        map; what PipeFusion's row bands work on)."""
        return replace(self, spatial_dims=2)

    @property
    def ndim(self) -> int:
        """Dimensions of the LATENT's samples: batch, channels and the spatial (and time) axes."""
        return 2 + self.spatial_dims

    def shape_rule(self, frames: bool = False) -> str:
        """The LATENT shape in words, e.g. "[B, 16, H/8, W/8]"; a 3-D format's time axis is one frame (a still
        image) unless the model takes `frames`."""
        d = self.downscale
        time = ("F, " if frames else "1, ") if self.spatial_dims == 3 else ""
        return f"[B, {self.channels}, {time}H/{d}, W/{d}]"

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a video of `frames` frames (ComfyUI's empty video latents: (frames - 1) // 4 + 1)."""
        return (frames - 1) // self.temporal_downscale + 1

    def pixel_frames(self, latent_frames: int) -> int:
        """The frames a video of `latent_frames` latent frames has (latent_frames undone)."""
        return (latent_frames - 1) * self.temporal_downscale + 1

    def frames_rule(self) -> str:
        """The frame counts ComfyUI's video nodes make for this format, in words."""
        step = self.temporal_downscale
        return f"{step}k + 1 frames (1, {1 + step}, {1 + 2 * step}, ...)"

    def nearest_frames(self, frames: int) -> tuple[int, int] | None:
        """None when ComfyUI's video nodes make `frames` frames for this format, else the counts below and above."""
        step = self.temporal_downscale
        off = (frames - 1) % step
        return None if not off else (frames - off, frames - off + step)

    def frames_formula(self) -> str:
        return f"F = (frames - 1) // {self.temporal_downscale} + 1"


@functools.lru_cache(maxsize=32)
def _stats_on(mean: tuple, std: tuple, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A format's per-channel mean and std on a device, copied there once: a copy from host memory at each process_in
    or process_out would make the host wait for the device at the end of every job."""
    return (torch.tensor(mean, device=device).to(dtype), torch.tensor(std, device=device).to(dtype))
