"""A guide job: the engine as a model that another sampler drives one evaluation at a time (ComfyUI's own samplers,
through the xDiT Guider node). The conditioning crosses once, when the session opens; each call sends only the
latent and sigma and returns one velocity per side asked for. The plan applies to every call as to the engine's
own loop (CFG parallel still splits the two passes, sequence parallel the tokens, data parallel the batch).

A guide job's request is a GenerateRequest whose sampling fields (seed, steps, sampler, scheduler, denoise) the ranks
do not use: the driving sampler owns them. `latent_raw` gives the latent's shape for the plan's checks.
"""
from __future__ import annotations

import time

import torch

from .. import wording
from ..errors import PlanError
from ..models.speed import attention_kernels
from .request import GenerateRequest
from .run import _finish, _parallel_model, _sides

SIDES = ("pos", "neg")


def check_guide(request: GenerateRequest) -> None:
    """What the engine's own loop runs but a driven model cannot: PipeFusion pipelines the steps of the engine's
    sampler, and the step cache counts the engine's steps."""
    if request.plan.pipefusion > 1:
        raise PlanError(f"{wording.say('plan subject', plan=wording.plan(request.plan))} uses pipefusion, which "
                        f"pipelines the engine's own sampler loop: with a guider (ComfyUI's sampler) use ulysses, ring, "
                        f"cfg or dp, or use xDiT Sampler")
    if request.cache_threshold:
        raise PlanError("the step cache counts the engine's own steps: set cache_threshold 0 with a guider, "
                        "or use xDiT Sampler")


class GuideSession:
    """Client side of a guide job: `with GuideSession(engine, request) as g: v = g.velocity(x_model, sigma, sides)`.

    request: validated (its plan resolved). When it has a negative, the negative travels even at cfg 1 (ComfyUI's
    CFG++ samplers ask for it there). deadlines: the job's (None: the engine's own)."""

    def __init__(self, engine, request: GenerateRequest, *, deadlines=None):
        check_guide(request)
        self.request = request
        spec, inputs = request.to_job()
        for name in ("neg_cond", "neg_pooled"):
            if getattr(request, name) is not None:
                inputs[name] = getattr(request, name)
        self._session = engine.session("guide", spec, inputs, deadlines=deadlines)
        self.calls = 0

    def __enter__(self) -> "GuideSession":
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    @property
    def result(self):
        """The job's result once the session ended: its per-rank reports (timings, bytes, memory)."""
        return self._session.result

    @property
    def call_s(self) -> list[float]:
        return self._session.call_s

    def velocity(self, x_model: torch.Tensor, sigma: torch.Tensor | float,
                 sides: tuple[str, ...] = ("pos",)) -> tuple[torch.Tensor, ...]:
        """v (float32, shaped like x_model, on x_model's device) for each of `sides` ("pos", "neg") at `sigma` (a
        number, or a tensor of equal values: one per batch item, as k-diffusion samplers pass it)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32).detach().reshape(-1).cpu()
        if sigma.numel() == 0 or not torch.isfinite(sigma).all() or not bool((sigma == sigma[0]).all()):
            raise ValueError(f"sigma {sigma.tolist()} is invalid: give one finite value for the whole batch")
        if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
            raise ValueError(f"sides {sides!r} is invalid: ask for 'pos', 'neg' or both, once each")
        if "neg" in sides and self.request.neg_cond is None:
            raise ValueError("the sampler asked for the negative pass but the guider has no negative conditioning")
        expected = tuple(self.request.latent_raw.shape)
        if tuple(x_model.shape) != expected:
            raise ValueError(f"latent of shape {list(x_model.shape)} is invalid for this session: it was opened for "
                             f"{list(expected)}")
        out = self._session.call({"x": x_model.detach().to("cpu", torch.float32).contiguous(), "sigma": sigma[:1]},
                                 sides=list(sides))
        self.calls += 1
        return tuple(out[f"v_{s}"].to(x_model.device) for s in sides)

    def predict(self, x_model: torch.Tensor, sigma: torch.Tensor, which: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """The engine's Predict (sampling/ksampler.py) through the session: lets the engine's own samplers drive it."""
        return self.velocity(x_model, sigma, which)


def run_guide(ctx, request: GenerateRequest) -> dict[str, torch.Tensor] | None:
    """Rank side: load the model under the plan, then answer calls until the client ends the session."""
    check_guide(request)
    mesh = ctx.mesh(request.plan)
    if not mesh.active:   # the plan runs on fewer ranks: this one only takes part in the calls' broadcast
        for _ in ctx.calls():
            pass
        return None
    ctx.reset_peak_memory()
    parallel = _parallel_model(ctx, request, mesh)
    positive, negative = _sides(request)
    predict = parallel.predictor(positive, negative)
    calls, compute_s = 0, 0.0
    with attention_kernels(request.attention, ctx.device):
        for call, meta, tensors in ctx.calls():
            t0 = time.perf_counter()
            which = tuple(meta["sides"])
            sigma = tensors["sigma"].reshape(()).to(ctx.device)
            velocities = predict(tensors["x"].to(ctx.device), sigma, which)
            compute_s += time.perf_counter() - t0
            calls += 1
            ctx.answer(call, {f"v_{w}": v.cpu() for w, v in zip(which, velocities)} if ctx.rank == 0 else None)
    ctx.info["guide"] = {"calls": calls, "compute_s": compute_s}
    _finish(ctx, request, mesh, parallel.flow.loaded.info, torch.empty(0))
    ctx.info["bytes_sent_per_step"] = {k: v / max(calls, 1) for k, v in mesh.stats.sent.items()}  # per call here
    return None

