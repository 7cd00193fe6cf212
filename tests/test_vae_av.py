"""The audio-video families' video VAEs across the engine's ranks (gloo CPU ranks, tiny files): LTX-2.x's row split
and MiniMax-H3's tile pool on 1, 2 and 4 ranks equal one rank's; one rank equals diffusers' AutoencoderKLLTX2Video and
AutoencoderKLMiniMaxH3 on the same weights; the files the engine does not split, and a decode noise that does not
belong, refused in one line before any rank starts.

Bounds (docs/vae.md): a row split computes the same sums in another order, so its float32 result may be K x as far
from the float64 result as one rank's float32 result is (relative L2). The tile pool computes each piece with the
unsplit network and blends in ComfyUI's order in the caller: on CPU ranks that is one rank's result bit for bit."""
import os
import re

import pytest
import torch

from engine.errors import CheckpointError
from engine.vae import client
from engine.vae import minimax_tiles as minimax
from engine.vae.load import LTX_TINY, VAEInputError, inspect_vae, load_vae, write_tiny_vae
from engine.vae.pool import assign
from tolerance import K, rel, within

EPS_RATIO = 2.0 ** -29   # float64's epsilon over float32's


LTX_DECODE, LTX_FRAMES = (1, 128, 3, 5, 2), 9   # 5 latent rows: bands (3, 2) and (2, 1, 1, 1); 9 frames: two chunks
H3 = {"decode": (1, 24, 8, 2, 18), "encode": (1, 3, 18, 32, 32)}   # 2 clips x 2 tiles; 2 clips of one tile
H3_WIDE = (1, 3, 1, 32, 288)   # an image of two tiles


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("vae"))
    return {"ltx": write_tiny_vae("ltx2", folder),
            "ltx-tc": write_tiny_vae("ltx2", folder, widths={"config": dict(LTX_TINY, timestep_conditioning=True)},
                                     file="tiny-ltx2-tc-vae.safetensors"),
            "h3": write_tiny_vae("minimax-h3", folder)}


@pytest.fixture(scope="module")
def ltx(files):
    """Per file: the inputs (the noise drawn as ComfyUI draws it), one rank's decode and encode in float32 and
    float64, in process."""
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(LTX_DECODE, generator=g)
    noise = torch.randn(LTX_DECODE, generator=g)
    pixels = torch.rand(1, 3, LTX_FRAMES, 160, 64, generator=g) * 2 - 1
    out = {}
    for name in ("ltx", "ltx-tc"):
        model = load_vae(inspect_vae(files[name]), "fp32", torch.device("cpu"))
        extra = {"noise": noise} if name == "ltx-tc" else {}
        with torch.inference_mode():   # the timestep conditioning is the decoder's: ltx-tc's encoder is ltx's
            whole = {"decode": model.decode(latent, **extra), "encode": model.encode(pixels) if not extra else None}
            model = model.double()
            ref = {"decode": model.decode(latent.double(), noise=noise.double()) if extra else
                   model.decode(latent.double()), "encode": model.encode(pixels.double()) if not extra else None}
        out[name] = {"decode": latent, "encode": pixels, "noise": noise if extra else None, "whole": whole,
                     "ref": ref}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name,op", [("ltx", "decode"), ("ltx", "encode"), ("ltx-tc", "decode")])   # the timestep
def test_ltx_on_row_bands_of_several_ranks_equals_one_rank(engines, files, ltx, world, op, name):   # is the decoder's
    case = ltx[name]
    got, result = client.run(engines(world), op, files[name], case[op], noise=case["noise"] if op == "decode" else
                             None)
    vae = result.ranks[0]["vae"]
    print(f"{name} {op} on {world} rank(s): bands {vae['rows']} latent rows, {vae['chunks']} chunks, rank 0 sent "
          f"{vae['sent']} bytes")
    assert got.shape == case["whole"][op].shape
    assert within(f"{name} {op} on {world} rank(s)", got, case["whole"][op], case["ref"][op])


def test_ltx_decode_in_byte_sized_chunks_equals_the_unchunked_decode(engines, files, ltx):
    """ComfyUI's byte-sized temporal chunks at every level (here 64 KiB of the whole frame: the last two levels cut
    into 2 to 5 pieces): the caches make them the same sums, on bands too."""
    case = ltx["ltx"]
    got = client.decode(engines(2), files["ltx"], case["decode"], chunk_bytes=64 * 1024)
    assert within("ltx decode in 64 KiB chunks on 2 ranks", got, case["whole"]["decode"], case["ref"]["decode"])


@pytest.fixture(scope="module")
def h3(files):
    model = load_vae(inspect_vae(files["h3"]), "fp32", torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    inputs = {"decode": torch.randn(H3["decode"], generator=g),
              "encode": torch.rand(H3["encode"], generator=g) * 2 - 1, "wide": torch.rand(H3_WIDE, generator=g) * 2 - 1}
    stats = (model.latents_mean, model.latents_std)

    def one_rank(op, x):
        pl = minimax.plan(op, tuple(x.shape))
        with torch.inference_mode():
            return minimax.assemble(pl, [model.piece(x, pl, k) for k in range(len(pl.pieces))], stats)
    return {"model": model, "inputs": inputs, "one_rank": one_rank, "stats": stats}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("op", ["decode", "encode", "wide"])
def test_h3_tile_pool_on_several_ranks_equals_one_rank_bit_for_bit(engines, files, h3, world, op):
    """One rank here computes with the threads each of `world` CPU ranks has (the cores over the ranks,
    engine/runtime/group.py): a convolution's sums follow the thread count, and so the same kernels run."""
    x = h3["inputs"][op]
    job = "encode" if op == "wide" else op
    got, result = client.run(engines(world), job, files["h3"], x)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        want = h3["one_rank"](job, x)
    finally:
        torch.set_num_threads(threads)
    pieces = [r["vae"]["pieces"] for r in result.ranks]
    print(f"h3 {op} {list(x.shape)} on {world} ranks: pieces {pieces} of {result.ranks[0]['vae']['of']}; max abs vs "
          f"one rank {float((got - want).abs().max()):.3g}")
    assert sorted(k for p in pieces for k in p) == list(range(result.ranks[0]["vae"]["of"]))
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_the_pool_gives_the_largest_pieces_first_each_to_the_least_loaded_rank():
    assert assign([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]             # equal pieces: round robin
    assert assign([1, 5, 2, 5, 3], 2) == [[1, 4], [0, 2, 3]]       # LPT: 5, 5, then 3, 2, 1 to the lighter
    assert assign([3], 4) == [[0], [], [], []]


def test_h3_plan_lays_out_comfyuis_clips_and_tiles():
    pl = minimax.plan("decode", (1, 24, 22, 48, 84))   # 768x1344, 22 latent frames (73 frames)
    assert pl.clips == 4 and pl.tiles[0][:2] == ([0, 160, 336, 512], [256] * 4) and len(pl.tiles[1][0]) == 7
    assert len(pl.pieces) == 4 * 4 * 7 and pl.pieces[0].out_shape == (1, 3, 28, 256, 256)
    assert minimax.decoded_frames(22) == 73 and minimax.encoded_frames(73) == 22


# ---- one rank vs diffusers ----------------------------------------------------------------------------------------
LTX_NARROW = dict(LTX_TINY, latent_channels=8)   # diffusers ties the encoder's first width to the latent's


def ltx_diffusers(path: str, config: dict):
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers
    from safetensors.torch import load_file
    sd = convert_ltx2_vae_to_diffusers(load_file(path))
    sd = {k.replace("decoder.last_time_embedder", "decoder.time_embedder")
          .replace("decoder.last_scale_shift_table", "decoder.scale_shift_table"): v for k, v in sd.items()}
    vae = AutoencoderKLLTX2Video(
        latent_channels=config["latent_channels"], block_out_channels=(16, 32, 64, 128),
        decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), timestep_conditioning=config["timestep_conditioning"],
        decoder_causal=False, decoder_spatial_padding_mode="reflect")
    missing, unexpected = vae.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return vae.eval()


def compare(name, ours, theirs, ours64, theirs64, float64_math=True):
    """Apart by float64 rounding in float64 (the same math; float64_math False where either keeps float32 islands in
    a float64 run) and, in float32, each by its own rounding."""
    own = rel(ours, ours64)
    print(f"{name}: ours vs diffusers float32 max abs {float((ours - theirs).abs().max()):.3g}, rel L2 "
          f"{rel(ours, theirs):.3g} (bound {2 * K * own:.3g}); float64 rel L2 {rel(ours64, theirs64):.3g}" +
          (f" (bound {K * own * EPS_RATIO:.3g})" if float64_math else " (float32 islands: not bounded)"))
    assert ours.shape == theirs.shape
    return (not float64_math or rel(ours64, theirs64) <= K * own * EPS_RATIO) and rel(ours, theirs) <= 2 * K * own


@pytest.mark.parametrize("op", ["decode", "decode-tc", "encode"])
def test_ltx_one_rank_equals_diffusers_autoencoder_kl_ltx2_video(tmp_path, op):
    """diffusers' decoder takes the noise mixed in and the latent un-normalized by its pipeline: the test does both
    as ComfyUI's VideoVAE.decode does; its encoder's means are the first latent channels, normalized here."""
    config = dict(LTX_NARROW, timestep_conditioning=op == "decode-tc")
    path = write_tiny_vae("ltx2", str(tmp_path), widths={"config": config}, file="narrow.safetensors")
    ours, theirs = load_vae(inspect_vae(path), "fp32", torch.device("cpu")), ltx_diffusers(path, config)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 8, 3, 3, 2, generator=g) if op != "encode" else torch.rand(1, 3, 9, 96, 64, generator=g) * 2 - 1
    noise = torch.randn(x.shape, generator=g) if op == "decode-tc" else None

    def run(o, t, x, noise):
        with torch.inference_mode():
            if op == "encode":
                return o.encode(x), o.per_channel_statistics.normalize(t.encode(x).latent_dist.mean)
            z = x if noise is None else noise * 0.025 + (1.0 - 0.025) * x
            temb = torch.tensor([0.05], dtype=x.dtype) if noise is not None else None
            return o.decode(x, noise=noise), t.decode(o.per_channel_statistics.un_normalize(z), temb).sample
    a, b = run(ours, theirs, x, noise)
    a64, b64 = run(ours.double(), theirs.double(), x.double(), None if noise is None else noise.double())
    assert compare(f"ltx {op}", a, b, a64, b64)


def h3_diffusers(path: str, widths: dict):
    from diffusers import AutoencoderKLMiniMaxH3
    from safetensors.torch import load_file
    sd, out = load_file(path), {}
    heads = widths["heads"]
    for key, v in sd.items():
        if key.endswith(("latents_mean", "latents_std", "mask_token")):
            continue
        key = re.sub(r"^encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets.", key)
        key = re.sub(r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0.", key)
        key = key.replace("nin_shortcut", "conv_shortcut").replace("decoder.x_embedder", "decoder.proj_in")
        key = key.replace("attn.to_out.", "attn.to_out.0.").replace("ff.w2.", "ff.net.2.")
        if ".attn.to_qkv." in key:   # ComfyUI's [q | k | v] per head, diffusers' q, k, v each over the heads
            per_head = v.reshape(heads, 3, 64, *v.shape[1:])
            for i, n in enumerate("qkv"):
                out[key.replace("to_qkv", f"to_{n}")] = per_head[:, i].reshape(heads * 64, *v.shape[1:])
            continue
        if ".ff.w1." in key:   # ComfyUI's [gate | x], diffusers' SwiGLU [x | gate]
            gate, x = v.chunk(2, dim=0)
            v, key = torch.cat([x, gate], dim=0), key.replace("ff.w1.", "ff.net.0.proj.")
        out[key] = v
    ch = widths["ch"]
    vae = AutoencoderKLMiniMaxH3(block_out_channels=tuple(ch * m for m in minimax.CH_MULT),
                                 decoder_num_layers=widths["num_layers"], decoder_num_attention_heads=heads)
    missing, unexpected = vae.load_state_dict(out, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return vae.eval()


@pytest.mark.parametrize("op", ["decode", "encode"])
def test_h3_one_rank_equals_diffusers_autoencoder_kl_minimax_h3(files, h3, op):
    """diffusers' decode returns the blended ImageNet-space output (its pipeline maps it to [0, 1]) and its encode the
    moments of ImageNet-normalized pixels: compared before ComfyUI's finish (the blended output, the moments). In a
    float64 run the decoder keeps float32 islands, in ComfyUI's RoPE angles (ours too) and in diffusers' norms: the
    decode is bounded in float32 only."""
    import copy
    info = inspect_vae(files["h3"])
    theirs, ours = h3_diffusers(files["h3"], info.widths), h3["model"]
    x = h3["inputs"]["decode" if op == "decode" else "wide"]   # the clips' layout: against ComfyUI, live
    mean, std = (torch.tensor(v).view(1, 3, 1, 1, 1) for v in (minimax.IMAGENET_MEAN, minimax.IMAGENET_STD))

    def run(o, t, x):
        pl = minimax.plan(op, tuple(x.shape))
        with torch.inference_mode():
            mine = minimax.assemble(pl, [o.piece(x, pl, k) for k in range(len(pl.pieces))], raw=True)
            if op == "decode":
                z = x * o.latents_std.view(1, -1, 1, 1, 1) + o.latents_mean.view(1, -1, 1, 1, 1)
                return mine, t.decode(z).sample
            return mine, t.encode(((x + 1) * 0.5 - mean.to(x)) / std.to(x)).latent_dist.parameters
    a, b = run(ours, theirs, x)
    a64, b64 = run(copy.deepcopy(ours).double(), theirs.double(), x.double())
    assert compare(f"h3 {op}", a, b, a64, b64, float64_math=op == "encode")


# ---- refusals -----------------------------------------------------------------------------------------------------
class NoRanks:
    def submit(self, *a, **k):
        raise AssertionError("a job was sent to the ranks")


@pytest.mark.parametrize("config,says", [
    ({"decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": True}]] + LTX_TINY["decoder_blocks"][1:]},
     "decoder injects noise inside its ResNet blocks (inject_noise, a version-1 LTX-Video VAE)"),
    ({"norm_layer": "group_norm"}, "norm_layer is 'group_norm' (the engine splits pixel_norm VAEs"),
    ({"encoder_blocks": [["compress_all", {}]] + LTX_TINY["encoder_blocks"][1:]}, "encoder has block compress_all"),
])
def test_an_ltx_file_the_engine_does_not_split_is_refused_in_one_line(files, tmp_path, config, says):
    import json
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "other-ltx.safetensors")   # the header says another network (refused before any tensor)
    save_file(load_file(files["ltx"]), path, metadata={"config": json.dumps({"vae": dict(LTX_TINY, **config)})})
    with pytest.raises(CheckpointError) as e:
        client.run(NoRanks(), "decode", path, torch.zeros(1, 128, 2, 2, 2))
    print(e.value)
    assert says in str(e.value) and str(e.value).endswith(": ComfyUI's own VAE decodes it")
    assert "\n" not in str(e.value)


def test_an_h3_file_with_an_int8_decoder_is_refused_in_one_line(files, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(files["h3"])
    sd["decoder.transformer_blocks.0.attn.to_qkv.comfy_quant"] = torch.tensor(list(b'{"format": "int8"}'),
                                                                              dtype=torch.uint8)
    path = str(tmp_path / "h3-int8.safetensors")
    save_file(sd, path)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(path)
    assert "with an int8 (ConvRot) decoder" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,noise,says", [
    ("ltx-tc", None, "none given; the LTX-2.x video VAE in tiny-ltx2-tc-vae.safetensors mixes noise into its decode: "
                     "give torch.randn_like of the latent ([1, 128, 2, 2, 2])"),
    ("ltx-tc", (1, 128, 3, 2, 2), "noise: [1, 128, 3, 2, 2] given"),
    ("ltx", (1, 128, 2, 2, 2), "takes no noise for its decode"),
])
def test_a_decode_noise_that_does_not_belong_is_refused_in_one_line_before_any_rank(files, name, noise, says):
    with pytest.raises(VAEInputError) as e:
        client.run(NoRanks(), "decode", files[name], torch.zeros(1, 128, 2, 2, 2),
                   noise=None if noise is None else torch.zeros(noise))
    print(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_kinds_are_detected_by_comfyuis_keys_and_their_widths_read_from_the_file(files):
    ltx_info, h3_info = inspect_vae(files["ltx-tc"]), inspect_vae(files["h3"])
    assert (ltx_info.kind.name, ltx_info.latent_channels, ltx_info.decode_noise) == ("ltx2", 128, True)
    assert not inspect_vae(files["ltx"]).decode_noise
    assert h3_info.widths == {"ch": 32, "heads": 2, "z_dim": 24, "num_layers": 2}
    assert h3_info.decoded_shape((1, 24, 8, 2, 18)) == (1, 3, 26, 32, 288)
    assert ltx_info.decoded_shape(LTX_DECODE) == (1, 3, 17, 160, 64)
