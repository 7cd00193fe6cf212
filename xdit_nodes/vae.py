"""What the xDiT VAE Loader's VAE does beside ComfyUI's own, without ComfyUI: which files the engine splits and
whether ComfyUI's own VAE of the file is the network the engine computes, the link that runs a decode or encode on
the engine's ranks (engine/vae/client.py) and tells the Info node, and the lines said when ComfyUI's own VAE runs
instead (comfy_vae.py, imported only inside ComfyUI, holds the VAE class)."""
from __future__ import annotations

import logging
import os
import time

import torch

from ..engine.errors import CheckpointError
from ..engine.vae import client, cost, room, tiles
from ..engine.vae.load import DTYPES, VAEInfo, dtype_name, inspect_vae
from . import core

LOG = logging.getLogger("xDiT")
_SAID: set[str] = set()


def say_once(line: str) -> None:
    """A line in ComfyUI's log, once per process (a fallback is said when first met, not at every decode)."""
    if line not in _SAID:
        _SAID.add(line)
        LOG.info(line)


def splits(path: str | None, prefix: str = "") -> tuple[VAEInfo | None, str]:
    """(the file's VAE, "") where the engine splits it (a checkpoint's: its tensors named with `prefix`), else (None,
    why not: the line said as ComfyUI's own runs)."""
    if path is None or not os.path.isfile(path):
        return None, "it is not a single file (ComfyUI builds it)"
    try:
        return inspect_vae(path, prefix), ""
    except CheckpointError as e:
        return None, str(e).split(": ComfyUI's own")[0]


def older_than(version: str, since: str) -> bool:
    """Whether ComfyUI `version` ("0.3.64") is older than release `since`; False where either is not a release."""
    try:
        return tuple(int(x) for x in version.split(".")) < tuple(int(x) for x in since.split("."))
    except ValueError:
        return False


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

    def result_shape(self, op: str, shape: tuple) -> tuple[int, ...]:
        """The shape of `op`'s result for an input of `shape`."""
        return self.info.decoded_shape(tuple(shape)) if op == "decode" else self.info.encoded_shape(tuple(shape))

    def takes(self, op: str, shape: tuple) -> bool:
        """Whether the ranks compute `op` for an input of `shape` (an encode's tile must be whole latent pixels)."""
        try:
            (self.info.check_latent if op == "decode" else self.info.check_pixels)(tuple(shape))
        except ValueError:
            return False
        return True

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    def device_need(self, op: str, shapes: list, tiles: bool = False) -> int:
        """Bytes a job of `op` on inputs of `shapes` takes on each GPU of the ranks beyond what they hold already: its
        activations (engine/vae/room.py's count), and the VAE's weights before its first job; 0 on CPU ranks."""
        if self.settings.device != "cuda":
            return 0
        ranks = type("Ranks", (), {"device": "cuda", "world": len(self.settings.gpus)})   # what job_need reads
        need = room.job_need(ranks, self.info, [tuple(s) for s in shapes], op, self.dtype, tiles)
        return need["need_bytes"] + (0 if self.loaded else need["weight_bytes"])

    def run(self, op: str, x, on_progress=None, should_cancel=None, before=None, noise=None):
        """`op` ("decode" or "encode") of x (channels first) on the ranks: the raw network output in the compute
        dtype, on the CPU (a VAE tiled by definition, MiniMax-H3's: ComfyUI's finished float32 result).
        before(need_bytes): ComfyUI's room on its own GPU, called first; noise: the decode noise ComfyUI's own VAE
        would draw (LTX's timestep-conditioned decoders)."""
        if before is not None:
            before(self.device_need(op, [tuple(x.shape)]))
        record = self.registry.get(self.settings)
        t0 = time.perf_counter()
        out, result = client.run(record.engine, op, self.info.path, x, self.dtype, prefix=self.info.prefix,
                                 attention=self.attention, noise=noise, on_progress=on_progress,
                                 should_cancel=should_cancel,
                                 deadlines=self.settings.deadlines)
        self.loaded = True
        vae = next((r["vae"] for r in result.ranks if "rows" in r.get("vae", {})), {})
        if "pieces" in result.ranks[0].get("vae", {}):   # a tile pool: whole pieces a rank
            ranks = len(result.ranks)
            split = (f"on {ranks} rank(s), {[len(r['vae']['pieces']) for r in result.ranks]} of its "
                     f"{result.ranks[0]['vae']['of']} tiles a rank")
        else:
            ranks = len(vae.get("rows", [1]))
            split = f"on {ranks} rank(s), latent rows {vae.get('rows')} a rank, {vae.get('chunks')} chunk(s)"
        self._note(record, result, f"vae: last {op} of {self._name()} ({self.info.kind.title}, {self.dtype}) {split}: "
                                   f"{time.perf_counter() - t0:.3f} s", op, tuple(x.shape), ranks, 0)
        return out

    def run_tiles(self, op: str, pieces: list, on_progress=None, should_cancel=None, before=None) -> list:
        """`op` of every tile in one job, the tiles spread over the ranks (engine/vae/tiles.py): the raw results in the
        tiles' order, in the compute dtype, on the CPU."""
        if before is not None:
            before(self.device_need(op, [tuple(p.shape) for p in pieces], tiles=True))
        record = self.registry.get(self.settings)
        t0 = time.perf_counter()
        outs, result = tiles.run(record.engine, op, self.info.path, pieces, self.dtype, prefix=self.info.prefix,
                                 attention=self.attention, on_progress=on_progress, should_cancel=should_cancel,
                                 deadlines=self.settings.deadlines)
        self.loaded = True
        counts = [len(r.get("vae", {}).get("tiles", [])) for r in result.ranks]
        largest = max((tuple(p.shape) for p in pieces), key=lambda s: torch.Size(s).numel())
        self._note(record, result, f"vae: last tiled {op} of {self._name()} ({self.info.kind.title}, {self.dtype}): "
                                   f"{len(pieces)} tiles over {len(counts)} rank(s) ({counts} a rank, each tile whole "
                                   f"on one rank): {time.perf_counter() - t0:.3f} s",
                   op, largest, len(counts), len(pieces))
        return outs

    loaded = False   # a job of this VAE has run (its weights are on the ranks, kept)

    def _name(self) -> str:
        return os.path.basename(self.info.path) + (f" ({self.info.prefix} tensors)" if self.info.prefix else "")

    def _note(self, record, result, line: str, op: str, shape: tuple, ranks: int, pieces: int) -> None:
        """The Info node's line of the last VAE job: what ran, its time, the planner's estimate of it on these GPUs
        (engine/vae/cost.py) and any model the ranks moved to make room."""
        if self.settings.device == "cuda":
            try:
                hw = self.registry.machine(self.settings).view().hardware
                counted = cost.count(self.info.kind, self.info.widths, shape, op, self.dtype)
                line += "; planned: " + cost.price(counted, ranks, hw, tiles=pieces).describe()
            except Exception as e:   # the estimate never hides the result
                line += f"; not priced ({e})"
        moved = [m for r in result.ranks for m in r.get("residency_moves", [])]
        if moved:
            line += "; to make room the ranks moved: " + "; ".join(sorted(set(moved)))
        core.note(record, "vae:", line)


class TilePool:
    """ComfyUI's own tiler (its tiles, feather masks and sums, in its order) with every tile computed on the ranks in
    one job: the tiler runs twice. First with a stand-in network that records each tile it is given and answers
    zeros of the result's shape (the tiler's arithmetic needs nothing else); then, after the engine computed every
    recorded tile, with one that answers the engine's results in the same order. The second pass's tiles are checked
    against the first's. Tiles the ranks do not compute (`takes` false) go to `own` in the first pass, their results
    kept for the second. One tile alone runs as an ordinary job (`single`: the frame split across the ranks)."""

    def __init__(self, op: str, link: EngineVAELink, run_all, single, own=None):
        self.op, self.link, self.run_all, self.single, self.own = op, link, run_all, single, own
        self.tiles: list = []      # the recorded inputs, on the CPU
        self.results: list = []    # per tile: its result, or None where the ranks compute it

    def __call__(self, tiler):
        """tiler(network) -> ComfyUI's tiled result, with `network` standing for the VAE's network."""
        tiler(self._record)
        sent = [i for i, r in enumerate(self.results) if r is None]
        if len(sent) == 1:
            self.results[sent[0]] = self.single(self.tiles[sent[0]])
        elif sent:
            for i, out in zip(sent, self.run_all([self.tiles[i] for i in sent])):
                self.results[i] = out
        given = iter(range(len(self.tiles)))

        def replay(x):
            i = next(given, None)
            if i is None or tuple(x.shape) != tuple(self.tiles[i].shape):
                raise RuntimeError(f"xDiT VAE Loader: ComfyUI's tiler asked for {list(x.shape)} on its second pass, "
                                   f"not the tiles of its first ({len(self.tiles)} tiles)")
            return self.results[i].to(x.device)
        out = tiler(replay)
        if next(given, None) is not None:
            raise RuntimeError(f"xDiT VAE Loader: ComfyUI's tiler asked for fewer tiles on its second pass than the "
                               f"{len(self.tiles)} of its first")
        return out

    def _record(self, x):
        self.tiles.append(x.detach().to("cpu", copy=True))
        if self.link.takes(self.op, x.shape) or self.own is None:
            self.results.append(None)
            return torch.zeros(self.link.result_shape(self.op, x.shape), dtype=x.dtype, device=x.device)
        say_once(f"xDiT VAE Loader: a tile of {list(x.shape)} is not whole latent pixels: ComfyUI's own {self.op} "
                 f"runs for it")
        self.results.append(self.own(x).detach().to("cpu"))
        return self.results[-1].to(x.device)
