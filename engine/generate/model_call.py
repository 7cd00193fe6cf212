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

import math
import time

import torch

from .. import syncs
from ..errors import EngineError, PlanError
from ..models.flow import Prepared, frame
from ..models.load import COMPUTE_DTYPES, inspect_model
from ..models.lora import HeldPatches, WeightPatches
from ..models.sharded import gathered
from ..models.speed import attention_kernels
from .request import GenerateRequest
from .run import _finish, _parallel_model, job_ends

# ComfyUI diffusion-model keyword inputs the engine's families take, and what they become: context -> the text
# tokens, y -> the pooled vector, guidance -> the embedded guidance scale, clip_fea -> the image tokens of the
# cross-attention (Wan's CLIP-vision features), ref_latents -> reference latents in model space (ComfyUI's extra_conds
# ran process_in), ref_latents_method -> how they are placed. Input channels ComfyUI concatenates (c_concat) arrive
# attached to x, and a per-frame timestep ([N, frames]) as the model timestep itself.
TENSORS = ("context", "y", "guidance", "clip_fea")
LISTS = ("ref_latents",)
STRINGS = ("ref_latents_method",)
FLOAT32 = ("guidance",)   # crosses and is held in float32 (the families embed it so); the rest in the compute dtype
CONCAT = "concat"   # held name of the input channels ComfyUI attaches to the latent (c_concat)
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
        held[slot] = t.detach().to("cpu").contiguous()
        if held[slot].data_ptr() == t.data_ptr():   # the caller's own tensor: a copy, which the caller cannot change
            held[slot] = held[slot].clone()
        return slot, held[slot]


class ModelSession:
    """Client side of a model job: `with ModelSession(engine, request, patches) as s: out = s.call(x, t, cond)`, or
    several model calls in one round trip: `outs = s.call_group([(x, t, cond), ...])` (a step's positive and negative
    passes, which CFG parallel then runs side by side, each at its own text length).

    request: validated (its plan resolved). patches: the MODEL's weight patches (WeightPatches) or None.

    What crosses per call is what the ranks compute in: the input and the conditioning in the request's compute dtype
    (the ranks cast them to it first, so the result is the same to the bit), the timestep and guidance in float32, and
    the output back in the dtype the model gives it (float32 here). Input channels ComfyUI attaches to the latent
    (c_concat: Wan's image channels and mask), constant for a clip, are held on the ranks like the conditioning."""

    def __init__(self, engine, request: GenerateRequest, patches: WeightPatches | None = None, *, deadlines=None):
        check_per_call(request)
        self.request = request
        self._dtype = COMPUTE_DTYPES[request.dtype]
        info = inspect_model(request.model)
        self._channels = info.latent.channels
        # a family whose LATENT packs several streams (audio + video) takes the packed [N, 1, values] tensor as it is,
        # with the streams' shapes and its own per-call tensors (float64) among the conditioning
        self._packed = info.spec.packed_streams
        self._extras = info.spec.extras
        spec, inputs = request.to_job(stand_ins=True)   # the ranks read the shapes: stand-ins cross as shapes
        self._patches = patches or WeightPatches.none()
        self._held_patches = HeldPatches.on_client(engine)
        patch_spec, patch_inputs = self._patches.to_job(self._held_patches)
        self._session = engine.session("model", {"request": spec, "patches": patch_spec}, {**inputs, **patch_inputs},
                                       deadlines=deadlines)
        self._held = HeldConditioning()
        self.calls = 0         # model calls answered (a group of calls counts each)
        self.sent_bytes = 0    # what crossed to the ranks, and back, in the calls (the session's job excluded)
        self.received_bytes = 0
        self.trip_bytes: list[tuple[int, int]] = []   # (sent, received) of each round trip

    def __enter__(self) -> "ModelSession":
        self._session.__enter__()   # the job reached the ranks: they keep its patches
        if self._held_patches is not None:
            self._held_patches.sent(self._patches)
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    @property
    def result(self):
        return self._session.result

    @property
    def call_s(self) -> list[float]:
        """Each round trip's time as the caller saw it (bridge and model)."""
        return self._session.call_s

    @property
    def model_s(self) -> list[float]:
        """Each round trip's model time, as rank 0 measured it: from the inputs on its device to the outputs written
        back (the rest of call_s is the bridge's)."""
        return [a.get("model_s", 0.0) for a in self._session.answers]

    def call(self, x: torch.Tensor, timestep: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """The diffusion model's output (float32, shaped like x, on x's device) for input x [N, C, ...] (model space,
        any concatenated channels attached), timestep [N] (float32, as ComfyUI's model passes it) and `conditioning`:
        {"context": [N, L, D], "y": [N, P], "guidance": [N], "ref_latents": [[N, C, h, w], ...],
        "ref_latents_method": str, "clip_fea": [N, T, D]} (absent or None: not given)."""
        return self.call_group([(x, timestep, conditioning)])[0]

    def call_group(self, calls: list[tuple], should_cancel=None) -> list[torch.Tensor]:
        """Several model calls (x, timestep, conditioning), as `call` takes each, in one round trip: their outputs in
        order. The ranks run them as the plan splits them (CFG parallel: one call on each CFG group). should_cancel:
        see Session.call."""
        tensors, parts = {}, []
        for i, (x, timestep, conditioning) in enumerate(calls):
            part_tensors, part = self._part(x, timestep, conditioning)
            tensors.update({f"{i}.{k}" if "@" not in k else k: v for k, v in part_tensors.items()})
            parts.append(part)
        sent = sum(t.numel() * t.element_size() for t in tensors.values())
        self.sent_bytes += sent
        # the answer: each call's output (at most float32) in rank 0's one answer segment
        answer = sum((x.numel() if self._packed else x.shape[0] * self._channels * math.prod(x.shape[2:])) * 4
                     for x, _, _ in calls)
        try:
            out = self._session.call(tensors, output_bytes=answer, should_cancel=should_cancel, parts=parts)
        except EngineError as e:
            if not e.oom:
                raise
            raise EngineError(f"{e}; {self.request.memory_advice(self._session.engine.world, e.memory)}",
                              rank=e.rank, phase=e.phase, oom=True, memory=e.memory) from e
        self.calls += len(calls)
        received = sum(t.numel() * t.element_size() for t in out.values())
        self.received_bytes += received
        self.trip_bytes.append((sent, received))
        return [out[f"{i}.out"].to(x.device, torch.float32) for i, (x, _, _) in enumerate(calls)]

    def _part(self, x: torch.Tensor, timestep, conditioning: dict) -> tuple[dict, dict]:
        n = x.shape[0]
        timestep = torch.as_tensor(timestep, dtype=torch.float32).detach().cpu()
        if timestep.numel() == 1:
            timestep = timestep.reshape(1).expand(n)
        if timestep.ndim not in (1, 2) or timestep.shape[0] != n or not torch.isfinite(timestep).all():
            raise ValueError(f"timestep of shape {list(timestep.shape)} is invalid for {n} rows: give one finite value "
                             f"per row, or per row and frame")
        unknown = set(conditioning) - set(TENSORS + LISTS + STRINGS + self._extras)
        if unknown:
            raise ValueError(f"the model call carries {sorted(unknown)}, which the engine does not take")
        x = x.detach().to("cpu")
        values = dict(conditioning)
        if not self._packed and x.shape[1] > self._channels:   # c_concat attached by ComfyUI's model: the clip's image channels and mask
            values[CONCAT] = x[:, self._channels:]
            x = x[:, :self._channels]
        tensors = {"x": x.to(self._dtype).contiguous(), "timestep": timestep.contiguous()}
        held, meta = {}, {}
        for name, value in values.items():
            if value is None:
                continue
            if name in STRINGS:
                meta[name] = str(value)
                continue
            items = {name: value} if name not in LISTS else {f"{name}.{i}": t for i, t in enumerate(value)}
            for key, t in items.items():
                if not isinstance(t, torch.Tensor) or t.shape[0] != n:
                    shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{key} of shape {shape} does not have the call's {n} rows")
                # a family's own tensors cross in float64: ComfyUI's model reads them as Python floats
                dtype = torch.float64 if name in self._extras else torch.float32 if name in FLOAT32 else self._dtype
                slot, new = self._held.place(key, t.detach().to("cpu", dtype))
                held[key] = slot
                if new is not None:
                    tensors[f"{key}@{slot}"] = new
        return tensors, {"held": held, **meta}


class CallClock:
    """A call's model time on a rank, without waiting for the device: on CUDA two events around the call's work, read
    once its output has been downloaded (which waited for them); on the CPU the work is done when the call returns."""

    def __init__(self, device: torch.device):
        self.started = time.perf_counter()
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._done = None

    def computed(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._done = time.perf_counter()

    def model_s(self) -> float:
        """Seconds of the call's work (after its output reached the host)."""
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return (self._done or time.perf_counter()) - self.started


def _prepared(flow, conditioning: dict[str, torch.Tensor], meta: dict, held: dict | None = None) -> Prepared:
    """The Prepared of one call from the tensors ComfyUI's model passed (already on the device, in their dtypes) and
    what the family derived from them when they were first held (Family.hold)."""
    n = conditioning["context"].shape[0]
    guidance = conditioning.get("guidance")
    refs = sorted((k for k in conditioning if k.startswith("ref_latents.")), key=lambda k: int(k.split(".")[1]))
    method = meta.get("ref_latents_method") or (flow.family.reference_methods or ("",))[0]
    if refs and method not in flow.family.reference_methods:
        raise ValueError(f"reference latents method {method!r} is not one this model places references by: use one of "
                         f"{list(flow.family.reference_methods)}")
    extras = {k: conditioning[k] for k in flow.family.extras if k in conditioning}
    return Prepared(conditioning["context"], conditioning.get("y"),
                    guidance if guidance is not None else torch.full((n,), 3.5, device=flow.device),
                    tuple(frame(conditioning[k]) for k in refs), method, image_context=conditioning.get("clip_fea"),
                    extras=extras or None, held=held or None)


def run_model(ctx, request: GenerateRequest, patches: WeightPatches) -> dict[str, torch.Tensor] | None:
    """Rank side: load the model under the plan with the MODEL's patches, then answer calls until the client ends
    the session. Each call holds one or more model calls ("parts"), run as the plan splits them; rank 0 answers
    with their outputs in the model's own dtype."""
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
    derived: dict[str, dict] = {}        # "<name>@<slot>" -> what the family derived from it (Family.hold)
    calls, compute_s, holds = 0, 0.0, 0
    # a test instrument around the calls (a call is its step); a no-op unless the rank's environment arms it
    with attention_kernels(request.attention, ctx.device), syncs.loop(ctx.info, ctx.device), job_ends(flow.model):
        syncs.start()
        # each call's tensors arrive on the device in one copy (the upload), its output leaves in one (the download)
        # the family's values read on the host (Family.host_extras) stay in host memory: reading them waits for nothing
        host = set(flow.family.host_extras)
        for call, meta, tensors in ctx.calls(device=ctx.device, host=lambda key: key.split("@")[0] in host):
            t0 = time.perf_counter()
            clock = CallClock(ctx.device)
            new = []
            for key, t in tensors.items():
                if "@" in key:   # a copy: the call's buffer is not kept alive by what the session holds
                    name = key.split("@")[0]
                    held[key] = t.to(torch.float64 if name in flow.family.extras else
                                     torch.float32 if name in FLOAT32 else flow.dtype, copy=True)
                    derived.pop(key, None)
                    new.append(key)
            with gathered(flow.model):   # the root's weights once for the call (call_parts nests in it)
                if flow.family.hold is not None:   # every rank, for the same new tensors, in the call's order
                    for key in new:
                        out = flow.family.hold(flow, key.split("@")[0], held[key])
                        if out:
                            derived[key], holds = out, holds + 1
                parts = []
                for i, part in enumerate(meta["parts"]):
                    keys = [f"{name}@{slot}" for name, slot in part["held"].items()]
                    conditioning = {key.split("@")[0]: held[key] for key in keys}
                    x = tensors[f"{i}.x"]
                    concat = conditioning.pop(CONCAT, None)
                    if concat is not None:
                        x = torch.cat([x.to(flow.dtype), concat], dim=1)
                    from_held = {k: v for key in keys for k, v in derived.get(key, {}).items()}
                    parts.append((x, tensors[f"{i}.timestep"], _prepared(flow, conditioning, part, from_held)))
                outs = parallel.call_parts(parts)
            clock.computed()
            calls += 1
            ctx.answer(call, {f"{i}.out": out for i, out in enumerate(outs)} if ctx.rank == 0 else None, clock=clock)
            compute_s += time.perf_counter() - t0
            syncs.step(calls)
    # held: the conditioning tensors the family derived from (LTX-2.3: each context through its text connectors)
    ctx.info["model_calls"] = {"calls": calls, "compute_s": compute_s, "held": holds}
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
