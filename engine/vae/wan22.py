"""The Wan 2.2 VAE (48 latent channels, 16x spatial) on row bands: ComfyUI 0.33's comfy/ldm/wan/vae2_2.py computed
band by band, with its chunk loops and caches, ComfyUI's parameter names (its files load as they are).

ComfyUI's loops (vae2_2.py:659-705): the pixels patchified 2x2 into 12 channels, the first frame encoded alone, then
four frames a chunk, `conv1` and the mean; decode runs `conv2` over the whole latent, then one latent frame a chunk,
the first marked `first_chunk` (its residual upsample shortcuts drop their first frames), then un-patchifies. The
space-to-channel shortcuts (AvgDown3D, DupUp3D) and the (un)patchify move data within a 2x2 square, so they stay
within a band whose rows are even at every level (the split is in latent rows).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import CausalConv3d
from .wan import DIM_MULT, NUM_RES_BLOCKS, TEMPORAL_DOWN, Head, ResidualBlock, Resample, causal, middle

PATCH = 2


def patchify(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, 2h, 2w] -> [B, 4C, T, h, w], channels ordered (c, column offset, row offset) (vae2_2.py:162-178)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // PATCH, PATCH, w // PATCH, PATCH)
    return x.permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * PATCH * PATCH, t, h // PATCH, w // PATCH)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """The inverse of patchify (vae2_2.py:181-195)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, t, h, w)
    return x.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c // (PATCH * PATCH), t, h * PATCH, w * PATCH)


def avg_down(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """AvgDown3D (vae2_2.py:198-249): zero frames in front to a whole number of `factor_t`, each factor_t x factor_s x
    factor_s block moved into channels, then the mean over each output channel's group."""
    pad_t = (factor_t - x.shape[2] % factor_t) % factor_t
    if pad_t:
        x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, out_channels, -1, t // factor_t, h // factor_s, w // factor_s)
    return x.mean(dim=2)


def dup_up(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool) -> torch.Tensor:
    """DupUp3D (vae2_2.py:252-294): channels repeated, then spread over factor_t frames and factor_s x factor_s
    pixels; the first chunk drops its first factor_t - 1 frames."""
    b, c, t, h, w = x.shape
    x = x.repeat_interleave(out_channels * factor_t * factor_s * factor_s // c, dim=1)
    x = x.reshape(b, out_channels, factor_t, factor_s, factor_s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, out_channels, t * factor_t, h * factor_s, w * factor_s)
    return x[:, :, factor_t - 1:] if first_chunk else x


class DownBlock(nn.Module):
    """Down_ResidualBlock (vae2_2.py:297-334): residual blocks and a downsample, plus the averaged shortcut."""

    def __init__(self, in_dim: int, out_dim: int, temporal: bool, down: bool):
        super().__init__()
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1
        layers = []
        for _ in range(NUM_RES_BLOCKS):
            layers.append(ResidualBlock(in_dim, out_dim, keep_two=True))
            in_dim = out_dim
        if down:
            layers.append(Resample(out_dim, "downsample3d" if temporal else "downsample2d", keep_two=True))
        self.downsamples = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        y = x
        for layer in self.downsamples:
            y = layer(y, cache)
        return y + avg_down(x, self.out_dim, self.factor_t, self.factor_s)


class UpBlock(nn.Module):
    """Up_ResidualBlock (vae2_2.py:337-379): residual blocks and an upsample, plus the duplicated shortcut."""

    def __init__(self, in_dim: int, out_dim: int, temporal: bool, up: bool):
        super().__init__()
        self.out_dim, self.up, self.factor_t = out_dim, up, 2 if temporal else 1
        layers = []
        for _ in range(NUM_RES_BLOCKS + 1):
            layers.append(ResidualBlock(in_dim, out_dim, keep_two=True))
            in_dim = out_dim
        if up:
            layers.append(Resample(out_dim, "upsample3d" if temporal else "upsample2d", out_dim, keep_two=True))
        self.upsamples = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, cache: dict, first_chunk: bool) -> torch.Tensor:
        y = x
        for layer in self.upsamples:
            y = layer(y, cache)
        if not self.up:
            return y
        return y + dup_up(x, self.out_dim, self.factor_t, 2, first_chunk)


class Encoder22(nn.Module):
    """Wan 2.2's Encoder3d (vae2_2.py:382-495), one chunk at a time."""

    def __init__(self, dim: int, z_dim: int):
        super().__init__()
        dims = [dim * u for u in (1,) + DIM_MULT]
        self.conv1 = CausalConv3d(3 * PATCH * PATCH, dims[0], 3, padding=1)
        self.downsamples = nn.Sequential(*(
            DownBlock(in_dim, out_dim, i < len(TEMPORAL_DOWN) and TEMPORAL_DOWN[i], i != len(DIM_MULT) - 1)
            for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:]))))
        self.middle = middle(dims[-1], keep_two=True)
        self.head = Head(dims[-1], z_dim, keep_two=True)

    def forward(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        x = causal(self.conv1, x, cache, keep_two=True)
        for layer in self.downsamples:
            x = layer(x, cache)
        for layer in self.middle:
            x = layer(x, cache)
        return self.head(x, cache)


class Decoder22(nn.Module):
    """Wan 2.2's Decoder3d (vae2_2.py:498-604), one chunk at a time."""

    def __init__(self, dim: int, z_dim: int):
        super().__init__()
        dims = [dim * u for u in (DIM_MULT[-1],) + DIM_MULT[::-1]]
        temporal_up = TEMPORAL_DOWN[::-1]
        self.conv1 = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.middle = middle(dims[0], keep_two=True)
        self.upsamples = nn.Sequential(*(
            UpBlock(in_dim, out_dim, i < len(temporal_up) and temporal_up[i], i != len(DIM_MULT) - 1)
            for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:]))))
        self.head = Head(dims[-1], 3 * PATCH * PATCH, keep_two=True)

    def forward(self, x: torch.Tensor, cache: dict, first_chunk: bool) -> torch.Tensor:
        x = causal(self.conv1, x, cache, keep_two=True)
        for layer in self.middle:
            x = layer(x, cache)
        for layer in self.upsamples:
            x = layer(x, cache, first_chunk)
        return self.head(x, cache)


class WanVAE22(nn.Module):
    """Wan 2.2's VAE (vae2_2.py:615-705). ComfyUI builds it at dim 160, decoder dim 256, z 48 whatever the file
    (sd.py:823-825); here the widths come from the file (`dim` from encoder.conv1, `dec_dim` from decoder.head.0), the
    same for every released file."""
    spatial = 16

    def __init__(self, dim: int = 160, dec_dim: int = 256, z_dim: int = 48):
        super().__init__()
        self.z_dim = z_dim
        self.encoder = Encoder22(dim, z_dim * 2)
        self.conv1 = CausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.conv2 = CausalConv3d(z_dim, z_dim, 1)
        self.decoder = Decoder22(dec_dim, z_dim)

    @staticmethod
    def decode_chunks(frames: int) -> int:
        return frames

    @staticmethod
    def encode_chunks(frames: int) -> int:
        return 1 + (frames - 1) // 4

    def decode(self, z: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, z_dim, T, h, w] (this rank's rows) -> [B, 3, 4T-3, 16h, 16w]; on_chunk(i, n) after each chunk."""
        x = self.conv2(z)
        cache, out = {}, []
        for i in range(z.shape[2]):
            out.append(self.decoder(x[:, :, i:i + 1], cache, first_chunk=i == 0))
            if on_chunk is not None:
                on_chunk(i, z.shape[2])
        return unpatchify(torch.cat(out, 2))

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, 3, T, 16h, 16w] (this rank's rows) -> the latent mean [B, z_dim, 1 + (T-1)//4, h, w]."""
        x = patchify(x)
        chunks = self.encode_chunks(x.shape[2])
        cache, out = {}, []
        for i in range(chunks):
            out.append(self.encoder(x[:, :, :1] if i == 0 else x[:, :, 1 + 4 * (i - 1):1 + 4 * i], cache))
            if on_chunk is not None:
                on_chunk(i, chunks)
        return self.conv1(torch.cat(out, 2))[:, :self.z_dim]
