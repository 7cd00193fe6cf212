"""Seeded noise drawn exactly as ComfyUI draws it: the initial latent noise and the per-step noise of stochastic samplers."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torchsde

from .. import syncs

# (sigma, sigma_next) -> unit-variance noise shaped like the sampler's x, for the step sigma -> sigma_next.
NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cpu_generator(seed: int) -> torch.Generator:
    # A private CPU generator seeded with s draws what torch.manual_seed(s) would, without touching global state.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def prepare_noise(latent: torch.Tensor, seed: int, batch_index: list[int] | None = None) -> torch.Tensor:
    """ComfyUI's initial noise for `latent`: always drawn on the CPU in the latent's dtype, so it is device-independent.

    With batch_index, item j gets the noise a single-item draw number batch_index[j] would get from one stream:
    draws 0..max(batch_index) are made in order, one item each, and the unused ones are discarded.
    """
    generator = _cpu_generator(seed)
    if batch_index is None:
        return torch.randn(latent.shape, dtype=latent.dtype, layout=latent.layout, generator=generator, device="cpu")
    if len(batch_index) == 0 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in batch_index):
        raise ValueError(f"batch_index={batch_index!r} must be a non-empty list of non-negative ints, one per latent item")
    item_shape = (1, *latent.shape[1:])
    wanted = set(batch_index)
    drawn: dict[int, torch.Tensor] = {}
    for draw in range(max(batch_index) + 1):
        item = torch.randn(item_shape, dtype=latent.dtype, layout=latent.layout, generator=generator, device="cpu")
        if draw in wanted:
            drawn[draw] = item
    return torch.cat([drawn[i] for i in batch_index], dim=0)


def _per_step(draw: NoiseSampler) -> NoiseSampler:
    """The same noise for a step however often it is asked for (PipeFusion's patches each take their region of the
    whole latent's noise from one draw), keyed by the step's sigmas in host memory."""
    last: dict = {}

    def once(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        key = (float(sigma), float(sigma_next))
        if key not in last:
            last.clear()
            last[key] = draw(sigma, sigma_next)
        return last[key]

    return once


def gaussian_noise_sampler(x: torch.Tensor, seed: int) -> NoiseSampler:
    """ComfyUI's default_noise_sampler: one generator on x's device, a fresh N(0, 1) tensor like x per step.

    ComfyUI seeds it with seed + 1 on the CPU (so step noise is not a copy of the initial noise, which was drawn
    from `seed` on the CPU too) and with seed itself on an accelerator. sigma, sigma_next: in host memory.
    """
    generator = torch.Generator(device=x.device)
    generator.manual_seed(seed + 1 if x.device.type == "cpu" else seed)

    def draw(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape, dtype=x.dtype, layout=x.layout, device=x.device, generator=generator)

    return _per_step(draw)


def _ordered(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    return (a, b, 1) if a < b else (b, a, -1)


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device` that the host does not wait for: through pinned memory (a copy from pageable
    memory makes the host wait for the device's queue). The pinned buffer comes from torch's caching host allocator,
    which reuses it only once the copy that reads it is done."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return syncs.in_pinned_memory(t).to(device, non_blocking=True)


def brownian_noise_sampler(x: torch.Tensor, sigma_min: torch.Tensor, sigma_max: torch.Tensor, seed: int,
                           ahead: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> NoiseSampler:
    """ComfyUI's BrownianTreeNoiseSampler with a single seed and cpu=True (what dpmpp_2m_sde builds).

    One torchsde Brownian tree over [sigma_min, sigma_max] lives on the CPU in x's dtype, so the noise does not depend
    on the device; a step's noise is the tree's increment over [sigma_next, sigma] scaled to unit variance.

    ahead: the (sigma, sigma_next) pairs, in host memory, the sampler will ask for, in order. The schedule is known
    before the loop, so each draw prepares the next pair's noise at once: the tree's increment on the CPU, sent to
    the device through pinned memory without waiting, so it has arrived long before its step uses it.
    """
    t_lo, t_hi, tree_sign = _ordered(torch.as_tensor(sigma_min), torch.as_tensor(sigma_max))
    w0 = torch.zeros(x.shape, dtype=x.dtype)   # on the CPU, made there (a copy of a device tensor would wait for it)
    tree = torchsde.BrownianTree(t_lo.detach().cpu(), w0, t_hi.detach().cpu(), entropy=seed)
    keys = [(float(a), float(b)) for a, b in ahead]
    following = dict(zip(keys, list(ahead)[1:]))
    staged: dict = {}   # (sigma, sigma_next) -> its noise, on its way to the device

    def increment(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        sigma, sigma_next = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
        lo, hi, sign = _ordered(sigma, sigma_next)
        step = tree(lo.detach().cpu().float(), hi.detach().cpu().float()).to(dtype=lo.dtype)
        return step * (tree_sign * sign) / (sigma_next - sigma).abs().sqrt()

    def draw(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        """sigma, sigma_next: in host memory (the samplers keep a copy), so no draw waits for the device."""
        key = (float(sigma), float(sigma_next))
        noise = staged.pop(key, None)
        if noise is None:   # the first step's (or one not foreseen): sent now, still without waiting
            noise = to_device_async(increment(sigma, sigma_next), x.device)
        nxt = following.get(key)
        if nxt is not None:
            staged[(float(nxt[0]), float(nxt[1]))] = to_device_async(increment(*nxt), x.device)
        return noise

    return _per_step(draw)
