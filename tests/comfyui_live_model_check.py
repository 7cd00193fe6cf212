"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): the xDiT Engine's MODEL in ComfyUI's own graphs.
Each stock graph runs twice: on the model ComfyUI loads from the file (UNETLoader's, the tiny file's widths given to
its detection), and with the loader swapped for the xDiT Engine (its MODEL through the same ComfyUI nodes: sampling
nodes, CFGNorm, LoraLoaderModelOnly; ComfyUI's KSampler, KSamplerAdvanced, SamplerCustomAdvanced), on 1 and 2 CPU
ranks; and with the sampler swapped too (xDiT Sampler taking the MODEL chain: the engine's own loop). Prints one JSON
report. Usage: python comfyui_live_model_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import json
import os
import re
import sys
import time

comfyui, pack_parent, models = sys.argv[1:4]
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.model_management as mm  # noqa: E402
import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402
from safetensors import safe_open  # noqa: E402

for folder in ("diffusion_models", "loras"):
    folder_paths.add_model_folder_path(folder, os.path.join(models, folder))
folder_paths.add_model_folder_path("custom_nodes", pack_parent)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
import comfyui_version  # noqa: E402
from comfyui_live_common import call, native_model, rel  # noqa: E402 (tests/, this file's folder)

report = {"comfyui": comfyui_version.__version__, "graphs": {}, "refusals": {}}


def engine(file, gpus, **kw):
    settings = dict(model_name=file, family="auto", weight_dtype="default", gpus=gpus, plan="auto", ulysses=1, ring=1,
                    cfg_parallel=False, dp=1, timeout_s=600)
    settings.update(kw)
    return call("XDiTEngine", **settings)


def last_job(eng):
    text = call("XDiTEngineInfo", engine=eng, unload=False)[0]
    plan = next((line for line in text.splitlines() if line.startswith("last job: plan ")), "")
    route = next((line for line in text.splitlines() if line.startswith("last job ran: ")), "")
    return plan[len("last job: plan "):].split(";")[0], route[len("last job ran: "):], text


LATENT = {"samples": torch.zeros(1, 16, 16, 16)}


def conds_for(file):
    """The tiny files' text widths differ from the released models': conditioning of the file's widths."""
    path = folder_paths.get_full_path("diffusion_models", file)
    with safe_open(path, "pt") as f:
        dims = json.loads((f.metadata() or {}).get("xdit.synthetic", "{}")).get("dims", {})
    gen = torch.Generator().manual_seed(1)
    width = dims.get("context_in") or dims.get("text_dim") or 64
    pooled = dims.get("vec_in") or dims.get("pooled_in")
    pos = [[torch.randn(1, 24, width, generator=gen),
            {"pooled_output": torch.randn(1, pooled, generator=gen) if pooled else None, "guidance": 3.5}]]
    neg = [[torch.randn(1, 24 if "qwen" not in file else 9, width, generator=gen),
            {"pooled_output": torch.randn(1, pooled, generator=gen) if pooled else None, "guidance": 3.5}]]
    return pos, neg


def ksampler(model, pos, neg, cfg, steps=3, sampler="euler", scheduler="simple", latent=LATENT, denoise=1.0):
    return call("KSampler", model=model, seed=3, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                positive=pos, negative=neg, latent_image=latent, denoise=denoise)[0]["samples"]


def chain(model, steps):
    for node, kw in steps:
        model = call(node, model=model, **kw)[0]
    return model


def with_reference(conditioning, latent):
    """ReferenceLatent (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit) on a conditioning."""
    return call("ReferenceLatent", conditioning=conditioning, latent={"samples": latent})[0]


HAS_FLUX2 = "EmptyFlux2LatentImage" in nodes.NODE_CLASS_MAPPINGS   # ComfyUI 0.3.72 and later
g = torch.Generator().manual_seed(9)
KONTEXT_REF = torch.randn(1, 16, 12, 16, generator=g)
QWEN_REF = torch.randn(1, 16, 1, 12, 12, generator=g)
FLUX2_REFS = (torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 128, 5, 3, generator=g))
LORA = "tiny-flux-lora.safetensors"
GRAPHS = [
    # (name, file, cfg, MODEL nodes between the loader and the sampler)
    ("flux-dev", "tiny-flux-dev.safetensors", 1.0, []),
    ("flux-dev+ModelSamplingFlux+LoRA", "tiny-flux-dev.safetensors", 1.0,
     [("ModelSamplingFlux", dict(max_shift=1.15, base_shift=0.5, width=256, height=256)),
      ("LoraLoaderModelOnly", dict(lora_name=LORA, strength_model=0.8))]),
    ("sd3.5-medium cfg4", "tiny-sd3.5-medium.safetensors", 4.0, [("ModelSamplingSD3", dict(shift=3.0))]),
    ("qwen-image AuraFlow3.1", "tiny-qwen-image.safetensors", 2.5, [("ModelSamplingAuraFlow", dict(shift=3.1))]),
    ("qwen-image-edit AuraFlow3.0+CFGNorm", "tiny-qwen-image.safetensors", 2.5,
     [("ModelSamplingAuraFlow", dict(shift=3.0)), ("CFGNorm", dict(strength=1.0))]),
    ("flux-schnell", "tiny-flux-schnell.safetensors", 1.0, []),
    ("flux-kontext (a ReferenceLatent)", "tiny-flux-dev.safetensors", 1.0, []),
    ("qwen-image-edit (ReferenceLatent on both sides)", "tiny-qwen-image.safetensors", 2.5,
     [("ModelSamplingAuraFlow", dict(shift=3.0)), ("CFGNorm", dict(strength=1.0))]),
    ("sd3.5-medium fp8_scaled file", "tiny-sd3.5-medium-fp8-scaled.safetensors", 4.0, []),
] + ([("flux2-dev (two ReferenceLatents)", "tiny-flux2-dev.safetensors", 1.0, []),
      ("flux2-klein-4b cfg3", "tiny-flux2-klein-4b.safetensors", 3.0, [])] if HAS_FLUX2 else [])
for name, file, cfg, steps in GRAPHS:
    pos, neg = conds_for(file)
    latent = {"samples": torch.zeros(1, 16, 1, 16, 16)} if "qwen" in file else LATENT
    if "flux2" in file:
        latent = {"samples": torch.zeros(1, 128, 8, 8)}
    if "ReferenceLatent" in name:
        refs = {"flux-dev": (KONTEXT_REF,), "qwen-image": (QWEN_REF,), "flux2-dev": FLUX2_REFS}[
            file[len("tiny-"):-len(".safetensors")]]
        for ref in refs:
            pos = with_reference(pos, ref)
            if "both sides" in name:
                neg = with_reference(neg, ref)
    t0 = time.perf_counter()
    want = ksampler(chain(native_model(file), steps), pos, neg, cfg, latent=latent)
    entry = {"native_s": round(time.perf_counter() - t0, 2)}
    if "fp8" in file:   # how far ComfyUI's own fp8 layers are from the file's exact values (ComfyUI 0.3.64: 2e-3)
        exact = ksampler(chain(native_model(file, dequantize=True), steps), pos, neg, cfg, latent=latent)
        entry["comfyui_fp8_vs_exact_rel_l2"] = rel(want, exact)
    # 1 and 2 ranks as auto plans them, and 2 ranks with the weights divided between them (explicit: CFG parallel where
    # there is a negative pass, else Ulysses, each with shard 2)
    divided = dict(plan="explicit", shard=2, **(dict(cfg_parallel=True) if cfg != 1.0 else dict(ulysses=2)))
    for gpus, kw in (("0", {}), ("0,1", {}), ("0,1 shard2", divided)):
        eng, model = engine(file, gpus.split()[0], **kw)
        t0 = time.perf_counter()
        got = ksampler(chain(model, steps), pos, neg, cfg, latent=latent)
        plan, route, _ = last_job(eng)
        entry[f"ksampler gpus={gpus}"] = {"rel_l2": rel(got, want), "plan": plan, "route": route,
                                          "s": round(time.perf_counter() - t0, 2)}
        t0 = time.perf_counter()
        fast = call("XDiTSampler", model=chain(model, steps), seed=3, steps=3, cfg=cfg, sampler_name="euler",
                    scheduler="simple", positive=pos, negative=neg, latent_image=latent, denoise=1.0)[0]["samples"]
        plan, route, _ = last_job(eng)
        entry[f"xdit sampler gpus={gpus}"] = {"rel_l2": rel(fast, want), "plan": plan, "route": route,
                                              "s": round(time.perf_counter() - t0, 2)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# Wan video as ComfyUI's Wan templates sample it: ModelSamplingSD3 shift 8 on the MODEL, a negative prompt
def wan_ksampler(model, pos, neg, latent, cfg=5.0):
    return call("KSampler", model=model, seed=3, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple",
                positive=pos, negative=neg, latent_image=latent, denoise=1.0)[0]["samples"]


def shift8(model):
    return chain(model, [("ModelSamplingSD3", dict(shift=8.0))])


WAN_LATENT = {"samples": torch.zeros(1, 16, 3, 8, 8)}   # 9 frames of 64x64
pos, neg = conds_for("tiny-wan2.1-1.3b.safetensors")
want = wan_ksampler(shift8(native_model("tiny-wan2.1-1.3b.safetensors")), pos, neg, WAN_LATENT)
entry = {}
for gpus, kw in (("0", {}), ("0,1", {}), ("0,1 shard2", dict(plan="explicit", cfg_parallel=True, shard=2))):
    eng, model = engine("tiny-wan2.1-1.3b.safetensors", gpus.split()[0], **kw)
    entry[f"ksampler gpus={gpus}"] = {"rel_l2": rel(wan_ksampler(shift8(model), pos, neg, WAN_LATENT), want),
                                      "plan": last_job(eng)[0], "route": last_job(eng)[1]}
    fast = call("XDiTSampler", model=shift8(model), seed=3, steps=3, cfg=5.0, sampler_name="euler",
                scheduler="simple", positive=pos, negative=neg, latent_image=WAN_LATENT, denoise=1.0)[0]["samples"]
    entry[f"xdit sampler gpus={gpus}"] = {"rel_l2": rel(fast, want), "plan": last_job(eng)[0],
                                          "route": last_job(eng)[1]}
report["graphs"]["wan2.1 t2v, ModelSamplingSD3 8, cfg 5"] = entry
print("wan2.1 t2v", json.dumps(entry), flush=True)

# Wan 2.2 A14B's template: the high-noise expert from step 0 to 2 with leftover noise, the low-noise expert from 2 on
def experts(high, low, node="KSamplerAdvanced"):
    def run(model, start, end, add, leftover, latent):
        return call(node, model=model, add_noise="enable" if add else "disable", noise_seed=7, steps=4, cfg=3.5,
                    sampler_name="euler", scheduler="simple", positive=pos, negative=neg, latent_image=latent,
                    start_at_step=start, end_at_step=end,
                    return_with_leftover_noise="enable" if leftover else "disable")[0]
    first = run(shift8(high), 0, 2, True, True, WAN_LATENT)
    return run(shift8(low), 2, 10000, False, False, first)["samples"]


want = experts(native_model("tiny-wan2.2-a14b.safetensors"), native_model("tiny-wan2.2-a14b-low.safetensors"))
eng_high, high = engine("tiny-wan2.2-a14b.safetensors", "0,1")
eng_low, low = engine("tiny-wan2.2-a14b-low.safetensors", "0,1")
report["graphs"]["wan2.2 a14b two experts, KSamplerAdvanced"] = {"rel_l2": rel(experts(high, low), want),
                                                                 "plan": last_job(eng_low)[0]}
report["graphs"]["wan2.2 a14b two experts, xDiT Sampler (Advanced)"] = {
    "rel_l2": rel(experts(high, low, "XDiTSamplerAdvanced"), want), "plan": last_job(eng_low)[0],
    "route": last_job(eng_low)[1]}
# both experts with their weights divided over the two ranks (each rank keeps half of each)
divided = dict(plan="explicit", cfg_parallel=True, shard=2)
eng_high2, high2 = engine("tiny-wan2.2-a14b.safetensors", "0,1", **divided)
eng_low2, low2 = engine("tiny-wan2.2-a14b-low.safetensors", "0,1", **divided)
report["graphs"]["wan2.2 a14b two experts divided, KSamplerAdvanced"] = {"rel_l2": rel(experts(high2, low2), want),
                                                                         "plan": last_job(eng_low2)[0]}

# the same two experts in SamplerCustomAdvanced's form: BasicScheduler's sigmas split at step 2 (SplitSigmas), each
# half through ComfyUI's CFGGuider on its expert, the second half without added noise (DisableNoise)
def experts_custom(high, low):
    high, low = shift8(high), shift8(low)
    sigmas = call("BasicScheduler", model=high, scheduler="simple", steps=4, denoise=1.0)[0]
    first_half, second_half = call("SplitSigmas", sigmas=sigmas, step=2)
    sampler = call("KSamplerSelect", sampler_name="euler")[0]

    def run(model, noise, part, latent):
        guider = call("CFGGuider", model=model, positive=pos, negative=neg, cfg=3.5)[0]
        return call("SamplerCustomAdvanced", noise=noise, guider=guider, sampler=sampler, sigmas=part,
                    latent_image=latent)[0]
    first = run(high, call("RandomNoise", noise_seed=7)[0], first_half, WAN_LATENT)
    return run(low, call("DisableNoise")[0], second_half, first)["samples"]


want = experts_custom(native_model("tiny-wan2.2-a14b.safetensors"), native_model("tiny-wan2.2-a14b-low.safetensors"))
report["graphs"]["wan2.2 a14b two experts, SamplerCustomAdvanced + SplitSigmas"] = {
    "rel_l2": rel(experts_custom(high, low), want), "plan": last_job(eng_low)[0]}


# CFG parallel whatever ComfyUI batches: a positive of 24 tokens and a negative of 10 (their lengths do not concatenate:
# ComfyUI runs them as two calls), under an explicit cfg2 plan: the stock Wan 2.2 graph with ComfyUI's CFGGuider and
# with the xDiT Guider, and KSampler on Wan 2.1
def calls_of(eng):
    """(model calls, round trips) of the engine's last job, as Info shows them."""
    line = next((ln for ln in last_job(eng)[2].splitlines() if ln.startswith("last job: plan ")), "")
    found = dict(re.findall(r"(model_calls|round_trips) (\d+)", line))
    return int(found.get("model_calls", 0)), int(found.get("round_trips", 0))


neg_short = [[torch.randn(1, 10, pos[0][0].shape[2], generator=torch.Generator().manual_seed(5)),
              {"pooled_output": None}]]
pos_long = pos


def experts_guided(high, low, guider):
    high, low = shift8(high), shift8(low)
    sigmas = call("BasicScheduler", model=high, scheduler="simple", steps=4, denoise=1.0)[0]
    first_half, second_half = call("SplitSigmas", sigmas=sigmas, step=2)
    sampler = call("KSamplerSelect", sampler_name="euler")[0]

    def run(model, noise, part, latent):
        made = call(guider, model=model, positive=pos_long, negative=neg_short, cfg=3.5)[0]
        return call("SamplerCustomAdvanced", noise=noise, guider=made, sampler=sampler, sigmas=part,
                    latent_image=latent)[0]
    first = run(high, call("RandomNoise", noise_seed=7)[0], first_half, WAN_LATENT)
    return run(low, call("DisableNoise")[0], second_half, first)["samples"]


want = experts_guided(native_model("tiny-wan2.2-a14b.safetensors"), native_model("tiny-wan2.2-a14b-low.safetensors"),
                      "CFGGuider")
cfg2 = dict(plan="explicit", cfg_parallel=True)
eng_high2, high2 = engine("tiny-wan2.2-a14b.safetensors", "0,1", **cfg2)
eng_low2, low2 = engine("tiny-wan2.2-a14b-low.safetensors", "0,1", **cfg2)
for guider in ("CFGGuider", "XDiTGuider"):
    got = experts_guided(high2, low2, guider)
    calls, trips = calls_of(eng_low2)
    report["graphs"][f"wan2.2 a14b SplitSigmas, {guider}, cfg2, text lengths 24 and 10"] = {
        "rel_l2": rel(got, want), "plan": last_job(eng_low2)[0], "model_calls": calls, "round_trips": trips}
want = wan_ksampler(shift8(native_model("tiny-wan2.1-1.3b.safetensors")), pos_long, neg_short, WAN_LATENT)
eng, model = engine("tiny-wan2.1-1.3b.safetensors", "0,1", **cfg2)
got = wan_ksampler(shift8(model), pos_long, neg_short, WAN_LATENT)
calls, trips = calls_of(eng)
report["graphs"]["wan2.1 t2v KSampler, cfg2, text lengths 24 and 10"] = {
    "rel_l2": rel(got, want), "plan": last_job(eng)[0], "model_calls": calls, "round_trips": trips}
print("cfg2 unequal", json.dumps({k: v for k, v in report["graphs"].items() if "lengths" in k}), flush=True)

# TI2V-5B: the start image's latent in frame 0, kept by the noise mask (Wan22ImageToVideoLatent), one timestep a frame
g = torch.Generator().manual_seed(4)
start = torch.zeros(1, 48, 3, 8, 8)
start[:, :, :1] = torch.randn(1, 48, 1, 8, 8, generator=g)
mask = torch.ones(1, 1, 3, 8, 8)
mask[:, :, 0] = 0.0
ti2v_latent = {"samples": start, "noise_mask": mask}
pos5, neg5 = conds_for("tiny-wan2.2-ti2v-5b.safetensors")
want = wan_ksampler(chain(native_model("tiny-wan2.2-ti2v-5b.safetensors"), [("ModelSamplingSD3", dict(shift=8.0))]),
                    pos5, neg5, ti2v_latent)
eng, model = engine("tiny-wan2.2-ti2v-5b.safetensors", "0,1")
report["graphs"]["wan2.2 ti2v-5b, start image through the noise mask"] = {
    "rel_l2": rel(wan_ksampler(shift8(model), pos5, neg5, ti2v_latent), want), "plan": last_job(eng)[0]}

# I2V 14B: WanImageToVideo's conditioning keys (the image's latent and mask concatenated, CLIP-vision features)
import comfy.clip_vision  # noqa: E402
import node_helpers  # noqa: E402
clip = comfy.clip_vision.Output()
clip.penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)
image = torch.zeros(1, 16, 3, 8, 8)
image[:, :, :1] = torch.randn(1, 16, 1, 8, 8, generator=g)
concat_mask = torch.ones(1, 1, 3, 8, 8)
concat_mask[:, :, 0] = 0.0
posi, negi = conds_for("tiny-wan2.1-i2v-14b.safetensors")
posi, negi = (node_helpers.conditioning_set_values(c, {"concat_latent_image": image, "concat_mask": concat_mask,
                                                        "clip_vision_output": clip}) for c in (posi, negi))
want = wan_ksampler(shift8(native_model("tiny-wan2.1-i2v-14b.safetensors")), posi, negi, WAN_LATENT)
eng, model = engine("tiny-wan2.1-i2v-14b.safetensors", "0,1")
report["graphs"]["wan2.1 i2v-14b, WanImageToVideo's conditioning"] = {
    "rel_l2": rel(wan_ksampler(shift8(model), posi, negi, WAN_LATENT), want), "plan": last_job(eng)[0]}
fast = call("XDiTSampler", model=shift8(model), seed=3, steps=3, cfg=5.0, sampler_name="euler", scheduler="simple",
            positive=posi, negative=negi, latent_image=WAN_LATENT, denoise=1.0)[0]["samples"]
report["graphs"]["wan2.1 i2v-14b, xDiT Sampler"] = {"rel_l2": rel(fast, want), "plan": last_job(eng)[0],
                                                    "route": last_job(eng)[1]}
print("wan", json.dumps({k: v for k, v in report["graphs"].items() if k.startswith("wan")}), flush=True)

# a GGUF file (ComfyUI-GGUF's format; this ComfyUI has no loader for it): the engine's MODEL, built from the file's
# header as ComfyUI detects models, against the engine's own loop on the same file
pos, _ = conds_for("tiny-flux-dev.safetensors")
eng, model = engine("tiny-flux-dev-Q8_0.gguf", "0,1")
via_model = ksampler(model, pos, pos, 1.0)
via_loop = call("XDiTSampler", engine=eng, seed=3, steps=3, cfg=1.0, sampler_name="euler", scheduler="simple",
                positive=pos, negative=pos, latent_image=LATENT, denoise=1.0)[0]["samples"]
report["graphs"]["flux-dev Q8_0 GGUF: KSampler on the MODEL vs xDiT Sampler"] = {
    "rel_l2": rel(via_model, via_loop), "plan": last_job(eng)[0]}

# the Wan 2.2 form of two samplers: KSamplerAdvanced from step 0 to 2 with leftover noise, then 2 to 4 without noise
pos, neg = conds_for("tiny-sd3.5-medium.safetensors")


def advanced(model, start, end, add_noise, leftover, latent, node="KSamplerAdvanced"):
    return call(node, model=model, add_noise="enable" if add_noise else "disable", noise_seed=7, steps=4,
                cfg=3.5, sampler_name="euler", scheduler="simple", positive=pos, negative=neg, latent_image=latent,
                start_at_step=start, end_at_step=end,
                return_with_leftover_noise="enable" if leftover else "disable")[0]


def two_stage(model, node="KSamplerAdvanced"):
    first = advanced(model, 0, 2, True, True, LATENT, node)
    return advanced(model, 2, 10000, False, False, first, node)["samples"]


want = two_stage(native_model("tiny-sd3.5-medium.safetensors"))
eng, model = engine("tiny-sd3.5-medium.safetensors", "0,1")
report["graphs"]["sd3.5 KSamplerAdvanced pair"] = {"rel_l2": rel(two_stage(model), want), "plan": last_job(eng)[0]}
got = two_stage(chain(model, [("ModelSamplingSD3", dict(shift=3.0))]), "XDiTSamplerAdvanced")
report["graphs"]["sd3.5 xDiT Sampler (Advanced) pair"] = {"rel_l2": rel(got, want), "plan": last_job(eng)[0],
                                                           "route": last_job(eng)[1]}

# SamplerCustomAdvanced with ComfyUI's BasicGuider on the engine's MODEL (the FLUX.2 templates' form)
pos, _ = conds_for("tiny-flux-dev.safetensors")


def custom(model):
    guider = call("BasicGuider", model=model, conditioning=pos)[0]
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    return call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=5)[0], guider=guider,
                sampler=call("KSamplerSelect", sampler_name="dpmpp_2m")[0], sigmas=sigmas,
                latent_image=LATENT)[0]["samples"]


want = custom(native_model("tiny-flux-dev.safetensors"))
eng, model = engine("tiny-flux-dev.safetensors", "0,1")
report["graphs"]["flux BasicGuider+SamplerCustomAdvanced"] = {"rel_l2": rel(custom(model), want),
                                                              "plan": last_job(eng)[0]}

# what the ranks cannot run is refused in one line
eng, model = engine("tiny-flux-dev.safetensors", "0")
patched = model.clone()
patched.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
for label, m in (("attention patch", patched),):
    try:
        ksampler(m, pos, pos, 1.0, steps=1)
        report["refusals"][label] = "not refused"
    except Exception as e:
        report["refusals"][label] = f"{type(e).__name__}: {e}"

# progress and interrupt through ComfyUI's own KSampler on the MODEL, then the next run
seen, seen_interrupt = [], []


def interrupt_at_2(value, total, preview, node_id=None, prompt_id=None):
    """The UI's cancel at step 2, and the server's progress hook (main.py), which raises ComfyUI's interrupt."""
    seen.append(value)
    if value >= 2 and not seen_interrupt:
        seen_interrupt.append(value)
        mm.interrupt_current_processing(True)
    mm.throw_exception_if_processing_interrupted()


comfy.utils.set_progress_bar_global_hook(interrupt_at_2)
try:
    ksampler(model, pos, pos, 1.0, steps=50)
    report["interrupt"] = "not interrupted"
except mm.InterruptProcessingException:
    report["interrupt"] = {"steps_seen": seen, "flag_after": mm.processing_interrupted()}
comfy.utils.set_progress_bar_global_hook(None)
again = ksampler(model, pos, pos, 1.0, steps=2)
report["after_interrupt_finite"] = bool(torch.isfinite(again).all())
report["info"] = last_job(eng)[2]
print("REPORT " + json.dumps(report))
