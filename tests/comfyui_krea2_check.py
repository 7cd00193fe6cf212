"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own Krea 2 graphs (the Turbo
template's EmptyLatentImage and KSampler at cfg 1 with ConditioningZeroOut's negative; the Raw model's cfg 4 with a
negative of another length; the style-reference template's ReferenceLatent + FluxKontextMultiReferenceLatentMethod
index_timestep_zero, ModelSamplingFlux, CFGGuider and SamplerCustomAdvanced; references without a method; two
references by index; a LoRA through LoraLoaderModelOnly; a mixed-precision fp8 file) on the model ComfyUI's own
loader makes of a tiny Krea 2 file, and with the loader swapped for the xDiT Engine on 1 and 2 CPU ranks (auto,
Ulysses, Ring, CFG parallel, the weights divided) and with the sampler swapped too (xDiT Sampler: the engine's own
loop). The conditioning is built directly (no text encoder): random text of the tiny file's width [1, L, layers x
width], as CLIPLoader type krea2 flattens its twelve tapped layers. Prints one JSON report.
Usage: python comfyui_krea2_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys
import time

from comfyui_live_common import call, last_plan, native_model, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv)
import torch  # noqa: E402
import folder_paths  # noqa: E402
import comfy.supported_models  # noqa: E402

FILE = "tiny-krea-2.safetensors"
MIXED = "tiny-krea-2-fp8_mixed.safetensors"   # ComfyUI's mixed-precision fp8: the blocks' matrices fp8 + their scales
LORA = "tiny-krea-2-lora.safetensors"         # LoRA factors on a block's query, gate and SwiGLU, a text fusion block
WIDTH = 4 * 80                                # the tiny file's tapped layers x text width
report = {"comfyui": VERSION, "graphs": {}, "refusals": {}}


def engine(gpus, file=FILE, **kw):
    return live.engine(file, gpus, **kw)


if not hasattr(comfy.supported_models, "Krea2"):   # a ComfyUI older than Krea 2 (0.26)
    report["older"] = live.older_ksampler(engine("0")[1], WIDTH, (1, 16, 1, 8, 8))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

import comfy.sd  # noqa: E402
from safetensors import safe_open  # noqa: E402

with safe_open(folder_paths.get_full_path("diffusion_models", FILE), "pt") as f:
    file_keys = set(f.keys())
own = native_model(FILE).model.diffusion_model.state_dict()   # ComfyUI's own model holds exactly the file's tensors
report["keys"] = {"file": len(file_keys), "comfyui_model": len(own),
                  "missing_in_file": sorted(set(own) - file_keys)[:5],
                  "extra_in_file": sorted(file_keys - set(own))[:5]}


def native(file=FILE):
    """UNETLoader's model of the file (a mixed-precision file's quantization metadata read by ComfyUI's loader),
    computing in float32."""
    if file == MIXED:
        return comfy.sd.load_diffusion_model(folder_paths.get_full_path("diffusion_models", file),
                                             model_options={"dtype": torch.float32})
    return native_model(file)


g = torch.Generator().manual_seed(2)
pos = [[torch.randn(1, 9, WIDTH, generator=g), {}]]
zero = call("ConditioningZeroOut", conditioning=pos)[0]          # the Turbo template's negative
neg = [[torch.randn(1, 5, WIDTH, generator=g), {}]]              # another length: two forwards a step
latent = call("EmptyLatentImage", width=136, height=104, batch_size=1)[0]   # 17 x 13: padded, 63 tokens
ref_a = torch.randn(1, 16, 1, 12, 10, generator=g)               # VAE latents as ReferenceLatent takes them
ref_b = torch.randn(1, 16, 1, 7, 9, generator=g)


def referenced(conditioning, refs, method=None):
    for ref in refs:
        conditioning = call("ReferenceLatent", conditioning=conditioning, latent={"samples": ref})[0]
    if method:
        conditioning = call("FluxKontextMultiReferenceLatentMethod", conditioning=conditioning,
                            reference_latents_method=method)[0]
    return conditioning


def ksampler(model, p, n, cfg, node="KSampler", lora=False):
    if lora:
        model = call("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=0.8)[0]
    return call(node, model=model, seed=5, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple", positive=p,
                negative=n, latent_image=latent, denoise=1.0)[0]["samples"]


def custom(model, p, n, cfg=1.0):
    """The style-reference template's sampling: ModelSamplingFlux (1.15, 0.5, the latent's size), CFGGuider,
    BasicScheduler simple, KSamplerSelect euler, RandomNoise, SamplerCustomAdvanced."""
    model = call("ModelSamplingFlux", model=model, max_shift=1.15, base_shift=0.5, width=136, height=104)[0]
    guider = call("CFGGuider", model=model, positive=p, negative=n, cfg=cfg)[0]
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    return call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
                sampler=call("KSamplerSelect", sampler_name="euler")[0], sigmas=sigmas,
                latent_image=latent)[0]["samples"]


X = dict(plan="explicit")
GRAPHS = [
    # (name, cfg, sample(model), runs: (label, gpus, engine settings), xDiT Sampler's node arguments or None)
    ("krea2 turbo template: KSampler cfg 1, ConditioningZeroOut", 1.0, lambda m: ksampler(m, pos, zero, 1.0),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ring2", "0,1", dict(X, ring=2)),
      ("ulysses2 shard2", "0,1", dict(X, ulysses=2, shard=2))], (pos, zero, 1.0)),
    ("krea2 raw: cfg 4, a negative of another length", 4.0, lambda m: ksampler(m, pos, neg, 4.0),
     [("gpus=0", "0", {}), ("cfg2", "0,1", dict(X, cfg_parallel=True)), ("ulysses2", "0,1", dict(X, ulysses=2)),
      ("cfg2 shard2", "0,1", dict(X, cfg_parallel=True, shard=2))], (pos, neg, 4.0)),
    ("krea2 style reference template: index_timestep_zero, ModelSamplingFlux, CFGGuider, SamplerCustomAdvanced",
     1.0, lambda m: custom(m, referenced(pos, [ref_a], "index_timestep_zero"), referenced(zero, [ref_a])),
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(X, ulysses=2)), ("ring2", "0,1", dict(X, ring=2))], None),
    ("krea2 references without a method (ignored)", 1.0, lambda m: ksampler(m, referenced(pos, [ref_a]), zero, 1.0),
     [("gpus=0,1", "0,1", {})], None),
    ("krea2 two references by index, cfg 3", 3.0,
     lambda m: ksampler(m, referenced(pos, [ref_a, ref_b], "index"), referenced(neg, [ref_a, ref_b], "index"), 3.0),
     [("gpus=0", "0", {}), ("ring2", "0,1", dict(X, ring=2)), ("cfg2", "0,1", dict(X, cfg_parallel=True))],
     (referenced(pos, [ref_a, ref_b], "index"), referenced(neg, [ref_a, ref_b], "index"), 3.0)),
    ("krea2 LoRA (LoraLoaderModelOnly 0.8), cfg 1", 1.0, lambda m: ksampler(m, pos, zero, 1.0, lora=True),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {})], None),
]
plain = None
for name, cfg, sample, runs, loop in GRAPHS:
    t0 = time.perf_counter()
    want = sample(native())
    entry = {"cfg": cfg, "native_s": round(time.perf_counter() - t0, 2)}
    plain = want if plain is None else plain
    entry["native_vs_turbo_rel_l2"] = rel(want, plain)   # what the graph's settings move ComfyUI's own result by
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model)
        entry[label] = {"rel_l2": rel(got, want), "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    if loop is not None:   # the sampler swapped too: xDiT Sampler runs the MODEL chain in the engine's own loop
        eng, model = engine("0,1")
        got = ksampler(model, *loop, node="XDiTSampler")
        entry["xdit sampler gpus=0,1"] = {"rel_l2": rel(got, want), "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# a mixed-precision fp8 file (Comfy-Org's Krea 2 releases are fp8): ComfyUI's own fp8 layers against its model on the
# file's exact weights, and the engine against both
want = ksampler(native(MIXED), pos, neg, 4.0)
with safe_open(folder_paths.get_full_path("diffusion_models", MIXED), "pt") as f:
    sd = {k: f.get_tensor(k) for k in f.keys()}
exact_sd = {k: (v.float() * sd[k[:-len("weight")] + "weight_scale"].float()
                if k.endswith(".weight") and k[:-len("weight")] + "weight_scale" in sd else v.float())
            for k, v in sd.items() if not k.endswith(".weight_scale")}
exact_model = comfy.sd.load_diffusion_model_state_dict(exact_sd, model_options={"dtype": torch.float32})
exact_out = ksampler(exact_model, pos, neg, 4.0)
entry = {"cfg": 4.0, "comfyui_fp8_vs_exact_rel_l2": rel(want, exact_out)}
for label, gpus, kw in (("gpus=0", "0", {}), ("ulysses2 shard2", "0,1", dict(X, ulysses=2, shard=2))):
    eng, model = engine(gpus, file=MIXED, **kw)
    got = ksampler(model, pos, neg, 4.0)
    entry[label] = {"rel_l2": rel(got, want), "vs_comfyui_exact_rel_l2": rel(got, exact_out), "plan": last_plan(eng)}
report["graphs"]["krea2 fp8 mixed file, cfg 4"] = entry
print("krea2 fp8 mixed", json.dumps(entry), flush=True)
print("REPORT " + json.dumps(report), flush=True)
