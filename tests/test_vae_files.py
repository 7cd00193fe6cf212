"""The VAE files and the one-rank network, in process: one rank's Wan 2.1 and 2.2 decode and encode equal diffusers'
AutoencoderKLWan on the same tiny weights (an independent implementation of the same math); the type detected as
ComfyUI detects it; a latent or clip that does not belong to the VAE refused in one line before any rank starts;
make-tiny writes the VAE files.

diffusers differs from ComfyUI where it does not change the math (docs/vae.md): it decodes one latent frame a chunk
and encodes 1 + 4 frames a chunk (the caches make both the same sums), its attention is SDPA, its decode clamps the
result to [-1, 1] (ComfyUI clamps after mapping to [0, 1]): the comparison clamps ours too; and its nearest upsample
casts to float32 and back (WanUpsample: a copy, exact in float32 and below, a rounding only in float64): the float64
comparison runs it in float64."""
import re

import pytest
import torch

from engine.cli import main
from engine.errors import CheckpointError
from engine.vae import client
from engine.vae.load import NAMES, VAEInputError, inspect_vae, load_vae, write_tiny_vae
from tolerance import K, rel

EPS_RATIO = 2.0 ** -29   # float64's epsilon over float32's: the same computation's rounding in float64


def diffusers_keys(name: str, sd: dict) -> dict:
    """ComfyUI's Wan VAE names as diffusers' AutoencoderKLWan names them: diffusers' own converter for Wan 2.1; for
    Wan 2.2 (which it lacks) the same renames on the residual up and down blocks."""
    if name == "wan2.1":
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
        return convert_wan_vae_to_diffusers(dict(sd))
    rename = [(r"^conv1\.", "quant_conv."), (r"^conv2\.", "post_quant_conv."),
              (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
              (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."), (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
              (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
              (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
              (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
              (r"^encoder\.downsamples\.(\d+)\.downsamples\.2\.", r"encoder.down_blocks.\1.downsampler."),
              (r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
              (r"^decoder\.upsamples\.(\d+)\.upsamples\.3\.", r"decoder.up_blocks.\1.upsampler."),
              (r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
              (r"\.residual\.0\.", ".norm1."), (r"\.residual\.2\.", ".conv1."), (r"\.residual\.3\.", ".norm2."),
              (r"\.residual\.6\.", ".conv2."), (r"\.shortcut\.", ".conv_shortcut.")]
    out = {}
    for key, value in sd.items():
        for pattern, to in rename:
            key = re.sub(pattern, to, key)
        out[key] = value
    return out


def diffusers_vae(name: str, path: str, widths: dict):
    from diffusers import AutoencoderKLWan
    from safetensors.torch import load_file
    if name == "wan2.1":
        config = dict(base_dim=widths["dim"], z_dim=widths["z_dim"])
    else:
        config = dict(base_dim=widths["dim"], decoder_base_dim=widths["dec_dim"], z_dim=widths["z_dim"],
                      is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
    vae = AutoencoderKLWan(**config)
    missing, unexpected = vae.load_state_dict(diffusers_keys(name, load_file(path)), strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return vae.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    return {name: write_tiny_vae(name, str(folder)) for name in ("wan2.1", "wan2.2")}


@pytest.mark.parametrize("op", ["decode", "encode"])
@pytest.mark.parametrize("name", ["wan2.1", "wan2.2"])
def test_one_rank_equals_diffusers_autoencoder_kl_wan_on_the_same_weights(files, name, op, monkeypatch):
    from diffusers.models.autoencoders import autoencoder_kl_wan
    monkeypatch.setattr(autoencoder_kl_wan.WanUpsample, "forward", torch.nn.Upsample.forward)
    info = inspect_vae(files[name])
    ours = load_vae(info, "fp32", torch.device("cpu"))
    theirs = diffusers_vae(name, files[name], info.widths)
    g = torch.Generator().manual_seed(5)
    s = info.kind.spatial
    x = torch.randn(1, info.latent_channels, 4, 3, 5, generator=g) if op == "decode" else \
        torch.rand(1, 3, 13, 3 * s, 5 * s, generator=g) * 2 - 1

    def run(ours_model, their_model, x):
        with torch.inference_mode():
            if op == "decode":
                return ours_model.decode(x).clamp(-1, 1), their_model.decode(x).sample
            return ours_model.encode(x), their_model.encode(x).latent_dist.mean
    ours32, theirs32 = run(ours, theirs, x)
    ours64, theirs64 = run(ours.double(), theirs.double(), x.double())
    own = rel(ours32, ours64)   # the network's float32 rounding
    inside = float((ours64.abs() < 1).double().mean()) if op == "decode" else 1.0   # what the clamp leaves
    print(f"{name} {op}: ours vs diffusers float32 max abs {float((ours32 - theirs32).abs().max()):.3g}, rel L2 "
          f"{rel(ours32, theirs32):.3g} (bound {2 * K * own:.3g}); float64 rel L2 {rel(ours64, theirs64):.3g} (bound "
          f"{K * own * EPS_RATIO:.3g})" + (f"; {inside:.0%} of it inside (-1, 1)" if op == "decode" else ""))
    assert ours32.shape == theirs32.shape
    same_math, both_rounded = rel(ours64, theirs64) <= K * own * EPS_RATIO, rel(ours32, theirs32) <= 2 * K * own
    assert same_math and both_rounded   # apart by float64 rounding; in float32, each by its own rounding
    assert inside > 0.5   # the clamp leaves most of the decode compared


def test_the_type_is_detected_by_comfyuis_keys_and_the_widths_read_from_the_shapes(files):
    assert (inspect_vae(files["wan2.1"]).kind.name, inspect_vae(files["wan2.2"]).kind.name) == ("wan2.1", "wan2.2")
    assert inspect_vae(files["wan2.1"]).widths == {"dim": 8, "z_dim": 16, "image_channels": 3, "out_channels": 3}
    assert inspect_vae(files["wan2.2"]).widths == {"dim": 16, "dec_dim": 16, "z_dim": 48}


def test_a_file_of_another_vae_is_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file
    path = str(tmp_path / "sdxl-vae.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)}, path)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(path)
    assert "is not a VAE the engine splits" in str(e.value) and "\n" not in str(e.value)


def test_a_wan_file_missing_tensors_is_refused_in_one_line(files, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(files["wan2.1"])
    del sd["decoder.upsamples.3.resample.1.weight"]
    path = str(tmp_path / "cut.safetensors")
    save_file(sd, path)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(path)
    assert "1 of its tensors are missing" in str(e.value) and "\n" not in str(e.value)


class NoRanks:
    """An engine that fails the test if a job reaches it: a refusal comes before any rank starts."""
    def submit(self, *a, **k):
        raise AssertionError("a job was sent to the ranks")


@pytest.mark.parametrize("op,shape,says", [
    ("decode", (1, 48, 3, 4, 6), "has 48 channels; the Wan 2.1 (also Wan 2.2 A14B's and Qwen-Image's) VAE in "
                                 "tiny-wan2.1-vae.safetensors decodes 16"),
    ("decode", (1, 16, 4, 6), "is not a video latent [batch, 16, frames, height, width]"),
    ("decode", (1, 16, 0, 4, 6), "is empty"),
    ("encode", (1, 4, 5, 32, 48), "is not a clip [batch, 3, frames, height, width]"),
    ("encode", (1, 3, 5, 30, 48), "a height and width that are multiples of 8"),
])
def test_a_latent_or_clip_that_does_not_belong_to_the_vae_is_refused_in_one_line_before_any_rank(files, op, shape,
                                                                                                   says):
    with pytest.raises(VAEInputError) as e:
        client.run(NoRanks(), op, files["wan2.1"], torch.zeros(shape))
    print(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_make_tiny_writes_a_vae_file_that_the_engine_reads(tmp_path, capsys):
    assert main(["make-tiny", "--kind", "vae-wan2.2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote   {tmp_path}/tiny-wan2.2-vae.safetensors" in out and "latent  [batch, 48, frames" in out
    assert inspect_vae(str(tmp_path / "tiny-wan2.2-vae.safetensors")).kind.name == "wan2.2"
    assert main(["make-tiny", "--kind", "vae-wan2.1", "--format", "gguf", "--out", str(tmp_path)]) == 2
    assert main(["make-tiny", "--kind", "vae-sdxl", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["python -m engine make-tiny: error: argument --format: applies to model files, and --kind "
                   "vae-wan2.1 writes a VAE file: leave it out",
                   "python -m engine make-tiny: error: argument --kind: 'vae-sdxl' is not a VAE make-tiny writes: use "
                   + " or ".join(f"vae-{n}" for n in sorted(NAMES))]


def test_a_comfyui_that_reads_the_file_as_another_vae_gets_the_release_it_needs_in_one_line(files):
    from conftest import PACK_NAME, load_pack
    import importlib
    load_pack()
    vae = importlib.import_module(PACK_NAME + ".xdit_nodes.vae")
    info = inspect_vae(files["wan2.2"])
    assert vae.comfyui_mismatch(info, ["comfy.ldm.wan.vae.WanVAE", "torch.nn.modules.module.Module"], 16, "0.3.45") \
        == ("xDiT VAE Loader: this ComfyUI (0.3.45) reads tiny-wan2.2-vae.safetensors as comfy.ldm.wan.vae.WanVAE with "
            "16 latent channels, not as Wan 2.2 (TI2V-5B, 48 channels): update ComfyUI to 0.3.46 or newer")
    assert vae.comfyui_mismatch(info, ["tests.TinyWidths", "comfy.ldm.wan.vae2_2.WanVAE"], 48, "0.33.0") is None
    # a ComfyUI that cannot build the file at all (its own loader raises) is named the same release, by version
    assert vae.older_than("0.3.64", "0.3.72") and vae.older_than("0.3.9", "0.3.46")
    assert not vae.older_than("0.33.0", "0.3.72") and not vae.older_than("version unknown", "0.3.72")
    assert vae.splits(None) == (None, "it is not a single file (ComfyUI builds it)")
    assert vae.splits(files["wan2.1"])[0].kind.name == "wan2.1"
