"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): the engine's fp8 weight option
(weight_dtype fp8_e4m3fn) on tiny LTX-2.3 and pruned MiniMax-H3 files in ComfyUI's own graphs, on 1 and 2 CPU ranks
(ulysses2 x shard2: the weights divided), against three of ComfyUI's own results on the same file: its float32 model
(what the option costs), its own fp8 loader (UNETLoader's weight_dtype fp8_e4m3fn; where that model runs), and its float32 model with only
the linear layers' weights ComfyUI's fp8 loader stores in fp8 rounded to fp8 (what rounding those weights alone
explains). Prints one JSON report.
Usage: python comfyui_fp8_option_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys

from comfyui_live_common import call, last_plan, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv)
import torch  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402
import comfy.sd  # noqa: E402

FP8 = torch.float8_e4m3fn
report = {"comfyui": VERSION, "graphs": {}}
if "LTXVConcatAVLatent" not in nodes.NODE_CLASS_MAPPINGS or "EmptyMiniMaxH3LatentAV" not in nodes.NODE_CLASS_MAPPINGS:
    report["older"] = True   # the audio-video families need ComfyUI 0.33 (test_comfyui_live checks the refusal)
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)


def loaded(file, dtype):
    """UNETLoader's model of the file in `dtype` (float32, or its fp8_e4m3fn weight dtype)."""
    return comfy.sd.load_diffusion_model(folder_paths.get_full_path("diffusion_models", file),
                                         model_options={"dtype": dtype})


def linear_weights_alone(file, fp8_model):
    """ComfyUI's float32 model of the file with only the weights of the linear layers its fp8 loader stores in fp8
    rounded to fp8 (and back); also the other tensors that loader stores in fp8 (not rounded here)."""
    net = fp8_model.model.diffusion_model
    linear = {n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == FP8}
    other = sorted(n for n, p in net.named_parameters() if p.dtype == FP8 and n[:-len(".weight")] not in linear)
    model = loaded(file, torch.float32)
    rounded = 0
    for n, m in model.model.diffusion_model.named_modules():
        if n in linear:
            m.weight.data = m.weight.data.to(FP8).to(torch.float32)
            rounded += 1
    return model, {"linear_weights_rounded": rounded, "other_fp8_in_comfyuis_fp8_model": len(other),
                   "other_fp8_examples": other[:4]}


def compare(name, file, sample, runs):
    fp32 = sample(loaded(file, torch.float32))
    fp8_model = loaded(file, FP8)
    try:
        comfy_fp8 = sample(fp8_model)
    except Exception as e:   # ComfyUI's own fp8 model may not run (e.g. a kernel that refuses fp8 norm scales)
        comfy_fp8, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    alone_model, counts = linear_weights_alone(file, fp8_model)
    alone = sample(alone_model)
    entry = dict(counts, linear_alone_vs_fp32=[rel(a, b) for a, b in zip(alone, fp32)])
    if comfy_fp8 is None:
        entry["comfyui_fp8_error"] = error
    else:
        entry["comfyui_fp8_vs_fp32"] = [rel(a, b) for a, b in zip(comfy_fp8, fp32)]
    for label, gpus, kw in runs:
        eng, model = live.engine(file, gpus, weight_dtype="fp8_e4m3fn", **kw)
        got = sample(model)
        entry[label] = {"vs_fp32": [rel(a, b) for a, b in zip(got, fp32)],
                        "vs_comfyui_fp8": comfy_fp8 and [rel(a, b) for a, b in zip(got, comfy_fp8)],
                        "vs_linear_alone": [rel(a, b) for a, b in zip(got, alone)],
                        "finite": all(bool(torch.isfinite(t).all()) for t in got), "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)


RUNS = [("gpus=0", "0", {}), ("ulysses2 shard2", "0,1", dict(plan="explicit", ulysses=2, shard=2))]
g = torch.Generator().manual_seed(2)

# MiniMax-H3 (pruned, as the run): text-to-video with audio at cfg 4, KSampler (its graph in comfyui_h3_check)
h3_pos = [[torch.randn(1, 9, 48, generator=g), {}]]
h3_neg = [[torch.randn(1, 6, 48, generator=g), {}]]
h3_latent = call("EmptyMiniMaxH3LatentAV", width=96, height=64, length=22)[0]


def h3_sample(model):
    out = call("KSampler", model=model, seed=5, steps=3, cfg=4.0, sampler_name="euler", scheduler="simple",
               positive=h3_pos, negative=h3_neg, latent_image=h3_latent, denoise=1.0)[0]["samples"]
    return out.unbind()


compare("h3 pruned: t2va cfg 4", "tiny-minimax-h3-pruned.safetensors", h3_sample, RUNS)

# LTX-2.3: text-to-video with audio at cfg 3 (the template's sampling, as comfyui_ltx_check)
LTX = "tiny-ltx-2.3.safetensors"
with open(folder_paths.get_full_path("diffusion_models", LTX), "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
config = json.loads(header["config"])["transformer"]
text = config["cross_attention_dim"] + config["audio_cross_attention_dim"]
raw_pos = [[torch.randn(1, 9, text, generator=g), {"unprocessed_ltxav_embeds": True}]]
raw_neg = [[torch.randn(1, 5, text, generator=g), {"unprocessed_ltxav_embeds": True}]]
ltx_pos, ltx_neg = call("LTXVConditioning", positive=raw_pos, negative=raw_neg, frame_rate=24.0)[:2]
video = call("EmptyLTXVLatentVideo", width=96, height=64, length=17, batch_size=1)[0]
audio = {"samples": torch.zeros(1, 8, round(17 / 24 * 25), 16)}
ltx_latent = call("LTXVConcatAVLatent", video_latent=video, audio_latent=audio)[0]


def ltx_sample(model):
    guider = call("CFGGuider", model=model, positive=ltx_pos, negative=ltx_neg, cfg=3.0)[0]
    out = call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
               sampler=call("KSamplerSelect", sampler_name="euler")[0],
               sigmas=call("ManualSigmas", sigmas="1.0, 0.99375, 0.909375, 0.725, 0.421875, 0.0")[0],
               latent_image=ltx_latent)[0]["samples"]
    return out.unbind()


compare("ltx-2.3: t2va cfg 3", LTX, ltx_sample, RUNS)
print("REPORT " + json.dumps(report), flush=True)
