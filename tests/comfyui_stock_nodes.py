"""The stock ComfyUI nodes that the example workflows in workflows/ use, as ComfyUI defines them.

Source: ComfyUI 0.3.64 (the oldest version pyproject.toml's requires-comfyui accepts), repository
Comfy-Org/ComfyUI (formerly comfyanonymous/ComfyUI), commit a125cd84b054a57729b5eecab930ca9408719832
(comfyui_version.py: __version__ = "0.3.64"):
- nodes.py: CLIPTextEncode, DualCLIPLoader, VAELoader, VAEDecode, VAEEncode, SaveImage, LoadImage
  (INPUT_TYPES, RETURN_TYPES, OUTPUT_NODE, NODE_DISPLAY_NAME_MAPPINGS; MAX_RESOLUTION = 16384);
- comfy_extras/nodes_flux.py: FluxGuidance, FluxKontextImageScale (V3 io.Schema);
- comfy_extras/nodes_edit_model.py: ReferenceLatent (V3 io.Schema);
- comfy_extras/nodes_sd3.py: TripleCLIPLoader, EmptySD3LatentImage (V3 io.Schema);
- nodes.py CLIPLoader; comfy_extras/nodes_qwen.py TextEncodeQwenImageEdit; comfy_extras/nodes_post_processing.py
  ImageScaleToTotalPixels (V3 io.Schema): what the Qwen-Image templates (comfyui-workflow-templates 0.1.95, the
  version 0.3.64 pins: image_qwen_image.json, image_qwen_image_edit.json) use.
The FLUX.2 workflows' nodes come from a later ComfyUI, the first with FLUX.2 being 0.3.72 (commit 6b573ae0, "Flux 2"):
- nodes.py: CLIPLoader's type list as of v0.12.1 (fe2511468d6b3f7a1581a711ae480f3313f2b39d): 0.3.64's list plus
  "flux2" (Mistral-3 24B for [dev] and, from 0.9.2 on, Qwen3 4B / 8B for [klein]) and "ovis" (0.3.72's lacks it);
- comfy_extras/nodes_flux.py: EmptyFlux2LatentImage (V3 io.Schema, the same in 0.3.72 and 0.12.1).
A V3 node without display_name is shown under its node_id; a V3 output without display_name is named after its
type (comfy_api/latest/_io.py, get_v1_info: `o.display_name if o.display_name else o.io_type`). A V1 node without
RETURN_NAMES names its outputs after their types.

The UI-format facts (what the frontend saves in widgets_values) come from ComfyUI's saved example workflows
(comfyanonymous/ComfyUI_examples, e.g. flux/flux_dev_OptimalSteps.json and img2img/img2img_workflow.json):
- widgets_values lists every widget in input order, optional ones included: DualCLIPLoader saves
  ["t5xxl_fp16.safetensors", "clip_l.safetensors", "flux", "default"] (its 4th widget is the optional device);
- an INT with control_after_generate (KSampler's seed) saves one more value after it: "fixed", "randomize", ...;
- a COMBO with image_upload (LoadImage's image) gets an "upload" button widget after it, saved as "image";
- node "inputs" lists the sockets only (widget inputs appear there only when converted to sockets).
In the API format (POST /prompt, ComfyUI's script_examples/basic_api_example.py) every input is keyed by name:
widget values as values, links as [source node id (string), source output slot]; the UI-only values
(control_after_generate's mode, the upload button) have no entry.

This module is data only. Each input is a dict:
  name, type: the input's name and type as ComfyUI declares it (a socket type such as "CLIP", or a widget type:
              "COMBO", "INT", "FLOAT", "STRING", "BOOLEAN");
  widget:     for widget inputs, the kind of widget the frontend shows:
                "combo"     a drop-down; "options" lists fixed options, or "folder" names the model/input folder
                            ComfyUI lists the options from at run time;
                "number"    INT/FLOAT with "default", "min", "max", "step";
                "text"      a single-line STRING; "multiline" a multi-line STRING (with "dynamicPrompts");
  optional:   True for inputs declared under "optional" (they still get a widget and a widgets_values entry);
  advanced:   True for inputs ComfyUI marks advanced;
  ui_extra:   a UI-only widget the frontend adds right after this one, saved in widgets_values only.
Outputs are (type, name) pairs in slot order.
"""

COMFYUI_VERSION = "0.3.64"
COMFYUI_COMMIT = "a125cd84b054a57729b5eecab930ca9408719832"
MAX_RESOLUTION = 16384  # nodes.py

STOCK_NODES = {
    # nodes.py, class CLIPTextEncode: "text": (IO.STRING, {"multiline": True, "dynamicPrompts": True}),
    # "clip": (IO.CLIP,); RETURN_TYPES = (IO.CONDITIONING,)
    "CLIPTextEncode": {
        "display_name": "CLIP Text Encode (Prompt)",
        "source": "nodes.py",
        "inputs": (
            {"name": "text", "type": "STRING", "widget": "multiline"},
            {"name": "clip", "type": "CLIP"},
        ),
        "outputs": (("CONDITIONING", "CONDITIONING"),),
        "output_node": False,
    },
    # nodes.py, class DualCLIPLoader: required clip_name1, clip_name2 (text_encoders list),
    # type (["sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image"]);
    # optional device (["default", "cpu"], {"advanced": True}); RETURN_TYPES = ("CLIP",); no display-name mapping
    "DualCLIPLoader": {
        "display_name": "DualCLIPLoader",
        "source": "nodes.py",
        "inputs": (
            {"name": "clip_name1", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "clip_name2", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "type", "type": "COMBO", "widget": "combo",
             "options": ("sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image")},
            {"name": "device", "type": "COMBO", "widget": "combo", "options": ("default", "cpu"),
             "optional": True, "advanced": True},
        ),
        "outputs": (("CLIP", "CLIP"),),
        "output_node": False,
    },
    # nodes.py (v0.12.1), class CLIPLoader: required clip_name (text_encoders list), type (the list below; 0.3.64's
    # ends at "hunyuan_image", without "flux2" and "ovis"); optional device (["default", "cpu"], {"advanced": True});
    # RETURN_TYPES = ("CLIP",); display name "Load CLIP"
    "CLIPLoader": {
        "display_name": "Load CLIP",
        "source": "nodes.py",
        "inputs": (
            {"name": "clip_name", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "type", "type": "COMBO", "widget": "combo",
             "options": ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart",
                         "cosmos", "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image",
                         "hunyuan_image", "flux2", "ovis")},
            {"name": "device", "type": "COMBO", "widget": "combo", "options": ("default", "cpu"),
             "optional": True, "advanced": True},
        ),
        "outputs": (("CLIP", "CLIP"),),
        "output_node": False,
    },
    # comfy_extras/nodes_flux.py (0.3.72 on), EmptyFlux2LatentImage: display_name "Empty Flux 2 Latent";
    # io.Int.Input("width", default=1024, min=16, max=nodes.MAX_RESOLUTION, step=16), height likewise,
    # io.Int.Input("batch_size", default=1, min=1, max=4096); io.Latent.Output() (zeros [B, 128, H/16, W/16])
    "EmptyFlux2LatentImage": {
        "display_name": "Empty Flux 2 Latent",
        "source": "comfy_extras/nodes_flux.py",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 1024, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 1024, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # comfy_extras/nodes_sd3.py, TripleCLIPLoader: io.Combo.Input clip_name1, clip_name2, clip_name3
    # (text_encoders list); io.Clip.Output()
    "TripleCLIPLoader": {
        "display_name": "TripleCLIPLoader",
        "source": "comfy_extras/nodes_sd3.py",
        "inputs": (
            {"name": "clip_name1", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "clip_name2", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
            {"name": "clip_name3", "type": "COMBO", "widget": "combo", "folder": "text_encoders"},
        ),
        "outputs": (("CLIP", "CLIP"),),
        "output_node": False,
    },
    # comfy_extras/nodes_qwen.py, TextEncodeQwenImageEdit: io.Clip.Input("clip"), io.String.Input("prompt",
    # multiline=True, dynamic_prompts=True), io.Vae.Input("vae", optional=True), io.Image.Input("image",
    # optional=True); io.Conditioning.Output() (the image to the VL encoder and, VAE-encoded, to reference_latents)
    "TextEncodeQwenImageEdit": {
        "display_name": "TextEncodeQwenImageEdit",
        "source": "comfy_extras/nodes_qwen.py",
        "inputs": (
            {"name": "clip", "type": "CLIP"},
            {"name": "prompt", "type": "STRING", "widget": "multiline"},
            {"name": "vae", "type": "VAE", "optional": True},
            {"name": "image", "type": "IMAGE", "optional": True},
        ),
        "outputs": (("CONDITIONING", "CONDITIONING"),),
        "output_node": False,
    },
    # comfy_extras/nodes_post_processing.py, ImageScaleToTotalPixels: io.Image.Input("image"),
    # io.Combo.Input("upscale_method", options=["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]),
    # io.Float.Input("megapixels", default=1.0, min=0.01, max=16.0, step=0.01); io.Image.Output()
    "ImageScaleToTotalPixels": {
        "display_name": "ImageScaleToTotalPixels",
        "source": "comfy_extras/nodes_post_processing.py",
        "inputs": (
            {"name": "image", "type": "IMAGE"},
            {"name": "upscale_method", "type": "COMBO", "widget": "combo",
             "options": ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")},
            {"name": "megapixels", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.01, "max": 16.0,
             "step": 0.01},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    # comfy_extras/nodes_flux.py, FluxGuidance: io.Conditioning.Input("conditioning"),
    # io.Float.Input("guidance", default=3.5, min=0.0, max=100.0, step=0.1); io.Conditioning.Output()
    "FluxGuidance": {
        "display_name": "FluxGuidance",
        "source": "comfy_extras/nodes_flux.py",
        "inputs": (
            {"name": "conditioning", "type": "CONDITIONING"},
            {"name": "guidance", "type": "FLOAT", "widget": "number", "default": 3.5, "min": 0.0, "max": 100.0,
             "step": 0.1},
        ),
        "outputs": (("CONDITIONING", "CONDITIONING"),),
        "output_node": False,
    },
    # comfy_extras/nodes_flux.py, FluxKontextImageScale: io.Image.Input("image"); io.Image.Output() (resizes to the
    # PREFERED_KONTEXT_RESOLUTIONS entry nearest the image's aspect ratio)
    "FluxKontextImageScale": {
        "display_name": "FluxKontextImageScale",
        "source": "comfy_extras/nodes_flux.py",
        "inputs": (
            {"name": "image", "type": "IMAGE"},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    # comfy_extras/nodes_edit_model.py, ReferenceLatent: io.Conditioning.Input("conditioning"),
    # io.Latent.Input("latent", optional=True); io.Conditioning.Output() (appends latent["samples"] to the
    # conditioning's "reference_latents")
    "ReferenceLatent": {
        "display_name": "ReferenceLatent",
        "source": "comfy_extras/nodes_edit_model.py",
        "inputs": (
            {"name": "conditioning", "type": "CONDITIONING"},
            {"name": "latent", "type": "LATENT", "optional": True},
        ),
        "outputs": (("CONDITIONING", "CONDITIONING"),),
        "output_node": False,
    },
    # comfy_extras/nodes_sd3.py, EmptySD3LatentImage: io.Int.Input("width", default=1024, min=16,
    # max=nodes.MAX_RESOLUTION, step=16), height likewise, io.Int.Input("batch_size", default=1, min=1, max=4096);
    # io.Latent.Output()
    "EmptySD3LatentImage": {
        "display_name": "EmptySD3LatentImage",
        "source": "comfy_extras/nodes_sd3.py",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 1024, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 1024, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # nodes.py, class VAELoader: "vae_name": (s.vae_list(),) - the vae folder plus taesd, taesdxl, taesd3, taef1
    # when their approx files exist, plus "pixel_space"; RETURN_TYPES = ("VAE",)
    "VAELoader": {
        "display_name": "Load VAE",
        "source": "nodes.py",
        "inputs": (
            {"name": "vae_name", "type": "COMBO", "widget": "combo", "folder": "vae"},
        ),
        "outputs": (("VAE", "VAE"),),
        "output_node": False,
    },
    # nodes.py, class VAEDecode: "samples": ("LATENT",), "vae": ("VAE",); RETURN_TYPES = ("IMAGE",)
    "VAEDecode": {
        "display_name": "VAE Decode",
        "source": "nodes.py",
        "inputs": (
            {"name": "samples", "type": "LATENT"},
            {"name": "vae", "type": "VAE"},
        ),
        "outputs": (("IMAGE", "IMAGE"),),
        "output_node": False,
    },
    # nodes.py, class VAEEncode: "pixels": ("IMAGE",), "vae": ("VAE",); RETURN_TYPES = ("LATENT",)
    "VAEEncode": {
        "display_name": "VAE Encode",
        "source": "nodes.py",
        "inputs": (
            {"name": "pixels", "type": "IMAGE"},
            {"name": "vae", "type": "VAE"},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # nodes.py, class SaveImage: "images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"});
    # hidden prompt, extra_pnginfo; RETURN_TYPES = (); OUTPUT_NODE = True
    "SaveImage": {
        "display_name": "Save Image",
        "source": "nodes.py",
        "inputs": (
            {"name": "images", "type": "IMAGE"},
            {"name": "filename_prefix", "type": "STRING", "widget": "text", "default": "ComfyUI"},
        ),
        "outputs": (),
        "output_node": True,
    },
    # nodes.py, class LoadImage: "image": (sorted(files), {"image_upload": True}) - the image files of ComfyUI's
    # input folder; RETURN_TYPES = ("IMAGE", "MASK"). The frontend adds the "upload" button after it.
    "LoadImage": {
        "display_name": "Load Image",
        "source": "nodes.py",
        "inputs": (
            {"name": "image", "type": "COMBO", "widget": "combo", "folder": "input", "image_upload": True,
             "ui_extra": {"name": "upload", "value": "image"}},
        ),
        "outputs": (("IMAGE", "IMAGE"), ("MASK", "MASK")),
        "output_node": False,
    },
}

# The stock nodes the pack's nodes replace (the sampler, and the loader of the diffusion model, which the engine
# loads itself); none of the example workflows uses them.
REPLACED_BY_XDIT = ("KSampler", "KSamplerAdvanced", "UNETLoader")
