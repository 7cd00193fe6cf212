"""HunyuanVideo 1.5's checkpoints: the dimensions of the model, the tensors of the layouts ComfyUI reads (its own
module names, `double_blocks.N.img_attn.qkv`, as its model holds them and Comfy-Org's files carry them; and the
HunyuanVideo names its load renames first, `img_attn_qkv`, `img_mod.linear`, `mlp.fc1`), the diffusers config
detected from a file's shapes as ComfyUI's model_detection reads them, and the key map into the diffusers
HunyuanVideo15Transformer3DModel (diffusers 0.42.1 has no single-file converter for it). The family's behaviour is in
hunyuanvideo15.py."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError
from .base import count, linear, linear_shapes

HEAD_DIM = 128            # comfy/model_detection.py: num_heads = hidden // 128
AXES = (16, 56, 56)       # model_detection: axes_dim for 3-D patches, fixed
THETA = 256.0             # model_detection: theta 256
REFINER_BLOCKS = 2        # comfy/ldm/hunyuan_video/model.py: TokenRefiner(..., 2): two refiner blocks, fixed
MLP_RATIO = 4.0           # model_detection: mlp_ratio 4.0
TIME_DIM = 256            # MLPEmbedder(in_dim=256)
BYT5_DIM, BYT5_HIDDEN = 1472, 2048   # ByT5Mapper(in_dim=1472, out_dim=2048, hidden_dim=2048), fixed
VISION_DIM = 1152         # supported_models.HunyuanVideo15: unet_config vision_in_dim 1152 (SigLIP's width)
COND_TYPES = 3            # cond_type_embedding: 0 text, 1 byT5, 2 vision


@dataclass(frozen=True)
class HunyuanVideo15Dims:
    hidden: int = 2048
    depth: int = 54
    channels: int = 32          # the latent's (HunyuanVideo15 latent format); the input is 2 x 32 + 1
    text_dim: int = 3584        # Qwen2.5-VL 7B's hidden width

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM


DIMS = {
    "full": {"hunyuanvideo-1.5": HunyuanVideo15Dims()},
    # ComfyUI's detection fixes 128-wide heads, the byT5 mapper's widths and the SigLIP width its model class asks for:
    # the tiny file has two whole heads, two blocks and a narrow text, those fixed widths as they are
    "tiny": {"hunyuanvideo-1.5": HunyuanVideo15Dims(hidden=256, depth=2, text_dim=64)},
    "small": {"hunyuanvideo-1.5": HunyuanVideo15Dims(hidden=512, depth=8, text_dim=256)},
}


def _stream(s: dict, name: str, h: int) -> None:
    """One stream of a double block (img_ or txt_), ComfyUI's names."""
    mlp = int(h * MLP_RATIO)
    linear_shapes(s, f"{name}_mod.lin", 6 * h, h)
    linear_shapes(s, f"{name}_attn.qkv", 3 * h, h)
    s[f"{name}_attn.norm.query_norm.weight"] = (HEAD_DIM,)
    s[f"{name}_attn.norm.key_norm.weight"] = (HEAD_DIM,)
    linear_shapes(s, f"{name}_attn.proj", h, h)
    linear_shapes(s, f"{name}_mlp.0", mlp, h)
    linear_shapes(s, f"{name}_mlp.2", h, mlp)


def shapes(d: HunyuanVideo15Dims) -> dict[str, tuple]:
    """Every tensor of a HunyuanVideo 1.5 transformer as ComfyUI's model holds it (comfy/ldm/hunyuan_video/model.py's
    module names), with its shape."""
    h, s = d.hidden, {}
    mlp = int(h * MLP_RATIO)
    s["img_in.proj.weight"] = (h, 2 * d.channels + 1, 1, 1, 1)
    s["img_in.proj.bias"] = (h,)
    linear_shapes(s, "time_in.in_layer", h, TIME_DIM)
    linear_shapes(s, "time_in.out_layer", h, h)
    linear_shapes(s, "txt_in.input_embedder", h, d.text_dim)
    linear_shapes(s, "txt_in.t_embedder.in_layer", h, TIME_DIM)
    linear_shapes(s, "txt_in.t_embedder.out_layer", h, h)
    linear_shapes(s, "txt_in.c_embedder.in_layer", h, d.text_dim)
    linear_shapes(s, "txt_in.c_embedder.out_layer", h, h)
    for i in range(REFINER_BLOCKS):
        b = f"txt_in.individual_token_refiner.blocks.{i}"
        linear_shapes(s, f"{b}.adaLN_modulation.1", 2 * h, h)
        s[f"{b}.norm1.weight"] = s[f"{b}.norm1.bias"] = (h,)
        linear_shapes(s, f"{b}.self_attn.qkv", 3 * h, h)
        linear_shapes(s, f"{b}.self_attn.proj", h, h)
        s[f"{b}.norm2.weight"] = s[f"{b}.norm2.bias"] = (h,)
        linear_shapes(s, f"{b}.mlp.0", mlp, h)
        linear_shapes(s, f"{b}.mlp.2", h, mlp)
    for i in range(d.depth):
        _stream(s, f"double_blocks.{i}.img", h)
        _stream(s, f"double_blocks.{i}.txt", h)
    s["byt5_in.layernorm.weight"] = s["byt5_in.layernorm.bias"] = (BYT5_DIM,)
    linear_shapes(s, "byt5_in.fc1", BYT5_HIDDEN, BYT5_DIM)
    linear_shapes(s, "byt5_in.fc2", BYT5_HIDDEN, BYT5_HIDDEN)
    linear_shapes(s, "byt5_in.fc3", h, BYT5_HIDDEN)
    s["vision_in.proj.0.weight"] = s["vision_in.proj.0.bias"] = (VISION_DIM,)
    linear_shapes(s, "vision_in.proj.1", VISION_DIM, VISION_DIM)
    linear_shapes(s, "vision_in.proj.3", h, VISION_DIM)
    s["vision_in.proj.4.weight"] = s["vision_in.proj.4.bias"] = (h,)
    s["cond_type_embedding.weight"] = (COND_TYPES, h)
    linear_shapes(s, "final_layer.linear", d.channels, h)
    linear_shapes(s, "final_layer.adaLN_modulation.1", 2 * h, h)
    return s


# ---- the HunyuanVideo names ComfyUI renames as it loads (supported_models.HunyuanVideo.process_unet_state_dict) -----
# (ComfyUI's name, the file's): the same replacements restated in the other direction, applied in order
_RENAMED = (("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."), ("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."),
            ("_attn.proj.", "_attn_proj."), ("_attn.norm.query_norm.weight", "_attn_q_norm.weight"),
            ("_attn.norm.key_norm.weight", "_attn_k_norm.weight"),
            ("txt_in.t_embedder.in_layer.", "txt_in.t_embedder.mlp.0."),
            ("txt_in.t_embedder.out_layer.", "txt_in.t_embedder.mlp.2."),
            ("txt_in.c_embedder.in_layer.", "txt_in.c_embedder.linear_1."),
            ("txt_in.c_embedder.out_layer.", "txt_in.c_embedder.linear_2."),
            ("time_in.in_layer.", "time_in.mlp.0."), ("time_in.out_layer.", "time_in.mlp.2."))


def hunyuan_name(comfy: str) -> str:
    """The name a HunyuanVideo-layout file gives the tensor ComfyUI's model calls `comfy`."""
    for ours, theirs in _RENAMED:
        comfy = comfy.replace(ours, theirs)
    return comfy


def comfy_name(key: str) -> str:
    """ComfyUI's name for a tensor of either layout: process_unet_state_dict's replacements, in its order."""
    for old, new in (("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
                     ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
                     ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
                     ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
                     ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."),
                     ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
                     ("_attn_q_norm.weight", "_attn.norm.query_norm.weight"),
                     ("_attn_k_norm.weight", "_attn.norm.key_norm.weight"),
                     (".q_norm.weight", ".norm.query_norm.weight"), (".k_norm.weight", ".norm.key_norm.weight"),
                     ("_attn_proj.", "_attn.proj."), (".modulation.linear.", ".modulation.lin."),
                     ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer.")):
        key = key.replace(old, new)
    return key[:-len(".scale")] + ".weight" if key.endswith(".scale") else key


# ---- detection: the diffusers config from the tensors' shapes, as ComfyUI's model_detection reads them -------------
def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    """What ComfyUI's detection reads (width and input channels from img_in, the patch from its kernel, output
    channels from final_layer, the text width from txt_in's input_embedder, blocks from double_blocks, the vision width
    from vision_in); what its HunyuanVideo15 class and diffusers' model fix (128-wide heads, no single-stream blocks,
    guidance, pooled vector or meanflow input, a byT5 mapper, a 1152-wide SigLIP projection, 2 x out + 1 input
    channels) a file that disagrees is refused for, in one line."""
    names = {k: comfy_name(k) for k in s} if layout == "hunyuan" else {k: k for k in s}
    c = {names[k]: v for k, v in s.items()}
    hidden, in_channels, *patch = c["img_in.proj.weight"]
    patch_t = patch[0] if len(patch) == 3 else 1
    if len(patch) != 3 or tuple(patch) != (1, 1, 1):
        raise CheckpointError(f"HunyuanVideo transformer with patches {list(patch)}: HunyuanVideo 1.5 has 1 x 1 x 1 "
                              f"patches (the 1.0 models and HunyuanImage are not run)")
    out_channels = c["final_layer.linear.weight"][0] // patch_t
    extra = [p for p in ("single_blocks.", "guidance_in.", "vector_in.", "time_r_in.")
             if any(k.startswith(p) for k in c)]
    if extra:
        raise CheckpointError(f"HunyuanVideo transformer with {', '.join(p.rstrip('.') for p in extra)}: not "
                              f"HunyuanVideo 1.5's text- and image-to-video model (its super-resolution and meanflow "
                              f"files, HunyuanVideo 1.0 and HunyuanImage are not run)")
    if hidden % HEAD_DIM or c["double_blocks.0.img_attn.norm.query_norm.weight"][0] != HEAD_DIM:
        raise CheckpointError(f"HunyuanVideo 1.5 transformer {hidden} wide: ComfyUI builds it with {HEAD_DIM}-wide "
                              f"heads only")
    if in_channels != 2 * out_channels + 1:
        raise CheckpointError(f"HunyuanVideo 1.5 transformer with {in_channels} input channels for a {out_channels}-"
                              f"channel latent: its text- and image-to-video model takes [noise | image latent | mask],"
                              f" {2 * out_channels + 1}")
    vision = c.get("vision_in.proj.0.weight", (None,))[0]
    if vision != VISION_DIM or "byt5_in.fc1.weight" not in c or "cond_type_embedding.weight" not in c:
        raise CheckpointError(f"HunyuanVideo transformer without a {VISION_DIM}-wide vision projection, a byT5 mapper "
                              f"and condition-type embeddings (vision width {vision}): not HunyuanVideo 1.5")
    refiner = count(c, r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.")
    if refiner != REFINER_BLOCKS:
        raise CheckpointError(f"HunyuanVideo 1.5 token refiner with {refiner} blocks: ComfyUI builds {REFINER_BLOCKS}")
    config = {"in_channels": in_channels, "out_channels": out_channels, "num_attention_heads": hidden // HEAD_DIM,
              "attention_head_dim": HEAD_DIM, "num_layers": count(c, r"double_blocks\.(\d+)\."),
              "num_refiner_layers": REFINER_BLOCKS, "mlp_ratio": c["double_blocks.0.img_mlp.0.weight"][0] / hidden,
              "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm", "text_embed_dim": c[
                  "txt_in.input_embedder.weight"][1], "text_embed_2_dim": c["byt5_in.fc1.weight"][1],
              "image_embed_dim": vision, "rope_theta": THETA, "rope_axes_dim": AXES}
    return config, "hunyuanvideo-1.5"


# ---- ComfyUI's names -> diffusers' ----------------------------------------------------------------------------------
def _comfy_map(config: dict) -> list:
    m: list = []
    h = config["num_attention_heads"] * config["attention_head_dim"]
    thirds = (h, h, h)
    m += [("x_embedder.proj.weight", "img_in.proj.weight", None), ("x_embedder.proj.bias", "img_in.proj.bias", None)]
    linear(m, "time_embed.timestep_embedder.linear_1", "time_in.in_layer")
    linear(m, "time_embed.timestep_embedder.linear_2", "time_in.out_layer")
    ce = "context_embedder"
    linear(m, f"{ce}.proj_in", "txt_in.input_embedder")
    linear(m, f"{ce}.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.in_layer")
    linear(m, f"{ce}.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.out_layer")
    linear(m, f"{ce}.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.in_layer")
    linear(m, f"{ce}.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.out_layer")
    for i in range(config["num_refiner_layers"]):
        d, s = f"{ce}.token_refiner.refiner_blocks.{i}", f"txt_in.individual_token_refiner.blocks.{i}"
        for norm in ("norm1", "norm2"):
            m += [(f"{d}.{norm}.weight", f"{s}.{norm}.weight", None), (f"{d}.{norm}.bias", f"{s}.{norm}.bias", None)]
        for j, proj in enumerate(("to_q", "to_k", "to_v")):
            linear(m, f"{d}.attn.{proj}", f"{s}.self_attn.qkv", ("chunk", j, thirds))
        linear(m, f"{d}.attn.to_out.0", f"{s}.self_attn.proj")
        linear(m, f"{d}.ff.net.0.proj", f"{s}.mlp.0")
        linear(m, f"{d}.ff.net.2", f"{s}.mlp.2")
        linear(m, f"{d}.norm_out.linear", f"{s}.adaLN_modulation.1")
    for i in range(config["num_layers"]):
        d, s = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, mod, qkv, norms, out, ff in (
                ("img", "norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
                ("txt", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
                 "to_add_out", "ff_context")):
            linear(m, f"{d}.{mod}.linear", f"{s}.{stream}_mod.lin")
            for j, proj in enumerate(qkv):
                linear(m, f"{d}.attn.{proj}", f"{s}.{stream}_attn.qkv", ("chunk", j, thirds))
            m.append((f"{d}.attn.{norms[0]}.weight", f"{s}.{stream}_attn.norm.query_norm.weight", None))
            m.append((f"{d}.attn.{norms[1]}.weight", f"{s}.{stream}_attn.norm.key_norm.weight", None))
            linear(m, f"{d}.attn.{out}", f"{s}.{stream}_attn.proj")
            linear(m, f"{d}.{ff}.net.0.proj", f"{s}.{stream}_mlp.0")
            linear(m, f"{d}.{ff}.net.2", f"{s}.{stream}_mlp.2")
    m += [("context_embedder_2.norm.weight", "byt5_in.layernorm.weight", None),
          ("context_embedder_2.norm.bias", "byt5_in.layernorm.bias", None)]
    for j in (1, 2, 3):
        linear(m, f"context_embedder_2.linear_{j}", f"byt5_in.fc{j}")
    for dst, src in (("norm_in", "0"), ("linear_1", "1"), ("linear_2", "3"), ("norm_out", "4")):
        linear(m, f"image_embedder.{dst}", f"vision_in.proj.{src}")
    m.append(("cond_type_embed.weight", "cond_type_embedding.weight", None))
    linear(m, "norm_out.linear", "final_layer.adaLN_modulation.1", "swap")   # (shift, scale) -> (scale, shift)
    linear(m, "proj_out", "final_layer.linear")
    return m


def key_map(layout: str, config: dict) -> list | None:
    """The file's keys (layout "comfy" or "hunyuan") -> diffusers' HunyuanVideo15Transformer3DModel keys: a fused qkv
    read as its three thirds, the final layer's (shift, scale) rows exchanged (diffusers' own conversion
    script, scripts/convert_hunyuan_video1_5_to_diffusers.py, pairs the same tensors)."""
    m = _comfy_map(config)
    if layout == "hunyuan":
        m = [(dst, hunyuan_name(src), op) for dst, src, op in m]
    return m
