"""The link between the xDiT Engine's MODEL and the engine: one engine session per sampling run, the run's model calls
(a step's passes gathered by ComfyUI's CALC_COND_BATCH wrapper) answered by the ranks, and the request a session is
planned by. Nothing here imports ComfyUI: its objects come in as arguments."""
from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, replace

import torch

from ..engine.families import FAMILIES
from ..engine.families.base import PACKED_SHAPE
from ..engine.errors import SESSION_IDLE, EngineError, JobCancelled
from ..engine.generate.request import GenerateRequest
from ..engine.models.load import inspect_model
from ..engine.models.lora import WeightPatches
from ..engine.parallel.plan import AUTO, FASTEST, TWO_EXPERTS
from .model import ModelPatchError, check_chain, check_transformer_options, weight_patches


CONDITIONING_KWARGS = ("y", "guidance", "ref_latents", "ref_latents_method", "clip_fea")
# a packed audio-video model's per-call tensors (model.py EngineTransformer builds them from ComfyUI's own inputs)
PACKED_KWARGS = tuple(sorted({name for family in FAMILIES for name in family.extras}))
APPLIED_KWARGS = ("denoise_mask",)   # used by ComfyUI's model before the call (WAN22's per-frame timestep), not in it
CALC_COND_BATCH = "calc_cond_batch"   # comfy.patcher_extension.WrappersMP.CALC_COND_BATCH (0.3.64 and 0.33)


@dataclass
class ModelCall:
    """One call of ComfyUI's model on its diffusion model: the input (model space, c_concat attached), the model
    timestep, the conditioning tensors, and which passes its row chunks are (transformer_options' cond_or_uncond:
    0 the positive, 1 the negative)."""
    x: torch.Tensor
    timestep: torch.Tensor
    conditioning: dict
    cond_or_uncond: list


class EngineLink:
    """Between a MODEL's diffusion model and the engine. The first diffusion-model call of a sampling run opens a
    model session (its plan chosen for that call's shapes, the sampling MODEL's LoRA patches sent along); ComfyUI's
    cleanup after the run (`on_cleanup`) closes it and records the job for the Info node.

    A step's passes reach the ranks as one request (`calc_cond_batch`, ComfyUI's CALC_COND_BATCH wrapper on the
    MODEL): ComfyUI's own calc_cond_batch runs twice, first with the diffusion model only noting each call it is asked
    for (its answer a stand-in of zeros, discarded with what ComfyUI made of it), then, once the ranks have answered
    every noted call together, again with each call answered from those outputs. So CFG parallel runs a positive and
    a negative on its two CFG groups whether or not ComfyUI batched them into one call (it does so only when their
    text lengths concatenate and its memory estimate fits), each at its own length, and everything else
    calc_cond_batch does (areas, masks, strengths, timestep ranges, its batching and accumulation, wrappers around the
    model call) stays ComfyUI's own.

    settings: the xDiT Engine's (core.EngineSettings); registry: core's EngineRegistry; request_for(settings, calls,
    view) -> a validated GenerateRequest for the run's first ModelCalls, planned on the machine's view
    (core.model_request); before_job(request): makes
    room on ComfyUI's GPU (or keeps its models where the job fits beside them); should_cancel(), on_cancelled(): ComfyUI's interrupt flag and its exception (nodes.py)."""

    def __init__(self, settings, registry, request_for, before_job=None, route: str = "", out_channels: int = 0,
                 should_cancel=None, on_cancelled=None):
        self.settings, self.registry, self.request_for, self.before_job = settings, registry, request_for, before_job
        self.should_cancel = should_cancel   # ComfyUI's interrupt flag, polled while a call waits
        self.on_cancelled = on_cancelled     # raises ComfyUI's own interrupt exception after a cancelled call
        self.route = route or "ComfyUI's sampler on the engine's MODEL, one request per step's model calls"
        self.out_channels = out_channels   # the diffusion model's output channels (the latent's)
        self.owner: weakref.ref | None = None   # the ComfyUI model holding the EngineTransformer
        self.base_patcher: weakref.ref | None = None
        self.session = None
        self._opened = 0.0
        self._noting: list[ModelCall] | None = None      # calc_cond_batch's first run: the calls asked for
        self._answers: list[tuple[ModelCall, torch.Tensor]] | None = None   # its second: the ranks' outputs

    # what ComfyUI calls ----------------------------------------------------------------------------------------------
    def call(self, x, timestep, context, control, transformer_options: dict, kwargs: dict) -> torch.Tensor:
        if control is not None:
            raise ModelPatchError("the conditioning carries a ControlNet (ControlNetApply nodes), which the xDiT "
                                  "engine does not run; remove it from the graph")
        check_transformer_options(transformer_options)
        conditioning = {"context": context}
        for name, value in kwargs.items():
            if value is None:
                continue
            if name in APPLIED_KWARGS:
                continue
            if name == "attention_mask":
                if torch.is_tensor(value) and bool((value != 0).all()):
                    continue   # a mask that masks nothing
                raise ModelPatchError("the conditioning carries a text attention mask that masks tokens, which the "
                                      "xDiT engine does not apply; encode one prompt per conditioning")
            if name in PACKED_KWARGS and isinstance(value, (int, float)) and not isinstance(value, bool):
                # a family's constant (ComfyUI's CONDConstant, e.g. Wan-Animate 2's strengths): one value a row
                value = torch.full((x.shape[0],), float(value), dtype=torch.float64)
            if name not in CONDITIONING_KWARGS + PACKED_KWARGS:
                raise ModelPatchError(f"the MODEL is called with {name!r} (from a node that adds conditioning the "
                                      f"xDiT engine does not take: e.g. an inpainting, control or regional node); "
                                      f"remove that node")
            conditioning[name] = value
        call = ModelCall(x, timestep, conditioning, list(transformer_options.get("cond_or_uncond") or [0]))
        if self._noting is not None:
            self._noting.append(call)
            return x.new_zeros((x.shape[0], self.out_channels or x.shape[1]) + tuple(x.shape[2:]))
        if self._answers is not None:
            answer = self._answer(call)
            if answer is not None:
                return answer
        return self.run([call])[0]

    def calc_cond_batch(self, executor, model, conds, x_in, timestep, model_options):
        """ComfyUI's CALC_COND_BATCH wrapper: a step's model calls (positive and negative, any area entries) in one
        request to the ranks; see the class."""
        entries = sum(len(c) for c in conds if c is not None)
        if entries < 2 or self._noting is not None or self._answers is not None:
            return executor(model, conds, x_in, timestep, model_options)
        self._noting = noted = []
        try:
            executor(model, conds, x_in, timestep, model_options)
        finally:
            self._noting = None
        self._answers = list(zip(noted, self.run(noted))) if noted else []
        try:
            return executor(model, conds, x_in, timestep, model_options)
        finally:
            self._answers = None

    def _answer(self, call: ModelCall) -> torch.Tensor | None:
        """The ranks' output for a call noted in calc_cond_batch's first run (the same input, timestep and passes);
        None for one it did not ask for then (its memory estimate batched differently), which runs on its own."""
        for i, (noted, out) in enumerate(self._answers):
            if noted.cond_or_uncond == call.cond_or_uncond and noted.x.shape == call.x.shape \
                    and torch.equal(torch.as_tensor(noted.timestep), torch.as_tensor(call.timestep)) \
                    and torch.equal(noted.x, call.x):
                del self._answers[i]
                return out
        return None

    def run(self, calls: list[ModelCall]) -> list[torch.Tensor]:
        """The diffusion model's outputs for these calls, in one round trip to the ranks (the run's session opened by
        the first). ComfyUI's interrupt (should_cancel) is honoured while a call waits, a long first call's model load
        included; a session the ranks ended on their own (no call within their collective timeout) is opened again."""
        for attempt in range(2):
            try:
                if self.session is None:
                    self._open(calls)   # the engine's first start here measures it: cancellable too
                return self.session.call_group([(c.x, c.timestep, c.conditioning) for c in calls],
                                               should_cancel=self.should_cancel)
            except JobCancelled:
                self.close(failed=True)
                if self.on_cancelled is not None:
                    self.on_cancelled()   # ComfyUI's own interrupt exception, its flag cleared
                raise
            except EngineError as e:
                self.close(failed=True)
                if attempt or SESSION_IDLE not in str(e):
                    raise
            except BaseException:
                self.close(failed=True)
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def on_cleanup(self, patcher=None) -> None:
        """ComfyUI's cleanup after a sampling run (CallbacksMP.ON_CLEANUP): the run's session ends."""
        self.close()

    # the session -------------------------------------------------------------------------------------------------------
    def _patcher(self):
        owner = self.owner() if self.owner is not None else None
        current = getattr(owner, "current_patcher", None)
        return current if current is not None else (self.base_patcher() if self.base_patcher else None)

    def _open(self, calls: list[ModelCall]) -> None:
        from ..engine.generate.model_call import ModelSession   # the rank-side stack loads only when a job runs

        patcher = self._patcher()
        patches = WeightPatches.none()
        if patcher is not None:
            check_chain(patcher)
            patches = weight_patches(patcher)
        machine = self.registry.machine(self.settings)
        view = machine.view()   # what was measured on this machine, read once for the session
        request = self.request_for(self.settings, calls, view)
        if self.before_job is not None:
            self.before_job(request)
        record = self.registry.get(self.settings)   # closes a session an earlier run left open
        fresh = machine.ensure(record.engine, request, view, should_cancel=self.should_cancel)
        if fresh is not None:   # the engine's first start here measured more: planned again
            view = fresh
            request = self.request_for(self.settings, calls, view)
        session = ModelSession(record.engine, request, patches, deadlines=self.settings.deadlines)
        session.__enter__()
        self.session, self._opened, self._request, self._record = session, time.perf_counter(), request, record
        self._machine, self._view = machine, view
        record.open_session = self

    def close(self, failed: bool = False) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        record = self._record
        if getattr(record, "open_session", None) is self:
            record.open_session = None
        if failed:
            session.__exit__(RuntimeError, RuntimeError("model call failed"), None)
        else:
            session.__exit__(None, None, None)
        result = session.result
        ranks = result.ranks if result is not None else []
        trips = len(session.call_s)
        record.last_route = self.route
        record.last_plan = self._request.plan.describe()
        record.last_plan_reason = self._request.choice.reason if self._request.choice else ""
        wall = time.perf_counter() - self._opened
        model_s = session.model_s
        record.last_timings = {"model_calls": session.calls, "round_trips": trips, "wall_s": wall,
                               "per_trip_s": (sum(session.call_s) / trips) if trips else 0.0,
                               "model_per_trip_s": (sum(model_s) / trips) if trips else 0.0}
        if not failed and trips >= 2:   # a round trip is a step's model calls: auto weighs the model's time next time
            self._machine.record_step(self._request, statistics.median(model_s[1:]), self._view)
        record.last_cache, record.last_stages = {}, []
        record.last_bytes = ranks[0].get("bytes_sent_per_step", {}) if ranks else {}
        record.last_memory = [r.get("memory", {}) for r in ranks]
        record.last_lora = ranks[0].get("lora_layers_touched") if ranks else None
        note_residency(record, self._request, ranks)


def note_residency(record, request: GenerateRequest, ranks: list[dict]) -> None:
    """What the Info node shows of where the ranks keep their models after a job (and what moved, and why)."""
    first = ranks[0] if ranks else {}
    record.last_residency = list(first.get("residency") or []) + [
        {"moved": line} for line in first.get("residency_moves") or []]
    work_experts = request.experts or (2 if inspect_model(request.model).variant in TWO_EXPERTS else 1)
    record.last_placement = request.expert_placement if work_experts > 1 else ""


def model_request(settings, calls: list[ModelCall], *, latent_channels: int, hardware,
                  job_request) -> GenerateRequest:
    """The request a model session is planned and checked by, from the first model calls of a sampling run (a step's,
    when calc_cond_batch gathered them): a call's rows are len(cond_or_uncond) chunks of the latent batch, each the
    positive (0) or the negative (1). The negative pass is there when some call carries a negative chunk beside a
    positive one (in the same call when ComfyUI batched them, or in another). `job_request` is core.job_request;
    `hardware` the engine's."""
    def chunk(call: ModelCall, label: int) -> tuple[slice, int] | None:
        labels = call.cond_or_uncond or [0]
        if label not in labels:
            return None
        n = call.x.shape[0]
        b = n // len(labels) if n % len(labels) == 0 else n
        i = labels.index(label)
        return slice(i * b, (i + 1) * b), b

    def side(call: ModelCall, rows: slice):
        conditioning = call.conditioning
        extras = {"pooled_output": conditioning["y"][rows] if conditioning.get("y") is not None else None}
        if conditioning.get("guidance") is not None:
            extras["guidance"] = float(conditioning["guidance"][rows.start])
        if conditioning.get("ref_latents"):
            extras["reference_latents"] = [r[rows] for r in conditioning["ref_latents"]]
            if conditioning.get("ref_latents_method"):
                extras["reference_latents_method"] = conditioning["ref_latents_method"]
        return [[conditioning["context"][rows], extras]]

    positive = next(((c, found) for c in calls if (found := chunk(c, 0))), None)
    negative = next(((c, found) for c in calls if (found := chunk(c, 1))), None) if positive else None
    if positive is None:   # only another label: its first chunk stands for the pass
        n = calls[0].x.shape[0]
        labels = calls[0].cond_or_uncond or [0]
        b = n // len(labels) if n % len(labels) == 0 else n
        positive = (calls[0], (slice(0, b), b))
    (pos_call, (pos_rows, b)) = positive
    plan = settings.requested_plan()
    if plan == FASTEST:   # PipeFusion runs only inside the engine's own loop
        plan = AUTO
    x = pos_call.x
    shape = pos_call.conditioning.get(PACKED_SHAPE)   # packed streams: the video stream is the latent planned for
    grid = tuple(int(v) for v in shape[0, 1:4].tolist()) if shape is not None else tuple(x.shape[2:])
    latent = torch.zeros(()).expand(b, latent_channels, *grid)
    negative_pass = negative is not None
    request = job_request(replace(settings, plan="auto") if plan == AUTO else settings, side(pos_call, pos_rows),
                          side(negative[0], negative[1][0]) if negative_pass else None, latent,
                          cfg=2.0 if negative_pass else 1.0)
    if x.shape[1] > latent_channels:
        # image-to-video: ComfyUI attached the image's channels to x already and passes its CLIP features per call;
        # the request (whose image fields only the engine's own loop reads) gets stand-ins of their shapes
        def clip_of(call, rows):
            clip = call.conditioning.get("clip_fea")
            return None if clip is None else clip[rows]
        image = torch.zeros(()).expand(b, latent_channels, *x.shape[2:])
        stand_ins = {"concat_latent_image": image, "clip_vision_output": clip_of(pos_call, pos_rows)}
        if negative_pass:
            stand_ins.update(neg_concat_latent_image=image,
                             neg_clip_vision_output=clip_of(negative[0], negative[1][0]))
        request = replace(request, **stand_ins)
    return request.validate(len(settings.gpus), hardware)
