"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own LTX-2.3 sampling (the stock
template's: LTXVConditioning's frame rate, LTXVConcatAVLatent of the video and audio latents, CFGGuider,
KSamplerSelect, ManualSigmas, SamplerCustomAdvanced; text-to-video with audio at cfg 1 and at cfg 3 with a negative,
euler_cfg_pp and euler_ancestral_cfg_pp; image-to-video through LTXVImgToVideoInplace's noise mask on the first frame;
the distilled LoRA through LoraLoaderModelOnly; LTXVAddGuide's first and last frames at 0.7, one with a pixel attention
mask, one an IC-LoRA's dilated reference; the extra passes of LTXVSpatioTemporalGuidance, LTXVModalityGuidance and
LTXVReferenceAudio) on the model ComfyUI's own loader makes of a tiny LTX-2.3 file, and
with the loader swapped for the xDiT Engine on 1 and 2 CPU ranks (auto, Ulysses, Ring, CFG parallel, the weights
divided); the video and audio latents compared each. The conditioning is built directly (no text encoder): random
text of the LTX-2.3 text projection's width [1, L, video inner + audio inner], marked unprocessed as
LTXAVTextEncoderLoader's CLIP marks it. Prints one JSON report.
Usage: python comfyui_ltx_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys
import time

from comfyui_live_common import call, last_plan, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv, folders=("diffusion_models", "loras", "checkpoints"))
import torch  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

FILE = "tiny-ltx-2.3.safetensors"
MIXED = "tiny-ltx-2.3-fp8_mixed.safetensors"   # ComfyUI's mixed-precision fp8: the blocks' matrices fp8 + their scales
CKPT = "tiny-ltx-2.3-av.safetensors"      # model, VAE (and the text projection) in one file, as the templates load it
LORA = "tiny-ltx-2.3-lora.safetensors"   # LoRA factors on a self-attention, a2v, v2a and a feed-forward
report = {"comfyui": VERSION, "graphs": {}, "refusals": {}}


def engine(gpus, file=FILE, **kw):
    return live.engine(file, gpus, **kw)


if "LTXVConcatAVLatent" not in nodes.NODE_CLASS_MAPPINGS:   # a ComfyUI older than LTX-2.3's audio-video model
    report["older"] = live.older_ksampler(engine("0")[1], 96, (1, 128, 2, 2, 2))
    report["older_checkpoint"] = live.outcome(lambda: live.checkpoint_loader(CKPT, "0"))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

import comfy.sd  # noqa: E402
from safetensors import safe_open  # noqa: E402

path = folder_paths.get_full_path("diffusion_models", FILE)
with safe_open(path, "pt") as f:
    header = json.loads(f.metadata()["config"])["transformer"]
    file_keys = set(f.keys())
TEXT = header["cross_attention_dim"] + header["audio_cross_attention_dim"]   # the raw text's width
FPS = 24.0


def native(file=FILE):
    """UNETLoader's model of the file (comfy.sd.load_diffusion_model: the header's config, and a mixed-precision file's
    quantization metadata, given to its detection), computing in float32."""
    return comfy.sd.load_diffusion_model(folder_paths.get_full_path("diffusion_models", file),
                                         model_options={"dtype": torch.float32})


# ComfyUI's own model holds exactly the file's tensors (its LTXAVModel's state dict: nothing missing or extra)
own = native().model.diffusion_model.state_dict()
report["keys"] = {"file": len(file_keys), "comfyui_model": len(own),
                  "missing_in_file": sorted(set(own) - file_keys)[:5],
                  "extra_in_file": sorted(file_keys - set(own))[:5]}

g = torch.Generator().manual_seed(2)
raw_pos = [[torch.randn(1, 9, TEXT, generator=g), {"unprocessed_ltxav_embeds": True}]]
raw_neg = [[torch.randn(1, 5, TEXT, generator=g), {"unprocessed_ltxav_embeds": True}]]
pos, neg = call("LTXVConditioning", positive=raw_pos, negative=raw_neg, frame_rate=FPS)[:2]
video = call("EmptyLTXVLatentVideo", width=96, height=64, length=17, batch_size=1)[0]   # [1, 128, 3, 2, 3]
audio = {"samples": torch.zeros(1, 8, round(17 / FPS * 25), 16)}   # LTXVEmptyLatentAudio's shape (25 latents a second)
latent = call("LTXVConcatAVLatent", video_latent=video, audio_latent=audio)[0]
# LTXVImgToVideoInplace at strength 0.7: the image's latent in frame 0, its noise mask 1 - 0.7 there
first = video["samples"].clone()
first[:, :, :1] = torch.randn(1, 128, 1, 2, 3, generator=g)
mask = torch.ones(1, 1, first.shape[2], 1, 1)
mask[:, :, :1] = 1.0 - 0.7
image_latent = call("LTXVConcatAVLatent", video_latent={"samples": first, "noise_mask": mask}, audio_latent=audio)[0]
report["latent"] = {"video": list(video["samples"].shape), "audio": list(audio["samples"].shape)}

SIGMAS = "1.0, 0.99375, 0.909375, 0.725, 0.421875, 0.0"   # the template's first-stage ManualSigmas, fewer steps


def sample(model, p, n, cfg, lat, sampler, lora=False):
    if lora:
        model = call("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=0.5)[0]
    guider = call("CFGGuider", model=model, positive=p, negative=n, cfg=cfg)[0]
    out = call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
               sampler=call("KSamplerSelect", sampler_name=sampler)[0], sigmas=call("ManualSigmas", sigmas=SIGMAS)[0],
               latent_image=lat)[0]["samples"]
    return out.unbind()


GRAPHS = [
    # (name, cfg, latent, sampler, LoRA, runs: (label, gpus, engine settings))
    ("ltx t2va cfg1 euler_cfg_pp", 1.0, latent, "euler_cfg_pp", False,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ring2", "0,1", dict(plan="explicit", ring=2)),
      ("ulysses2 shard2", "0,1", dict(plan="explicit", ulysses=2, shard=2))]),
    ("ltx t2va cfg3 negative euler_ancestral_cfg_pp", 3.0, latent, "euler_ancestral_cfg_pp", False,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
      ("cfg2", "0,1", dict(plan="explicit", cfg_parallel=True))]),
    ("ltx i2va: first frame through the noise mask (strength 0.7), cfg 3", 3.0, image_latent, "euler_cfg_pp", False,
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
      ("ring2 shard2", "0,1", dict(plan="explicit", ring=2, shard=2)), ("cfg2", "0,1", dict(plan="explicit",
                                                                                           cfg_parallel=True))]),
    ("ltx template: distilled LoRA 0.5, cfg 1, euler", 1.0, latent, "euler", True,
     [("gpus=0", "0", {}), ("gpus=0,1", "0,1", {})]),
    ("ltx fp8 mixed file: t2va cfg 3", 3.0, latent, "euler_cfg_pp", False,
     [("gpus=0", "0", dict(file=MIXED)), ("gpus=0,1", "0,1", dict(file=MIXED)),
      ("ulysses2 shard2", "0,1", dict(file=MIXED, plan="explicit", ulysses=2, shard=2))]),
]
plain = None
for name, cfg, lat, sampler, lora, runs in GRAPHS:
    t0 = time.perf_counter()
    file = runs[0][2].get("file", FILE)
    want = sample(native(file), pos, neg, cfg, lat, sampler, lora)
    entry = {"native_s": round(time.perf_counter() - t0, 2)}
    plain = plain or want
    # how far the graph's conditioning moves ComfyUI's own result from the first graph's (what a dropped mask, cfg or
    # LoRA would show as)
    entry["native_vs_first_rel_l2"] = rel(want[0], plain[0]) + rel(want[1], plain[1])
    if lora:
        no_lora = sample(native(), pos, neg, cfg, lat, sampler)
        entry["native_lora_effect_rel_l2"] = rel(want[0], no_lora[0]) + rel(want[1], no_lora[1])
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model, pos, neg, cfg, lat, sampler, lora)
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# xDiT Sampler on the engine's MODEL: its own loop samples one latent stream, so ComfyUI's KSampler drives the engine
# (the same result as KSampler on ComfyUI's own model)
def ksampler(model, node="KSampler"):
    out = call(node, model=model, seed=5, steps=3, cfg=3.0, sampler_name="euler", scheduler="simple", positive=pos,
               negative=neg, latent_image=latent, denoise=1.0)[0]["samples"]
    return out.unbind()


want = ksampler(native())
eng, model = engine("0,1")
got = ksampler(model, node="XDiTSampler")
report["graphs"]["ltx t2va, xDiT Sampler (KSampler's route), cfg 3"] = {
    "xdit sampler gpus=0,1": {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                              "plan": last_plan(eng)}}

# ---- xDiT Checkpoint Loader in place of the templates' CheckpointLoaderSimple (diffusion model, text projection and
# VAE in one file): ComfyUI's own text encoder and VAE, the engine's MODEL. The file gets a real (tiny) LTX video VAE
# first: ComfyUI's own VideoVAE class at a tiny config, stated in the header as LTX files state theirs
TINY_VAE = live.TINY_LTX_VAE


def add_tiny_vae(path):
    from safetensors.torch import load_file, save_file
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    sd = {k: v for k, v in load_file(path).items() if not k.startswith("vae.")}
    sd.update({"vae." + k: t for k, t in live.tiny_ltx_vae_state().items()})
    config = json.loads(metadata["config"])
    config["vae"] = TINY_VAE
    save_file(sd, path, metadata={**metadata, "config": json.dumps(config)})


add_tiny_vae(folder_paths.get_full_path("checkpoints", CKPT))
stock_model, stock_clip, stock_vae = call("CheckpointLoaderSimple", ckpt_name=CKPT)
stock_vae_sd = stock_vae.first_stage_model.state_dict()
want = sample(stock_model, pos, neg, 3.0, image_latent, "euler_cfg_pp")
want_frames = stock_vae.decode(want[0])
entry = {"stock_clip": type(stock_clip).__name__, "stock_vae": type(stock_vae.first_stage_model).__name__,
         "frames": list(want_frames.shape),
         # the checkpoint's diffusion model is the file the other graphs load: the same result as UNETLoader's
         "stock_vs_unet_loader_rel_l2": rel(want[0], sample(native(), pos, neg, 3.0, image_latent, "euler_cfg_pp")[0])}
for label, gpus, kw in (("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))):
    model, clip, vae, eng = live.checkpoint_loader(CKPT, gpus, **kw)
    got = sample(model, pos, neg, 3.0, image_latent, "euler_cfg_pp")
    vae_sd = vae.first_stage_model.state_dict()
    entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                    "plan": last_plan(eng), "clip": type(clip).__name__,
                    "vae_state_equal": list(vae_sd) == list(stock_vae_sd)
                    and all(torch.equal(vae_sd[k], stock_vae_sd[k]) for k in vae_sd),
                    "frames_rel_l2": rel(vae.decode(got[0]), want_frames)}
report["graphs"]["ltx i2va through xDiT Checkpoint Loader, cfg 3, decoded by its VAE"] = entry
print("checkpoint", json.dumps(entry), flush=True)

# ---- LTXVAddGuide (the First-Last-Frame template's guides), through ComfyUI's own node and the file's tiny VAE: a
# first image at frame 0 and a last at frame -1, each at 0.7 (appended latent frames, their noise mask 0.3, their
# positions, the attention weight 0.7 between them and the generated tokens); the last with an attention mask over its
# pixels; an IC-LoRA's half-size reference (dilated: the tokens between its rows and columns out of the sequence)
def guided(width, attention_mask=None, iclora=None):
    images = torch.rand(2, 64, width, 3, generator=torch.Generator().manual_seed(7))
    empty = call("EmptyLTXVLatentVideo", width=width, height=64, length=17, batch_size=1)[0]
    p, n, lat = call("LTXVAddGuide", positive=pos, negative=neg, vae=stock_vae, latent=empty, image=images[:1],
                     frame_idx=0, strength=0.7)
    extra = {"attention_mask": attention_mask} if attention_mask is not None else {}
    if iclora is not None:
        extra["iclora_parameters"] = iclora
    p, n, lat = call("LTXVAddGuide", positive=p, negative=n, vae=stock_vae, latent=lat, image=images[1:],
                     frame_idx=-1, strength=0.7, **extra)
    return p, n, call("LTXVConcatAVLatent", video_latent=lat, audio_latent=audio)[0]


for name, (gp, gn, glat), runs in (
        ("ltx flf: LTXVAddGuide first and last frames at 0.7, cfg 3", guided(96),
         [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
          ("ring2", "0,1", dict(plan="explicit", ring=2)), ("cfg2", "0,1", dict(plan="explicit", cfg_parallel=True))]),
        ("ltx flf: the last guide with an attention mask, cfg 3", guided(96, torch.linspace(0, 1, 64 * 96).reshape(
            1, 64, 96)), [("gpus=0", "0", {}), ("ring2 shard2", "0,1", dict(plan="explicit", ring=2, shard=2))]),
        ("ltx flf: the last guide an IC-LoRA reference at half size, cfg 3", guided(128, iclora={
            "reference_downscale_factor": 2}), [("gpus=0", "0", {}), ("ring2", "0,1", dict(plan="explicit",
                                                                                              ring=2))])):
    want = sample(native(), gp, gn, 3.0, glat, "euler_cfg_pp")
    unweighted = [[c[0], {**c[1], "guide_attention_entries": None}] for c in gp], \
        [[c[0], {**c[1], "guide_attention_entries": None}] for c in gn]
    entry = {"video": list(glat["samples"][0].shape), "keyframe_tokens": list(gp[0][1]["keyframe_idxs"].shape),
             # how far the guides' attention weights move ComfyUI's own result (what a dropped bias would show as)
             "native_weights_effect_rel_l2": rel(sample(native(), *unweighted, 3.0, glat, "euler_cfg_pp")[0],
                                                 want[0])}
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        got = sample(model, gp, gn, 3.0, glat, "euler_cfg_pp")
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# ---- the extra passes LTX-2.3's guidance nodes add after CFG (each a post-CFG function calling the model once more a
# step): LTXVSpatioTemporalGuidance (blocks 1 and 2: their self-attentions pass their values through),
# LTXVModalityGuidance (the audio-video cross-attentions severed), LTXVReferenceAudio (ID-LoRA: a reference audio's
# tokens ahead of the audio, and a pass without them), each through ComfyUI's own node on the MODEL; the reference's
# audio VAE a stand-in whose encode gives fixed latents (the node's only use of it)
class StandInAudioVAE:
    audio_sample_rate = 16000

    def encode(self, waveform):
        return torch.randn(1, 8, 6, 16, generator=torch.Generator().manual_seed(11))


def guided_by(kind):
    def patch(model, p, n):
        if kind == "stg":
            return call("LTXVSpatioTemporalGuidance", model=model, scale=1.0, blocks="1, 2", start_percent=0.0,
                        end_percent=1.0)[0], p, n
        if kind == "modality":
            return call("LTXVModalityGuidance", model=model, modality_scale=3.0, start_percent=0.0,
                        end_percent=1.0)[0], p, n
        return call("LTXVReferenceAudio", model=model, positive=p, negative=n,
                    reference_audio={"waveform": torch.zeros(1, 1, 16000), "sample_rate": 16000},
                    audio_vae=StandInAudioVAE(), identity_guidance_scale=3.0, start_percent=0.0, end_percent=1.0)
    return patch


for name, kind, runs in (
        ("ltx guidance: STG on blocks 1 and 2 (scale 1), cfg 3", "stg",
         [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))]),
        ("ltx guidance: modality (scale 3), cfg 3", "modality",
         [("gpus=0", "0", {}), ("ring2", "0,1", dict(plan="explicit", ring=2))]),
        ("ltx guidance: reference audio (ID-LoRA, identity 3), cfg 3", "reference",
         [("gpus=0", "0", {}), ("cfg2", "0,1", dict(plan="explicit", cfg_parallel=True)),
          ("ulysses2", "0,1", dict(plan="explicit", ulysses=2))])):
    want = sample(*guided_by(kind)(native(), pos, neg), 3.0, image_latent, "euler_cfg_pp")
    plain_want = sample(native(), pos, neg, 3.0, image_latent, "euler_cfg_pp")
    entry = {"native_guidance_effect_rel_l2": rel(want[0], plain_want[0]) + rel(want[1], plain_want[1])}
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        got = sample(*guided_by(kind)(model, pos, neg), 3.0, image_latent, "euler_cfg_pp")
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# what the engine does not run yet: one line each
eng, model = engine("0")
connected = [[pos[0][0], {k: v for k, v in pos[0][1].items() if k != "unprocessed_ltxav_embeds"}]]
report["refusals"]["connected text"] = live.outcome(lambda: sample(model, connected, neg, 1.0, latent, "euler"))
one_way = model.clone()
one_way.model_options.setdefault("transformer_options", {})["a2v_cross_attn"] = False
report["refusals"]["one direction severed"] = live.outcome(lambda: sample(one_way, pos, neg, 1.0, latent, "euler"))
print("REPORT " + json.dumps(report), flush=True)
