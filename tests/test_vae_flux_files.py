"""The FLUX.1 / SD3 and FLUX.2 VAE files and the one-rank network, in process: one rank's decode and encode equal
diffusers' AutoencoderKL / AutoencoderKLFlux2 on the same tiny weights (an independent implementation of the same
math); the type detected as ComfyUI detects it, FLUX.2's quant convs under either of the names ComfyUI reads; an image
latent or image that does not belong to the VAE refused in one line before any rank starts; make-tiny writes them.

diffusers differs from ComfyUI where it does not change the math (docs/vae.md): its mid-block attention is SDPA (and
upcasts the softmax), its AutoencoderKL has one width for the encoder and the decoder (the tiny files' differ, as
ComfyUI allows: the test gives it an encoder of the file's width), and AutoencoderKLFlux2's decode and encode leave
out the latent's fixed BatchNorm and 2x2 (un)patchify, which its pipeline applies (diffusers'
pipelines/flux2/pipeline_flux2.py:457-470, 611-618, 1019-1024; that pipeline needs transformers, so the test applies
them as it writes them). The tiny files' tensors are named as the released files name them (FLUX.2's quant convs under
decoder. and encoder., which ComfyUI renames, sd.py:671-672): the test renames them as ComfyUI does, then converts them
with diffusers' own converter."""
import pytest
import torch

from engine.cli import main
from engine.errors import CheckpointError
from engine.vae import client
from engine.vae.load import VAEInputError, inspect_vae, load_vae, write_tiny_vae
from tolerance import K, rel

EPS_RATIO = 2.0 ** -29   # float64's epsilon over float32's: the same computation's rounding in float64
BLOCKS = ("DownEncoderBlock2D",) * 4, ("UpDecoderBlock2D",) * 4


def widths_of(ch: int) -> tuple[int, ...]:
    return tuple(ch * m for m in (1, 2, 4, 4))


def diffusers_vae(name: str, path: str, widths: dict):
    from diffusers import AutoencoderKL, AutoencoderKLFlux2
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from diffusers.models.autoencoders.vae import Encoder
    from safetensors.torch import load_file
    types = {"down_block_types": BLOCKS[0], "up_block_types": BLOCKS[1]}
    sd = {k.replace("decoder.post_quant_conv.", "post_quant_conv.").replace("encoder.quant_conv.", "quant_conv."): v
          for k, v in load_file(path).items()}   # ComfyUI's rename (sd.py:671-672)
    if name == "flux":
        vae = AutoencoderKL(**types, block_out_channels=widths_of(widths["dec_ch"]), layers_per_block=2,
                            latent_channels=widths["z_dim"], use_quant_conv=False, use_post_quant_conv=False)
        vae.encoder = Encoder(in_channels=3, out_channels=widths["z_dim"], down_block_types=BLOCKS[0],
                              block_out_channels=widths_of(widths["ch"]), layers_per_block=2, norm_num_groups=32,
                              double_z=True)
    else:
        vae = AutoencoderKLFlux2(**types, block_out_channels=widths_of(widths["ch"]),
                                 decoder_block_out_channels=widths_of(widths["dec_ch"]),
                                 latent_channels=widths["z_dim"] // 4)
    converted = convert_ldm_vae_checkpoint(sd, types)
    converted.update({k: v for k, v in sd.items() if k.startswith("bn.")})
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    assert set(missing) <= {"bn.num_batches_tracked"} and not unexpected, (missing[:3], unexpected[:3])
    return vae.eval()


def diffusers_decode(name: str, vae, z):
    """FLUX.2: the pipeline's un-normalisation and un-patchify (pipeline_flux2.py:465-470, 1019-1024) before decode."""
    if name == "flux2":
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.dtype)
        z = z * std + mean
        b, c, h, w = z.shape
        z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
    return vae.decode(z).sample


def diffusers_encode(name: str, vae, x):
    """FLUX.2: the pipeline's patchify and normalisation (pipeline_flux2.py:457-462, 611-618) after encode."""
    z = vae.encode(x).latent_dist.mode()
    if name == "flux2":
        b, c, h, w = z.shape
        z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.dtype)
        z = (z - mean) / std
    return z


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    return {name: write_tiny_vae(name, str(folder)) for name in ("flux", "flux2")}


@pytest.fixture(scope="module")
def networks(files):
    """networks(name): (ours, diffusers') on the file's weights, built once (in float32: .double() converts in place,
    and back to float32 exactly)."""
    built = {}

    def get(name):
        if name not in built:
            info = inspect_vae(files[name])
            built[name] = (load_vae(info, "fp32", torch.device("cpu")), diffusers_vae(name, files[name], info.widths))
        return tuple(m.float() for m in built[name])
    return get


@pytest.mark.parametrize("op", ["decode", "encode"])
@pytest.mark.parametrize("name", ["flux", "flux2"])
def test_one_rank_equals_diffusers_autoencoder_kl_on_the_same_weights(files, networks, name, op):
    info = inspect_vae(files[name])
    ours, theirs = networks(name)
    g = torch.Generator().manual_seed(5)
    s = info.kind.spatial
    x = torch.randn(2, info.latent_channels, 3, 4, generator=g) if op == "decode" else \
        torch.rand(2, 3, 3 * s, 4 * s, generator=g) * 2 - 1

    def run(ours_model, their_model, x):
        with torch.inference_mode():
            if op == "decode":
                return ours_model.decode(x), diffusers_decode(name, their_model, x)
            return ours_model.encode(x), diffusers_encode(name, their_model, x)
    ours32, theirs32 = run(ours, theirs, x)
    ours64, theirs64 = run(ours.double(), theirs.double(), x.double())
    own = rel(ours32, ours64)   # the network's float32 rounding
    print(f"{name} {op}: ours vs diffusers float32 max abs {float((ours32 - theirs32).abs().max()):.3g}, rel L2 "
          f"{rel(ours32, theirs32):.3g} (bound {2 * K * own:.3g}); float64 rel L2 {rel(ours64, theirs64):.3g} (bound "
          f"{K * own * EPS_RATIO:.3g})")
    assert ours32.shape == theirs32.shape
    same_math, both_rounded = rel(ours64, theirs64) <= K * own * EPS_RATIO, rel(ours32, theirs32) <= 2 * K * own
    assert same_math and both_rounded   # apart by float64 rounding; in float32, each by its own rounding


def test_the_type_is_detected_by_comfyuis_keys_and_the_widths_read_from_the_shapes(files):
    flux, flux2 = inspect_vae(files["flux"]), inspect_vae(files["flux2"])
    assert (flux.kind.name, flux2.kind.name) == ("flux", "flux2")
    assert flux.widths == {"ch": 128, "dec_ch": 32, "z_dim": 16} and flux.latent_channels == 16
    assert flux2.widths == {"ch": 128, "dec_ch": 32, "z_dim": 128} and flux2.latent_channels == 128
    assert (flux.kind.latent_dim, flux.kind.spatial, flux2.kind.spatial) == (2, 8, 16)


def test_flux2s_quant_convs_load_under_either_name_comfyui_reads(files, tmp_path):
    """The released files name them decoder.post_quant_conv / encoder.quant_conv (ComfyUI renames them, sd.py:671-672);
    a file saved from ComfyUI's own network names them post_quant_conv / quant_conv: the same weights either way."""
    from safetensors.torch import load_file, save_file
    sd = load_file(files["flux2"])
    assert "decoder.post_quant_conv.weight" in sd and "encoder.quant_conv.weight" in sd
    path = str(tmp_path / "comfy-names.safetensors")
    save_file({k.replace("decoder.post_quant_conv.", "post_quant_conv.").replace("encoder.quant_conv.", "quant_conv."):
               v for k, v in sd.items()}, path)
    info = inspect_vae(path)
    assert info.kind.name == "flux2" and "post_quant_conv.weight" in info.keys
    a, b = (load_vae(inspect_vae(p), "fp32", torch.device("cpu")).state_dict() for p in (files["flux2"], path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _conv(z):
    return torch.zeros(32, z, 3, 3)


@pytest.mark.parametrize("what,tensors", [
    ("SD 1.x / SDXL's VAE (4 channels, quant convs)", {"decoder.conv_in.weight": _conv(4),
                                                       "post_quant_conv.weight": torch.zeros(4, 4, 1, 1)}),
    ("the diffusers layout (ComfyUI converts it first)",
     {"decoder.conv_in.weight": _conv(16), "decoder.up_blocks.0.resnets.0.norm1.weight": torch.zeros(4)}),
    ("a 32-channel AutoencoderKL without FLUX.2's BatchNorm",
     {"decoder.conv_in.weight": _conv(32), "decoder.post_quant_conv.weight": torch.zeros(32, 32, 1, 1)}),
    ("Hunyuan's 64-channel VAE", {"decoder.conv_in.weight": _conv(64)}),
])
def test_an_autoencoder_kl_file_of_another_model_is_refused_in_one_line(tmp_path, what, tensors):
    from safetensors.torch import save_file
    path = str(tmp_path / "other-vae.safetensors")
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(path)
    assert "is not a VAE the engine splits" in str(e.value) and "\n" not in str(e.value), what


def test_a_flux_file_missing_tensors_is_refused_in_one_line(files, tmp_path):
    from safetensors.torch import load_file, save_file
    sd = load_file(files["flux"])
    del sd["decoder.mid.attn_1.k.weight"]
    path = str(tmp_path / "cut.safetensors")
    save_file(sd, path)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(path)
    assert "is a FLUX.1 / SD3 VAE but 1 of its tensors are missing" in str(e.value) and "\n" not in str(e.value)


class NoRanks:
    """An engine that fails the test if a job reaches it: a refusal comes before any rank starts."""
    def submit(self, *a, **k):
        raise AssertionError("a job was sent to the ranks")


@pytest.mark.parametrize("name,op,shape,says", [
    ("flux", "decode", (1, 16, 1, 4, 6), "is not an image latent [batch, 16, height, width], which the FLUX.1 / SD3 "
                                         "VAE in tiny-flux-vae.safetensors decodes"),
    ("flux2", "decode", (1, 32, 4, 6), "has 32 channels; the FLUX.2 VAE in tiny-flux2-vae.safetensors decodes 128"),
    ("flux", "decode", (1, 16, 0, 6), "is empty; the FLUX.1 / SD3 VAE in tiny-flux-vae.safetensors decodes at least "
                                      "one latent row and column"),
    ("flux", "encode", (1, 3, 1, 32, 48), "is not an image batch [batch, 3, height, width]"),
    ("flux2", "encode", (1, 3, 40, 48), "encodes at least one height and width that are multiples of 16"),
])
def test_an_image_latent_or_image_that_does_not_belong_to_the_vae_is_refused_in_one_line_before_any_rank(
        files, name, op, shape, says):
    with pytest.raises(VAEInputError) as e:
        client.run(NoRanks(), op, files[name], torch.zeros(shape))
    print(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_make_tiny_writes_a_flux_vae_file_that_the_engine_reads(tmp_path, capsys):
    assert main(["make-tiny", "--kind", "vae-flux2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote   {tmp_path}/tiny-flux2-vae.safetensors" in out and "latent  [batch, 128, height / 16, width / " \
        "16]" in out
    assert inspect_vae(str(tmp_path / "tiny-flux2-vae.safetensors")).kind.name == "flux2"
