"""What a VAE decode or encode costs, for the planner and the Info node: the network of any kind in load.KINDS run once
on the meta device at the job's size (no memory, no weights read), counting its FLOPs (torch's flop counter rules),
the high-water mark of its live tensors, the rows each row-reaching convolution reads beyond a band (the halo a split
sends per boundary), its K/V gathers and its frame-wide norms; then priced for N ranks of a device.

A row split (engine/vae/layers.py) divides the compute by the ranks' share of rows and adds, per boundary, the halo
rows (posted together, awaited: exposed), one exchange's latency per row-reaching convolution, the K/V all-gather of
each attention and two all-reduces per frame-wide norm. The tile pool (tiles.py) gives each rank whole tiles: its
time is the busiest rank's tiles. Memory per rank: the weights (whole on every rank) and the activations' share.

A clip of many latent frames is counted at two short lengths and extrapolated (the chunk loops repeat: every chunk
after the first costs the same), so pricing an 81-frame decode takes as long as a 5-frame one.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .layers import RowLayer
from .load import Kind

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The share of the GPU's eager efficiency (devices.efficiency: a DiT step's share of the rated bf16 rate) a
# convolutional VAE decode reaches: its 3-D convolutions of 96-384 channels and per-position norms run far from the
# tensor cores' rate. Fitted to sglang's Wan 2.1 VAE decode, 832x480x81 on one H200 (2.63 s, published/vae.py:
# fitted_conv_share); the other rows are held out.
CONV_SHARE = 0.335
P2P_LATENCY_US = 20.0        # one halo exchange (a pair of sends and receives posted together), NCCL over a link
HOST_COPY_GBS = 20.0         # a rank's band of the result, device to shared memory (pinned PCIe copy)


@dataclass(frozen=True)
class Counted:
    """One decode or encode of one input shape, unsplit."""
    flops: float
    peak_bytes: int          # the live tensors' high-water mark (activations, caches, the input and the result)
    weight_bytes: int
    halo_bytes: int          # bytes one rank sends across one boundary, one way, summed over the row-reaching layers
    exchanges: int           # row-reaching layer calls (one halo exchange each)
    gather_bytes: int        # K and V of every attention call, whole frame (each rank receives (N-1)/N of it)
    attentions: int          # attention calls (a split holds one call's whole-frame K and V at a time)
    norms: int               # frame-wide norm calls (two all-reduces each)
    rows: int                # the split's rows (latent rows for a decode, pixel rows / ratio for an encode)
    out_bytes: int


class _Count(TorchDispatchMode):
    """FLOPs (torch's flop registry, composite ops decomposed to what it counts) and live storage bytes."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.live: dict[int, list] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self.live[key]
                self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket not in flop_registry:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.live:
                    self.live[key][1] += 1
                else:
                    self.live[key] = [storage.nbytes(), 1]
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, key)
        return out


def _tally_layers(model: nn.Module, tally: dict) -> list:
    """Hooks counting what a split of `model`'s row layers would exchange (layers.py): a convolution reaching rows
    beyond the band (its row padding each way, or a strided one the row below), an attention's K and V, a frame-wide
    norm."""
    hooks = []
    for m in model.modules():
        if not isinstance(m, RowLayer):
            continue
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            pad = m.padding[-2] if isinstance(m.padding, tuple) else 0
            rows = pad or (1 if m.stride[-2] > 1 and m.kernel_size[-2] > 1 else 0)
            if rows:
                def conv(mod, args, rows=rows):
                    x = args[0]
                    tally["halo"] += rows * x.numel() // max(1, x.shape[-2]) * x.element_size()
                    tally["exchanges"] += 1
                hooks.append(m.register_forward_pre_hook(conv))
        elif isinstance(m, nn.GroupNorm):
            hooks.append(m.register_forward_pre_hook(lambda mod, args: tally.__setitem__("norms", tally["norms"] + 1)))
        else:   # a row layer of its own: the attention of the frame's positions (K and V gathered)
            def attend(mod, args):
                tally["gather"] += 2 * args[0].numel() * args[0].element_size()
                tally["attentions"] += 1
            hooks.append(m.register_forward_pre_hook(attend))
    return hooks


_COUNTED: dict[tuple, Counted] = {}


def _count_once(kind: Kind, widths: tuple, shape: tuple, op: str, dtype: str) -> Counted:
    key = (kind.name, widths, shape, op, dtype)
    if key not in _COUNTED:
        if len(_COUNTED) > 64:
            _COUNTED.clear()
        _COUNTED[key] = _run_once(kind, widths, shape, op, dtype)
    return _COUNTED[key]


def _run_once(kind: Kind, widths: tuple, shape: tuple, op: str, dtype: str) -> Counted:
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with torch.device("meta"):
        model = kind.build(**dict(widths)).to(dt)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    tally = {"halo": 0, "exchanges": 0, "gather": 0, "attentions": 0, "norms": 0}
    hooks = _tally_layers(model, tally)
    counter = _Count()
    try:
        with torch.inference_mode(), counter:
            x = torch.empty(shape, device="meta", dtype=dt)
            out = model.decode(x) if op == "decode" else model.encode(x)
    finally:
        for h in hooks:
            h.remove()
    rows = shape[-2] if op == "decode" else shape[-2] // kind.spatial
    return Counted(float(counter.flops), counter.peak, weight_bytes, tally["halo"], tally["exchanges"],
                   tally["gather"], tally["attentions"], tally["norms"], rows, out.numel() * out.element_size())


def count(kind: Kind, widths: dict, shape: tuple, op: str = "decode", dtype: str = "bf16") -> Counted:
    """The counts of `op` on an input of `shape` ([B, C, T, H, W]; a long clip extrapolated from two short ones)."""
    shape = tuple(int(s) for s in shape)
    key = tuple(sorted(widths.items()))
    if len(shape) != 5:
        return _count_once(kind, key, shape, op, dtype)
    step = 2 if op == "decode" else 8   # latent frames, or clip frames, of whole chunks of every kind in the engine
    short = 1 + step
    if shape[2] <= short + step:
        return _count_once(kind, key, shape, op, dtype)
    a = _count_once(kind, key, shape[:2] + (short,) + shape[3:], op, dtype)
    b = _count_once(kind, key, shape[:2] + (short + step,) + shape[3:], op, dtype)
    k = (shape[2] - short) / step

    def grow(x, y):
        return x + (y - x) * k
    return Counted(grow(a.flops, b.flops), int(grow(a.peak_bytes, b.peak_bytes)), a.weight_bytes,
                   int(grow(a.halo_bytes, b.halo_bytes)), int(round(grow(a.exchanges, b.exchanges))),
                   int(grow(a.gather_bytes, b.gather_bytes)), int(round(grow(a.attentions, b.attentions))),
                   int(round(grow(a.norms, b.norms))), a.rows,
                   int(grow(a.out_bytes, b.out_bytes)))


@dataclass(frozen=True)
class Estimate:
    """A decode or encode priced for `ranks` ranks (seconds; GiB per rank)."""
    ranks: int
    how: str                 # "rows" (each rank a band of every frame) or "tiles" (whole tiles a rank)
    compute_s: float
    halo_s: float
    latency_s: float
    gather_s: float
    copy_s: float
    weights_gib: float
    activations_gib: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.halo_s + self.latency_s + self.gather_s + self.copy_s

    @property
    def memory_gib(self) -> float:
        return self.weights_gib + self.activations_gib

    def describe(self) -> str:
        split = "a band of rows of every frame a rank" if self.how == "rows" else "whole tiles a rank"
        return (f"est. {self.seconds:.2f} s on {self.ranks} rank(s) ({split}: compute {self.compute_s:.2f} s, "
                f"halo and gathers {self.halo_s + self.gather_s + self.latency_s:.3f} s), "
                f"{self.memory_gib:.1f} GiB a GPU (weights {self.weights_gib:.2f}, activations "
                f"{self.activations_gib:.1f})")


def rate_flops(hw, transformer: bool = False) -> float:
    """FLOP/s one GPU of `hw` reaches on a VAE: its eager efficiency (devices.py, a DiT step's) times CONV_SHARE for a
    convolutional network; a transformer decoder (MiniMax-H3's ViT) at the DiT's own share."""
    from ..parallel.devices import efficiency
    share = efficiency(hw.gpu, False)[0]
    return hw.rated_tflops * 1e12 * share * (1.0 if transformer else CONV_SHARE)


def price(c: Counted, ranks: int, hw, *, tiles: int = 0, transformer: bool = False) -> Estimate:
    """`c` on `ranks` GPUs of `hw`: a row split (tiles=0; the rows as layers.split_rows deals them, on the first
    min(ranks, rows) ranks) or a tile pool of `tiles` equal tiles (c: one tile)."""
    GiB = 2 ** 30
    rate = rate_flops(hw, transformer)
    if tiles:
        per_rank = math.ceil(tiles / ranks)
        return Estimate(ranks, "tiles", per_rank * c.flops / rate, 0.0, 0.0, 0.0,
                        per_rank * c.out_bytes / (HOST_COPY_GBS * 1e9), c.weight_bytes / GiB,
                        (c.peak_bytes + per_rank * c.out_bytes) / GiB)
    n = max(1, min(ranks, c.rows))
    share = math.ceil(c.rows / n) / c.rows   # the largest band's share of the rows
    link = hw.link.bandwidth_gbs * 1e9
    split = n > 1
    kv = c.gather_bytes // c.attentions if split and c.attentions else 0   # one call's gathered K and V
    return Estimate(n, "rows", c.flops * share / rate,
                    c.halo_bytes / link if split else 0.0,
                    (c.exchanges * P2P_LATENCY_US + 2 * c.norms * hw.link.latency_us) / 1e6 if split else 0.0,
                    c.gather_bytes * (n - 1) / n / link if split else 0.0,
                    c.out_bytes * share / (HOST_COPY_GBS * 1e9), c.weight_bytes / GiB,
                    (c.peak_bytes * share + kv) / GiB)


# ComfyUI's VAE class of each engine family's released VAE (what its stock workflows load), by family and by variant
# where a family's variants differ: the Kind of load.KINDS with that comfy_class prices it, once the engine has one.
MODEL_VAES = {
    "flux": "comfy.ldm.models.autoencoder.AutoencodingEngine",
    "sd3": "comfy.ldm.models.autoencoder.AutoencodingEngine",
    "flux2": "comfy.ldm.models.autoencoder.AutoencoderKL",
    "qwen-image": "comfy.ldm.wan.vae.WanVAE",
    "wan": "comfy.ldm.wan.vae.WanVAE",
    "wan2.2-ti2v-5b": "comfy.ldm.wan.vae2_2.WanVAE",
    "ltx23": "comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE",
    "minimax-h3": "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE",
}


def kind_for_model(family: str, variant: str) -> tuple[Kind | None, str]:
    """(the engine's Kind of the model's VAE, None where the engine does not split it, and its ComfyUI class)."""
    from .load import KINDS
    comfy_class = MODEL_VAES.get(variant) or MODEL_VAES.get(family, "")
    return next((k for k in KINDS if k.comfy_class == comfy_class), None), comfy_class


def decode_estimates(family: str, variant: str, latent_shape: tuple, ranks: list[int], hw, dtype: str = "bf16",
                     model_title: str = "") -> tuple[Kind | None, list[Estimate], str]:
    """The model's VAE decode of `latent_shape` priced on each count of `ranks` GPUs of `hw`, at the released widths:
    (its Kind, the estimates, "") or (None, [], why it is not priced)."""
    found, comfy_class = kind_for_model(family, variant)
    if found is None:
        return None, [], (f"{model_title or family}'s VAE ({comfy_class or 'unknown'}) is not split by the engine "
                          f"yet (ComfyUI's own decodes it): not priced")
    try:
        counted = count(found, {}, tuple(latent_shape), "decode", dtype)
    except Exception as e:   # a network that cannot run on the meta device at this size
        return found, [], f"the {found.title} VAE's decode could not be counted at {list(latent_shape)} ({e})"
    return found, [price(counted, n, hw) for n in ranks], ""
