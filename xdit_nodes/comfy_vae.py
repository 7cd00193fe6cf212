"""The xDiT VAE Loader's VAE: ComfyUI's own comfy.sd.VAE of the file, built by ComfyUI's own VAELoader (every
attribute the stock nodes read, its ratios, latent channels, patcher and state dict, stays ComfyUI's), whose decode,
encode and tiled variants run on the xDiT Engine's ranks for the VAE types the engine splits (engine/vae/), and are
ComfyUI's own for any other (said once in the log). Imported only inside ComfyUI."""
from __future__ import annotations

import contextlib

import torch
import comfy.model_management as mm
import comfy.sd
import comfy.utils
import folder_paths
import nodes

from ..engine.errors import JobCancelled
from . import core
from .vae import EngineVAELink, comfyui_mismatch, say_once, splits


class EngineVAE(comfy.sd.VAE):
    """A ComfyUI VAE (made by VAELoader, its class then set to this one) whose work runs on the engine's ranks:
    `xdit` is its EngineVAELink. Its weights stay where ComfyUI left them (host memory): nothing here loads them on a
    GPU. Where ComfyUI would run something the ranks do not hold (weight patches on its patcher, decode options), it
    runs ComfyUI's own method, said once."""
    xdit: EngineVAELink = None

    def _own(self) -> str | None:
        """Why this call runs ComfyUI's own method, or None for the ranks."""
        if self.xdit is None:
            return "no engine is linked"
        if getattr(self.patcher, "patches", None):
            return "weight patches were added to it (the ranks hold the file's weights)"
        return None

    def _run(self, op: str, x: torch.Tensor) -> torch.Tensor:
        """op on the ranks, with ComfyUI's progress bar and interrupt. A decode that mixes in noise (LTX's timestep-
        conditioned decoders) gets the noise ComfyUI's own would draw: randn_like of the latent on the VAE's device in
        its dtype, from the global generator (causal_video_autoencoder.py:1304-1306)."""
        noise = None
        if op == "decode" and self.xdit.info.decode_noise:
            noise = torch.randn_like(x.to(device=self.device, dtype=self.vae_dtype))
        bar = []

        def progress(step, total):
            if not bar:
                bar.append(comfy.utils.ProgressBar(total))
            bar[0].update_absolute(step, total)
        try:
            return self.xdit.run(op, x, on_progress=progress, should_cancel=mm.processing_interrupted,
                                 **({"noise": noise} if noise is not None else {}))
        except JobCancelled:
            mm.throw_exception_if_processing_interrupted()   # ComfyUI's own interrupt exception, flag cleared
            raise

    def decode(self, samples_in, vae_options={}):
        why = self._own() or ("decode options were given" if vae_options else None)
        if why:
            say_once(f"xDiT VAE Loader: ComfyUI's own decode runs: {why}")
            return super().decode(samples_in, vae_options)
        self.throw_exception_if_invalid()
        if self.latent_dim == 2 and samples_in.ndim == 5:   # an image VAE decodes a video latent's first frame
            samples_in = samples_in[:, :, 0]                  # (sd.py:1224-1225)
        out = self._run("decode", samples_in.to(self.vae_dtype))   # sd.py:1242: the latent in the VAE's dtype
        out = out.to(device=self.output_device, dtype=self.vae_output_dtype(), copy=True)   # sd.py:1246
        self.process_output(out)   # sd.py:1251, in place
        return out.movedim(1, -1)

    def encode(self, pixel_samples):
        why = self._own()
        if why:
            say_once(f"xDiT VAE Loader: ComfyUI's own encode runs: {why}")
            return super().encode(pixel_samples)
        self.throw_exception_if_invalid()
        pixels = self.vae_encode_crop_pixels(pixel_samples).movedim(-1, 1)   # sd.py:1359-1367
        if self.latent_dim == 3 and pixels.ndim < 5:
            pixels = pixels.movedim(1, 0).unsqueeze(0) if not self.not_video else pixels.unsqueeze(2)
        out = self._run("encode", self.process_input(pixels).to(self.vae_dtype))   # sd.py:1378
        out = out.to(self.output_device).to(dtype=self.vae_output_dtype())
        return self.format_encoded(out) if self.format_encoded is not None else out

    @contextlib.contextmanager
    def _tiles_on_ranks(self):
        """For ComfyUI's own tiled decode and encode (its tiles, feather masks and sums; it loads its copy of the
        weights on its device first, as its own tiled decode does): each tile's network call goes to the ranks."""
        model = self.first_stage_model
        own_encode = type(model).encode
        s = self.xdit.info.kind.spatial

        def encode_tile(x):
            if x.shape[-1] % s or x.shape[-2] % s:   # a tile ComfyUI's network pads itself: ComfyUI's own
                say_once(f"xDiT VAE Loader: a tile of {list(x.shape)} pixels is not whole latent rows: ComfyUI's own "
                         f"encode runs for it")
                return own_encode(model, x)
            return self._run("encode", x)
        model.decode = lambda z: self._run("decode", z)
        model.encode = encode_tile
        try:
            yield
        finally:
            del model.decode, model.encode

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """ComfyUI's own tiled decode (its tiles, feather masks and sums), each tile decoded on the ranks. A VAE that
        tiles itself (MiniMax-H3) ignores the tile sizes: its decode (sd.py:1340-1341, minimax/vae.py:695-696)."""
        if self._own():
            return super().decode_tiled(samples, tile_x, tile_y, overlap, tile_t, overlap_t)
        if self.handles_tiling:
            return self.decode(samples)
        with self._tiles_on_ranks():
            return super().decode_tiled(samples, tile_x, tile_y, overlap, tile_t, overlap_t)

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """ComfyUI's own tiled encode, each tile encoded on the ranks (MiniMax-H3: its encode, as decode_tiled)."""
        if self._own():
            return super().encode_tiled(pixel_samples, tile_x, tile_y, overlap, tile_t, overlap_t)
        if self.handles_tiling:
            return self.encode(pixel_samples)
        with self._tiles_on_ranks():
            return super().encode_tiled(pixel_samples, tile_x, tile_y, overlap, tile_t, overlap_t)


def vae_names() -> list[str]:
    """The list ComfyUI's Load VAE offers (nodes.VAELoader.vae_list: a method of the class since ComfyUI 0.3.76, a
    plain function before)."""
    try:
        return nodes.VAELoader.vae_list(nodes.VAELoader)
    except TypeError:
        return nodes.VAELoader.vae_list()


def _attention() -> str:
    """The VAE attention kernel ComfyUI uses on its device (comfy/ldm/modules/diffusionmodules/model.py:326-335)."""
    return "sdpa" if mm.xformers_enabled_vae() or mm.pytorch_attention_enabled_vae() else "split"


def _version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "version unknown"
    return __version__


def load(vae_name: str, settings: core.EngineSettings | None):
    """ComfyUI's own VAELoader's VAE of `vae_name`; for a type the engine splits, its decode and encode on the ranks
    of `settings`' engine."""
    if settings is None:
        raise ValueError("xDiT VAE Loader: connect the xDiT Engine's engine output to engine (the VAE decodes and "
                         "encodes on its ranks), or use ComfyUI's Load VAE to decode on ComfyUI's own device")
    vae = nodes.VAELoader().load_vae(vae_name)[0]
    path = folder_paths.get_full_path("vae", vae_name) if vae_name != "pixel_space" else None
    info, why = splits(path)
    if info is None:
        say_once(f"xDiT VAE Loader: {vae_name}: {why}; ComfyUI's own VAE decodes and encodes it")
        return vae
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(vae.first_stage_model).__mro__]
    mismatch = comfyui_mismatch(info, classes, vae.latent_channels, _version())
    if mismatch:
        raise ValueError(mismatch)
    if vae.vae_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        say_once(f"xDiT VAE Loader: {vae_name} computes in {vae.vae_dtype}, which the ranks do not; ComfyUI's own VAE "
                 f"decodes and encodes it")
        return vae
    vae.__class__ = EngineVAE
    vae.xdit = EngineVAELink(settings, info, vae.vae_dtype, _attention())
    return vae
