"""What the check scripts that run inside a real ComfyUI share: starting ComfyUI in the script's process with the
pack loaded (`start`, before anything of ComfyUI is imported), running a node as ComfyUI's executor does, the xDiT
Engine node's settings, the relative difference they report, and the model ComfyUI's own loader makes of a tiny
file."""
import asyncio
import json
import os
import sys

import torch


def start(argv, folders=("diffusion_models", "loras")) -> tuple[str, str]:
    """ComfyUI started in this process as a check script's argv names it (COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR):
    its arguments parsed as `main.py --cpu`, MODELS_DIR's `folders` and the pack's parent folder registered, the custom
    nodes loaded. Returns (MODELS_DIR, ComfyUI's version)."""
    comfyui, pack_parent, models = argv[1:4]
    sys.argv = ["main.py", "--cpu"]
    sys.path.insert(0, comfyui)
    os.chdir(comfyui)
    import comfy.options
    comfy.options.enable_args_parsing()
    import folder_paths
    import nodes
    for folder in folders:
        folder_paths.add_model_folder_path(folder, os.path.join(models, folder))
    folder_paths.add_model_folder_path("custom_nodes", pack_parent)
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
    try:
        import comfyui_version
        version = comfyui_version.__version__
    except ImportError:   # a ComfyUI older than its version file
        version = "unknown"
    return models, version


def engine(file, gpus, **kw):
    """The xDiT Engine node on `file` and `gpus` (its other inputs at their defaults, `kw` changing some): (engine,
    MODEL)."""
    return call("XDiTEngine", model_name=file, **_settings(gpus, kw))


def checkpoint_loader(file, gpus, **kw):
    """The xDiT Checkpoint Loader node on the checkpoints file `file` and `gpus` (the engine's other inputs as
    `engine` sets them): (MODEL, CLIP, VAE, engine)."""
    return call("XDiTCheckpointLoader", ckpt_name=file, **_settings(gpus, kw))


def _settings(gpus, kw) -> dict:
    settings = dict(family="auto", weight_dtype="default", gpus=gpus, plan="auto", ulysses=1, ring=1,
                    cfg_parallel=False, dp=1, timeout_s=600)
    settings.update(kw)
    return settings


def last_plan(eng) -> str:
    """The plan the engine's last job ran, as its Info node says it."""
    text = call("XDiTEngineInfo", engine=eng, unload=False)[0]
    line = next((x for x in text.splitlines() if x.startswith("last job: plan ")), "")
    return line[len("last job: plan "):].split(";")[0]


def call(name, **kw):
    """Run a node as ComfyUI's executor would: V3 classes through EXECUTE_NORMALIZED, V1 through FUNCTION."""
    import nodes
    cls = nodes.NODE_CLASS_MAPPINGS[name]
    if hasattr(cls, "EXECUTE_NORMALIZED"):
        return cls.EXECUTE_NORMALIZED(**kw).args
    return getattr(cls(), cls.FUNCTION)(**kw)


def outcome(run) -> str:
    """What running `run()` gives: "ran", or the first line of what it raised (the message is what a check reads)."""
    try:
        run()
        return "ran"
    except Exception as e:  # noqa: BLE001 (the message is the check)
        return str(e).splitlines()[0]


def older_ksampler(model, text_width: int, latent_shape: tuple) -> str:
    """One KSampler step on `model` with zero text and latent (on a ComfyUI older than the model's family the
    engine's MODEL must refuse in one line): the outcome."""
    text = [[torch.zeros(1, 9, text_width), {}]]
    return outcome(lambda: call("KSampler", model=model, seed=5, steps=1, cfg=1.0, sampler_name="euler",
                                scheduler="simple", positive=text, negative=text,
                                latent_image={"samples": torch.zeros(latent_shape)}, denoise=1.0))


def rel(a, b):
    return float((a - b).norm() / b.norm())


def dequantized(sd):
    """A scaled fp8 state dict's weights as float32 (fp8 x scale_weight), the scales dropped: the exact values."""
    out = {}
    for k, v in sd.items():
        if k.endswith(("scale_weight", "scale_input")) or k == "scaled_fp8":
            continue
        scale = sd.get(k[:-len("weight")] + "scale_weight") if k.endswith("weight") else None
        out[k] = v.float() * scale.float() if scale is not None else v.float()
    return out


def native_model(file, dequantize=False):
    """UNETLoader's model, with the tiny file's widths given to ComfyUI's detection (which fixes the released models'
    widths for FLUX.1, FLUX.2 and Qwen-Image); everything else (config class, weights, model sampling) is ComfyUI's
    own. A scaled fp8 file is loaded as UNETLoader loads it, or with dequantize its exact float32 values."""
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils
    import folder_paths
    from safetensors import safe_open

    path = folder_paths.get_full_path("diffusion_models", file)
    sd = comfy.utils.load_torch_file(path)
    with safe_open(path, "pt") as f:
        dims = json.loads((f.metadata() or {}).get("xdit.synthetic", "{}")).get("dims", {})
    if any(k.endswith("scale_weight") or k == "scaled_fp8" for k in sd):
        import comfy.sd
        return comfy.sd.load_diffusion_model_state_dict(dequantized(sd) if dequantize else sd,
                                                        model_options={"dtype": torch.float32})
    unet_config = comfy.model_detection.detect_unet_config(sd, "")
    if unet_config.get("image_model") in ("flux", "flux2"):
        unet_config.update(hidden_size=sd["img_in.weight"].shape[0], num_heads=dims["heads"],
                           axes_dim=list(dims["axes_dim"]), context_in_dim=dims["context_in"])
        if "vec_in" in dims:
            unet_config["vec_in_dim"] = dims["vec_in"]
    elif unet_config.get("image_model") == "qwen_image":
        unet_config.update(attention_head_dim=dims["hidden"] // dims["heads"], num_attention_heads=dims["heads"],
                           joint_attention_dim=dims["context_in"], axes_dims_rope=tuple(dims["axes_dim"]))
    config = comfy.model_detection.model_config_from_unet_config(unet_config, sd)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model(sd, "")
    model.load_model_weights(sd, "")
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


# ---- a tiny LTX video VAE of ComfyUI's own class (VideoVAE at a tiny config, stated in a header as LTX files state
# theirs), for the LTX checks' LTXVAddGuide and decodes
TINY_LTX_VAE = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
                "latent_channels": 128, "patch_size": 4, "norm_layer": "pixel_norm", "latent_log_var": "uniform",
                "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False, "scaling_factor": 1.0,
                "encoder_base_channels": 8, "decoder_base_channels": 8,
                "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                                   ["compress_time_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}],
                                   ["compress_all_res", {"multiplier": 2}], ["res_x", {"num_layers": 1}]],
                "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                                   ["compress_all", {"residual": True, "multiplier": 2}],
                                   ["compress_all", {"residual": True, "multiplier": 2}],
                                   ["compress_all", {"residual": True, "multiplier": 2}],
                                   ["res_x", {"num_layers": 1, "inject_noise": False}]]}


def tiny_ltx_vae_state(seed=3) -> dict:
    """Random weights for TINY_LTX_VAE (VideoVAE's keys, its per-channel statistics 1 and 0)."""
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(t.shape, generator=g) * t[0].numel() ** -0.5 if t.ndim >= 2 else
                torch.ones(t.shape) if k.endswith("std-of-means") else torch.zeros(t.shape))
            for k, t in VideoVAE(config=TINY_LTX_VAE).state_dict().items()}
