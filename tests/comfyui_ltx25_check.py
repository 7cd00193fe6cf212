"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own LTX-2.5 sampling on the model its
own loader (UNETLoader) makes of a tiny LTX-2.5 file (ff_bias false in its header, keyframes_abs_pos_embedding among
its tensors), and with the loader swapped for the xDiT Engine on 1 and 2 CPU ranks (Ulysses, Ring, CFG parallel, data
parallel, the weights divided); the video and audio latents compared each. The templates' sampling
(LTXVConditioning at 24 fps, LTXVConcatAVLatent, LTXVDualCFGGuider at video 1 / audio 1, euler_ancestral,
ManualSigmas, SamplerCustomAdvanced), LTXVDualCFGGuider at video 3 / audio 7 (the negative always run, the audio
scale on the packed tail), a first frame through LTXVImgToVideoInplace's noise mask, LTXVAddGuide's first and last
frames (the frame-0 guide never takes the keyframe embedding), a generated_keyframes entry, a batch of two clips.
ComfyUI's own result with the keyframe embedding zeroed shows it applies the embedding in plain text-to-video. The
conditioning is built directly (no text encoder), marked unprocessed as ComfyUI's LTX CLIP marks it. Prints one JSON
report. Usage: python comfyui_ltx25_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import json
import sys
import time

from comfyui_live_common import call, last_plan, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv)
import torch  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

FILE = "tiny-ltx-2.5.safetensors"
report = {"comfyui": VERSION, "graphs": {}}


def engine(gpus, **kw):
    return live.engine(FILE, gpus, **kw)


if "LTXVDualCFGGuider" not in nodes.NODE_CLASS_MAPPINGS:   # a ComfyUI older than LTX-2.5 (0.32's #15499)
    report["older"] = live.older_ksampler(engine("0")[1], 96, (1, 128, 2, 2, 2))
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

import comfy.sd  # noqa: E402
import node_helpers  # noqa: E402
from safetensors import safe_open  # noqa: E402

with safe_open(folder_paths.get_full_path("diffusion_models", FILE), "pt") as f:
    header = json.loads(f.metadata()["config"])["transformer"]
    file_keys = set(f.keys())
TEXT = header["cross_attention_dim"] + header["audio_cross_attention_dim"]   # the raw text's width
FPS = 24.0   # the LTX-2.5 templates' frame rate


def native():
    """UNETLoader's model of the file (comfy.sd.load_diffusion_model: the header's config given to its detection),
    computing in float32."""
    return comfy.sd.load_diffusion_model(folder_paths.get_full_path("diffusion_models", FILE),
                                         model_options={"dtype": torch.float32})


# ComfyUI's own model: the file's tensors exactly, built with ff_bias false and the keyframe embedding
own = native().model.diffusion_model
report["model"] = {"file_keys": len(file_keys), "comfyui_keys": len(own.state_dict()),
                   "missing_in_file": sorted(set(own.state_dict()) - file_keys)[:5],
                   "extra_in_file": sorted(file_keys - set(own.state_dict()))[:5],
                   "ff_bias": own.ff_bias, "keyframes_embedding": own.keyframes_abs_pos_embedding is not None,
                   "ff_has_bias": own.transformer_blocks[0].ff.net[2].bias is not None,
                   "audio_ff_has_bias": own.transformer_blocks[0].audio_ff.net[2].bias is not None}

g = torch.Generator().manual_seed(2)
raw_pos = [[torch.randn(1, 9, TEXT, generator=g), {"unprocessed_ltxav_embeds": True}]]
raw_neg = [[torch.randn(1, 5, TEXT, generator=g), {"unprocessed_ltxav_embeds": True}]]
pos, neg = call("LTXVConditioning", positive=raw_pos, negative=raw_neg, frame_rate=FPS)[:2]


def av_latent(video_latent, batch=1):
    audio = {"samples": torch.zeros(batch, 8, round(17 / FPS * 25), 16)}   # LTXVEmptyLatentAudio's shape
    return call("LTXVConcatAVLatent", video_latent=video_latent, audio_latent=audio)[0]


video = call("EmptyLTXVLatentVideo", width=96, height=64, length=17, batch_size=1)[0]   # [1, 128, 3, 2, 3]
latent = av_latent(video)
batch = av_latent(call("EmptyLTXVLatentVideo", width=96, height=64, length=17, batch_size=2)[0], batch=2)
first = video["samples"].clone()   # LTXVImgToVideoInplace at 0.7: the image's latent in frame 0, noise mask 0.3 there
first[:, :, :1] = torch.randn(1, 128, 1, 2, 3, generator=g)
mask = torch.ones(1, 1, first.shape[2], 1, 1)
mask[:, :, :1] = 1.0 - 0.7
image_latent = av_latent({"samples": first, "noise_mask": mask})

# LTXVAddGuide's first image at frame 0 and last at frame -1, each at 0.7, through a tiny LTX video VAE of ComfyUI's own
# class
vae = comfy.sd.VAE(sd=live.tiny_ltx_vae_state(), metadata={"config": json.dumps({"vae": live.TINY_LTX_VAE})})
images = torch.rand(2, 64, 96, 3, generator=torch.Generator().manual_seed(7))
gp, gn, glat = call("LTXVAddGuide", positive=pos, negative=neg, vae=vae, latent=video, image=images[:1], frame_idx=0,
                    strength=0.7)
gp, gn, glat = call("LTXVAddGuide", positive=gp, negative=gn, vae=vae, latent=glat, image=images[1:], frame_idx=-1,
                    strength=0.7)
guided = av_latent(glat)
# generated keyframes (no node of 0.33 sets them; a conditioning entry its model reads): latent frame 1's 6 tokens
slot = {"generated_keyframes": {"tokens_per_frame": 6, "first_latent_frame": 1, "num_keyframes": 1}}
kp, kn = (node_helpers.conditioning_set_values(c, slot) for c in (pos, neg))

SIGMAS = "1.0, 0.99375, 0.909375, 0.725, 0.421875, 0.0"   # the templates' first-pass ManualSigmas, fewer steps


def sample(model, p, n, lat, video_cfg, audio_cfg, sampler="euler_ancestral"):
    guider = call("LTXVDualCFGGuider", model=model, positive=p, negative=n, video_cfg=video_cfg,
                  audio_cfg=audio_cfg)[0]
    out = call("SamplerCustomAdvanced", noise=call("RandomNoise", noise_seed=42)[0], guider=guider,
               sampler=call("KSamplerSelect", sampler_name=sampler)[0], sigmas=call("ManualSigmas", sigmas=SIGMAS)[0],
               latent_image=lat)[0]["samples"]
    return out.unbind()


def calls_of(model):
    """ComfyUI's own model with its calls' rows counted (the positive and negative passes of a step batched: 2 rows a
    clip where the negative runs)."""
    rows = []

    def counted(apply, args):
        rows.append(args["input"].shape[0])
        return apply(args["input"], args["timestep"], **args["c"])
    model.set_model_unet_function_wrapper(counted)
    return model, rows


GRAPHS = [
    # (name, positive, negative, latent, video cfg, audio cfg, runs: (label, gpus, engine settings))
    ("ltx25 template: t2va, dual cfg 1/1, euler_ancestral", pos, neg, latent, 1.0, 1.0,
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
      ("ring2 shard2", "0,1", dict(plan="explicit", ring=2, shard=2))]),
    ("ltx25 t2va, dual cfg video 3 audio 7", pos, neg, latent, 3.0, 7.0,
     [("gpus=0", "0", {}), ("cfg2", "0,1", dict(plan="explicit", cfg_parallel=True)),
      ("ulysses2 shard2", "0,1", dict(plan="explicit", ulysses=2, shard=2))]),
    ("ltx25 t2va, dual cfg video 1 audio 4 (the negative run at a scale of 1)", pos, neg, latent, 1.0, 4.0,
     [("cfg2", "0,1", dict(plan="explicit", cfg_parallel=True))]),
    ("ltx25 i2va: first frame through the noise mask (0.7), dual cfg 3/7", pos, neg, image_latent, 3.0, 7.0,
     [("gpus=0", "0", {}), ("ring2", "0,1", dict(plan="explicit", ring=2))]),
    ("ltx25 flf: LTXVAddGuide first and last frames at 0.7, dual cfg 3/7", gp, gn, guided, 3.0, 7.0,
     [("gpus=0", "0", {}), ("ulysses2", "0,1", dict(plan="explicit", ulysses=2)),
      ("ring2", "0,1", dict(plan="explicit", ring=2))]),
    ("ltx25 generated keyframes on latent frame 1, dual cfg 3/7", kp, kn, latent, 3.0, 7.0,
     [("gpus=0", "0", {}), ("ring2", "0,1", dict(plan="explicit", ring=2))]),
    ("ltx25 two clips, dual cfg 3/7", pos, neg, batch, 3.0, 7.0,
     [("dp2", "0,1", dict(plan="explicit", dp=2))]),
]
wants = {}
for name, p, n, lat, vcfg, acfg, runs in GRAPHS:
    t0 = time.perf_counter()
    counted, rows = calls_of(native())
    want = wants[name] = sample(counted, p, n, lat, vcfg, acfg)
    entry = {"native_s": round(time.perf_counter() - t0, 2), "native_call_rows": sorted(set(rows))}
    for label, gpus, kw in runs:
        eng, model = engine(gpus, **kw)
        t0 = time.perf_counter()
        got = sample(model, p, n, lat, vcfg, acfg)
        entry[label] = {"video_rel_l2": rel(got[0], want[0]), "audio_rel_l2": rel(got[1], want[1]),
                        "plan": last_plan(eng), "s": round(time.perf_counter() - t0, 2)}
    report["graphs"][name] = entry
    print(name, json.dumps(entry), flush=True)

# ComfyUI applies the keyframe embedding in plain text-to-video: its own result with the embedding zeroed differs
plain = native()
with torch.no_grad():
    plain.model.diffusion_model.keyframes_abs_pos_embedding.zero_()
want = wants["ltx25 t2va, dual cfg video 3 audio 7"]
report["native_keyframe_embedding_effect_rel_l2"] = rel(sample(plain, pos, neg, latent, 3.0, 7.0)[0], want[0])
# ... and the generated keyframes' slot moves it
report["native_generated_keyframes_effect_rel_l2"] = rel(
    wants["ltx25 generated keyframes on latent frame 1, dual cfg 3/7"][0], want[0])
print("REPORT " + json.dumps(report), flush=True)
