"""The LTX-2.x video VAE on row bands: ComfyUI 0.33's comfy/ldm/lightricks/vae/causal_video_autoencoder.py (with
causal_conv3d.py and pixel_norm.py; the blocks in ltx_blocks.py) computed band by band, its streaming caches kept as
ComfyUI keeps them, ComfyUI's parameter names (its files load as they are), the network built from the file header's
config["vae"] (sd.py:746-749).

Nothing in it reaches across the frame but the 3x3x3 convolutions (one halo row from each neighbour; the spatial
padding, reflect in the decoder by default, zeros in the encoder, at the frame's true edges only): PixelNorm, the
LayerNorm shortcut, depth-to-space, space-to-depth and (un)patchify are per position or within a band's even rows, and
the timestep scale and shift are per channel. Time is padded by repeating the first (and, non-causally, the last)
frame; each conv keeps its last frames (with their halo rows) for the next chunk.

Chunking (ComfyUI's only changes rounding, the caches make the sums the same): decode runs one latent frame a chunk
through the whole decoder (ComfyUI runs conv_in over the whole latent), and inside it ComfyUI's own byte-sized
temporal chunks at every level (causal_video_autoencoder.py:538-583), sized from the WHOLE frame's bytes so every rank
cuts the same chunks, 128 MiB by default (ComfyUI's for a device of 24 GB or more, :326-342); encode runs the first
frame alone, then 8 frames a chunk (ComfyUI: sized from device memory, a multiple of 8 from 8 frames up, :285-311)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import RowLayer
from .ltx_blocks import (Conv, DepthToSpaceUpsample, ResnetBlock3D, SpaceToDepthDownsample, TimeEmbedder,
                         UNetMidBlock3D, mark_ended, pixel_norm)

CHUNK_BYTES = 128 * 1024 ** 2   # ComfyUI's MAX_CHUNK_SIZE (causal_video_autoencoder.py:329)
ENCODE_CHUNK_FRAMES = 8
DECODE_NOISE_SCALE, DECODE_TIMESTEP = 0.025, 0.05   # VideoVAE's defaults (causal_video_autoencoder.py:1162-1163)

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
    """The encoder's or decoder's block list as VideoVAE reads it (causal_video_autoencoder.py:1173, 1185)."""
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
        for name, p in layout:   # the width at conv_in: every channel multiplier's product (:392-404)
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
        if self.timestep:   # forward_orig (:605-630)
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
        """ComfyUI's run_up (:538-583)."""
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
    """VideoVAE (causal_video_autoencoder.py:1151-1307) on row bands. decode(z, noise=...): a timestep-conditioned
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
DEFAULT_V2 = {   # VideoVAE.get_default_config(2) (causal_video_autoencoder.py:1259-1292), what ComfyUI builds for an
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
