"""The row-split leaf layers of a VAE: each rank of a process group holds one band of rows of every frame, the same
band at every level of the network (scaled by the level's ratio to the split's own level), and each layer here computes
on that band exactly what the unsplit layer computes on those rows.

- a convolution reads `k // 2` rows beyond the band: they come from the neighbours (non-blocking P2P, gloo on CPU,
  NCCL on GPU), and the layer's own padding applies only at the frame's true top (first rank) and bottom (last rank);
- ComfyUI's causal 3-D convolution (comfy/ldm/wan/vae.py:16-47) keeps its temporal cache WITH the halo rows (the cache
  is cut from the band after the exchange), so cached frames are never sent again;
- a stride-2 downsample after ComfyUI's ZeroPad2d((0, 1, 0, 1)) reads one row below the band only (the zero row is the
  last rank's); bands are even there;
- GroupNorm takes its statistics over the whole frame (two all-reduces: sums, then squares about the global mean);
- mid-block attention keeps its queries local and all-gathers K and V along the rows (the frame's raster order).

A split of one rank takes the plain local path (the layer as torch computes it unsplit), with no collective. No layer
synchronises the host with the device: a wait on a P2P or collective work orders the streams on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PAD_MODES = ("zeros", "reflect", "replicate")


def split_rows(total: int, members: int) -> tuple[int, ...]:
    """`total` rows over `members` ranks as evenly as possible, the first ranks taking one more (every rank one at
    least: `members` <= `total`)."""
    if not 1 <= members <= total:
        raise ValueError(f"{total} rows cannot be split over {members} ranks (each needs one row at least)")
    return tuple(total // members + (1 if r < total % members else 0) for r in range(members))


@dataclass
class RowSplit:
    """Which band of rows this rank holds: its place `index` among the members (0: the frame's top), every member's
    row count at the split's own level (`rows`: e.g. latent rows), the members' global ranks top to bottom (`peers`)
    and their process group (None for one member). `sent` counts the bytes this rank sent, by kind."""
    index: int = 0
    rows: tuple[int, ...] = (1,)
    peers: tuple[int, ...] = (0,)
    group: object = None
    sent: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.rows)

    @property
    def single(self) -> bool:
        return len(self.rows) == 1

    @property
    def top(self) -> bool:
        return self.index == 0

    @property
    def bottom(self) -> bool:
        return self.index == len(self.rows) - 1

    @property
    def start(self) -> int:
        """The band's first row at the split's own level."""
        return sum(self.rows[:self.index])

    def level_rows(self, local_rows: int) -> tuple[int, ...]:
        """Every member's rows at the level of a tensor whose band here has `local_rows` rows."""
        base = self.rows[self.index]
        if local_rows % base:
            raise ValueError(f"a band of {local_rows} rows is not a whole multiple of the split's {base}")
        return tuple(r * (local_rows // base) for r in self.rows)

    def note(self, kind: str, nbytes: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + int(nbytes)


class RowLayer:
    """A layer that computes on a RowSplit's band; `bind` sets the split (None: the whole frame on one rank)."""
    split: RowSplit | None = None

    @property
    def local(self) -> bool:
        return self.split is None or self.split.single


def bind(model: nn.Module, split: RowSplit | None, **settings) -> nn.Module:
    """Give every row layer of `model` this split (and attributes such as `attention=`), for the next calls."""
    for m in model.modules():
        if isinstance(m, RowLayer):
            m.split = split
            for name, value in settings.items():
                if hasattr(m, name):
                    setattr(m, name, value)
    return model


# ---- rows between neighbours ---------------------------------------------------------------------------------------
def exchange_rows(x: torch.Tensor, split: RowSplit, above: int, below: int, dim: int = -2):
    """(the last `above` rows of the member above, the first `below` rows of the member below), None at the frame's
    edges; this band's own edge rows go the other way. All sends and receives are posted at once, then awaited."""
    top = bottom = None
    ops = []
    n = x.shape[dim]
    if above and not split.top:
        top = x.new_empty(x.shape[:dim % x.ndim] + (above,) + x.shape[dim % x.ndim + 1:])
        ops.append(dist.P2POp(dist.irecv, top, split.peers[split.index - 1], split.group))
    if above and not split.bottom:
        rows = x.narrow(dim, n - above, above).contiguous()
        ops.append(dist.P2POp(dist.isend, rows, split.peers[split.index + 1], split.group))
        split.note("halo", rows.numel() * rows.element_size())
    if below and not split.bottom:
        bottom = x.new_empty(x.shape[:dim % x.ndim] + (below,) + x.shape[dim % x.ndim + 1:])
        ops.append(dist.P2POp(dist.irecv, bottom, split.peers[split.index + 1], split.group))
    if below and not split.top:
        rows = x.narrow(dim, 0, below).contiguous()
        ops.append(dist.P2POp(dist.isend, rows, split.peers[split.index - 1], split.group))
        split.note("halo", rows.numel() * rows.element_size())
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return top, bottom


def _edge(x: torch.Tensor, n: int, mode: str, at_top: bool, dim: int) -> torch.Tensor:
    """`n` rows of padding in `mode` beyond the top (or bottom) row of `x` along `dim`."""
    if mode == "zeros":
        return x.new_zeros(x.shape[:dim % x.ndim] + (n,) + x.shape[dim % x.ndim + 1:])
    size = x.shape[dim]
    if mode == "replicate":
        edge = x.narrow(dim, 0 if at_top else size - 1, 1)
        return torch.cat([edge] * n, dim) if n > 1 else edge
    if mode == "reflect":
        if size <= n:
            raise ValueError(f"reflect padding of {n} rows needs more than {n} rows, the band has {size}")
        return (x.narrow(dim, 1, n) if at_top else x.narrow(dim, size - 1 - n, n)).flip(dim)
    raise ValueError(f"padding mode {mode!r} is not one of {PAD_MODES}")


def pad_rows(x: torch.Tensor, split: RowSplit | None, before: int, after: int, mode: str = "zeros",
             dim: int = -2) -> torch.Tensor:
    """The band with `before` rows above and `after` below: the neighbours' rows where the frame goes on, the layer's
    own padding (`mode`) at the frame's true top and bottom only."""
    if split is None or split.single:
        top = bottom = None
        is_top = is_bottom = True
    else:
        top, bottom = exchange_rows(x, split, before, after, dim)
        is_top, is_bottom = split.top, split.bottom
    if is_top and before:   # reflect reads past the band's first rows: the rows below it count
        top = _edge(torch.cat([x, bottom], dim) if bottom is not None else x, before, mode, True, dim)
    if is_bottom and after:
        bottom = _edge(torch.cat([top, x], dim) if top is not None else x, after, mode, False, dim)
    parts = [p for p in (top, x, bottom) if p is not None]
    return torch.cat(parts, dim) if len(parts) > 1 else x


def gather_rows(x: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """Every member's band of `x` (rows at dim -2, bands of unequal size allowed) in the frame's order, on every
    member: one all-gather of the bands padded to the largest."""
    rows = split.level_rows(x.shape[-2])
    most = max(rows)
    if x.shape[-2] < most:
        x = torch.cat([x, x.new_zeros(x.shape[:-2] + (most - x.shape[-2], x.shape[-1]))], -2)
    x = x.contiguous()
    out = x.new_empty((split.world * x.shape[0],) + tuple(x.shape[1:]))   # the bands stacked along dim 0
    dist.all_gather_into_tensor(out, x, group=split.group)
    split.note("gather", x.numel() * x.element_size() * (split.world - 1))
    out = out.view((split.world,) + tuple(x.shape))
    return torch.cat([out[i].narrow(-2, 0, r) for i, r in enumerate(rows)], -2)


# ---- convolutions --------------------------------------------------------------------------------------------------
class RowConv2d(RowLayer, nn.Conv2d):
    """nn.Conv2d (stride 1) on the band: its `padding` rows from the neighbours, its `padding_mode` at the frame's
    edges."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            return super().forward(x)
        rows, cols = self.padding
        x = pad_rows(x, self.split, rows, rows, self.padding_mode)
        if cols and self.padding_mode != "zeros":
            x, cols = F.pad(x, (cols, cols, 0, 0), mode=self.padding_mode), 0
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, cols), self.dilation, self.groups)


class RowDownConv2d(RowLayer, nn.Conv2d):
    """A stride-2 conv (padding 0) after ComfyUI's ZeroPad2d((0, 1, 0, 1)) (Wan's downsamples,
    comfy/ldm/wan/vae.py:88-95; FLUX's, comfy/ldm/modules/diffusionmodules/model.py:143-171): the row after the band
    comes from the member below, the zero row is the last member's; the band's rows are even."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            return super().forward(F.pad(x, (0, 1, 0, 1)))
        if x.shape[-2] % 2:
            raise ValueError(f"a stride-2 downsample needs an even band of rows, this rank has {x.shape[-2]}")
        _, below = exchange_rows(x, self.split, 0, 1)
        x = torch.cat([x, below if below is not None else _edge(x, 1, "zeros", False, -2)], -2)
        return F.conv2d(F.pad(x, (0, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class CausalConv3d(RowLayer, nn.Conv3d):
    """ComfyUI's CausalConv3d (comfy/ldm/wan/vae.py:16-47) on the band: time padded causally, 2 * padding[0] frames
    in front, taken from the cache first and zeros for the rest; a frame alone with no cache through the last temporal
    tap only (ComfyUI's "causal_zero" fast path, comfy/ops.py:611-613). Rows are padded by `halo` (the neighbours'
    rows, zeros at the frame's edges) before the call, so a cache cut from a haloed band keeps its halo."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.time_pad = 2 * self.padding[0]

    def halo(self, x: torch.Tensor) -> torch.Tensor:
        """The band with the rows the kernel reaches beyond it; the band itself on one rank (the conv pads)."""
        if self.local or not self.padding[1]:
            return x
        return pad_rows(x, self.split, self.padding[1], self.padding[1], "zeros")

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        """x: the band from `halo`; cache: the frames before it (as cut from earlier haloed bands), or None."""
        padding = (0, self.padding[1] if self.local else 0, self.padding[2])
        if cache is None and x.shape[2] == 1:
            return F.conv3d(x, self.weight[:, :, -1:], self.bias, self.stride, padding, self.dilation, self.groups)
        if self.time_pad:
            have = 0 if cache is None else cache.shape[2]
            parts = []
            if self.time_pad > have:
                parts.append(x.new_zeros(x.shape[:2] + (self.time_pad - have,) + x.shape[3:]))
            if have:
                parts.append(cache.to(x.device))
            x = torch.cat(parts + [x], 2)
        return F.conv3d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


# ---- normalisation and attention -----------------------------------------------------------------------------------
class RowGroupNorm(RowLayer, nn.GroupNorm):
    """nn.GroupNorm with its statistics over the whole frame (every member's band): the sums, then the squares about
    the global mean, each all-reduced, accumulated in float32 (float64 across ranks). per_frame: statistics per frame of
    a [N, C, T, H, W] input (MiniMax-H3's TemporalIsolatedGroupNorm, comfy/ldm/minimax/vae.py:59-71)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-6, affine: bool = True,
                 per_frame: bool = False, **kwargs):
        super().__init__(num_groups, num_channels, eps, affine, **kwargs)
        self.per_frame = per_frame

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_frame:
            return self._norm(x)
        n, c, t = x.shape[:3]
        y = self._norm(x.transpose(1, 2).reshape(n * t, c, *x.shape[3:]))
        return y.reshape(n, t, c, *x.shape[3:]).transpose(1, 2)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        n, c, g = x.shape[0], x.shape[1], self.num_groups
        local = x.reshape(n, g, -1).float()
        count = local.shape[-1] // x.shape[-2] * sum(self.split.level_rows(x.shape[-2]))
        sums = local.sum(-1, dtype=torch.float64)
        dist.all_reduce(sums, group=self.split.group)
        mean = (sums / count).float().unsqueeze(-1)
        centred = local - mean
        squares = centred.square().sum(-1, dtype=torch.float64)
        dist.all_reduce(squares, group=self.split.group)
        self.split.note("norm", 2 * sums.numel() * sums.element_size())
        y = (centred * torch.rsqrt((squares / count).float().unsqueeze(-1) + self.eps)).reshape(x.shape)
        if self.affine:
            shape = (1, c) + (1,) * (x.ndim - 2)
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        return y.to(x.dtype)


ATTENTION = ("split", "sdpa")   # ComfyUI's VAE attention on CPU (bmm + softmax) and on NVIDIA (SDPA)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: RowSplit | None = None,
                       kernel: str = "split") -> torch.Tensor:
    """Single-head attention of the band's queries ([N, C, rows, W]) against the whole frame's keys and values (one
    all-gather of K and V together), as ComfyUI's VAE attention computes it (comfy/ldm/modules/diffusionmodules/
    model.py:236-338): `split` its bmm, softmax, bmm (on CPU), `sdpa` torch's scaled_dot_product_attention."""
    if split is not None and not split.single:
        kv = gather_rows(torch.cat([k, v], 1), split)
        k, v = kv.chunk(2, 1)
    shape = q.shape
    n, c = shape[:2]
    if kernel == "sdpa":
        q, k, v = (t.reshape(n, 1, c, -1).transpose(2, 3).contiguous() for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(shape)
    if kernel != "split":
        raise ValueError(f"attention kernel {kernel!r} is not one of {ATTENTION}")
    scores = torch.bmm(q.reshape(n, c, -1).permute(0, 2, 1), k.reshape(n, c, -1)) * (c ** -0.5)
    weights = torch.softmax(scores, dim=2).permute(0, 2, 1)
    return torch.bmm(v.reshape(n, c, -1), weights).reshape(shape)
