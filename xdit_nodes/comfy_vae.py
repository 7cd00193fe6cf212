"""The xDiT VAE Loader's VAE: ComfyUI's own comfy.sd.VAE of the file, built by ComfyUI's own VAELoader (every
attribute the stock nodes read, its ratios, latent channels, patcher and state dict, stays ComfyUI's), whose decode,
encode and tiled variants run on the xDiT Engine's ranks for the VAE types the engine splits (engine/vae/), and are
ComfyUI's own for any other (said once in the log). Imported only inside ComfyUI."""
from __future__ import annotations

import contextlib
import os

import torch
import comfy.model_management as mm
import comfy.sd
import comfy.utils
import folder_paths
import nodes

from ..engine.errors import JobCancelled
from . import core
from .vae import EngineVAELink, TilePool, comfyui_mismatch, older_than, say_once, splits


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

    def _callbacks(self) -> dict:
        """ComfyUI's progress bar, its interrupt, and room on its own GPU, for a job on the ranks."""
        bar = []

        def progress(step, total):
            if not bar:
                bar.append(comfy.utils.ProgressBar(total))
            bar[0].update_absolute(step, total)
        return {"on_progress": progress, "should_cancel": mm.processing_interrupted,
                "before": lambda need: _room_on_comfyuis_gpu(self.xdit, need)}

    @contextlib.contextmanager
    def _interruptible(self):
        try:
            yield
        except JobCancelled:
            mm.throw_exception_if_processing_interrupted()   # ComfyUI's own interrupt exception, flag cleared
            raise

    def _run(self, op: str, x: torch.Tensor) -> torch.Tensor:
        """op on the ranks, the frame split across them. A decode that mixes in noise (LTX's timestep-conditioned
        decoders) gets the noise ComfyUI's own would draw: randn_like of the latent on the VAE's device in its dtype,
        from the global generator (causal_video_autoencoder.py:1304-1306)."""
        noise = None
        if op == "decode" and self.xdit.info.decode_noise:
            noise = torch.randn_like(x.to(device=self.device, dtype=self.vae_dtype))
        with self._interruptible():
            return self.xdit.run(op, x, **self._callbacks(), **({"noise": noise} if noise is not None else {}))

    def _run_tiles(self, op: str, pieces: list) -> list:
        """op of every tile in one job, the tiles spread over the ranks; a decode that mixes in noise runs its tiles
        one after another in ComfyUI's order, each drawing its noise as ComfyUI's own tiled decode draws it (a call
        each)."""
        if op == "decode" and self.xdit.info.decode_noise:
            return [self._run(op, x) for x in pieces]
        with self._interruptible():
            return self.xdit.run_tiles(op, pieces, **self._callbacks())

    def _output_dtype(self):
        """The dtype ComfyUI's VAE gives its results in: its vae_output_dtype() (sd.py:1130-1131), float32 before
        ComfyUI had one (0.3.64 casts with .float())."""
        return self.vae_output_dtype() if hasattr(self, "vae_output_dtype") else torch.float32

    def decode(self, samples_in, vae_options={}):
        why = self._own() or ("decode options were given" if vae_options else None)
        if why:
            say_once(f"xDiT VAE Loader: ComfyUI's own decode runs: {why}")
            return super().decode(samples_in, vae_options)
        self.throw_exception_if_invalid()
        if self.latent_dim == 2 and samples_in.ndim == 5:   # an image VAE decodes a video latent's first frame
            samples_in = samples_in[:, :, 0]                  # (sd.py:1224-1225)
        out = self._run("decode", samples_in.to(self.vae_dtype))   # sd.py:1242: the latent in the VAE's dtype
        out = out.to(device=self.output_device, dtype=self._output_dtype(), copy=True)   # sd.py:1246
        out = self.process_output(out)   # sd.py:1251 (in place there; 0.3.64's returns a new tensor)
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
        out = out.to(self.output_device).to(dtype=self._output_dtype())
        formatted = getattr(self, "format_encoded", None)   # (absent before ComfyUI had it: 0.3.64)
        return formatted(out) if formatted is not None else out

    @contextlib.contextmanager
    def _weights_stay_with_the_ranks(self):
        """ComfyUI's tiled code first loads its copy of the VAE's weights on its device (sd.py:1328-1329, 1438); the
        ranks hold them, so for the call that load leaves this VAE out, and its tiles stay in host memory (the VAE's
        device is the output device, the CPU, while ComfyUI's tiler runs)."""
        load, device = mm.load_models_gpu, self.device

        def load_others(models, *args, **kwargs):
            others = [m for m in models if m is not self.patcher]
            return load(others, *args, **kwargs) if others else None
        mm.load_models_gpu, self.device = load_others, self.output_device
        try:
            yield
        finally:
            mm.load_models_gpu, self.device = load, device

    def _pooled(self, op: str, tiled):
        """ComfyUI's tiled `op` (tiled(): its own method) with its tiles computed on the ranks in one job
        (vae.TilePool): ComfyUI's tiles, feather masks and sums, in its order."""
        model = self.first_stage_model
        own = type(model).encode if op == "encode" else type(model).decode

        def own_tile(x):   # a tile the ranks do not compute: ComfyUI's network where its weights are
            weight = next(model.parameters(), None)
            with torch.inference_mode():
                return own(model, x.to(weight.device if weight is not None else x.device))
        pool = TilePool(op, self.xdit, lambda pieces: self._run_tiles(op, pieces),
                        single=lambda x: self._run(op, x), own=own_tile)

        def tiler(network):
            setattr(model, op, network)
            try:
                return tiled()
            finally:
                delattr(model, op)
        with self._weights_stay_with_the_ranks():
            return pool(tiler)

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """ComfyUI's own tiled decode (its tiles, feather masks and sums), the tiles spread over the ranks. A VAE that
        tiles itself (MiniMax-H3) ignores the tile sizes: its decode (sd.py:1340-1341, minimax/vae.py:695-696)."""
        if self._own():
            return super().decode_tiled(samples, tile_x, tile_y, overlap, tile_t, overlap_t)
        if getattr(self, "handles_tiling", False):   # (absent before ComfyUI had a VAE that tiles itself: 0.3.64)
            return self.decode(samples)
        return self._pooled("decode", lambda: comfy.sd.VAE.decode_tiled(self, samples, tile_x, tile_y, overlap, tile_t,
                                                                        overlap_t))

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """ComfyUI's own tiled encode, the tiles spread over the ranks (MiniMax-H3: its encode, as decode_tiled)."""
        if self._own():
            return super().encode_tiled(pixel_samples, tile_x, tile_y, overlap, tile_t, overlap_t)
        if getattr(self, "handles_tiling", False):
            return self.encode(pixel_samples)
        return self._pooled("encode", lambda: comfy.sd.VAE.encode_tiled(self, pixel_samples, tile_x, tile_y, overlap,
                                                                        tile_t, overlap_t))


def _room_on_comfyuis_gpu(link, need_bytes: int) -> None:
    """Before a VAE job: on a GPU that ComfyUI's own process uses and the engine's ranks use too, ComfyUI's models stay
    where the job fits beside them, else ComfyUI frees what it needs (core.room_beside_comfyui, as before the MODEL's
    jobs, comfy_model._make_room); the Info node says which."""
    settings = link.settings
    if settings.device != "cuda" or not need_bytes:
        return
    device = mm.get_torch_device()
    if device.type != "cuda" or (device.index or 0) not in settings.gpus:
        return
    models = [(type(getattr(lm.model, "model", lm.model)).__name__, int(lm.model_loaded_memory()))
              for lm in mm.current_loaded_models if lm.device == device and lm.model is not None]
    free_bytes, line = core.room_beside_comfyui(f"cuda:{device.index or 0}", need_bytes,
                                                int(mm.get_free_memory(device)), [m for m in models if m[1] > 0])
    if free_bytes:
        mm.free_memory(free_bytes, device)
        mm.soft_empty_cache()
    core.note(link.registry.running(settings), f"cuda:{device.index or 0}, ComfyUI's GPU", line)


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
    path = folder_paths.get_full_path("vae", vae_name) if vae_name != "pixel_space" else None
    try:
        vae = nodes.VAELoader().load_vae(vae_name)[0]
    except Exception as e:   # a ComfyUI older than the VAE type cannot build it: name the release it needs
        info = splits(path, "")[0] if path else None
        if info is None or not older_than(_version(), info.kind.comfyui_since):
            raise
        raise ValueError(f"xDiT VAE Loader: this ComfyUI ({_version()}) cannot build {vae_name} "
                         f"({info.kind.title}: {str(e).strip().splitlines()[0]}): update ComfyUI to "
                         f"{info.kind.comfyui_since} or newer") from None
    return on_ranks(vae, settings, path, "", vae_name)



def checkpoint_vae(vae, settings: core.EngineSettings, path: str):
    """The VAE ComfyUI's checkpoint loader made of the checkpoint in `path` (its VAE output), its decode and encode on
    the ranks of `settings`' engine where the engine splits its type: the ranks read the checkpoint's VAE tensors, named
    with ComfyUI's vae_key_prefix for the checkpoint's model (supported_models_base.py:45, `first_stage_model.`;
    `vae.` for Wan, LTX-2.x and most video models), as ComfyUI's loader takes them (sd.py:2210-2213)."""
    if getattr(vae, "first_stage_model", None) is None:   # no VAE in the checkpoint: ComfyUI's own says so when used
        return vae
    prefix = _vae_prefix(path)
    return on_ranks(vae, settings, path, prefix, f"the VAE of {os.path.basename(path)}")


def _vae_prefix(path: str) -> str:
    """The checkpoint's VAE key prefix as ComfyUI's loader finds it: its model config's vae_key_prefix (detected from
    the header's tensor names and stated config, as load_state_dict_guess_config detects it), the first one the file's
    names carry; else ComfyUI's default or `vae.`, whichever the file carries."""
    import comfy.model_detection as detection
    from ..engine.models.load import checkpoint_files, header_tensors, read_headers
    prefixes = []
    try:
        sd = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in header_tensors(path).items()}
        header = read_headers(checkpoint_files(path))[1]
        stated = {"metadata": {"config": header["config"]}} if isinstance(header.get("config"), str) else {}
        config = detection.model_config_from_unet(sd, detection.unet_prefix_from_state_dict(sd), **stated)
        prefixes = list(getattr(config, "vae_key_prefix", None) or [])
    except Exception:   # a file ComfyUI's detection cannot read: the names decide
        sd = {}
    candidates = prefixes + ["first_stage_model.", "vae."]
    return next((p for p in candidates if any(k.startswith(p) for k in sd)), candidates[0])


def on_ranks(vae, settings: core.EngineSettings, path: str | None, prefix: str, name: str):
    """ComfyUI's VAE `vae` (of the file in `path`; a checkpoint's: its tensors named with `prefix`) made an EngineVAE
    where the engine splits its type; ComfyUI's own VAE, said once, where it does not."""
    info, why = splits(path, prefix)
    if info is None:
        say_once(f"xDiT VAE Loader: {name}: {why}; ComfyUI's own VAE decodes and encodes it")
        return vae
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(vae.first_stage_model).__mro__]
    mismatch = comfyui_mismatch(info, classes, vae.latent_channels, _version())
    if mismatch:
        raise ValueError(mismatch)
    if vae.vae_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        say_once(f"xDiT VAE Loader: {name} computes in {vae.vae_dtype}, which the ranks do not; ComfyUI's own VAE "
                 f"decodes and encodes it")
        return vae
    vae.__class__ = EngineVAE
    vae.xdit = EngineVAELink(settings, info, vae.vae_dtype, _attention())
    return vae
