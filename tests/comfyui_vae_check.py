"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own Load VAE against the xDiT VAE
Loader on the xDiT Engine's 2 CPU ranks, for tiny Wan 2.1 and Wan 2.2 VAE files (make-tiny's, ComfyUI's key names),
through ComfyUI's own nodes: VAE Decode, VAE Encode, VAE Decode (Tiled), VAE Encode (Tiled), WanImageToVideo (2.1) and
Wan22ImageToVideoLatent (2.2). Each graph runs three times: with ComfyUI's VAE, with the xDiT VAE Loader's, and with
ComfyUI's VAE computing in float64 (the reference the bound is derived from: the split's float32 result may be 4 x
farther from it than ComfyUI's own float32 result is). The tiled graphs' tiles go to the ranks in one job (the tile
pool), and ComfyUI's loader never loads the xDiT VAE's weights on its device. Then a Wan checkpoint with the tiny Wan 2.1
VAE under `vae.`: CheckpointLoaderSimple's VAE against the xDiT Checkpoint Loader's (the engine's, read from the
checkpoint). ComfyUI builds Wan 2.2's VAE at its released widths whatever the file says (comfy/sd.py:823-825), and
0.3.64 Wan 2.1's too: this process patches those classes to the tiny files' widths (size only).
Prints one JSON report. Usage: python comfyui_vae_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import copy
import json
import os
import sys

from comfyui_live_common import call, outcome, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv, folders=("diffusion_models", "vae", "checkpoints"))
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import comfy.ldm.wan.vae as wan21  # noqa: E402
import comfy.ldm.wan.vae2_2 as wan22  # noqa: E402
import comfy.model_management as mm  # noqa: E402

ENGINE_MODEL = "tiny-wan2.1-1.3b.safetensors"
FILES = {"wan2.1": "tiny-wan2.1-vae.safetensors", "wan2.2": "tiny-wan2.2-vae.safetensors"}
CHECKPOINT = "tiny-wan2.1-1.3b-with-vae.safetensors"   # the Wan 2.1 VAE's tensors under vae.
report = {"comfyui": VERSION, "kinds": {}}

# ---- Wan 2.2's widths from the tiny file (a size-only patch of ComfyUI's class) --------------------------------------
with safe_open(os.path.join(models, "vae", FILES["wan2.2"]), "pt") as f:
    DIM = f.get_slice("encoder.conv1.weight").get_shape()[0]
    DEC_DIM = f.get_slice("decoder.head.0.gamma").get_shape()[0]
Released = wan22.WanVAE


class TinyWidths(Released):
    def __init__(self, dim=160, dec_dim=256, **kw):
        super().__init__(dim=DIM, dec_dim=DEC_DIM, **kw)


wan22.WanVAE = TinyWidths

# ComfyUI before it read Wan 2.1's dim from decoder.head.0.gamma (0.3.64) builds that VAE at dim 96 whatever the file
# says (its sd.py): the same size-only patch, to the tiny file's dim (a no-op where ComfyUI reads it itself)
with safe_open(os.path.join(models, "vae", FILES["wan2.1"]), "pt") as f:
    DIM21 = f.get_slice("decoder.head.0.gamma").get_shape()[0]
Released21 = wan21.WanVAE


class TinyWidths21(Released21):
    def __init__(self, dim=96, **kw):
        super().__init__(dim=DIM21, **kw)


wan21.WanVAE = TinyWidths21


def float64(vae):
    """ComfyUI's own VAE with its network in float64 (its output still cast to float32 as ComfyUI casts it)."""
    v = copy.copy(vae)
    v.first_stage_model = copy.deepcopy(vae.first_stage_model).double()
    v.vae_dtype = torch.float64
    return v


def compare(name, run, stock, ours):
    """run(vae) -> tensor, with each VAE, in inference mode as ComfyUI's executor runs every node (execution.py:751):
    the figures, and whether ours is within the derived bound."""
    jobs = []   # the jobs ours sent to the ranks (a tiled graph: one for all its tiles)
    sent, pooled = ours.xdit.run, ours.xdit.run_tiles
    ours.xdit.run = lambda op, x, **kw: (jobs.append((op, list(x.shape))), sent(op, x, **kw))[1]
    ours.xdit.run_tiles = lambda op, xs, **kw: (jobs.append((op, len(xs))), pooled(op, xs, **kw))[1]
    with torch.inference_mode():
        a, b, ref = run(stock), run(ours), run(float64(stock))
    del ours.xdit.run, ours.xdit.run_tiles
    own, measured = rel(a, ref), rel(b, ref)
    entry = {"shape": list(b.shape), "engine_jobs": len(jobs), "jobs": jobs, "rel_l2": rel(b, a),
             "comfy_loaded_ours": any(lm.model is ours.patcher for lm in mm.current_loaded_models),
             "max_abs": float((b - a).abs().max()),
             "stock_vs_float64": own, "ours_vs_float64": measured, "within": measured <= 4 * own,
             "scale": float(a.abs().max())}
    print(name, json.dumps(entry), flush=True)
    return entry


def graphs(kind, stock, ours):
    g = torch.Generator().manual_seed(0)
    z = 16 if kind == "wan2.1" else 48
    s = 8 if kind == "wan2.1" else 16
    latent = torch.randn(1, z, 3, 5, 6, generator=g)          # 5 latent rows: bands of 3 and 2
    wide = torch.randn(1, z, 3, 12, 10, generator=g)           # tiled: several spatial tiles
    pixels = torch.rand(9, 5 * s, 6 * s, 3, generator=g)       # 9 frames, as a batch of images
    out = {
        "VAEDecode": lambda v: call("VAEDecode", vae=v, samples={"samples": latent})[0],
        "VAEEncode": lambda v: call("VAEEncode", vae=v, pixels=pixels)[0]["samples"],
        "VAEDecodeTiled": lambda v: call("VAEDecodeTiled", vae=v, samples={"samples": wide}, tile_size=64,
                                         overlap=32, temporal_size=64, temporal_overlap=8)[0],
        "VAEEncodeTiled": lambda v: call("VAEEncodeTiled", vae=v, pixels=torch.rand(5, 12 * s, 10 * s, 3,
                                                                                     generator=torch.Generator()
                                                                                     .manual_seed(1)),
                                         tile_size=64 if kind == "wan2.1" else 128, overlap=32, temporal_size=64,
                                         temporal_overlap=8)[0]["samples"],
    }
    cond = [[torch.zeros(1, 4, 8), {}]]
    start_image = torch.rand(1, 5 * s, 6 * s, 3, generator=g)
    if kind == "wan2.1":
        out["WanImageToVideo"] = lambda v: call("WanImageToVideo", positive=cond, negative=cond, vae=v, width=6 * s,
                                                height=5 * s, length=9, batch_size=1,
                                                start_image=start_image)[0][0][1]["concat_latent_image"]
    else:
        out["Wan22ImageToVideoLatent"] = lambda v: call("Wan22ImageToVideoLatent", vae=v, width=6 * s, height=5 * s,
                                                        length=9, batch_size=1, start_image=start_image)[0]["samples"]
    return {name: compare(f"{kind} {name}", run, stock, ours) for name, run in out.items()}


engine = live.engine(ENGINE_MODEL, "0,1")[0]
for kind, file in FILES.items():
    stock = call("VAELoader", vae_name=file)[0]
    ours = call("XDiTVAELoader", vae_name=file, engine=engine)[0]
    entry = {"stock_class": type(stock.first_stage_model).__module__, "ours": type(ours).__name__,
             "latent_channels": [stock.latent_channels, ours.latent_channels],
             "same_state": all(torch.equal(a, b) for a, b in zip(stock.get_sd().values(), ours.get_sd().values())),
             "graphs": graphs(kind, stock, ours)}
    entry["wrong_latent"] = outcome(lambda: call("VAEDecode", vae=ours, samples={
        "samples": torch.zeros(1, 4 if kind == "wan2.1" else 16, 3, 5, 6)}))
    report["kinds"][kind] = entry
# the xDiT Checkpoint Loader's VAE: the engine's, read from the checkpoint's vae. tensors
stock_model, _, stock_vae = call("CheckpointLoaderSimple", ckpt_name=CHECKPOINT)[:3]
_, _, ours_vae, _ = live.checkpoint_loader(CHECKPOINT, "0,1")
from_file = call("XDiTVAELoader", vae_name=FILES["wan2.1"], engine=engine)[0]
z = torch.randn(1, 16, 3, 5, 6, generator=torch.Generator().manual_seed(4))
with torch.inference_mode():
    decoded = {"stock": stock_vae.decode(z), "ours": ours_vae.decode(z), "vae file": from_file.decode(z),
               "float64": float64(stock_vae).decode(z)}
report["checkpoint"] = {"stock": type(stock_vae).__name__, "ours": type(ours_vae).__name__,
                        "prefix": getattr(getattr(ours_vae, "xdit", None), "info", None) and ours_vae.xdit.info.prefix,
                        "rel_l2": rel(decoded["ours"], decoded["stock"]),
                        "stock_vs_float64": rel(decoded["stock"], decoded["float64"]),
                        "ours_vs_float64": rel(decoded["ours"], decoded["float64"]),
                        "equals_the_vae_files": torch.equal(decoded["ours"], decoded["vae file"])}
report["checkpoint"]["within"] = report["checkpoint"]["ours_vs_float64"] <= 4 * report["checkpoint"]["stock_vs_float64"]
print("checkpoint", json.dumps(report["checkpoint"]), flush=True)
report["info"] = call("XDiTEngineInfo", engine=engine, unload=False)[0]
report["no_engine"] = outcome(lambda: call("XDiTVAELoader", vae_name=FILES["wan2.1"]))
report["pixel_space"] = type(call("XDiTVAELoader", vae_name="pixel_space", engine=engine)[0]).__name__
print("REPORT " + json.dumps(report), flush=True)
