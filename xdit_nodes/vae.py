"""What the xDiT VAE Loader's VAE does beside ComfyUI's own, without ComfyUI: which files the engine splits and
whether ComfyUI's own VAE of the file is the network the engine computes, the link that runs a decode or encode on
the engine's ranks (engine/vae/client.py) and tells the Info node, and the lines said when ComfyUI's own VAE runs
instead (comfy_vae.py, imported only inside ComfyUI, holds the VAE class)."""
from __future__ import annotations

import logging
import os
import time

from ..engine.errors import CheckpointError
from ..engine.vae import client
from ..engine.vae.load import DTYPES, VAEInfo, dtype_name, inspect_vae
from . import core

LOG = logging.getLogger("xDiT")
_SAID: set[str] = set()


def say_once(line: str) -> None:
    """A line in ComfyUI's log, once per process (a fallback is said when first met, not at every decode)."""
    if line not in _SAID:
        _SAID.add(line)
        LOG.info(line)


def splits(path: str | None) -> tuple[VAEInfo | None, str]:
    """(the file's VAE, "") where the engine splits it, else (None, why not: the line said as ComfyUI's own runs)."""
    if path is None or not os.path.isfile(path):
        return None, "it is not a single file (ComfyUI builds it)"
    try:
        return inspect_vae(path), ""
    except CheckpointError as e:
        return None, str(e).split(": ComfyUI's own")[0]


def comfyui_mismatch(info: VAEInfo, comfy_classes: list[str], latent_channels: int, version: str) -> str | None:
    """The one line for a ComfyUI whose own VAE of the file is not the network the engine computes (a ComfyUI older
    than the VAE type: it reads the file as another), naming the release it needs; None where they agree.
    comfy_classes: the module-qualified names of ComfyUI's network's class and its bases."""
    if info.kind.comfy_class in comfy_classes and latent_channels == info.latent_channels:
        return None
    return (f"xDiT VAE Loader: this ComfyUI ({version}) reads {os.path.basename(info.path)} as {comfy_classes[0]} with "
            f"{latent_channels} latent channels, not as {info.kind.title}: update ComfyUI to {info.kind.comfyui_since} "
            f"or newer")


class EngineVAELink:
    """The engine side of a ComfyUI VAE whose decode and encode run on the xDiT Engine's ranks: its settings (the
    engine found in the registry at each call: started if it is not running), the file and the compute dtype and
    attention kernel ComfyUI's own VAE would use, so the result is ComfyUI's to rounding."""

    def __init__(self, settings: core.EngineSettings, info: VAEInfo, dtype, attention: str,
                 registry: core.EngineRegistry = core.REGISTRY):
        self.settings, self.info, self.attention, self.registry = settings, info, attention, registry
        self.dtype = dtype_name(dtype)

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    def run(self, op: str, x, on_progress=None, should_cancel=None, noise=None):
        """`op` ("decode" or "encode") of x (channels first) on the ranks: the raw network output in the compute
        dtype, on the CPU (a VAE tiled by definition, MiniMax-H3's: ComfyUI's finished float32 result); noise: the
        decode noise ComfyUI's own VAE would draw (LTX's timestep-conditioned decoders)."""
        record = self.registry.get(self.settings)
        t0 = time.perf_counter()
        out, result = client.run(record.engine, op, self.info.path, x, self.dtype, attention=self.attention,
                                 noise=noise, on_progress=on_progress, should_cancel=should_cancel,
                                 deadlines=self.settings.deadlines)
        vae = next((r["vae"] for r in result.ranks if "rows" in r.get("vae", {})), {})
        if "pieces" in result.ranks[0].get("vae", {}):   # a tile pool: whole pieces a rank
            split = (f"on {len(result.ranks)} rank(s), {[len(r['vae']['pieces']) for r in result.ranks]} of its "
                     f"{result.ranks[0]['vae']['of']} tiles a rank")
        else:
            split = (f"on {len(vae.get('rows', [1]))} rank(s), latent rows {vae.get('rows')} a rank, "
                     f"{vae.get('chunks')} chunk(s)")
        core.note(record, "vae:", f"vae: last {op} of {os.path.basename(self.info.path)} ({self.info.kind.title}, "
                                  f"{self.dtype}) {split}, {time.perf_counter() - t0:.3f} s")
        return out
