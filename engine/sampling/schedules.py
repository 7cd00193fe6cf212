"""Sigma schedules for flow models, equal to what ComfyUI 0.3.64's KSampler hands its sampler.

Everything is computed in float32 with ComfyUI's operation order: its schedules are float32, and most schedulers
pick entries of the float32 sigma table or re-evaluate sigma() at the table's float32 ends.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

SCHEDULERS: tuple[str, ...] = (
    "simple", "normal", "sgm_uniform", "beta", "karras", "exponential", "ddim_uniform", "linear_quadratic", "kl_optimal",
)

# A table end below this counts as zero: ComfyUI then schedules one more point instead of appending a 0.
_ZERO_SIGMA_TOLERANCE = 1e-5
# KSampler treats any denoise above this as a full schedule.
_FULL_DENOISE_ABOVE = 0.9999


SAMPLING_NODES = {   # ComfyUI's sampling nodes: (kind, multiplier); each takes a shift
    "aura_flow": ("discrete_flow", 1.0),    # ModelSamplingAuraFlow (Qwen-Image's templates: 3.1, edit 3.0)
    "sd3": ("discrete_flow", 1000.0),       # ModelSamplingSD3
    "flux": ("flux", 1.0),                  # ModelSamplingFlux (its shift: what that node computes from the size)
}


class FlowSampling:
    """ComfyUI's model sampling of a flow model: the sigma table and sigma<->timestep, of one of its two kinds.

    "flux" mirrors ModelSamplingFlux: 10000 table entries and timestep == sigma, with sigma(t) applying the exponential
    shift mu=shift (FLUX.1-dev, and Qwen-Image without a sampling patch). "discrete_flow" mirrors
    ModelSamplingDiscreteFlow: 1000 entries, timestep = sigma * multiplier and the SNR shift (SD3/SD3.5: shift 3,
    multiplier 1000; FLUX.1-schnell: shift 1, multiplier 1; ModelSamplingAuraFlow: multiplier 1). timestep() only
    rescales and does not undo the shift, so sigma(timestep(s)) != s; that is ComfyUI's behaviour too, and its
    normal/sgm_uniform schedules depend on it (they shift the table's ends a second time).
    """

    KINDS = ("flux", "discrete_flow")

    def __init__(self, kind: str, shift: float, multiplier: float = 1000.0) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"model sampling kind={kind!r} is not supported; use one of {', '.join(self.KINDS)}")
        for name, value in (("shift", shift), ("multiplier", multiplier)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} is not supported; use a finite number > 0 (shift: 1.15 is "
                                 f"FLUX.1-dev's default, 3.0 SD3's; multiplier: 1000 for SD3, 1 for AuraFlow-style)")
        self.kind = kind
        self.shift = float(shift)
        self.multiplier = float(multiplier)
        table_size = 10_000 if kind == "flux" else 1_000
        self.timesteps_per_sigma = 1.0 if kind == "flux" else self.multiplier
        # Table entry k (1-based) sits at t = k / table_size; scaling to timesteps and back is kept (not simplified)
        # because ComfyUI does it in float32 and the round trip is not always exact.
        grid_t = torch.arange(1, table_size + 1) / table_size
        self.sigmas: torch.Tensor = self.sigma(grid_t * self.timesteps_per_sigma)

    @classmethod
    def flux(cls, shift: float = 1.15) -> FlowSampling:
        return cls("flux", shift)

    @classmethod
    def discrete_flow(cls, shift: float, multiplier: float = 1000.0) -> FlowSampling:
        return cls("discrete_flow", shift, multiplier)

    @classmethod
    def sd3(cls, shift: float = 3.0) -> FlowSampling:
        return cls("discrete_flow", shift, 1000.0)

    @classmethod
    def node(cls, method: str, shift: float) -> FlowSampling:
        """What ComfyUI's sampling node `method` (SAMPLING_NODES) sets at `shift`; ValueError naming a bad input."""
        if method not in SAMPLING_NODES:
            raise ValueError(f"sampling method {method!r} is invalid: use one of {', '.join(SAMPLING_NODES)}")
        kind, multiplier = SAMPLING_NODES[method]
        return cls(kind, shift, multiplier)

    @classmethod
    def from_dict(cls, spec: dict) -> FlowSampling:
        """From as_dict()'s {"kind", "shift", "multiplier"}; ValueError naming what is wrong."""
        if not isinstance(spec, dict) or set(spec) - {"kind", "shift", "multiplier"} or "kind" not in spec \
                or "shift" not in spec:
            raise ValueError(f"model sampling {spec!r} is invalid: give {{'kind': 'flux' | 'discrete_flow', "
                             f"'shift': S, 'multiplier': M}}")
        return cls(spec["kind"], spec["shift"], spec.get("multiplier", 1000.0))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "shift": self.shift, "multiplier": self.multiplier}

    def __eq__(self, other) -> bool:
        return isinstance(other, FlowSampling) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def sigma(self, timestep: torch.Tensor | float) -> torch.Tensor:
        """Sigma (float32) at a model timestep: in [0, 1] for flux, [0, multiplier] for discrete_flow."""
        timestep = torch.as_tensor(timestep, dtype=torch.float32)
        if self.kind == "flux":
            growth = math.exp(self.shift)
            return growth / (growth + (1 / timestep - 1))
        t = timestep / self.timesteps_per_sigma
        if self.shift == 1.0:
            return t
        return self.shift * t / (1 + (self.shift - 1) * t)

    def timestep(self, sigma: torch.Tensor | float) -> torch.Tensor:
        """Model timestep (float32) for a sigma; no inverse shift, exactly as ComfyUI."""
        return torch.as_tensor(sigma, dtype=torch.float32) * self.timesteps_per_sigma

    def percent_to_sigma(self, percent: float) -> float:
        """ComfyUI's percent_to_sigma of this model sampling, in Python floats as there (the result is rounded to
        float32 only when a sampler stores it into its schedule)."""
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        t = 1.0 - percent
        if self.kind == "flux":
            growth = math.exp(self.shift)
            return growth / (growth + (1 / t - 1))
        return t if self.shift == 1.0 else self.shift * t / (1 + (self.shift - 1) * t)

    def describe(self) -> str:
        """e.g. "ModelSamplingFlux shift 1.15" or "ModelSamplingDiscreteFlow shift 3.0, multiplier 1000"."""
        if self.kind == "flux":
            return f"ModelSamplingFlux shift {self.shift:g}"
        return f"ModelSamplingDiscreteFlow shift {self.shift:g}, multiplier {self.multiplier:g}"

    def __repr__(self) -> str:
        return f"FlowSampling({self.kind!r}, shift={self.shift}, multiplier={self.multiplier})"


def _with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _simple(sampling: FlowSampling, steps: int) -> torch.Tensor:
    table = sampling.sigmas
    stride = len(table) / steps  # fractional on purpose: indices are truncated per step
    picked = [len(table) - 1 - int(i * stride) for i in range(steps)]
    return _with_zero(table[picked])


def _normal(sampling: FlowSampling, steps: int, sgm: bool = False) -> torch.Tensor:
    first_timestep = float(sampling.timestep(sampling.sigma_max))
    last_timestep = float(sampling.timestep(sampling.sigma_min))
    if sgm:
        timesteps = torch.linspace(first_timestep, last_timestep, steps + 1)[:-1]
        return _with_zero(sampling.sigma(timesteps))
    if abs(float(sampling.sigma(last_timestep))) <= _ZERO_SIGMA_TOLERANCE:
        return sampling.sigma(torch.linspace(first_timestep, last_timestep, steps + 1))
    return _with_zero(sampling.sigma(torch.linspace(first_timestep, last_timestep, steps)))


def _beta(sampling: FlowSampling, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    import numpy as np
    from scipy.stats import beta as beta_distribution

    last_index = len(sampling.sigmas) - 1
    quantiles = 1 - np.linspace(0, 1, steps, endpoint=False)
    indices = np.rint(beta_distribution.ppf(quantiles, alpha, beta) * last_index)
    # Neighbouring steps that round to the same table entry collapse into one, so the schedule can be shorter.
    kept = [int(index) for n, index in enumerate(indices) if n == 0 or index != indices[n - 1]]
    return _with_zero(sampling.sigmas[kept])


def _ddim_uniform(sampling: FlowSampling, steps: int) -> torch.Tensor:
    table = sampling.sigmas
    ends_at_zero = abs(float(table[1])) <= _ZERO_SIGMA_TOLERANCE
    if ends_at_zero:
        steps += 1
    stride = max(len(table) // steps, 1)
    # Walks up from entry 1 with an integer stride, so it may yield more than `steps` sigmas (e.g. 28 -> 29).
    ascending = table[1::stride]
    descending = ascending.flip(0)
    return descending if ends_at_zero else _with_zero(descending)


def _linear_quadratic(sampling: FlowSampling, steps: int, threshold_noise: float = 0.025) -> torch.Tensor:
    # Mochi's schedule: noise level rises linearly to threshold_noise over the first half, then quadratically to 1.
    # Computed in float64 like ComfyUI's Python floats; only the result is float32.
    if steps == 1:
        noise_levels = [0.0, 1.0]
    else:
        linear_steps = steps // 2
        quadratic_steps = steps - linear_steps
        excess = linear_steps - threshold_noise * steps
        quadratic_coef = excess / (linear_steps * quadratic_steps ** 2)
        linear_coef = threshold_noise / linear_steps - 2 * excess / (quadratic_steps ** 2)
        offset = quadratic_coef * (linear_steps ** 2)
        noise_levels = (
            [i * threshold_noise / linear_steps for i in range(linear_steps)]
            + [quadratic_coef * (i ** 2) + linear_coef * i + offset for i in range(linear_steps, steps)]
            + [1.0]
        )
    sigmas_unit = torch.tensor([1.0 - level for level in noise_levels], dtype=torch.float32)
    return sigmas_unit * sampling.sigma_max


def _karras(sigma_min: float, sigma_max: float, steps: int, rho: float = 7.0) -> torch.Tensor:
    ramp = torch.linspace(0, 1, steps)
    min_root, max_root = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return _with_zero((max_root + ramp * (min_root - max_root)) ** rho)


def _exponential(sigma_min: float, sigma_max: float, steps: int) -> torch.Tensor:
    return _with_zero(torch.linspace(math.log(sigma_max), math.log(sigma_min), steps).exp())


def _kl_optimal(sigma_min: float, sigma_max: float, steps: int) -> torch.Tensor:
    # steps == 1 divides 0 by 0 and yields [nan, 0]; ComfyUI 0.3.64 does the same and the golden data records it.
    progress = torch.arange(steps, dtype=torch.float32) / (steps - 1)
    angles = progress * math.atan(sigma_min) + (1 - progress) * math.atan(sigma_max)
    return _with_zero(angles.tan())


def _from_range(schedule: Callable[[float, float, int], torch.Tensor]) -> Callable[[FlowSampling, int], torch.Tensor]:
    # k-diffusion style schedulers see only the table's ends, as Python floats.
    return lambda sampling, steps: schedule(float(sampling.sigma_min), float(sampling.sigma_max), steps)


_SCHEDULE_BUILDERS: Mapping[str, Callable[[FlowSampling, int], torch.Tensor]] = MappingProxyType({
    "simple": _simple,
    "normal": _normal,
    "sgm_uniform": lambda sampling, steps: _normal(sampling, steps, sgm=True),
    "beta": _beta,
    "karras": _from_range(_karras),
    "exponential": _from_range(_exponential),
    "ddim_uniform": _ddim_uniform,
    "linear_quadratic": _linear_quadratic,
    "kl_optimal": _from_range(_kl_optimal),
})


def compute_sigmas(sampling: FlowSampling, scheduler: str, steps: int, denoise: float = 1.0) -> torch.Tensor:
    """float32 1-D sigmas ending in 0, exactly what ComfyUI's KSampler passes to the sampler.

    Usually steps+1 long; beta may be shorter (merged steps) and ddim_uniform longer (integer stride), as in ComfyUI.
    denoise < 1 schedules int(steps / denoise) steps and keeps the last steps+1 sigmas; denoise <= 0 gives an empty
    schedule. Samplers ComfyUI runs with one extra step (dpm_2, uni_pc, ...) are not covered here.
    """
    if scheduler not in _SCHEDULE_BUILDERS:
        raise ValueError(f"scheduler={scheduler!r} is not supported; use one of {list(SCHEDULERS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not supported; use an integer >= 1")
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or not 0.0 <= denoise <= 1.0:
        raise ValueError(
            f"denoise={denoise!r} is outside [0, 1]; use a number in [0, 1] (1 = full schedule, 0 = nothing to do)"
        )
    build = _SCHEDULE_BUILDERS[scheduler]
    if denoise > _FULL_DENOISE_ABOVE:
        return build(sampling, steps)
    if denoise <= 0.0:
        return torch.zeros(0, dtype=torch.float32)
    return build(sampling, int(steps / denoise))[-(steps + 1):]
