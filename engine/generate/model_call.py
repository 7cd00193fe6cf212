"""A model job: the engine as ComfyUI's diffusion model. ComfyUI's sampler and its model's own code (model sampling,
the conditioning's preparation, CFG and what patches it) run in ComfyUI's process; each call hands the ranks exactly
what ComfyUI's model hands its diffusion model (the input in model space with any concatenated channels, the model
timestep, the conditioning tensors) and returns the diffusion model's output. The plan applies to every call: sequence
parallel splits the tokens, CFG and data parallel split the call's rows (ComfyUI batches the positive and negative
passes into one call when their shapes agree).

The conditioning a sampler passes is the same call after call (the same prompt every step): each tensor crosses once
and the ranks hold it for the session (`HeldConditioning`); a call names what it reuses.

A model job's request is a GenerateRequest whose sampling fields the ranks do not use; its tensors give the shapes the
plan was checked against. A MODEL's LoRA patches (ComfyUI's LoRA loaders) travel with the session (WeightPatches).
"""
from __future__ import annotations

import time

import torch

from .. import syncs
from ..errors import PlanError
from ..models.flow import Prepared, frame
from ..models.lora import WeightPatches
from ..models.speed import attention_kernels
from .request import GenerateRequest
from .run import _finish, _parallel_model

# ComfyUI diffusion-model keyword inputs the engine's families take, and what they become: context -> the text
# tokens, y -> the pooled vector, guidance -> the embedded guidance scale, clip_fea -> the image tokens of the
# cross-attention (Wan's CLIP-vision features), ref_latents -> reference latents in model space (ComfyUI's extra_conds
# ran process_in), ref_latents_method -> how they are placed. Input channels ComfyUI concatenates (c_concat) arrive
# attached to x, and a per-frame timestep ([N, frames]) as the model timestep itself.
TENSORS = ("context", "y", "guidance", "clip_fea")
LISTS = ("ref_latents",)
STRINGS = ("ref_latents_method",)
SLOTS = 4   # conditioning tensors the ranks hold per name (a positive and a negative, each alone or batched)


def check_per_call(request: GenerateRequest) -> None:
    """What the engine's own loop runs but a model driven one call at a time cannot: PipeFusion pipelines the steps of
    the engine's sampler, and the step cache counts the engine's steps."""
    if request.plan.pipefusion > 1:
        raise PlanError(f"plan {request.plan.describe()} uses pipefusion, which pipelines the engine's own sampler "
                        f"loop: with ComfyUI's sampler on the engine use ulysses, ring, cfg or dp, or use xDiT Sampler")
    if request.cache_threshold:
        raise PlanError("the step cache counts the engine's own steps: set cache_threshold 0 with ComfyUI's sampler "
                        "on the engine, or use xDiT Sampler")


class HeldConditioning:
    """The client's record of the conditioning the ranks hold in this session: per name a few tensors (copies), so a
    tensor equal to one sent before crosses no more; the ranks keep the same slots (`RankHeld`)."""

    def __init__(self, slots: int = SLOTS):
        self.slots = slots
        self._held: dict[str, list[torch.Tensor | None]] = {}
        self._next: dict[str, int] = {}

    def place(self, name: str, t: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(slot, tensor to send or None when the ranks hold an equal one in that slot)."""
        held = self._held.setdefault(name, [None] * self.slots)
        for slot, h in enumerate(held):
            if h is not None and h.shape == t.shape and h.dtype == t.dtype and torch.equal(h, t):
                return slot, None
        slot = self._next.get(name, 0)
        self._next[name] = (slot + 1) % self.slots
        held[slot] = t.detach().to("cpu", copy=True)
        return slot, held[slot]


class ModelSession:
    """Client side of a model job: `with ModelSession(engine, request, patches) as s: out = s.call(x, t, cond)`.

    request: validated (its plan resolved). patches: the MODEL's weight patches (WeightPatches) or None."""

    def __init__(self, engine, request: GenerateRequest, patches: WeightPatches | None = None, *, deadlines=None):
        check_per_call(request)
        self.request = request
        spec, inputs = request.to_job()
        patch_spec, patch_inputs = (patches or WeightPatches.none()).to_job()
        self._session = engine.session("model", {"request": spec, "patches": patch_spec}, {**inputs, **patch_inputs},
                                       deadlines=deadlines)
        self._held = HeldConditioning()
        self.calls = 0
        self.sent_bytes = 0

    def __enter__(self) -> "ModelSession":
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    @property
    def result(self):
        return self._session.result

    @property
    def call_s(self) -> list[float]:
        return self._session.call_s

    def call(self, x: torch.Tensor, timestep: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """The diffusion model's output (float32, shaped like x, on x's device) for input x [N, C, ...] (model space,
        any concatenated channels attached), timestep [N] (float32, as ComfyUI's model passes it) and `conditioning`:
        {"context": [N, L, D], "y": [N, P], "guidance": [N], "ref_latents": [[N, C, h, w], ...],
        "ref_latents_method": str} (absent or None: not given)."""
        n = x.shape[0]
        timestep = torch.as_tensor(timestep, dtype=torch.float32).detach().cpu()
        if timestep.numel() == 1:
            timestep = timestep.reshape(1).expand(n)
        if timestep.ndim not in (1, 2) or timestep.shape[0] != n or not torch.isfinite(timestep).all():
            raise ValueError(f"timestep of shape {list(timestep.shape)} is invalid for {n} rows: give one finite value "
                             f"per row, or per row and frame")
        unknown = set(conditioning) - set(TENSORS + LISTS + STRINGS)
        if unknown:
            raise ValueError(f"the model call carries {sorted(unknown)}, which the engine does not take")
        tensors = {"x": x.detach().to("cpu", torch.float32).contiguous(), "timestep": timestep.contiguous()}
        held, meta = {}, {}
        for name, value in conditioning.items():
            if value is None:
                continue
            if name in STRINGS:
                meta[name] = str(value)
                continue
            parts = {name: value} if name in TENSORS else {f"{name}.{i}": t for i, t in enumerate(value)}
            for key, t in parts.items():
                if not isinstance(t, torch.Tensor) or t.shape[0] != n:
                    shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{key} of shape {shape} does not have the call's {n} rows")
                slot, new = self._held.place(key, t.detach().to(torch.float32))
                held[key] = slot
                if new is not None:
                    tensors[f"{key}@{slot}"] = new
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        out = self._session.call(tensors, held=held, **meta)
        self.calls += 1
        return out["out"].to(x.device)


def _prepared(flow, conditioning: dict[str, torch.Tensor], meta: dict) -> Prepared:
    """The Prepared of one call from the tensors ComfyUI's model passed (already on the device, in their dtypes)."""
    n = conditioning["context"].shape[0]
    guidance = conditioning.get("guidance")
    refs = sorted((k for k in conditioning if k.startswith("ref_latents.")), key=lambda k: int(k.split(".")[1]))
    method = meta.get("ref_latents_method") or (flow.family.reference_methods or ("",))[0]
    if refs and method not in flow.family.reference_methods:
        raise ValueError(f"reference latents method {method!r} is not one this model places references by: use one of "
                         f"{list(flow.family.reference_methods)}")
    return Prepared(conditioning["context"], conditioning.get("y"),
                    guidance if guidance is not None else torch.full((n,), 3.5, device=flow.device),
                    tuple(frame(conditioning[k]) for k in refs), method, image_context=conditioning.get("clip_fea"))


def run_model(ctx, request: GenerateRequest, patches: WeightPatches) -> dict[str, torch.Tensor] | None:
    """Rank side: load the model under the plan with the MODEL's patches, then answer calls until the client ends
    the session."""
    check_per_call(request)
    mesh = ctx.mesh(request.plan)
    if not mesh.active:   # the plan runs on fewer ranks: this one only follows the session
        for _ in ctx.calls(read=False):
            pass
        return None
    ctx.reset_peak_memory()
    parallel = _parallel_model(ctx, request, mesh, weight_patches=patches)
    flow = parallel.flow
    held: dict[str, torch.Tensor] = {}   # "<name>@<slot>" -> on the device, in the dtype the model takes
    calls, compute_s = 0, 0.0
    # a test instrument around the calls (a call is its step); a no-op unless the rank's environment arms it
    with attention_kernels(request.attention, ctx.device), syncs.loop(ctx.info, ctx.device):
        syncs.start()
        # each call's tensors arrive on the device in one copy (the upload), its output leaves in one (the download)
        for call, meta, tensors in ctx.calls(device=ctx.device):
            t0 = time.perf_counter()
            for key, t in tensors.items():
                if "@" in key:   # a copy: the call's buffer is not kept alive by what the session holds
                    held[key] = t.to(torch.float32 if key.startswith("guidance") else flow.dtype, copy=True)
            conditioning = {name: held[f"{name}@{slot}"] for name, slot in meta["held"].items()}
            out = parallel.call(tensors["x"], tensors["timestep"], _prepared(flow, conditioning, meta))
            compute_s += time.perf_counter() - t0
            calls += 1
            ctx.answer(call, {"out": out} if ctx.rank == 0 else None)
            syncs.step(calls)
    ctx.info["model_calls"] = {"calls": calls, "compute_s": compute_s}
    _finish(ctx, request, mesh, flow.loaded.info, torch.empty(0))
    ctx.info["bytes_sent_per_step"] = {k: v / max(calls, 1) for k, v in mesh.stats.sent.items()}  # per call here
    return None


def request_conditioning(request: GenerateRequest, sides: tuple[str, ...], rows: int) -> dict:
    """What ComfyUI's model would hand its diffusion model for a request's conditioning (`sides` "pos"/"neg" stacked,
    `rows` latent rows each): for benchmarks and checks that drive a model session without ComfyUI."""
    def side(name):
        cond = request.cond if name == "pos" else request.neg_cond
        pooled = request.pooled if name == "pos" else request.neg_pooled
        return (cond.expand(rows, *cond.shape[1:]) if cond.shape[0] == 1 else cond,
                None if pooled is None else pooled.expand(rows, *pooled.shape[1:]) if pooled.shape[0] == 1 else pooled)
    parts = [side(s) for s in sides]
    out = {"context": torch.cat([c for c, _ in parts]), "guidance": torch.full((rows * len(sides),), request.guidance)}
    if parts[0][1] is not None:
        out["y"] = torch.cat([p for _, p in parts])
    return out


def session_predictor(session: ModelSession, request: GenerateRequest, timesteps_per_sigma: float):
    """A Predict (sampling/ksampler.py) over a model session, the passes asked for batched into one call as ComfyUI
    batches them: lets the engine's own samplers drive the per-call route, e.g. to time it against the engine's loop."""
    def predict(x_model: torch.Tensor, sigma: torch.Tensor, which: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        rows = x_model.shape[0]
        t = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1)[:1] * timesteps_per_sigma
        out = session.call(torch.cat([x_model] * len(which)), t.expand(rows * len(which)),
                           request_conditioning(request, which, rows))
        return tuple(out.chunk(len(which)))
    return predict
