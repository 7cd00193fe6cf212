"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own MiniMax-H3 graphs (text-to-video
with audio: EmptyMiniMaxH3LatentAV, KSampler; the turbo form at cfg 1, the full form at cfg 4 with a negative prompt,
MiniMaxH3SigmaShift and the text encoder's token tags) on the model ComfyUI's UNETLoader makes of a tiny H3 file, and
with the loader swapped for the xDiT Engine on 1 and 2 CPU ranks (Ulysses, Ring, CFG parallel, the weights divided);
the video and audio latents compared each. Prints one JSON report.
Usage: python comfyui_h3_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import os
import sys
import time

from comfyui_live_common import call, last_plan, native_model, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv)
import torch  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

FILE = "tiny-minimax-h3.safetensors"
LORA = "tiny-minimax-h3-lora.safetensors"   # LoRA factors on fused q/k/v, the SwiGLU's up and a modulation
report = {"comfyui": VERSION, "graphs": {}, "refusals": {}}


PRUNED = "tiny-minimax-h3-pruned.safetensors"   # the pruned form: adaln curve table instead of a time embedder
MIXED = "tiny-minimax-h3-fp8_mixed.safetensors"  # ComfyUI's mixed-precision fp8: the blocks' matrices fp8 + scales
INT8 = "tiny-minimax-h3-pruned-int8_convrot.safetensors"   # Comfy-Org's release format: pruned, int8 ConvRot


def dequantized_int8(file):
    """The int8 file's exact weights as a plain float32 file, dequantized with ComfyUI's own kitchen (q x scale, ConvRot
    undone), for ComfyUI's model without int8 arithmetic: ComfyUI's int8 layers also quantize each activation row to
    int8 (comfy_kitchen int8_linear), which the engine does not."""
    import comfy.utils
    from comfy_kitchen.backends.eager.quantization import dequantize_int8_convrot_weight, dequantize_int8_simple
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = folder_paths.get_full_path("diffusion_models", file)
    sd = comfy.utils.load_torch_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    layers = json.loads(meta.get("_quantization_metadata", "{}")).get("layers", {})
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight_scale"):
            continue
        layer = k[:-len(".weight")]
        conf = layers.get(layer)
        if conf is None:
            out[k] = v.float()
        elif conf.get("convrot"):
            out[k] = dequantize_int8_convrot_weight(v, sd[layer + ".weight_scale"].float(), conf["convrot_groupsize"])
        else:
            out[k] = dequantize_int8_simple(v, sd[layer + ".weight_scale"].float())
    name = file.replace(".safetensors", "-dequantized.safetensors")
    save_file(out, os.path.join(models, "diffusion_models", name), metadata={"xdit.synthetic": meta["xdit.synthetic"]})
    return name


def native(file):
    """UNETLoader's model of a tiny file; a mixed-precision fp8 file through ComfyUI's loader with its header (whose
    quantization metadata UNETLoader reads)."""
    if file in (MIXED, INT8):
        import comfy.sd
        return comfy.sd.load_diffusion_model(folder_paths.get_full_path("diffusion_models", file),
                                             model_options={"dtype": torch.float32})
    return native_model(file)


def engine(gpus, file=FILE, **kw):
    return live.engine(file, gpus, **kw)




def chain(model, shift):
    return call("MiniMaxH3SigmaShift", model=model, shift_video=shift[0], shift_audio=shift[1])[0] if shift else model


def sample(model, pos, neg, cfg, latent, shift=None, node="KSampler"):
    out = call(node, model=chain(model, shift), seed=5, steps=3, cfg=cfg, sampler_name="euler", scheduler="simple",
               positive=pos, negative=neg, latent_image=latent, denoise=1.0)[0]["samples"]
    return out.unbind() if out.is_nested else (out,)


if "EmptyMiniMaxH3LatentAV" not in nodes.NODE_CLASS_MAPPINGS:   # a ComfyUI older than MiniMax-H3 (0.33)
    report["older"] = live.older_ksampler(engine("0")[1], 48, (1, 24, 2, 4, 6))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

g = torch.Generator().manual_seed(2)
TEXT = 48   # the tiny file's text width
pos = [[torch.randn(1, 9, TEXT, generator=g), {}]]
neg = [[torch.randn(1, 6, TEXT, generator=g), {}]]
tagged = [[pos[0][0], {"minimax_token_tags": torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 1]])}]]
latent = call("EmptyMiniMaxH3LatentAV", width=96, height=64, length=22)[0]


def r(*shape):
    return torch.randn(*shape, generator=g)


# MiniMaxH3ImageToVideo's first and last frames, MiniMaxH3AddGuide's 5-frame clip with its soundtrack at frame 5 and
# an audio guide at frame 12, as those nodes put them in the conditioning (VAE latents of the canvas's size)
keyframes = [{"resolved_frame_index": 0, "latent": r(1, 24, 1, 4, 6)},
             {"resolved_frame_index": 21, "latent": r(1, 24, 1, 4, 6)},
             {"resolved_frame_index": 5, "latent": r(1, 24, 2, 4, 6), "audio_latent": r(1, 32, 2, 8)},
             {"resolved_frame_index": 12, "audio_latent": r(1, 32, 2, 6)}]
guided = [[pos[0][0], {"minimax_keyframes": keyframes, "minimax_visual_cond_noise_aug": 0.95}]]
# MiniMaxH3ReferenceToVideo's blocks: an image, an audio, a video with its soundtrack (each at its own size)
refs = [{"kind": "image", "latent_h": 2, "latent_w": 4, "latent": r(1, 24, 1, 2, 4)},
        {"kind": "audio", "ref_audio_t": 6, "audio_latent": r(1, 32, 2, 6)},
        {"kind": "video_audio", "latent_t": 2, "latent_h": 4, "latent_w": 2, "ref_audio_t": 5,
         "latent": r(1, 24, 2, 4, 2), "audio_latent": r(1, 32, 2, 5)}]
referenced = [[pos[0][0], {"minimax_refs": refs, "minimax_token_tags": torch.tensor([[1, 0, 0, 0, 2, 2, 1, 1, 1]])}]]
video, audio = latent["samples"].unbind()
report["latent"] = {"video": list(video.shape), "audio": list(audio.shape)}

GRAPHS = [
    # (name, positive, negative, cfg, MiniMaxH3SigmaShift or None, runs: (label, gpus, engine settings))
    ("h3 t2va turbo cfg1", pos, neg, 1.0, None,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ring2", "0,1", dict(plan="explicit", ring=2)),
      ("ulysses2 shard2", "0,1", dict(plan="explicit", ulysses=2, shard=2))]),
    ("h3 t2va cfg4, negative, SigmaShift 10/2.5, token tags", tagged, neg, 4.0, (10.0, 2.5),
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))]),
    ("h3 fl2va: first and last frames, a guide clip with its audio, an audio guide", guided, neg, 1.0, None,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ring2", "0,1", dict(plan="explicit", ring=2))]),
    ("h3 ref2va: image, audio and video+soundtrack references, cfg 3", referenced, neg, 3.0, None,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
      ("ring2 shard2", "0,1", dict(plan="explicit", ring=2, shard=2))]),
]
GRAPHS += [
    ("h3 pruned file: t2va cfg 4", pos, neg, 4.0, None,
     [("gpus=0", "0", dict(file=PRUNED)), ("gpus=0,1", "0,1", dict(file=PRUNED)),
      ("ulysses2", "0,1", dict(file=PRUNED, plan="explicit", ulysses=2))]),
    ("h3 pruned file: fl2va", guided, neg, 1.0, None,
     [("gpus=0", "0", dict(file=PRUNED)), ("ring2", "0,1", dict(file=PRUNED, plan="explicit", ring=2))]),
    ("h3 pruned int8 ConvRot file (the templates' format): fl2va", guided, neg, 1.0, None,
     [("gpus=0", "0", dict(file=INT8)), ("gpus=0,1", "0,1", dict(file=INT8)),
      ("ulysses2 shard2", "0,1", dict(file=INT8, plan="explicit", ulysses=2, shard=2))]),
    ("h3 fp8 mixed file: t2va cfg 4", pos, neg, 4.0, None,
     [("gpus=0", "0", dict(file=MIXED)), ("gpus=0,1", "0,1", dict(file=MIXED)),
      ("ulysses2 shard2", "0,1", dict(file=MIXED, plan="explicit", ulysses=2, shard=2))])]
plain = None
for name, p, n, cfg, shift, runs in GRAPHS:
    t0 = time.perf_counter()
    file = runs[0][2].get("file", FILE)
    want = sample(native(file), p, n, cfg, latent, shift)
    entry = {"native_s": round(time.perf_counter() - t0, 2)}
    plain = plain or want
    if file != FILE:   # another model: compared with its own plain graph
        entry["native_vs_t2va_rel_l2"] = None
    if file == INT8:   # how far ComfyUI's own int8 arithmetic is from the file's exact weights
        exact = sample(native_model(dequantized_int8(file)), p, n, cfg, latent, shift)
        entry["comfyui_int8_vs_exact_rel_l2"] = max(rel(want[0], exact[0]), rel(want[1], exact[1]))
        entry["comfyui_exact"] = exact
    # how far the graph's conditioning moves ComfyUI's own result from the plain text-to-video one (what a dropped
    # keyframe or reference would show as)
    if file == FILE:
        entry["native_vs_t2va_rel_l2"] = rel(want[0], plain[0]) + rel(want[1], plain[1])
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model, p, n, cfg, latent, shift)
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
        if "comfyui_exact" in entry:   # and against ComfyUI's model on the exact weights
            exact = entry["comfyui_exact"]
            entry[label]["vs_comfyui_exact_rel_l2"] = max(rel(got[0], exact[0]), rel(got[1], exact[1]))
    # xDiT Sampler on the engine's MODEL: ComfyUI's sampler drives it (the engine's own loop takes one latent stream)
    eng, model = engine("0,1", file=file)
    got = sample(model, p, n, cfg, latent, shift, node="XDiTSampler")
    entry["xdit sampler gpus=0,1"] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                                      "plan": last_plan(eng)}
    entry.pop("comfyui_exact", None)
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# ComfyUI's own MiniMax-H3 template's sampling: the turbo LoRA (LoraLoaderModelOnly), BasicGuider, BasicScheduler,
# KSamplerSelect res_multistep, RandomNoise, SamplerCustomAdvanced (its MiniMaxH3ImageToVideo needs a text encoder and
# a VAE, so the conditioning it would make stands here: a first frame keyframe)
def template(model):
    model = call("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=1.0)[0]
    guider = call("BasicGuider", model=model, conditioning=guided)[0]
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    out = call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
               sampler=call("KSamplerSelect", sampler_name="res_multistep")[0], sigmas=sigmas,
               latent_image=latent)[0]["samples"]
    return out.unbind()


want = template(native_model(FILE))
entry = {}
for label, gpus, kw in (("gpus=0", "0", {}), ("gpus=0,1", "0,1", {})):
    eng, model = engine(gpus, **kw)
    got = template(model)
    entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                    "plan": last_plan(eng)}
no_lora = call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0],
               guider=call("BasicGuider", model=native_model(FILE), conditioning=guided)[0],
               sampler=call("KSamplerSelect", sampler_name="res_multistep")[0],
               sigmas=call("BasicScheduler", model=native_model(FILE), scheduler="simple", steps=3, denoise=1.0)[0],
               latent_image=latent)[0]["samples"].unbind()
entry["native_lora_effect_rel_l2"] = rel(want[0], no_lora[0]) + rel(want[1], no_lora[1])
report["graphs"]["h3 template: turbo LoRA, BasicGuider, res_multistep, SamplerCustomAdvanced"] = entry
print("h3 template", json.dumps(entry), flush=True)

# a noise mask on the AV latent (extending a clip: its first latent frames and audio frames kept, one frame half
# regenerated): ComfyUI's model gives masked rows their own timesteps
import comfy.nested_tensor  # noqa: E402 (0.33 and newer)
video_mask, audio_mask = torch.ones(1, 1, 7, 4, 6), torch.ones(1, 1, 2, 37)
video_mask[:, :, 0], video_mask[:, :, 3, :2] = 0.0, 0.5
audio_mask[..., :6] = 0.0
masked = {"samples": comfy.nested_tensor.NestedTensor((r(1, 24, 7, 4, 6), r(1, 32, 2, 37))),
          "noise_mask": comfy.nested_tensor.NestedTensor((video_mask, audio_mask))}
want = sample(native_model(FILE), pos, neg, 1.0, masked)
entry = {"native_vs_t2va_rel_l2": rel(want[0], plain[0]) + rel(want[1], plain[1])}
for label, gpus, kw in (("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))):
    eng, model = engine(gpus, **kw)
    got = sample(model, pos, neg, 1.0, masked)
    entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                    "plan": last_plan(eng)}
report["graphs"]["h3 v2va: a noise mask keeps the first frames and audio, half a frame regenerated"] = entry
print("h3 noise mask", json.dumps(entry), flush=True)
print("REPORT " + json.dumps(report), flush=True)
