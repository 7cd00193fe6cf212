"""A VAE file as the engine reads it: its type detected from the tensor names as ComfyUI 0.33's comfy.sd.VAE does
(sd.py:521-1010, in its order), its widths read from the tensor shapes, its weights loaded whole on a rank (VAEs are
small) in the dtype the caller names; the checks of a latent or a clip against it; and tiny random files of each type
with ComfyUI's key names (`python -m engine make-tiny --kind vae-wan2.1`).

Adding a VAE family is one module with its network and one Kind in KINDS."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, PackError
from ..models.safetensors_file import read_header
from . import flux

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class VAEInputError(PackError, ValueError):
    """A latent or a clip that does not belong to the VAE: one line naming the input, its value and what works."""


def dtype_name(dtype) -> str:
    """"fp32" / "bf16" / "fp16" for any of those names or torch dtypes; ValueError naming what works."""
    for name, d in DTYPES.items():
        if dtype in (name, d):
            return name
    raise ValueError(f"VAE dtype {dtype!r} is not one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Kind:
    """One VAE type: `detect` on the file's tensors ({name: shape}, ComfyUI's test), `widths` from its shapes, `build`
    the network (the kwargs from `widths`), the latent's `spatial` and `temporal` ratios, `tiny` the widths of a tiny
    file, `comfy_class` the module of ComfyUI's own network for it and `comfyui_since` the first ComfyUI release with
    it; `latent_dim` ComfyUI's (3: video latents [B, C, T, H, W]; 2: images [B, C, H, W]); `renames` the (file prefix,
    network prefix) pairs ComfyUI applies to a file's names before loading it (the released files' names are the
    file prefixes)."""
    name: str
    title: str
    detect: Callable[[dict], bool]
    widths: Callable[[dict], dict]
    build: Callable[..., torch.nn.Module]
    spatial: int
    temporal: int
    tiny: dict
    comfy_class: str
    comfyui_since: str
    latent_dim: int = 3
    renames: tuple = ()
    # what else the file says (its name, tensor shapes, header metadata) -> more build kwargs (LTX: the header's
    # config); raises CheckpointError in one line for a file of this type the engine does not split
    header: Callable[[str, dict, dict], dict] | None = None
    metadata: Callable[[dict], dict] | None = None   # the header metadata a tiny file of these widths carries
    decoded_frames: Callable[[int], int] | None = None   # when not (t - 1) x temporal + 1
    encoded_frames: Callable[[int], int] | None = None   # when not 1 + (t - 1) // temporal
    pool: Callable[[], object] | None = None   # tiles by definition: the module that plans and blends them

    def network_name(self, key: str) -> str:
        """A file's tensor name as the network names it."""
        for file_prefix, prefix in self.renames:
            if key.startswith(file_prefix):
                return prefix + key[len(file_prefix):]
        return key

    def file_name(self, key: str) -> str:
        """A network's tensor name as the released files name it."""
        for file_prefix, prefix in self.renames:
            if key.startswith(prefix):
                return file_prefix + key[len(prefix):]
        return key


def _wan21_widths(shapes: dict) -> dict:
    """What comfy.sd.VAE reads of a Wan 2.1 file (sd.py:830-841): dim, the image and output channels."""
    return {"dim": shapes["decoder.head.0.gamma"][0], "z_dim": shapes["decoder.conv1.weight"][1],
            "image_channels": shapes["encoder.conv1.weight"][1], "out_channels": shapes["decoder.head.2.weight"][0]}


def _wan22_widths(shapes: dict) -> dict:
    return {"dim": shapes["encoder.conv1.weight"][0], "dec_dim": shapes["decoder.head.0.gamma"][0],
            "z_dim": shapes["decoder.conv1.weight"][1]}


def _wan21(**widths):
    from .wan import WanVAE21
    return WanVAE21(**widths)


def _wan22(**widths):
    from .wan22 import WanVAE22
    return WanVAE22(**widths)


def _ltx(config: dict | None = None, z_dim: int = 128):
    from .ltx import DEFAULT_V2, LTXVideoVAE
    return LTXVideoVAE(config or DEFAULT_V2)


def _ltx_header(name: str, shapes: dict, metadata: dict) -> dict:
    """The config ComfyUI builds the LTX VAE from: the header's config["vae"], else its default for the version the
    widths say (sd.py:737-749); a network the engine does not split refused in one line."""
    from .ltx import DEFAULT_V2, unsupported, version
    try:
        config = json.loads(metadata["config"]).get("vae") if metadata.get("config") else None
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{name}: its header's config is not a JSON object ({e}): the file is damaged") from None
    if config is None and version(shapes) != 2:
        why = ("decoder injects noise inside its ResNet blocks (ComfyUI's version-1 default config, inject_noise): "
               "noise drawn per call inside the network cannot be reproduced on the ranks") if version(shapes) == 1 \
            else "encoder downsamples with strided convolutions (ComfyUI's version-0 default config, LTX-Video 0.9)"
        raise CheckpointError(f"{name} is an LTX video VAE whose {why}: ComfyUI's own VAE decodes it")
    config = config if config is not None else DEFAULT_V2
    why = unsupported(config)
    if why:
        raise CheckpointError(f"{name} is an LTX video VAE whose {why}: ComfyUI's own VAE decodes it")
    return {"config": config, "z_dim": config["latent_channels"]}


def _h3(ch: int = 128, num_layers: int = 36, heads: int = 32, z_dim: int = 24):
    from .minimax import H3VideoVAE
    return H3VideoVAE(ch, num_layers, heads, z_dim)


def _h3_widths(shapes: dict) -> dict:
    """ComfyUI builds H3's VAE at its released widths (sd.py:1000); the engine reads them: the encoder's ch, the
    decoder's layers and heads (of 64 channels, as ComfyUI's)."""
    dim, z_dim = shapes["decoder.x_embedder.weight"]
    layers = sum(1 for k in shapes if k.startswith("decoder.transformer_blocks.") and k.endswith(".scale1"))
    return {"ch": shapes["encoder.conv_in.weight"][0], "heads": dim // 64, "z_dim": z_dim, "num_layers": layers}


def _h3_header(name: str, shapes: dict, metadata: dict) -> dict:
    if any(k.endswith(".comfy_quant") for k in shapes):   # ComfyUI's int8+ConvRot decoder (sd.py:996-999)
        raise CheckpointError(f"{name} is a MiniMax-H3 video VAE with an int8 (ConvRot) decoder, which the engine does "
                              f"not split (its float files it does): ComfyUI's own VAE decodes it")
    return {}


def _pool_minimax():
    from . import minimax_tiles
    return minimax_tiles


def _h3_frames(decode: bool):
    def frames(t: int) -> int:
        from .minimax_tiles import decoded_frames, encoded_frames
        return decoded_frames(t) if decode else encoded_frames(t)
    return frames


WAN_MIDDLE = "decoder.middle.0.residual.0.gamma"          # sd.py:816
WAN22_UP = "decoder.upsamples.0.upsamples.0.residual.2.weight"   # sd.py:817

LTX_UP = "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"                        # sd.py:737
H3_DECODER, H3_ENCODER = "decoder.transformer_blocks.0.scale1", "encoder.down.5.block.0.conv1.weight"   # sd.py:995
LTX_TINY = {   # the LTX-2 layout (four res_x levels, three residual compress_all) at tiny widths; latent 128 as ComfyUI
    "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "patch_size": 4, "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
    "timestep_conditioning": False, "encoder_base_channels": 8, "decoder_base_channels": 8,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}]] * 3 +
                      [["res_x", {"num_layers": 1, "inject_noise": False}]]}

# in comfy.sd.VAE's order of tests (sd.py:632-694, 816-829; LTX's at sd.py:737 and H3's at sd.py:995 test keys no other
# has)
KINDS: tuple[Kind, ...] = (
    Kind("flux2", "FLUX.2", flux.is_flux2, flux.flux2_widths, flux.Flux2VAE, 16, 1, flux.TINY2,
         "comfy.ldm.models.autoencoder.AutoencoderKL", "0.3.72", latent_dim=2, renames=flux.FLUX2_RENAMES),
    # every ComfyUI the pack supports (0.3.64 on) reads it: the 16-channel AutoencodingEngine since April 2024
    Kind("flux", "FLUX.1 / SD3", flux.is_flux, flux.flux_widths, flux.FluxVAE, 8, 1, flux.TINY,
         "comfy.ldm.models.autoencoder.AutoencodingEngine", "0.3.64", latent_dim=2),
    Kind("wan2.2", "Wan 2.2 (TI2V-5B, 48 channels)", lambda k: WAN_MIDDLE in k and WAN22_UP in k, _wan22_widths,
         _wan22, 16, 4, {"dim": 16, "dec_dim": 16, "z_dim": 48}, "comfy.ldm.wan.vae2_2.WanVAE", "0.3.46"),
    Kind("wan2.1", "Wan 2.1 (also Wan 2.2 A14B's and Qwen-Image's)", lambda k: WAN_MIDDLE in k and WAN22_UP not in k,
         _wan21_widths, _wan21, 8, 4, {"dim": 8, "z_dim": 16, "image_channels": 3, "out_channels": 3},
         "comfy.ldm.wan.vae.WanVAE", "0.3.16"),
    Kind("ltx2", "LTX-2.x video", lambda k: LTX_UP in k, lambda shapes: {}, _ltx, 32, 8, {"config": LTX_TINY},
         "comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE", "0.33", header=_ltx_header,   # sd.py:737
         metadata=lambda widths: {"config": json.dumps({"vae": widths.get("config") or LTX_TINY})}),
    Kind("minimax-h3", "MiniMax-H3 video", lambda k: H3_DECODER in k and H3_ENCODER in k, _h3_widths, _h3, 16, 4,
         {"ch": 32, "num_layers": 2, "heads": 2, "z_dim": 24}, "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE", "0.33",
         header=_h3_header, decoded_frames=_h3_frames(True), encoded_frames=_h3_frames(False), pool=_pool_minimax),
)
NAMES = tuple(k.name for k in KINDS)


def kind(name: str) -> Kind:
    for k in KINDS:
        if k.name == name:
            return k
    raise ValueError(f"VAE kind {name!r} is unknown: use one of {', '.join(NAMES)}")


@dataclass(frozen=True)
class VAEInfo:
    """A VAE file as its header says: path, mtime (what the ranks key their copy by), kind and widths; `prefix`: the
    key prefix of the VAE's tensors in a checkpoint that holds more (ComfyUI's vae_key_prefix, e.g. "vae."; "" for a
    VAE file), `keys` the VAE's tensor names without it."""
    path: str
    mtime_ns: int
    kind: Kind
    widths: dict
    keys: frozenset
    prefix: str = ""

    @property
    def latent_channels(self) -> int:
        return self.widths["z_dim"]

    @property
    def image_channels(self) -> int:
        return self.widths.get("image_channels", 3)

    @property
    def out_channels(self) -> int:
        return self.widths.get("out_channels", 3)

    def describe(self) -> str:
        where = f" (its {self.prefix} tensors)" if self.prefix else ""
        return f"the {self.kind.title} VAE in {os.path.basename(self.path)}{where}"

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the network takes, with its shape (from the network built on the meta device)."""
        with torch.device("meta"):
            model = self.kind.build(**self.widths)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def check_latent(self, shape: tuple) -> None:
        """A latent [B, C, T, H, W] ([B, C, H, W] for an image VAE) this VAE decodes, else VAEInputError in one
        line."""
        shape = tuple(int(s) for s in shape)
        if self.kind.latent_dim == 2 and len(shape) != 4:
            raise VAEInputError(f"latent: shape {list(shape)} is not an image latent [batch, {self.latent_channels}, "
                                f"height, width], which {self.describe()} decodes")
        if self.kind.latent_dim == 3 and len(shape) != 5:
            raise VAEInputError(f"latent: shape {list(shape)} is not a video latent [batch, {self.latent_channels}, "
                                f"frames, height, width], which {self.describe()} decodes")
        if shape[1] != self.latent_channels:
            raise VAEInputError(f"latent: shape {list(shape)} has {shape[1]} channels; {self.describe()} decodes "
                                f"{self.latent_channels}: give it a latent of the model this VAE belongs to")
        if min(shape[0], *shape[2:]) < 1:
            raise VAEInputError(f"latent: shape {list(shape)} is empty; {self.describe()} decodes at least one "
                                f"{'frame of one ' if len(shape) == 5 else ''}latent row and column")

    def check_pixels(self, shape: tuple) -> None:
        """Pixels [B, C, T, H, W] (channels first, as the engine takes them; [B, C, H, W] for an image VAE) this VAE
        encodes, else VAEInputError."""
        shape = tuple(int(s) for s in shape)
        s = self.kind.spatial
        if self.kind.latent_dim == 2 and (len(shape) != 4 or shape[1] != self.image_channels):
            raise VAEInputError(f"pixels: shape {list(shape)} is not an image batch [batch, {self.image_channels}, "
                                f"height, width], which {self.describe()} encodes")
        if self.kind.latent_dim == 3 and (len(shape) != 5 or shape[1] != self.image_channels):
            raise VAEInputError(f"pixels: shape {list(shape)} is not a clip [batch, {self.image_channels}, frames, "
                                f"height, width], which {self.describe()} encodes")
        if min(shape[0], shape[2]) < 1 or min(shape[-2:]) < s or shape[-2] % s or shape[-1] % s:
            raise VAEInputError(f"pixels: shape {list(shape)}: {self.describe()} encodes at least one "
                                f"{'frame of a ' if len(shape) == 5 else ''}height and width that are multiples of "
                                f"{s} (crop it as ComfyUI's VAE Encode does)")

    @property
    def decode_noise(self) -> bool:
        """The decode mixes in noise the caller draws (LTX's timestep-conditioned decoders)."""
        return bool(self.widths.get("config", {}).get("timestep_conditioning", False))

    def decoded_shape(self, shape: tuple) -> tuple[int, ...]:
        s = self.kind.spatial
        if self.kind.latent_dim == 2:
            return (shape[0], self.out_channels, shape[2] * s, shape[3] * s)
        b, _, t, h, w = shape
        k = self.kind
        frames = k.decoded_frames(t) if k.decoded_frames else max(0, (t - 1) * k.temporal + 1)
        return (b, self.out_channels, frames, h * s, w * s)

    def encoded_shape(self, shape: tuple) -> tuple[int, ...]:
        s = self.kind.spatial
        if self.kind.latent_dim == 2:
            return (shape[0], self.latent_channels, shape[2] // s, shape[3] // s)
        b, _, t, h, w = shape
        k = self.kind
        frames = k.encoded_frames(t) if k.encoded_frames else 1 + (t - 1) // k.temporal
        return (b, self.latent_channels, frames, h // s, w // s)


_INFO: dict[tuple, VAEInfo] = {}


def inspect_vae(path: str, prefix: str = "") -> VAEInfo:
    """The VAE file's kind and widths from its header (no tensor read); CheckpointError in one line for a file that is
    not a VAE the engine splits, or lacks tensors the network needs. prefix: read only the tensors named with it, the
    prefix removed, as ComfyUI's checkpoint loader takes a checkpoint's VAE (its vae_key_prefix, sd.py:2210-2213)."""
    path = os.path.abspath(path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as e:
        raise CheckpointError(f"VAE file {path!r} cannot be read ({e.strerror or e})") from None
    cached = _INFO.get((path, mtime, prefix))
    if cached is not None:
        return cached
    tensors, metadata = read_header(path)
    in_file = {key[len(prefix):]: tuple(t.shape) for key, t in tensors.items() if key.startswith(prefix)}
    name = os.path.basename(path) + (f"'s {prefix} tensors" if prefix else "")
    verb = "are" if prefix else "is"
    found = next((k for k in KINDS if k.detect(in_file)), None)
    if found is None:
        raise CheckpointError(f"{name} {verb} not a VAE the engine splits (it reads "
                              f"{', '.join(k.title for k in KINDS)}): ComfyUI's own VAE decodes it")
    shapes = {found.network_name(key): shape for key, shape in in_file.items()}
    keys = frozenset(shapes)
    try:
        widths = found.widths(shapes)
    except KeyError as e:
        raise CheckpointError(f"{name} {verb} a {found.title} VAE without its tensor {e.args[0]}: the file is "
                              f"incomplete") from None
    if found.header is not None:
        widths.update(found.header(os.path.basename(path), shapes, metadata))
    info = VAEInfo(path, mtime, found, widths, keys, prefix)
    expected = info.expected()
    missing = sorted(set(expected) - keys)
    wrong = sorted(k for k in expected if k in keys and shapes[k] != expected[k])
    if missing or wrong:
        k = (missing or wrong)[0]
        raise CheckpointError(f"{name} {verb} a {found.title} VAE but {len(missing)} of its tensors are "
                              f"missing and {len(wrong)} have other shapes (e.g. {k}: "
                              f"{shapes.get(k, 'absent')}, expected {expected[k]}): the file is damaged or of another "
                              f"model")
    _INFO[(path, mtime, prefix)] = info
    return info


def load_vae(info: VAEInfo, dtype: str, device: torch.device) -> torch.nn.Module:
    """The whole network on `device` in `dtype` (every tensor of the file cast as ComfyUI casts them, sd.py:1076)."""
    with torch.device("meta"):
        model = info.kind.build(**info.widths)
    names = set(model.state_dict())
    with safe_open(info.path, "pt", device="cpu") as f:
        in_file = {info.kind.network_name(k[len(info.prefix):]): k for k in f.keys() if k.startswith(info.prefix)}
        weights = {k: f.get_tensor(in_file[k]).to(DTYPES[dtype]) for k in names}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


POSITIVE = ("gamma", "std-of-means", "latents_std")   # scales and stds: about 1
FIXED = {"timestep_scale_multiplier": 1000.0}          # LTX's, as released (causal_video_autoencoder.py:613)


def tiny_state_dict(name: str, seed: int = 0, full: bool = False,
                    widths: dict | None = None) -> dict[str, torch.Tensor]:
    """Random weights of a tiny VAE of kind `name` (full: at the released widths; widths: these instead of the kind's
    tiny ones) with ComfyUI's key names: matrices and kernels with std 1/sqrt(fan-in), norm scales and stds about 1,
    biases about 0.1, running variances in [0.5, 1.5), drawn in key order from `seed`."""
    k = kind(name)
    with torch.device("meta"):
        model = k.build() if full else k.build(**(widths or k.tiny))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in sorted(model.state_dict().items()):
        if key.endswith(tuple(FIXED)):
            out[key] = torch.full(t.shape, FIXED[key.rsplit(".", 1)[-1]])
        elif t.ndim >= 2 and not key.endswith("gamma"):
            out[key] = torch.randn(t.shape, generator=g) * (t[0].numel() ** -0.5)
        elif key.endswith(POSITIVE) or ("norm" in key and key.endswith(".weight")):   # RMS_norm's, GroupNorm's
            out[key] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif key.endswith("running_var"):
            out[key] = 0.5 + torch.rand(t.shape, generator=g)
        else:
            out[key] = 0.1 * torch.randn(t.shape, generator=g)
    return out


def tiny_vae_file(name: str) -> str:
    return f"tiny-{name}-vae.safetensors"


def write_tiny_vae(name: str, out_dir: str, seed: int = 0, dtype: str = "fp32", full: bool = False,
                   widths: dict | None = None, file: str | None = None) -> str:
    """Write a tiny VAE file of kind `name` (ComfyUI's key names, layout and header; full: random weights at the
    released widths, for benchmarks; widths: these instead of the kind's tiny ones, file: under this name) into
    out_dir; returns its path."""
    k = kind(name)
    weights = {k.file_name(key): t.to(DTYPES[dtype_name(dtype)]).contiguous()
               for key, t in tiny_state_dict(name, seed, full, widths).items()}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, file or (tiny_vae_file(name) if not full else f"random-{name}-vae.safetensors"))
    metadata = k.metadata({} if full else widths or k.tiny) if k.metadata else {}
    save_file(weights, path, metadata={"format": "pt", **metadata})
    return path
