"""What a checkpoint holds, from its header alone: model family, key layout, key prefix, and the transformer
config inferred from tensor shapes (nothing is fetched from a hub)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from .safetensors_file import CheckpointError, TensorInfo

# key prefixes a transformer may sit under in the files ComfyUI users have
PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.", "transformer.")
FLUX_HEAD_DIM_AXES = {128: (16, 56, 56)}  # FLUX.1's RoPE split of its 128-wide heads


@dataclass
class CheckpointInfo:
    family: str                 # "flux" | "sd3"
    variant: str                # flux-dev, flux-schnell, sd3-medium, sd3.5-medium, sd3.5-large
    layout: str                 # "bfl" | "sai" | "diffusers"
    prefix: str                 # stripped from every transformer key
    config: dict                # diffusers transformer config
    keys: list[str] = field(default_factory=list)  # transformer keys, prefix stripped
    ignored: int = 0            # other tensors in the file (text encoders, VAE)
    parameters: int = 0         # the transformer's parameter count (what the planner's memory model weighs)
    block_parameters: int = 0   # of which in the transformer blocks
    stored_fp8: bool = False    # the file stores matrices in fp8 or GGUF blocks (<= ~1 byte a weight), which stay so
    format: str = "safetensors"  # "safetensors" | "fp8_scaled" (ComfyUI's per-layer scale_weight) | "gguf"
    quantization: str = ""      # GGUF: the transformer's tensor types with counts, e.g. "Q4_K x 120, F32 x 300"

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def layers(self) -> int:
        return self.config["num_layers"] + self.config.get("num_single_layers", 0)

    @property
    def latent_patch(self) -> int:
        """Latent pixels per token side: FLUX packs 2x2 latent patches, SD3 patchifies by its patch_size."""
        return 2 if self.family == "flux" else self.config["patch_size"]


BLOCK_PREFIXES = ("double_blocks.", "single_blocks.", "joint_blocks.", "transformer_blocks.",
                  "single_transformer_blocks.")


def count_parameters(shapes: dict[str, tuple]) -> tuple[int, int]:
    """(all, in the transformer blocks) parameters of a transformer's tensors."""
    sizes = {k: math.prod(shape) for k, shape in shapes.items()}
    return sum(sizes.values()), sum(n for k, n in sizes.items() if k.startswith(BLOCK_PREFIXES))


def _count(keys, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in keys if (m := rx.match(k))})


def _find_prefix(tensors: dict, marker: str) -> str | None:
    for p in PREFIXES:
        if p + marker in tensors:
            return p
    return None


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
    """Identify a FLUX.1 or SD3/SD3.5 transformer in any supported layout, or say what the file is instead.

    `stated`: a diffusers folder's config.json, which decides what shapes cannot (FLUX's RoPE axes)."""
    for marker, layout, family in (("double_blocks.0.img_attn.qkv.weight", "bfl", "flux"),
                                   ("joint_blocks.0.x_block.attn.qkv.weight", "sai", "sd3"),
                                   ("single_transformer_blocks.0.attn.to_q.weight", "diffusers", "flux"),
                                   ("pos_embed.proj.weight", "diffusers", "sd3")):
        prefix = _find_prefix(tensors, marker)
        if prefix is not None:
            break
    else:
        names = sorted(tensors)
        raise CheckpointError(
            f"{path}: this looks like {_unsupported(names)}, not a FLUX.1 or SD3/SD3.5 transformer "
            f"(first keys: {', '.join(names[:3])}); supported: FLUX.1 dev/schnell and SD3-medium, SD3.5 "
            f"medium/large, as single-file checkpoints (safetensors, fp8_scaled or GGUF) or diffusers-format "
            f"transformers")
    arch = metadata.get("gguf.architecture")
    if arch and arch != family:
        raise CheckpointError(f"{path}: its GGUF architecture is {arch!r} but its tensors are a {family} transformer "
                              f"({layout} layout); the file is mislabelled or damaged")
    # as in ComfyUI, the marker makes a file fp8_scaled: without it, scale tensors are unexpected keys
    scaled = {k for k in tensors if k.startswith(prefix) and is_scale_key(k[len(prefix):])} \
        if prefix + "scaled_fp8" in tensors else set()
    keys = [k[len(prefix):] for k in tensors if k.startswith(prefix) and k not in scaled]
    shapes = {k[len(prefix):]: v.shape for k, v in tensors.items() if k.startswith(prefix) and k not in scaled}
    infer = {("bfl", "flux"): _flux_bfl, ("sai", "sd3"): _sd3_sai,
             ("diffusers", "flux"): _flux_diffusers, ("diffusers", "sd3"): _sd3_diffusers}[(layout, family)]
    try:
        config, variant = infer(shapes, {**metadata, "stated": stated or {}})
    except KeyError as e:
        raise CheckpointError(f"{path}: a {family} transformer ({layout} layout) missing key {e.args[0]!r}; "
                              f"the file is incomplete or an unsupported variant") from None
    except CheckpointError as e:   # the config's own checks: say which file
        raise CheckpointError(f"{path}: {e}") from None
    except (IndexError, TypeError, ValueError, ZeroDivisionError) as e:   # a tensor of the wrong rank or size 0
        raise CheckpointError(f"{path}: a {family} transformer ({layout} layout) whose tensor shapes make no "
                              f"model ({type(e).__name__}: {e}); the file is damaged or an unsupported variant") from None
    bad = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v < 1
           and k not in ("patch_size",)} if isinstance(config, dict) else {}
    if bad or config.get("patch_size", 1) < 1:
        raise CheckpointError(f"{path}: a {family} transformer ({layout} layout) whose tensor shapes give "
                              f"{bad or {'patch_size': config.get('patch_size')}}; the file is damaged")
    parameters, in_blocks = count_parameters(shapes)
    dtypes = [tensors[prefix + k].dtype for k in keys]
    fp8 = any(d.startswith("F8") for d in dtypes)
    gguf = "gguf.architecture" in metadata
    quantization = ""
    if gguf:
        counts = {d: dtypes.count(d) for d in sorted(set(dtypes))}
        quantization = ", ".join(f"{d} x {n}" for d, n in counts.items())
        fp8 = any(d not in ("F32", "F16", "BF16") for d in dtypes)
    fmt = "gguf" if gguf else "fp8_scaled" if scaled else "safetensors"
    return CheckpointInfo(family, variant, layout, prefix, config, keys, ignored=len(tensors) - len(keys) - len(scaled),
                          parameters=parameters, block_parameters=in_blocks, stored_fp8=fp8, format=fmt,
                          quantization=quantization)


def is_scale_key(key: str) -> bool:
    """ComfyUI's fp8_scaled tensors: the `scaled_fp8` marker and each layer's scale_weight / scale_input."""
    return key == "scaled_fp8" or key.endswith((".scale_weight", ".scale_input"))


def _rope_axes(head_dim: int, metadata: dict) -> tuple:
    stated = metadata.get("stated", {}).get("axes_dims_rope")
    if stated and sum(stated) == head_dim:
        return tuple(stated)
    if head_dim in FLUX_HEAD_DIM_AXES:
        return FLUX_HEAD_DIM_AXES[head_dim]
    synthetic = metadata.get("xdit.synthetic")
    if synthetic:  # our tiny test models carry their RoPE split; real FLUX always has 128-wide heads
        return tuple(json.loads(synthetic)["dims"]["axes_dim"])
    raise CheckpointError(f"FLUX transformer with {head_dim}-wide heads: its RoPE axes cannot be inferred "
                          f"(FLUX.1 has 128-wide heads)")


def _flux_config(hidden, in_channels, head_dim, depth, single, context_in, vec_in, guidance, metadata):
    if hidden % head_dim:
        raise CheckpointError(f"FLUX width {hidden} is not a multiple of its head width {head_dim}")
    if in_channels != 64:
        raise CheckpointError(f"FLUX transformer with {in_channels} input channels (FLUX.1 Fill/Depth/Canny "
                              f"variants); only text-to-image FLUX.1 dev/schnell (64 channels) is supported")
    config = {"patch_size": 1, "in_channels": in_channels, "num_layers": depth, "num_single_layers": single,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": context_in, "pooled_projection_dim": vec_in, "guidance_embeds": guidance,
              "axes_dims_rope": _rope_axes(head_dim, metadata)}
    return config, "flux-dev" if guidance else "flux-schnell"


def _flux_bfl(s, metadata):
    return _flux_config(s["img_in.weight"][0], s["img_in.weight"][1], s["double_blocks.0.img_attn.norm.query_norm.scale"][0],
                        _count(s, r"double_blocks\.(\d+)\."), _count(s, r"single_blocks\.(\d+)\."),
                        s["txt_in.weight"][1], s["vector_in.in_layer.weight"][1], "guidance_in.in_layer.weight" in s,
                        metadata)


def _flux_diffusers(s, metadata):
    return _flux_config(s["x_embedder.weight"][0], s["x_embedder.weight"][1], s["transformer_blocks.0.attn.norm_q.weight"][0],
                        _count(s, r"transformer_blocks\.(\d+)\."), _count(s, r"single_transformer_blocks\.(\d+)\."),
                        s["context_embedder.weight"][1], s["time_text_embed.text_embedder.linear_1.weight"][1],
                        "time_text_embed.guidance_embedder.linear_1.weight" in s, metadata)


def _sd3_config(hidden, in_channels, patch, depth, pos_len, context_in, pooled_in, out_features, head_dim, dual):
    # SAI convention: 64-wide heads; SD3.5 files carry qk-norm weights that state the width outright
    head_dim = head_dim or 64
    size = int(round(pos_len ** 0.5))
    if size * size != pos_len:
        raise CheckpointError(f"SD3 pos_embed has {pos_len} positions, not a square grid")
    config = {"sample_size": 128, "patch_size": patch, "in_channels": in_channels, "num_layers": depth,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": context_in, "caption_projection_dim": hidden, "pooled_projection_dim": pooled_in,
              "out_channels": out_features // (patch * patch), "pos_embed_max_size": size,
              "dual_attention_layers": tuple(dual), "qk_norm": None}
    return config


def _sd3_variant(config) -> str:
    if config["dual_attention_layers"]:
        return "sd3.5-medium"
    return "sd3.5-large" if config["qk_norm"] else "sd3-medium"


def _sd3_sai(s, metadata):
    qk = s.get("joint_blocks.0.x_block.attn.ln_q.weight")
    depth = _count(s, r"joint_blocks\.(\d+)\.")
    dual = sorted(int(m.group(1)) for k in s if (m := re.match(r"joint_blocks\.(\d+)\.x_block\.attn2\.qkv\.weight", k)))
    w = s["x_embedder.proj.weight"]
    config = _sd3_config(w[0], w[1], w[2], depth, s["pos_embed"][1], s["context_embedder.weight"][1],
                         s["y_embedder.mlp.0.weight"][1], s["final_layer.linear.weight"][0], qk[0] if qk else None, dual)
    config["qk_norm"] = "rms_norm" if qk else None
    return config, _sd3_variant(config)


def _sd3_diffusers(s, metadata):
    qk = s.get("transformer_blocks.0.attn.norm_q.weight")
    depth = _count(s, r"transformer_blocks\.(\d+)\.")
    dual = sorted(int(m.group(1)) for k in s if (m := re.match(r"transformer_blocks\.(\d+)\.attn2\.to_q\.weight", k)))
    w = s["pos_embed.proj.weight"]
    config = _sd3_config(w[0], w[1], w[2], depth, s["pos_embed.pos_embed"][1], s["context_embedder.weight"][1],
                         s["time_text_embed.text_embedder.linear_1.weight"][1], s["proj_out.weight"][0],
                         qk[0] if qk else None, dual)
    config["qk_norm"] = "rms_norm" if qk else None
    return config, _sd3_variant(config)
