"""An unmodified diffusers transformer seen the way ComfyUI's sampler sees a flow model: `velocity(x_model, sigma,
prepared)` is ComfyUI's _apply_model (the model timestep from sigma, processed under a noise mask where the family's
ComfyUI model does so; c_concat attached to the latent's channels), `output(x, timestep, prepared)` ComfyUI's
diffusion model call: one forward pass with the conventions of the model's family (engine/families: how latents become
tokens and positions, what the model takes as its timestep, its reference latents and image context), in float32.
Nothing here knows about ranks: parallel methods are applied around this class by engine/parallel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import families
from ..families.base import pad_text
from .load import LoadedTransformer
from .sharded import gathered


# A benchmark instrument (bench guider --stub-forward), read from the ranks' environment: each forward returns zeros of
# its output's shape at once, so what surrounds the model (the bridge, the protocol, the splits and gathers) is timed
# at real token counts where a tiny model's attention on the CPU would take minutes a call. Unset: the model runs.
FORWARD_STUB_ENV = "XDIT_FORWARD_STUB"   # only from Engine(env=...): runtime/launch.py BENCHMARK_SWITCHES
FORWARD_STUB = os.environ.get(FORWARD_STUB_ENV, "") == "zeros"


@dataclass
class Conditioning:
    """One side of the conditioning, as ComfyUI's CONDITIONING holds it: cond [B|1, N, width], pooled [B|1, D] (None
    for families without one); an embedded guidance value (FluxGuidance) where the family takes one; reference
    latents (raw VAE latents [B|1, C, h, w], ReferenceLatent) with the method that places them."""
    cond: torch.Tensor
    pooled: torch.Tensor | None = None
    guidance: float | None = None
    references: tuple[torch.Tensor, ...] = ()
    reference_method: str = ""          # "": the family's default (ComfyUI's, when the conditioning names none)
    # image-to-video (the CONDITIONING keys ComfyUI's WanImageToVideo & co. set): CLIP-vision features
    # (clip_vision_output's penultimate_hidden_states) [B|1, T, width]; the image's raw VAE latent (concat_latent_image)
    # [B|1, C, F, h, w] and its mask (concat_mask) [B|1, 1|4, F, h, w], 0 where the image is known
    image_context: torch.Tensor | None = None
    concat_latent: torch.Tensor | None = None
    concat_mask: torch.Tensor | None = None
    # the family's own per-call tensors (Family.extras) as the model takes them, [B|1, ...] (Wan-Animate 2's pose
    # branch: pose_latents in model space, context_pose, clip_fea_pose, the strengths); None: none
    extras: dict | None = None

    @property
    def forward_shape(self) -> tuple:
        """What must agree for two sides to share one forward: their token counts, reference positions and image
        context tokens."""
        refs = tuple(tuple(r.shape[1:]) for r in self.references)
        image = None if self.image_context is None else self.image_context.shape[1]
        extras = tuple(sorted((k, tuple(v.shape[1:])) for k, v in (self.extras or {}).items()))
        return self.cond.shape[1], refs, self.reference_method if refs else None, image, extras


@dataclass(frozen=True)
class Prepared:
    """Conditioning for one forward, on the model's device and dtype: the sides stacked along the batch."""
    cond: torch.Tensor
    pooled: torch.Tensor | None
    guidance: torch.Tensor        # fp32, one value per batch row
    references: tuple[torch.Tensor, ...] = ()   # model space [rows, C, h, w], one row per batch row, like cond
    reference_method: str = ""
    image_context: torch.Tensor | None = None   # ComfyUI's clip_fea [rows, T, width]
    concat: torch.Tensor | None = None          # ComfyUI's c_concat [rows, extra, ...] (model space): attached to the
    #                                             latent's channels by velocity (a MODEL call hands x with it attached)
    denoise_mask: torch.Tensor | None = None    # ComfyUI's denoise_mask [rows, C, ...] (1: denoise), for the family's
    #                                             process_timestep
    extras: dict | None = None                  # the family's own per-call tensors (Family.extras), [rows, ...]
    held: dict | None = None                    # what the family derived once from the held conditioning
    #                                             (Family.hold), [rows, ...]; None: nothing held (its forward computes)

    def rows(self, items: slice) -> "Prepared":
        """The conditioning of batch rows `items` (each row has its own)."""
        def take(t):
            return None if t is None else t[items]
        return Prepared(self.cond[items], take(self.pooled), self.guidance[items],
                        tuple(r[items] for r in self.references), self.reference_method, take(self.image_context),
                        take(self.concat), take(self.denoise_mask),
                        None if self.extras is None else {k: take(v) for k, v in self.extras.items()},
                        None if self.held is None else {k: take(v) for k, v in self.held.items()})


def rows(t: torch.Tensor, batch: int, items: slice, name: str = "conditioning") -> torch.Tensor:
    """Rows `items` of a tensor that holds one row for the whole batch or one per item."""
    if t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])[items]
    if t.shape[0] == batch:
        return t[items]
    raise ValueError(f"{name} batch {t.shape[0]} does not match the latent batch {batch}: give {name} a batch of "
                     f"{'1' if batch == 1 else f'1 or {batch}'}")


class FlowModel:
    def __init__(self, loaded: LoadedTransformer):
        self.loaded = loaded
        self.model = loaded.model
        self.family = families.get(loaded.info.family)
        self.dtype = loaded.dtype
        self.device = next(p for p in self.model.parameters() if not p.is_meta).device  # a stage holds part
        # ComfyUI's model timestep per sigma under the family's own model sampling (the only scale the engine's loop
        # runs: a sampling node of another scale is refused, GenerateRequest._check_model_sampling)
        self.timesteps_per_sigma = self.family.sampling(loaded.info.variant).timesteps_per_sigma
        # reference tokens at the end of the current forward's image tokens: the parallel token hooks read it
        self.reference_tokens = 0

    def prepare(self, sides: list[Conditioning], batch: int, items: slice = slice(None),
                denoise_mask: torch.Tensor | None = None) -> Prepared:
        """The sides' conditioning for latent items `items` of a batch of `batch`, stacked side after side.
        denoise_mask: the sampler's noise mask [batch, C, ...] (ComfyUI's denoise_mask), None without one."""
        cond = torch.cat([pad_text(rows(s.cond, batch, items), self.family.pad_text_to)
                          for s in sides]).to(self.device, self.dtype)
        pooled = None
        if sides[0].pooled is not None:
            pooled = torch.cat([rows(s.pooled, batch, items, "pooled") for s in sides]).to(self.device, self.dtype)
        per_side = len(range(batch)[items])
        guidance = torch.tensor([3.5 if s.guidance is None else float(s.guidance) for s in sides],
                                dtype=torch.float32, device=self.device).repeat_interleave(per_side)
        if len({s.forward_shape[1:] for s in sides}) > 1:
            raise ValueError("sides with different reference latents, image context or extra inputs cannot share one "
                             "forward: run one per side")
        # as ComfyUI's extra_conds: each reference to model space in its own dtype, then to the compute dtype
        fmt = self.loaded.info.latent
        references = tuple(
            torch.cat([rows(frame(fmt.process_in(s.references[i])), batch, items, "reference latent") for s in sides])
            .to(self.device, self.dtype)
            for i in range(len(sides[0].references)))
        method = sides[0].reference_method or (self.family.reference_methods or ("",))[0]
        image = None
        if sides[0].image_context is not None:
            image = torch.cat([rows(s.image_context, batch, items, "clip_vision_output") for s in sides]) \
                .to(self.device, self.dtype)
        whole = None if denoise_mask is None else denoise_mask.to(self.device)
        mask = None if whole is None else rows(whole, batch, items, "noise mask")
        concat = None
        if self.family.concat_cond is not None and self.family.concat_channels(self.loaded.info.config):
            parts = [self.family.concat_cond(self, s, whole) for s in sides]
            if any(p is None for p in parts) and any(p is not None for p in parts):
                raise ValueError("one side has an image (concat_latent_image or concat_mask) and the other none: give "
                                 "both sides the image-to-video node's conditioning")
            if parts[0] is not None:   # None: the family's forward attaches ComfyUI's c_concat without an image
                concat = torch.cat([rows(p, batch, items, "concat_latent_image")
                                    for p in parts]).to(self.device, self.dtype)
        extras = None
        if sides[0].extras:
            if any(set(s.extras or {}) != set(sides[0].extras) for s in sides):   # forward_shape keeps them apart
                raise ValueError("sides with different extra inputs (byT5 rows, pose inputs) cannot share one forward: "
                                 "run one per side")
            host = set(self.family.host_extras)   # read on the host: kept there (no wait on the device to read them)
            extras = {k: torch.cat([rows(s.extras[k], batch, items, k) for s in sides])
                      .to(*(() if k in host else (self.device, self.dtype))) for k in sides[0].extras}
        return Prepared(cond, pooled, guidance, references, method, image_context=image, concat=concat,
                        denoise_mask=None if mask is None else mask.repeat(len(sides), *([1] * (mask.ndim - 1))),
                        extras=extras)

    @torch.no_grad()
    def velocity(self, x_model: torch.Tensor, sigma: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        """v for latents x_model [n, C, h, w] or video latents [n, C, F, h, w] (model space; one frame unless the
        family takes frames) at `sigma`, float32, shaped like x_model: ComfyUI's _apply_model. The model timestep is
        sigma x the model sampling's multiplier, processed under a noise mask as the family's ComfyUI model does; the
        conditioning's c_concat joins the latent's channels."""
        sigma32 = sigma.detach().to(torch.float32).reshape(-1).expand(x_model.shape[0]).to(self.device)
        timestep = sigma32 * self.timesteps_per_sigma
        if prepared.denoise_mask is not None and self.family.process_timestep is not None:
            timestep = self.family.process_timestep(self.loaded.info.config, timestep, prepared.denoise_mask)
        if prepared.concat is not None:
            x_model = torch.cat([x_model.to(self.device, self.dtype), prepared.concat], dim=1)
        return self.output(x_model, timestep, prepared)

    @torch.no_grad()
    def output(self, x_model: torch.Tensor, timestep: torch.Tensor, prepared: Prepared,
               dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The model's output (for a flow model its velocity) at ComfyUI's model timestep: what ComfyUI's diffusion
        model returns for (x_model, timestep), in `dtype` (None: as the model gives it, which float32 takes exactly),
        shaped like x_model but for the channels (the model's output channels: a c_concat attached to x_model is input
        only). timestep: one float32 value per item ([n]), or per item and latent frame ([n, F]) where the family's
        ComfyUI model makes one (process_timestep)."""
        n = x_model.shape[0]
        timestep32 = timestep.detach().to(torch.float32)
        timestep32 = (timestep32.expand(n, -1) if timestep32.ndim == 2 else timestep32.reshape(-1).expand(n))
        x = (x_model if self.family.frames else frame(x_model)).to(self.device, self.dtype)
        if FORWARD_STUB:   # benchmarks of what surrounds the model: its output's shape and dtype, no arithmetic
            v = torch.zeros((x.shape[0], self.loaded.info.latent.channels) + tuple(x.shape[2:]), dtype=self.dtype,
                            device=self.device)
        else:
            with gathered(self.model):   # weights divided among ranks: the root's whole for the forward (sharded.py)
                v = self.family.forward(self, x, timestep32.to(self.device), prepared)
        v = v if dtype is None else v.to(dtype)
        return v.unsqueeze(2) if x_model.ndim == 5 and not self.family.frames else v


def frame(x: torch.Tensor) -> torch.Tensor:
    """A one-frame video latent [n, C, 1, h, w] as the image latent [n, C, h, w] a family's forward takes (an image
    latent as it is). Video formats (ComfyUI's Wan21, Qwen-Image's) hold a still image as one frame."""
    if x.ndim == 5:
        if x.shape[2] != 1:
            raise ValueError(f"latent of shape {list(x.shape)} has {x.shape[2]} frames: give one (a still image)")
        return x[:, :, 0]
    return x
