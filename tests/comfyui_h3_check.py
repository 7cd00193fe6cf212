"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own MiniMax-H3 graphs (text-to-video
with audio: EmptyMiniMaxH3LatentAV, KSampler; the turbo form at cfg 1, the full form at cfg 4 with a negative prompt,
MiniMaxH3SigmaShift and the text encoder's token tags) on the model ComfyUI's UNETLoader makes of a tiny H3 file, and
with the loader swapped for the xDiT Engine on 1 and 2 CPU ranks (Ulysses, Ring, CFG parallel, the weights divided);
the video and audio latents compared each. Prints one JSON report.
Usage: python comfyui_h3_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import json
import os
import sys
import time

comfyui, pack_parent, models = sys.argv[1:4]
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import folder_paths  # noqa: E402
import nodes  # noqa: E402

folder_paths.add_model_folder_path("diffusion_models", os.path.join(models, "diffusion_models"))
folder_paths.add_model_folder_path("custom_nodes", pack_parent)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
import comfyui_version  # noqa: E402
from comfyui_live_common import call, native_model, rel  # noqa: E402 (tests/, this file's folder)

FILE = "tiny-minimax-h3.safetensors"
report = {"comfyui": comfyui_version.__version__, "graphs": {}, "refusals": {}}


def engine(gpus, **kw):
    settings = dict(model_name=FILE, family="auto", weight_dtype="default", gpus=gpus, plan="auto", ulysses=1, ring=1,
                    cfg_parallel=False, dp=1, timeout_s=600)
    settings.update(kw)
    return call("XDiTEngine", **settings)


def last_plan(eng):
    text = call("XDiTEngineInfo", engine=eng, unload=False)[0]
    line = next((x for x in text.splitlines() if x.startswith("last job: plan ")), "")
    return line[len("last job: plan "):].split(";")[0]


def chain(model, shift):
    return call("MiniMaxH3SigmaShift", model=model, shift_video=shift[0], shift_audio=shift[1])[0] if shift else model


def sample(model, pos, neg, cfg, latent, shift=None, node="KSampler"):
    out = call(node, model=chain(model, shift), seed=5, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple",
               positive=pos, negative=neg, latent_image=latent, denoise=1.0)[0]["samples"]
    return out.unbind() if out.is_nested else (out,)


if "EmptyMiniMaxH3LatentAV" not in nodes.NODE_CLASS_MAPPINGS:   # a ComfyUI older than MiniMax-H3 (0.33)
    eng, model = engine("0")
    try:
        call("KSampler", model=model, seed=5, steps=1, cfg=1.0, sampler_name="euler", scheduler="simple",
             positive=[[torch.zeros(1, 9, 48), {}]], negative=[[torch.zeros(1, 9, 48), {}]],
             latent_image={"samples": torch.zeros(1, 24, 2, 4, 6)}, denoise=1.0)
        report["older"] = "ran"
    except Exception as e:  # noqa: BLE001 (the message is the check)
        report["older"] = str(e).splitlines()[0]
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

g = torch.Generator().manual_seed(2)
TEXT = 48   # the tiny file's text width
pos = [[torch.randn(1, 9, TEXT, generator=g), {}]]
neg = [[torch.randn(1, 6, TEXT, generator=g), {}]]
tagged = [[pos[0][0], {"minimax_token_tags": torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 1]])}]]
latent = call("EmptyMiniMaxH3LatentAV", width=96, height=64, length=22)[0]
video, audio = latent["samples"].unbind()
report["latent"] = {"video": list(video.shape), "audio": list(audio.shape)}

GRAPHS = [
    # (name, positive, negative, cfg, MiniMaxH3SigmaShift or None, runs: (label, gpus, engine settings))
    ("h3 t2va turbo cfg1", pos, neg, 1.0, None,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ring2", "0,1", dict(plan="explicit", ring=2)),
      ("ulysses2 shard2", "0,1", dict(plan="explicit", ulysses=2, shard=2))]),
    ("h3 t2va cfg4, negative, SigmaShift 10/2.5, token tags", tagged, neg, 4.0, (10.0, 2.5),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))]),
]
for name, p, n, cfg, shift, runs in GRAPHS:
    t0 = time.perf_counter()
    want = sample(native_model(FILE), p, n, cfg, latent, shift)
    entry = {"native_s": round(time.perf_counter() - t0, 2)}
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model, p, n, cfg, latent, shift)
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    # xDiT Sampler on the engine's MODEL: ComfyUI's sampler drives it (the engine's own loop takes one latent stream)
    eng, model = engine("0,1")
    got = sample(model, p, n, cfg, latent, shift, node="XDiTSampler")
    entry["xdit sampler gpus=0,1"] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                                      "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# what the engine does not run yet is refused in one line, never run differently
eng, model = engine("0")
guided = [[pos[0][0], {"minimax_keyframes": [{"latent": torch.zeros(1, 24, 1, 4, 6), "resolved_frame_index": 0}]}]]
try:
    sample(model, guided, neg, 1.0, latent)
    report["refusals"]["keyframes"] = "ran"
except Exception as e:  # noqa: BLE001 (the message is the check)
    report["refusals"]["keyframes"] = str(e).splitlines()[0]
print("REPORT " + json.dumps(report), flush=True)
