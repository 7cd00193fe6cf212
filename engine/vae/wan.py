"""The Wan 2.1 VAE (also Qwen-Image's) and the blocks Wan 2.2's shares, on row bands: ComfyUI 0.33's decode and encode
(comfy/ldm/wan/vae.py) computed band by band with the row layers of layers.py, the chunk loops ComfyUI runs and its
temporal caches. The modules carry ComfyUI's parameter names, so a ComfyUI Wan VAE file loads as it is.

ComfyUI's loops (vae.py:461-511): decode runs `conv2` over the whole latent, then the first latent frame alone, then two
latent frames a chunk, the decoder cutting each temporal upsample's output into two-frame pieces (`run_up`,
vae.py:363-398); encode cuts the clip to 1 + 4k frames, runs the first frame alone, then two frames a chunk, each
temporal downsample deferring a lone frame to the next chunk (vae.py:129-150), then `conv1` and the mean. Caches are
kept per layer (ComfyUI keeps them in a list indexed in call order: the same layers in the same order).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import CausalConv3d, RowConv2d, RowDownConv2d, RowLayer, gathered_attention

CACHE_T = 2          # frames a causal conv's cache keeps (vae.py:13)
REPEAT = "Rep"       # ComfyUI's mark of a temporal upsample that has seen its first chunk (vae.py:104-109)
DIM_MULT = (1, 2, 4, 4)
NUM_RES_BLOCKS = 2
TEMPORAL_DOWN = (False, True, True)   # sd.py:836-837 (and 823-824 for Wan 2.2)


class RMSNorm(nn.Module):
    """ComfyUI's RMS_norm (vae.py:50-64): per position over channels, x / |x| * sqrt(C) * gamma."""

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma.to(x)


def causal(conv: CausalConv3d, x: torch.Tensor, cache: dict, keep_two: bool = False) -> torch.Tensor:
    """One cached step of a causal conv: the band haloed, the conv over the frames cached before it, then the cache
    the last CACHE_T frames of the haloed band; keep_two (Wan 2.2, vae2_2.py:143-153): a one-frame chunk keeps the
    previous cache's last frame before it."""
    x = conv.halo(x)
    previous = cache.get(conv)
    kept = x[:, :, -CACHE_T:]
    if keep_two and kept.shape[2] < 2 and previous is not None:
        kept = torch.cat([previous[:, :, -1:], kept], 2)
    out = conv(x, previous)
    cache[conv] = kept.clone()
    return out


class ResidualBlock(nn.Module):
    """RMS_norm, SiLU, causal conv, RMS_norm, SiLU, causal conv, plus a 1x1x1 shortcut where widths differ
    (vae.py:154-181; Wan 2.2's caches, vae2_2.py:117-159, with keep_two)."""

    def __init__(self, in_dim: int, out_dim: int, keep_two: bool = False):
        super().__init__()
        self.keep_two = keep_two
        self.residual = nn.Sequential(
            RMSNorm(in_dim, images=False), nn.SiLU(), CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMSNorm(out_dim, images=False), nn.SiLU(), nn.Dropout(0.0), CausalConv3d(out_dim, out_dim, 3, padding=1))
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        h = x
        for layer in self.residual:
            h = causal(layer, h, cache, self.keep_two) if isinstance(layer, CausalConv3d) else layer(h)
        return h + self.shortcut(x)


class AttentionBlock(RowLayer, nn.Module):
    """Single-head attention over each frame's positions (vae.py:184-212): queries from the band, keys and values from
    the whole frame (layers.gathered_attention). `attention`: ComfyUI's kernel for the device (split or sdpa)."""
    attention = "split"

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        q, k, v = self.to_qkv(y).chunk(3, dim=1)
        y = self.proj(gathered_attention(q, k, v, self.split, self.attention))
        return y.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4) + x


def per_frame(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A 2-D module on every frame of [B, C, T, H, W] (ComfyUI's rearrange 'b c t h w -> (b t) c h w' and back)."""
    b, c, t, h, w = x.shape
    y = module(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    return y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


class Resample(nn.Module):
    """ComfyUI's Resample (vae.py:67-151; vae2_2.py:16-114): nearest-exact 2x and a 3x3 conv (to out_dim channels),
    plus for upsample3d a (3,1,1) time conv doubling the frames, not run on the first chunk (REPEAT) and zero-padded
    on the second; or a stride-2 3x3 conv after a (0,1,0,1) zero pad, plus for downsample3d a stride-2 (3,1,1) time
    conv over the previous chunk's last frame and this chunk. defer (Wan 2.1): a downsample3d's lone output frame waits
    for the next chunk unless `final`; keep_two (Wan 2.2): caches as ComfyUI 2.2 keeps them."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None, defer: bool = False, keep_two: bool = False):
        super().__init__()
        self.mode, self.defer, self.keep_two = mode, defer, keep_two
        if mode in ("upsample2d", "upsample3d"):
            self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          RowConv2d(dim, out_dim, 3, padding=1))
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode in ("downsample2d", "downsample3d"):
            # ComfyUI's ZeroPad2d((0, 1, 0, 1)) is the row conv's own: the row below comes from the next rank
            self.resample = nn.Sequential(nn.Identity(), RowDownConv2d(dim, dim, 3, stride=(2, 2)))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=(0, 0, 0))
        else:
            raise ValueError(f"Resample mode {mode!r}")

    def forward(self, x: torch.Tensor, cache: dict, final: bool = False) -> torch.Tensor | None:
        if self.mode == "upsample3d":
            x = self._time_up(x, cache)
        x = per_frame(self.resample, x)
        if self.mode == "downsample3d":
            return self._time_down(x, cache, final)
        return x

    def _time_up(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        previous = cache.get(self)
        if previous is None:   # the first chunk: its frame is not time-upsampled
            cache[self] = REPEAT
            return x
        b, c, t, h, w = x.shape
        kept = x[:, :, -CACHE_T:]
        if self.keep_two and kept.shape[2] < 2:
            kept = torch.cat([torch.zeros_like(kept) if previous is REPEAT else previous[:, :, -1:], kept], 2)
        x = self.time_conv(x, None if previous is REPEAT else previous)
        cache[self] = kept.clone()
        x = x.reshape(b, 2, c, t, h, w)
        return torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)

    def _time_down(self, x: torch.Tensor, cache: dict, final: bool) -> torch.Tensor | None:
        previous = cache.get(self)
        if previous is None:   # the first chunk: kept, not time-downsampled
            cache[self] = x[:, :, -1:].clone()
            return x
        cache[self] = x[:, :, -1:].clone()
        x = self.time_conv(torch.cat([previous, x], 2))
        if not self.defer:
            return x
        deferred = cache.pop((self, "deferred"), None)
        if deferred is not None:
            x = torch.cat([deferred, x], 2)
        if x.shape[2] == 1 and not final:
            cache[(self, "deferred")] = x
            return None
        return x


class Head(nn.Sequential):
    """RMS_norm, SiLU, causal conv (vae.py:265-267, 359-361)."""

    def __init__(self, dim: int, out_dim: int, keep_two: bool = False):
        super().__init__(RMSNorm(dim, images=False), nn.SiLU(), CausalConv3d(dim, out_dim, 3, padding=1))
        self.keep_two = keep_two

    def forward(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        return causal(self[2], self[1](self[0](x)), cache, self.keep_two)


def middle(dim: int, keep_two: bool = False) -> nn.Sequential:
    """Residual block, attention, residual block (vae.py:260-262, 335-337)."""
    return nn.Sequential(ResidualBlock(dim, dim, keep_two), AttentionBlock(dim), ResidualBlock(dim, dim, keep_two))


class Encoder21(nn.Module):
    """Wan 2.1's Encoder3d (vae.py:215-305), one chunk at a time."""

    def __init__(self, dim: int, z_dim: int, image_channels: int):
        super().__init__()
        dims = [dim * u for u in (1,) + DIM_MULT]
        self.conv1 = CausalConv3d(image_channels, dims[0], 3, padding=1)
        layers = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(NUM_RES_BLOCKS):
                layers.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(DIM_MULT) - 1:
                layers.append(Resample(out_dim, "downsample3d" if TEMPORAL_DOWN[i] else "downsample2d", defer=True))
        self.downsamples = nn.Sequential(*layers)
        self.middle = middle(dims[-1])
        self.head = Head(dims[-1], z_dim)

    def forward(self, x: torch.Tensor, cache: dict, final: bool = False) -> torch.Tensor | None:
        x = causal(self.conv1, x, cache)
        for layer in self.downsamples:
            x = layer(x, cache, final) if isinstance(layer, Resample) else layer(x, cache)
            if x is None:   # a lone frame deferred to the next chunk
                return None
        for layer in self.middle:
            x = layer(x, cache)
        return self.head(x, cache)


class Decoder21(nn.Module):
    """Wan 2.1's Decoder3d (vae.py:308-421), one chunk at a time into a list of output pieces."""

    def __init__(self, dim: int, z_dim: int, out_channels: int):
        super().__init__()
        dims = [dim * u for u in (DIM_MULT[-1],) + DIM_MULT[::-1]]
        temporal_up = TEMPORAL_DOWN[::-1]
        self.conv1 = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.middle = middle(dims[0])
        layers = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:   # the upsample before halved the channels
                in_dim //= 2
            for _ in range(NUM_RES_BLOCKS + 1):
                layers.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(DIM_MULT) - 1:
                layers.append(Resample(out_dim, "upsample3d" if temporal_up[i] else "upsample2d", out_dim // 2))
        self.upsamples = nn.Sequential(*layers)
        self.head = Head(dims[-1], out_channels)

    def forward(self, x: torch.Tensor, cache: dict, out: list) -> None:
        x = causal(self.conv1, x, cache)
        for layer in self.middle:
            x = layer(x, cache)
        self._up(0, x, cache, out)

    def _up(self, i: int, x: torch.Tensor, cache: dict, out: list) -> None:
        """ComfyUI's run_up: after a temporal upsample of more than two frames, the rest runs two frames at a time."""
        if i == len(self.upsamples):
            out.append(self.head(x, cache))
            return
        layer = self.upsamples[i]
        x = layer(x, cache)
        if isinstance(layer, Resample) and layer.mode == "upsample3d" and x.shape[2] > 2:
            for first in range(0, x.shape[2], 2):
                self._up(i + 1, x[:, :, first:first + 2], cache, out)
            return
        self._up(i + 1, x, cache, out)


class WanVAE21(nn.Module):
    """Wan 2.1's VAE (vae.py:432-511): encoder, conv1 (the moments), conv2 (into the decoder), decoder; widths from the
    file (`dim`, `z_dim`, the image and output channels; sd.py:830-841 reads the same)."""
    spatial = 8

    def __init__(self, dim: int = 96, z_dim: int = 16, image_channels: int = 3, out_channels: int = 3):
        super().__init__()
        self.z_dim = z_dim
        self.encoder = Encoder21(dim, z_dim * 2, image_channels)
        self.conv1 = CausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.conv2 = CausalConv3d(z_dim, z_dim, 1)
        self.decoder = Decoder21(dim, z_dim, out_channels)

    @staticmethod
    def decode_chunks(frames: int) -> int:
        return 1 + frames // 2

    @staticmethod
    def encode_chunks(frames: int) -> int:
        return 1 + ((frames - 1) // 4 * 4) // 2

    def decode(self, z: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, z_dim, T, h, w] (this rank's rows) -> [B, C, 4T-3, 8h, 8w]; on_chunk(i, n) after each chunk."""
        x = self.conv2(z)
        cache, out = {}, []
        chunks = self.decode_chunks(z.shape[2])
        for i in range(chunks):
            self.decoder(x[:, :, :1] if i == 0 else x[:, :, 1 + 2 * (i - 1):1 + 2 * i], cache, out)
            if on_chunk is not None:
                on_chunk(i, chunks)
        return torch.cat(out, 2)

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, C, T, 8h, 8w] (this rank's rows) -> the latent mean [B, z_dim, 1 + (T-1)//4, h, w]."""
        chunks = self.encode_chunks(x.shape[2])
        cache, out = {}, []
        for i in range(chunks):
            piece = x[:, :, :1] if i == 0 else x[:, :, 1 + 2 * (i - 1):1 + 2 * i]
            y = self.encoder(piece, cache, final=i > 0 and i == chunks - 1)
            if y is not None:
                out.append(y)
            if on_chunk is not None:
                on_chunk(i, chunks)
        return self.conv1(torch.cat(out, 2))[:, :self.z_dim]
