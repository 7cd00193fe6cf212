"""A generate request (one KSampler run), validated before any rank starts, and its translation to an engine
job. The CLI and the ComfyUI nodes both build one of these."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, asdict

import torch

from .models.load import COMPUTE_DTYPES, inspect_model
from .plan import ParallelPlan, validate_plan



@dataclass
class GenerateRequest:
    model: str
    cond: torch.Tensor                    # [B|1, N, 4096]
    pooled: torch.Tensor                  # [B|1, 768 (FLUX) | 2048 (SD3)]
    latent_raw: torch.Tensor              # [B, 16, H/8, W/8], raw VAE space (zeros for an empty latent)
    seed: int = 0
    steps: int = 20
    cfg: float = 1.0
    sampler: str = "euler"
    scheduler: str = "simple"
    denoise: float = 1.0
    neg_cond: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None
    guidance: float = 3.5                 # FLUX only (FluxGuidance)
    dtype: str = "fp32"
    fp8_weights: bool = False             # store Linear weights as float8_e4m3fn (ComfyUI's fp8 weight dtype)
    batch_index: list[int] | None = None
    plan: ParallelPlan = field(default_factory=ParallelPlan)
    loras: list = field(default_factory=list)   # [(path, strength)], applied in order
    family: str = field(default="", init=False)

    def validate(self) -> None:
        """Every check that needs no rank: raises ValueError naming the input, the value and what works."""
        from .sampling.samplers import SAMPLERS
        from .sampling.schedules import SCHEDULERS

        info = inspect_model(self.model)  # CheckpointError (a ValueError) for a bad file
        self.family = info.family
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r} is not supported: use one of {list(SAMPLERS)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is not supported: use one of {list(SCHEDULERS)}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} is invalid: use an integer >= 1")
        if not 0 < self.denoise <= 1:
            raise ValueError(f"denoise={self.denoise} is invalid: use a value in (0, 1]")
        if not self.cfg > 0:
            raise ValueError(f"cfg={self.cfg} is invalid: use a value > 0 (1.0 for FLUX.1-dev/schnell)")
        lat = self.latent_raw
        if lat.ndim != 4 or lat.shape[1] != 16 or not lat.is_floating_point():
            raise ValueError(f"latent of shape {list(lat.shape)} ({lat.dtype}) is invalid: {info.family} takes "
                             f"[batch, 16, height/8, width/8] floats (EmptySD3LatentImage)")
        if lat.shape[2] % 2 or lat.shape[3] % 2:
            raise ValueError(f"latent {lat.shape[3] * 8}x{lat.shape[2] * 8} px is invalid: {info.family} needs width "
                             f"and height that are multiples of 16 px")
        batch = lat.shape[0]
        self._check_side("cond", self.cond, self.pooled, info, batch)
        needs_negative = self.cfg != 1.0
        if needs_negative:
            if self.neg_cond is None or self.neg_pooled is None:
                raise ValueError(f"cfg={self.cfg} needs a negative conditioning (neg_cond and neg_pooled); give one "
                                 f"or use cfg 1.0")
            self._check_side("neg_cond", self.neg_cond, self.neg_pooled, info, batch)
        if self.batch_index is not None and len(self.batch_index) != batch:
            raise ValueError(f"batch_index has {len(self.batch_index)} entries for a batch of {batch}")
        if self.loras:
            self._check_loras(info)
        patch = info.config["patch_size"] if info.family == "sd3" else 2
        validate_plan(self.plan, self.plan.world_size, heads=info.heads,
                      image_tokens=(lat.shape[2] // patch) * (lat.shape[3] // patch), batch=batch,
                      negative_pass=needs_negative, sampler=self.sampler, layers=info.layers)

    def _check_loras(self, info) -> None:
        from .models.load import build_empty
        from .models.lora import check_lora

        if self.model.startswith("synthetic:"):
            raise ValueError(f"LoRAs need a model file; {self.model} has random weights")
        keys = set(build_empty(info).state_dict())
        for entry in self.loras:
            path, strength = entry
            if not os.path.isfile(path):
                raise ValueError(f"LoRA file {path!r} does not exist")
            if not isinstance(strength, (int, float)):
                raise ValueError(f"LoRA strength {strength!r} for {path} is not a number")
            check_lora(path, info, keys)

    @staticmethod
    def _check_side(name, cond, pooled, info, batch) -> None:
        context = info.config["joint_attention_dim"]
        pooled_dim = info.config["pooled_projection_dim"]
        if cond.ndim != 3 or cond.shape[2] != context:
            raise ValueError(f"{name} of shape {list(cond.shape)} is invalid: {info.variant} takes "
                             f"[batch, tokens, {context}]")
        if pooled.ndim != 2 or pooled.shape[1] != pooled_dim:
            raise ValueError(f"{name.replace('cond', 'pooled')} of shape {list(pooled.shape)} is invalid: "
                             f"{info.variant} takes [batch, {pooled_dim}]")
        for t, what in ((cond, name), (pooled, name.replace("cond", "pooled"))):
            if t.shape[0] not in (1, batch):
                raise ValueError(f"{what} has batch {t.shape[0]} but the latent has {batch}: give 1 or {batch}")

    def to_job(self) -> tuple[dict, dict[str, torch.Tensor]]:
        spec = {k: v for k, v in asdict(self).items()
                if k not in ("cond", "pooled", "latent_raw", "neg_cond", "neg_pooled", "plan")}
        spec["plan"] = self.plan.as_dict()
        spec["loras"] = [[os.path.abspath(p), float(s)] for p, s in self.loras]
        spec["model"] = self.model if self.model.startswith("synthetic:") else os.path.abspath(self.model)
        inputs = {"cond": self.cond, "pooled": self.pooled, "latent_raw": self.latent_raw}
        if self.cfg != 1.0:
            inputs.update(neg_cond=self.neg_cond, neg_pooled=self.neg_pooled)
        return spec, inputs


def model_key(path: str, dtype: str, fp8_weights: bool = False) -> tuple:
    """What identifies loaded weights: a changed file (mtime, size) is loaded again."""
    if path.startswith("synthetic:"):
        return (path, dtype, fp8_weights)
    st = os.stat(path)
    return (os.path.abspath(path), dtype, fp8_weights, st.st_mtime_ns, st.st_size)
