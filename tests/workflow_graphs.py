"""What each workflow in workflows/ is, compactly: its nodes (type, widget values, column, title), what feeds each
input, and where its model files come from. tests/make_workflows.py turns these into the UI and API files.

Each graph is ComfyUI's own template for its model with the diffusion-model loader (UNETLoader, Load Checkpoint)
swapped for the xDiT Engine. Where the template samples with KSampler, the engine's MODEL goes through the
template's own MODEL nodes into the xDiT Sampler's `model` input; where it samples with SamplerCustomAdvanced (the
FLUX.2 templates), its guider takes the engine's MODEL; where it samples with a KSamplerAdvanced pair (Wan 2.2 A14B's
high-noise and low-noise experts), each expert has an xDiT Engine on the same GPUs and an xDiT Sampler (Advanced).
Every graph has an xDiT Engine Info node on an engine, run after the last sampler, with room below and beside it for
the report it draws after a run."""
from dataclasses import dataclass, field

GPUS = "all"   # every GPU the machine has (the engine node's default)
SEED = 42

# Where each model file comes from (name -> download URL, ComfyUI models/ folder), as ComfyUI's own templates link
# them (comfyui-workflow-templates 0.1.94 and comfyui-workflow-templates-json 0.1.50, each loader node's
# properties.models) where a template names the file; the others from their publishers' repositories.
HF = "https://huggingface.co/"
MODEL_SOURCES = {
    "flux1-dev.safetensors": (HF + "Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors", "diffusion_models"),
    "flux1-schnell.safetensors": (HF + "Comfy-Org/flux1-schnell/resolve/main/flux1-schnell.safetensors",
                                  "diffusion_models"),
    # Black Forest Labs' own file (gated: accept the licence on the model page first)
    "flux1-kontext-dev.safetensors": (HF + "black-forest-labs/FLUX.1-Kontext-dev/resolve/main/"
                                      "flux1-kontext-dev.safetensors", "diffusion_models"),
    # Stability AI's own checkpoint (gated), which ComfyUI's SD3.5 examples load from checkpoints/
    "sd3.5_large.safetensors": (HF + "stabilityai/stable-diffusion-3.5-large/resolve/main/sd3.5_large.safetensors",
                                "checkpoints"),
    "qwen_image_fp8_e4m3fn.safetensors": (HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"
                                          "diffusion_models/qwen_image_fp8_e4m3fn.safetensors", "diffusion_models"),
    "qwen_image_edit_fp8_e4m3fn.safetensors": (HF + "Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/"
                                               "diffusion_models/qwen_image_edit_fp8_e4m3fn.safetensors",
                                               "diffusion_models"),
    "flux2_dev_fp8mixed.safetensors": (HF + "Comfy-Org/flux2-dev/resolve/main/split_files/diffusion_models/"
                                       "flux2_dev_fp8mixed.safetensors", "diffusion_models"),
    "flux-2-klein-4b.safetensors": (HF + "Comfy-Org/flux2-klein/resolve/main/split_files/diffusion_models/"
                                    "flux-2-klein-4b.safetensors", "diffusion_models"),
    "t5xxl_fp16.safetensors": (HF + "comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors",
                               "text_encoders"),
    "clip_l.safetensors": (HF + "comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors", "text_encoders"),
    "clip_g.safetensors": (HF + "Comfy-Org/stable-diffusion-3.5-fp8/resolve/main/text_encoders/clip_g.safetensors",
                           "text_encoders"),
    "qwen_2.5_vl_7b_fp8_scaled.safetensors": (HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"
                                              "text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors", "text_encoders"),
    "mistral_3_small_flux2_bf16.safetensors": (HF + "Comfy-Org/flux2-dev/resolve/main/split_files/text_encoders/"
                                               "mistral_3_small_flux2_bf16.safetensors", "text_encoders"),
    "qwen_3_4b.safetensors": (HF + "Comfy-Org/flux2-klein/resolve/main/split_files/text_encoders/"
                              "qwen_3_4b.safetensors", "text_encoders"),
    "ae.safetensors": (HF + "Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors", "vae"),
    # SD3.5's VAE as Stability AI publishes it (gated), vae/diffusion_pytorch_model.safetensors: saved under this
    # name in vae/
    "sd3.5_vae.safetensors": (HF + "stabilityai/stable-diffusion-3.5-large/resolve/main/vae/"
                              "diffusion_pytorch_model.safetensors", "vae"),
    "qwen_image_vae.safetensors": (HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/"
                                   "qwen_image_vae.safetensors", "vae"),
    "flux2-vae.safetensors": (HF + "Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors", "vae"),
    # Wan: Comfy-Org's repackaged files, as ComfyUI's Wan templates link them (text_to_video_wan.json,
    # video_wan2_2_14B_t2v.json, video_wan2_2_14B_i2v.json, video_wan2_2_5B_ti2v.json; the 2.2 templates link
    # wan_2.1_vae from Wan_2.2_ComfyUI_Repackaged, the same file)
    **{name: (HF + f"Comfy-Org/{repo}/resolve/main/split_files/{folder}/{name}", folder) for repo, folder, name in (
        ("Wan_2.1_ComfyUI_repackaged", "diffusion_models", "wan2.1_t2v_1.3B_fp16.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "diffusion_models", "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "diffusion_models", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "diffusion_models", "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "diffusion_models", "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "diffusion_models", "wan2.2_ti2v_5B_fp16.safetensors"),
        ("Wan_2.1_ComfyUI_repackaged", "text_encoders", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
        ("Wan_2.1_ComfyUI_repackaged", "vae", "wan_2.1_vae.safetensors"),
        ("Wan_2.2_ComfyUI_Repackaged", "vae", "wan2.2_vae.safetensors"))},
    # MiniMax-H3: Comfy-Org's files as ComfyUI's MiniMax-H3 templates link them (video_minimax_h3_t2v.json,
    # video_minimax_h3_i2v.json), and the templates' 8-step turbo LoRA from lightx2v; the engine loads the templates'
    # model file (pruned, int8 ConvRot)
    **{name: (HF + f"Comfy-Org/MiniMax-H3/resolve/main/{folder}/{name}", folder) for folder, name in (
        ("diffusion_models", "minimax_h3_fl2va_pruned_int8_convrot.safetensors"),
        ("text_encoders", "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"),
        ("vae", "minimax_h3_video_vae_fp16.safetensors"),
        ("vae", "minimax_h3_audio_vae_fp32.safetensors"))},
    "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors": (
        HF + "lightx2v/Minimax-h3-Turbo/resolve/main/minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
        "loras"),
    # Krea 2: Comfy-Org's files as ComfyUI's Krea 2 Turbo template links them (image_krea2_turbo_t2i.json; its VAE is
    # Qwen-Image's, the same file as above)
    **{name: (HF + f"Comfy-Org/Krea-2/resolve/main/{folder}/{name}", folder) for folder, name in (
        ("diffusion_models", "krea2_turbo_fp8_scaled.safetensors"),
        ("text_encoders", "qwen3vl_4b_fp8_scaled.safetensors"))},
    # HunyuanVideo 1.5: Comfy-Org's repackaged files as ComfyUI's 720p text-to-video template links them
    # (video_hunyuan_video_1.5_720p_t2v.json, each loader's properties.models; its Qwen2.5-VL file is Qwen-Image's,
    # the same file as above)
    **{name: (HF + f"Comfy-Org/HunyuanVideo_1.5_repackaged/resolve/main/split_files/{folder}/{name}", folder)
       for folder, name in (("diffusion_models", "hunyuanvideo1.5_720p_t2v_fp16.safetensors"),
                            ("diffusion_models", "hunyuanvideo1.5_720p_i2v_fp16.safetensors"),
                            ("text_encoders", "byt5_small_glyphxl_fp16.safetensors"),
                            ("vae", "hunyuanvideo15_vae_fp16.safetensors"))},
    "sigclip_vision_patch14_384.safetensors": (HF + "Comfy-Org/sigclip_vision_384/resolve/main/"
                                               "sigclip_vision_patch14_384.safetensors", "clip_vision"),
    # Wan-Animate 2: Comfy-Org's files as ComfyUI's "Wan Animate 2 Distilled: Motion Transfer" template links them
    # (video_wan_animate2_distilled.json, each loader's properties.models; its umT5 file is the Wan workflows', linked
    # above)
    **{name: (HF + f"Comfy-Org/Wan-Animate-2/resolve/main/{folder}/{name}", folder) for folder, name in (
        ("diffusion_models", "wan_animate_2_distill_int8_convrot.safetensors"),
        ("clip_vision", "clip_vision_h.safetensors"),
        ("vae", "Wan2_1_VAE_bf16.safetensors"))},
    # LTX-2.3: the files ComfyUI 0.33.0's LTX-2.3 templates link (blueprints/Text to Video (LTX-2.3).json, each
    # loader's properties.models)
    "ltx-2.3-22b-dev-fp8.safetensors": (HF + "Lightricks/LTX-2.3-fp8/resolve/main/ltx-2.3-22b-dev-fp8.safetensors",
                                        "checkpoints"),
    "ltx-2.3-22b-distilled-lora-384.safetensors": (HF + "Lightricks/LTX-2.3/resolve/main/"
                                                   "ltx-2.3-22b-distilled-lora-384.safetensors", "loras"),
    "ltx-2.3-spatial-upscaler-x2-1.1.safetensors": (HF + "Lightricks/LTX-2.3/resolve/main/"
                                                    "ltx-2.3-spatial-upscaler-x2-1.1.safetensors",
                                                    "latent_upscale_models"),
    "gemma_3_12B_it_fp4_mixed.safetensors": (HF + "Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/"
                                             "gemma_3_12B_it_fp4_mixed.safetensors", "text_encoders"),
    # the First-Last-Frame template's one file (blueprints/First-Last-Frame to Video (LTX-2.3).json)
    "ltx-2.3-22b-distilled-fp8.safetensors": (HF + "Lightricks/LTX-2.3-fp8/resolve/main/"
                                              "ltx-2.3-22b-distilled-fp8.safetensors", "checkpoints"),
    # LTX-2.5: the files ComfyUI's LTX-2.5 templates link (video_ltx2_5_t2v.json, each loader's properties.models)
    **{name: (HF + f"Lightricks/LTX-2.5/resolve/main/{folder}/{name}", folder) for folder, name in (
        ("diffusion_models", "ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors"),
        ("text_encoders", "gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors"),
        ("vae", "ltx-2.5-video-vae-bf16.safetensors"), ("vae", "ltx-2.5-audio-vae-bf16.safetensors"),
        ("latent_upscale_models", "ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors"))},
}


@dataclass
class Node:
    type: str
    values: list
    column: int
    title: str | None = None
    links: dict = field(default_factory=dict)   # input name -> (node, output slot)
    size: tuple = (0, 0)                        # at least this (w, h); the layout makes it no smaller than drawn
    room: tuple = (0, 0)                        # the (w, h) it may grow to later: the layout keeps it free
    key: int = 0                                # its id: its place in the graph, from 1

    def out(self, slot: int = 0):
        return (self, slot)


@dataclass
class Graph:
    name: str
    needs_comfyui: str = "0.3.64"               # the oldest ComfyUI that has every node the graph uses
    nodes: list = field(default_factory=list)

    def add(self, type, values=(), column=0, title=None, size=(0, 0), room=(0, 0), **links) -> Node:
        node = Node(type, list(values), column, title,
                    {k: (v if isinstance(v, tuple) else v.out()) for k, v in links.items()}, size, room,
                    key=len(self.nodes) + 1)
        self.nodes.append(node)
        return node


PROMPT_BOX = (400, 200)      # the frontend gives a new text-prompt node this size (minNodeSize)
EMPTY_PROMPT_BOX = (400, 120)
SAVE_BOX = (440, 480)        # room for the saved image's preview
LOAD_BOX = (320, 360)        # room for the loaded image's preview
# The Info node after a run (xdit_nodes/web/engine_info.js): 420 wide, and as tall as computeSize with the report's
# box at its most, 18 lines of 15 px + 12: two socket rows (40) + unload (20 + 4) + the box (282 + 4) + 8 + 6 = 364
INFO_REPORT_BOX = (420, 364)


def _engine(g: Graph, model, column=0):
    return g.add("XDiTEngine", [model, "auto", "default", GPUS, "auto", 1, 1, False, 1, 3600, 0.0, False, "auto", 1,
                                0, 1, "auto", 1], column)


def _xdit_sampler(g, column, model, positive, negative, latent, steps, cfg, denoise=1.0, sampler="euler"):
    return g.add("XDiTSampler", [SEED, "fixed", steps, cfg, sampler, "simple", denoise], column, positive=positive,
                 negative=negative, latent_image=latent, model=model)


def _info(g, column, engine, latent):
    """The Info node on the engine, run after the sampler's LATENT, with room for its report."""
    return g.add("XDiTEngineInfo", [False], column, room=INFO_REPORT_BOX, engine=engine.out(0), after=latent)


def _finish(g, column, engine, latent, vae):
    """VAE Decode -> Save Image, and the Info node on the engine, run after the sampler."""
    decode = g.add("VAEDecode", [], column, samples=latent, vae=vae)
    _info(g, column, engine, latent)
    g.add("SaveImage", [f"xDiT/{g.name}"], column + 1, size=SAVE_BOX, images=decode)


def _prompt(g, column, clip, text, title=None, box=PROMPT_BOX):
    return g.add("CLIPTextEncode", [text], column, title, box, clip=clip)


def _flux1(name, model, steps, guidance=3.5, image=False, denoise=1.0) -> Graph:
    """ComfyUI's FLUX.1 [dev] / [schnell] text-to-image template (flux_dev_full_text_to_image.json: the model's
    MODEL straight into the sampler), or with image=True its image-to-image example (Load Image -> VAE Encode)."""
    g = Graph(name)
    clip = g.add("DualCLIPLoader", ["t5xxl_fp16.safetensors", "clip_l.safetensors", "flux", "default"], 0)
    engine = _engine(g, model)
    vae = g.add("VAELoader", ["ae.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS[name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, "", "CLIP Text Encode (Negative Prompt, unused at cfg 1.0)", EMPTY_PROMPT_BOX)
    if guidance is not None:
        positive = g.add("FluxGuidance", [guidance], 1, conditioning=positive)
    if image:
        pixels = g.add("LoadImage", ["example.png", "image"], 0, size=LOAD_BOX)
        latent = g.add("VAEEncode", [], 1, pixels=pixels, vae=vae)
    else:
        latent = g.add("EmptySD3LatentImage", [1024, 1024, 1], 1)
    sampler = _xdit_sampler(g, 2, engine.out(1), positive, negative, latent, steps, 1.0, denoise)
    _finish(g, 3, engine, sampler, vae)
    return g


def _sd35() -> Graph:
    """ComfyUI's SD3.5 example: the checkpoint's model into KSampler, a real negative prompt at cfg 4.5."""
    g = Graph("sd3.5-large")
    clip = g.add("TripleCLIPLoader", ["clip_g.safetensors", "clip_l.safetensors", "t5xxl_fp16.safetensors"], 0)
    engine = _engine(g, "sd3.5_large.safetensors")
    vae = g.add("VAELoader", ["sd3.5_vae.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS["sd3.5-large"], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, NEGATIVE_SD35, "CLIP Text Encode (Negative Prompt)")
    latent = g.add("EmptySD3LatentImage", [1024, 1024, 1], 1)
    sampler = _xdit_sampler(g, 2, engine.out(1), positive, negative, latent, 28, 4.5)
    _finish(g, 3, engine, sampler, vae)
    return g


def _kontext() -> Graph:
    """ComfyUI's FLUX.1 Kontext [dev] example: the reference image scaled (FluxKontextImageScale), VAE-encoded and
    attached to the instruction by ReferenceLatent, FluxGuidance 2.5; an empty 1024x1024 latent, 20 steps."""
    g = Graph("flux1-kontext-dev")
    clip = g.add("DualCLIPLoader", ["t5xxl_fp16.safetensors", "clip_l.safetensors", "flux", "default"], 0)
    engine = _engine(g, "flux1-kontext-dev.safetensors")
    vae = g.add("VAELoader", ["ae.safetensors"], 0)
    image = g.add("LoadImage", ["example.png", "image"], 0, size=LOAD_BOX)
    instruction = _prompt(g, 1, clip, PROMPTS["flux1-kontext-dev"], "CLIP Text Encode (Edit Instruction)")
    negative = _prompt(g, 1, clip, "", "CLIP Text Encode (Negative Prompt, unused at cfg 1.0)", EMPTY_PROMPT_BOX)
    scaled = g.add("FluxKontextImageScale", [], 1, image=image)
    encoded = g.add("VAEEncode", [], 1, pixels=scaled, vae=vae)
    reference = g.add("ReferenceLatent", [], 2, conditioning=instruction, latent=encoded)
    positive = g.add("FluxGuidance", [2.5], 2, conditioning=reference)
    latent = g.add("EmptySD3LatentImage", [1024, 1024, 1], 2)
    sampler = _xdit_sampler(g, 3, engine.out(1), positive, negative, latent, 20, 1.0)
    _finish(g, 4, engine, sampler, vae)
    return g


def _qwen_image() -> Graph:
    """ComfyUI's Qwen-Image template (image_qwen_image.json): ModelSamplingAuraFlow 3.1 on the model, an empty
    negative prompt (real CFG 2.5), EmptySD3LatentImage 1328x1328, 20 euler/simple steps."""
    g = Graph("qwen-image")
    clip = g.add("CLIPLoader", ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image", "default"], 0)
    engine = _engine(g, "qwen_image_fp8_e4m3fn.safetensors")
    vae = g.add("VAELoader", ["qwen_image_vae.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS["qwen-image"], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, "", "CLIP Text Encode (Negative Prompt)", EMPTY_PROMPT_BOX)
    shifted = g.add("ModelSamplingAuraFlow", [3.1], 1, model=engine.out(1))
    latent = g.add("EmptySD3LatentImage", [1328, 1328, 1], 1)
    sampler = _xdit_sampler(g, 2, shifted, positive, negative, latent, 20, 2.5)
    _finish(g, 3, engine, sampler, vae)
    return g


def _qwen_image_edit() -> Graph:
    """ComfyUI's Qwen-Image-Edit template (image_qwen_image_edit.json): the image scaled to 1 megapixel (lanczos),
    TextEncodeQwenImageEdit (with the VAE: the reference latent) for the instruction and an empty negative, the
    scaled image's latent to sample; ModelSamplingAuraFlow 3.0 then CFGNorm 1 on the model, 20 steps at cfg 2.5."""
    g = Graph("qwen-image-edit")
    clip = g.add("CLIPLoader", ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image", "default"], 0)
    engine = _engine(g, "qwen_image_edit_fp8_e4m3fn.safetensors")
    vae = g.add("VAELoader", ["qwen_image_vae.safetensors"], 0)
    image = g.add("LoadImage", ["example.png", "image"], 0, size=LOAD_BOX)
    scaled = g.add("ImageScaleToTotalPixels", ["lanczos", 1.0, 1], 1, image=image)
    shifted = g.add("ModelSamplingAuraFlow", [3.0], 1, model=engine.out(1))
    normed = g.add("CFGNorm", [1.0, False], 1, model=shifted)
    positive = g.add("TextEncodeQwenImageEdit", [PROMPTS["qwen-image-edit"]], 2,
                     "TextEncodeQwenImageEdit (Positive)", PROMPT_BOX, clip=clip, vae=vae, image=scaled)
    negative = g.add("TextEncodeQwenImageEdit", [""], 2, "TextEncodeQwenImageEdit (Negative)", EMPTY_PROMPT_BOX,
                     clip=clip, vae=vae, image=scaled)
    latent = g.add("VAEEncode", [], 2, pixels=scaled, vae=vae)
    sampler = _xdit_sampler(g, 3, normed, positive, negative, latent, 20, 2.5)
    _finish(g, 4, engine, sampler, vae)
    return g


def _custom_sampling(g, column, steps, engine, vae, guider, size=1024):
    """The FLUX.2 templates' sampling: an empty FLUX.2 latent, RandomNoise, KSamplerSelect euler, Flux2Scheduler
    for the image size and the guider (`guider(column)` adds it under them), into SamplerCustomAdvanced."""
    latent = g.add("EmptyFlux2LatentImage", [size, size, 1], column)
    noise = g.add("RandomNoise", [SEED, "fixed"], column)
    select = g.add("KSamplerSelect", ["euler"], column)
    sigmas = g.add("Flux2Scheduler", [steps, size, size], column)
    sampler = g.add("SamplerCustomAdvanced", [], column + 1, noise=noise, guider=guider(column), sampler=select,
                    sigmas=sigmas, latent_image=latent)
    decode = g.add("VAEDecode", [], column + 1, samples=sampler.out(0), vae=vae)
    _info(g, column + 1, engine, sampler.out(0))
    g.add("SaveImage", [f"xDiT/{g.name}"], column + 2, size=SAVE_BOX, images=decode)


def _version_note(g, column, why, more="", size=(400, 120)):
    """The Markdown note every workflow that needs more than 0.3.64 carries (its one note); `more`, a paragraph
    after it."""
    g.add("MarkdownNote", [f"**Needs ComfyUI {g.needs_comfyui} or later** ({why}).\n\n"
                           "The xDiT Engine uses every GPU (`gpus` all); list some, e.g. 0,1, to use fewer."
                           + (f"\n\n{more}" if more else "")],
          column, size=size)


def _flux2_dev(multi_reference=False) -> Graph:
    """ComfyUI's FLUX.2 [dev] template (image_flux2_text_to_image.json): Mistral-3 through CLIPLoader type flux2,
    FluxGuidance 4 -> BasicGuider on the model, EmptyFlux2LatentImage 1024x1024, 20 steps. multi_reference: two
    images, each scaled (FluxKontextImageScale) and VAE-encoded, chained ReferenceLatent nodes on the instruction
    (FLUX.2 places reference k at time index 10 k)."""
    g = Graph("flux2-dev-multi-reference" if multi_reference else "flux2-dev", needs_comfyui="0.3.72")
    _version_note(g, 0, "FLUX.2 [dev]: its text encoder type, EmptyFlux2LatentImage and Flux2Scheduler")
    clip = g.add("CLIPLoader", ["mistral_3_small_flux2_bf16.safetensors", "flux2", "default"], 0)
    engine = _engine(g, "flux2_dev_fp8mixed.safetensors")
    vae = g.add("VAELoader", ["flux2-vae.safetensors"], 0)
    if multi_reference:
        encoded = []
        for k, picture in enumerate(("person.png", "jacket.png"), 1):
            image = g.add("LoadImage", [picture, "image"], 1, f"Load Image (Reference {k})", LOAD_BOX)
            scaled = g.add("FluxKontextImageScale", [], 2, image=image)
            encoded.append(g.add("VAEEncode", [], 2, pixels=scaled, vae=vae))
        conditioning = _prompt(g, 3, clip, PROMPTS[g.name], "CLIP Text Encode (Edit Instruction)")
        for latent in encoded:
            conditioning = g.add("ReferenceLatent", [], 3, conditioning=conditioning, latent=latent)
        column = 3
    else:
        conditioning = _prompt(g, 1, clip, PROMPTS[g.name])
        column = 1
    positive = g.add("FluxGuidance", [4.0], column, conditioning=conditioning)
    _custom_sampling(g, column + 1, 20, engine, vae,
                     lambda c: g.add("BasicGuider", [], c, model=engine.out(1), conditioning=positive))
    return g


def _flux2_klein() -> Graph:
    """ComfyUI's FLUX.2 [klein] 4B (distilled) template (image_flux2_klein_text_to_image.json): Qwen3 4B through
    CLIPLoader type flux2, CFGGuider at cfg 1 with the prompt zeroed out as the negative, no FluxGuidance (klein
    has no guidance embedding), EmptyFlux2LatentImage 1024x1024, 4 steps."""
    g = Graph("flux2-klein-4b", needs_comfyui="0.9.2")
    _version_note(g, 0, "FLUX.2 [klein]: its Qwen3 text encoder under CLIPLoader type flux2, "
                        "EmptyFlux2LatentImage and Flux2Scheduler")
    clip = g.add("CLIPLoader", ["qwen_3_4b.safetensors", "flux2", "default"], 0)
    engine = _engine(g, "flux-2-klein-4b.safetensors")
    vae = g.add("VAELoader", ["flux2-vae.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS["flux2-klein-4b"])
    negative = g.add("ConditioningZeroOut", [], 1, conditioning=positive)
    _custom_sampling(g, 2, 4, engine, vae,
                     lambda c: g.add("CFGGuider", [1.0], c, model=engine.out(1), positive=positive, negative=negative))
    return g


def _krea2() -> Graph:
    """ComfyUI's Krea 2 Turbo template (image_krea2_turbo_t2i.json: one "Text to Image (Krea-2 Turbo)" subgraph,
    flattened here with the values its node sets): the Qwen3-VL 4B text encoder through CLIPLoader type krea2 ->
    CLIPTextEncode of the template's prompt -> positive, ConditioningZeroOut of it -> negative (unused at cfg 1);
    EmptyLatentImage 1024x1024; KSampler 8 steps, cfg 1, euler/simple with no sampling node (ModelSamplingFlux's
    1.15); VAELoader qwen_image_vae. The template's prompt enhancement (TextGenerate on the text encoder) and its style
    LoRA switch (off) are left out: the prompt is sampled as written."""
    g = Graph("krea-2", needs_comfyui="0.26.0")
    _version_note(g, 0, "Krea 2: its model and its Qwen3-VL text encoder under CLIPLoader type krea2")
    clip = g.add("CLIPLoader", ["qwen3vl_4b_fp8_scaled.safetensors", "krea2", "default"], 0)
    engine = _engine(g, "krea2_turbo_fp8_scaled.safetensors")
    vae = g.add("VAELoader", ["qwen_image_vae.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS["krea-2"], "CLIP Text Encode (Positive Prompt)")
    negative = g.add("ConditioningZeroOut", [], 1, conditioning=positive)
    latent = g.add("EmptyLatentImage", [1024, 1024, 1], 1)
    sampler = _xdit_sampler(g, 2, engine.out(1), positive, negative, latent, 8, 1.0)
    _finish(g, 3, engine, sampler, vae)
    return g


def _hunyuanvideo15(image: bool) -> Graph:
    """ComfyUI's HunyuanVideo 1.5 720p templates (video_hunyuan_video_1.5_720p_t2v.json, video_hunyuan_video_1.5_720p_
    i2v.json), their first pass (the t2v one's 1080p super-resolution pass, off there by default, is another model and
    left out, as their EasyCache nodes): Qwen2.5-VL and byT5 through DualCLIPLoader type hunyuan_video_15 ->
    CLIPTextEncode of the template's prompt and an empty negative; text to video from EmptyHunyuanVideo15Latent
    1280x720, 121 frames; image to video from HunyuanVideo15ImageToVideo (the same size, Load Image as its start image
    and, through Load CLIP Vision (SigLIP) and CLIP Vision Encode (center), its CLIP-vision output) on both prompts;
    ModelSamplingSD3 7 on the model, CFGGuider 6, BasicScheduler simple 20 steps, KSamplerSelect euler, RandomNoise,
    SamplerCustomAdvanced; VAELoader hunyuanvideo15_vae_fp16 (ComfyUI's own decode), Create Video at 24 fps."""
    kind = "i2v" if image else "t2v"
    g = Graph(f"hunyuanvideo-1.5-{kind}", needs_comfyui="0.3.71")
    _version_note(g, 0, "HunyuanVideo 1.5: its model, its latent and image-to-video nodes and DualCLIPLoader type "
                        "hunyuan_video_15")
    clip = g.add("DualCLIPLoader", ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "byt5_small_glyphxl_fp16.safetensors",
                                    "hunyuan_video_15", "default"], 0)
    engine = _engine(g, f"hunyuanvideo1.5_720p_{kind}_fp16.safetensors")
    vae = g.add("VAELoader", ["hunyuanvideo15_vae_fp16.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, "", "CLIP Text Encode (Negative Prompt)", EMPTY_PROMPT_BOX)
    if image:
        picture = g.add("LoadImage", ["example.png", "image"], 1, size=LOAD_BOX)
        vision = g.add("CLIPVisionLoader", ["sigclip_vision_patch14_384.safetensors"], 1)
        encoded = g.add("CLIPVisionEncode", ["center"], 2, clip_vision=vision, image=picture)
        conditioned = g.add("HunyuanVideo15ImageToVideo", [1280, 720, 121, 1], 2, positive=positive,
                            negative=negative, vae=vae, start_image=picture, clip_vision_output=encoded)
        positive, negative, latent = conditioned.out(0), conditioned.out(1), conditioned.out(2)
        column = 3
    else:
        latent = g.add("EmptyHunyuanVideo15Latent", [1280, 720, 121, 1], 1)
        column = 2
    shifted = g.add("ModelSamplingSD3", [7.0], column, model=engine.out(1))
    guider = g.add("CFGGuider", [6.0], column, model=shifted, positive=positive, negative=negative)
    select = g.add("KSamplerSelect", ["euler"], column)
    sigmas = g.add("BasicScheduler", ["simple", 20, 1.0], column, model=shifted)
    noise = g.add("RandomNoise", [SEED, "fixed"], column)
    sampler = g.add("SamplerCustomAdvanced", [], column + 1, noise=noise, guider=guider, sampler=select,
                    sigmas=sigmas, latent_image=latent)
    _video_finish(g, column + 2, engine, sampler.out(0), vae, 24.0)
    return g


def _video_finish(g, column, engine, latent, vae, fps):
    """The Wan templates' end: VAE Decode -> Create Video at the template's fps -> Save Video; the Info node on the
    engine, run after the (last) sampler."""
    decode = g.add("VAEDecode", [], column, samples=latent, vae=vae)
    video = g.add("CreateVideo", [fps, 8], column, images=decode)
    _info(g, column, engine, latent)
    g.add("SaveVideo", [f"xDiT/{g.name}", "auto", "auto"], column + 1, size=SAVE_BOX, video=video)


def _engine_vae(g, name, engine, column=0):
    """The xDiT VAE Loader in Load VAE's place: the same VAE file, its decode and encode on the engine's ranks."""
    return g.add("XDiTVAELoader", [name], column, engine=engine.out(0))


def _umt5(g):
    return g.add("CLIPLoader", ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default"], 0)


def _wan_prompts(g, clip, negative=None):
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    return positive, _prompt(g, 1, clip, negative or NEGATIVE_WAN, "CLIP Text Encode (Negative Prompt)")


def _wan21_t2v() -> Graph:
    """ComfyUI's Wan 2.1 text-to-video template (text_to_video_wan.json, the 1.3B model): umT5 through CLIPLoader type
    wan, ModelSamplingSD3 8 on the model, EmptyHunyuanLatentVideo 832x480, 33 frames, 30 uni_pc/simple steps at cfg
    6, Create Video at 16 fps -> Save Video."""
    g = Graph("wan2.1-t2v-1.3b")
    clip = _umt5(g)
    engine = _engine(g, "wan2.1_t2v_1.3B_fp16.safetensors")
    vae = _engine_vae(g, "wan_2.1_vae.safetensors", engine)
    positive, negative = _wan_prompts(g, clip)
    shifted = g.add("ModelSamplingSD3", [8.0], 1, model=engine.out(1))
    latent = g.add("EmptyHunyuanLatentVideo", [832, 480, 33, 1], 1)
    sampler = _xdit_sampler(g, 2, shifted, positive, negative, latent, 30, 6.0, sampler="uni_pc")
    _video_finish(g, 3, engine, sampler, vae, 16.0)
    return g


NOISE = ("high", "low")   # the Wan 2.2 A14B experts, in the order they sample


def _wan22_a14b(image: bool) -> Graph:
    """ComfyUI's Wan 2.2 A14B templates (video_wan2_2_14B_t2v.json, video_wan2_2_14B_i2v.json; their fp8_scaled
    group, without the 4-step LoRAs): each expert's model through ModelSamplingSD3 8 into a KSamplerAdvanced, 20
    euler/simple steps at cfg 3.5, the high-noise expert from step 0 to 10 adding noise and returning the leftover
    noise, the low-noise expert from 10 to the end on its latent without adding noise; 640x640, 81 frames, Create
    Video at 16 fps. Text to video starts from EmptyHunyuanLatentVideo; image to video from WanImageToVideo's latent
    and conditioning on the start image (Wan 2.2 takes no CLIP vision). Here both experts are xDiT Engines on the
    same GPUs: one rank group keeps both loaded."""
    kind = "i2v" if image else "t2v"
    g = Graph(f"wan2.2-{kind}-a14b")
    clip = _umt5(g)
    experts = {noise: _engine(g, f"wan2.2_{kind}_{noise}_noise_14B_fp8_scaled.safetensors") for noise in NOISE}
    for noise, engine in experts.items():
        engine.title = f"xDiT Engine ({noise} noise expert)"
    vae = _engine_vae(g, "wan_2.1_vae.safetensors", experts["high"])   # both experts' engine: one rank group
    positive, negative = _wan_prompts(g, clip, None if image else NEGATIVE_WAN + "，裸露，NSFW")
    shifted = {noise: g.add("ModelSamplingSD3", [8.0], 1, model=engine.out(1)) for noise, engine in experts.items()}
    if image:
        picture = g.add("LoadImage", ["example.png", "image"], 1, size=LOAD_BOX)
        start = g.add("WanImageToVideo", [640, 640, 81, 1], 2, positive=positive, negative=negative, vae=vae,
                      start_image=picture)
        positive, negative, latent, column = start.out(0), start.out(1), start.out(2), 3
    else:
        latent, column = g.add("EmptyHunyuanLatentVideo", [640, 640, 81, 1], 1), 2
    steps = {"high": ["enable", SEED, "fixed", 20, 3.5, "euler", "simple", 0, 10, "enable"],
             "low": ["disable", 0, "fixed", 20, 3.5, "euler", "simple", 10, 10000, "disable"]}
    for noise in NOISE:   # the low-noise expert continues the high-noise one's latent
        latent = g.add("XDiTSamplerAdvanced", steps[noise], column, f"xDiT Sampler (Advanced, {noise} noise)",
                       positive=positive, negative=negative, latent_image=latent, model=shifted[noise])
    _video_finish(g, column + 1, experts["low"], latent, vae, 16.0)
    return g


def _wan22_ti2v_5b() -> Graph:
    """ComfyUI's Wan 2.2 TI2V-5B template (video_wan2_2_5B_ti2v.json) with its start image: Wan22ImageToVideoLatent
    1280x704, 121 frames (the image's latent and a noise mask on its frames; the Wan 2.2 VAE), ModelSamplingSD3 8, 20
    uni_pc/simple steps at cfg 5, Create Video at 24 fps."""
    g = Graph("wan2.2-ti2v-5b")
    clip = _umt5(g)
    engine = _engine(g, "wan2.2_ti2v_5B_fp16.safetensors")
    vae = _engine_vae(g, "wan2.2_vae.safetensors", engine)
    picture = g.add("LoadImage", ["example.png", "image"], 0, size=LOAD_BOX)
    positive, negative = _wan_prompts(g, clip)
    shifted = g.add("ModelSamplingSD3", [8.0], 1, model=engine.out(1))
    latent = g.add("Wan22ImageToVideoLatent", [1280, 704, 121, 1], 1, vae=vae, start_image=picture)
    sampler = _xdit_sampler(g, 2, shifted, positive, negative, latent, 20, 5.0, sampler="uni_pc")
    _video_finish(g, 3, engine, sampler, vae, 24.0)
    return g


def _wan_animate2() -> Graph:
    """ComfyUI's "Wan Animate 2 Distilled: Motion Transfer" template (video_wan_animate2_distilled.json: its first
    "Motion Transfer (Wan Animate 2 Distilled)" subgraph flattened, each node with the value the subgraph node gives
    it) with UNETLoader swapped for the xDiT Engine (the template's distilled int8 ConvRot file). Load Image (the
    reference) and Load Video (the driving video) -> Get Video Components; the driving frames resized to 482x854
    (Resize Image/Mask: scale dimensions, center crop, area), their size (Get Image Size) the reference image's
    resize and WanAnimate2ToVideo's width and height; umT5 through CLIPLoader type wan for the character prompt, the
    Wan negative and the pose prompt; CLIP Vision Encode (clip_vision_h, crop none) of the resized reference and of
    the first resized driving frame (Get Image from Batch 0, 1); the xDiT VAE Loader (Wan2_1_VAE_bf16) on the engine;
    WanAnimate2ToVideo 81 frames, batch 1, offset 0, strengths 1 / 0 / 1 / 1; the engine's MODEL -> ModelSamplingSD3
    5 -> SamplerCustom (noise on, cfg 1) with KSamplerSelect lcm and BasicScheduler simple 10 steps (on the model
    before the shift, as there); TrimVideoLatent by WanAnimate2ToVideo's trim_latent (the reference frame) -> VAE
    Decode -> Create Video at the driving video's fps with its audio -> Save Video. Left out: WanAnimate2Cache (the
    engine runs the pose branch on its ranks every step), the ContextWindowsManual switch (off there), the bypassed
    second segment and the Video Stitch side-by-side subgraph; the seed fixed (42) where the template draws it."""
    g = Graph("wan-animate-2", needs_comfyui="0.31.0")
    _version_note(g, 0, "Wan-Animate 2: its model and WanAnimate2ToVideo",
                  "The template's WanAnimate2Cache is left out: the engine runs the pose branch on its ranks every "
                  "step. One segment of 81 frames; the template's second one and its side-by-side video are left "
                  "out.", size=(400, 200))
    clip = _umt5(g)
    engine = _engine(g, "wan_animate_2_distill_int8_convrot.safetensors")
    vae = _engine_vae(g, "Wan2_1_VAE_bf16.safetensors", engine)
    vision = g.add("CLIPVisionLoader", ["clip_vision_h.safetensors"], 0)
    reference = g.add("LoadImage", ["ref_doll_realistic.png", "image"], 1, "Load Image (Reference Image)",
                      size=LOAD_BOX)
    driving = g.add("LoadVideo", ["drive_doll_street_dance.mp4", "image"], 1, "Load Video (Pose Video)",
                    size=LOAD_BOX)
    components = g.add("GetVideoComponents", [], 1, video=driving)
    positive = _prompt(g, 2, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 2, clip, NEGATIVE_WAN, "CLIP Text Encode (Negative Prompt)")
    pose = _prompt(g, 2, clip, POSE_PROMPT_ANIMATE2, "CLIP Text Encode (Pose Prompt)")
    pose_video = g.add("ResizeImageMaskNode", ["scale dimensions", 482, 854, "center", "area"], 3,
                       input=components.out(0))
    size = g.add("GetImageSize", [], 3, image=pose_video)
    picture = g.add("ResizeImageMaskNode", ["scale dimensions", 482, 854, "center", "area"], 3, input=reference,
                    **{"resize_type.width": size.out(0), "resize_type.height": size.out(1)})
    first = g.add("ImageFromBatch", [0, 1], 3, image=pose_video)
    seen = g.add("CLIPVisionEncode", ["none"], 4, clip_vision=vision, image=picture)
    seen_pose = g.add("CLIPVisionEncode", ["none"], 4, clip_vision=vision, image=first)
    animate = g.add("WanAnimate2ToVideo", [832, 480, 81, 1, 0, 1.0, 0.0, 1.0, 1.0], 4, positive=positive,
                    negative=negative, vae=vae, reference_image=picture, pose_video=pose_video,
                    clip_vision_output=seen, positive_pose=pose, clip_vision_output_pose=seen_pose,
                    width=size.out(0), height=size.out(1))
    shifted = g.add("ModelSamplingSD3", [5.0], 4, model=engine.out(1))
    select = g.add("KSamplerSelect", ["lcm"], 4)
    sigmas = g.add("BasicScheduler", ["simple", 10, 1.0], 4, model=engine.out(1))
    sampler = g.add("SamplerCustom", [True, SEED, "fixed", 1.0], 5, model=shifted, positive=animate.out(0),
                    negative=animate.out(1), sampler=select, sigmas=sigmas, latent_image=animate.out(2))
    trimmed = g.add("TrimVideoLatent", [0], 5, samples=sampler.out(0), trim_amount=animate.out(3))
    decode = g.add("VAEDecode", [], 5, samples=trimmed, vae=vae)
    _info(g, 5, engine, sampler.out(0))
    video = g.add("CreateVideo", [30.0, 8], 6, images=decode, audio=components.out(1), fps=components.out(2))
    g.add("SaveVideo", [f"xDiT/{g.name}", "auto", "auto"], 6, size=SAVE_BOX, video=video)
    return g


H3_PROMPT_BOX = (430, 550)    # the MiniMax-H3 templates' MiniMaxH3ImageToVideo: room for their long prompts


def _minimax_h3(image: bool) -> Graph:
    """ComfyUI's MiniMax-H3 templates (video_minimax_h3_t2v.json, video_minimax_h3_i2v.json: one "Image to Video
    (MiniMax H3)" subgraph, flattened here with the values its node sets): the Qwen3-VL text encoder through
    CLIPLoader type minimax, MiniMaxH3ImageToVideo (prompt, the video VAE; text to video without images, image to
    video with Load Image on first_frame) giving the conditioning and the empty audio + video latent; the model through
    the 8-step turbo LoRA (LoraLoaderModelOnly, strength 1) into BasicGuider and BasicScheduler (simple, 8 steps),
    RandomNoise, KSamplerSelect res_multistep, SamplerCustomAdvanced; VAE Decode (video VAE) and VAE Decode Audio
    (audio VAE) into Create Video at 24 fps -> Save Video. The templates' helper nodes are their values here:
    ResolutionSelector (16:9 or 1:1 at 0.4 megapixels, multiples of 32: 864x480, 640x640), the duration of 5 s
    through ComfyMathExpression (124 frames, the 17k + 5 grid), the turbo switch on (the LoRA and its 8 steps)."""
    kind = "i2v" if image else "t2v"
    g = Graph(f"minimax-h3-{kind}", needs_comfyui="0.33.0")
    _version_note(g, 0, "MiniMax-H3: MiniMaxH3ImageToVideo, its Qwen3-VL text encoder under CLIPLoader type minimax "
                        "and its audio VAE")
    clip = g.add("CLIPLoader", ["qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "minimax", "default"], 0)
    engine = _engine(g, "minimax_h3_fl2va_pruned_int8_convrot.safetensors")
    video_vae = _engine_vae(g, "minimax_h3_video_vae_fp16.safetensors", engine)   # its tiles over the ranks
    audio_vae = g.add("VAELoader", ["minimax_h3_audio_vae_fp32.safetensors"], 0)
    turbo = g.add("LoraLoaderModelOnly", ["minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1.0], 1,
                  model=engine.out(1))
    frames = {"first_frame": g.add("LoadImage", ["example.png", "image"], 1, size=LOAD_BOX)} if image else {}
    width, height = (640, 640) if image else (864, 480)
    av = g.add("MiniMaxH3ImageToVideo", [PROMPTS[g.name], width, height, 124], 2, size=H3_PROMPT_BOX, clip=clip,
               vae=video_vae, **frames)
    noise = g.add("RandomNoise", [SEED, "fixed"], 3)
    guider = g.add("BasicGuider", [], 3, model=turbo, conditioning=av.out(0))
    select = g.add("KSamplerSelect", ["res_multistep"], 3)
    sigmas = g.add("BasicScheduler", ["simple", 8, 1.0], 3, model=turbo)
    sampler = g.add("SamplerCustomAdvanced", [], 4, noise=noise, guider=guider, sampler=select, sigmas=sigmas,
                    latent_image=av.out(1))
    decode = g.add("VAEDecode", [], 4, samples=sampler.out(0), vae=video_vae)
    audio = g.add("VAEDecodeAudio", [], 4, samples=sampler.out(0), vae=audio_vae)
    _info(g, 4, engine, sampler.out(0))
    video = g.add("CreateVideo", [24.0, 8], 5, images=decode, audio=audio)
    g.add("SaveVideo", [f"xDiT/{g.name}", "auto", "auto"], 5, size=SAVE_BOX, video=video)
    return g


LTX_CHECKPOINT = "ltx-2.3-22b-dev-fp8.safetensors"
NEGATIVE_LTX = "pc game, console game, video game, cartoon, childish, ugly"   # the LTX-2.3 templates' negative


def _ltx23_loaders(g: Graph, checkpoint: str):
    """The LTX-2.3 templates' first column: the note, the xDiT Checkpoint Loader in Load Checkpoint's place, the Gemma
    text encoder and the audio VAE from the same file. (loader, clip, audio VAE)"""
    _version_note(g, 0, "LTX-2.3: its audio-video latent nodes, LTXAVTextEncoderLoader and its audio VAE")
    loader = g.add("XDiTCheckpointLoader", [checkpoint, "auto", "default", GPUS, "auto", 1, 1, False, 1, 3600, 0.0,
                                            False, "auto", 1, 0, 1, "auto", 1], 0)
    # (room below it: ComfyUI 0.3.64's frontend draws this node, which it lacks, a widget row taller)
    clip = g.add("LTXAVTextEncoderLoader", ["gemma_3_12B_it_fp4_mixed.safetensors", checkpoint, "default"], 0,
                 room=(0, 180))
    return loader, clip, g.add("LTXVAudioVAELoader", [checkpoint], 0)


def _ltx23_end(g: Graph, column: int, loader, audio_vae, video, audio, after, tiling: list, info_column: int) -> None:
    """The LTX-2.3 templates' last columns: VAE Decode (Tiled, the template's `tiling`) with the loader's VAE and LTXV
    Audio VAE Decode in `column`, Info after the last sampler in `info_column`, Create Video at 25 fps and Save Video
    in the next."""
    decode = g.add("VAEDecodeTiled", tiling, column, samples=video, vae=loader.out(2))
    sound = g.add("LTXVAudioVAEDecode", [], column, samples=audio, audio_vae=audio_vae)
    g.add("XDiTEngineInfo", [False], info_column, room=INFO_REPORT_BOX, engine=loader.out(3), after=after)
    clip_out = g.add("CreateVideo", [25.0, 8], column + 1, images=decode, audio=sound)
    g.add("SaveVideo", [f"xDiT/{g.name}", "auto", "auto"], column + 1, size=SAVE_BOX, video=clip_out)


def _ltx23(image: bool) -> Graph:
    """ComfyUI's LTX-2.3 templates (0.33.0: blueprints/Text to Video (LTX-2.3).json, Image to Video (LTX-2.3).json:
    one subgraph each, flattened here with the values its nodes get) with CheckpointLoaderSimple swapped for the xDiT
    Checkpoint Loader (its MODEL, CLIP and VAE outputs in the same places). Gemma 3 through LTXAVTextEncoderLoader,
    the distilled LoRA at 0.5 on the model for both passes, LTXVConditioning at 25 fps; pass 1 at half size (640x352
    for the template's 1280x720: the same 20 x 11 latent as its 640 x 360) on the empty video and audio latents
    (LTXVEmptyLatentAudio, 126 frames: 5 s at 25 fps + 1; the video's 121 gives the same 16 latent frames as 126),
    CFGGuider cfg 1, euler_ancestral_cfg_pp, ManualSigmas of 8 steps; LTXVLatentUpsampler x2 on its video, pass 2 on
    it with pass 1's audio, LTXVCropGuides, euler_cfg_pp, ManualSigmas of 3 steps; VAE Decode (Tiled) and LTXV Audio
    VAE Decode into Create Video at 25 fps -> Save Video. Image to video puts the image in both passes' first frame
    (LTXVImgToVideoInplace at 0.7, then 1.0) after LTXVPreprocess (compression 18); the text-to-video template runs
    those nodes bypassed, so they are left out here. The image is scaled to 1280x720 by Upscale Image (lanczos, center
    crop) where the template uses Resize Image/Mask (scale dimensions, center, lanczos) and the deprecated Resize
    Images by Longer Edge (1536). Seeds fixed (42) where the template draws pass 1's at random."""
    kind = "i2v" if image else "t2v"
    g = Graph(f"ltx-2.3-{kind}", needs_comfyui="0.33.0")
    loader, clip, audio_vae = _ltx23_loaders(g, LTX_CHECKPOINT)
    upscaler = g.add("LatentUpscaleModelLoader", ["ltx-2.3-spatial-upscaler-x2-1.1.safetensors"], 0)
    vae = loader.out(2)
    lora = g.add("LoraLoaderModelOnly", ["ltx-2.3-22b-distilled-lora-384.safetensors", 0.5], 1, model=loader.out(0))
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, NEGATIVE_LTX, "CLIP Text Encode (Negative Prompt)", EMPTY_PROMPT_BOX)
    if image:
        picture = g.add("LoadImage", ["example.png", "image"], 1, size=LOAD_BOX)
        scaled = g.add("ImageScale", ["lanczos", 1280, 720, "center"], 1, image=picture)
        frame = g.add("LTXVPreprocess", [18], 1, image=scaled)
    conditioning = g.add("LTXVConditioning", [25.0], 2, positive=positive, negative=negative)
    video = g.add("EmptyLTXVLatentVideo", [640, 352, 121, 1], 2)
    if image:
        video = g.add("LTXVImgToVideoInplace", [0.7, False], 2, vae=vae, image=frame, latent=video)
    audio = g.add("LTXVEmptyLatentAudio", [126, 25.0, 1], 2, audio_vae=audio_vae)
    first = g.add("LTXVConcatAVLatent", [], 2, video_latent=video, audio_latent=audio)
    passes = {}
    for n, column, sampler, sigmas in ((1, 3, "euler_ancestral_cfg_pp",
                                        "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"),
                                       (2, 5, "euler_cfg_pp", "0.85, 0.7250, 0.4219, 0.0")):
        if n == 1:
            pos, neg, latent = conditioning.out(0), conditioning.out(1), first
        else:
            split = passes[1]
            upscaled = g.add("LTXVLatentUpsampler", [], 4, samples=split.out(0), upscale_model=upscaler, vae=vae)
            if image:
                upscaled = g.add("LTXVImgToVideoInplace", [1.0, False], 4, vae=vae, image=frame, latent=upscaled)
            latent = g.add("LTXVConcatAVLatent", [], 4, video_latent=upscaled, audio_latent=split.out(1))
            crop = g.add("LTXVCropGuides", [], 4, positive=conditioning.out(0), negative=conditioning.out(1),
                         latent=split.out(0))
            pos, neg = crop.out(0), crop.out(1)
        noise = g.add("RandomNoise", [SEED, "fixed"], column)
        guider = g.add("CFGGuider", [1.0], column, model=lora, positive=pos, negative=neg)
        select = g.add("KSamplerSelect", [sampler], column)
        steps = g.add("ManualSigmas", [sigmas], column)
        sampled = g.add("SamplerCustomAdvanced", [], column, f"SamplerCustomAdvanced (pass {n})", noise=noise,
                        guider=guider, sampler=select, sigmas=steps, latent_image=latent)
        passes[n] = g.add("LTXVSeparateAVLatent", [], column, av_latent=sampled)
    last = passes[2]
    _ltx23_end(g, 6, loader, audio_vae, last.out(0), last.out(1), sampled, [768, 64, 4096, 4], info_column=6)
    return g


LTX_DISTILLED = "ltx-2.3-22b-distilled-fp8.safetensors"
# the First-Last-Frame template's negative prompt (its CLIP Text Encode node's text)
NEGATIVE_LTX_FLF = (
    "blurry, out of focus, overexposed, underexposed, low contrast, washed out colors, excessive noise, grainy texture, "
    "poor lighting, flickering, motion blur, distorted proportions, unnatural skin tones, deformed facial features, "
    "asymmetrical face, missing facial features, extra limbs, disfigured hands, wrong hand count, artifacts around "
    "text, unreadable text on shirt or hat, incorrect lettering on cap (\u201cPNTR\u201d), incorrect t-shirt slogan "
    "(\u201cJUST DO IT\u201d), missing microphone, misplaced microphone, inconsistent perspective, camera shake, "
    "incorrect depth of field, background too sharp, background clutter, distracting reflections, harsh shadows, "
    "inconsistent lighting direction, color banding, cartoonish rendering, 3D CGI look, unrealistic materials, uncanny "
    "valley effect, incorrect ethnicity, wrong gender, exaggerated expressions, smiling, laughing, exaggerated sadness, "
    "wrong gaze direction, eyes looking at camera, mismatched lip sync, silent or muted audio, distorted voice, robotic "
    "voice, echo, background noise, off-sync audio, missing sniff sounds, incorrect dialogue, added dialogue, "
    "repetitive speech, jittery movement, awkward pauses, incorrect timing, unnatural transitions, inconsistent "
    "framing, tilted camera, missing door or shelves, missing shallow depth of field, flat lighting, inconsistent tone, "
    "cinematic oversaturation, stylized filters, or AI artifacts.")


def _ltx23_flf() -> Graph:
    """ComfyUI's LTX-2.3 First-Last-Frame template (0.33.0: blueprints/First-Last-Frame to Video (LTX-2.3).json, one
    subgraph, flattened with the values its nodes get) with CheckpointLoaderSimple swapped for the xDiT Checkpoint
    Loader: the distilled fp8 file for the model, text projection, audio VAE and VAE; LTXVConditioning at 25 fps; the
    empty video at the images' size (1280x704 for their 1280x720: the same 40 x 22 latent, 720 is off the widget's
    step) and the empty audio (126 frames: 5 s at 25 fps + 1); LTXVAddGuide puts the
    first image at frame 0 and then the last at frame -1, each at strength 0.7, after LTXVPreprocess (compression 25);
    one pass: CFGGuider cfg 1, SamplerEulerAncestral (eta 0, s_noise 1), ManualSigmas of 8 steps; LTXVSeparateAVLatent,
    LTXVCropGuides takes the guide frames off the video; VAE Decode (Tiled) and LTXV Audio VAE Decode into Create Video
    at 25 fps. The images are scaled to 1280x720 by Upscale Image (nearest-exact, center crop) where the template uses
    Resize Image/Mask (scale dimensions, center, nearest-exact); the template's primitive and math nodes (width,
    height, duration, frame rate) are their values; video length 121 for 126 (the same 16 latent frames); the seed
    fixed (42) where the template draws it; both images ComfyUI's example.png (the template leaves them to the user)."""
    g = Graph("ltx-2.3-flf", needs_comfyui="0.33.0")
    loader, clip, audio_vae = _ltx23_loaders(g, LTX_DISTILLED)
    vae = loader.out(2)
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, NEGATIVE_LTX_FLF, "CLIP Text Encode (Negative Prompt)")
    frames = []
    for title in ("Load Image (first frame)", "Load Image (last frame)"):
        picture = g.add("LoadImage", ["example.png", "image"], 2, title, size=LOAD_BOX)
        scaled = g.add("ImageScale", ["nearest-exact", 1280, 720, "center"], 2, image=picture)
        frames.append(g.add("LTXVPreprocess", [25], 2, image=scaled))
    conditioning = g.add("LTXVConditioning", [25.0], 3, positive=positive, negative=negative)
    video = g.add("EmptyLTXVLatentVideo", [1280, 704, 121, 1], 3)
    first = g.add("LTXVAddGuide", [0, 0.7], 3, positive=conditioning.out(0), negative=conditioning.out(1), vae=vae,
                  latent=video, image=frames[0])
    last = g.add("LTXVAddGuide", [-1, 0.7], 3, positive=first.out(0), negative=first.out(1), vae=vae,
                 latent=first.out(2), image=frames[1])
    audio = g.add("LTXVEmptyLatentAudio", [126, 25.0, 1], 3, audio_vae=audio_vae)
    latent = g.add("LTXVConcatAVLatent", [], 3, video_latent=last.out(2), audio_latent=audio)
    noise = g.add("RandomNoise", [SEED, "fixed"], 4)
    guider = g.add("CFGGuider", [1.0], 4, model=loader, positive=last.out(0), negative=last.out(1))
    select = g.add("SamplerEulerAncestral", [0.0, 1.0], 4)
    steps = g.add("ManualSigmas", ["1., 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"], 4)
    sampled = g.add("SamplerCustomAdvanced", [], 4, noise=noise, guider=guider, sampler=select, sigmas=steps,
                    latent_image=latent)
    split = g.add("LTXVSeparateAVLatent", [], 5, av_latent=sampled)
    crop = g.add("LTXVCropGuides", [], 5, positive=last.out(0), negative=last.out(1), latent=split.out(0))
    _ltx23_end(g, 5, loader, audio_vae, crop.out(2), split.out(1), sampled, [768, 64, 4096, 64], info_column=6)
    return g


LTX25_MODEL = "ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors"
LTX25_SIGMAS = ("1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0", "0.85, 0.7250, 0.4219, 0.0")


def _ltx25_loaders(g: Graph):
    """The LTX-2.5 templates' loaders, the xDiT Engine in UNETLoader's place: (clip, engine, video VAE, audio VAE)."""
    _version_note(g, 0, "LTX-2.5: LTXVDualCFGGuider, its Gemma 4 text encoder under CLIPLoader type ltxv and its "
                        "audio-video latent nodes")
    clip = g.add("CLIPLoader", ["gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors", "ltxv", "default"], 0)
    engine = _engine(g, LTX25_MODEL)
    return clip, engine, _engine_vae(g, "ltx-2.5-video-vae-bf16.safetensors", engine), \
        g.add("VAELoader", ["ltx-2.5-audio-vae-bf16.safetensors"], 0)


def _ltx25_end(g: Graph, column: int, engine, video_vae, audio_vae, video, audio, after, info_column: int) -> None:
    """The LTX-2.5 templates' last columns: VAE Decode (Tiled, 512 / 64 / 64 / 16) and LTXV Audio VAE Decode, Info
    after the last sampler, Create Video at 24 fps and Save Video."""
    decode = g.add("VAEDecodeTiled", [512, 64, 64, 16], column, samples=video, vae=video_vae)
    sound = g.add("LTXVAudioVAEDecode", [], column, samples=audio, audio_vae=audio_vae)
    _info(g, info_column, engine, after)
    clip_out = g.add("CreateVideo", [24.0, 8], column + 1, images=decode, audio=sound)
    g.add("SaveVideo", [f"xDiT/{g.name}", "auto", "auto"], column + 1, size=SAVE_BOX, video=clip_out)


def _ltx25(image: bool) -> Graph:
    """ComfyUI's LTX-2.5 templates (video_ltx2_5_t2v.json, video_ltx2_5_i2v.json: one subgraph each, flattened with
    the values its nodes get) with UNETLoader swapped for the xDiT Engine (the templates' distilled int8 ConvRot
    file): Gemma 4 12B with the LTX-2.5 projection through CLIPLoader (type ltxv) -> the prompt and the templates'
    negative -> LTXVConditioning 24 fps; the engine's MODEL -> both passes' LTXVDualCFGGuider (video 1, audio 1).
    Pass 1 at half size (640x352 for the template's 1280x720: the same 20 x 11 latent as its 640 x 360) on the empty
    video and audio latents (121 frames at 24 fps: 5 s + 1), euler_ancestral, ManualSigmas of 8 steps;
    LTXVLatentUpsampler x2 on its video (the video VAE), pass 2 on it with pass 1's audio, euler_ancestral,
    ManualSigmas of 3 steps; VAE Decode (Tiled) and LTXV Audio VAE Decode into Create Video at 24 fps -> Save Video.
    Image to video puts the image in both passes' first frame (LTXVImgToVideoInplace at 0.7, then 1.0) after LTXV
    Preprocess (18); the image is scaled to 1280x720 by Upscale Image (lanczos, center crop) where the template scales
    its longer side to 1536 by Resize Image/Mask. The templates' prompt enhancer (off by default) is left out, and
    their helper nodes are their values; seeds fixed (42) where the template draws pass 1's at random."""
    kind = "i2v" if image else "t2v"
    g = Graph(f"ltx-2.5-{kind}", needs_comfyui="0.33.0")
    clip, engine, video_vae, audio_vae = _ltx25_loaders(g)
    upscaler = g.add("LatentUpscaleModelLoader", ["ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors"], 0)
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, NEGATIVE_LTX, "CLIP Text Encode (Negative Prompt)", EMPTY_PROMPT_BOX)
    if image:
        picture = g.add("LoadImage", ["example.png", "image"], 1, size=LOAD_BOX)
        scaled = g.add("ImageScale", ["lanczos", 1280, 720, "center"], 1, image=picture)
        frame = g.add("LTXVPreprocess", [18], 1, image=scaled)
    conditioning = g.add("LTXVConditioning", [24.0], 2, positive=positive, negative=negative)
    video = g.add("EmptyLTXVLatentVideo", [640, 352, 121, 1], 2)
    if image:
        video = g.add("LTXVImgToVideoInplace", [0.7, False], 2, vae=video_vae, image=frame, latent=video)
    audio = g.add("LTXVEmptyLatentAudio", [121, 24.0, 1], 2, audio_vae=audio_vae)
    latent = g.add("LTXVConcatAVLatent", [], 2, video_latent=video, audio_latent=audio)
    split = None
    for n, column, sigmas in ((1, 3, LTX25_SIGMAS[0]), (2, 5, LTX25_SIGMAS[1])):
        if n == 2:
            upscaled = g.add("LTXVLatentUpsampler", [], 4, samples=split.out(0), upscale_model=upscaler,
                             vae=video_vae)
            if image:
                upscaled = g.add("LTXVImgToVideoInplace", [1.0, False], 4, vae=video_vae, image=frame, latent=upscaled)
            latent = g.add("LTXVConcatAVLatent", [], 4, video_latent=upscaled, audio_latent=split.out(1))
        noise = g.add("RandomNoise", [SEED, "fixed"], column)
        guider = g.add("LTXVDualCFGGuider", [1.0, 1.0], column, model=engine.out(1), positive=conditioning.out(0),
                       negative=conditioning.out(1))
        select = g.add("KSamplerSelect", ["euler_ancestral"], column)
        steps = g.add("ManualSigmas", [sigmas], column)
        sampled = g.add("SamplerCustomAdvanced", [], column, f"SamplerCustomAdvanced (pass {n})", noise=noise,
                        guider=guider, sampler=select, sigmas=steps, latent_image=latent)
        split = g.add("LTXVSeparateAVLatent", [], column, av_latent=sampled)
    _ltx25_end(g, 6, engine, video_vae, audio_vae, split.out(0), split.out(1), sampled, info_column=6)
    return g


def _ltx25_flf() -> Graph:
    """ComfyUI's LTX-2.5 First-Last-Frame template (video_ltx2_5_flf2v.json, one subgraph, flattened with the values
    its nodes get) with UNETLoader swapped for the xDiT Engine: Gemma 4 as in ltx-2.5-t2v, the template's long
    negative; the images scaled to 640x360 by Upscale Image (nearest-exact, center crop; the template's Resize
    Image/Mask) -> LTXV Preprocess (18); LTXVConditioning 24 fps; the empty video at the images' size (640x352: the
    same 20 x 11 latent, 360 is off the widget's step) and 121 frames, the empty audio (121 frames at 24 fps);
    LTXVAddGuide puts the first image at frame 0 and then the last at frame -1, each at 0.7; one pass:
    LTXVDualCFGGuider (video 1, audio 1), SamplerEulerAncestral (eta 0, s_noise 1), ManualSigmas of 8 steps;
    LTXVSeparateAVLatent, LTXVCropGuides takes the guide frames off the video; VAE Decode (Tiled) and LTXV Audio VAE
    Decode into Create Video at 24 fps. The seed fixed (42) where the template draws it; both images ComfyUI's
    example.png (the template ships its own)."""
    g = Graph("ltx-2.5-flf", needs_comfyui="0.33.0")
    clip, engine, video_vae, audio_vae = _ltx25_loaders(g)
    positive = _prompt(g, 1, clip, PROMPTS[g.name], "CLIP Text Encode (Positive Prompt)")
    negative = _prompt(g, 1, clip, NEGATIVE_LTX_FLF, "CLIP Text Encode (Negative Prompt)")
    frames = []
    for title in ("Load Image (first frame)", "Load Image (last frame)"):
        picture = g.add("LoadImage", ["example.png", "image"], 2, title, size=LOAD_BOX)
        scaled = g.add("ImageScale", ["nearest-exact", 640, 360, "center"], 2, image=picture)
        frames.append(g.add("LTXVPreprocess", [18], 2, image=scaled))
    conditioning = g.add("LTXVConditioning", [24.0], 3, positive=positive, negative=negative)
    video = g.add("EmptyLTXVLatentVideo", [640, 352, 121, 1], 3)
    first = g.add("LTXVAddGuide", [0, 0.7], 3, positive=conditioning.out(0), negative=conditioning.out(1),
                  vae=video_vae, latent=video, image=frames[0])
    last = g.add("LTXVAddGuide", [-1, 0.7], 3, positive=first.out(0), negative=first.out(1), vae=video_vae,
                 latent=first.out(2), image=frames[1])
    audio = g.add("LTXVEmptyLatentAudio", [121, 24.0, 1], 3, audio_vae=audio_vae)
    latent = g.add("LTXVConcatAVLatent", [], 3, video_latent=last.out(2), audio_latent=audio)
    noise = g.add("RandomNoise", [SEED, "fixed"], 4)
    guider = g.add("LTXVDualCFGGuider", [1.0, 1.0], 4, model=engine.out(1), positive=last.out(0),
                   negative=last.out(1))
    select = g.add("SamplerEulerAncestral", [0.0, 1.0], 4)
    steps = g.add("ManualSigmas", [LTX25_SIGMAS[0]], 4)
    sampled = g.add("SamplerCustomAdvanced", [], 4, noise=noise, guider=guider, sampler=select, sigmas=steps,
                    latent_image=latent)
    split = g.add("LTXVSeparateAVLatent", [], 5, av_latent=sampled)
    crop = g.add("LTXVCropGuides", [], 5, positive=last.out(0), negative=last.out(1), latent=split.out(0))
    _ltx25_end(g, 5, engine, video_vae, audio_vae, crop.out(2), split.out(1), sampled, info_column=6)
    return g


PROMPTS = {
    "flux1-dev": "a red fox curled up asleep on a mossy stone in a misty pine forest at dawn, soft golden light, "
                 "shallow depth of field, highly detailed photograph",
    "flux1-dev-img2img": "the same scene repainted as a watercolor illustration, loose brush strokes, soft pastel "
                         "palette, paper texture",
    "flux1-kontext-dev": "change the weather to a snowy winter evening, keep the composition, the subject and the "
                         "camera angle unchanged",
    "sd3.5-large": "a cozy reading nook in a sunlit library, tall wooden bookshelves, a green velvet armchair, dust "
                   "motes in the light, a hand-lettered sign that reads \"QUIET PLEASE\", cinematic photograph",
    "qwen-image": "a tidy bookshop window at dusk, a hand-painted sign reading \"OPEN LATE\", warm light, rain on the "
                  "glass, photographed with a 35mm lens",
    "qwen-image-edit": "replace the sign's text with \"CLOSED\" and make it daytime; keep everything else unchanged",
    "flux2-dev": "a red fox sitting in tall grass at golden hour, shallow depth of field, photographed on 35mm film, "
                 "the words \"FLUX.2\" painted on a weathered wooden sign behind it",
    "flux2-dev-multi-reference": "the woman from image 1 wearing the jacket from image 2, standing on a rainy city "
                                 "street at night, neon reflections on the wet pavement",
    # the Krea 2 Turbo template's own prompt
    "krea-2": "A high-resolution, surreal digital illustration showing a human hand holding a martini glass. The "
              "image is overlaid with whimsical, expressive ink-style doodles, including a cartoon figure inside "
              "the glass, a drawn citrus wedge on the rim, and various abstract sketches and faces surrounding "
              "the glass against a clean, white background. The style seamlessly blends a realistic, lit "
              "photograph with loose, hand-drawn marker artistry, creating a playful and artistic juxtaposition.",
    # the HunyuanVideo 1.5 720p text-to-video template's own prompt
    "hunyuanvideo-1.5-t2v": "A paper airplane released from the top of a skyscraper, gliding through urban canyons, "
                            "crossing traffic, flying over streets, spiraling upward between buildings. The camera "
                            "follows the paper airplane's perspective, shooting cityscape in first-person POV, finally "
                            "flying toward the sunset, disappearing in golden light. Creative camera movement, free "
                            "perspective, dreamlike colors.",
    # the HunyuanVideo 1.5 720p image-to-video template's own prompt
    "hunyuanvideo-1.5-i2v": "A feathered young dinosaur (with ruffled brown-and-white plumage, sharp claws, and a "
                            "spiky crested head) moves alertly through a sun-dappled, dense coniferous forest. "
                            "Sunbeams filter through the tall tree canopy, casting warm golden rays over the "
                            "mossy undergrowth and ferns. The dinosaur lifts one clawed foot mid-step, head "
                            "tilted sharply to scan for prey (or predators), its tail fanning slightly for "
                            "balance. The air glows with soft mist, and the forest hums with quiet "
                            "rustles\u2014small plants sway as it passes, and dappled light dances across its "
                            "textured feathers. The camera captures the dynamic, tense stillness of its movement, "
                            "emphasizing the lush, ancient wilderness and the creature\u2019s vivid, lifelike "
                            "details.",
    # the Wan Animate 2 Distilled template's character prompt (its "Character Prompt" text node, which the first
    # segment's positive prompt takes; the pose prompt is POSE_PROMPT_ANIMATE2)
    "wan-animate-2": ("Character appearance description: A realistic premium collectible action figure of a male "
                      "street dancer, lifelike matte vinyl and resin material with realistic skin-like paint finish, "
                      "detailed fabric folds on a black hoodie, dark cargo pants, white sneakers, subtle articulated "
                      "joints, premium designer toy craftsmanship, standing in a relaxed confident pose facing the "
                      "camera, full body from head to toe.\nBackground description: rainy neon-lit city street "
                      "corner at night, wet asphalt reflecting purple-blue and red neon signs, light mist, cinematic "
                      "night photography."),
    # the Wan templates' own prompts
    "wan2.1-t2v-1.3b": "a fox moving quickly in a beautiful winter scenery nature trees mountains daytime tracking "
                       "camera",
    "wan2.2-t2v-a14b": "Beautiful young European woman with honey blonde hair gracefully turning her head back over "
                       "shoulder, gentle smile, bright eyes looking at camera. Hair flowing in slow motion as she "
                       "turns. Soft natural lighting, clean background, cinematic slow-motion portrait.",
    "wan2.2-i2v-a14b": "The white dragon warrior stands still, eyes full of determination and strength. The camera "
                       "slowly moves closer or circles around the warrior, highlighting the powerful presence and "
                       "heroic spirit of the character.",
    "wan2.2-ti2v-5b": "Low contrast. In a retro 1970s-style subway station, a street musician plays in dim colors and "
                      "rough textures. He wears an old jacket, playing guitar with focus. Commuters hurry by, and a "
                      "small crowd gathers to listen. The camera slowly moves right, capturing the blend of music and "
                      "city noise, with old subway signs and mottled walls in the background.",
    # the MiniMax-H3 templates' own prompts (the text the subgraph node sets; the image-to-video one without its
    # trailing U+2028 line separator)
    "minimax-h3-t2v": ("Realistic live-action cinematic look, action movie trailer: practical film photography "
                       "style, a post-rain dusk metropolis, anamorphic lens, shallow depth of field, film grain, "
                       "city volumetric fog, flying-car traffic between the towers, restrained grading for a "
                       "premium feel, powerful natural movement.\n\n"
                       "Scene overview: at dusk on a cluster of skyscrapers, the protagonist is being chased, "
                       "sprinting and leaping across rooftops, jumping from one building's roof to the next with "
                       "pursuers closing in behind. This is the escape sequence of an action movie trailer: every "
                       "leap is life-or-death, thrilling and fluid.\n\n"
                       "Storyboard (each shot a separate scene, rapid cuts, all landing on the musical beats):\n"
                       "[0s-1.5s] Shot 1: high side angle: the protagonist sprinting at the roof edge, pursuers "
                       "appearing in the rooftop doorway behind him, wind catching his coat.\n"
                       "[1s-2.5s] Shot 2: the protagonist leaps across the gap between buildings, body stretching "
                       "mid-air, towers and flying-car light trails behind him, a slight slow-motion feel.\n"
                       "[2.5s-4s] Shot 3: he lands, rolls and rises, low-angle shot, tower shadows and fog behind "
                       "him, he keeps running.\n"
                       "[4s-5s] Shot 4: freeze: the instant he hits the edge of the next roof and launches into the "
                       "jump, silhouette, holding.\n\n"
                       "Camera: each shot its own angle, cuts clean and hard, no dissolves, a slight frame jitter "
                       "on the jumps.\n\n"
                       "Audio: wind, rapid footsteps, city ambience, low score underneath, an accent hit on each "
                       "leap, the score bursting at 4s, closing the last 1s.\n\n"
                       "No text, subtitles, logos or watermarks of any kind, no animation or cartoon rendering, no "
                       "overly-CG look, keep the live-action texture."),
    "ltx-2.3-t2v": ("A lighthouse keeper climbs the spiral stairs at dusk carrying a brass lantern; wind howls against "
                    "the windows and waves crash on the rocks below. Handheld camera following from behind, warm "
                    "lantern light against cold blue twilight. He says quietly: \"One more night.\""),
    "ltx-2.3-flf": ("From the first frame to the last: the camera drifts slowly forward through the scene as the light "
                    "shifts from morning to late afternoon; a light wind, birdsong, footsteps on gravel."),
    "ltx-2.3-i2v": ("The scene in the image comes to life: a slow push-in as leaves drift across the frame and a soft "
                    "breeze moves through the grass; birdsong and distant church bells in the background."),
    "minimax-h3-i2v": ("Editorial tech product film. The transparent gaming mouse from <Picture 1> in its original "
                       "scene: a pitch-black studio void with a dark, subtle reflective surface, lit by dramatic "
                       "duotone vibrant blue and warm neon orange rim lighting, deep soft shadow falloff into pure "
                       "black. Monochromatic dark palette with electric blue and amber accents. Material motif: "
                       "glowing internal metallic micro-components and glossy acrylic refractions. The environment "
                       "is constant throughout.\n"
                       "SHOT 1: The scene opens exactly on image 1, the mouse resting confidently on the dark "
                       "surface; the blue and orange lights slowly pulse brighter, refracting deeply through the "
                       "transparent acrylic shell as the camera executes a slow, deliberate push-in to reveal the "
                       "intricate circuitry.\n"
                       "SHOT 2: Cut to an extreme macro profile of the ridged scroll wheel and layered internal "
                       "micro-components; the camera glides slowly along the side as a sharp beam of warm orange "
                       "light sweeps across the metallic textures, contrasting perfectly against the deep blue "
                       "ambient glow.\n"
                       "SHOT 3: Cut to a low-angle beauty shot: the mouse levitates weightlessly a few centimeters "
                       "above the dark reflective surface, rotating in a slow, precise orbit; the duotone lighting "
                       "flares gently along the glassy transparent edges before fading slowly into a sleek "
                       "silhouette.\n"
                       "Audio: deep pulsing sub-bass room tone, sharp tactile mechanical clicks, a sweeping glassy "
                       "whoosh on cuts, and a rising electronic swell that resolves to near-silence on the final "
                       "fade."),

}
# the LTX-2.5 templates' own prompts (the text their subgraph node sets; the first-last-frame one without its trailing
# newline)
PROMPTS.update({
    "ltx-2.5-t2v": (
        "A close-up of an Arctic hunter's face, his eyes fixed straight ahead, narrowed and locked on something in the "
        "far distance directly in front of him, frost dusting his dark beard, one hand slowly reaching toward the "
        "rifle slung on his back, his breath quick and shallow, the tension in his jaw visible even through the "
        "scarf. The camera slowly pulls back, revealing him crouched at the edge of an ice floe, and ahead of him, in "
        "the exact direction of his gaze, a polar bear moves slowly along a distant ice ridge, its pale coat blending "
        "into the white haze, facing toward him. The pull-back continues, the hunter in the foreground and the bear "
        "far ahead, the two facing each other across the dark lead of water, the ice field and grey sea stretching "
        "around them, seabirds wheeling overhead. Midway through the shot, the complete title \"LTX-2.5\" fades in "
        "large and centered, plain white sans-serif letters with wide spacing, no glow, no shadow, no ornament, the "
        "lettering large enough to dominate the center of the frame, emerging slowly from the mist, resting still "
        "and blending into the snowscape, with the hunter and the bear still visible below on either side of the "
        "title, staying through the end of the scene. The wind carries the distant sound of shifting ice, a single "
        "low growl rolling across the water."),
    "ltx-2.5-i2v": (
        "Use the provided start image as the first frame. The cybernetic figure slowly turns his head to the right, "
        "his glowing blue eyes scanning the horizon, mechanical joints in his neck whirring faintly. The camera "
        "follows his gaze, panning across the rooftop to reveal the city beyond: a river of light winding between "
        "dark towers, a flying vehicle gliding past between the buildings, its lights streaking. He watches it pass, "
        "then his eyes narrow slightly. The camera settles on his profile against the city glow, distant hover "
        "traffic humming, wind gusting across the rooftop. No text, no black frames."),
    "ltx-2.5-flf": (
        "Use the provided start image as the first frame and the provided end image as the final frame anchor. The "
        "video opens on the back of the robotic hand, four fingers slightly curled, joints glowing faintly in the "
        "darkness, a low electrical hum filling the space. The hand rotates slowly at the wrist, turning from the "
        "back view toward the palm side, the four visible fingers uncurling gently one by one, starting with the "
        "index finger, then the middle, ring, and pinky, each joint clicking softly. As the palm turns upward, the "
        "thumb swings out from the side of the hand into view, clearly separate from the four fingers, all five "
        "fingers spreading open. A blue energy crystal fades into existence above the palm, its hum rising into a "
        "resonant tone, thin energy threads coiling around it, particles crackling softly as they spiral away like "
        "sparks. The crystal rotates slowly, hovering above the fully open hand, light spilling between the five "
        "spread fingers, the crystal's steady hum filling the silence as the video ends on the open palm with the "
        "glowing crystal."),
})
PROMPTS["flux1-schnell"] = PROMPTS["flux1-dev"]
PROMPTS["flux2-klein-4b"] = PROMPTS["flux2-dev"]
# the Wan Animate 2 Distilled template's pose prompt (its text node for the pose branch: the motion, not the looks)
POSE_PROMPT_ANIMATE2 = ("A man doing energetic street dance with popping body waves and fast spinning moves, rain "
                        "falling around him.")
NEGATIVE_SD35 = "blurry, low quality, jpeg artifacts, watermark, deformed, oversaturated"
# The Wan templates' negative prompt (the Wan 2.2 A14B text-to-video one adds "，裸露，NSFW")
NEGATIVE_WAN = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，"
                "残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，"
                "背景人很多，倒着走")


def graphs() -> list[Graph]:
    return [_flux1("flux1-dev", "flux1-dev.safetensors", 28),
            _flux1("flux1-schnell", "flux1-schnell.safetensors", 4, guidance=None),
            _sd35(),
            _flux1("flux1-dev-img2img", "flux1-dev.safetensors", 28, image=True, denoise=0.75),
            _kontext(), _qwen_image(), _qwen_image_edit(), _flux2_dev(), _flux2_dev(multi_reference=True),
            _flux2_klein(), _krea2(), _wan21_t2v(), _wan22_a14b(image=False), _wan22_a14b(image=True), _wan22_ti2v_5b(),
            _wan_animate2(), _hunyuanvideo15(image=False), _hunyuanvideo15(image=True), _minimax_h3(image=False),
            _minimax_h3(image=True), _ltx23(image=False), _ltx23(image=True), _ltx23_flf(), _ltx25(image=False),
            _ltx25(image=True), _ltx25_flf()]
