"""What the nodes do, without ComfyUI: the engine settings a node's inputs make, a registry of running engines keyed
by settings, and the conversion of CONDITIONING / LATENT into engine jobs and back (the node specs are in specs.py).

nodes.py only turns the specs into ComfyUI V3 schemas and passes ComfyUI's progress bar and interrupt check in;
everything testable lives here and in specs.py.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace

from ..engine.generate.inputs import fix_empty_latent
from ..engine.generate.request import GenerateRequest, default_dtype
from ..engine.models.load import inspect_model
from ..engine.models.speed import CUDA_ONLY
from ..engine.runtime.machine import Machine
from ..engine.parallel.memory import memory_gib
from ..engine.parallel.plan import AUTO, EXPERT_PLACEMENTS, FASTEST, HOST, MAX_RANKS, GiB, ParallelPlan
from ..engine.runtime.client import Deadlines, Engine
from ..engine.sampling.ksampler import StepWindow
from ..engine.sampling.schedules import FlowSampling
from ..engine.wording import NODES, speaking
from .conditioning import (conditioning_file, conditioning_images, conditioning_references,  # noqa: F401
                           conditioning_tensors, job_request)
from .link import EngineLink, model_request, note_residency
from .specs import ATTENTION_KERNELS, PLANS, WEIGHT_DTYPES

# ---- engine settings and registry --------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    model_path: str
    gpus: tuple[int, ...]
    device: str = "cuda"              # "cuda" or "cpu" (ComfyUI started with --cpu, or no CUDA)
    family: str = "auto"
    weight_dtype: str = "default"
    plan: str = "auto"
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    dp: int = 1
    timeout_s: int = 3600
    loras: tuple[tuple[str, float], ...] = ()   # applied in order inside the ranks
    cache_threshold: float = 0.0      # step cache; 0 is off (per job: changing it keeps the ranks)
    compile: bool = False
    attention: str = "auto"
    pipefusion: int = 1
    patches: int = 0                  # 0: one per stage
    warmup_steps: int = 1
    sampling: tuple = ()              # xDiT Model Sampling: (kind, shift, multiplier); () the family's default
    cfg_norm: float = 0.0             # xDiT CFGNorm's strength; 0: none
    expert_placement: str = "auto"    # a two-expert clip: where the idle expert waits (auto, resident, host)
    shard: int = 1                    # explicit plan: the weights divided among groups of this many GPUs

    @speaking(NODES)
    def validate(self) -> None:
        """Checks that need no rank, with errors that name the input (shown as the node's error)."""
        if not self.gpus or len(set(self.gpus)) != len(self.gpus) or min(self.gpus) < 0:
            raise ValueError(f"gpus={','.join(map(str, self.gpus))!r} is invalid: list distinct GPU indices, e.g. 0,1")
        if len(self.gpus) > MAX_RANKS:
            raise ValueError(f"gpus lists {len(self.gpus)} GPUs: the engine runs 1 to {MAX_RANKS} ranks")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} is invalid: use one of {list(WEIGHT_DTYPES)}")
        info = inspect_model(self.model_path)
        if self.family != "auto" and self.family != info.family:
            raise ValueError(f"family={self.family!r} but {self.model_path} holds a {info.variant} ({info.family}) "
                             f"transformer: use auto or {info.family}")
        if self.plan not in PLANS:
            raise ValueError(f"plan={self.plan!r} is invalid: use auto or explicit")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r} is invalid: use one of {list(ATTENTION_KERNELS)}")
        if self.device != "cuda" and self.attention in CUDA_ONLY:
            raise ValueError(f"attention={self.attention!r} needs CUDA GPUs and ComfyUI runs on the CPU: use auto")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold={self.cache_threshold} is invalid: use 0 (off) to 1")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ValueError(f"expert_placement={self.expert_placement!r} is invalid: use one of "
                             f"{list(EXPERT_PLACEMENTS)}")
        if self.plan == "explicit":
            self.requested_plan().check_world(len(self.gpus))

    def requested_plan(self) -> ParallelPlan | str:
        """What the engine's plan resolution gets: "auto", or the explicit degrees."""
        if self.plan == "explicit":
            return ParallelPlan(dp=self.dp, cfg=2 if self.cfg_parallel else 1, ulysses=self.ulysses, ring=self.ring,
                                pipefusion=self.pipefusion, shard=self.shard)
        return FASTEST if self.plan == "fastest" else AUTO

    def with_sampling(self, method: str, shift: float) -> "EngineSettings":
        """These settings with a sampling node's model sampling (xDiT Model Sampling)."""
        chosen = FlowSampling.node(method, float(shift))   # ValueError naming a method or shift that cannot be
        return replace(self, sampling=(chosen.kind, chosen.shift, chosen.multiplier))

    def with_cfg_norm(self, strength: float) -> "EngineSettings":
        """These settings with ComfyUI's CFGNorm at `strength` (xDiT CFGNorm)."""
        return replace(self, cfg_norm=float(strength))

    @property
    def model_sampling(self) -> dict | None:
        """The request's model sampling: the sampling node's, else None (the family's default)."""
        return dict(zip(("kind", "shift", "multiplier"), self.sampling)) if self.sampling else None

    def with_lora(self, path: str, strength: float) -> "EngineSettings":
        """These settings with one more LoRA (a LoRA node returns a new engine value; upstream ones are unchanged)."""
        if strength == 0:
            return self
        return replace(self, loras=self.loras + ((path, float(strength)),))

    @property
    def ranks_key(self) -> tuple:
        """What the running ranks depend on; model, dtype and plan change per job without a restart."""
        return (self.device, self.gpus)

    @property
    def deadlines(self) -> Deadlines:
        """Each job's deadlines: timeout_s bounds its compute (per job, so a changed timeout_s keeps the ranks)."""
        return Deadlines(compute_s=float(self.timeout_s))

    @property
    def compute_dtype(self) -> str:
        if self.weight_dtype in ("bf16", "fp16"):
            return self.weight_dtype
        return default_dtype(self.device)


@dataclass
class EngineRecord:
    engine: Engine
    settings: EngineSettings
    last_plan: str = ""
    last_plan_reason: str = ""
    last_timings: dict = field(default_factory=dict)
    last_cache: dict = field(default_factory=dict)
    last_bytes: dict = field(default_factory=dict)
    last_stages: list = field(default_factory=list)   # PipeFusion: each rank's stage, blocks and weights held
    last_memory: list = field(default_factory=list)   # what each rank measured of itself
    last_route: str = ""                              # which route ran the last job (the Info node says)
    last_lora: int | None = None                      # layers the last job's LoRAs touched
    last_residency: list = field(default_factory=list)   # the models rank 0 keeps and where (device, host memory)
    last_placement: str = ""                          # a clip of several experts: where the plan keeps the idle one
    open_session: object = None                       # a model session of a sampling run still open (model.py)
    notes: list[str] = field(default_factory=list)

    def close_session(self) -> None:
        """End a model session an earlier sampling run left open (the engine serves one job at a time). What ended it
        meanwhile (the ranks' idle timeout) was that run's, not the next job's: it is not raised."""
        if self.open_session is not None:
            self.open_session.close(failed=True)
            self.open_session = None


class EngineRegistry:
    """The engines running in this process, one per (device, GPU list). The only process-wide state of the pack:
    an engine must outlive a prompt (that is the point), and ComfyUI runs prompts one at a time."""

    def __init__(self):
        self._records: dict[tuple, EngineRecord] = {}
        self._machines: dict[tuple, Machine] = {}
        self._lock = threading.Lock()
        # where this machine's measurements are stored (nodes.py: ComfyUI's user folder; None: the user's cache)
        self.machine_folder = lambda: None

    def machine(self, settings: EngineSettings) -> Machine:
        """The engine's devices on this machine and what was measured of them (engine/runtime/machine.py): one Machine
        per setup and store folder, kept (it reads its file again only when the file changed)."""
        folder = self.machine_folder()
        key = (settings.device, settings.gpus, folder)
        machine = self._machines.get(key)
        if machine is None:
            machine = self._machines[key] = Machine(settings.device, len(settings.gpus),
                                                    list(settings.gpus) if settings.device == "cuda" else None,
                                                    folder=folder)
        return machine

    def get(self, settings: EngineSettings) -> EngineRecord:
        with self._lock:
            record = self._records.get(settings.ranks_key)
            if record is None:
                engine = Engine(len(settings.gpus), device=settings.device,
                                gpus=list(settings.gpus) if settings.device == "cuda" else None,
                                deadlines=settings.deadlines)
                record = self._records[settings.ranks_key] = EngineRecord(engine, settings)
            record.close_session()
            record.settings = settings
            return record

    def running(self, settings: EngineSettings) -> EngineRecord | None:
        return self._records.get(settings.ranks_key)

    def unload(self, settings: EngineSettings | None = None) -> int:
        """Stop the engine for these settings (all engines when None); returns how many were stopped."""
        with self._lock:
            keys = [settings.ranks_key] if settings is not None else list(self._records)
            stopped = 0
            for key in keys:
                record = self._records.pop(key, None)
                if record is not None:
                    record.close_session()
                    record.engine.close()
                    stopped += 1
            return stopped


REGISTRY = EngineRegistry()
MODEL_KEY = "xdit_model"   # a LATENT's key: the variant of the model that sampled it


@speaking(NODES)   # the engine's errors name the nodes' inputs
def sample(settings: EngineSettings, positive, negative, latent: dict, *, seed: int, steps: int, cfg: float,
           sampler_name: str, scheduler: str, denoise: float, on_progress=None, should_cancel=None,
           before_job=None, registry: EngineRegistry = REGISTRY, weight_patches=None,
           window: StepWindow = StepWindow()) -> dict:
    """KSampler on the engine: returns the LATENT dict (other keys kept, as KSampler does). weight_patches: a MODEL
    chain's LoRA patches (models/lora.py WeightPatches), applied on the ranks with the engine's own LoRAs."""
    settings.validate()
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ValueError("latent_image is not a LATENT (a dict with 'samples'); connect EmptySD3LatentImage or "
                         "VAEEncode to it")
    info = inspect_model(settings.model_path)
    previous = latent.get(MODEL_KEY)
    if not window.add_noise and previous and previous != info.variant:
        raise ValueError(f"latent_image was sampled by a {previous} model and this one is {info.variant}: a second "
                         f"expert continues a clip only on the same model's other expert (the same family and size); "
                         f"give both samplers a file of the same model")
    samples = fix_empty_latent(info, latent["samples"], latent.get("downscale_ratio_spacial"))   # as KSampler does
    request = job_request(settings, positive, negative, samples, cfg=cfg, seed=seed, steps=steps,
                          sampler_name=sampler_name, scheduler=scheduler, denoise=denoise,
                          batch_index=latent.get("batch_index"), noise_mask=latent.get("noise_mask"), window=window,
                          clip_state=info.spec.clip_vision_state)
    machine = registry.machine(settings)
    view = machine.view()   # what was measured on this machine, read once for the job
    planned = request.validate(len(settings.gpus), view.hardware)  # every check that needs no rank, before any starts
    if before_job is not None:
        before_job(planned)
    record = registry.get(settings)
    fresh = machine.ensure(record.engine, planned, view)
    if fresh is not None:   # the engine's first start here (or a new model) measured more: planned again
        view = fresh
        planned = request.validate(len(settings.gpus), view.hardware)
    request, choice = planned, planned.choice
    t0 = time.perf_counter()
    result = request.submit(record.engine, on_progress=on_progress, should_cancel=should_cancel,
                            weight_patches=weight_patches, deadlines=settings.deadlines)
    record.last_route = "xDiT Sampler: the whole sampling loop on the ranks"
    record.last_lora = result.ranks[0].get("lora_layers_touched")
    record.last_plan = choice.plan.describe()
    record.last_plan_reason = choice.reason
    record.last_timings = dict(result.timings, wall_s=time.perf_counter() - t0)
    record.last_cache = result.ranks[0].get("step_cache") or {}
    record.last_bytes = result.ranks[0].get("bytes_sent_per_step", {})
    record.last_memory = [r.get("memory", {}) for r in result.ranks]
    record.last_stages = [dict(r["pipefusion"], rank=r["rank"]) for r in result.ranks if r.get("pipefusion")]
    note_residency(record, request, result.ranks)
    machine.record_job(request, result, view)   # the plan's measured step: auto weighs it next time
    out = dict(latent)
    out["samples"] = result.outputs["samples"]
    out[MODEL_KEY] = info.variant   # a second expert (xDiT Sampler (Advanced) without added noise) checks it
    return out


@speaking(NODES)
def check_per_call(settings: EngineSettings) -> None:
    """What only the engine's own loop runs, refused (naming the xDiT Engine's input) before ComfyUI's sampler drives
    the engine one model call at a time."""
    settings.validate()
    if settings.pipefusion > 1 or settings.cache_threshold:
        name = "pipefusion" if settings.pipefusion > 1 else "cache_threshold"
        raise ValueError(f"xDiT Engine: {name} runs only inside the xDiT Sampler's own loop, and this job runs "
                         f"ComfyUI's sampler on the engine one model call at a time; set {name} to "
                         f"{'1' if name == 'pipefusion' else '0'}, or use xDiT Sampler with a sampler and scheduler "
                         f"the engine has")


def model_link(settings: EngineSettings, *, before_job=None, should_cancel=None, on_cancelled=None,
               registry: EngineRegistry = REGISTRY) -> EngineLink:
    """The link of an xDiT Engine's MODEL to the engine (model.py): its sessions are planned and checked with the
    settings' plan on the engine's hardware; should_cancel, on_cancelled: ComfyUI's interrupt (EngineLink)."""
    @speaking(NODES)
    def request_for(settings, calls, view):
        info = inspect_model(settings.model_path)
        return model_request(settings, calls, latent_channels=info.latent.channels, hardware=view.hardware,
                             job_request=job_request)
    info = inspect_model(settings.model_path)
    # packed streams (audio + video): the output is shaped like the packed input
    return EngineLink(settings, registry, request_for, before_job,
                      out_channels=0 if info.spec.packed_streams else info.latent.channels,
                      should_cancel=should_cancel, on_cancelled=on_cancelled)


COMFY_DEVICE_MARGIN = GiB // 2   # kept free on ComfyUI's GPU beyond the job's estimate


def job_device_need(record: EngineRecord | None, request: GenerateRequest) -> int:
    """What a job will take on one of its GPUs beyond what the engine holds there already, in bytes, as the planner's
    memory model counts it: its activations, its model's weights unless the ranks keep that model on the GPU, and the
    CUDA runtime unless the ranks run already."""
    work = request.workload(inspect_model(request.model))
    parts = memory_gib(request.plan, work, HOST)
    running = record is not None and record.engine.running
    resident = running and any(e.get("file") == os.path.basename(request.model) and str(e.get("where", ""))
                               .startswith("cuda") for e in record.last_residency)
    gib = parts["activations"] + (0.0 if resident else parts["weights"]) + \
        (0.0 if running else parts["runtime"] + parts["nccl"])
    return int(gib * GiB)


def room_beside_comfyui(device: str, need_bytes: int, free_bytes: int, comfy_models: list[tuple[str, int]]) -> \
        tuple[int, str]:
    """Before a job on a GPU that ComfyUI's own process uses too (its text encoder, its VAE decode): (bytes ComfyUI
    should free there, 0 to keep its models, and the line the Info node shows). ComfyUI's models stay where the job
    fits beside them, so the next prompt does not load its text encoder again; else ComfyUI frees what the job needs
    (its own free_memory, least recently used first)."""
    held = sum(b for _, b in comfy_models)
    names = ", ".join(f"{name} {b / GiB:.1f} GiB" for name, b in comfy_models) or "nothing"
    want = need_bytes + COMFY_DEVICE_MARGIN
    if want <= free_bytes:
        return 0, (f"{device}, ComfyUI's GPU: kept ComfyUI's models there ({names}); the job's about "
                   f"{need_bytes / GiB:.1f} GiB fit in the {free_bytes / GiB:.1f} GiB free")
    short = "" if want <= free_bytes + held else (
        f"; even without them the device has {(free_bytes + held) / GiB:.1f} GiB for it: the ranks say what fits")
    return want, (f"{device}, ComfyUI's GPU: ComfyUI freed what the job needs there (about {need_bytes / GiB:.1f} GiB, "
                  f"{free_bytes / GiB:.1f} GiB were free; its models: {names}){short}")


def note(record: EngineRecord | None, kind: str, line: str) -> None:
    """Set the Info node's line of this kind (one per kind: the latest job's)."""
    if record is None:
        return
    record.notes = [n for n in record.notes if not n.startswith(kind)] + [line]


def measured_line(machine: Machine) -> str:
    """What the planner measured of the engine's devices, or that its figures are still the model's."""
    measured = machine.measured()
    where = f" ({machine.unsaved})" if machine.unsaved else ""
    if measured is None or not measured.calibrated:
        when = ("the engine's first job here measures them" if machine.device == "cuda" else
                "CPU ranks are measured by python -m engine calibrate")
        return f"measured: nothing yet for {machine.setup}; the planner's figures are modelled ({when}){where}"
    return f"measured ({machine.setup}, {machine.path}): " + "; ".join(measured.summary()) + where


def describe(settings: EngineSettings, registry: EngineRegistry = REGISTRY) -> str:
    """What the Info node shows."""
    record = registry.running(settings)
    lines = [f"model: {settings.model_path}", f"ranks: {len(settings.gpus)} on {settings.device} "
             f"{'GPUs ' + ','.join(map(str, settings.gpus)) if settings.device == 'cuda' else '(CPU ranks, gloo)'}",
             f"weights: {settings.weight_dtype} (compute {settings.compute_dtype}); plan setting: {settings.plan}"]
    for path, strength in settings.loras:
        lines.append(f"LoRA: {path} at {strength:g}")
    if settings.sampling:
        lines.append(f"model sampling: {FlowSampling(*settings.sampling).describe()}")
    if settings.cfg_norm:
        lines.append(f"CFGNorm: strength {settings.cfg_norm:g}")
    lines.append(measured_line(registry.machine(settings)))
    if record is None:
        lines.append("engine: not running (starts with the next xDiT Sampler job)")
        return "\n".join(lines)
    engine = record.engine
    lines.append(f"engine: {'running' if engine.running else 'stopped'}, pids {engine.pids}, "
                 f"restarts {len(engine.restarts)}" + (f" (last: {engine.restarts[-1]})" if engine.restarts else ""))
    for rank, memory in enumerate(record.last_memory):
        where = f"cuda:{settings.gpus[rank]}" if settings.device == "cuda" else "cpu"
        parts = [f"{k.replace('_gib', '')} {v:.2f} GiB" for k, v in memory.items()]
        lines.append(f"rank {rank} ({where}): " + ", ".join(parts))
    if record.last_route:
        lines.append(f"last job ran: {record.last_route}")
    if record.last_timings:
        lines.append(f"last job: plan {record.last_plan}; " + ", ".join(
            f"{k} {v:.3f} s" if k.endswith("_s") else f"{k} {v}" for k, v in record.last_timings.items()))
    if record.last_lora:
        lines.append(f"LoRA layers applied on the ranks: {record.last_lora}")
    if record.last_placement:
        lines.append(f"experts: the plan keeps the idle expert {'in host memory' if record.last_placement == 'host' else 'on the GPUs too'} "
                     f"({record.last_placement}; re-checked before each job against the free memory measured then)")
    held = [e for e in record.last_residency if "model" in e]
    if held:
        lines.append("models on the ranks: " + "; ".join(f"{e['model']} ({e['file']}) on {e['where']}" for e in held))
    for e in record.last_residency:
        if "moved" in e:
            lines.append(f"before the last job: {e['moved']}")
    if record.last_plan_reason:
        lines.append(f"plan: {record.last_plan_reason}")
    if record.last_cache:
        lines.append(f"step cache: skipped {record.last_cache['skipped_calls']} of {record.last_cache['model_calls']} "
                     f"model calls")
    for stage in record.last_stages:
        blocks = stage["blocks"]
        lines.append(f"rank {stage['rank']}: PipeFusion stage {stage['stage']}, blocks {blocks[0]}-{blocks[-1]}, weights held "
                     f"{stage['held_bytes'] / 2**30:.2f} GiB ({stage['patches']} patches, {stage['warmup_steps']} "
                     f"warmup step(s))")
    if record.last_bytes:
        lines.append("rank 0 sent per step: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in record.last_bytes.items()))
    lines.extend(record.notes)
    return "\n".join(lines)
