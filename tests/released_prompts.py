"""Prompts as users saved them with each released version of the pack (API format, as File > Export (API) writes
them): tests/released_inputs.json's input sets in a FLUX.1-dev graph. Data and builders only, so that both the pure
compatibility tests and the live check inside a real ComfyUI (tests/comfyui_live_check.py) use them."""
import json
import os

RELEASED = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "released_inputs.json")))["releases"]
WIDGETS = ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN")
TEXT_ENCODERS = ("t5xxl_fp16.safetensors", "clip_l.safetensors")
VAE = "ae.safetensors"


def released_value(node_id: str, name: str, entry: dict, model: str, lora: str):
    """What a prompt saved with that release holds for a widget: the release's default (files: the ones given)."""
    if name == "model_name":
        return model
    if name == "lora_name":
        return lora
    if node_id == "XDiTEngine" and name == "gpus":
        return "0"
    return entry["default"]


def release_prompt(release: dict, model: str, lora: str, custom_sampler: bool = False) -> dict:
    """A FLUX.1-dev API prompt (as File > Export (API) saves it) whose xDiT nodes carry exactly that release's inputs:
    text encoders, FluxGuidance and the empty latent feed the sampler, the LoRA (when released) sits between the
    engine and the sampler and the Info node reports after it. custom_sampler: the guider (when released) drives
    SamplerCustomAdvanced (RandomNoise, KSamplerSelect, KarrasScheduler) into a second image, so that ComfyUI, which
    validates only what leads to an output, validates it too."""
    nodes = release["nodes"]
    prompt = {
        "1": {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": TEXT_ENCODERS[0], "clip_name2": TEXT_ENCODERS[1],
                                                         "type": "flux"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 0]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 0]}},
        "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["2", 0], "guidance": 3.5}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "6": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
    }
    links = {"XDiTEngine": {}, "XDiTLoRA": {"engine": ["10", 0]},
             "XDiTSampler": {"engine": ["11", 0] if "XDiTLoRA" in nodes else ["10", 0], "positive": ["4", 0],
                             "negative": ["3", 0], "latent_image": ["5", 0]},
             # the sampling and CFGNorm nodes (a Qwen-Image graph's) on a side branch the Info node reports from
             "XDiTEngineInfo": {"engine": ["18", 0] if "XDiTCFGNorm" in nodes else ["10", 0], "after": ["12", 0]},
             "XDiTGuider": {"engine": ["10", 0], "positive": ["4", 0], "negative": ["3", 0]},
             "XDiTModelSampling": {"engine": ["10", 0]}, "XDiTCFGNorm": {"engine": ["17", 0]},
             "XDiTSaveConditioning": {"positive": ["4", 0]},
             "XDiTSamplerAdvanced": {"engine": ["10", 0], "positive": ["4", 0], "negative": ["3", 0],
                                     "latent_image": ["5", 0]}}
    ids = {"XDiTEngine": "10", "XDiTLoRA": "11", "XDiTSampler": "12", "XDiTEngineInfo": "13", "XDiTGuider": "14",
           "XDiTModelSampling": "17", "XDiTCFGNorm": "18", "XDiTSaveConditioning": "19",
           "XDiTSamplerAdvanced": "30"}
    for node_id, node in nodes.items():
        inputs = {}
        for name, entry in node["inputs"].items():
            if name in links[node_id]:
                inputs[name] = links[node_id][name]
            elif entry["type"] in WIDGETS:
                inputs[name] = released_value(node_id, name, entry, model, lora)
            elif entry.get("optional"):
                continue   # an optional socket (a MODEL): left unconnected
        prompt[ids[node_id]] = {"class_type": node_id, "inputs": inputs}
    if "XDiTSamplerAdvanced" in nodes:   # its own image, so that ComfyUI validates it too
        prompt["31"] = {"class_type": "VAEDecode", "inputs": {"samples": ["30", 0], "vae": ["6", 0]}}
        prompt["32"] = {"class_type": "SaveImage", "inputs": {"images": ["31", 0], "filename_prefix": "ComfyUI"}}
    prompt["15"] = {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["6", 0]}}
    prompt["16"] = {"class_type": "SaveImage", "inputs": {"images": ["15", 0], "filename_prefix": "ComfyUI"}}
    if custom_sampler and "XDiTGuider" in nodes:
        prompt.update({
            "20": {"class_type": "RandomNoise", "inputs": {"noise_seed": 0}},
            "21": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
            "22": {"class_type": "KarrasScheduler", "inputs": {"steps": 4, "sigma_max": 1.0, "sigma_min": 0.01,
                                                               "rho": 7.0}},
            "23": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["20", 0], "guider": ["14", 0],
                                                                     "sampler": ["21", 0], "sigmas": ["22", 0],
                                                                     "latent_image": ["5", 0]}},
            "24": {"class_type": "VAEDecode", "inputs": {"samples": ["23", 0], "vae": ["6", 0]}},
            "25": {"class_type": "SaveImage", "inputs": {"images": ["24", 0], "filename_prefix": "ComfyUI"}}})
    return prompt
