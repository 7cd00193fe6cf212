"""A PipeFusion stage's share of a model's forward: the base every family's stage model builds on (embed on the first
stage, this stage's blocks, the final layer on the last), and what is the same for every family: which blocks the
stage holds, which image tokens a sequence-parallel rank holds of a patch, and which latent rows a patch covers."""
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

    def local(self, band: int | None) -> torch.Tensor:
        """Global image-token indices this sequence-parallel rank holds of a patch (None: the whole latent)."""
        return self.layout.local_tokens(band, self.sp.rank)

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
