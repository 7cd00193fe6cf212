"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own HunyuanVideo 1.5 graphs (the 720p
text-to-video template's sampling: EmptyHunyuanVideo15Latent, ModelSamplingSD3 7, CFGGuider 6, BasicScheduler simple,
KSamplerSelect euler, RandomNoise, SamplerCustomAdvanced; KSampler at cfg 6 with a negative of another length; a
prompt with quoted text, whose byT5 rows ride with the text; image-to-video with HunyuanVideo15ImageToVideo's keys and
a SigLIP output) on the model ComfyUI's own loader makes of a tiny HunyuanVideo 1.5 file, and with the loader swapped
for the xDiT Engine on 1 and 2 CPU ranks (auto, Ulysses, Ring over a token count it pads, CFG parallel, the weights
divided) and with the sampler swapped too (xDiT Sampler: the engine's own loop). The conditioning is built directly
(no text encoder, no VAE): random Qwen2.5-VL rows of the tiny file's width, byT5 rows as conditioning_byt5small, the
image-to-video keys as HunyuanVideo15ImageToVideo sets them (concat_latent_image: a VAE latent in the first latent
frame, zeros after; concat_mask 0 there) and a CLIP-vision output whose last_hidden_state is random SigLIP rows.
Prints one JSON report. Usage: python comfyui_hv15_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys
import time

from comfyui_live_common import call, last_plan, native_model, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv)
import torch  # noqa: E402
import folder_paths  # noqa: E402
import comfy.supported_models  # noqa: E402

FILE = "tiny-hunyuanvideo-1.5.safetensors"
TEXT = 64                     # the tiny file's text width (Qwen2.5-VL 7B's: 3584)
report = {"comfyui": VERSION, "graphs": {}}


def engine(gpus, **kw):
    return live.engine(FILE, gpus, **kw)


if not hasattr(comfy.supported_models, "HunyuanVideo15"):   # a ComfyUI older than HunyuanVideo 1.5 (0.3.71)
    report["older"] = live.older_ksampler(engine("0")[1], TEXT, (1, 32, 2, 4, 6))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

import comfy.clip_vision  # noqa: E402
import node_helpers  # noqa: E402
from safetensors import safe_open  # noqa: E402

with safe_open(folder_paths.get_full_path("diffusion_models", FILE), "pt") as f:
    file_keys = set(f.keys())
own = native_model(FILE).model.diffusion_model.state_dict()   # ComfyUI's own model holds exactly the file's tensors
report["keys"] = {"file": len(file_keys), "comfyui_model": len(own),
                  "missing_in_file": sorted(set(own) - file_keys)[:5],
                  "extra_in_file": sorted(file_keys - set(own))[:5],
                  "model_class": type(native_model(FILE).model).__name__}

g = torch.Generator().manual_seed(2)
pos = [[torch.randn(1, 9, TEXT, generator=g), {"pooled_output": None}]]
neg = [[torch.randn(1, 5, TEXT, generator=g), {"pooled_output": None}]]          # another length: two forwards a step
quoted = [[pos[0][0], {"pooled_output": None, "conditioning_byt5small": torch.randn(1, 6, 1472, generator=g)}]]
video = call("EmptyHunyuanVideo15Latent", width=96, height=64, length=5, batch_size=1)[0]   # 2 x 4 x 6: 48 tokens
odd = call("EmptyHunyuanVideo15Latent", width=80, height=48, length=1, batch_size=1)[0]    # 1 x 3 x 5: 15, padded


def image_to_video(conditioning, latent):
    """HunyuanVideo15ImageToVideo's keys on a conditioning: the start image's latent in the first latent frame, the
    mask 0 there, and the CLIP-vision output (SigLIP's last_hidden_state is what ComfyUI's model takes)."""
    frames, h, w = latent["samples"].shape[2:]
    image = torch.zeros(1, 32, frames, h, w)
    image[:, :, :1] = torch.randn(1, 32, 1, h, w, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(1, 1, frames, h, w)
    mask[:, :, :1] = 0.0
    clip = comfy.clip_vision.Output()
    clip.last_hidden_state = torch.randn(1, 9, 1152, generator=torch.Generator().manual_seed(9))
    clip.penultimate_hidden_states = torch.randn(1, 9, 1152, generator=torch.Generator().manual_seed(10))
    return node_helpers.conditioning_set_values(conditioning, {"concat_latent_image": image, "concat_mask": mask,
                                                               "clip_vision_output": clip})


def ksampler(model, p, n, cfg, latent=video, node="KSampler"):
    return call(node, model=model, seed=5, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple", positive=p,
                negative=n, latent_image=latent, denoise=1.0)[0]["samples"]


def template(model, p, n, cfg=6.0, latent=video):
    """The 720p text-to-video template's first pass: ModelSamplingSD3 7, CFGGuider, BasicScheduler simple,
    KSamplerSelect euler, RandomNoise, SamplerCustomAdvanced (3 steps here, 20 in the template)."""
    model = call("ModelSamplingSD3", model=model, shift=7.0)[0]
    guider = call("CFGGuider", model=model, positive=p, negative=n, cfg=cfg)[0]
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    return call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
                sampler=call("KSamplerSelect", sampler_name="euler")[0], sigmas=sigmas,
                latent_image=latent)[0]["samples"]


X = dict(plan="explicit")
I2V_POS, I2V_NEG = image_to_video(pos, video), image_to_video(neg, video)
GRAPHS = [
    # (name, cfg, sample(model), runs: (label, gpus, engine settings), xDiT Sampler's node arguments or None)
    ("hv15 t2v template: ModelSamplingSD3 7, CFGGuider 6, SamplerCustomAdvanced", 6.0,
     lambda m: template(m, pos, neg),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(X, ulysses=2)),
      ("cfg2", "0,1", dict(X, cfg_parallel=True)), ("ulysses2 shard2", "0,1", dict(X, ulysses=2, shard=2))], None),
    ("hv15 t2v KSampler cfg 6, 15 tokens", 6.0, lambda m: ksampler(m, pos, neg, 6.0, odd),
     [("gpus=0", "0", {}), ("ring2 padded", "0,1", dict(X, ring=2))], (pos, neg, 6.0, odd)),
    ("hv15 quoted text: byT5 rows, KSampler cfg 6", 6.0, lambda m: ksampler(m, quoted, neg, 6.0),
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(X, ulysses=2))], (quoted, neg, 6.0, video)),
    ("hv15 i2v: HunyuanVideo15ImageToVideo's keys, KSampler cfg 6", 6.0,
     lambda m: ksampler(m, I2V_POS, I2V_NEG, 6.0),
     [("gpus=0", "0", {}), ("ring2", "0,1", dict(X, ring=2)), ("cfg2 shard2", "0,1", dict(X, cfg_parallel=True,
                                                                                      shard=2))],
     (I2V_POS, I2V_NEG, 6.0, video)),
]
plain = ksampler(native_model(FILE), pos, neg, 6.0)   # ComfyUI's own text-to-video by KSampler, the 48 tokens
for name, cfg, sample, runs, loop in GRAPHS:
    t0 = time.perf_counter()
    want = sample(native_model(FILE))
    entry = {"cfg": cfg, "shape": list(want.shape), "native_s": round(time.perf_counter() - t0, 2)}
    if "KSampler" in name and want.shape == plain.shape:   # what the byT5 rows or the image move ComfyUI's result by
        entry["native_vs_t2v_ksampler_rel_l2"] = rel(want, plain)
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model)
        entry[label] = {"rel_l2": rel(got, want), "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    if loop is not None:   # the sampler swapped too: xDiT Sampler runs the MODEL chain in the engine's own loop
        eng, model = engine("0,1")
        p, n, c, latent = loop
        got = ksampler(model, p, n, c, latent, node="XDiTSampler")
        entry["xdit sampler gpus=0,1"] = {"rel_l2": rel(got, want), "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

print("REPORT " + json.dumps(report), flush=True)
