"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): ComfyUI's own Load VAE against the xDiT VAE
Loader on the xDiT Engine's 2 CPU ranks, for the tiny VAE files XDIT_VAE_KINDS names (make-tiny's, ComfyUI's key
names; default Wan 2.1, Wan 2.2, FLUX.1 / SD3 and FLUX.2), through ComfyUI's own nodes: VAE Decode, VAE Encode, VAE
Decode (Tiled), VAE Encode (Tiled), WanImageToVideo (2.1) and Wan22ImageToVideoLatent (2.2); for the image VAEs
InpaintModelConditioning (FLUX.1 Fill's: its two encodes), VAE Encode (for Inpainting) and VAE Decode of a video
latent (its first frame); for LTX-2.x (timestep conditioning off and on, the global generator seeded before each
decode) LTXVImgToVideo(Inplace) and LTXVAddGuide, and ComfyUI's LTXVLatentUpsampler reading the VAE; for MiniMax-H3
MiniMaxH3ImageToVideo. Each graph runs three times: with ComfyUI's VAE, with the xDiT VAE Loader's, and with ComfyUI's
VAE computing in float64 (the reference the bound is derived from: the split's float32 result may be 4 x farther from
it than ComfyUI's own float32 result is). ComfyUI builds Wan 2.2's VAE at its released widths whatever the file says
(comfy/sd.py:823-825), and MiniMax-H3's likewise (sd.py:1000): this process patches those classes to the tiny files'
widths (size only) The tiled graphs' tiles go to the ranks in one
job (the tile pool), and ComfyUI's loader never loads the xDiT VAE's weights on its device. Then a Wan checkpoint with
the tiny Wan 2.1 VAE under `vae.`: CheckpointLoaderSimple's VAE against the xDiT Checkpoint Loader's (the engine's, read
from the checkpoint). (0.3.64 builds Wan 2.1's VAE and FLUX.1's decoder at their released widths too: patched likewise;
it has neither FLUX.2's VAE, which the loader then refuses naming 0.3.72, nor the decode of an image VAE's 5-D latent.)
Prints one JSON report. Usage: python comfyui_vae_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import copy
import importlib.util
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
FILES = {name: f"tiny-{name}-vae.safetensors" for name in ("wan2.1", "wan2.2", "flux", "flux2", "ltx2", "ltx2-tc",
                                                                "minimax-h3")}
KINDS = os.environ.get("XDIT_VAE_KINDS", "wan2.1,wan2.2,flux,flux2").split(",")   # the files the calling test wrote
CHECKPOINT = "tiny-wan2.1-1.3b-with-vae.safetensors"   # the Wan 2.1 VAE's tensors under vae.
report = {"comfyui": VERSION, "kinds": {}}

# ---- Wan 2.2's widths from the tiny file (a size-only patch of ComfyUI's class) --------------------------------------
if "wan2.2" in KINDS:
    with safe_open(os.path.join(models, "vae", FILES["wan2.2"]), "pt") as f:
        DIM = f.get_slice("encoder.conv1.weight").get_shape()[0]
        DEC_DIM = f.get_slice("decoder.head.0.gamma").get_shape()[0]
    Released = wan22.WanVAE

    class TinyWidths(Released):
        def __init__(self, dim=160, dec_dim=256, **kw):
            super().__init__(dim=DIM, dec_dim=DEC_DIM, **kw)

    wan22.WanVAE = TinyWidths

# ---- FLUX.1's decoder: ComfyUI before it read the decoder's width from decoder.conv_in (0.3.64) builds it at 128
# whatever the file (sd.py then: ddconfig 'ch': 128 for both); the same size-only patch as Wan's
if "flux" in KINDS:
    import inspect
    import comfy.sd
    import comfy.ldm.modules.diffusionmodules.model as sd_model
    if "decoder_ch" not in inspect.getsource(comfy.sd.VAE.__init__):
        with safe_open(os.path.join(models, "vae", FILES["flux"]), "pt") as f:
            DECODER_CH = f.get_slice("decoder.conv_in.weight").get_shape()[0] // 4   # ch_mult [1, 2, 4, 4]
        ReleasedDecoder = sd_model.Decoder

        class TinyDecoder(ReleasedDecoder):
            def __init__(self, ch=128, **kw):
                super().__init__(ch=DECODER_CH, **kw)

        sd_model.Decoder = TinyDecoder

# ---- MiniMax-H3's likewise: ComfyUI builds ch 128 and a 36-layer decoder of 32 heads whatever the file (sd.py:1000) --
if "minimax-h3" in KINDS and importlib.util.find_spec("comfy.ldm.minimax"):   # (absent before 0.33)
    import functools
    import comfy.ldm.minimax.vae as h3vae
    with safe_open(os.path.join(models, "vae", FILES["minimax-h3"]), "pt") as f:
        H3_CH = f.get_slice("encoder.conv_in.weight").get_shape()[0]
        H3_HEADS = f.get_slice("decoder.x_embedder.weight").get_shape()[0] // 64
        H3_LAYERS = sum(1 for k in f.keys() if k.startswith("decoder.transformer_blocks.") and k.endswith(".scale1"))
    h3vae.ViT3DDecoder = functools.partial(h3vae.ViT3DDecoder, num_layers=H3_LAYERS, heads=H3_HEADS, dim_head=64)
    ReleasedH3 = h3vae.MiniMaxH3VideoVAE

    class TinyH3(ReleasedH3):
        def __init__(self, **kw):
            super().__init__(ch=H3_CH, **kw)

    h3vae.MiniMaxH3VideoVAE = TinyH3
    # comfy_kitchen's RoPE refuses float64 (its eager backend's capability check): the float64 reference runs the
    # kitchen's own eager formula (comfy_kitchen/backends/eager/rope.py), float32 and below stay ComfyUI's call
    import comfy.quant_ops
    from comfy_kitchen.backends.eager import rope as eager_rope
    kitchen_rope = comfy.quant_ops.ck.apply_rope_split_half
    comfy.quant_ops.ck.apply_rope_split_half = lambda q, k, f: (eager_rope.apply_rope_split_half(q, k, f)
                                                               if q.dtype == torch.float64 else kitchen_rope(q, k, f))

# ComfyUI before it read Wan 2.1's dim from decoder.head.0.gamma (0.3.64) builds that VAE at dim 96 whatever the file
# says (its sd.py): the same size-only patch, to the tiny file's dim (a no-op where ComfyUI reads it itself)
if "wan2.1" in KINDS:
    with safe_open(os.path.join(models, "vae", FILES["wan2.1"]), "pt") as f:
        DIM21 = f.get_slice("decoder.head.0.gamma").get_shape()[0]
    Released21 = wan21.WanVAE

    class TinyWidths21(Released21):
        def __init__(self, dim=96, **kw):
            super().__init__(dim=DIM21, **kw)

    wan21.WanVAE = TinyWidths21


def float64(vae):
    """ComfyUI's own VAE with its network in float64 (its output still cast to float32 as ComfyUI casts it). A decode
    that draws noise (LTX's timestep-conditioned decoders) draws it as the float32 run does, then in float64."""
    v = copy.copy(vae)
    v.first_stage_model = model = copy.deepcopy(vae.first_stage_model).double()
    v.vae_dtype = torch.float64
    if getattr(model, "timestep_conditioning", False):
        decode = model.decode

        def noised_as_in_float32(x, **kw):
            draw = torch.randn_like
            torch.randn_like = lambda t, **k: draw(t.float(), **k).to(t.dtype)
            try:
                return decode(x, **kw)
            finally:
                torch.randn_like = draw
        model.decode = noised_as_in_float32
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
    }
    import inspect
    import comfy.sd
    if "samples_in.ndim == 5" in inspect.getsource(comfy.sd.VAE.decode):   # ComfyUI decodes it frame by frame (0.33)
        out["VAEDecode of a video latent"] = lambda v: call("VAEDecode", vae=v, samples={
            "samples": latent.unsqueeze(2).repeat(1, 1, 2, 1, 1)})[0]
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


def seeded(run):
    """run(vae) after torch.manual_seed: a timestep-conditioned LTX decode draws its noise from the global generator,
    ComfyUI's own and ours alike."""
    return lambda v: (torch.manual_seed(11), run(v))[1]


def ltx_graphs(kind, stock, ours):
    """LTX-2.x: VAE Decode / Encode and their tiled forms, and the LTX nodes that encode through the VAE."""
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 128, 3, 5, 3, generator=g)         # 5 latent rows: bands of 3 and 2
    wide = torch.randn(1, 128, 3, 6, 7, generator=g)           # tiled: several spatial tiles
    pixels = torch.rand(9, 160, 96, 3, generator=g)
    image = torch.rand(1, 160, 96, 3, generator=g)
    cond = [[torch.zeros(1, 4, 8), {}]]
    out = {
        "VAEDecode": seeded(lambda v: call("VAEDecode", vae=v, samples={"samples": latent})[0]),
        "VAEDecodeTiled": seeded(lambda v: call("VAEDecodeTiled", vae=v, samples={"samples": wide}, tile_size=128,
                                                overlap=32, temporal_size=64, temporal_overlap=8)[0]),
    }
    if kind == "ltx2-tc":   # the encoder is ltx2's network: its graphs run once, on the ltx2 file
        return {name: compare(f"{kind} {name}", run, stock, ours) for name, run in out.items()}
    out.update({
        "VAEEncode": lambda v: call("VAEEncode", vae=v, pixels=pixels)[0]["samples"],
        "VAEEncodeTiled": lambda v: call("VAEEncodeTiled", vae=v, pixels=torch.rand(
            9, 192, 224, 3, generator=torch.Generator().manual_seed(1)), tile_size=128, overlap=32, temporal_size=64,
            temporal_overlap=8)[0]["samples"],
        "LTXVImgToVideo": lambda v: call("LTXVImgToVideo", positive=cond, negative=cond, vae=v, image=image, width=96,
                                         height=160, length=17, batch_size=1, strength=1.0)[2]["samples"],
        "LTXVImgToVideoInplace": lambda v: call("LTXVImgToVideoInplace", vae=v, image=image, latent={
            "samples": torch.zeros(1, 128, 3, 5, 3)}, strength=1.0)[0]["samples"],
        "LTXVAddGuide": lambda v: call("LTXVAddGuide", positive=cond, negative=cond, vae=v, latent={
            "samples": torch.zeros(1, 128, 3, 5, 3)}, image=pixels, frame_idx=0, strength=1.0)[2]["samples"],
    })
    return {name: compare(f"{kind} {name}", run, stock, ours) for name, run in out.items()}


class StubClip:
    """MiniMaxH3ImageToVideo's text encoder, standing in (the node only tokenizes and encodes the prompt with it)."""

    def tokenize(self, prompt, images=None):
        return {}

    def encode_from_tokens_scheduled(self, tokens):
        return [[torch.zeros(1, 4, 8), {}]]


def h3_graphs(kind, stock, ours):
    """MiniMax-H3: VAE Decode / Encode (its own tiles), the tiled nodes (which it ignores), MiniMaxH3ImageToVideo's
    first and last frames."""
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 24, 8, 2, 18, generator=g)         # 2 clips x 2 tiles
    pixels = torch.rand(18, 32, 32, 3, generator=g)            # 2 clips
    wide = torch.rand(1, 32, 288, 3, generator=g)              # one frame, 2 tiles
    frames = (torch.rand(1, 40, 300, 3, generator=g), torch.rand(1, 32, 280, 3, generator=g))

    def keyframes(v):
        cond = call("MiniMaxH3ImageToVideo", clip=StubClip(), vae=v, prompt="", width=288, height=32, length=5,
                    first_frame=frames[0], last_frame=frames[1])[0]
        return torch.cat([k["latent"] for k in cond[0][1]["minimax_keyframes"]], dim=2)
    out = {
        "VAEDecode": lambda v: call("VAEDecode", vae=v, samples={"samples": latent})[0],
        "VAEEncode": lambda v: call("VAEEncode", vae=v, pixels=pixels)[0]["samples"],
        "VAEDecodeTiled": lambda v: call("VAEDecodeTiled", vae=v, samples={"samples": latent}, tile_size=64,
                                         overlap=32, temporal_size=64, temporal_overlap=8)[0],
        "VAEEncodeTiled": lambda v: call("VAEEncodeTiled", vae=v, pixels=wide, tile_size=64, overlap=32,
                                         temporal_size=64, temporal_overlap=8)[0]["samples"],
        "MiniMaxH3ImageToVideo": keyframes,
    }
    return {name: compare(f"{kind} {name}", run, stock, ours) for name, run in out.items()}


def upsampled(vae):
    """LTXVLatentUpsampler with a 1x1x1 conv for its model: what it reads of the VAE (first_stage_model's
    per_channel_statistics, nodes_lt_upsampler.py:53-56) is ComfyUI's own on ours."""
    import comfy.model_patcher

    class Up(torch.nn.Conv3d):
        def get_dtype(self):
            return torch.float32
    up = Up(128, 128, 1)
    torch.nn.init.eye_(up.weight.data.view(128, 128))
    torch.nn.init.zeros_(up.bias.data)
    patcher = comfy.model_patcher.ModelPatcher(up, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    with torch.inference_mode():
        return call("LTXVLatentUpsampler", samples={"samples": torch.randn(1, 128, 2, 2, 2, generator=torch.Generator()
                                                                          .manual_seed(5))},
                    upscale_model=patcher, vae=vae)[0]["samples"]


WRONG = {"wan2.1": 4, "wan2.2": 16, "flux": 4, "flux2": 16, "ltx2": 16, "ltx2-tc": 16, "minimax-h3": 16}   # latent channels of another VAE
engine = live.engine(ENGINE_MODEL, "0,1")[0]
for kind in KINDS:
    file = FILES[kind]
    try:
        ours = call("XDiTVAELoader", vae_name=file, engine=engine)[0]
    except Exception as e:  # noqa: BLE001 (a ComfyUI older than the VAE type: the loader names the release it needs)
        report.setdefault("older", {})[kind] = str(e).splitlines()[0]
        continue
    stock = call("VAELoader", vae_name=file)[0]
    run_graphs = ltx_graphs if kind.startswith("ltx2") else h3_graphs if kind == "minimax-h3" else graphs
    entry = {"stock_class": type(stock.first_stage_model).__module__, "ours": type(ours).__name__,
             "latent_channels": [stock.latent_channels, ours.latent_channels],
             "same_state": all(torch.equal(a, b) for a, b in zip(stock.get_sd().values(), ours.get_sd().values())),
             "graphs": run_graphs(kind, stock, ours)}
    entry["wrong_latent"] = outcome(lambda: call("VAEDecode", vae=ours, samples={
        "samples": torch.zeros((1, WRONG[kind], 3, 5, 6)[:4 if "flux" in kind else 5])}))
    if kind == "ltx2":
        entry["upsampler_equal"] = bool(torch.equal(upsampled(stock), upsampled(ours)))
    if kind == "ltx2-tc":   # the noise matters: another seed, another decode (ComfyUI's and ours)
        latent = torch.randn(1, 128, 2, 2, 2, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            decodes = [(torch.manual_seed(seed), call("VAEDecode", vae=v, samples={"samples": latent})[0])[1]
                       for v in (stock, ours) for seed in (11, 12)]
        entry["other_seed_rel_l2"] = [rel(decodes[1], decodes[0]), rel(decodes[3], decodes[2])]
    report["kinds"][kind] = entry
# the xDiT Checkpoint Loader's VAE: the engine's, read from the checkpoint's vae. tensors
if "wan2.1" in KINDS:   # (the calling test wrote the Wan checkpoint beside the Wan 2.1 VAE file)
    stock_model, _, stock_vae = call("CheckpointLoaderSimple", ckpt_name=CHECKPOINT)[:3]
    _, _, ours_vae, _ = live.checkpoint_loader(CHECKPOINT, "0,1")
    from_file = call("XDiTVAELoader", vae_name=FILES["wan2.1"], engine=engine)[0]
    z = torch.randn(1, 16, 3, 5, 6, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        decoded = {"stock": stock_vae.decode(z), "ours": ours_vae.decode(z), "vae file": from_file.decode(z),
                   "float64": float64(stock_vae).decode(z)}
    report["checkpoint"] = {"stock": type(stock_vae).__name__, "ours": type(ours_vae).__name__,
                            "prefix": getattr(getattr(ours_vae, "xdit", None), "info", None)
                            and ours_vae.xdit.info.prefix,
                            "rel_l2": rel(decoded["ours"], decoded["stock"]),
                            "stock_vs_float64": rel(decoded["stock"], decoded["float64"]),
                            "ours_vs_float64": rel(decoded["ours"], decoded["float64"]),
                            "equals_the_vae_files": torch.equal(decoded["ours"], decoded["vae file"])}
    checked = report["checkpoint"]
    checked["within"] = checked["ours_vs_float64"] <= 4 * checked["stock_vs_float64"]
    print("checkpoint", json.dumps(report["checkpoint"]), flush=True)
report["info"] = call("XDiTEngineInfo", engine=engine, unload=False)[0]
report["no_engine"] = outcome(lambda: call("XDiTVAELoader", vae_name=FILES[KINDS[0]]))
report["pixel_space"] = type(call("XDiTVAELoader", vae_name="pixel_space", engine=engine)[0]).__name__
print("REPORT " + json.dumps(report), flush=True)
