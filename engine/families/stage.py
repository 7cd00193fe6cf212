"""A PipeFusion stage's share of a model's forward: the base every family's stage model builds on (embed on the first
stage, this stage's blocks, the final layer on the last), and what is the same for every family: which blocks the
stage holds, which image tokens a sequence-parallel rank holds of a patch, and which latent rows a patch covers; and
the stale K/V its attention layers attend through."""
from __future__ import annotations

import torch


class StageModel:
    """A family subclasses this with temb(prepared, sigma32), embed(x, prepared, band, with_text) -> (text, image),
    run_blocks(text, image, temb, band, with_text) -> (text, image), final(image, temb) and unpatch(tokens, band)."""

    def __init__(self, flow, layout, mesh, block_lists: tuple[str, ...], stage: int):
        self.flow, self.model, self.layout, self.mesh = flow, flow.model, layout, mesh
        self.first, self.last = stage == 0, stage == layout.stages - 1
        every = [b for name in block_lists for b in flow.model.get_submodule(name)]
        self.blocks = [every[i] for i in layout.blocks_of(stage)]
        self.patch = flow.family.latent_patch(flow.loaded.info.config)
        self.sp = mesh["sp"]
        # the token indices the loop gathers with, on the device, built once per layout (never copied per call)
        self._indices = {}
        for band in [None] + list(range(layout.patches)):
            idx = self.local(band)
            start = 0 if band is None else layout.band_start(band)
            self._indices[band] = (idx.to(flow.device), (idx - start).to(flow.device))

    def local(self, band: int | None) -> torch.Tensor:
        """Global image-token indices this sequence-parallel rank holds of a patch (None: the whole latent)."""
        return self.layout.local_tokens(band, self.sp.rank)

    def local_index(self, band: int | None) -> torch.Tensor:
        """`local` on the compute device (built once)."""
        return self._indices[band][0]

    def band_index(self, band: int | None) -> torch.Tensor:
        """`local` counted from the patch's first token, on the compute device: this rank's tokens of the patch's
        own token sequence (built once)."""
        return self._indices[band][1]

    def latent_rows(self, band: int | None) -> slice:
        """The latent rows a patch covers (None: all)."""
        if band is None:
            return slice(0, self.layout.rows * self.patch)
        start = sum(self.layout.band_rows[:band]) * self.patch
        return slice(start, start + self.layout.band_rows[band] * self.patch)

    def band_grid(self, band: int | None) -> tuple[int, int]:
        """(token rows, token columns) of a patch."""
        rows = self.latent_rows(band)
        return (rows.stop - rows.start) // self.patch, self.layout.cols

    def temb(self, prepared, sigma32: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, x: torch.Tensor, prepared, band: int | None, with_text: bool):
        raise NotImplementedError

    def run_blocks(self, text, image, temb, band, with_text: bool):
        raise NotImplementedError

    def final(self, image: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        """[b, tokens of the piece in row-major order, features] -> latent rows [b, channels, rows, width]."""
        raise NotImplementedError


# ---- stale K/V: one buffer per attention layer ----------------------------------------------------------------------

class PieceState:
    """What the stage is computing now: the whole latent (band None) or one patch; and which pass group. positions:
    where each patch's keys go in a K/V buffer (Layout.buffer_positions), on the device, built once per layout."""

    def __init__(self, layout, ulysses: int, device: torch.device):
        self.band: int | None = None
        self.group = 0
        self.positions = [layout.buffer_positions(m, ulysses).to(device) for m in range(layout.patches)]


class StaleKV:
    """One attention layer's K/V for the whole latent (this rank's share), per pass group. A whole-latent call
    replaces it; a patch's call writes its fresh keys in place and attends to all of it."""

    def __init__(self, state: PieceState):
        self.state = state
        self.buffers: dict[int, list] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, text: tuple | None):
        """k, v: this call's image keys and values (after the Ulysses exchange); text: fresh text (k, v) or None.
        Returns (text k, v or None, image k, image v) to attend to."""
        s = self.state
        if s.band is None:
            self.buffers[s.group] = [k.contiguous(), v.contiguous(), text]
            return text, k, v
        buf = self.buffers.get(s.group)
        if buf is None:
            raise RuntimeError("a patch reached attention before a whole-latent call filled its K/V")
        pos = s.positions[s.band]
        buf[0].index_copy_(1, pos, k)
        buf[1].index_copy_(1, pos, v)
        if text is not None:
            buf[2] = text
        return buf[2], buf[0], buf[1]
