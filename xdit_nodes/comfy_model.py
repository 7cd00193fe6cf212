"""The xDiT Engine's MODEL, as ComfyUI builds a model: ComfyUI's own model class for the file's family, detected from
the file's header by ComfyUI's model_detection (no weight read), with the engine standing in for its diffusion model
(model.py); ComfyUI's model sampling objects and CFGNorm for the settings of the engine's older nodes; and the room a
job needs on a GPU ComfyUI's own process uses too. Imported only inside ComfyUI."""
from __future__ import annotations

import weakref

import torch
import comfy.model_management as mm

from . import core, model as engine_model_parts


def _make_room(settings: core.EngineSettings, request) -> None:
    """Before each job: on a GPU that ComfyUI's own process uses and the engine's ranks use too, ComfyUI's models stay
    where the job fits beside them, else ComfyUI frees what the job needs (core.room_beside_comfyui); the Info node says
    which. The engine's MODEL holds nothing on any GPU in ComfyUI's process."""
    if settings.device != "cuda":
        return
    device = mm.get_torch_device()
    if device.type != "cuda" or (device.index or 0) not in settings.gpus:
        return
    record = core.REGISTRY.running(settings)
    models = [(type(getattr(lm.model, "model", lm.model)).__name__, int(lm.model_loaded_memory()))
              for lm in mm.current_loaded_models if lm.device == device and lm.model is not None]
    need = core.job_device_need(record, request)
    free_bytes, line = core.room_beside_comfyui(f"cuda:{device.index or 0}", need, int(mm.get_free_memory(device)),
                                                [m for m in models if m[1] > 0])
    if free_bytes:
        mm.free_memory(free_bytes, device)
        mm.soft_empty_cache()
    core.note(record, f"cuda:{device.index or 0}, ComfyUI's GPU", line)


class _Unavailable(torch.nn.Module):
    """The MODEL of an xDiT Engine whose file this ComfyUI cannot describe (a family newer than it): any use says so."""

    def __init__(self, message: str):
        super().__init__()
        self.__dict__["message"] = message

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_parameters", "_buffers", "_modules"):
            return super().__getattr__(name)
        raise AttributeError(self.__dict__["message"])


_MODELS: dict = {}   # settings -> (MODEL, its link): one per engine settings while ComfyUI holds the node's output


def engine_model(settings: core.EngineSettings):
    """The xDiT Engine's MODEL: ComfyUI's own model class for the file, detected from the file's header as ComfyUI's
    loader detects it (no weight read), with the engine standing in for its diffusion model (model.py)."""
    import comfy.model_detection as detection
    import comfy.model_patcher
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    from ..engine.models.load import checkpoint_files, header_tensors, read_headers

    key = settings
    if key in _MODELS:
        return _MODELS[key]
    sd = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in
          header_tensors(settings.model_path).items()}
    prefix = detection.unet_prefix_from_state_dict(sd)
    stripped = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or sd
    # the header's model config, which ComfyUI's loader hands its detection too (LTX-2.3 states its settings there)
    header = read_headers(checkpoint_files(settings.model_path))[1]
    stated = {"metadata": {"config": header["config"]}} if isinstance(header.get("config"), str) else {}
    config = detection.model_config_from_unet(stripped, "", **stated)
    if config is None:
        converted = detection.convert_diffusers_mmdit(stripped, "")
        if converted is not None:
            stripped, config = converted, detection.model_config_from_unet(converted, "")
    info = core.inspect_model(settings.model_path)
    expected = info.spec.comfy_model(info.config)[1].get("image_model")
    if config is not None and expected and getattr(config, "unet_config", {}).get("image_model") != expected:
        config = None   # an older ComfyUI takes the file for another model (0.3.64: LTX-2.3 as the video-only LTXV)
    wanted = info.spec.comfy_class(info.variant)
    if config is not None and wanted and type(config).__name__ != wanted:
        config = None   # (0.3.64: Wan-Animate 2 as Wan 2.1 image-to-video, without its pose inputs)
    device = torch.device("cpu")   # ComfyUI's side of the MODEL holds no weights: its sampler runs on the CPU
    if config is None:
        since = info.spec.comfyui_since(info.variant)
        message = (f"this ComfyUI ({_comfyui_version()}) does not know {info.variant} ({info.spec.title}) models, so "
                   f"the xDiT Engine's MODEL output cannot describe it: update ComfyUI to "
                   f"{since + ' or newer' if since else 'a release that has it'}"
                   + ("" if info.spec.packed_streams else ", or use the xDiT Engine's engine output with xDiT Sampler"))
        return comfy.model_patcher.ModelPatcher(_Unavailable(message), load_device=device, offload_device=device,
                                                size=1)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model(stripped, "", device=torch.device("meta"))
    keys = {k: (tuple(v.shape), v.dtype) for k, v in model.diffusion_model.state_dict().items()}
    link = core.model_link(settings, before_job=lambda request: _make_room(settings, request),
                           should_cancel=mm.processing_interrupted,
                           on_cancelled=mm.throw_exception_if_processing_interrupted)
    model.diffusion_model = engine_model_parts.EngineTransformer(link, keys, meta=model.diffusion_model,
                                                                 family=info.spec)
    link.owner = weakref.ref(model)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device, size=1)
    link.base_patcher = weakref.ref(patcher)
    patcher.add_callback_with_key(CallbacksMP.ON_CLEANUP, engine_model_parts.OWN_CALLBACK, link.on_cleanup)
    # a step's positive and negative passes reach the ranks as one request, whatever ComfyUI batches (model.py)
    patcher.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, engine_model_parts.OWN_CALLBACK, link.calc_cond_batch)
    if settings.sampling:   # xDiT Model Sampling on the engine output: as ComfyUI's sampling nodes patch a MODEL
        patcher.add_object_patch("model_sampling", _model_sampling(model, *settings.sampling))
    if settings.cfg_norm:   # xDiT CFGNorm on the engine output
        patcher.set_model_sampler_post_cfg_function(_cfg_norm(settings.cfg_norm))
    if len(_MODELS) >= 8:
        _MODELS.clear()
    _MODELS[key] = patcher
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
    cfg_norm.xdit_cfg_norm = float(strength)   # the engine's own loop recognises it (model.cfg_norm_strength)
    return cfg_norm
