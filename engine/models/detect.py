"""What a checkpoint holds, from its header alone: model family, key layout, key prefix, and the transformer
config inferred from tensor shapes by the family's module (engine/families; nothing is fetched from a hub)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .. import families
from ..families.base import Family
from .quantized import CONVROT_GROUP, INT8_FORMAT, convrot_group_ok
from .safetensors_file import CheckpointError, TensorInfo

# key prefixes a transformer may sit under in the files ComfyUI users have
PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.", "transformer.")


@dataclass
class CheckpointInfo:
    family: str                 # a family name (engine/families): "flux", "sd3", ...
    variant: str                # e.g. flux-dev, flux-schnell, sd3-medium, sd3.5-medium, sd3.5-large
    layout: str                 # the file's key layout: e.g. "bfl", "sai", "diffusers"
    prefix: str                 # stripped from every transformer key
    config: dict                # diffusers transformer config
    keys: list[str] = field(default_factory=list)  # transformer keys, prefix stripped
    ignored: int = 0            # other tensors in the file (text encoders, VAE)
    parameters: int = 0         # the transformer's parameter count (what the planner's memory model weighs)
    block_parameters: int = 0   # of which in the transformer blocks
    unit_parameters: tuple = ()  # of which in each of the family's shard_units (gathered alone under divided weights)
    stored_fp8: bool = False    # the file stores matrices in fp8 or GGUF blocks (<= ~1 byte a weight), which stay so
    format: str = "safetensors"  # "safetensors" | "fp8_scaled" (ComfyUI's per-layer scale_weight) | "fp8_mixed"
    #                              (ComfyUI's mixed precision: weight_scale on the layers its metadata lists) |
    #                              "int8_mixed" (the same, with int8_tensorwise layers, ConvRot or not) | "gguf"
    quantization: str = ""      # GGUF: the transformer's tensor types with counts, e.g. "Q4_K x 120, F32 x 300";
    #                             int8_mixed: its int8 layers and their ConvRot groups, e.g. "int8_tensorwise x 28 ..."
    quantized_parameters: int = 0   # parameters stored in fp8, int8 or GGUF blocks (held so in memory)
    quantized_bytes: int = 0        # the bytes they take in the file (and in memory)
    layer_quant: dict = field(default_factory=dict)   # mixed precision: {layer (prefix stripped): its config} from
    #                                                   the header's _quantization_metadata (comfy_quant: read at load)

    @property
    def spec(self) -> Family:
        """The family module's declarations for this checkpoint."""
        return families.get(self.family)

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def layers(self) -> int:
        return self.spec.layers(self.config)

    @property
    def latent(self):
        """The latent format of this file (engine/sampling/latent_formats.py)."""
        return self.spec.latent_format(self.config)

    @property
    def latent_patch(self) -> int:
        """Latent pixels per token side."""
        return self.spec.latent_patch(self.config)


def count_parameters(family: Family, layout: str, config: dict,
                     shapes: dict[str, tuple]) -> tuple[int, int, tuple[int, ...]]:
    """(all, in the transformer blocks, in each of the family's shard_units) parameters of a transformer's tensors,
    `shapes` in the file's `layout`: a tensor is in the blocks (a unit) when what it becomes in diffusers' names is."""
    mapping = family.key_map(layout, config)
    diffusers_name = {src: dst for dst, src, _ in mapping} if mapping else {}
    blocks = tuple(f"{name}." for name in family.tokens.blocks)
    sizes = [(diffusers_name.get(k, k), math.prod(shape)) for k, shape in shapes.items()]
    return (sum(n for _, n in sizes), sum(n for k, n in sizes if k.startswith(blocks)),
            tuple(sum(n for k, n in sizes if k.startswith(f"{unit}.")) for unit in family.shard_units))


def _recognise(tensors: dict) -> tuple[Family, str, str] | None:
    """(family, layout, prefix) of the first family marker the file holds under one of PREFIXES."""
    for family in families.FAMILIES:
        for marker in family.markers:
            for p in PREFIXES:
                if p + marker.key in tensors and not any(p + a in tensors for a in marker.absent):
                    return family, marker.layout, p
    return None


def supported() -> str:
    """The families and variants the engine runs, in words."""
    return "; ".join(f"{f.title} ({', '.join(f.variants)})" for f in families.FAMILIES)


def _unsupported(names: list[str]) -> str:
    keys = " ".join(names[:2000])
    if "input_blocks." in keys and "label_emb." in keys:
        return "an SDXL UNet"
    if "input_blocks." in keys:
        return "an SD1.x/SD2.x UNet"
    if "down_blocks." in keys and "resnets." in keys:
        return "a diffusers UNet"
    if "double_layers." in keys:
        return "an AuraFlow transformer"
    if "encoder.down." in keys or "decoder.up." in keys:
        return "a VAE"
    if "text_model.encoder." in keys or "encoder.block." in keys:
        return "a text encoder"
    if "blocks.0.cross_attn" in keys:
        return "a video/other DiT"
    return "an unknown model"


def detect(path: str, tensors: dict[str, TensorInfo], metadata: dict, stated: dict | None = None) -> CheckpointInfo:
    """Identify a transformer of one of the engine's families in any layout it reads, or say what the file is instead.

    `stated`: a diffusers folder's config.json, which decides what shapes cannot (e.g. FLUX's RoPE axes)."""
    found = _recognise(tensors)
    if found is None:
        names = sorted(tensors)
        raise CheckpointError(
            f"{path}: this looks like {_unsupported(names)}, not a transformer the engine runs "
            f"(first keys: {', '.join(names[:3])}); supported: {supported()}, as single-file checkpoints "
            f"(safetensors, fp8_scaled or GGUF) or diffusers-format transformers")
    family, layout, prefix = found
    arch = metadata.get("gguf.architecture")
    if arch and arch not in family.gguf_arches:
        raise CheckpointError(f"{path}: its GGUF architecture is {arch!r} but its tensors are a {family.name} "
                              f"transformer ({layout} layout); the file is mislabelled or damaged")
    scaled_format, layer_quant = _scaled_format(path, tensors, metadata, prefix)
    int8_groups = _check_int8(path, tensors, prefix, layer_quant)
    scaled = {k for k in tensors if k.startswith(prefix) and is_scale_key(k[len(prefix):], scaled_format)}
    keys = [k[len(prefix):] for k in tensors if k.startswith(prefix) and k not in scaled]
    shapes = {k[len(prefix):]: v.shape for k, v in tensors.items() if k.startswith(prefix) and k not in scaled}
    what = f"a {family.name} transformer ({layout} layout)"
    try:
        config, variant = family.infer(layout, shapes, {**metadata, "stated": stated or {}})
    except KeyError as e:
        raise CheckpointError(f"{path}: {what} missing key {e.args[0]!r}; the file is incomplete or an unsupported "
                              f"variant") from None
    except CheckpointError as e:   # the config's own checks: say which file
        raise CheckpointError(f"{path}: {e}") from None
    except (IndexError, TypeError, ValueError, ZeroDivisionError) as e:   # a tensor of the wrong rank or size 0
        raise CheckpointError(f"{path}: {what} whose tensor shapes make no model ({type(e).__name__}: {e}); the file "
                              f"is damaged or an unsupported variant") from None
    bad = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v < 1
           and k not in ("patch_size",)} if isinstance(config, dict) else {}
    if bad or config.get("patch_size", 1) < 1:
        raise CheckpointError(f"{path}: {what} whose tensor shapes give "
                              f"{bad or {'patch_size': config.get('patch_size')}}; the file is damaged")
    parameters, in_blocks, in_units = count_parameters(family, layout, config, shapes)
    dtypes = [tensors[prefix + k].dtype for k in keys]
    fp8 = any(d.startswith("F8") for d in dtypes)
    gguf = "gguf.architecture" in metadata
    quantization = ""
    if gguf:
        counts = {d: dtypes.count(d) for d in sorted(set(dtypes))}
        quantization = ", ".join(f"{d} x {n}" for d, n in counts.items())
        fp8 = any(d not in ("F32", "F16", "BF16") for d in dtypes)
    fmt = "gguf" if gguf else scaled_format or "safetensors"
    if int8_groups:   # held int8 in memory (Int8Linear), counted in quantized_parameters
        rotated = {}
        for group in int8_groups.values():
            rotated[group] = rotated.get(group, 0) + 1
        rotated.pop(None, None)
        others = [d for k, d in zip(keys, dtypes) if k not in int8_groups]
        quantization = ", ".join(
            [f"{INT8_FORMAT} x {len(int8_groups)}" + (" (ConvRot groups of " + ", ".join(
                f"{g} x {n}" for g, n in sorted(rotated.items())) + ")" if rotated else "")]
            + [f"{d} x {others.count(d)}" for d in sorted(set(others))])
    quantized = [tensors[prefix + k] for k in keys if tensors[prefix + k].dtype.startswith("F8")
                 or tensors[prefix + k].dtype == "I8" or (gguf and tensors[prefix + k].dtype not in ("F32", "F16", "BF16"))]
    return CheckpointInfo(family.name, variant, layout, prefix, config, keys,
                          ignored=len(tensors) - len(keys) - len(scaled), parameters=parameters,
                          block_parameters=in_blocks, unit_parameters=in_units, stored_fp8=fp8, format=fmt, quantization=quantization,
                          quantized_parameters=sum(math.prod(t.shape) for t in quantized),
                          quantized_bytes=sum(t.end - t.begin for t in quantized), layer_quant=layer_quant)


# ComfyUI's scaled formats: each layer's tensors besides its weight (the weight's scale first). "fp8_scaled" is the
# legacy one (a `scaled_fp8` marker tensor; comfy/utils.py convert_old_quants turns it into the other); "fp8_mixed" is
# its mixed-precision format (comfy/ops.py MixedPrecisionOps: the layers in the header's `_quantization_metadata`,
# or with a `comfy_quant` tensor, hold a quantized weight and its weight_scale; the others are plain), "int8_mixed" the
# same with int8_tensorwise layers (an int8 weight, a float32 weight_scale, ConvRot or not; Comfy-Org's MiniMax-H3).
SCALE_KEYS = {"fp8_scaled": (".scale_weight", ".scale_input"),
              "fp8_mixed": (".weight_scale", ".input_scale", ".comfy_quant"),
              "int8_mixed": (".weight_scale", ".input_scale", ".comfy_quant")}
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")   # the mixed-precision layer formats the engine loads
MIXED_FORMATS = FP8_FORMATS + (INT8_FORMAT,)
LOADED_FORMATS = ", ".join(MIXED_FORMATS[:-1]) + " or " + MIXED_FORMATS[-1]


def _scaled_format(path: str, tensors: dict, metadata: dict, prefix: str) -> tuple[str, dict]:
    """("fp8_scaled" | "fp8_mixed" | "int8_mixed" | "" (none: scale tensors are then unexpected keys, as in ComfyUI),
    the header's layer configs {layer, prefix stripped: config})."""
    if prefix + "scaled_fp8" in tensors:
        return "fp8_scaled", {}
    if "_quantization_metadata" not in metadata and not any(k.endswith(".comfy_quant") for k in tensors):
        return "", {}
    layers = {}
    if "_quantization_metadata" in metadata:
        try:
            listed = json.loads(metadata["_quantization_metadata"])["layers"]
            formats = {name: conf.get("format") for name, conf in listed.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: its _quantization_metadata is not ComfyUI's {{\"layers\": {{layer: "
                                  f"{{\"format\": ...}}}}}}: the file is damaged") from None
        other = {name: f for name, f in formats.items() if f not in MIXED_FORMATS}
        if other:
            name, f = next(iter(sorted(other.items())))
            raise CheckpointError(f"{path}: layer {name} is quantized as {f!r}; the engine loads ComfyUI's "
                                  f"mixed-precision layers in {LOADED_FORMATS}: use an fp8 or int8 release")
        # the names are the file's keys (a full checkpoint's with its prefix); ComfyUI's diffusion-model loader also
        # finds them without it
        layers = {name[len(prefix):] if prefix and name.startswith(prefix) else name: conf
                  for name, conf in listed.items()}
    for k, t in tensors.items():   # per-layer comfy_quant tensors: the scale is known only for fp8 and int8 weights
        if k.endswith((".weight_scale", ".weight_scale_2")):
            layer = k.rsplit(".", 1)[0]
            weight = tensors.get(layer + ".weight")
            listed = layers.get(layer[len(prefix):] if prefix and layer.startswith(prefix) else layer, {})
            if listed.get("format") == INT8_FORMAT and not k.endswith("_2"):
                continue   # its weight's dtype is checked against its format by _check_int8
            if k.endswith("_2") or (weight is not None and not weight.dtype.startswith("F8") and weight.dtype != "I8"):
                stored = "a second weight scale: nvfp4" if k.endswith("_2") else weight.dtype
                raise CheckpointError(f"{path}: layer {k.rsplit('.', 1)[0]} is quantized in a format other than "
                                      f"fp8 or int8 ({stored}); the engine loads ComfyUI's mixed-precision layers in "
                                      f"{LOADED_FORMATS}: use an fp8 or int8 release")
    int8 = any(conf.get("format") == INT8_FORMAT for conf in layers.values()) or any(
        t.dtype == "I8" and k.endswith(".weight") and k[:-len("weight")] + "weight_scale" in tensors
        for k, t in tensors.items())
    return ("int8_mixed" if int8 else "fp8_mixed"), layers


def int8_group(path: str, layer: str, conf: dict, shape: tuple) -> int | None:
    """An int8_tensorwise layer's ConvRot group size (None: not rotated), read as comfy/ops.py reads the layer's
    config: `convrot` and `convrot_groupsize` (default 256) at its top level or under "params". A size the rotation
    has no matrix for, or one that does not divide the layer's input width, is said in one line."""
    params = conf.get("params", {})
    params = params if isinstance(params, dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    given = conf.get("convrot_groupsize", params.get("convrot_groupsize", CONVROT_GROUP))
    try:
        group = int(given)
    except (TypeError, ValueError):
        group = given
    if not convrot_group_ok(group):
        raise CheckpointError(f"{path}: layer {layer} is ConvRot-rotated in groups of {given!r}; the rotation's "
                              f"regular Hadamard matrix has a power of 4 rows (4, 16, 64, 256, ...): the file is "
                              f"damaged")
    if len(shape) != 2 or shape[1] % group:
        raise CheckpointError(f"{path}: layer {layer} is ConvRot-rotated in groups of {group}, which do not divide "
                              f"its {shape[-1] if shape else 0} inputs (weight shape {list(shape)}); the file is "
                              f"damaged")
    return group


def _check_int8(path: str, tensors: dict, prefix: str, layers: dict) -> dict[str, int | None]:
    """{transformer key of each int8 weight: its ConvRot group (None: not rotated, or given in the layer's comfy_quant
    tensor, read at load)}, after checking from the header what can be: an int8 tensor is a layer's weight matrix with
    a weight_scale and a config naming it int8_tensorwise (ComfyUI would read the bare integers as the weights), and a
    layer the header calls int8_tensorwise stores its weight in int8."""
    found = {}
    for k, t in tensors.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        layer = name[:-len(".weight")]
        conf = layers.get(layer)
        if t.dtype != "I8":
            if name.endswith(".weight") and conf is not None and conf.get("format") == INT8_FORMAT:
                raise CheckpointError(f"{path}: layer {layer} is {INT8_FORMAT} but its weight is stored as "
                                      f"{t.dtype}, not int8; the file is damaged")
            continue
        if not name.endswith(".weight") or len(t.shape) != 2:
            raise CheckpointError(f"{path}: tensor {name} is int8 (shape {list(t.shape)}) but not a layer's weight "
                                  f"matrix; ComfyUI's {INT8_FORMAT} quantizes Linear weights only: the file is "
                                  f"damaged or not one ComfyUI reads")
        listed = conf is not None or prefix + layer + ".comfy_quant" in tensors
        if not listed:
            raise CheckpointError(f"{path}: layer {layer} stores its weight as int8 but neither the header's "
                                  f"_quantization_metadata nor a comfy_quant tensor gives its format; ComfyUI would "
                                  f"read the integers as the weights: the file is damaged or not one ComfyUI reads")
        if conf is not None and conf.get("format") != INT8_FORMAT:
            raise CheckpointError(f"{path}: layer {layer} is {conf.get('format')} but its weight is stored as int8; "
                                  f"the file is damaged")
        if prefix + layer + ".weight_scale" not in tensors:
            raise CheckpointError(f"{path}: layer {layer} is {INT8_FORMAT} but has no weight_scale; the file is "
                                  f"damaged or incomplete")
        found[name] = int8_group(path, layer, conf, t.shape) if conf is not None else None
    return found


def is_scale_key(key: str, scaled_format: str = "fp8_scaled") -> bool:
    """A scaled fp8 format's tensor besides the weights: fp8_scaled's `scaled_fp8` marker, a layer's scales (and
    fp8_mixed's per-layer comfy_quant)."""
    if not scaled_format:
        return False
    return key == "scaled_fp8" or key.endswith(SCALE_KEYS[scaled_format])
