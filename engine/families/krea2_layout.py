"""Krea 2's checkpoints: the dimensions of the model, the tensors of ComfyUI's layout (Comfy-Org's and Krea's files:
`first`, `blocks.N`, `txtfusion`, `last`), the diffusers config detected from a file's shapes as ComfyUI's
model_detection reads them, and the key map into the diffusers Krea2Transformer2DModel. The family's behaviour is in
krea2.py."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError
from .base import count, linear, linear_shapes

HEAD_DIM = 128        # comfy/model_detection.py: heads = wq rows // 128, whatever the file
TEXT_HEADS = 20       # comfy/ldm/krea2/model.py SingleStreamDiT(txtheads=20, txtkvheads=20): not read from the file
TEXT_BLOCKS = 2       # TextFusionTransformer: 2 layerwise and 2 refiner blocks, fixed
THETA = 1000.0        # SingleStreamDiT(theta=1e3)
TIME_DIM = 256        # SingleStreamDiT(tdim=256)
MULTIPLIER = 4        # SwiGLU(multiplier=4)


def axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (index, row, column) of a head, as SingleStreamDiT splits it: (32, 48, 48) for 128."""
    sixteenth = head_dim // 16
    return head_dim - 12 * sixteenth, 6 * sixteenth, 6 * sixteenth


def swiglu_width(features: int) -> int:
    """ComfyUI's SwiGLU hidden width: int(2 f / 3) x 4, rounded up to a multiple of 128 (16384 for 6144, 6912 for
    2560)."""
    width = int(2 * features / 3) * MULTIPLIER
    return 128 * ((width + 127) // 128)


@dataclass(frozen=True)
class Krea2Dims:
    hidden: int = 6144
    heads: int = 48
    kv_heads: int = 12
    depth: int = 28
    channels: int = 16         # the Wan 2.1 VAE's latent, packed 2x2 into 64 features a token
    text_dim: int = 2560       # Qwen3-VL 4B's hidden width
    text_layers: int = 12      # tapped layers of the text encoder (comfy/text_encoders/krea2.py KREA2_TAP_LAYERS)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


DIMS = {
    "full": {"krea-2": Krea2Dims()},
    # ComfyUI's detection fixes 128-wide heads and 20 text heads: a tiny file it accepts has whole 128-wide heads (two,
    # sharing one key/value head) and a text width of 20 x 4
    "tiny": {"krea-2": Krea2Dims(hidden=256, heads=2, kv_heads=1, depth=4, text_dim=80, text_layers=4)},
    "small": {"krea-2": Krea2Dims(hidden=512, heads=4, kv_heads=2, depth=8, text_dim=160, text_layers=12)},
}


def _attention(s: dict, name: str, width: int, kv_width: int, head_dim: int) -> None:
    for proj, rows in (("wq", width), ("wk", kv_width), ("wv", kv_width), ("gate", width), ("wo", width)):
        linear_shapes(s, f"{name}.attn.{proj}", rows, width, bias=False)
    s[f"{name}.attn.qknorm.qnorm.scale"] = (head_dim,)
    s[f"{name}.attn.qknorm.knorm.scale"] = (head_dim,)
    mlp = swiglu_width(width)
    linear_shapes(s, f"{name}.mlp.gate", mlp, width, bias=False)
    linear_shapes(s, f"{name}.mlp.up", mlp, width, bias=False)
    linear_shapes(s, f"{name}.mlp.down", width, mlp, bias=False)
    s[f"{name}.prenorm.scale"] = (width,)
    s[f"{name}.postnorm.scale"] = (width,)


def shapes(d: Krea2Dims) -> dict[str, tuple]:
    """Every tensor of a Krea 2 transformer in ComfyUI's layout (comfy/ldm/krea2/model.py's module names), with its
    shape."""
    h, s = d.hidden, {}
    linear_shapes(s, "first", h, 4 * d.channels)
    linear_shapes(s, "tmlp.0", h, TIME_DIM)
    linear_shapes(s, "tmlp.2", h, h)
    linear_shapes(s, "tproj.1", 6 * h, h)
    s["txtmlp.0.scale"] = (d.text_dim,)
    linear_shapes(s, "txtmlp.1", h, d.text_dim)
    linear_shapes(s, "txtmlp.3", h, h)
    text_head = d.text_dim // TEXT_HEADS
    for kind in ("layerwise_blocks", "refiner_blocks"):
        for i in range(TEXT_BLOCKS):
            _attention(s, f"txtfusion.{kind}.{i}", d.text_dim, d.text_dim, text_head)
    s["txtfusion.projector.weight"] = (1, d.text_layers)
    for i in range(d.depth):
        _attention(s, f"blocks.{i}", h, d.kv_heads * d.head_dim, d.head_dim)
        s[f"blocks.{i}.mod.lin"] = (6 * h,)
    s["last.norm.scale"] = (h,)
    linear_shapes(s, "last.linear", 4 * d.channels, h)
    s["last.modulation.lin"] = (2, h)
    return s


# ---- detection: the diffusers config from the tensors' shapes, as ComfyUI's model_detection reads them -------------
def _names(layout: str) -> dict[str, str]:
    """The tensors infer reads, in the file's layout."""
    if layout == "comfy":
        return {"first": "first.weight", "tmlp": "tmlp.0.weight", "q": "blocks.0.attn.wq.weight",
                "k": "blocks.0.attn.wk.weight", "qnorm": "blocks.0.attn.qknorm.qnorm.scale",
                "mlp": "blocks.0.mlp.gate.weight", "projector": "txtfusion.projector.weight",
                "text_norm": "txtfusion.layerwise_blocks.0.prenorm.scale",
                "text_k": "txtfusion.layerwise_blocks.0.attn.wk.weight",
                "text_qnorm": "txtfusion.layerwise_blocks.0.attn.qknorm.qnorm.scale",
                "text_mlp": "txtfusion.layerwise_blocks.0.mlp.gate.weight", "blocks": r"blocks\.(\d+)\.",
                "layerwise": r"txtfusion\.layerwise_blocks\.(\d+)\.", "refiner": r"txtfusion\.refiner_blocks\.(\d+)\."}
    return {"first": "img_in.weight", "tmlp": "time_embed.linear_1.weight",
            "q": "transformer_blocks.0.attn.to_q.weight", "k": "transformer_blocks.0.attn.to_k.weight",
            "qnorm": "transformer_blocks.0.attn.norm_q.weight",
            "mlp": "transformer_blocks.0.ff.gate.weight", "projector": "text_fusion.projector.weight",
            "text_norm": "text_fusion.layerwise_blocks.0.norm1.weight",
            "text_k": "text_fusion.layerwise_blocks.0.attn.to_k.weight",
            "text_qnorm": "text_fusion.layerwise_blocks.0.attn.norm_q.weight",
            "text_mlp": "text_fusion.layerwise_blocks.0.ff.gate.weight", "blocks": r"transformer_blocks\.(\d+)\.",
            "layerwise": r"text_fusion\.layerwise_blocks\.(\d+)\.", "refiner": r"text_fusion\.refiner_blocks\.(\d+)\."}


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    """What ComfyUI's detection reads (width and input channels from `first`, heads and key/value heads from the first
    block's wq and wk at 128 a head, text layers from the projector, the text width from the first layerwise
    block's norm); what it fixes (128-wide heads, 20 text heads, two layerwise and two refiner blocks) a file that
    disagrees is refused for, as ComfyUI could not build it."""
    n = _names(layout)
    hidden, in_channels = s[n["first"]]
    q_rows, k_rows = s[n["q"]][0], s[n["k"]][0]
    if s[n["qnorm"]][0] != HEAD_DIM or q_rows != hidden or q_rows % HEAD_DIM or k_rows % HEAD_DIM:
        raise CheckpointError(f"Krea 2 transformer with {s[n['qnorm']][0]}-wide heads ({q_rows} query and {k_rows} "
                              f"key rows for width {hidden}): ComfyUI builds Krea 2 with {HEAD_DIM}-wide heads only")
    text_dim, text_layers = s[n["text_norm"]][0], s[n["projector"]][1]
    text_head = text_dim // TEXT_HEADS
    if text_dim % TEXT_HEADS or s[n["text_qnorm"]][0] != text_head or s[n["text_k"]][0] != text_dim:
        raise CheckpointError(f"Krea 2 text fusion {text_dim} wide with {s[n['text_qnorm']][0]}-wide heads: ComfyUI "
                              f"builds it with {TEXT_HEADS} heads of width / {TEXT_HEADS}")
    blocks = {kind: count(s, n[kind]) for kind in ("layerwise", "refiner")}
    if blocks != {"layerwise": TEXT_BLOCKS, "refiner": TEXT_BLOCKS}:
        raise CheckpointError(f"Krea 2 text fusion with {blocks['layerwise']} layerwise and {blocks['refiner']} "
                              f"refiner blocks: ComfyUI builds {TEXT_BLOCKS} of each")
    if in_channels % 4:
        raise CheckpointError(f"Krea 2 transformer with {in_channels} input features: not 2x2 patches of a latent")
    config = {"in_channels": in_channels, "num_layers": count(s, n["blocks"]), "attention_head_dim": HEAD_DIM,
              "num_attention_heads": q_rows // HEAD_DIM, "num_key_value_heads": k_rows // HEAD_DIM,
              "intermediate_size": s[n["mlp"]][0], "timestep_embed_dim": s[n["tmlp"]][1],
              "text_hidden_dim": text_dim, "num_text_layers": text_layers, "text_num_attention_heads": TEXT_HEADS,
              "text_num_key_value_heads": TEXT_HEADS, "text_intermediate_size": s[n["text_mlp"]][0],
              "num_layerwise_text_blocks": TEXT_BLOCKS, "num_refiner_text_blocks": TEXT_BLOCKS,
              "axes_dims_rope": axes(HEAD_DIM), "rope_theta": THETA, "norm_eps": 1e-5}
    return config, "krea-2"


# ---- ComfyUI's names -> diffusers' ----------------------------------------------------------------------------------
def _block(m: list, dst: str, src: str) -> None:
    for d, c in (("attn.to_q", "attn.wq"), ("attn.to_k", "attn.wk"), ("attn.to_v", "attn.wv"),
                 ("attn.to_gate", "attn.gate"), ("attn.to_out.0", "attn.wo"), ("ff.gate", "mlp.gate"),
                 ("ff.up", "mlp.up"), ("ff.down", "mlp.down")):
        linear(m, f"{dst}.{d}", f"{src}.{c}", bias=False)
    for d, c in (("attn.norm_q", "attn.qknorm.qnorm"), ("attn.norm_k", "attn.qknorm.knorm"), ("norm1", "prenorm"),
                 ("norm2", "postnorm")):
        m.append((f"{dst}.{d}.weight", f"{src}.{c}.scale", None))


def key_map(layout: str, config: dict) -> list | None:
    """ComfyUI's keys -> diffusers' Krea2Transformer2DModel keys (None: the diffusers layout needs none); the same map
    as diffusers' convert_krea2_transformer_checkpoint_to_diffusers (a test checks it against that): a block's six
    modulation rows, stored flat, read as their [6, width] table ("rows:6")."""
    if layout == "diffusers":
        return None
    m: list = []
    linear(m, "img_in", "first")
    linear(m, "time_embed.linear_1", "tmlp.0")
    linear(m, "time_embed.linear_2", "tmlp.2")
    linear(m, "time_mod_proj", "tproj.1")
    m.append(("txt_in.norm.weight", "txtmlp.0.scale", None))
    linear(m, "txt_in.linear_1", "txtmlp.1")
    linear(m, "txt_in.linear_2", "txtmlp.3")
    for kind, blocks in (("layerwise_blocks", config["num_layerwise_text_blocks"]),
                         ("refiner_blocks", config["num_refiner_text_blocks"])):
        for i in range(blocks):
            _block(m, f"text_fusion.{kind}.{i}", f"txtfusion.{kind}.{i}")
    m.append(("text_fusion.projector.weight", "txtfusion.projector.weight", None))
    for i in range(config["num_layers"]):
        _block(m, f"transformer_blocks.{i}", f"blocks.{i}")
        m.append((f"transformer_blocks.{i}.scale_shift_table", f"blocks.{i}.mod.lin", "rows:6"))
    m.append(("final_layer.norm.weight", "last.norm.scale", None))
    linear(m, "final_layer.linear", "last.linear")
    m.append(("final_layer.scale_shift_table", "last.modulation.lin", None))
    return m
