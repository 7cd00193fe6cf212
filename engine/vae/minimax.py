"""The MiniMax-H3 video VAE as a pool of tiles: ComfyUI 0.33's comfy/ldm/minimax/vae.py decodes and encodes it in
256 px spatial tiles of 17-frame (5-token) temporal clips whatever the memory (its decoder's RoPE coordinates are the
tile's own, vae.py:169-177, 295: the tiles are the model's semantics), so the exact parallel form is whole tiles:
every (clip, tile) piece is decoded (or encoded) by one rank with the unsplit network (`H3VideoVAE.piece`), the raw
pieces come back, and ComfyUI's blending runs on them in ComfyUI's order (minimax_tiles.py: the plan and the blend).
The modules carry ComfyUI's parameter names, so its files load as they are."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .minimax_tiles import (CH_MULT, IMAGENET_MEAN, IMAGENET_STD, RATIO, RATIO_T, SPACE_DOWN, TIME_DOWN, Plan,
                            plan)

DIM_HEAD = 64


# ---- the encoder: a causal 3-D CNN, reflect spatial padding, GroupNorm per frame -----------------------------------
class CausalConv3d(nn.Conv3d):
    """vae.py:41-56: reflect spatial padding, zero frames in front; a lone frame through the last temporal taps."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__(in_channels, out_channels, kernel_size=kernel_size, stride=stride)
        self.causal_padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h, w = self.causal_padding
        if t + h + w == 0:
            return super().forward(x)
        x = F.pad(x, (w, w, h, h, 0, 0), mode="reflect")
        if x.shape[2] == 1:   # ComfyUI's causal_zero (comfy/ops.py:611-613)
            return F.conv3d(x, self.weight[:, :, -1:], self.bias, self.stride)
        return super().forward(F.pad(x, (0, 0, 0, 0, t * 2, 0)))


class TemporalIsolatedGroupNorm(nn.GroupNorm):
    """GroupNorm(32) with statistics per frame (vae.py:59-71)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        x = super().forward(x.permute(0, 2, 1, 3, 4).contiguous().view(b * t, c, 1, h, w))
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4).contiguous()


def group_norm(channels: int) -> TemporalIsolatedGroupNorm:
    return TemporalIsolatedGroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class Downsample3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, time_stride: int, space_stride: int):
        super().__init__()
        self.space_stride = space_stride
        self.conv = CausalConv3d(in_channels, out_channels, 3, padding=(1, 0, 0),
                                 stride=(time_stride, space_stride, space_stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.space_stride == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode="reflect")
        return self.conv(x)


class ResnetBlock3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1, self.norm2 = group_norm(in_channels), group_norm(out_channels)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, padding=1)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = CausalConv3d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x), inplace=True))
        h = self.conv2(F.silu(self.norm2(h), inplace=True))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return h.add_(x)


class EncoderFCN3D(nn.Module):
    """vae.py:114-164, six levels of ch x (1, 2, 2, 4, 4, 8), two ResNet blocks each."""

    def __init__(self, ch: int, z_channels: int, in_channels: int = 3, num_res_blocks: int = 2):
        super().__init__()
        mid = [ch * m for m in CH_MULT]
        self.conv_in = CausalConv3d(in_channels, mid[0], 3, padding=1)
        self.down = nn.ModuleList()
        for i, width in enumerate(mid):
            level = nn.Module()
            level.block = nn.ModuleList(ResnetBlock3D(mid[max(i - 1, 0)] if j == 0 else width, width)
                                        for j in range(num_res_blocks))
            if SPACE_DOWN[i] * TIME_DOWN[i] > 1:
                level.downsample = Downsample3D(width, width, TIME_DOWN[i], SPACE_DOWN[i])
            self.down.append(level)
        self.norm_out = group_norm(mid[-1])
        self.conv_out = CausalConv3d(mid[-1], 2 * z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# ---- the decoder: a ViT over one tile's tokens -------------------------------------------------------------------
def rope_table(ids: torch.Tensor, rot_dim: int, inv_freq_dtype: torch.dtype) -> torch.Tensor:
    """RotaryEmbeddingND (vae.py:180-198): inv_freq held in the VAE's dtype (ComfyUI casts the module's buffers with
    its weights), the angles in float32, the [B, S, 1, pairs, 2, 2] rotations in the ids' dtype."""
    inv_freq = (1 / 100.0 ** torch.arange(0, 1, 2 * 3 / rot_dim, dtype=torch.float32)).to(inv_freq_dtype)
    angles = 2.0 * math.pi * ids[:, :, :, None].float() * inv_freq.to(ids.device)[None, None, None, :]
    angles = angles.flatten(2, 3)
    c, s = torch.cos(angles), torch.sin(angles)
    return torch.stack([c, -s, s, c], dim=-1).reshape(*angles.shape[:2], 1, angles.shape[-1], 2, 2).to(ids.dtype)


def rope_split_half(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """comfy_kitchen's apply_rope_split_half1 (its eager reference): pair k is channels k and k + half."""
    t = x.reshape(*x.shape[:-1], 2, -1).movedim(-2, -1).unsqueeze(-2).to(table.dtype)
    out = table[..., 0] * t[..., 0] + table[..., 1] * t[..., 1]
    return out.movedim(-1, -2).reshape(*x.shape).type_as(x)


class Attention(nn.Module):
    """vae.py:214-242: q, k, v interleaved per head in one projection, q/k RMS-normed, split-half RoPE on a 0.75
    share of each head, full attention over the tile's tokens (torch's SDPA, as ComfyUI's on NVIDIA)."""

    def __init__(self, heads: int, eps: float = 1e-5):
        super().__init__()
        self.heads, self.eps = heads, eps
        inner = heads * DIM_HEAD
        self.to_qkv = nn.Linear(inner, inner * 3)
        self.to_out = nn.Linear(inner, inner)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = torch.chunk(self.to_qkv(x).view(b, s, -1, 3 * DIM_HEAD), 3, dim=-1)
        q, k = F.rms_norm(q, (DIM_HEAD,), eps=self.eps), F.rms_norm(k, (DIM_HEAD,), eps=self.eps)
        rot = rope.shape[-3] * 2
        q[..., :rot], k[..., :rot] = rope_split_half(q[..., :rot], rope), rope_split_half(k[..., :rot], rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out(out.transpose(1, 2).reshape(b, s, -1).nan_to_num_(0.0))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, dim * mult * 2), nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, x = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate).mul_(x))


class TransformerBlock(nn.Module):
    def __init__(self, heads: int, eps: float = 1e-5):
        super().__init__()
        dim = heads * DIM_HEAD
        self.eps = eps
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.attn, self.ff = Attention(heads, eps), FeedForward(dim)
        self.scale1, self.scale2 = nn.Parameter(torch.empty(dim)), nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x.addcmul_(self.attn(self._norm(x, self.norm1), rope), self.scale1.to(x.dtype))
        return x.addcmul_(self.ff(self._norm(x, self.norm2)), self.scale2.to(x.dtype))

    def _norm(self, x: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
        """comfy.rmsnorm.rms_norm: the weight cast to the input's dtype."""
        return F.rms_norm(x, norm.weight.shape, norm.weight.to(x.dtype), self.eps)


class ViT3DDecoder(nn.Module):
    """vae.py:261-319: each latent token a Linear embedding, 4 register tokens and a zero token appended (at position
    0), the blocks, LayerNorm, a Linear to 3 x 4 x 16 x 16 pixels a token."""

    def __init__(self, num_layers: int = 36, heads: int = 32, z_channels: int = 24, registers: int = 4):
        super().__init__()
        dim = heads * DIM_HEAD
        self.x_embedder = nn.Linear(z_channels, dim)
        self.register_tokens = nn.Parameter(torch.empty(1, registers, dim))
        self.register_buffer("mask_token", torch.empty(1, 1, dim))   # unused at inference, in the file
        self.transformer_blocks = nn.ModuleList(TransformerBlock(heads) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=1e-5)
        self.proj_out = nn.Linear(dim, 3 * RATIO_T * RATIO * RATIO)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, t, h, w = x.shape
        tokens = self.x_embedder(x.flatten(2).transpose(1, 2))
        n = tokens.shape[1]
        tokens = torch.cat([tokens, self.register_tokens.to(tokens.dtype).expand(b, -1, -1),
                            torch.zeros_like(tokens[:, 0:1, :])], dim=1)
        grids = [(torch.arange(0.5, size, dtype=x.dtype, device=x.device) / size) * 2.0 - 1.0 for size in (t, h, w)]
        ids = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2).unsqueeze(0).expand(b, -1, -1)
        ids = torch.cat([ids, ids.new_zeros((b, tokens.shape[1] - n, 3))], dim=1)
        rope = rope_table(ids, int(DIM_HEAD * 0.75), self.x_embedder.weight.dtype)
        for block in self.transformer_blocks:
            tokens = block(tokens, rope)
        out = self.proj_out(self.norm_out(tokens))[:, :n, :]
        out = out.view(b, t, h, w, 3, RATIO_T, RATIO, RATIO).permute(0, 4, 1, 5, 2, 6, 3, 7).contiguous()
        return out.reshape(b, 3, t * RATIO_T, h * RATIO, w * RATIO)


class H3VideoVAE(nn.Module):
    """MiniMaxH3VideoVAE (vae.py:323-710) as a pool of pieces. ComfyUI builds it at its released widths (ch 128, a
    36-layer decoder of 32 heads, sd.py:1000); here the widths come from the file."""
    spatial, temporal, pool = RATIO, RATIO_T, True

    def __init__(self, ch: int = 128, num_layers: int = 36, heads: int = 32, z_dim: int = 24):
        super().__init__()
        self.encoder = EncoderFCN3D(ch, z_dim)
        self.quant_conv = nn.Conv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = nn.Conv3d(z_dim, z_dim, 1)
        self.decoder = ViT3DDecoder(num_layers, heads, z_dim)
        self.register_buffer("latents_mean", torch.empty(z_dim))
        self.register_buffer("latents_std", torch.empty(z_dim))

    plan = staticmethod(plan)

    def piece(self, x: torch.Tensor, pl: Plan, k: int) -> torch.Tensor:
        """Piece k of plan `pl` of the whole input `x` (the latent, or the clip in [-1, 1], in the VAE's dtype; on any
        device: only the piece moves to the VAE's): the
        raw decoder output of its tile (_decode_pixels of the un-normalized latent, vae.py:392-393, 698-702) or its
        moments (_encode_moments of the normalized pixels, vae.py:389-390, 395-396, 544-552)."""
        p = pl.pieces[k]
        t = x.shape[2]
        frames = torch.arange(*p.frames, device=x.device).clamp_(max=t - 1)   # a padded clip repeats its last frame
        x = x[:, :, frames, p.rows[0]:p.rows[1], p.cols[0]:p.cols[1]].to(self.quant_conv.weight.device)
        if pl.op == "decode":
            x = x * self.latents_std.view(1, -1, 1, 1, 1).to(x) + self.latents_mean.view(1, -1, 1, 1, 1).to(x)
            return self.decoder(self.post_quant_conv(x))
        mean, std = (torch.tensor(v).view(1, 3, 1, 1, 1).to(self.quant_conv.weight.dtype).to(x)
                     for v in (IMAGENET_MEAN, IMAGENET_STD))
        return self.quant_conv(self.encoder(x.add(1.0).mul_(0.5).sub_(mean).div_(std)))
