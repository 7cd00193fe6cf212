"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own Load VAE against the xDiT VAE
Loader on the xDiT Engine's 2 CPU ranks, for tiny Wan 2.1, Wan 2.2, FLUX.1 / SD3 and FLUX.2 VAE files (make-tiny's,
the released files' key names), through ComfyUI's own nodes: VAE Decode, VAE Encode, VAE Decode (Tiled), VAE Encode
(Tiled), WanImageToVideo (2.1), Wan22ImageToVideoLatent (2.2), and for the image VAEs InpaintModelConditioning (FLUX.1
Fill's: its two encodes), VAE Encode (for Inpainting) and VAE Decode of a video latent (its first frame). Each graph
runs three times: with ComfyUI's VAE, with the xDiT VAE Loader's, and with ComfyUI's VAE computing in float64 (the
reference the bound is derived from: the split's float32 result may be 4 x farther from it than ComfyUI's own float32
result is). ComfyUI builds Wan 2.2's VAE at its released widths whatever the
file says (comfy/sd.py:823-825): this process patches that class to the tiny file's widths (size only).
Prints one JSON report. Usage: python comfyui_vae_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import copy
import json
import os
import sys

from comfyui_live_common import call, outcome, rel, start  # tests/, this file's folder
import comfyui_live_common as live

models, VERSION = start(sys.argv, folders=("diffusion_models", "vae"))
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import comfy.ldm.wan.vae2_2 as wan22  # noqa: E402

ENGINE_MODEL = "tiny-wan2.1-1.3b.safetensors"
FILES = {name: f"tiny-{name}-vae.safetensors" for name in ("wan2.1", "wan2.2", "flux", "flux2")}
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


def float64(vae):
    """ComfyUI's own VAE with its network in float64 (its output still cast to float32 as ComfyUI casts it)."""
    v = copy.copy(vae)
    v.first_stage_model = copy.deepcopy(vae.first_stage_model).double()
    v.vae_dtype = torch.float64
    return v


def compare(name, run, stock, ours):
    """run(vae) -> tensor, with each VAE, in inference mode as ComfyUI's executor runs every node (execution.py:751):
    the figures, and whether ours is within the derived bound."""
    jobs = []   # the jobs ours sent to the ranks (a tiled graph: one a tile)
    sent = ours.xdit.run
    ours.xdit.run = lambda op, x, **kw: (jobs.append((op, list(x.shape))), sent(op, x, **kw))[1]
    with torch.inference_mode():
        a, b, ref = run(stock), run(ours), run(float64(stock))
    del ours.xdit.run
    own, measured = rel(a, ref), rel(b, ref)
    entry = {"shape": list(b.shape), "engine_jobs": len(jobs), "rel_l2": rel(b, a),
             "max_abs": float((b - a).abs().max()),
             "stock_vs_float64": own, "ours_vs_float64": measured, "within": measured <= 4 * own,
             "scale": float(a.abs().max())}
    print(name, json.dumps(entry), flush=True)
    return entry


def image_graphs(kind, stock, ours):
    """The graphs of an image VAE (FLUX.1 / SD3, FLUX.2): latents [B, C, H, W], images a batch."""
    g = torch.Generator().manual_seed(0)
    z, s = stock.latent_channels, stock.downscale_ratio
    latent = torch.randn(1, z, 5, 6, generator=g)              # 5 latent rows: bands of 3 and 2
    wide = torch.randn(1, z, 12, 10, generator=g)              # tiled: several tiles
    pixels = torch.rand(2, 5 * s, 6 * s, 3, generator=g)       # two images
    mask = (torch.rand(1, 5 * s, 6 * s, generator=g) > 0.5).float()
    cond = [[torch.zeros(1, 4, 8), {}]]

    def inpaint(v):
        positive, _, out = call("InpaintModelConditioning", positive=cond, negative=cond, vae=v, pixels=pixels,
                                mask=mask, noise_mask=True)
        return torch.cat([positive[0][1]["concat_latent_image"], out["samples"]])
    out = {
        "VAEDecode": lambda v: call("VAEDecode", vae=v, samples={"samples": latent})[0],
        "VAEEncode": lambda v: call("VAEEncode", vae=v, pixels=pixels)[0]["samples"],
        "VAEDecodeTiled": lambda v: call("VAEDecodeTiled", vae=v, samples={"samples": wide}, tile_size=64,
                                         overlap=32, temporal_size=64, temporal_overlap=8)[0],
        # 128 px tiles: ComfyUI's image tiler also runs tile_size / 2, which must exceed the overlap (utils.py:1141)
        "VAEEncodeTiled": lambda v: call("VAEEncodeTiled", vae=v, pixels=torch.rand(
            1, 192, 160, 3, generator=torch.Generator().manual_seed(1)), tile_size=128, overlap=32, temporal_size=64,
            temporal_overlap=8)[0]["samples"],
        "InpaintModelConditioning": inpaint,
        "VAEEncodeForInpaint": lambda v: call("VAEEncodeForInpaint", vae=v, pixels=pixels, mask=mask,
                                              grow_mask_by=6)[0]["samples"],
        "VAEDecode of a video latent": lambda v: call("VAEDecode", vae=v, samples={
            "samples": latent.unsqueeze(2).repeat(1, 1, 2, 1, 1)})[0],
    }
    return {name: compare(f"{kind} {name}", run, stock, ours) for name, run in out.items()}


def graphs(kind, stock, ours):
    if kind.startswith("flux"):
        return image_graphs(kind, stock, ours)
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
        "samples": torch.zeros((1, 4 if kind in ("wan2.1", "flux") else 16, 3, 5, 6)[:4 if "flux" in kind else 5])}))
    report["kinds"][kind] = entry
report["info"] = call("XDiTEngineInfo", engine=engine, unload=False)[0]
report["no_engine"] = outcome(lambda: call("XDiTVAELoader", vae_name=FILES["wan2.1"]))
report["pixel_space"] = type(call("XDiTVAELoader", vae_name="pixel_space", engine=engine)[0]).__name__
print("REPORT " + json.dumps(report), flush=True)
