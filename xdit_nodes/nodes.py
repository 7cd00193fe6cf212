"""The ComfyUI V3 nodes (comfy_api v0_0_2): schemas made from core's specs; ComfyUI's model folders, progress bar,
interrupt and memory management passed into core. Imported only inside ComfyUI."""
from __future__ import annotations

import os
from dataclasses import replace

import torch
import comfy.model_management as mm
import comfy.utils
import folder_paths
from comfy_api.v0_0_2 import ComfyExtension, io, ui

from ..engine.errors import JobCancelled
from ..engine.models.gguf_file import find_gguf_files
from ..engine.sampling.ksampler import StepWindow
from . import core, model as engine_model_parts, specs
from .comfy_model import _cfg_norm, _make_room, _model_sampling, engine_model  # noqa: F401 (tests patch them here)
from .comfy_model import _Unavailable

EngineType = io.Custom(specs.ENGINE_TYPE)
_TYPES = {"CONDITIONING": io.Conditioning, "LATENT": io.Latent, "STRING": io.String, "MODEL": io.Model,
          "GUIDER": io.Guider, "CLIP": io.Clip, "VAE": io.Vae, specs.ENGINE_TYPE: EngineType}
MODEL_FOLDERS = ("diffusion_models", "checkpoints")
MODEL_WHERE = "models/" + " or models/".join(MODEL_FOLDERS)


def _machine_folder() -> str | None:
    """Where what the planner measures of this machine lives: ComfyUI's user folder, read when used (ComfyUI may set
    it after the pack loads); None (the per-user cache) when ComfyUI names none."""
    try:
        user = folder_paths.get_user_directory()
    except Exception:   # an older ComfyUI without one
        return None
    return os.path.join(user, "comfyui-xdit") if isinstance(user, str) and user else None


core.REGISTRY.machine_folder = _machine_folder


def _takes_advanced() -> bool:
    """This ComfyUI's inputs can be marked advanced (0.33's "Show advanced inputs"; 0.3.64's cannot)."""
    import inspect
    return "advanced" in inspect.signature(io.Int.Input.__init__).parameters


def _input(f: specs.Field):
    tip = {"tooltip": f.tooltip} if f.tooltip else {}
    if f.optional:
        tip["optional"] = True
    if f.advanced and _takes_advanced():   # folded under the frontend's advanced inputs; saved values unchanged
        tip["advanced"] = True
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
    device = _device()
    return specs.parse_gpus(text, device, torch.cuda.device_count() if device == "cuda" else 0, os.cpu_count() or 1)


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
                cache_threshold=0.0, compile=False, attention="auto", pipefusion=1, patches=0, warmup_steps=1,
                expert_placement="auto", shard=1):
        settings = _settings(_model_path(model_name), family, weight_dtype, gpus, plan, ulysses, ring, cfg_parallel, dp,
                             timeout_s, cache_threshold, compile, attention, pipefusion, patches, warmup_steps,
                             expert_placement, shard)
        return io.NodeOutput(settings, engine_model(settings))


def _settings(model_path, family, weight_dtype, gpus, plan, ulysses, ring, cfg_parallel, dp, timeout_s,
              cache_threshold=0.0, compile=False, attention="auto", pipefusion=1, patches=0, warmup_steps=1,
              expert_placement="auto", shard=1) -> core.EngineSettings:
    """The engine's settings from its node's inputs (those added after the first release optional, at the defaults
    that keep the earlier behaviour), checked."""
    settings = core.EngineSettings(model_path=model_path, gpus=_gpus(gpus), device=_device(), family=family,
                                   weight_dtype=weight_dtype, plan=plan, ulysses=ulysses, ring=ring,
                                   cfg_parallel=cfg_parallel, dp=dp, timeout_s=timeout_s,
                                   cache_threshold=cache_threshold, compile=compile, attention=attention,
                                   pipefusion=pipefusion, patches=patches, warmup_steps=warmup_steps,
                                   expert_placement=expert_placement, shard=shard)
    settings.validate()
    return settings


class XDiTCheckpointLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.checkpoint_spec(folder_paths.get_filename_list("checkpoints")))

    @classmethod
    def validate_inputs(cls, ckpt_name=None):
        return specs.check_file_name("ckpt_name", ckpt_name, folder_paths.get_filename_list("checkpoints"),
                                     "models/checkpoints")

    @classmethod
    def execute(cls, ckpt_name, family, weight_dtype, gpus, plan, ulysses, ring, cfg_parallel, dp, timeout_s,
                cache_threshold=0.0, compile=False, attention="auto", pipefusion=1, patches=0, warmup_steps=1,
                expert_placement="auto", shard=1):
        """The engine's MODEL of the file's diffusion model (refused in one line where this ComfyUI is too old for
        it), then its text encoder and VAE exactly as CheckpointLoaderSimple loads them (ComfyUI's own loader, its
        diffusion model left unread), the VAE's decode and encode on the engine's ranks where the engine splits its
        type (comfy_vae.checkpoint_vae; ComfyUI's own VAE for any other)."""
        import comfy.sd
        path = folder_paths.get_full_path_or_raise("checkpoints", ckpt_name)
        settings = _settings(path, family, weight_dtype, gpus, plan, ulysses, ring, cfg_parallel, dp, timeout_s,
                             cache_threshold, compile, attention, pipefusion, patches, warmup_steps, expert_placement,
                             shard)
        model = engine_model(settings)
        if isinstance(getattr(model, "model", None), _Unavailable):   # a family newer than this ComfyUI: its own
            raise ValueError(model.model.__dict__["message"])           # loader would misread the file too
        _, clip, vae, *_ = comfy.sd.load_checkpoint_guess_config(
            path, output_vae=True, output_clip=True, output_model=False,
            embedding_directory=folder_paths.get_folder_paths("embeddings"))
        if getattr(vae, "first_stage_model", None) is not None:   # the checkpoint has a VAE
            from .comfy_vae import checkpoint_vae
            vae = checkpoint_vae(vae, settings, path)
        return io.NodeOutput(model, clip, vae, settings)


class XDiTVAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from .comfy_vae import vae_names
        return _schema(specs.vae_loader_spec(vae_names()))

    @classmethod
    def validate_inputs(cls, vae_name=None):
        from .comfy_vae import vae_names
        return specs.check_file_name("vae_name", vae_name, vae_names(), "models/vae")

    @classmethod
    def execute(cls, vae_name, engine=None):
        """ComfyUI's own VAELoader's VAE, its decode and encode on the engine's ranks where the engine splits the
        file's type (comfy_vae.py)."""
        from .comfy_vae import load
        return io.NodeOutput(load(vae_name, engine))


class XDiTSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import comfy.samplers
        return _schema(specs.sampler_spec(comfy.samplers.KSampler.SAMPLERS, comfy.samplers.KSampler.SCHEDULERS))

    @classmethod
    def execute(cls, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                engine=None, model=None):
        return io.NodeOutput(_run_sampler(engine, model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                          latent_image, denoise, StepWindow()))


class XDiTSamplerAdvanced(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import comfy.samplers
        return _schema(specs.sampler_advanced_spec(comfy.samplers.KSampler.SAMPLERS,
                                                   comfy.samplers.KSampler.SCHEDULERS))

    @classmethod
    def execute(cls, add_noise, noise_seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                start_at_step, end_at_step, return_with_leftover_noise, model=None, engine=None):
        window = StepWindow(start_step=start_at_step, last_step=end_at_step,
                            force_full_denoise=return_with_leftover_noise != "enable", add_noise=add_noise != "disable")
        return io.NodeOutput(_run_sampler(engine, model, noise_seed, steps, cfg, sampler_name, scheduler, positive,
                                          negative, latent_image, 1.0, window))


def _run_sampler(engine, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                 window: StepWindow):
    """KSampler (KSamplerAdvanced with a window) on the engine: its own loop when it runs the sampler, scheduler and
    the MODEL chain's patches, else ComfyUI's own sampler on the engine's MODEL (the same result)."""
    settings, chain = _engine_and_chain(engine, model)
    sampling, cfg_norm, reasons, weight_patches = None, 0.0, [], None
    if chain is not None:
        engine_model_parts.check_chain(chain)
        info = core.inspect_model(settings.model_path)
        sampling, cfg_norm, reasons = engine_model_parts.loop_settings(chain, _sampling_classes(),
                                                                       info.spec.sampling(info.variant))
        weight_patches = engine_model_parts.weight_patches(chain)
    if isinstance(latent_image, dict) and latent_image.get("noise_mask") is not None:
        reasons.append("the latent has a noise mask")   # ComfyUI's sampler masks the denoising itself
    if core.inspect_model(settings.model_path).spec.packed_streams:
        reasons.append("its latent packs audio and video")   # the engine's own loop samples one latent stream
    if reasons or not specs.engine_loop_runs(sampler_name, scheduler):
        # ComfyUI's own KSampler on the engine's MODEL: one model call at a time, the same result
        core.check_per_call(settings)
        return _comfy_ksampler(_as_engine_model(settings, chain), seed, steps, cfg, sampler_name, scheduler, positive,
                               negative, latent_image, denoise, window)
    if chain is not None:
        settings = replace(settings, sampling=(sampling["kind"], sampling["shift"], sampling["multiplier"]),
                           cfg_norm=cfg_norm)
    progress = comfy.utils.ProgressBar(steps)  # its update also raises on interrupt, on this thread
    try:
        return core.sample(settings, positive, negative, latent_image, seed=seed, steps=steps, cfg=cfg,
                           sampler_name=sampler_name, scheduler=scheduler, denoise=denoise,
                           on_progress=lambda step, total: progress.update_absolute(step, total),
                           should_cancel=mm.processing_interrupted,
                           before_job=lambda request: _make_room(settings, request), weight_patches=weight_patches,
                           window=window)
    except JobCancelled:
        mm.throw_exception_if_processing_interrupted()  # ComfyUI's own interrupt exception, flag cleared
        raise


def _sampling_classes() -> engine_model_parts.SamplingClasses:
    import comfy.model_sampling as ms
    return engine_model_parts.SamplingClasses(ms.ModelSamplingFlux, ms.ModelSamplingDiscreteFlow, ms.CONST)


def _link_of(model):
    """The EngineLink behind an xDiT Engine's MODEL (after any patches), or None for another MODEL."""
    diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
    return diffusion_model.link if isinstance(diffusion_model, engine_model_parts.EngineTransformer) else None


def _engine_and_chain(engine, model):
    """(engine settings, MODEL chain or None) of a node given an xDiT Engine's engine output and/or a MODEL."""
    link = _link_of(model) if model is not None else None
    if link is not None:
        if engine is not None and (engine.model_path, engine.gpus) != (link.settings.model_path, link.settings.gpus):
            raise ValueError("engine and model come from different xDiT Engines (or settings): connect only the "
                             "model input (the xDiT Engine's MODEL chain), or only engine")
        return (engine if engine is not None else link.settings), model
    if engine is None:
        raise ValueError("connect the xDiT Engine's MODEL (through any ModelSampling, CFGNorm or LoRA nodes) to the "
                         "model input, or its engine output to engine" + (
                             "; the MODEL given comes from another loader (it can only add sampling settings to an "
                             "engine input)" if model is not None else ""))
    return engine, model


def _as_engine_model(settings: core.EngineSettings, chain):
    """A MODEL whose forward runs on the engine for these settings: the chain itself when it is the engine's, else the
    engine's MODEL carrying the chain's sampling, options and LoRA patches (a MODEL from another loader), else the
    engine's MODEL with the xDiT Model Sampling / CFGNorm settings."""
    if chain is not None and _link_of(chain) is not None:
        return chain
    m = engine_model(settings)
    if chain is None:
        return m
    m = m.clone()
    m.add_object_patch("model_sampling", chain.get_model_object("model_sampling"))
    m.model_options = chain.model_options
    for key, entries in (chain.patches or {}).items():
        m.patches[key] = list(entries)
    return m


def _comfy_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                    window: StepWindow):
    """ComfyUI's own KSampler / KSamplerAdvanced (nodes.common_ksampler: its noise, schedule, sampler, progress and
    previews)."""
    import nodes as comfy_nodes

    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise ValueError("latent_image is not a LATENT (a dict with 'samples'); connect EmptySD3LatentImage or "
                         "VAEEncode to it")
    return comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                       latent_image, denoise=denoise, disable_noise=not window.add_noise,
                                       start_step=window.start_step, last_step=window.last_step,
                                       force_full_denoise=window.force_full_denoise)[0]


class XDiTGuider(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.GUIDER_SPEC)

    @classmethod
    def execute(cls, positive, cfg, engine=None, negative=None, model=None):
        """ComfyUI's own CFGGuider (BasicGuider without a negative) on the engine's MODEL: SamplerCustomAdvanced's
        sampler calls the engine once per model evaluation, CFG parallel splitting the batched passes."""
        import comfy.samplers
        from comfy_extras.nodes_custom_sampler import Guider_Basic

        settings, chain = _engine_and_chain(engine, model)
        if chain is not None:
            engine_model_parts.check_chain(chain)
        core.check_per_call(settings)
        cfg = float(cfg)
        if cfg != 1.0 and negative is None:
            raise ValueError(f"xDiT Guider: cfg={cfg} needs a negative conditioning: connect one to negative, or set "
                             f"cfg 1.0 (FLUX)")
        m = _as_engine_model(settings, chain)
        if negative is None:
            guider = Guider_Basic(m)
            guider.set_conds(positive)
        else:
            guider = comfy.samplers.CFGGuider(m)
            guider.set_conds(positive, negative)
            guider.set_cfg(cfg)
        return io.NodeOutput(guider)


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


class XDiTSaveConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return _schema(specs.SAVE_CONDITIONING_SPEC)

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # a file each run, as SaveImage

    @classmethod
    def execute(cls, positive, filename_prefix, negative=None):
        import os
        from safetensors.torch import save_file

        tensors, metadata = core.conditioning_file(positive, negative)
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix,
                                                                              folder_paths.get_output_directory())
        path = os.path.join(folder, f"{name}_{counter:05}_.safetensors")
        save_file(tensors, path, metadata=metadata)
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
        flags = (f" --guidance {metadata['guidance']}" if "guidance" in metadata else "") + (
            f" --reference-method {metadata['reference_latents_method']}" if "reference_latents_method" in metadata
            else "")
        text = f"saved {path}: {shapes}\nuse it: python -m engine generate --cond {path}{flags} --model ..."
        return io.NodeOutput(path, ui=ui.PreviewText(text))


class XDiTExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [XDiTEngine, XDiTCheckpointLoader, XDiTVAELoader, XDiTLoRA, XDiTSampler, XDiTSamplerAdvanced, XDiTGuider, XDiTEngineInfo, XDiTModelSampling,
                XDiTCFGNorm, XDiTSaveConditioning]
