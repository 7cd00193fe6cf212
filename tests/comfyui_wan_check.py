"""Run inside a ComfyUI checkout's Python (argv: ComfyUI path, the pack's root, a folder of tiny Wan files): ComfyUI's
own model_detection, supported_models and model_base (extra_conds: c_concat from the CONDITIONING keys, clip_fea,
denoise_mask; _apply_model: process_timestep, the concatenation) around ComfyUI's own WanModel, built from each tiny
file, against the engine's FlowModel on the same inputs. Prints one JSON line per file:
{"variant", "comfy_class", "unet", "max_abs_diff", "scale"}.

The engine side builds its inputs as the xDiT nodes pass ComfyUI's CONDITIONING to it (Conditioning's image_context,
concat_latent, concat_mask; the noise mask through prepare)."""
import json
import os
import sys

comfy_path, pack_root, folder = sys.argv[1:4]
sys.path.insert(0, comfy_path)
sys.path.insert(1, pack_root)
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options   # noqa: E402

comfy.options.enable_args_parsing()
import torch   # noqa: E402
from safetensors.torch import load_file   # noqa: E402

import comfy.clip_vision   # noqa: E402
import comfy.model_detection   # noqa: E402
from engine.models.flow import Conditioning, FlowModel   # noqa: E402
from engine.models.load import load_model   # noqa: E402

torch.manual_seed(0)
for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    sd = load_file(path)
    config = comfy.model_detection.model_config_from_unet(sd, "")
    model = config.get_model(sd, "")
    model.load_model_weights(dict(sd), "")
    model = model.float().eval()
    flow = FlowModel(load_model(path))
    info = flow.loaded.info
    g = torch.Generator().manual_seed(1)
    channels = info.latent.channels
    frames, h, w = 3, 7, 9   # odd: padded to whole patches
    x = torch.randn(2, channels, frames, h, w, generator=g)
    sigma = torch.tensor([0.7, 0.7])
    cond = torch.randn(1, 11, info.config["text_dim"], generator=g)
    kwargs = {"noise": x, "device": torch.device("cpu"), "cross_attn": cond}
    side = Conditioning(cond)
    if info.config.get("image_dim"):
        clip = comfy.clip_vision.Output()
        clip.penultimate_hidden_states = torch.randn(1, 257 * (2 if info.config.get("pos_embed_seq_len") else 1),
                                                     1280, generator=g)
        kwargs["clip_vision_output"] = clip
        side.image_context = clip.penultimate_hidden_states
    mask = None
    if info.config["in_channels"] == 36:
        image = torch.randn(1, 16, frames, h, w, generator=g)
        concat_mask = torch.ones(1, 4 if info.config.get("pos_embed_seq_len") else 1, frames, h, w)
        concat_mask[:, :, 0] = 0.0
        kwargs.update(concat_latent_image=image, concat_mask=concat_mask)
        side.concat_latent, side.concat_mask = image, concat_mask
    if info.config["out_channels"] == 48:   # Wan22ImageToVideoLatent's noise mask: the first frame kept
        mask = torch.ones(2, channels, frames, h, w)
        mask[:, :, 0] = 0.0
        kwargs["denoise_mask"] = mask
    conds = model.extra_conds(**kwargs)
    with torch.no_grad():
        denoised = model.apply_model(x, sigma, **{k: c.process_cond(batch_size=2, area=None).cond
                                                  for k, c in conds.items()})
        v = flow.velocity(x, sigma[0], flow.prepare([side], 2, denoise_mask=mask))
    engine_denoised = x - v * sigma.view(-1, 1, 1, 1, 1)
    print(json.dumps({"variant": info.variant, "comfy_class": type(config).__name__,
                      "unet": {k: config.unet_config.get(k) for k in ("model_type", "in_dim", "out_dim", "dim",
                                                                       "num_heads", "num_layers")},
                      "max_abs_diff": float((engine_denoised - denoised).abs().max()),
                      "scale": float(denoised.abs().max())}), flush=True)
