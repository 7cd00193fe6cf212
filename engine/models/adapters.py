"""Model adapters: an unmodified diffusers transformer seen the way ComfyUI's sampler sees a flow model.

predict(x_model, sigma, which) returns the flow prediction v for the positive (and negative) conditioning,
with ComfyUI's conventions: FLUX packs 2x2 latent patches with (c, ph, pw) channel order and position ids
(0, row, col), takes sigma as its timestep and a guidance value; SD3 takes sigma * 1000. The timestep and
guidance embeddings are computed from fp32 values whatever the compute dtype (ComfyUI does; diffusers'
FLUX would first round timestep * 1000 to the weights' dtype), via a pre-hook on the embedding module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .load import LoadedTransformer


@dataclass
class Conditioning:
    """One side of the conditioning, as ComfyUI's CONDITIONING holds it: cond [B|1, N, 4096] and pooled
    [B|1, D]; FLUX adds guidance (FluxGuidance, default 3.5)."""
    cond: torch.Tensor
    pooled: torch.Tensor
    guidance: float | None = None


def _batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    if t.shape[0] == batch:
        return t
    if t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])
    raise ValueError(f"conditioning batch {t.shape[0]} does not match the latent batch {batch}: give 1 or {batch}")


class FlowAdapter:
    """With a mesh, the parallel plan is applied here: sequence-parallel processors (and SD3's token shard/gather
    hooks) on the model, FLUX tokens sharded per rank, the velocity gathered across the sequence-parallel group,
    and the positive/negative passes split across the CFG group."""

    def __init__(self, loaded: LoadedTransformer, mesh=None):
        self.loaded = loaded
        self.model = loaded.model
        self.family = loaded.family
        self.dtype = loaded.dtype
        self.device = next(p for p in self.model.parameters()).device
        self.mesh = mesh
        self._exact: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._hooks = [self.model.time_text_embed.register_forward_pre_hook(self._fp32_embedding_inputs)]
        self._original_processors = dict(self.model.attn_processors)
        self.sp = mesh["sp"] if mesh is not None and mesh["sp"].size > 1 else None
        self.cfg_group = mesh["cfg"] if mesh is not None and mesh["cfg"].size > 1 else None
        if self.sp is not None:
            self._apply_sequence_parallel()

    def _apply_sequence_parallel(self) -> None:
        from ..parallel.attention import SequenceParallelAttention
        from ..parallel.processors import FluxSPProcessor, SD3SPProcessor, TextTokens

        attention = SequenceParallelAttention(self.mesh)
        self.text = TextTokens()
        if self.family == "flux":
            self.model.set_attn_processor(FluxSPProcessor(attention, self.text))
        else:
            self.model.set_attn_processor(SD3SPProcessor(attention))
            # SD3 adds its positional embedding to the whole patch grid; shard right after it, gather before
            # the un-patchify that needs every token
            self._hooks.append(self.model.pos_embed.register_forward_hook(lambda m, a, out: self._shard(out)))
            self._hooks.append(self.model.proj_out.register_forward_hook(
                lambda m, a, out: self.mesh.all_gather(out, "sp", dim=1, kind="sp_gather")))

    def _shard(self, tokens: torch.Tensor, dim: int = 1) -> torch.Tensor:
        n = tokens.shape[dim] // self.sp.size
        return tokens.narrow(dim, self.sp.rank * n, n)

    def close(self) -> None:
        """Give the model back as it was (hooks off, diffusers' own processors), e.g. for another plan."""
        for hook in self._hooks:
            hook.remove()
        if self.sp is not None:
            self.model.set_attn_processor(self._original_processors)

    def _fp32_embedding_inputs(self, module, args):
        if self._exact is None:
            return None
        timestep, guidance = self._exact
        if len(args) == 3:  # FLUX with guidance: (timestep, guidance, pooled)
            return (timestep, guidance, args[2])
        return (timestep, args[1])

    def predictor(self, positive: Conditioning, negative: Conditioning | None):
        """A Predict callable for the sampler, bound to this job's conditioning (prepared once, not per step)."""
        prepared: dict[tuple, tuple] = {}

        def prepare(sides: list[Conditioning], batch: int) -> tuple:
            key = (tuple(id(s) for s in sides), batch)
            if key not in prepared:
                cond = torch.cat([_batch(s.cond, batch) for s in sides]).to(self.device, self.dtype)
                pooled = torch.cat([_batch(s.pooled, batch) for s in sides]).to(self.device, self.dtype)
                guidance = [3.5 if s.guidance is None else float(s.guidance) for s in sides]
                prepared[key] = (cond, pooled, guidance)
            return prepared[key]

        def predict(x_model: torch.Tensor, sigma: torch.Tensor, which: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
            sides = [positive if w == "pos" else negative for w in which]
            if any(s is None for s in sides):
                raise ValueError("the sampler asked for the negative pass but the job has no negative conditioning")
            batch = x_model.shape[0]
            if self.cfg_group is not None and len(sides) == 2:
                # CFG parallel: this rank runs one side; the pair is exchanged (in group order: pos, neg)
                mine = self.forward(x_model, sigma, prepare([sides[self.cfg_group.rank]], batch), batch)
                both = self.mesh.all_gather(mine, "cfg", dim=0, kind="cfg_gather")
                return tuple(both.chunk(2))
            # batch both passes in one forward when their text lengths agree (exactly the same math)
            if len(sides) == 2 and sides[0].cond.shape[1] == sides[1].cond.shape[1]:
                v = self.forward(torch.cat([x_model, x_model]), sigma, prepare(sides, batch), batch)
                return tuple(v.chunk(2))
            return tuple(self.forward(x_model, sigma, prepare([s], batch), batch) for s in sides)
        return predict

    @torch.no_grad()
    def forward(self, x_model: torch.Tensor, sigma: torch.Tensor, prepared: tuple, batch: int) -> torch.Tensor:
        cond, pooled, guidance = prepared
        n = x_model.shape[0]
        sigma32 = sigma.detach().to(torch.float32).reshape(-1).expand(n).to(self.device)
        x = x_model.to(self.device, self.dtype)
        if self.family == "flux":
            v = self._flux(x, sigma32, cond, pooled, guidance, batch)
        else:
            self._exact = (sigma32 * 1000.0, None)
            try:
                v = self.model(hidden_states=x, encoder_hidden_states=cond, pooled_projections=pooled,
                               timestep=sigma32 * 1000.0, return_dict=False)[0]
            finally:
                self._exact = None
        return v.to(torch.float32)

    def _flux(self, x, sigma32, cond, pooled, guidance_values, batch):
        b, c, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"FLUX latent {h}x{w} is not a multiple of its 2x2 patches: width and height must be "
                             f"multiples of 16 pixels")
        packed = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        rows = torch.arange(h // 2, device=self.device).repeat_interleave(w // 2)
        cols = torch.arange(w // 2, device=self.device).repeat(h // 2)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(torch.float32)
        txt_ids = torch.zeros(cond.shape[1], 3, device=self.device)
        if self.sp is not None:
            packed, img_ids = self._shard(packed), self._shard(img_ids, dim=0)
            self.text.replicated = cond.shape[1] % self.sp.size != 0
            self.text.count = cond.shape[1]
            if not self.text.replicated:  # text tokens split with the image tokens
                cond, txt_ids = self._shard(cond), self._shard(txt_ids, dim=0)
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = torch.tensor(guidance_values, dtype=torch.float32, device=self.device).repeat_interleave(batch)
        self._exact = (sigma32 * 1000.0, guidance * 1000.0 if guidance is not None else None)
        try:
            out = self.model(hidden_states=packed, encoder_hidden_states=cond, pooled_projections=pooled,
                             timestep=sigma32, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                             return_dict=False)[0]
        finally:
            self._exact = None
        if self.sp is not None:
            out = self.mesh.all_gather(out, "sp", dim=1, kind="sp_gather")
        return out.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
