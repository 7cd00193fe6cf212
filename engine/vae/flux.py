"""The FLUX.1 / SD3 and FLUX.2 VAEs on row bands: ComfyUI 0.33's AutoencodingEngine and AutoencoderKL
(comfy/ldm/models/autoencoder.py) with the Encoder and Decoder of comfy/ldm/modules/diffusionmodules/model.py, computed
band by band with the row layers of layers.py, with ComfyUI's parameter names (its files load as they are); and how
comfy.sd.VAE recognises their files (the tests and widths load.py's KINDS use).

The network is 2-D and fully convolutional but for two things that see the whole frame: every GroupNorm(32) (its
statistics all-reduced over the bands) and the middle block's single-head attention (queries on the band, keys and
values gathered). Its upsample is nearest 2x then a 3x3 conv, its downsample a (0, 1, 0, 1) zero pad then a stride-2
3x3 conv (model.py:109-171): one halo row a conv. No time axis: one chunk a job. FLUX.2 adds a 2x2 patchify of the
latent and a fixed BatchNorm (its running statistics) around it, and the 1x1 quant convs (autoencoder.py:204-266): all
per position, so a band of latent rows stays whole.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import RowConv2d, RowDownConv2d, RowGroupNorm, RowLayer, gathered_attention

CH_MULT = (1, 2, 4, 4)     # sd.py:663 (every FLUX.1 / SD3 / FLUX.2 file)
TINY = {"ch": 128, "dec_ch": 32, "z_dim": 16}    # make-tiny's: the encoder at ComfyUI's fixed 128 (sd.py:663)
TINY2 = {"ch": 128, "dec_ch": 32, "z_dim": 128}
NUM_RES_BLOCKS = 2
GROUPS, NORM_EPS = 32, 1e-6   # Normalize (model.py:53-54)
BN_EPS = 1e-4              # FLUX.2's latent BatchNorm (autoencoder.py:186)
PATCH = 2                  # FLUX.2's latent patchify (autoencoder.py:188)


# comfy.sd.VAE's AutoencoderKL branch (sd.py:632, 661-694) in the original layout: a 2-D decoder.conv_in not of 64
# channels (sd.py:633) and none of the earlier branches' or the diffusers layout's keys (sd.py:488-490, 536, 587, 616)
EARLIER = ("decoder.up_blocks.0.resnets.0.norm1.weight", "decoder.mid.block_1.mix_factor",
           "decoder.up_blocks.2.upsamplers.0.upscale_conv.weight", "decoder.conv_in_x_t.weight")
QUANT = ("post_quant_conv.weight", "decoder.post_quant_conv.weight")   # either name (sd.py:671-672, 689)
FLUX2_RENAMES = (("decoder.post_quant_conv.", "post_quant_conv."), ("encoder.quant_conv.", "quant_conv."))


def _autoencoder(shapes: dict) -> tuple | None:
    """decoder.conv_in's shape where comfy.sd.VAE takes the file for its default AutoencoderKL branch, else None."""
    conv = shapes.get("decoder.conv_in.weight")
    if conv is None or len(conv) != 4 or conv[1] == 64 or any(k in shapes for k in EARLIER):
        return None
    return conv


def is_flux(shapes: dict) -> bool:
    """FLUX.1 / SD3: 16 latent channels, no quant convs (ComfyUI's AutoencodingEngine, sd.py:691-694), no latent
    BatchNorm."""
    conv = _autoencoder(shapes)
    return conv is not None and conv[1] == 16 and not any(k in shapes for k in QUANT + ("bn.running_mean",))


def is_flux2(shapes: dict) -> bool:
    """FLUX.2: the latent BatchNorm (sd.py:674) and the quant convs (AutoencoderKL, sd.py:689-690)."""
    return _autoencoder(shapes) is not None and "bn.running_mean" in shapes and any(k in shapes for k in QUANT)


def flux_widths(shapes: dict) -> dict:
    """What comfy.sd.VAE reads of a FLUX.1 / SD3 file (sd.py:663-687): the latent's channels and the decoder's width
    from decoder.conv_in; the encoder's width, fixed there at 128 (every released file's), from encoder.conv_in."""
    return {"ch": shapes["encoder.conv_in.weight"][0], "dec_ch": shapes["decoder.conv_in.weight"][0] // CH_MULT[-1],
            "z_dim": shapes["decoder.conv_in.weight"][1]}


def flux2_widths(shapes: dict) -> dict:
    """FLUX.2's: as FLUX.1's, the latent 4 x the network's channels after the 2x2 patchify (sd.py:674-680)."""
    return dict(flux_widths(shapes), z_dim=PATCH * PATCH * shapes["decoder.conv_in.weight"][1])


def norm(channels: int) -> RowGroupNorm:
    return RowGroupNorm(GROUPS, channels, eps=NORM_EPS)


class ResnetBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, GroupNorm, SiLU, 3x3 conv, plus a 1x1 nin_shortcut where widths differ
    (model.py:174-234)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = norm(in_channels)
        self.conv1 = RowConv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = norm(out_channels)
        self.conv2 = RowConv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(RowLayer, nn.Module):
    """GroupNorm, 1x1 q, k, v, single-head attention over every position of the frame, 1x1 proj_out, residual
    (model.py:340-380): queries from the band, keys and values from the whole frame (layers.gathered_attention).
    `attention`: ComfyUI's kernel for the device (split or sdpa, model.py:326-335)."""
    attention = "split"

    def __init__(self, channels: int):
        super().__init__()
        self.norm = norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = gathered_attention(self.q(h), self.k(h), self.v(h), self.split, self.attention)
        return x + self.proj_out(h)


class Upsample(nn.Module):
    """Nearest 2x, then a 3x3 conv (model.py:109-140)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = RowConv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    """A (0, 1, 0, 1) zero pad, then a stride-2 3x3 conv (model.py:143-171): the row below the band from the next rank
    (layers.RowDownConv2d)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = RowDownConv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _middle(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(channels, channels), AttnBlock(channels), \
        ResnetBlock(channels, channels)
    return mid


class Encoder(nn.Module):
    """model.py:540-682 without a time axis or attention outside the middle (attn_resolutions = [], sd.py:663)."""

    def __init__(self, ch: int, z_channels: int, in_channels: int = 3):
        super().__init__()
        self.conv_in = RowConv2d(in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in = ch
        for level, mult in enumerate(CH_MULT):
            down = nn.Module()
            down.block = nn.ModuleList()
            for _ in range(NUM_RES_BLOCKS):
                down.block.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
            if level != len(CH_MULT) - 1:
                down.downsample = Downsample(block_in)
            self.down.append(down)
        self.mid = _middle(block_in)
        self.norm_out = norm(block_in)
        self.conv_out = RowConv2d(block_in, 2 * z_channels, 3, padding=1)   # double_z: mean and log-variance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for down in self.down:
            for block in down.block:
                h = block(h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """model.py:685-827 (2-D, no tanh): `up` indexed by level as ComfyUI keeps it (the finest level first), run from
    the coarsest."""

    def __init__(self, ch: int, z_channels: int, out_channels: int = 3):
        super().__init__()
        block_in = ch * CH_MULT[-1]
        self.conv_in = RowConv2d(z_channels, block_in, 3, padding=1)
        self.mid = _middle(block_in)
        ups = []
        for level in reversed(range(len(CH_MULT))):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(NUM_RES_BLOCKS + 1):
                up.block.append(ResnetBlock(block_in, ch * CH_MULT[level]))
                block_in = ch * CH_MULT[level]
            if level != 0:
                up.upsample = Upsample(block_in)
            ups.insert(0, up)
        self.up = nn.ModuleList(ups)
        self.norm_out = norm(block_in)
        self.conv_out = RowConv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in reversed(self.up):
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class FluxVAE(nn.Module):
    """FLUX.1's and SD3's VAE, ComfyUI's AutoencodingEngine (autoencoder.py:102-144; sd.py:661-694): decode is the
    decoder, encode the encoder and the mode of its Gaussian (the mean: the first z_dim channels, autoencoder.py:15-29,
    comfy/ldm/modules/distributions/distributions.py:27).
    Widths from the file: the encoder's `ch` (ComfyUI fixes 128, sd.py:663: every released file), the decoder's
    (`dec_ch`, read by ComfyUI from decoder.conv_in, sd.py:682), `z_dim` (16)."""
    spatial = 8

    def __init__(self, ch: int = 128, dec_ch: int = 128, z_dim: int = 16):
        super().__init__()
        self.z_dim = z_dim
        self.encoder = Encoder(ch, z_dim)
        self.decoder = Decoder(dec_ch, z_dim)

    @staticmethod
    def decode_chunks(frames: int) -> int:
        return 1   # an image: one chunk

    encode_chunks = decode_chunks

    def decode(self, z: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, z_dim, h, w] (this rank's rows) -> [B, 3, 8h, 8w]."""
        out = self.decoder(z)
        if on_chunk is not None:
            on_chunk(0, 1)
        return out

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, 3, 8h, 8w] (this rank's rows) -> the latent mean [B, z_dim, h, w]."""
        out = self.encoder(x)[:, :self.z_dim]
        if on_chunk is not None:
            on_chunk(0, 1)
        return out


class LatentStatistics(nn.Module):
    """FLUX.2's BatchNorm2d of the patchified latent, as ComfyUI uses it: its running statistics only, fixed
    (autoencoder.py:185-197; num_batches_tracked, which it never reads, is not loaded)."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))


def patchify(z: torch.Tensor) -> torch.Tensor:
    """'... c (i pi) (j pj) -> ... (c pi pj) i j' (autoencoder.py:223-228)."""
    b, c, h, w = z.shape
    z = z.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """'... (c pi pj) i j -> ... c (i pi) (j pj)' (autoencoder.py:244-249)."""
    b, c, h, w = z.shape
    z = z.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c // (PATCH * PATCH), h * PATCH, w * PATCH)


class Flux2VAE(FluxVAE):
    """FLUX.2's VAE, ComfyUI's AutoencoderKL with batch_norm_latent (autoencoder.py:154-275; sd.py:671-690): decode
    un-normalises the latent by the fixed statistics (z * sqrt(var + 1e-4) + mean, in the latent's dtype), un-patchifies
    2x2, post_quant_conv, the decoder; encode the reverse (the encoder, quant_conv, the mean, patchify, batch_norm with
    the statistics). `z_dim` is the latent's channels as ComfyUI counts them (4 x the network's 32, sd.py:678)."""
    spatial = 16

    def __init__(self, ch: int = 128, dec_ch: int = 128, z_dim: int = 128):
        z_channels = z_dim // (PATCH * PATCH)
        super().__init__(ch, dec_ch, z_channels)
        self.z_dim, self.z_channels = z_dim, z_channels
        self.quant_conv = nn.Conv2d(2 * z_channels, 2 * z_channels, 1)   # embed_dim = z_channels, as bn needs
        self.post_quant_conv = nn.Conv2d(z_channels, z_channels, 1)
        self.bn = LatentStatistics(z_dim)

    def decode(self, z: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, z_dim, h, w] (this rank's rows) -> [B, 3, 16h, 16w]."""
        s = torch.sqrt(self.bn.running_var.view(1, -1, 1, 1).to(z.dtype) + BN_EPS)
        z = unpatchify(z * s + self.bn.running_mean.view(1, -1, 1, 1).to(z.dtype))
        return super().decode(self.post_quant_conv(z), on_chunk)

    def encode(self, x: torch.Tensor, on_chunk=None) -> torch.Tensor:
        """[B, 3, 16h, 16w] (this rank's rows) -> the normalised latent [B, z_dim, h, w]."""
        z = self.quant_conv(self.encoder(x))[:, :self.z_channels]
        z = F.batch_norm(patchify(z), self.bn.running_mean.to(z.dtype), self.bn.running_var.to(z.dtype),
                         momentum=0.1, eps=BN_EPS)
        if on_chunk is not None:
            on_chunk(0, 1)
        return z
