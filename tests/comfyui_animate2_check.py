"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own Wan-Animate 2 graphs on the model
ComfyUI's own loader (UNETLoader's comfy.sd.load_diffusion_model, float32) makes of a tiny Wan-Animate 2 file (Wan 2.1
image-to-video tensors, the header's transformer.model_type "animate2": ComfyUI's WAN_Animate2, shift 5), and with the
loader swapped for the xDiT Engine on 1 and 2 CPU ranks (auto, Ulysses, Ring over a token count it pads, CFG parallel,
the weights divided). The conditioning comes from ComfyUI's own WanAnimate2ToVideo node (comfy_extras/nodes_wan.py)
with ComfyUI's own Load VAE on a tiny Wan 2.1 VAE file (its encodes: the reference image's latent frame, the grey
video, the pose video's latent); the prompts and CLIP-vision outputs are built directly (no text encoder, no CLIP
vision model): random umT5 rows of 4096 for the positive, the negative (another length) and the pose prompt
(positive_pose), and comfy.clip_vision.Output objects with random penultimate_hidden_states (257 x 1280) for the
reference image and the pose video (clip_vision_output_pose). Graphs: the Motion Transfer template's sampling
(ModelSamplingSD3 5, SamplerCustom cfg 1, KSamplerSelect lcm, BasicScheduler simple) over 75 tokens (3 generation + 2
pose frames of 5 x 3 patches: odd, so the split pads); KSampler cfg 4 with pose_strength 0.7 and
reference_image_strength 1.3 (the pose values on both passes, as the node sets them); a pose window (0.0 to 0.5: the
last step runs without the pose branch) at cfg 4; the template without a pose video. Also ComfyUI's own
WanAnimate2Cache (its result against no cache, default and int8 storage) and the engine's MODEL with the cache node
applied (the engine computes the pose branch each call), and the xDiT Sampler (the engine's own loop) on the
KSampler graphs: its result, or its one-line refusal of the pose inputs.
On a ComfyUI older than Wan-Animate 2 (0.31.0) it reports what a KSampler on the engine's MODEL says.
Prints one JSON report. Usage: python comfyui_animate2_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys
import time

from comfyui_live_common import call, last_plan, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv, folders=("diffusion_models", "vae"))
import torch  # noqa: E402
import folder_paths  # noqa: E402
import comfy.model_base  # noqa: E402

FILE = "tiny-wan-animate-2.safetensors"
VAE = "tiny-wan2.1-vae.safetensors"
TEXT = 4096                   # umT5's width (the tiny file keeps the released text width)
report = {"comfyui": VERSION, "graphs": {}}


def engine(gpus, **kw):
    return live.engine(FILE, gpus, **kw)


if not hasattr(comfy.model_base, "WAN_Animate2"):   # a ComfyUI older than Wan-Animate 2 (0.31.0)
    report["older"] = live.older_ksampler(engine("0")[1], TEXT, (1, 16, 3, 6, 8))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

import comfy.clip_vision  # noqa: E402
import comfy.sd  # noqa: E402
from safetensors import safe_open  # noqa: E402

PATH = folder_paths.get_full_path("diffusion_models", FILE)
# ComfyUI's own loader (UNETLoader's call, the header read by its detection), its weights and compute in float32
NATIVE = comfy.sd.load_diffusion_model(PATH, model_options={"dtype": torch.float32})
with safe_open(PATH, "pt") as f:
    file_keys = set(f.keys())
own = NATIVE.model.diffusion_model.state_dict()   # ComfyUI's own model holds exactly the file's tensors
report["keys"] = {"file": len(file_keys), "comfyui_model": len(own),
                  "missing_in_file": sorted(set(own) - file_keys)[:5],
                  "extra_in_file": sorted(file_keys - set(own))[:5],
                  "model_class": type(NATIVE.model).__name__, "shift": float(NATIVE.model.model_sampling.shift)}

vae = call("VAELoader", vae_name=VAE)[0]   # ComfyUI's own Load VAE on the tiny Wan 2.1 VAE
g = torch.Generator().manual_seed(2)
pos = [[torch.randn(1, 9, TEXT, generator=g), {"pooled_output": None}]]
neg = [[torch.randn(1, 5, TEXT, generator=g), {"pooled_output": None}]]          # another length: two forwards a step
pose_prompt = [[torch.randn(1, 7, TEXT, generator=g), {"pooled_output": None}]]  # positive_pose: the pose branch's
clip_ref, clip_pose = comfy.clip_vision.Output(), comfy.clip_vision.Output()
clip_ref.penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)
clip_pose.penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)
reference = torch.rand(1, 48, 80, 3, generator=g)   # images in [0, 1]; the node scales them to width x height
pose_video = torch.rand(5, 48, 80, 3, generator=g)


def animate(width, height, pose=True, **kw):
    """ComfyUI's own WanAnimate2ToVideo: (positive, negative, latent); 5 frames -> 2 latent frames + the reference
    image's slot, the pose video's latent 2 frames."""
    out = call("WanAnimate2ToVideo", positive=pos, negative=neg, vae=vae, width=width, height=height, length=5,
               batch_size=1, video_frame_offset=0, reference_image=reference, clip_vision_output=clip_ref,
               **(dict(pose_video=pose_video, positive_pose=pose_prompt, clip_vision_output_pose=clip_pose)
                  if pose else {}), **kw)
    return out[0], out[1], out[2]


def template(model, p, n, latent):
    """The Motion Transfer template's sampling: ModelSamplingSD3 5, BasicScheduler simple, KSamplerSelect lcm,
    SamplerCustom cfg 1 (3 steps here)."""
    model = call("ModelSamplingSD3", model=model, shift=5.0)[0]
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    return call("SamplerCustom", model=model, add_noise=True, noise_seed=42, cfg=1.0, positive=p, negative=n,
                sampler=call("KSamplerSelect", sampler_name="lcm")[0], sigmas=sigmas,
                latent_image=latent)[0]["samples"]


def ksampler(model, p, n, cfg, latent, node="KSampler"):
    return call(node, model=model, seed=5, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple", positive=p,
                negative=n, latent_image=latent, denoise=1.0)[0]["samples"]


def counting(model, calls):
    """`model` with a unet wrapper that records, for each model call, whether the pose branch's latents came (the
    numbers unchanged: it calls ComfyUI's apply_model as is)."""
    m = model.clone()

    def wrapper(apply_model, args):
        calls.append("pose_latents" in args["c"])
        return apply_model(args["input"], args["timestep"], **args["c"])
    m.set_model_unet_function_wrapper(wrapper)
    return m


X = dict(plan="explicit")
ODD = animate(80, 48)                                   # 10 x 6 latent: 5 x 3 patches, (3 + 2) x 15 = 75 tokens
STRENGTHS = animate(64, 48, pose_strength=0.7, reference_image_strength=1.3)   # 8 x 6: (3 + 2) x 12 = 60 tokens
WINDOW = animate(64, 48, pose_start_percent=0.0, pose_end_percent=0.5)
NO_POSE = animate(80, 48, pose=False)
report["conditioning"] = {"positive_keys": sorted(k for k in ODD[0][0][1] if k != "pooled_output"),
                          "latent": list(ODD[2]["samples"].shape),
                          "pose_video_latent": list(ODD[0][0][1]["pose_video_latent"].shape),
                          "negative_has_pose": "pose_video_latent" in ODD[1][0][1],
                          "window_entries": [len(WINDOW[0]), len(WINDOW[1])],
                          "strengths": {k: STRENGTHS[1][0][1].get(k) for k in ("pose_strength", "reference_strength")}}
GRAPHS = [
    # (name, cfg, sample(model), runs: (label, gpus, engine settings))
    ("animate2 template: ModelSamplingSD3 5, SamplerCustom cfg 1 lcm, 75 tokens", 1.0,
     lambda m: template(m, ODD[0], ODD[1], ODD[2]),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(X, ulysses=2)),
      ("ring2 padded", "0,1", dict(X, ring=2)), ("ulysses2 shard2", "0,1", dict(X, ulysses=2, shard=2))]),
    ("animate2 KSampler cfg 4, pose_strength 0.7, reference_image_strength 1.3", 4.0,
     lambda m: ksampler(m, STRENGTHS[0], STRENGTHS[1], 4.0, STRENGTHS[2]),
     [("gpus=0", "0", {}), ("cfg2", "0,1", dict(X, cfg_parallel=True)),
      ("cfg2 shard2", "0,1", dict(X, cfg_parallel=True, shard=2))]),
    ("animate2 pose window 0.0-0.5, KSampler cfg 4", 4.0,
     lambda m: ksampler(m, WINDOW[0], WINDOW[1], 4.0, WINDOW[2]),
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(X, ulysses=2))]),
    ("animate2 template without a pose video", 1.0,
     lambda m: template(m, NO_POSE[0], NO_POSE[1], NO_POSE[2]),
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(X, ulysses=2))]),
]
results = {}
for name, cfg, sample, runs in GRAPHS:
    t0 = time.perf_counter()
    calls = []
    want = sample(counting(NATIVE, calls))
    results[name] = want
    entry = {"cfg": cfg, "shape": list(want.shape), "native_s": round(time.perf_counter() - t0, 2),
             "native_calls_with_pose": sum(calls), "native_calls_without_pose": len(calls) - sum(calls)}
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model)
        entry[label] = {"rel_l2": rel(got, want), "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# the pose inputs move ComfyUI's own result far beyond rounding
report["native_vs_no_pose_rel_l2"] = rel(results[GRAPHS[0][0]], results[GRAPHS[3][0]])

# ComfyUI's own WanAnimate2Cache (the pose branch's block inputs kept from the first step) on the template's graph,
# against no cache; and the engine's MODEL with the node applied (the engine runs the branch each call)
first = GRAPHS[0][0]
cache = {}
for dtype in ("default", "int8"):
    try:
        cached = template(call("WanAnimate2Cache", model=NATIVE, device="cpu", dtype=dtype)[0], *ODD)
        cache[f"native_{dtype}_vs_no_cache_rel_l2"] = rel(cached, results[first])
        if dtype == "default":
            with_cache = cached
    except Exception as e:  # noqa: BLE001 (the message is the finding)
        cache[f"native_{dtype}_vs_no_cache_rel_l2"] = str(e).splitlines()[0]
eng, model = engine("0,1")
got = template(call("WanAnimate2Cache", model=model, device="cpu", dtype="default")[0], *ODD)
cache["engine_with_cache_vs_native_cache_default_rel_l2"] = rel(got, with_cache)
cache["engine_with_cache_vs_native_no_cache_rel_l2"] = rel(got, results[first])
cache["engine_plan"] = last_plan(eng)
report["cache"] = cache
print("cache", json.dumps(cache), flush=True)

# the sampler swapped too (xDiT Sampler: the engine's own loop) on the KSampler graphs: it runs the pose inputs (its result
# against ComfyUI's own) and refuses the pose window (two conditioning entries a side) in one line
report["xdit_sampler"] = {}
for name, (p, n, latent) in ((GRAPHS[1][0], STRENGTHS), (GRAPHS[2][0], WINDOW)):
    eng, model = engine("0,1")
    try:
        got = ksampler(model, p, n, 4.0, latent, node="XDiTSampler")
        report["xdit_sampler"][name] = {"rel_l2": rel(got, results[name]), "plan": last_plan(eng)}
    except Exception as e:  # noqa: BLE001 (the whole message: the check reads it as one line)
        report["xdit_sampler"][name] = {"refused": str(e)}
    print("xdit sampler", name, json.dumps(report["xdit_sampler"][name]), flush=True)
print("REPORT " + json.dumps(report), flush=True)
