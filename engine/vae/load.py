"""A VAE file as the engine reads it: its type detected from the tensor names as ComfyUI 0.33's comfy.sd.VAE does
(sd.py:521-1010, in its order), its widths read from the tensor shapes, its weights loaded whole on a rank (VAEs are
small) in the dtype the caller names; the checks of a latent or a clip against it; and tiny random files of each type
with ComfyUI's key names (`python -m engine make-tiny --kind vae-wan2.1`).

Adding a VAE family is one module with its network and one Kind in KINDS."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, PackError
from ..models.safetensors_file import read_header

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
    """One VAE type: `detect` on the file's tensor names (ComfyUI's test), `widths` from its shapes, `build` the
    network (the kwargs from `widths`), the latent's `spatial` and `temporal` ratios, `tiny` the widths of a tiny file,
    `comfy_class` the module of ComfyUI's own network for it and `comfyui_since` the first ComfyUI release with it."""
    name: str
    title: str
    detect: Callable[[set], bool]
    widths: Callable[[dict], dict]
    build: Callable[..., torch.nn.Module]
    spatial: int
    temporal: int
    tiny: dict
    comfy_class: str
    comfyui_since: str


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


WAN_MIDDLE = "decoder.middle.0.residual.0.gamma"          # sd.py:816
WAN22_UP = "decoder.upsamples.0.upsamples.0.residual.2.weight"   # sd.py:817

# in comfy.sd.VAE's order of tests (sd.py:816-829)
KINDS: tuple[Kind, ...] = (
    Kind("wan2.2", "Wan 2.2 (TI2V-5B, 48 channels)", lambda k: WAN_MIDDLE in k and WAN22_UP in k, _wan22_widths,
         _wan22, 16, 4, {"dim": 16, "dec_dim": 16, "z_dim": 48}, "comfy.ldm.wan.vae2_2.WanVAE", "0.3.46"),
    Kind("wan2.1", "Wan 2.1 (also Wan 2.2 A14B's and Qwen-Image's)", lambda k: WAN_MIDDLE in k and WAN22_UP not in k,
         _wan21_widths, _wan21, 8, 4, {"dim": 8, "z_dim": 16, "image_channels": 3, "out_channels": 3},
         "comfy.ldm.wan.vae.WanVAE", "0.3.16"),
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
        """A latent [B, C, T, H, W] this VAE decodes, else VAEInputError in one line."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != 5:
            raise VAEInputError(f"latent: shape {list(shape)} is not a video latent [batch, {self.latent_channels}, "
                                f"frames, height, width], which {self.describe()} decodes")
        if shape[1] != self.latent_channels:
            raise VAEInputError(f"latent: shape {list(shape)} has {shape[1]} channels; {self.describe()} decodes "
                                f"{self.latent_channels}: give it a latent of the model this VAE belongs to")
        if min(shape[0], shape[2], shape[3], shape[4]) < 1:
            raise VAEInputError(f"latent: shape {list(shape)} is empty; {self.describe()} decodes at least one frame "
                                f"of one latent row and column")

    def check_pixels(self, shape: tuple) -> None:
        """Pixels [B, C, T, H, W] (channels first, as the engine takes them) this VAE encodes, else VAEInputError."""
        shape = tuple(int(s) for s in shape)
        s = self.kind.spatial
        if len(shape) != 5 or shape[1] != self.image_channels:
            raise VAEInputError(f"pixels: shape {list(shape)} is not a clip [batch, {self.image_channels}, frames, "
                                f"height, width], which {self.describe()} encodes")
        if min(shape[0], shape[2]) < 1 or shape[3] < s or shape[4] < s or shape[3] % s or shape[4] % s:
            raise VAEInputError(f"pixels: shape {list(shape)}: {self.describe()} encodes at least one frame of a "
                                f"height and width that are multiples of {s} (crop it as ComfyUI's VAE Encode does)")

    def decoded_shape(self, shape: tuple) -> tuple[int, ...]:
        b, _, t, h, w = shape
        s = self.kind.spatial
        return (b, self.out_channels, max(0, t * 4 - 3), h * s, w * s)

    def encoded_shape(self, shape: tuple) -> tuple[int, ...]:
        b, _, t, h, w = shape
        s = self.kind.spatial
        return (b, self.latent_channels, 1 + (t - 1) // 4, h // s, w // s)


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
    tensors, _ = read_header(path)
    tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    keys = frozenset(tensors)
    name = os.path.basename(path) + (f"'s {prefix} tensors" if prefix else "")
    verb = "are" if prefix else "is"
    found = next((k for k in KINDS if k.detect(keys)), None)
    if found is None:
        raise CheckpointError(f"{name} {verb} not a VAE the engine splits (it reads "
                              f"{', '.join(k.title for k in KINDS)}): ComfyUI's own VAE decodes it")
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    try:
        widths = found.widths(shapes)
    except KeyError as e:
        raise CheckpointError(f"{name} {verb} a {found.title} VAE without its tensor {e.args[0]}: the file is "
                              f"incomplete") from None
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
        weights = {k: f.get_tensor(info.prefix + k).to(DTYPES[dtype]) for k in names}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def tiny_state_dict(name: str, seed: int = 0, full: bool = False) -> dict[str, torch.Tensor]:
    """Random weights of a tiny VAE of kind `name` (full: at the released widths) with ComfyUI's key names: matrices
    and kernels with std 1/sqrt(fan-in), norm scales about 1, biases about 0.1, drawn in key order from `seed`."""
    k = kind(name)
    with torch.device("meta"):
        model = k.build() if full else k.build(**k.tiny)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in sorted(model.state_dict().items()):
        if t.ndim >= 2 and not key.endswith("gamma"):
            out[key] = torch.randn(t.shape, generator=g) * (t[0].numel() ** -0.5)
        elif key.endswith("gamma"):
            out[key] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            out[key] = 0.1 * torch.randn(t.shape, generator=g)
    return out


def tiny_vae_file(name: str) -> str:
    return f"tiny-{name}-vae.safetensors"


def write_tiny_vae(name: str, out_dir: str, seed: int = 0, dtype: str = "fp32", full: bool = False) -> str:
    """Write a tiny VAE file of kind `name` (ComfyUI's key names and layout; full: random weights at the released
    widths, for benchmarks) into out_dir; returns its path."""
    weights = {key: t.to(DTYPES[dtype_name(dtype)]).contiguous()
               for key, t in tiny_state_dict(name, seed, full).items()}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, tiny_vae_file(name) if not full else f"random-{name}-vae.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    return path
