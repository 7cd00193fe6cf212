"""The nodes a workflow in workflows/ may use, in one shape: ours from xdit_nodes/specs.py, ComfyUI's stock ones and
the frontend's own from tests/comfyui_stock_nodes.py, and the stock nodes the MiniMax-H3 workflows add (LATER_NODES
below, in the same shape). Inputs come in the order ComfyUI's frontend builds a node's sockets and widgets
(getOrderedInputSpecs: the required inputs in declaration order, then the optional ones), which is the order a UI
workflow saves them in."""
import importlib

import comfyui_stock_nodes as stock
from conftest import PACK_NAME, load_pack

WIDGET_TYPES = ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN")
NEWEST_FRONTEND = "1.49.6"
SEED_CONTROL = {"name": "control_after_generate", "values": ("fixed", "increment", "decrement", "randomize")}
_KINDS = {"COMBO": "combo", "INT": "number", "FLOAT": "number", "STRING": "text", "BOOLEAN": "toggle"}


# The stock nodes of ComfyUI's MiniMax-H3 templates (comfyui-workflow-templates-json 0.1.50: video_minimax_h3_t2v.json,
# video_minimax_h3_i2v.json) that tests/comfyui_stock_nodes.py lacks, as ComfyUI 0.33.0 defines them (its source and
# GET /object_info agree; comfyui_version.py "0.33.0"). The three older ones are the same in 0.3.64 (nodes.py,
# comfy_extras/nodes_custom_sampler.py and nodes_audio.py there, V1), whose display names they keep, as
# comfyui_stock_nodes.py does; the frontends' titles are in LATER_TITLES.
LATER_NODES = {
    # comfy_extras/nodes_hunyuan.py (0.3.71 on; 0.33.0), EmptyHunyuanVideo15Latent(EmptyHunyuanLatentVideo): the same
    # inputs (width default 848, height 480, both min 16 step 16; length default 25, min 1, step 4; batch_size 1 to
    # 4096), display name "Empty HunyuanVideo 1.5 Latent"; a LATENT of zeros [B, 32, (length - 1) // 4 + 1, H/16, W/16]
    "EmptyHunyuanVideo15Latent": {
        "display_name": "Empty HunyuanVideo 1.5 Latent",
        "source": "comfy_extras/nodes_hunyuan.py",
        "since": "0.3.71",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 848, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 480, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "length", "type": "INT", "widget": "number", "default": 25, "min": 1,
             "max": stock.MAX_RESOLUTION, "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # nodes.py, class EmptyLatentImage (the Krea 2 template's latent; the same in 0.3.64 and 0.33.0): "width" and
    # "height": ("INT", {"default": 512, "min": 16, "max": MAX_RESOLUTION, "step": 8}), "batch_size": ("INT",
    # {"default": 1, "min": 1, "max": 4096}); RETURN_TYPES = ("LATENT",); display name "Empty Latent Image"
    "EmptyLatentImage": {
        "display_name": "Empty Latent Image",
        "source": "nodes.py",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 512, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 8},
            {"name": "height", "type": "INT", "widget": "number", "default": 512, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 8},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # comfy_extras/nodes_hunyuan.py (0.3.71 on; 0.33.0), HunyuanVideo15ImageToVideo: no display name;
    # io.Conditioning.Input("positive"), io.Conditioning.Input("negative"), io.Vae.Input("vae"), io.Int.Input("width",
    # default=848, min=16, max=nodes.MAX_RESOLUTION, step=16), "height" (default 480) likewise, io.Int.Input("length",
    # default=33, min=1, step=4), io.Int.Input("batch_size", default=1, min=1, max=4096), io.Image.Input("start_image",
    # optional=True), io.ClipVisionOutput.Input("clip_vision_output", optional=True); outputs positive, negative, latent
    "HunyuanVideo15ImageToVideo": {
        "display_name": "HunyuanVideo15ImageToVideo",
        "source": "comfy_extras/nodes_hunyuan.py",
        "since": "0.3.71",
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "vae", "type": "VAE"},
            {"name": "width", "type": "INT", "widget": "number", "default": 848, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 480, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "length", "type": "INT", "widget": "number", "default": 33, "min": 1,
             "max": stock.MAX_RESOLUTION, "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
            {"name": "start_image", "type": "IMAGE", "optional": True},
            {"name": "clip_vision_output", "type": "CLIP_VISION_OUTPUT", "optional": True},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative"), ("LATENT", "latent")),
        "output_node": False,
    },
    # nodes.py, class CLIPVisionLoader: "clip_name": (folder_paths.get_filename_list("clip_vision"),);
    # RETURN_TYPES = ("CLIP_VISION",); display name "Load CLIP Vision" (the same in 0.3.64 and 0.33.0)
    "CLIPVisionLoader": {
        "display_name": "Load CLIP Vision",
        "source": "nodes.py",
        "inputs": ({"name": "clip_name", "type": "COMBO", "widget": "combo", "folder": "clip_vision"},),
        "outputs": (("CLIP_VISION", "CLIP_VISION"),),
        "output_node": False,
    },
    # nodes.py, class CLIPVisionEncode: "clip_vision": ("CLIP_VISION",), "image": ("IMAGE",), "crop": (["center",
    # "none"],); RETURN_TYPES = ("CLIP_VISION_OUTPUT",); display name "CLIP Vision Encode" (the same in 0.3.64)
    "CLIPVisionEncode": {
        "display_name": "CLIP Vision Encode",
        "source": "nodes.py",
        "inputs": (
            {"name": "clip_vision", "type": "CLIP_VISION"},
            {"name": "image", "type": "IMAGE"},
            {"name": "crop", "type": "COMBO", "widget": "combo", "options": ("center", "none")},
        ),
        "outputs": (("CLIP_VISION_OUTPUT", "CLIP_VISION_OUTPUT"),),
        "output_node": False,
    },
    # nodes.py, class LoraLoaderModelOnly(LoraLoader): "model": ("MODEL",), "lora_name":
    # (folder_paths.get_filename_list("loras"),), "strength_model": ("FLOAT", {"default": 1.0, "min": -100.0,
    # "max": 100.0, "step": 0.01}); RETURN_TYPES = ("MODEL",). Display name "Load LoRA" in 0.33.0 (none in 0.3.64)
    "LoraLoaderModelOnly": {
        "display_name": "LoraLoaderModelOnly",
        "source": "nodes.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "lora_name", "type": "COMBO", "widget": "combo", "folder": "loras"},
            {"name": "strength_model", "type": "FLOAT", "widget": "number", "default": 1.0, "min": -100.0,
             "max": 100.0, "step": 0.01},
        ),
        "outputs": (("MODEL", "MODEL"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, BasicScheduler (V3 in 0.33.0, no display_name): io.Model.Input("model"),
    # io.Combo.Input("scheduler", options=comfy.samplers.SCHEDULER_NAMES), io.Int.Input("steps", default=20, min=1,
    # max=10000), io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01); io.Sigmas.Output()
    "BasicScheduler": {
        "display_name": "BasicScheduler",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "scheduler", "type": "COMBO", "widget": "combo", "options": stock.SCHEDULER_NAMES},
            {"name": "steps", "type": "INT", "widget": "number", "default": 20, "min": 1, "max": 10000},
            {"name": "denoise", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 1.0,
             "step": 0.01},
        ),
        "outputs": (("SIGMAS", "SIGMAS"),),
        "output_node": False,
    },
    # comfy_extras/nodes_audio.py, VAEDecodeAudio: display_name "VAE Decode Audio"; IO.Latent.Input("samples"),
    # IO.Vae.Input("vae"); IO.Audio.Output() (0.33.0 decodes the last stream of a nested latent: H3's audio)
    "VAEDecodeAudio": {
        "display_name": "VAE Decode Audio",
        "source": "comfy_extras/nodes_audio.py",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "vae", "type": "VAE"},
        ),
        "outputs": (("AUDIO", "AUDIO"),),
        "output_node": False,
    },
    # comfy_extras/nodes_minimax_h3.py (0.33.0), MiniMaxH3ImageToVideo: display_name "MiniMax H3 Image to Video";
    # io.Clip.Input("clip"), io.Vae.Input("vae"), io.String.Input("prompt", multiline=True, dynamic_prompts=True),
    # io.Int.Input("width", default=1344, min=32, max=nodes.MAX_RESOLUTION, step=32), "height" (default 768)
    # likewise, io.Int.Input("length", default=124, min=5, max=3600, step=17), io.Image.Input("first_frame",
    # optional=True), io.Image.Input("last_frame", optional=True); io.Conditioning.Output(display_name="positive"),
    # io.Latent.Output() (the empty audio + video latent, its length snapped up to 17k + 5 frames at 24 fps; the
    # keyframes' latents in the conditioning)
    "MiniMaxH3ImageToVideo": {
        "display_name": "MiniMax H3 Image to Video",
        "source": "comfy_extras/nodes_minimax_h3.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "clip", "type": "CLIP"},
            {"name": "vae", "type": "VAE"},
            {"name": "prompt", "type": "STRING", "widget": "multiline"},
            {"name": "width", "type": "INT", "widget": "number", "default": 1344, "min": 32,
             "max": stock.MAX_RESOLUTION, "step": 32},
            {"name": "height", "type": "INT", "widget": "number", "default": 768, "min": 32,
             "max": stock.MAX_RESOLUTION, "step": 32},
            {"name": "length", "type": "INT", "widget": "number", "default": 124, "min": 5, "max": 3600, "step": 17},
            {"name": "first_frame", "type": "IMAGE", "optional": True},
            {"name": "last_frame", "type": "IMAGE", "optional": True},
        ),
        "outputs": (("CONDITIONING", "positive"), ("LATENT", "LATENT")),
        "output_node": False,
    },    # The stock nodes of ComfyUI's LTX-2.3 templates (0.33.0: blueprints/Text to Video (LTX-2.3).json and Image to
    # Video (LTX-2.3).json), as 0.33.0 defines them (GET /object_info of a 0.33.0 server; comfy_extras/nodes_lt.py,
    # nodes_lt_audio.py, nodes_lt_upsampler.py, nodes_hunyuan.py, nodes_custom_sampler.py; nodes.py VAEDecodeTiled and
    # ImageScale). Those without "since" have the same inputs and outputs in 0.3.64 (its object_info; 0.33.0 only marks
    # VAEDecodeTiled's tiling inputs advanced and names LTXVPreprocess). LTXVEmptyLatentAudio's frame_rate takes a
    # FLOAT or an INT socket ("FLOAT,INT", drawn as a FLOAT widget)
    "LTXAVTextEncoderLoader": {
        "display_name": "Load LTXV Audio Text Encoder",
        "source": "comfy_extras/nodes_lt_audio.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "text_encoder", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "ckpt_name", "type": "COMBO", "widget": "combo", "folder": "checkpoints"},
            {"name": "device", "type": "COMBO", "widget": "combo", "options": ("default", "cpu"), "advanced": True},
        ),
        "outputs": (("CLIP", "CLIP"),),
        "output_node": False,
    },
    "LTXVAudioVAELoader": {
        "display_name": "Load LTXV Audio VAE",
        "source": "comfy_extras/nodes_lt_audio.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "ckpt_name", "type": "COMBO", "widget": "combo", "folder": "checkpoints"},
        ),
        "outputs": (("VAE", "Audio VAE"),),
        "output_node": False,
    },
    "LatentUpscaleModelLoader": {
        "display_name": "Load Latent Upscale Model",
        "source": "comfy_extras/nodes_hunyuan.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "model_name", "type": "COMBO", "widget": "combo", "folder": "latent_upscale_models"},
        ),
        "outputs": (("LATENT_UPSCALE_MODEL", "LATENT_UPSCALE_MODEL"),),
        "output_node": False,
    },
    "LTXVConditioning": {
        "display_name": "LTXVConditioning",
        "source": "comfy_extras/nodes_lt.py",
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "frame_rate", "type": "FLOAT", "widget": "number", "default": 25.0, "min": 0.0,
             "max": 1000.0, "step": 0.01},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative")),
        "output_node": False,
    },
    "EmptyLTXVLatentVideo": {
        "display_name": "EmptyLTXVLatentVideo",
        "source": "comfy_extras/nodes_lt.py",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 768, "min": 64, "max": 16384, "step": 32},
            {"name": "height", "type": "INT", "widget": "number", "default": 512, "min": 64, "max": 16384,
             "step": 32},
            {"name": "length", "type": "INT", "widget": "number", "default": 97, "min": 1, "max": 16384, "step": 8},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    "LTXVEmptyLatentAudio": {
        "display_name": "LTXV Empty Latent Audio",
        "source": "comfy_extras/nodes_lt_audio.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "frames_number", "type": "INT", "widget": "number", "default": 97, "min": 1, "max": 1000,
             "step": 1},
            {"name": "frame_rate", "type": "FLOAT", "widget": "number", "default": 25.0, "min": 1.0,
             "max": 1000.0, "step": 0.01},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
            {"name": "audio_vae", "type": "VAE"},
        ),
        "outputs": (("LATENT", "Latent"),),
        "output_node": False,
    },
    "LTXVConcatAVLatent": {
        "display_name": "Concat AV Latent",
        "source": "comfy_extras/nodes_lt.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "video_latent", "type": "LATENT"},
            {"name": "audio_latent", "type": "LATENT"},
        ),
        "outputs": (("LATENT", "latent"),),
        "output_node": False,
    },
    "LTXVSeparateAVLatent": {
        "display_name": "Separate AV Latent",
        "source": "comfy_extras/nodes_lt.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "av_latent", "type": "LATENT"},
        ),
        "outputs": (("LATENT", "video_latent"), ("LATENT", "audio_latent")),
        "output_node": False,
    },
    "ManualSigmas": {
        "display_name": "ManualSigmas",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "sigmas", "type": "STRING", "widget": "text", "default": "1, 0.5"},
        ),
        "outputs": (("SIGMAS", "SIGMAS"),),
        "output_node": False,
    },
    "LTXVCropGuides": {
        "display_name": "LTXVCropGuides",
        "source": "comfy_extras/nodes_lt.py",
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "latent", "type": "LATENT"},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative"), ("LATENT", "latent")),
        "output_node": False,
    },
    "LTXVLatentUpsampler": {
        "display_name": "LTXVLatentUpsampler",
        "source": "comfy_extras/nodes_lt_upsampler.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "upscale_model", "type": "LATENT_UPSCALE_MODEL"},
            {"name": "vae", "type": "VAE"},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    "VAEDecodeTiled": {
        "display_name": "VAE Decode (Tiled)",
        "source": "nodes.py",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "vae", "type": "VAE"},
            {"name": "tile_size", "type": "INT", "widget": "number", "default": 512, "min": 64, "max": 4096,
             "step": 32, "advanced": True},
            {"name": "overlap", "type": "INT", "widget": "number", "default": 64, "min": 0, "max": 4096,
             "step": 32, "advanced": True},
            {"name": "temporal_size", "type": "INT", "widget": "number", "default": 64, "min": 8, "max": 4096,
             "step": 4, "advanced": True},
            {"name": "temporal_overlap", "type": "INT", "widget": "number", "default": 8, "min": 4,
             "max": 4096, "step": 4, "advanced": True},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    "LTXVAudioVAEDecode": {
        "display_name": "LTXV Audio VAE Decode",
        "source": "comfy_extras/nodes_lt_audio.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "audio_vae", "type": "VAE"},
        ),
        "outputs": (("AUDIO", "Audio"),),
        "output_node": False,
    },
    "LTXVImgToVideoInplace": {
        "display_name": "LTXVImgToVideoInplace",
        "source": "comfy_extras/nodes_lt.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "vae", "type": "VAE"},
            {"name": "image", "type": "IMAGE"},
            {"name": "latent", "type": "LATENT"},
            {"name": "strength", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 1.0},
            {"name": "bypass", "type": "BOOLEAN", "widget": "toggle", "default": False},
        ),
        "outputs": (("LATENT", "latent"),),
        "output_node": False,
    },
    # comfy_extras/nodes_lt.py, LTXVAddGuide (V3, no display_name; 0.3.64 has it with strength up to 1 and neither
    # optional input): positive, negative, vae, latent, image, io.Int.Input("frame_idx", default=0, min=-9999,
    # max=9999), io.Float.Input("strength", default=1.0, min=0.0, max=10.0, step=0.01), optional io.Mask.Input(
    # "attention_mask"), ICLoRAParameters.Input("iclora_parameters") (io.Custom("IC_LORA_PARAMETERS")); outputs
    # positive, negative, latent
    "LTXVAddGuide": {
        "display_name": "LTXVAddGuide",
        "source": "comfy_extras/nodes_lt.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "vae", "type": "VAE"},
            {"name": "latent", "type": "LATENT"},
            {"name": "image", "type": "IMAGE"},
            {"name": "frame_idx", "type": "INT", "widget": "number", "default": 0, "min": -9999, "max": 9999},
            {"name": "strength", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 10.0,
             "step": 0.01},
            {"name": "attention_mask", "type": "MASK", "optional": True},
            {"name": "iclora_parameters", "type": "IC_LORA_PARAMETERS", "optional": True},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative"), ("LATENT", "latent")),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, SamplerEulerAncestral (V3 in 0.33.0, V1 in 0.3.64 with the same inputs):
    # io.Float.Input("eta" / "s_noise", default=1.0, min=0.0, max=100.0, step=0.01, round=False, advanced=True);
    # io.Sampler.Output()
    "SamplerEulerAncestral": {
        "display_name": "SamplerEulerAncestral",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "eta", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 100.0,
             "step": 0.01, "advanced": True},
            {"name": "s_noise", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 100.0,
             "step": 0.01, "advanced": True},
        ),
        "outputs": (("SAMPLER", "SAMPLER"),),
        "output_node": False,
    },
    "LTXVPreprocess": {
        "display_name": "LTXV Preprocess",
        "source": "comfy_extras/nodes_lt.py",
        "inputs": (
            {"name": "image", "type": "IMAGE"},
            {"name": "img_compression", "type": "INT", "widget": "number", "default": 35, "min": 0, "max": 100},
        ),
        "outputs": (("IMAGE", "output_image"),),
        "output_node": False,
    },
    "ImageScale": {
        "display_name": "Upscale Image",
        "source": "nodes.py",
        "inputs": (
            {"name": "image", "type": "IMAGE"},
            {"name": "upscale_method", "type": "COMBO", "widget": "combo", "options": ("nearest-exact",
             "bilinear", "area", "bicubic", "lanczos")},
            {"name": "width", "type": "INT", "widget": "number", "default": 512, "min": 0, "max": 16384, "step": 1},
            {"name": "height", "type": "INT", "widget": "number", "default": 512, "min": 0, "max": 16384, "step": 1},
            {"name": "crop", "type": "COMBO", "widget": "combo", "options": ("disabled", "center")},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    # The one stock node ComfyUI's LTX-2.5 templates (comfyui-workflow-templates-json 0.1.50: video_ltx2_5_t2v.json,
    # video_ltx2_5_i2v.json, video_ltx2_5_flf2v.json) add to the LTX-2.3 ones', as 0.33.0 defines it
    # (comfy_extras/nodes_lt.py, LTXVDualCFGGuider, V3: display_name "LTXV Dual CFG Guider"; io.Model.Input("model"),
    # io.Conditioning.Input("positive"), io.Conditioning.Input("negative"), io.Float.Input("video_cfg", default=3.0,
    # min=0.0, max=100.0, step=0.1, round=0.01), io.Float.Input("audio_cfg", default=7.0, ...); io.Guider.Output();
    # first in 0.32.0, #15499). The frontend 1.49.6 has no locale entry for it: shown under its display name
    "LTXVDualCFGGuider": {
        "display_name": "LTXV Dual CFG Guider",
        "source": "comfy_extras/nodes_lt.py",
        "since": "0.33.0",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "video_cfg", "type": "FLOAT", "widget": "number", "default": 3.0, "min": 0.0, "max": 100.0,
             "step": 0.1},
            {"name": "audio_cfg", "type": "FLOAT", "widget": "number", "default": 7.0, "min": 0.0, "max": 100.0,
             "step": 0.1},
        ),
        "outputs": (("GUIDER", "GUIDER"),),
        "output_node": False,
    },
    # The stock nodes of ComfyUI's "Wan Animate 2 Distilled: Motion Transfer" template (comfyui-workflow-templates-json
    # 0.1.50 and 0.1.123: video_wan_animate2_distilled.json, its subgraph flattened) that the tables above lack, as
    # ComfyUI 0.33.0 defines them (comfy_extras/nodes_wan.py, nodes_video.py, nodes_images.py,
    # nodes_post_processing.py, nodes_custom_sampler.py). Those without "since" are in 0.3.64 with the same inputs and
    # outputs (its nodes_video.py, nodes_images.py, nodes_wan.py, nodes_custom_sampler.py; V1 there, their display
    # names kept: the frontends' titles are in LATER_TITLES), but for the outputs 0.33.0 adds (LATER_NODE_OUTPUTS) and
    # ImageFromBatch's batch_index, which 0.3.64 takes from 0 to 4095.
    # comfy_extras/nodes_wan.py (0.33.0), WanAnimate2ToVideo (first released in 0.31.0, a464ac33; is_experimental, no
    # display_name): io.Conditioning.Input("positive"), ("negative"), io.Vae.Input("vae"), io.Int.Input("width",
    # default=832, min=16, max=nodes.MAX_RESOLUTION, step=16), "height" (default 480) likewise, io.Int.Input("length",
    # default=81, min=1, max=nodes.MAX_RESOLUTION, step=4), io.Int.Input("batch_size", default=1, min=1, max=4096);
    # optional io.Image.Input("reference_image"), io.Image.Input("pose_video"),
    # io.ClipVisionOutput.Input("clip_vision_output"), io.Conditioning.Input("positive_pose"),
    # io.ClipVisionOutput.Input("clip_vision_output_pose"), io.Image.Input("continue_motion"); then
    # io.Int.Input("video_frame_offset", default=0, min=0, max=nodes.MAX_RESOLUTION, step=1),
    # io.Float.Input("pose_strength", default=1.0, min=0.0, max=10.0, step=0.01), "pose_start_percent" (0.0, 0 to 1),
    # "pose_end_percent" (1.0, 0 to 1), "reference_image_strength" (1.0, 0 to 10), all required; outputs positive,
    # negative, latent, io.Int.Output "trim_latent", "trim_image", "video_frame_offset". The frontend 1.49.6 has no
    # locale entry for it: shown under its node id
    "WanAnimate2ToVideo": {
        "display_name": "WanAnimate2ToVideo",
        "source": "comfy_extras/nodes_wan.py",
        "since": "0.31.0",
        "experimental": True,
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "vae", "type": "VAE"},
            {"name": "width", "type": "INT", "widget": "number", "default": 832, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 480, "min": 16,
             "max": stock.MAX_RESOLUTION, "step": 16},
            {"name": "length", "type": "INT", "widget": "number", "default": 81, "min": 1,
             "max": stock.MAX_RESOLUTION, "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
            {"name": "reference_image", "type": "IMAGE", "optional": True},
            {"name": "pose_video", "type": "IMAGE", "optional": True},
            {"name": "clip_vision_output", "type": "CLIP_VISION_OUTPUT", "optional": True},
            {"name": "positive_pose", "type": "CONDITIONING", "optional": True},
            {"name": "clip_vision_output_pose", "type": "CLIP_VISION_OUTPUT", "optional": True},
            {"name": "continue_motion", "type": "IMAGE", "optional": True},
            {"name": "video_frame_offset", "type": "INT", "widget": "number", "default": 0, "min": 0,
             "max": stock.MAX_RESOLUTION, "step": 1},
            {"name": "pose_strength", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 10.0,
             "step": 0.01},
            {"name": "pose_start_percent", "type": "FLOAT", "widget": "number", "default": 0.0, "min": 0.0,
             "max": 1.0, "step": 0.01},
            {"name": "pose_end_percent", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0,
             "max": 1.0, "step": 0.01},
            {"name": "reference_image_strength", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0,
             "max": 10.0, "step": 0.01},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative"), ("LATENT", "latent"),
                    ("INT", "trim_latent"), ("INT", "trim_image"), ("INT", "video_frame_offset")),
        "output_node": False,
    },
    # comfy_extras/nodes_video.py, LoadVideo: display_name "Load Video"; io.Combo.Input("file", options=the video files
    # of ComfyUI's input folder, upload=io.UploadType.video); io.Video.Output(). The frontend adds the upload button
    # after it (saved as "image", as the template saves it) and shows the video below
    "LoadVideo": {
        "display_name": "Load Video",
        "source": "comfy_extras/nodes_video.py",
        "image_preview": True,
        "inputs": (
            {"name": "file", "type": "COMBO", "widget": "combo", "folder": "input", "image_upload": True,
             "ui_extra": {"name": "upload", "value": "image"}},
        ),
        "outputs": (("VIDEO", "VIDEO"),),
        "output_node": False,
    },
    # comfy_extras/nodes_video.py, GetVideoComponents: display_name "Get Video Components"; io.Video.Input("video");
    # io.Image.Output "images", io.Audio.Output "audio", io.Float.Output "fps" (0.3.64's three; 0.33.0 adds
    # io.Int.Output "bit_depth" and io.Combo.Output "color_space": LATER_NODE_OUTPUTS)
    "GetVideoComponents": {
        "display_name": "Get Video Components",
        "source": "comfy_extras/nodes_video.py",
        "inputs": ({"name": "video", "type": "VIDEO"},),
        "outputs": (("IMAGE", "images"), ("AUDIO", "audio"), ("FLOAT", "fps")),
        "output_node": False,
    },
    # comfy_extras/nodes_images.py, GetImageSize (V1 in 0.3.64, RETURN_NAMES = ("width", "height", "batch_size"); V3 in
    # 0.33.0): display name "Get Image Size"; IO.Image.Input("image"); three IO.Int.Output
    "GetImageSize": {
        "display_name": "Get Image Size",
        "source": "comfy_extras/nodes_images.py",
        "inputs": ({"name": "image", "type": "IMAGE"},),
        "outputs": (("INT", "width"), ("INT", "height"), ("INT", "batch_size")),
        "output_node": False,
    },
    # comfy_extras/nodes_images.py, ImageFromBatch (V3 in 0.33.0, display_name "Get Image from Batch"; V1 in 0.3.64
    # without one, batch_index from 0 to 4095): IO.Image.Input("image"), IO.Int.Input("batch_index", default=0,
    # min=-MAX_RESOLUTION, max=MAX_RESOLUTION), IO.Int.Input("length", default=1, min=1, max=4096); IO.Image.Output()
    "ImageFromBatch": {
        "display_name": "ImageFromBatch",
        "source": "comfy_extras/nodes_images.py",
        "inputs": (
            {"name": "image", "type": "IMAGE"},
            {"name": "batch_index", "type": "INT", "widget": "number", "default": 0, "min": -stock.MAX_RESOLUTION,
             "max": stock.MAX_RESOLUTION},
            {"name": "length", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    # comfy_extras/nodes_post_processing.py (0.33.0), ResizeImageMaskNode: display_name "Resize Image/Mask";
    # io.MatchType.Input("input", template IMAGE or MASK), io.DynamicCombo.Input("resize_type", options "scale
    # dimensions" (io.Int.Input("width", default=512, min=0, max=MAX_RESOLUTION, step=1), "height" likewise,
    # io.Combo.Input("crop", ["disabled", "center"], default "center")), "scale by", "scale longer dimension", "scale
    # shorter dimension", "scale width", "scale height", "scale total pixels", "match size", "scale to multiple"),
    # io.Combo.Input("scale_method", ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"], default "area");
    # io.MatchType.Output "resized". The frontend (1.49.6) draws the chosen option's inputs as widgets after
    # resize_type, named "resize_type.width" and so on (as the template saves them, and as the API prompt names
    # them); it shows the input as "IMAGE,MASK" and the output as the type its input gets (IMAGE here). Not in
    # 0.3.64; in ComfyUI by January 2026 (Comfy-Org/ComfyUI#12013 edits it), so in 0.31.0 (later: WanAnimate2ToVideo's
    # release) at the latest: "since" names that bound, its first release is not checked. Only "scale dimensions" is
    # spelled out here, the option the template uses
    "ResizeImageMaskNode": {
        "display_name": "Resize Image/Mask",
        "source": "comfy_extras/nodes_post_processing.py",
        "since": "0.31.0",
        "inputs": (
            {"name": "input", "type": "IMAGE,MASK"},
            {"name": "resize_type", "type": "COMBO", "widget": "combo",
             "options": ("scale dimensions", "scale by", "scale longer dimension", "scale shorter dimension",
                         "scale width", "scale height", "scale total pixels", "match size", "scale to multiple")},
            {"name": "resize_type.width", "type": "INT", "widget": "number", "default": 512, "min": 0,
             "max": stock.MAX_RESOLUTION, "step": 1},
            {"name": "resize_type.height", "type": "INT", "widget": "number", "default": 512, "min": 0,
             "max": stock.MAX_RESOLUTION, "step": 1},
            {"name": "resize_type.crop", "type": "COMBO", "widget": "combo", "options": ("disabled", "center")},
            {"name": "scale_method", "type": "COMBO", "widget": "combo",
             "options": ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")},
        ),
        "outputs": (("IMAGE", "resized"),),
        "output_node": False,
    },
    # comfy_extras/nodes_wan.py, TrimVideoLatent (V3, no display_name in 0.3.64; "Trim Video Latent" in 0.33.0):
    # io.Latent.Input("samples"), io.Int.Input("trim_amount", default=0, min=0, max=99999); io.Latent.Output() (the
    # samples without their first trim_amount latent frames)
    "TrimVideoLatent": {
        "display_name": "TrimVideoLatent",
        "source": "comfy_extras/nodes_wan.py",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "trim_amount", "type": "INT", "widget": "number", "default": 0, "min": 0, "max": 99999},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, SamplerCustom (V1 in 0.3.64, V3 in 0.33.0, no display name; 0.33.0 marks
    # add_noise advanced): "model": ("MODEL",), "add_noise": ("BOOLEAN", {"default": True}), "noise_seed": ("INT",
    # {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True}), "cfg": ("FLOAT",
    # {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}), "positive", "negative":
    # ("CONDITIONING",), "sampler": ("SAMPLER",), "sigmas": ("SIGMAS",), "latent_image": ("LATENT",);
    # RETURN_NAMES = ("output", "denoised_output")
    "SamplerCustom": {
        "display_name": "SamplerCustom",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "add_noise", "type": "BOOLEAN", "widget": "toggle", "default": True, "advanced": True},
            {"name": "noise_seed", "type": "INT", "widget": "number", "default": 0, "min": 0,
             "max": 0xffffffffffffffff,
             "ui_extra": {"name": "control_after_generate", "values": ("fixed", "increment", "decrement",
                                                                       "randomize")}},
            {"name": "cfg", "type": "FLOAT", "widget": "number", "default": 8.0, "min": 0.0, "max": 100.0,
             "step": 0.1},
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "sampler", "type": "SAMPLER"},
            {"name": "sigmas", "type": "SIGMAS"},
            {"name": "latent_image", "type": "LATENT"},
        ),
        "outputs": (("LATENT", "output"), ("LATENT", "denoised_output")),
        "output_node": False,
    },
}
# Outputs 0.33.0 adds to a node above (not saved, as LATER_OUTPUTS; they count only for the node's drawn size):
# comfy_extras/nodes_video.py, GetVideoComponents: io.Int.Output "bit_depth", io.Combo.Output "color_space"
LATER_NODE_OUTPUTS = {"GetVideoComponents": (("INT", "bit_depth"), ("COMBO", "color_space"))}
# nodes.py (0.33.0), CLIPLoader's type list: comfyui_stock_nodes.py's (v0.12.1) and the types added since, "minimax"
# (MiniMax-H3's Qwen3-VL text encoder) among them; the rest of the node as there
CLIP_TYPES_0_33 = ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
                   "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2",
                   "ovis", "longcat_image", "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2",
                   "joyimage", "mage", "minimax")
# nodes.py (0.33.0), DualCLIPLoader's type list: comfyui_stock_nodes.py's and the types added since,
# "hunyuan_video_15" (HunyuanVideo 1.5's Qwen2.5-VL and byT5) among them; the rest of the node as there
DUAL_CLIP_TYPES_0_33 = ("sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image", "hunyuan_video_15",
                        "kandinsky5", "kandinsky5_image", "ltxv", "newbie", "ace")
# The frontends' titles for them where they differ from the display name (each one's en locale, nodeDefs: 1.27.10
# names BasicScheduler and LoraLoaderModelOnly so and VAEDecodeAudio "VAE Decode Audio"; 1.49.6 names
# LoraLoaderModelOnly "Load LoRA" and has no entry for MiniMaxH3ImageToVideo, shown under 0.33.0's display name; it
# names LTXVConcatAVLatent and LTXVSeparateAVLatent by their node ids, where 0.33.0 says "Concat AV Latent" and
# "Separate AV Latent"; it names ImageFromBatch and TrimVideoLatent as 0.33.0 does, where 0.3.64 gives no display
# name, and has no entry for WanAnimate2ToVideo)
LATER_TITLES = {"1.27.10": {}, "1.49.6": {"LoraLoaderModelOnly": "Load LoRA", "LTXVConcatAVLatent": "LTXVConcatAVLatent",
                                          "LTXVSeparateAVLatent": "LTXVSeparateAVLatent",
                                          "ImageFromBatch": "Get Image from Batch",
                                          "TrimVideoLatent": "Trim Video Latent"}}


def _clip_loader(d):
    """CLIPLoader offering 0.33.0's type list (a superset of comfyui_stock_nodes.py's)."""
    types = next(i for i in d["inputs"] if i["name"] == "type")
    assert set(types["options"]) <= set(CLIP_TYPES_0_33)
    return dict(d, inputs=tuple(dict(i, options=CLIP_TYPES_0_33) if i is types else i for i in d["inputs"]))


def _dual_clip_loader(d):
    """DualCLIPLoader offering 0.33.0's type list (a superset of comfyui_stock_nodes.py's)."""
    types = next(i for i in d["inputs"] if i["name"] == "type")
    assert set(types["options"]) <= set(DUAL_CLIP_TYPES_0_33)
    return dict(d, inputs=tuple(dict(i, options=DUAL_CLIP_TYPES_0_33) if i is types else i for i in d["inputs"]))


def _frontend_titles(version) -> dict:
    """{node type: title} a frontend version shows where it differs from the display name."""
    return {**stock.FRONTEND_TITLES.get(version, {}), **LATER_TITLES.get(version, {})}


def specs_module():
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.specs")


def _frontend_order(inputs):
    return tuple(i for i in inputs if not i.get("optional")) + tuple(i for i in inputs if i.get("optional"))


def _from_spec(spec):
    inputs = []
    for f in spec.inputs:
        entry = {"name": f.name, "type": f.type, "optional": f.optional}
        if f.type in WIDGET_TYPES:
            entry.update(widget=_KINDS[f.type], options=tuple(f.options), min=f.min, max=f.max, step=f.step)
            if f.control_after_generate:
                entry["ui_extra"] = SEED_CONTROL
        inputs.append(entry)
    return {"display_name": spec.display_name, "inputs": _frontend_order(inputs),
            "outputs": tuple((t, n) for t, n in spec.outputs), "output_node": spec.output_node, "ours": True}


def definitions(model_names) -> dict:
    """Node type -> definition. The engine's model_name options are ComfyUI's model folders at run time: here they
    are `model_names`, the files the workflows name. The samplers offer ComfyUI's sampler and scheduler lists, as
    they do inside ComfyUI."""
    specs = specs_module()
    lists = (stock.SAMPLER_NAMES, stock.SCHEDULER_NAMES)
    ours = [specs.engine_spec(sorted(set(model_names))), specs.checkpoint_spec(sorted(set(model_names))),
            specs.sampler_spec(*lists),
            specs.sampler_advanced_spec(*lists), specs.INFO_SPEC, specs.GUIDER_SPEC, specs.SAMPLING_SPEC,
            specs.CFG_NORM_SPEC]
    defs = {spec.node_id: _from_spec(spec) for spec in ours}
    # the xDiT VAE Loader offers ComfyUI's VAE folder, as Load VAE does (VAELoader.vae_list at run time)
    vae_loader = _from_spec(specs.vae_loader_spec([]))
    vae_loader["inputs"] = tuple(dict({k: v for k, v in i.items() if k != "options"}, folder="vae")
                                 if i["name"] == "vae_name" else i for i in vae_loader["inputs"])
    defs["XDiTVAELoader"] = vae_loader
    stock_nodes = dict(stock.STOCK_NODES, CLIPLoader=_clip_loader(stock.STOCK_NODES["CLIPLoader"]),
                       DualCLIPLoader=_dual_clip_loader(stock.STOCK_NODES["DualCLIPLoader"]))
    assert not set(LATER_NODES) & set(stock_nodes)
    stock_nodes.update(LATER_NODES)
    assert not set(defs) & set(stock_nodes) and not set(defs) & set(stock.FRONTEND_NODES)
    for node_type, d in list(stock_nodes.items()) + list(stock.FRONTEND_NODES.items()):
        defs[node_type] = dict(d, inputs=_frontend_order(d["inputs"]), ours=False)
    return defs


def sockets(definition):
    return [i for i in definition["inputs"] if "widget" not in i]


def widgets(definition):
    return [i for i in definition["inputs"] if "widget" in i]


def titles(node_type, definition) -> set:
    """Every title a frontend shows for a node of this type that has no title of its own."""
    versions = set(stock.FRONTEND_TITLES) | set(LATER_TITLES)
    return {definition["display_name"]} | {t[node_type] for t in map(_frontend_titles, versions) if node_type in t}


def current_title(node_type, definition) -> str:
    """The title the newest frontend checked shows for a node of this type that has no title of its own (and puts in
    the API prompt's _meta)."""
    return _frontend_titles(NEWEST_FRONTEND).get(node_type, definition["display_name"])


def drawn_outputs(node_type, definition):
    """The outputs a node shows on the newest ComfyUI checked (a later version may have added some)."""
    return tuple(definition["outputs"]) + stock.LATER_OUTPUTS.get(node_type, ()) + LATER_NODE_OUTPUTS.get(node_type, ())
