"""The LTX-2.x video VAE's layers and blocks on row bands (ltx.py builds the networks from them): ComfyUI 0.33's
CausalConv3d (comfy/ldm/lightricks/vae/causal_conv3d.py), PixelNorm (pixel_norm.py), and causal_video_autoencoder.py's
ResnetBlock3D, UNetMidBlock3D, DepthToSpaceUpsample and SpaceToDepthDownsample with ComfyUI's streaming state, held in
the call's `cache` dict (ComfyUI keeps it per module and thread) instead of on the modules. Only the convolution reaches
across rows: one halo row from each neighbour, its padding at the frame's true edges."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import RowLayer, pad_rows


# ---- layers -------------------------------------------------------------------------------------------------------
class Conv(RowLayer, nn.Module):
    """ComfyUI's CausalConv3d (causal_conv3d.py:9-96), 3x3x3, stride 1: time padded by repeating the first frame
    (k-1 frames causal, (k-1)/2 in front and, on the chunk marked ended, (k-1)/2 copies of the last frame behind when
    not causal); the state (the cached tail, ended) lives in the call's `cache`. On a band the input is haloed first,
    so the cached frames keep their halo rows and are never sent again."""

    def __init__(self, in_channels: int, out_channels: int, mode: str):
        super().__init__()
        self.mode = mode
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=(0, 1, 1), padding_mode=mode)

    def forward(self, x: torch.Tensor, cache: dict, causal: bool = True) -> torch.Tensor:
        rows = x.shape[3]
        if not self.local:
            x = pad_rows(x, self.split, 1, 1, self.mode, dim=3) if x.shape[2] else \
                x.new_empty(x.shape[:3] + (rows + 2, x.shape[4]))
        cached, ended = cache.get(self, (None, False))
        if cached is None:
            if x.shape[2] == 0:
                return self._empty(x, rows)
            cached = x[:, :, :1].repeat(1, 1, 2 if causal else 1, 1, 1)
        pieces = [cached, x]
        if ended and not causal:
            pieces.append(x[:, :, -1:])
        keep = 2   # ComfyUI's cache_length, (k - stride) + ((n - k) % stride), for k = 3 and stride 1
        caching = not ended
        if caching and x.shape[2] >= keep:
            caching = False
            cache[self] = (x[:, :, -keep:], False)
        x = torch.cat(pieces, 2)
        if caching:
            cache[self] = (x[:, :, -keep:], False)
        elif ended:
            cache[self] = (None, True)
        return self._conv(x) if x.shape[2] >= 3 else self._empty(x, rows)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            return self.conv(x)
        if self.mode == "zeros":
            return F.conv3d(x, self.conv.weight, self.conv.bias, padding=(0, 0, 1))
        return F.conv3d(F.pad(x, (1, 1, 0, 0, 0, 0), mode=self.mode), self.conv.weight, self.conv.bias)

    def _empty(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], self.conv.out_channels, 0, rows, x.shape[4]))


def mark_ended(module: nn.Module, cache: dict) -> None:
    """ComfyUI's mark_conv3d_ended (causal_video_autoencoder.py:21-26): every conv under `module` takes this chunk as
    the last (pads the end when not causal, keeps no cache)."""
    for m in module.modules():
        if isinstance(m, Conv):
            cache[m] = (cache.get(m, (None, False))[0], True)


def cat_if_needed(pieces: list, dim: int = 2):
    """ComfyUI's torch_cat_if_needed (comfy/ldm/modules/diffusionmodules/model.py:16-23)."""
    pieces = [p for p in pieces if p is not None and p.shape[dim] > 0]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0] if pieces else None


def add_exchange_cache(dest, cache_in, new_input, dim: int = 2):
    """ComfyUI's add_exchange_cache (causal_video_autoencoder.py:31-40): the shortcut added to the frames the conv path
    produced, the rest of the shortcut kept for the next chunk (the conv path lags behind its input)."""
    if dest is not None:
        if cache_in is not None:
            n = min(dest.shape[dim], cache_in.shape[dim])
            lead, dest = torch.split(dest, [n, dest.shape[dim] - n], dim)
            source, cache_in = torch.split(cache_in, [n, cache_in.shape[dim] - n], dim)
            lead.add_(source)
        body, new_input = torch.split(new_input, [dest.shape[dim], new_input.shape[dim] - dest.shape[dim]], dim)
        dest.add_(body)
    return cat_if_needed([cache_in, new_input], dim)


def pixel_norm(x: torch.Tensor) -> torch.Tensor:
    """PixelNorm (pixel_norm.py:5-12): per position over channels."""
    return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-8)


class LayerNorm(nn.Module):
    """ComfyUI's LayerNorm over channels (causal_video_autoencoder.py:892-901)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """get_timestep_embedding (comfy/ldm/lightricks/model.py:52-101) with flip_sin_to_cos, shift 0, in float32."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(256, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeEmbedder(nn.Module):
    """PixArtAlphaCombinedTimestepSizeEmbeddings (comfy/ldm/lightricks/model.py:176-204): the sinusoidal embedding in
    float32, cast to the activations' dtype, then the MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_embedding(t).to(dtype))


# ---- blocks -------------------------------------------------------------------------------------------------------
class ResnetBlock3D(nn.Module):
    """ResnetBlock3D (causal_video_autoencoder.py:904-1096) with pixel_norm: norm, timestep scale and shift, SiLU, conv,
    twice; the LayerNorm + 1x1x1 shortcut where the widths differ, added through add_exchange_cache."""

    def __init__(self, in_channels: int, out_channels: int, mode: str, timestep: bool = False, eps: float = 1e-6):
        super().__init__()
        self.timestep = timestep
        self.conv1 = Conv(in_channels, out_channels, mode)
        self.conv2 = Conv(out_channels, out_channels, mode)
        self.conv_shortcut = nn.Conv3d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        self.norm3 = LayerNorm(in_channels, eps) if in_channels != out_channels else nn.Identity()
        if timestep:
            self.scale_shift_table = nn.Parameter(torch.empty(4, in_channels))

    def forward(self, x: torch.Tensor, cache: dict, causal: bool = True, timestep=None) -> torch.Tensor:
        h = pixel_norm(x)
        if self.timestep:
            ada = self.scale_shift_table[None, ..., None, None, None].to(h) + \
                timestep.reshape(timestep.shape[0], 4, -1, *timestep.shape[-3:])
            shift1, scale1, shift2, scale2 = ada.unbind(dim=1)
            h = h * (1 + scale1) + shift1
        h = self.conv1(F.silu(h), cache, causal)
        h = pixel_norm(h)
        if self.timestep:
            h = h * (1 + scale2) + shift2
        h = self.conv2(F.silu(h), cache, causal)
        x = self.conv_shortcut(self.norm3(x))
        cache[self] = add_exchange_cache(h, cache.get(self), x)
        return h


class UNetMidBlock3D(nn.Module):
    """`res_x`: ResnetBlock3Ds of one width, sharing one timestep embedding (causal_video_autoencoder.py:658-750)."""

    def __init__(self, channels: int, num_layers: int, mode: str, timestep: bool = False):
        super().__init__()
        self.timestep = timestep
        if timestep:
            self.time_embedder = TimeEmbedder(channels * 4)
        self.res_blocks = nn.ModuleList(ResnetBlock3D(channels, channels, mode, timestep) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, cache: dict, causal: bool = True, timestep=None) -> torch.Tensor:
        embed = None
        if self.timestep:
            embed = self.time_embedder(timestep.flatten(), x.dtype)
            embed = embed.view(embed.shape[0], embed.shape[-1], 1, 1, 1)
        for block in self.res_blocks:
            x = block(x, cache, causal, embed)
        return x


def to_space(x: torch.Tensor, stride: tuple) -> torch.Tensor:
    """'b (c p1 p2 p3) d h w -> b c (d p1) (h p2) (w p3)'."""
    b, c, d, h, w = x.shape
    p1, p2, p3 = stride
    x = x.reshape(b, c // (p1 * p2 * p3), p1, p2, p3, d, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, c // (p1 * p2 * p3), d * p1, h * p2, w * p3)


def to_depth(x: torch.Tensor, stride: tuple) -> torch.Tensor:
    """'b c (d p1) (h p2) (w p3) -> b (c p1 p2 p3) d h w'."""
    b, c, d, h, w = x.shape
    p1, p2, p3 = stride
    x = x.reshape(b, c, d // p1, p1, h // p2, p2, w // p3, p3).permute(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, c * p1 * p2 * p3, d // p1, h // p2, w // p3)


class DepthToSpaceUpsample(nn.Module):
    """The decoder's compress_* blocks (causal_video_autoencoder.py:824-890): conv, depth-to-space (the first frame
    dropped once when time doubles), plus the input itself spread the same way (residual)."""

    def __init__(self, in_channels: int, stride: tuple, mode: str, residual: bool = False, reduction: int = 1):
        super().__init__()
        self.stride, self.residual = stride, residual
        self.repeat = math.prod(stride) // reduction
        self.conv = Conv(in_channels, math.prod(stride) * in_channels // reduction, mode)

    def forward(self, x: torch.Tensor, cache: dict, causal: bool = True, timestep=None):
        cached, drop_conv, drop_res = cache.get((self, "state"), (None, True, True))
        y = to_space(self.conv(x, cache, causal), self.stride)
        if self.stride[0] == 2 and y.shape[2] > 0 and drop_conv:
            y, drop_conv = y[:, :, 1:], False
        if not self.residual:
            cache[(self, "state")] = (None, drop_conv, False)
            return y
        x_in = to_space(x, self.stride).repeat(1, self.repeat, 1, 1, 1)
        if self.stride[0] == 2 and x_in.shape[2] > 0 and drop_res:
            x_in, drop_res = x_in[:, :, 1:], False
        y = None if y.shape[2] == 0 else y
        cache[(self, "state")] = (add_exchange_cache(y, cached, x_in), drop_conv, drop_res)
        return y


class SpaceToDepthDownsample(nn.Module):
    """The encoder's compress_*_res blocks (causal_video_autoencoder.py:753-821): the first frame duplicated when time
    halves, conv then space-to-depth, plus the input's group means (the shortcut), streamed with ComfyUI's state."""

    def __init__(self, in_channels: int, out_channels: int, stride: tuple, mode: str):
        super().__init__()
        self.stride = stride
        self.group_size = in_channels * math.prod(stride) // out_channels
        self.conv = Conv(in_channels, out_channels // math.prod(stride), mode)

    def forward(self, x: torch.Tensor, cache: dict, causal: bool = True, timestep=None):
        cached, pad_first, cached_x, cached_input = cache.get((self, "state"), (None, True, None, None))
        if cached_input is not None:
            x, cached_input = cat_if_needed([cached_input, x]), None
        if self.stride[0] == 2 and pad_first:
            x, pad_first = torch.cat([x[:, :, :1], x], 2), False
        if x.shape[2] < self.stride[0]:
            cache[(self, "state")] = (cached, pad_first, cached_x, x)
            return None
        x_in = to_depth(x, self.stride)
        x_in = x_in.reshape(x_in.shape[0], -1, self.group_size, *x_in.shape[2:]).mean(dim=2)
        x = self.conv(x, cache, causal)
        if self.stride[0] == 2 and x.shape[2] == 1:
            if cached_x is not None:
                x, cached_x = cat_if_needed([cached_x, x]), None
            else:
                cached_x, x = x, None
        if x is not None:
            x = to_depth(x, self.stride)
        cache[(self, "state")] = (add_exchange_cache(x, cached, x_in), pad_first, cached_x, cached_input)
        return x
