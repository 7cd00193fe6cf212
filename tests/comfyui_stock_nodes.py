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
  ImageScaleToTotalPixels (V3 io.Schema): what the Qwen-Image templates (comfyui-workflow-templates 0.1.94, the
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

The sampling side of ComfyUI's own templates (comfyui-workflow-templates 0.1.94, which 0.3.64's frontend pins, and
comfyui-workflow-templates-json 0.1.50: image_qwen_image.json, image_qwen_image_edit.json,
image_flux2_text_to_image.json, image_flux2_klein_text_to_image.json), added for the workflows that keep it:
- comfy_extras/nodes_model_advanced.py ModelSamplingAuraFlow; comfy_extras/nodes_cfg.py CFGNorm (V3);
- comfy_extras/nodes_custom_sampler.py RandomNoise, KSamplerSelect, BasicGuider, CFGGuider, SamplerCustomAdvanced;
  nodes.py ConditioningZeroOut (all in 0.3.64);
- comfy_extras/nodes_flux.py Flux2Scheduler (V3, 0.3.72 on; as in 0.33.0).
The Wan workflows' nodes, from ComfyUI's Wan templates (comfyui-workflow-templates 0.1.94 and
comfyui-workflow-templates-json 0.1.50: text_to_video_wan.json, video_wan2_2_14B_t2v.json, video_wan2_2_14B_i2v.json,
video_wan2_2_5B_ti2v.json), all in 0.3.64 (Wan 2.2's nodes arrived in 0.3.46: commit a88788dc, "Wan 2.2 support."):
- comfy_extras/nodes_model_advanced.py ModelSamplingSD3; comfy_extras/nodes_hunyuan.py EmptyHunyuanLatentVideo (V1);
- comfy_extras/nodes_wan.py WanImageToVideo, Wan22ImageToVideoLatent (V3);
- comfy_extras/nodes_video.py CreateVideo, SaveVideo (V3).
Inputs a later ComfyUI added carry "since" (as ComfyUI 0.33.0 defines them, comfyui_version.py "0.33.0"): the
workflows save them too, because 0.33.0 refuses an API prompt without a required one ("Required input is missing")
while 0.3.64 ignores inputs its node does not declare (both checked by POST /prompt) and its frontend ignores
widgets_values past the widgets a node has. LATER_OUTPUTS lists outputs a later ComfyUI added (not saved: an
output slot 0.3.64's node lacks would show on it; they count only for the node's drawn size).

How the frontends show these nodes (titles from their en locale, src/locales/en/nodeDefs.json, read from the page):
FRONTEND_TITLES; the frontend's own nodes (no server definition, never sent to the server): FRONTEND_NODES.

This module is data only. Each input is a dict:
  name, type: the input's name and type as ComfyUI declares it (a socket type such as "CLIP", or a widget type:
              "COMBO", "INT", "FLOAT", "STRING", "BOOLEAN");
  widget:     for widget inputs, the kind of widget the frontend shows:
                "combo"     a drop-down; "options" lists fixed options, or "folder" names the model/input folder
                            ComfyUI lists the options from at run time;
                "number"    INT/FLOAT with "default", "min", "max", "step";
                "text"      a single-line STRING; "multiline" a multi-line STRING (with "dynamicPrompts");
                "toggle"    a BOOLEAN; "markdown" the Markdown Note's text;
  optional:   True for inputs declared under "optional" (they still get a widget and a widgets_values entry);
  advanced:   True for inputs ComfyUI marks advanced;
  ui_extra:   a UI-only widget the frontend adds right after this one, saved in widgets_values only;
  api_alias:  another name the newest frontend checked also sends the widget's value under in the API prompt;
  since:      a ComfyUI version that has the input and 0.3.64 lacks: "0.33.0" where it was added somewhere between
              the two, the release that added it where known; absent: 0.3.64 has it. On a node, the release that
              added the node.
Outputs are (type, name) pairs in slot order. "image_preview": the frontend shows the node's image (the loaded or
the saved one) below its widgets. "experimental": ComfyUI marks the node experimental (is_experimental).
"""

COMFYUI_VERSION = "0.3.64"
COMFYUI_COMMIT = "a125cd84b054a57729b5eecab930ca9408719832"
MAX_RESOLUTION = 16384  # nodes.py
# comfy/samplers.py (0.3.64), SAMPLER_NAMES = KSAMPLER_NAMES + ["ddim", "uni_pc", "uni_pc_bh2"]
SAMPLER_NAMES = ("euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
                 "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral",
                 "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp",
                 "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde",
                 "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis", "res_multistep",
                 "res_multistep_cfg_pp", "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp",
                 "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde", "seeds_2", "seeds_3", "sa_solver",
                 "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2")
# comfy/samplers.py (0.3.64), SCHEDULER_NAMES = list(SCHEDULER_HANDLERS)
SCHEDULER_NAMES = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
                   "linear_quadratic", "kl_optimal")

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
        "since": "0.3.72",
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
            # 0.33.0: io.Int.Input("resolution_steps", default=1, min=1, max=256, advanced=True), required
            {"name": "resolution_steps", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 256,
             "advanced": True, "since": "0.33.0"},
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
        "image_preview": True,
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
        "image_preview": True,
        "inputs": (
            {"name": "image", "type": "COMBO", "widget": "combo", "folder": "input", "image_upload": True,
             "ui_extra": {"name": "upload", "value": "image"}},
        ),
        "outputs": (("IMAGE", "IMAGE"), ("MASK", "MASK")),
        "output_node": False,
    },
    # comfy_extras/nodes_model_advanced.py, ModelSamplingAuraFlow: "model": ("MODEL",), "shift": ("FLOAT",
    # {"default": 1.73, "min": 0.0, "max": 100.0, "step": 0.01}); RETURN_TYPES = ("MODEL",)
    "ModelSamplingAuraFlow": {
        "display_name": "ModelSamplingAuraFlow",
        "source": "comfy_extras/nodes_model_advanced.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "shift", "type": "FLOAT", "widget": "number", "default": 1.73, "min": 0.0, "max": 100.0,
             "step": 0.01},
        ),
        "outputs": (("MODEL", "MODEL"),),
        "output_node": False,
    },
    # comfy_extras/nodes_cfg.py, CFGNorm: io.Model.Input("model"), io.Float.Input("strength", default=1.0, min=0.0,
    # max=100.0, step=0.01); io.Model.Output(display_name="patched_model"); 0.33.0 adds
    # io.Boolean.Input("pre_cfg", default=False, optional=True)
    "CFGNorm": {
        "display_name": "CFGNorm",
        "source": "comfy_extras/nodes_cfg.py",
        "experimental": True,   # is_experimental=True (0.3.64 and 0.33.0): the frontend badges it
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "strength", "type": "FLOAT", "widget": "number", "default": 1.0, "min": 0.0, "max": 100.0,
             "step": 0.01},
            {"name": "pre_cfg", "type": "BOOLEAN", "widget": "toggle", "default": False, "optional": True,
             "since": "0.33.0"},
        ),
        "outputs": (("MODEL", "patched_model"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, RandomNoise: "noise_seed": ("INT", {"default": 0, "min": 0,
    # "max": 0xffffffffffffffff, "control_after_generate": True}); RETURN_TYPES = ("NOISE",)
    "RandomNoise": {
        "display_name": "RandomNoise",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "noise_seed", "type": "INT", "widget": "number", "default": 0, "min": 0,
             "max": 0xffffffffffffffff,
             "ui_extra": {"name": "control_after_generate", "values": ("fixed", "increment", "decrement",
                                                                       "randomize")}},
        ),
        "outputs": (("NOISE", "NOISE"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, KSamplerSelect: "sampler_name": (comfy.samplers.SAMPLER_NAMES,);
    # RETURN_TYPES = ("SAMPLER",)
    "KSamplerSelect": {
        "display_name": "KSamplerSelect",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "sampler_name", "type": "COMBO", "widget": "combo", "options": SAMPLER_NAMES},
        ),
        "outputs": (("SAMPLER", "SAMPLER"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, BasicGuider: "model": ("MODEL",), "conditioning": ("CONDITIONING",);
    # RETURN_TYPES = ("GUIDER",)
    "BasicGuider": {
        "display_name": "BasicGuider",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "conditioning", "type": "CONDITIONING"},
        ),
        "outputs": (("GUIDER", "GUIDER"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, CFGGuider: "model", "positive", "negative", "cfg": ("FLOAT",
    # {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}); RETURN_TYPES = ("GUIDER",)
    "CFGGuider": {
        "display_name": "CFGGuider",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "cfg", "type": "FLOAT", "widget": "number", "default": 8.0, "min": 0.0, "max": 100.0,
             "step": 0.1},
        ),
        "outputs": (("GUIDER", "GUIDER"),),
        "output_node": False,
    },
    # comfy_extras/nodes_custom_sampler.py, SamplerCustomAdvanced: "noise": ("NOISE",), "guider": ("GUIDER",),
    # "sampler": ("SAMPLER",), "sigmas": ("SIGMAS",), "latent_image": ("LATENT",); RETURN_TYPES = ("LATENT",
    # "LATENT"), RETURN_NAMES = ("output", "denoised_output")
    "SamplerCustomAdvanced": {
        "display_name": "SamplerCustomAdvanced",
        "source": "comfy_extras/nodes_custom_sampler.py",
        "inputs": (
            {"name": "noise", "type": "NOISE"},
            {"name": "guider", "type": "GUIDER"},
            {"name": "sampler", "type": "SAMPLER"},
            {"name": "sigmas", "type": "SIGMAS"},
            {"name": "latent_image", "type": "LATENT"},
        ),
        "outputs": (("LATENT", "output"), ("LATENT", "denoised_output")),
        "output_node": False,
    },
    # nodes.py, class ConditioningZeroOut: "conditioning": ("CONDITIONING",); RETURN_TYPES = ("CONDITIONING",)
    "ConditioningZeroOut": {
        "display_name": "ConditioningZeroOut",
        "source": "nodes.py",
        "inputs": (
            {"name": "conditioning", "type": "CONDITIONING"},
        ),
        "outputs": (("CONDITIONING", "CONDITIONING"),),
        "output_node": False,
    },
    # comfy_extras/nodes_flux.py (0.3.72 on), Flux2Scheduler: io.Int.Input("steps", default=20, min=1, max=4096),
    # io.Int.Input("width", default=1024, min=16, max=nodes.MAX_RESOLUTION, step=1), height likewise;
    # io.Sigmas.Output() (FLUX.2's resolution-dependent schedule)
    "Flux2Scheduler": {
        "display_name": "Flux2Scheduler",
        "source": "comfy_extras/nodes_flux.py",
        "since": "0.3.72",
        "inputs": (
            {"name": "steps", "type": "INT", "widget": "number", "default": 20, "min": 1, "max": 4096},
            {"name": "width", "type": "INT", "widget": "number", "default": 1024, "min": 16, "max": MAX_RESOLUTION,
             "step": 1},
            {"name": "height", "type": "INT", "widget": "number", "default": 1024, "min": 16,
             "max": MAX_RESOLUTION, "step": 1},
        ),
        "outputs": (("SIGMAS", "SIGMAS"),),
        "output_node": False,
    },
    # comfy_extras/nodes_model_advanced.py, ModelSamplingSD3: "model": ("MODEL",), "shift": ("FLOAT",
    # {"default": 3.0, "min": 0.0, "max": 100.0, "step": 0.01}); RETURN_TYPES = ("MODEL",)
    "ModelSamplingSD3": {
        "display_name": "ModelSamplingSD3",
        "source": "comfy_extras/nodes_model_advanced.py",
        "inputs": (
            {"name": "model", "type": "MODEL"},
            {"name": "shift", "type": "FLOAT", "widget": "number", "default": 3.0, "min": 0.0, "max": 100.0,
             "step": 0.01},
        ),
        "outputs": (("MODEL", "MODEL"),),
        "output_node": False,
    },
    # comfy_extras/nodes_hunyuan.py, EmptyHunyuanLatentVideo (V1 in 0.3.64, no display-name mapping; V3 with
    # display_name "Empty HunyuanVideo 1.0 Latent" in 0.33.0, the same inputs): "width": ("INT", {"default": 848,
    # "min": 16, "max": nodes.MAX_RESOLUTION, "step": 16}), "height" (default 480) likewise, "length": ("INT",
    # {"default": 25, "min": 1, "max": nodes.MAX_RESOLUTION, "step": 4}), "batch_size": ("INT", {"default": 1,
    # "min": 1, "max": 4096}); RETURN_TYPES = ("LATENT",) (zeros [B, 16, (length - 1) // 4 + 1, H/8, W/8])
    "EmptyHunyuanLatentVideo": {
        "display_name": "EmptyHunyuanLatentVideo",
        "source": "comfy_extras/nodes_hunyuan.py",
        "inputs": (
            {"name": "width", "type": "INT", "widget": "number", "default": 848, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 480, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "length", "type": "INT", "widget": "number", "default": 25, "min": 1, "max": MAX_RESOLUTION,
             "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # comfy_extras/nodes_wan.py, WanImageToVideo: io.Conditioning.Input("positive"), io.Conditioning.Input("negative"),
    # io.Vae.Input("vae"), io.Int.Input("width", default=832, min=16, max=nodes.MAX_RESOLUTION, step=16), "height"
    # (default 480) likewise, io.Int.Input("length", default=81, min=1, max=nodes.MAX_RESOLUTION, step=4),
    # io.Int.Input("batch_size", default=1, min=1, max=4096), io.ClipVisionOutput.Input("clip_vision_output",
    # optional=True), io.Image.Input("start_image", optional=True); outputs io.Conditioning.Output(display_name=
    # "positive"), io.Conditioning.Output(display_name="negative"), io.Latent.Output(display_name="latent")
    "WanImageToVideo": {
        "display_name": "WanImageToVideo",
        "source": "comfy_extras/nodes_wan.py",
        "inputs": (
            {"name": "positive", "type": "CONDITIONING"},
            {"name": "negative", "type": "CONDITIONING"},
            {"name": "vae", "type": "VAE"},
            {"name": "width", "type": "INT", "widget": "number", "default": 832, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "height", "type": "INT", "widget": "number", "default": 480, "min": 16, "max": MAX_RESOLUTION,
             "step": 16},
            {"name": "length", "type": "INT", "widget": "number", "default": 81, "min": 1, "max": MAX_RESOLUTION,
             "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
            {"name": "clip_vision_output", "type": "CLIP_VISION_OUTPUT", "optional": True},
            {"name": "start_image", "type": "IMAGE", "optional": True},
        ),
        "outputs": (("CONDITIONING", "positive"), ("CONDITIONING", "negative"), ("LATENT", "latent")),
        "output_node": False,
    },
    # comfy_extras/nodes_wan.py, Wan22ImageToVideoLatent: io.Vae.Input("vae"), io.Int.Input("width", default=1280,
    # min=32, max=nodes.MAX_RESOLUTION, step=32), io.Int.Input("height", default=704, ...) likewise,
    # io.Int.Input("length", default=49, min=1, max=nodes.MAX_RESOLUTION, step=4), io.Int.Input("batch_size",
    # default=1, min=1, max=4096), io.Image.Input("start_image", optional=True); io.Latent.Output() (48 channels at
    # 16x, the encoded start image with a noise_mask 0 on its frames)
    "Wan22ImageToVideoLatent": {
        "display_name": "Wan22ImageToVideoLatent",
        "source": "comfy_extras/nodes_wan.py",
        "inputs": (
            {"name": "vae", "type": "VAE"},
            {"name": "width", "type": "INT", "widget": "number", "default": 1280, "min": 32, "max": MAX_RESOLUTION,
             "step": 32},
            {"name": "height", "type": "INT", "widget": "number", "default": 704, "min": 32, "max": MAX_RESOLUTION,
             "step": 32},
            {"name": "length", "type": "INT", "widget": "number", "default": 49, "min": 1, "max": MAX_RESOLUTION,
             "step": 4},
            {"name": "batch_size", "type": "INT", "widget": "number", "default": 1, "min": 1, "max": 4096},
            {"name": "start_image", "type": "IMAGE", "optional": True},
        ),
        "outputs": (("LATENT", "LATENT"),),
        "output_node": False,
    },
    # comfy_extras/nodes_video.py, CreateVideo: display_name "Create Video"; io.Image.Input("images"),
    # io.Float.Input("fps", default=30.0, min=1.0, max=120.0, step=1.0), io.Audio.Input("audio", optional=True);
    # io.Video.Output(). 0.33.0 adds io.Int.Input("bit_depth", min=8, max=10, default=8, step=2, optional=True)
    "CreateVideo": {
        "display_name": "Create Video",
        "source": "comfy_extras/nodes_video.py",
        "inputs": (
            {"name": "images", "type": "IMAGE"},
            {"name": "fps", "type": "FLOAT", "widget": "number", "default": 30.0, "min": 1.0, "max": 120.0,
             "step": 1.0},
            {"name": "audio", "type": "AUDIO", "optional": True},
            {"name": "bit_depth", "type": "INT", "widget": "number", "default": 8, "min": 8, "max": 10, "step": 2,
             "optional": True, "since": "0.33.0"},
        ),
        "outputs": (("VIDEO", "VIDEO"),),
        "output_node": False,
    },
    # comfy_extras/nodes_video.py, SaveVideo: display_name "Save Video"; io.Video.Input("video"),
    # io.String.Input("filename_prefix", default="video/ComfyUI"), io.Combo.Input("format",
    # options=VideoContainer.as_input(), default="auto") (["auto", "mp4"]), io.Combo.Input("codec",
    # options=VideoCodec.as_input(), default="auto") (["auto", "h264"]); no outputs; is_output_node=True.
    # 0.33.0: format is a DynamicCombo ("auto", "mp4", "mkv", "webm") whose options each hold a "codec" DynamicCombo
    # ("auto", "h264", "av1"; webm without h264), plus a hidden optional "codec" for prompts saved before. The UI saves
    # [filename_prefix, format, codec] in both (0.33.0's template too: its frontend draws the third as the format's
    # "codec", named "format.codec"); 1.49.6's Export (API) sends that value as "format.codec" and again as "codec".
    # POST /prompt with {"format": "auto", "codec": "auto"}, with or without "format.codec", runs in both
    "SaveVideo": {
        "display_name": "Save Video",
        "source": "comfy_extras/nodes_video.py",
        "inputs": (
            {"name": "video", "type": "VIDEO"},
            {"name": "filename_prefix", "type": "STRING", "widget": "text", "default": "video/ComfyUI"},
            {"name": "format", "type": "COMBO", "widget": "combo", "options": ("auto", "mp4"), "default": "auto"},
            {"name": "codec", "type": "COMBO", "widget": "combo", "options": ("auto", "h264"), "default": "auto",
             "api_alias": "format.codec"},
        ),
        "outputs": (),
        "output_node": True,
    },
}

# Outputs a later ComfyUI added to a node: nodes.py (0.33.0), class SaveImage: RETURN_TYPES = ("IMAGE",),
# RETURN_NAMES = ("images",); comfy_extras/nodes_video.py (0.33.0), SaveVideo: io.Video.Output("video").
LATER_OUTPUTS = {"SaveImage": (("IMAGE", "images"),), "SaveVideo": (("VIDEO", "video"),)}

# The frontend's own nodes (src/extensions/core/noteNode.ts in 1.27.10 and 1.49.6): virtual, never sent to the
# server. MarkdownNote holds one Markdown "text" widget (ComfyWidgets.MARKDOWN), saved in widgets_values.
FRONTEND_NODES = {
    "MarkdownNote": {
        "display_name": "Markdown Note",
        "source": "src/extensions/core/noteNode.ts",
        "inputs": (
            {"name": "text", "type": "STRING", "widget": "markdown"},
        ),
        "outputs": (),
        "output_node": False,
        "virtual": True,
    },
}

# Node titles the frontends show where they differ from the display name above: each frontend's en locale names
# some stock nodes itself (src/locales/en/nodeDefs.json, display_name), whatever the server says; 1.49.6 also shows
# 0.33.0's own display names where 0.3.64 had none (EmptyHunyuanLatentVideo).
FRONTEND_TITLES = {
    "1.27.10": {"ImageScaleToTotalPixels": "Scale Image to Total Pixels"},
    "1.49.6": {"DualCLIPLoader": "Load CLIP (Dual)", "TripleCLIPLoader": "Load CLIP (Triple)",
               "ImageScaleToTotalPixels": "Scale Image to Total Pixels", "ReferenceLatent": "Set Reference Latent",
               "BasicGuider": "Basic Guider", "CFGGuider": "CFG Guider",
               "ConditioningZeroOut": "Conditioning Zero Out",
               "EmptyHunyuanLatentVideo": "Empty HunyuanVideo 1.0 Latent"},
}

# The stock nodes the pack's nodes replace in the example workflows (KSampler, where a template has it, and the
# loader of the diffusion model, which the engine loads itself); none of them uses these.
REPLACED_BY_XDIT = ("KSampler", "KSamplerAdvanced", "UNETLoader", "CheckpointLoaderSimple")
