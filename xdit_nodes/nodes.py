"""The ComfyUI V3 nodes (comfy_api v0_0_2): schemas made from core's specs; ComfyUI's model folders, progress bar,
interrupt and memory management passed into core. Imported only inside ComfyUI."""
from __future__ import annotations

import torch
import comfy.model_management as mm
import comfy.utils
import folder_paths
from comfy_api.v0_0_2 import ComfyExtension, io, ui

from ..engine.errors import JobCancelled
from ..engine.models.gguf_file import find_gguf_files
from . import core, specs

EngineType = io.Custom(specs.ENGINE_TYPE)
_TYPES = {"CONDITIONING": io.Conditioning, "LATENT": io.Latent, "STRING": io.String, "MODEL": io.Model,
          "GUIDER": io.Guider, specs.ENGINE_TYPE: EngineType}
MODEL_FOLDERS = ("diffusion_models", "checkpoints")
MODEL_WHERE = "models/" + " or models/".join(MODEL_FOLDERS)


def _input(f: specs.Field):
    tip = {"tooltip": f.tooltip} if f.tooltip else {}
    if f.optional:
        tip["optional"] = True
    if f.type == "COMBO":
        return io.Combo.Input(f.name, options=list(f.options), default=f.default, **tip)
    if f.type == "INT":
        return io.Int.Input(f.name, default=f.default, min=f.min, max=f.max,
                            control_after_generate=f.control_after_generate, **tip)
    if f.type == "FLOAT":
        return io.Float.Input(f.name, default=f.default, min=f.min, max=f.max, step=f.step, round=f.round, **tip)
    if f.type == "BOOLEAN":
        return io.Boolean.Input(f.name, default=f.default, **tip)
    if f.type == "STRING":
        return io.String.Input(f.name, default=f.default, **tip)
    return _TYPES[f.type].Input(f.name, **tip)


def _schema(spec: specs.NodeSpec) -> io.Schema:
    outputs = [_TYPES[t].Output(display_name=n) for t, n in spec.outputs]
    return io.Schema(node_id=spec.node_id, display_name=spec.display_name, category=spec.category,
                     description=spec.description, inputs=[_input(f) for f in spec.inputs], outputs=outputs,
                     is_output_node=spec.output_node)


def _gguf_files() -> dict[str, str]:
    """ComfyUI lists no .gguf in its model folders (ComfyUI-GGUF adds its own "unet_gguf" name for them): the
    engine reads them, so they are found here in the same folders."""
    return find_gguf_files([p for folder in MODEL_FOLDERS for p in folder_paths.get_folder_paths(folder)])


def _model_names() -> list[str]:
    listed = {n for folder in MODEL_FOLDERS for n in folder_paths.get_filename_list(folder)}
    return sorted(listed | set(_gguf_files()))


def _model_path(name: str) -> str:
    for folder in MODEL_FOLDERS:
        path = folder_paths.get_full_path(folder, name)
        if path:
            return path
    if name in (found := _gguf_files()):
        return found[name]
    raise ValueError(f"model_name={name!r} is not in ComfyUI's {' or '.join(MODEL_FOLDERS)} folders")


def _device() -> str:
    return "cpu" if mm.cpu_state == mm.CPUState.CPU or not torch.cuda.is_available() else "cuda"


def _gpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in text.replace(" ", "").split(",") if g != "")
    except ValueError:
        raise ValueError(f"gpus={text!r} is invalid: list GPU indices separated by commas, e.g. 0,1,2,3") from None


class XDiTEngine(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.engine_spec(_model_names()))

    @classmethod
    def validate_inputs(cls, model_name=None):
        """At validation (ComfyUI does not check V3 combo values): a model name not in the folders is refused."""
        return specs.check_file_name("model_name", model_name, _model_names(), MODEL_WHERE)

    @classmethod
    def execute(cls, model_name, family, weight_dtype, gpus, plan, ulysses, ring, cfg_parallel, dp, timeout_s,
                cache_threshold=0.0, compile=False, attention="auto", pipefusion=1, patches=0, warmup_steps=1):
        settings = core.EngineSettings(model_path=_model_path(model_name), gpus=_gpus(gpus), device=_device(),
                                       family=family, weight_dtype=weight_dtype, plan=plan, ulysses=ulysses, ring=ring,
                                       cfg_parallel=cfg_parallel, dp=dp, timeout_s=timeout_s,
                                       cache_threshold=cache_threshold, compile=compile, attention=attention,
                                       pipefusion=pipefusion, patches=patches, warmup_steps=warmup_steps)
        settings.validate()
        return io.NodeOutput(settings)


def _make_room(settings: core.EngineSettings) -> None:
    """ComfyUI's own models leave a GPU that the engine's ranks use."""
    if settings.device != "cuda":
        return
    device = mm.get_torch_device()
    if device.type == "cuda" and (device.index or 0) in settings.gpus:
        mm.unload_all_models()
        mm.soft_empty_cache()
        record = core.REGISTRY.running(settings)
        note = f"made room on cuda:{device.index or 0} (ComfyUI's device) by unloading ComfyUI's models before each job"
        if record is not None and note not in record.notes:
            record.notes.append(note)


class XDiTSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import comfy.samplers
        return _schema(specs.sampler_spec(comfy.samplers.KSampler.SAMPLERS, comfy.samplers.KSampler.SCHEDULERS))

    @classmethod
    def execute(cls, engine, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise):
        if not specs.engine_loop_runs(sampler_name, scheduler):
            return io.NodeOutput(_comfy_driven(engine, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                               latent_image, denoise))
        progress = comfy.utils.ProgressBar(steps)  # its update also raises on interrupt, on this thread
        try:
            latent = core.sample(engine, positive, negative, latent_image, seed=seed, steps=steps, cfg=cfg,
                                 sampler_name=sampler_name, scheduler=scheduler, denoise=denoise,
                                 on_progress=lambda step, total: progress.update_absolute(step, total),
                                 should_cancel=mm.processing_interrupted, before_job=lambda: _make_room(engine))
        except JobCancelled:
            mm.throw_exception_if_processing_interrupted()  # ComfyUI's own interrupt exception, flag cleared
            raise
        return io.NodeOutput(latent)


class _NoWeights(torch.nn.Module):
    """Stands where ComfyUI's model would hold its diffusion model: the engine's ranks hold the weights."""
    dtype = torch.float32

    def forward(self, *args, **kwargs):
        raise RuntimeError("this MODEL carries only the xDiT engine's sampling settings (no weights): sample it with "
                           "xDiT Sampler or the xDiT Guider, not KSampler or BasicGuider")


def sampling_model(settings: core.EngineSettings):
    """A ComfyUI model without weights for the engine's model family: ComfyUI's own model sampling (sigmas,
    noise scaling, percent_to_sigma) and latent format, for ComfyUI's samplers, schedulers and previews."""
    import comfy.model_patcher
    import comfy.supported_models as models

    info = core.inspect_model(settings.model_path)
    class_name, unet = info.spec.comfy_model(info.config)
    if not hasattr(models, class_name):   # a family newer than this ComfyUI (e.g. FLUX.2 before 0.3.72)
        since = info.spec.comfyui_since(info.variant)
        raise ValueError(f"{settings.model_path} holds a {info.variant} transformer, and this ComfyUI "
                         f"({_comfyui_version()}) has no {class_name} model: update ComfyUI to "
                         f"{since + ' or newer' if since else 'a release that has it'} to sample it")
    config = getattr(models, class_name)(dict(unet, disable_unet_model_creation=True))
    model = config.get_model({})
    model.diffusion_model = _NoWeights()
    device = mm.intermediate_device()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device, size=1)
    if settings.sampling:   # xDiT Model Sampling: as ComfyUI's sampling nodes patch a MODEL (this one is ours alone)
        model.model_sampling = _model_sampling(model, *settings.sampling)
    if settings.cfg_norm:   # xDiT CFGNorm: as ComfyUI's CFGNorm node patches a MODEL
        patcher.set_model_sampler_post_cfg_function(_cfg_norm(settings.cfg_norm))
    return patcher


def _comfyui_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:   # a ComfyUI older than its version file
        return "version unknown"
    return __version__


def _model_sampling(model, kind: str, shift: float, multiplier: float):
    """ComfyUI's own model sampling object, as ModelSamplingAuraFlow / ModelSamplingSD3 / ModelSamplingFlux build it."""
    import comfy.model_sampling

    base = comfy.model_sampling.ModelSamplingFlux if kind == "flux" else comfy.model_sampling.ModelSamplingDiscreteFlow

    class ModelSamplingAdvanced(base, comfy.model_sampling.CONST):
        pass
    sampling = ModelSamplingAdvanced(model.model_config)
    if kind == "flux":
        sampling.set_parameters(shift=shift)
    else:
        sampling.set_parameters(shift=shift, multiplier=multiplier)
    return sampling


def _cfg_norm(strength: float):
    """ComfyUI's CFGNorm post-CFG function (comfy_extras/nodes_cfg.py), at `strength`."""
    def cfg_norm(args):
        cond_p, pred = args["cond_denoised"], args["denoised"]
        scale = (torch.norm(cond_p, dim=1, keepdim=True) / (torch.norm(pred, dim=1, keepdim=True) + 1e-8)).clamp(
            min=0.0, max=1.0)
        return pred * scale * strength
    return cfg_norm


class XDiTGuider(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.GUIDER_SPEC)

    @classmethod
    def execute(cls, engine, positive, cfg, negative=None, model=None):
        import comfy.samplers

        patcher = sampling_model(engine)
        if model is not None:  # its sampling settings (ModelSamplingFlux/SD3/AuraFlow) and CFG hooks, our weights
            patcher.model.model_sampling = model.get_model_object("model_sampling")
            for fn in model.model_options.get("sampler_post_cfg_function", []):   # e.g. CFGNorm
                patcher.set_model_sampler_post_cfg_function(fn)
        guider = core.guider(engine, positive, negative, cfg, model_patcher=patcher,
                             sampling_function=comfy.samplers.sampling_function,
                             before_job=lambda: _make_room(engine))
        return io.NodeOutput(guider)


def _comfy_driven(settings, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise):
    """A sampler or scheduler the engine's loop does not have: ComfyUI's KSampler (its sigmas, noise and sampler)
    drives the engine through the xDiT Guider, one model evaluation per call."""
    import comfy.sample
    import comfy.samplers

    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise ValueError("latent_image is not a LATENT (a dict with 'samples'); connect EmptySD3LatentImage or "
                         "VAEEncode to it")
    if latent_image.get("noise_mask") is not None:
        raise ValueError("latent_image has a noise_mask (inpainting), which the xDiT Sampler does not support")
    patcher = sampling_model(settings)
    guider = core.guider(settings, positive, negative, cfg, model_patcher=patcher,
                         sampling_function=comfy.samplers.sampling_function, before_job=lambda: _make_room(settings))
    sigmas = comfy.samplers.KSampler(patcher, steps=steps, device="cpu", sampler=sampler_name, scheduler=scheduler,
                                     denoise=denoise).sigmas   # ComfyUI's own schedule, denoise and discarded sigma
    ratio = latent_image.get("downscale_ratio_spacial")   # set by ComfyUI versions whose function takes it
    samples = comfy.sample.fix_empty_latent_channels(patcher, latent_image["samples"],   # as KSampler does
                                                     *(() if ratio is None else (ratio,)))
    noise = comfy.sample.prepare_noise(samples, seed, latent_image.get("batch_index"))
    progress = comfy.utils.ProgressBar(len(sigmas) - 1)
    out = guider.sample(noise, samples, comfy.samplers.sampler_object(sampler_name), sigmas,
                        callback=lambda step, x0, x, total: progress.update_absolute(step + 1, total), seed=seed)
    latent = dict(latent_image)
    latent["samples"] = out.to(mm.intermediate_device())
    return latent


class XDiTLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.lora_spec(folder_paths.get_filename_list("loras")))

    @classmethod
    def validate_inputs(cls, lora_name=None):
        return specs.check_file_name("lora_name", lora_name, folder_paths.get_filename_list("loras"), "models/loras")

    @classmethod
    def execute(cls, engine, lora_name, strength_model):
        path = folder_paths.get_full_path("loras", lora_name)
        if not path:
            raise ValueError(f"lora_name={lora_name!r} is not in ComfyUI's loras folder")
        return io.NodeOutput(engine.with_lora(path, strength_model))


class XDiTModelSampling(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.SAMPLING_SPEC)

    @classmethod
    def execute(cls, engine, method, shift):
        return io.NodeOutput(engine.with_sampling(method, shift))


class XDiTCFGNorm(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.CFG_NORM_SPEC)

    @classmethod
    def execute(cls, engine, strength):
        return io.NodeOutput(engine.with_cfg_norm(strength))


class XDiTEngineInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.INFO_SPEC)

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # the engine's state changes between runs: never reuse a cached report

    @classmethod
    def execute(cls, engine, unload, after=None):
        text = core.describe(engine)
        if unload:
            stopped = core.REGISTRY.unload(engine)
            text += f"\nunloaded: {stopped} engine(s) stopped, their GPUs freed"
        return io.NodeOutput(text, ui=ui.PreviewText(text))


class XDiTExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [XDiTEngine, XDiTLoRA, XDiTSampler, XDiTGuider, XDiTEngineInfo, XDiTModelSampling, XDiTCFGNorm]
