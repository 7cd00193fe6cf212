"""The LTX-2.x video VAE on row bands: ComfyUI 0.33's comfy/ldm/lightricks/vae/causal_video_autoencoder.py (with
causal_conv3d.py and pixel_norm.py) computed band by band, its streaming caches kept as ComfyUI keeps them, ComfyUI's
parameter names (its files load as they are), the network built from the file header's config["vae"] (sd.py:746-749).

Nothing in it reaches across the frame but the 3x3x3 convolutions (one halo row from each neighbour; the spatial
padding, reflect in the decoder by default, zeros in the encoder, at the frame's true edges only): PixelNorm, the
LayerNorm shortcut, depth-to-space, space-to-depth and (un)patchify are per position or within a band's even rows, and
the timestep scale and shift are per channel. Time is padded by repeating the first (and, non-causally, the last)
frame; each conv keeps its last frames (with their halo rows) for the next chunk.

Chunking (ComfyUI's only changes rounding, the caches make the sums the same): decode runs one latent frame a chunk
through the whole decoder (ComfyUI runs conv_in over the whole latent), and inside it ComfyUI's own byte-sized
temporal chunks at every level (causal_video_autoencoder.py:468-501), sized from the WHOLE frame's bytes so every rank
cuts the same chunks, 128 MiB by default (ComfyUI's for a device of 24 GB or more, :326-342); encode runs the first
frame alone, then 8 frames a chunk (ComfyUI: sized from device memory, a multiple of 8 from 8 frames up, :285-311)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import RowLayer, pad_rows

CHUNK_BYTES = 128 * 1024 ** 2   # ComfyUI's MAX_CHUNK_SIZE (causal_video_autoencoder.py:323)
ENCODE_CHUNK_FRAMES = 8
DECODE_NOISE_SCALE, DECODE_TIMESTEP = 0.025, 0.05   # VideoVAE's defaults (causal_video_autoencoder.py:1162-1163)


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


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """'b c (f 1) (h q) (w r) -> b (c r q) f h w' (causal_video_autoencoder.py:1099-1117)."""
    if p == 1:
        return x
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, f, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """'b (c r q) f h w -> b c f (h q) (w r)' (causal_video_autoencoder.py:1120-1137)."""
    if p == 1:
        return x
    b, c, f, h, w = x.shape
    x = x.reshape(b, c // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, c // (p * p), f, h * p, w * p)


# ---- the networks -------------------------------------------------------------------------------------------------
ENCODER_DOWN = {"compress_space_res": (1, 2, 2), "compress_time_res": (2, 1, 1), "compress_all_res": (2, 2, 2)}
DECODER_UP = {"compress_time": (2, 1, 1), "compress_space": (1, 2, 2), "compress_all": (2, 2, 2)}
LOG_VAR = {"per_channel": None, "uniform": 1, "constant": 1}   # conv_out's channels beyond the latent: latent or 1


def blocks(config: dict, side: str) -> list:
    """The encoder's or decoder's block list as VideoVAE reads it (causal_video_autoencoder.py:1170, 1184)."""
    return config.get(f"{side}_blocks", config.get("blocks"))


def params(p) -> dict:
    return p if isinstance(p, dict) else {"num_layers": p}


class Encoder(nn.Module):
    """The Encoder (causal_video_autoencoder.py:42-311) with ComfyUI's streaming state, one chunk at a time."""

    def __init__(self, config: dict):
        super().__init__()
        mode = config.get("spatial_padding_mode", "zeros")
        self.patch, self.latent = config.get("patch_size", 1), config["latent_channels"]
        ch = config.get("encoder_base_channels", 128)
        self.conv_in = Conv(config.get("in_channels", 3) * self.patch ** 2, ch, mode)
        layers = []
        for name, p in blocks(config, "encoder"):
            p = params(p)
            if name == "res_x":
                layers.append(UNetMidBlock3D(ch, p["num_layers"], mode))
                continue
            out = p.get("multiplier", 2) * ch
            layers.append(ResnetBlock3D(ch, out, mode) if name == "res_x_y" else
                          SpaceToDepthDownsample(ch, out, ENCODER_DOWN[name], mode))
            ch = out
        self.down_blocks = nn.ModuleList(layers)
        log_var = config.get("latent_log_var", "per_channel" if config.get("double_z", True) else "none")
        self.conv_out = Conv(ch, self.latent + (LOG_VAR[log_var] or self.latent), mode)

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """The first frame alone, then ENCODE_CHUNK_FRAMES a chunk, the last marked ended: the latent means."""
        pieces = [x[:, :, :1]] + (list(torch.split(x[:, :, 1:], ENCODE_CHUNK_FRAMES, 2)) if x.shape[2] > 1 else [])
        cache, out = {}, []
        for i, piece in enumerate(pieces):
            if i == len(pieces) - 1:
                mark_ended(self, cache)
            h = self.conv_in(patchify(piece, self.patch), cache)
            for block in self.down_blocks:
                h = block(h, cache)
                if h is None or h.shape[2] == 0:
                    break
            else:
                h = self.conv_out(F.silu(pixel_norm(h)), cache)
                if h.shape[2]:
                    out.append(h[:, :self.latent])   # the means: what VideoVAE.encode keeps of every log_var layout
            if on_chunk is not None:
                on_chunk(i, len(pieces))
        return torch.cat(out, 2)


class Decoder(nn.Module):
    """The Decoder (causal_video_autoencoder.py:344-655): conv_in, up_blocks, PixelNorm + the last timestep shift and
    scale, SiLU, conv_out, unpatchify; ComfyUI's run_up with its byte-sized chunks at every level."""

    def __init__(self, config: dict):
        super().__init__()
        mode = config.get("spatial_padding_mode", "reflect")
        self.patch, self.causal = config.get("patch_size", 1), config.get("causal_decoder", False)
        self.timestep = config.get("timestep_conditioning", False)
        layout = blocks(config, "decoder")
        ch = config.get("decoder_base_channels", 128)
        for name, p in layout:   # the width at conv_in: every channel multiplier's product (:385-397)
            p = p if isinstance(p, dict) else {}
            ch = p.get("in_channels", ch * p.get("multiplier", 2)) if name == "res_x_y" else \
                ch * p.get("multiplier", 1) if name in DECODER_UP else ch
        self.conv_in = Conv(config["latent_channels"], ch, mode)
        layers = []
        for name, p in reversed(layout):
            p = params(p)
            if name == "res_x":
                layers.append(UNetMidBlock3D(ch, p["num_layers"], mode, self.timestep))
            elif name == "res_x_y":
                out = p.get("out_channels", ch // p.get("multiplier", 2))
                layers.append(ResnetBlock3D(ch, out, mode))
                ch = out
            else:
                m = p.get("multiplier", 1)
                layers.append(DepthToSpaceUpsample(ch, DECODER_UP[name], mode,
                                                   name == "compress_all" and p.get("residual", False), m))
                ch //= m
        self.up_blocks = nn.ModuleList(layers)
        self.conv_out = Conv(ch, config.get("out_channels", 3) * self.patch ** 2, mode)
        if self.timestep:
            self.timestep_scale_multiplier = nn.Parameter(torch.empty(()))
            self.last_time_embedder = TimeEmbedder(ch * 2)
            self.last_scale_shift_table = nn.Parameter(torch.empty(2, ch))

    def decode(self, z: torch.Tensor, on_chunk=None, chunk_bytes: int = CHUNK_BYTES, timestep: float = DECODE_TIMESTEP,
               frame_rows=lambda rows: rows) -> torch.Tensor:
        """One latent frame a chunk through the whole decoder (the last marked ended); frame_rows(local rows) -> the
        whole frame's rows at that level (the byte-sized chunks are the whole frame's)."""
        run = {"cache": {}, "out": [], "scaled": None, "ada": None, "bytes": chunk_bytes, "rows": frame_rows}
        if self.timestep:   # forward_orig (:516-545)
            run["scaled"] = timestep * self.timestep_scale_multiplier.to(dtype=z.dtype, device=z.device)
            emb = self.last_time_embedder(run["scaled"].flatten(), z.dtype)
            emb = emb.view(emb.shape[0], emb.shape[-1], 1, 1, 1)
            run["ada"] = (self.last_scale_shift_table[None, ..., None, None, None].to(z) +
                          emb.reshape(emb.shape[0], 2, -1, 1, 1, 1)).unbind(dim=1)
        frames = z.shape[2]
        for i in range(frames):
            if i == frames - 1:
                mark_ended(self.conv_in, run["cache"])
            self._up(0, self.conv_in(z[:, :, i:i + 1], run["cache"], self.causal), i == frames - 1, run)
            if on_chunk is not None:
                on_chunk(i, frames)
        return torch.cat(run["out"], 2)

    def _up(self, idx: int, x, ended: bool, run: dict) -> None:
        """ComfyUI's run_up (:456-501)."""
        if x is None or x.shape[2] == 0:
            return
        cache = run["cache"]
        if idx == len(self.up_blocks):
            x = pixel_norm(x)
            if run["ada"] is not None:
                shift, scale = run["ada"]
                x = x * (1 + scale) + shift
            if ended:
                mark_ended(self.conv_out, cache)
            x = self.conv_out(F.silu(x), cache, self.causal)
            if x.shape[2] > 0:
                run["out"].append(unpatchify(x, self.patch))
            return
        block = self.up_blocks[idx]
        if ended:
            mark_ended(block, cache)
        x = block(x, cache, self.causal, run["scaled"] if isinstance(block, UNetMidBlock3D) else None)
        if x is None or x.shape[2] == 0:
            return
        whole = x.numel() // x.shape[3] * run["rows"](x.shape[3]) * x.element_size()
        pieces = torch.chunk(x, -(-whole // run["bytes"]), dim=2) if whole > run["bytes"] else (x,)
        for j, piece in enumerate(pieces):
            self._up(idx + 1, piece, ended and j == len(pieces) - 1, run)


class Statistics(nn.Module):
    """per_channel_statistics (causal_video_autoencoder.py:1139-1149): the latent's per-channel mean and std."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("std-of-means", torch.empty(channels))
        self.register_buffer("mean-of-means", torch.empty(channels))

    def un_normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.get_buffer("std-of-means").view(1, -1, 1, 1, 1).to(x)) + \
            self.get_buffer("mean-of-means").view(1, -1, 1, 1, 1).to(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.get_buffer("mean-of-means").view(1, -1, 1, 1, 1).to(x)) / \
            self.get_buffer("std-of-means").view(1, -1, 1, 1, 1).to(x)


class LTXVideoVAE(RowLayer, nn.Module):
    """VideoVAE (causal_video_autoencoder.py:1152-1307) on row bands. decode(z, noise=...): a timestep-conditioned
    decoder mixes in noise (ComfyUI draws it with an unseeded randn_like on the whole latent, :1304-1306): the caller
    draws it as ComfyUI would and sends it; each rank takes its band of it."""
    spatial, temporal = 32, 8

    def __init__(self, config: dict, version: int = 2, z_dim: int = 128):
        super().__init__()
        self.timestep_conditioning = config.get("timestep_conditioning", False)
        self.noise_scale = config.get("decode_noise_scale", DECODE_NOISE_SCALE)
        self.decode_timestep = config.get("decode_timestep", DECODE_TIMESTEP)
        self.encoder, self.decoder = Encoder(config), Decoder(config)
        self.per_channel_statistics = Statistics(config["latent_channels"])

    @staticmethod
    def decode_chunks(frames: int) -> int:
        return frames

    @staticmethod
    def encode_chunks(frames: int) -> int:
        return 1 + (frames - 1) // ENCODE_CHUNK_FRAMES

    def _frame_rows(self, rows: int) -> int:
        return rows if self.local else sum(self.split.level_rows(rows))

    def decode(self, z: torch.Tensor, on_chunk=None, noise: torch.Tensor | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
        """[B, 128, T, h, w] (this rank's rows) -> [B, 3, 8T-7, 32h, 32w], the raw decoder output."""
        if self.timestep_conditioning:
            if noise is None:
                raise ValueError("this LTX VAE's decoder is timestep-conditioned: its decode takes the noise ComfyUI "
                                 "draws (torch.randn_like of the latent on the VAE's device, in its dtype)")
            z = noise.to(z) * self.noise_scale + (1.0 - self.noise_scale) * z
        return self.decoder.decode(self.per_channel_statistics.un_normalize(z), on_chunk, chunk_bytes,
                                   self.decode_timestep, self._frame_rows)

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, 3, T, 32h, 32w] in [-1, 1] (this rank's rows) -> the normalized latent means, 1 + (T-1)//8 frames."""
        x = x[:, :, :max(1, 1 + ((x.shape[2] - 1) // ENCODE_CHUNK_FRAMES) * ENCODE_CHUNK_FRAMES)]
        return self.per_channel_statistics.normalize(self.encoder.encode(x, on_chunk))


# ---- which files: ComfyUI's config, and what the engine splits -----------------------------------------------------
DEFAULT_V2 = {   # VideoVAE.get_default_config(2) (causal_video_autoencoder.py:1257-1290), what ComfyUI builds for an
    # LTX-2 file without a header config (sd.py:738-749)
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "norm_layer": "pixel_norm",
    "patch_size": 4, "latent_log_var": "uniform", "causal_decoder": False, "timestep_conditioning": True,
    "encoder_blocks": [["res_x", {"num_layers": 4}], ["compress_space_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 6}], ["compress_time_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 6}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 2}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 2}]],
    "decoder_blocks": [["res_x", {"num_layers": 5, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}]] * 3 +
                      [["res_x", {"num_layers": 5, "inject_noise": False}]]}


def version(shapes: dict) -> int:
    """The config ComfyUI picks for a file without one in its header (sd.py:738-744)."""
    width = shapes["decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"][0]
    if width == 1024:
        return 2 if "encoder.down_blocks.1.conv.conv.bias" in shapes else 1
    return 0


def unsupported(config: dict) -> str | None:
    """Why the engine does not split the network `config` builds (a clause after "whose"), or None."""
    if config.get("dims") != 3:
        return f"config has dims {config.get('dims')!r} (the engine splits the 3-D LTX VAEs)"
    if config.get("norm_layer", "group_norm") != "pixel_norm":
        return (f"norm_layer is {config.get('norm_layer', 'group_norm')!r} (the engine splits pixel_norm VAEs; a "
                f"GroupNorm over a chunk's frames makes ComfyUI's own result depend on its chunking)")
    decoder = blocks(config, "decoder") or []
    if any(params(p).get("inject_noise") for _, p in decoder):
        return ("decoder injects noise inside its ResNet blocks (inject_noise, a version-1 LTX-Video VAE): noise drawn "
                "per call inside the network cannot be reproduced on the ranks")
    for side, known in (("encoder", {"res_x", "res_x_y", *ENCODER_DOWN}), ("decoder", {"res_x", "res_x_y",
                                                                                        *DECODER_UP})):
        odd = [name for name, _ in blocks(config, side) or [] if name not in known]
        if odd or not blocks(config, side):
            return f"{side} has block {odd[0] if odd else 'list'} {'' if odd else 'missing '}(the engine splits " \
                   f"{', '.join(sorted(known))})"
    log_var = config.get("latent_log_var", "per_channel" if config.get("double_z", True) else "none")
    if log_var not in LOG_VAR:
        return f"latent_log_var is {log_var!r} (the engine splits {', '.join(LOG_VAR)})"
    return None
