"""Wan's checkpoints: the dimensions of each variant, the tensors of ComfyUI's single-file layout (which tiny files and
full-size checks are made from), the key map into the diffusers WanTransformer3DModel, and the diffusers config
detected from a file's shapes, as ComfyUI's model_detection reads them. The family's behaviour is in wan.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointError
from .base import count, linear_shapes
from .wan_animate2 import ANIMATE2, stated

HEAD_DIM = 128          # model_detection: num_heads = dim // 128
TEXT_DIM = 4096         # umT5-XXL
IMAGE_DIM = 1280        # CLIP ViT-H/14 penultimate hidden states
FREQ_DIM = 256          # the time embedding's sinusoid
CLIP_TOKENS = 257       # one image's CLIP-vision tokens
# comfy/model_detection.py: other Wan files ComfyUI knows, which the engine does not run
OTHER_MODELS = {"vace_patch_embedding.weight": "VACE", "control_adapter.conv.weight": "Camera",
                "casual_audio_encoder.encoder.final_linear.weight": "S2V",
                "audio_proj.audio_proj_glob_1.layer.bias": "HuMo",
                "face_adapter.fuser_blocks.0.k_norm.weight": "Animate",
                "ref_conv.weight": "Fun reference", "patch_embedding_pose.weight": "SCAIL",
                "patch_embedding_mask.weight": "SCAIL-2", "patch_embedding_global.weight": "WanDancer"}


# ---- dimensions and the Wan (ComfyUI) layout -------------------------------------------------------------------------
@dataclass(frozen=True)
class WanDims:
    dim: int = 5120
    ffn: int = 13824
    depth: int = 40
    in_channels: int = 16      # the latent's, + 20 (4 mask + 16 image latent) for image-to-video
    out_channels: int = 16
    image: bool = False        # img_emb: CLIP-vision tokens in the cross-attention
    flf_tokens: int = 0        # img_emb.emb_pos: first-last-frame models' 2 x 257 positions
    text_dim: int = TEXT_DIM
    animate2: bool = False     # Wan-Animate 2: the image-to-video tensors, told apart only by the header

    @property
    def heads(self) -> int:
        return self.dim // HEAD_DIM


_T14 = dict(dim=5120, ffn=13824, depth=40)
_TINY = dict(dim=512, ffn=512, depth=4)   # 4 heads of 128, as ComfyUI infers heads from the width
DIMS = {
    "full": {"wan2.1-1.3b": WanDims(dim=1536, ffn=8960, depth=30),
             "wan2.1-14b": WanDims(**_T14),
             "wan2.1-i2v-14b": WanDims(**_T14, in_channels=36, image=True),
             "wan2.1-flf2v-14b": WanDims(**_T14, in_channels=36, image=True, flf_tokens=2 * CLIP_TOKENS),
             "wan2.2-a14b": WanDims(**_T14),
             "wan2.2-i2v-a14b": WanDims(**_T14, in_channels=36),
             "wan2.2-ti2v-5b": WanDims(dim=3072, ffn=14336, depth=30, in_channels=48, out_channels=48),
             "wan-animate-2": WanDims(**_T14, in_channels=36, image=True, animate2=True)},
    "tiny": {"wan2.1-1.3b": WanDims(**_TINY),
             "wan2.1-14b": WanDims(**_TINY),
             "wan2.1-i2v-14b": WanDims(**_TINY, in_channels=36, image=True),
             "wan2.1-flf2v-14b": WanDims(**_TINY, in_channels=36, image=True, flf_tokens=2 * CLIP_TOKENS),
             "wan2.2-a14b": WanDims(**_TINY),
             "wan2.2-i2v-a14b": WanDims(**_TINY, in_channels=36),
             "wan2.2-ti2v-5b": WanDims(**_TINY, in_channels=48, out_channels=48),
             "wan-animate-2": WanDims(**_TINY, in_channels=36, image=True, animate2=True)},
}


def shapes(d: WanDims) -> dict[str, tuple]:
    """Every tensor of a Wan transformer in the Wan-AI / ComfyUI layout (Comfy-Org's repackaged files), with its
    shape."""
    h, s = d.dim, {}
    s["patch_embedding.weight"] = (h, d.in_channels, 1, 2, 2)
    s["patch_embedding.bias"] = (h,)
    linear_shapes(s, "text_embedding.0", h, d.text_dim)
    linear_shapes(s, "text_embedding.2", h, h)
    linear_shapes(s, "time_embedding.0", h, FREQ_DIM)
    linear_shapes(s, "time_embedding.2", h, h)
    linear_shapes(s, "time_projection.1", 6 * h, h)
    for i in range(d.depth):
        b = f"blocks.{i}"
        s[f"{b}.modulation"] = (1, 6, h)
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                linear_shapes(s, f"{b}.{attn}.{proj}", h, h)
            s[f"{b}.{attn}.norm_q.weight"] = (h,)
            s[f"{b}.{attn}.norm_k.weight"] = (h,)
        if d.image:
            linear_shapes(s, f"{b}.cross_attn.k_img", h, h)
            linear_shapes(s, f"{b}.cross_attn.v_img", h, h)
            s[f"{b}.cross_attn.norm_k_img.weight"] = (h,)
        s[f"{b}.norm3.weight"] = (h,)
        s[f"{b}.norm3.bias"] = (h,)
        linear_shapes(s, f"{b}.ffn.0", d.ffn, h)
        linear_shapes(s, f"{b}.ffn.2", h, d.ffn)
    s["head.modulation"] = (1, 2, h)
    linear_shapes(s, "head.head", d.out_channels * 4, h)
    if d.image:
        s["img_emb.proj.0.weight"] = s["img_emb.proj.0.bias"] = (IMAGE_DIM,)
        linear_shapes(s, "img_emb.proj.1", IMAGE_DIM, IMAGE_DIM)
        linear_shapes(s, "img_emb.proj.3", h, IMAGE_DIM)
        s["img_emb.proj.4.weight"] = s["img_emb.proj.4.bias"] = (h,)
        if d.flf_tokens:
            s["img_emb.emb_pos"] = (1, d.flf_tokens, IMAGE_DIM)
    return s


# Wan-AI / ComfyUI names -> diffusers' (diffusers' convert_wan_transformer_to_diffusers, plus the first-last-frame
# position embedding, which that converter leaves out)
TOP = {"patch_embedding": "patch_embedding", "text_embedding.0": "condition_embedder.text_embedder.linear_1",
       "text_embedding.2": "condition_embedder.text_embedder.linear_2",
       "time_embedding.0": "condition_embedder.time_embedder.linear_1",
       "time_embedding.2": "condition_embedder.time_embedder.linear_2",
       "time_projection.1": "condition_embedder.time_proj", "head.head": "proj_out",
       "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
       "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
       "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
       "img_emb.proj.4": "condition_embedder.image_embedder.norm2"}
BLOCK = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
         "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
         "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
         "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
         "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
         "cross_attn.norm_k_img": "attn2.norm_added_k", "norm3": "norm2", "ffn.0": "ffn.net.0.proj",
         "ffn.2": "ffn.net.2"}


def key_map(layout: str, config: dict) -> list | None:
    """Wan-AI / ComfyUI keys -> diffusers' WanTransformer3DModel keys (None: a diffusers file needs none)."""
    if layout == "diffusers":
        return None
    d = dims_of(config)
    m = [(to, src, None) for src, to in (("head.modulation", "scale_shift_table"),)]
    for name, (_, shape) in ((k, (k, v)) for k, v in shapes(d).items()):
        module, _, leaf = name.rpartition(".")
        if name == "head.modulation":
            continue
        if name == "img_emb.emb_pos":
            m.append(("condition_embedder.image_embedder.pos_embed", name, None))
        elif module.startswith("blocks."):
            _, index, rest = module.split(".", 2) if "." in module[7:] else (None, module[7:], "")
            if not rest:   # blocks.N.modulation
                m.append((f"blocks.{index}.scale_shift_table", name, None))
            else:
                m.append((f"blocks.{index}.{BLOCK[rest]}.{leaf}", name, None))
        else:
            m.append((f"{TOP[module]}.{leaf}", name, None))
    return m


def dims_of(config: dict) -> WanDims:
    """The Wan dims a diffusers config describes."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return WanDims(dim=dim, ffn=config["ffn_dim"], depth=config["num_layers"], in_channels=config["in_channels"],
                   out_channels=config["out_channels"], image=config.get("image_dim") is not None,
                   flf_tokens=config.get("pos_embed_seq_len") or 0, text_dim=config["text_dim"])


# ---- detection: the diffusers config from the tensors' shapes --------------------------------------------------------
def _variant(d: WanDims, metadata: dict) -> str:
    """Which Wan model the structure is: what the tensors tell apart (ComfyUI tells no more apart: a Wan 2.1 14B and a
    Wan 2.2 A14B text-to-video expert are one structure, named wan2.1-14b unless a synthetic file states which)."""
    if d.animate2:   # the header's model_type, as ComfyUI reads it (model_detection.py:779)
        return ANIMATE2
    synthetic = metadata.get("xdit.synthetic")
    stated = json.loads(synthetic).get("variant", "") if synthetic else ""
    structure = (d.in_channels, d.out_channels, d.image, bool(d.flf_tokens))
    known = DIMS["full"].get(stated) if stated != ANIMATE2 else None   # Animate 2 only by its header
    if known is not None and (known.in_channels, known.out_channels, known.image, bool(known.flf_tokens)) == structure:
        return stated
    if d.out_channels == 48:
        return "wan2.2-ti2v-5b"
    if d.image:
        return "wan2.1-flf2v-14b" if d.flf_tokens else "wan2.1-i2v-14b"
    if d.in_channels == 36:
        return "wan2.2-i2v-a14b"
    return "wan2.1-1.3b" if d.dim < 3072 else "wan2.1-14b"


def infer(layout: str, s: dict, metadata: dict) -> tuple[dict, str]:
    other = [name for key, name in OTHER_MODELS.items() if key in s]
    if other:
        raise CheckpointError(f"a Wan {other[0]} transformer: the engine runs Wan 2.1 / 2.2 text-to-video, "
                              f"image-to-video, first-last-frame and TI2V-5B files")
    if layout == "wan":
        dim, ffn = s["head.modulation"][2], s["blocks.0.ffn.0.weight"][0]
        depth = count(s, r"blocks\.(\d+)\.")
        in_channels, out_channels = s["patch_embedding.weight"][1], s["head.head.weight"][0] // 4
        text_dim, image = s["text_embedding.0.weight"][1], "img_emb.proj.0.bias" in s
        flf = s["img_emb.emb_pos"][1] if "img_emb.emb_pos" in s else 0
    else:
        dim, ffn = s["scale_shift_table"][2], s["blocks.0.ffn.net.0.proj.weight"][0]
        depth = count(s, r"blocks\.(\d+)\.")
        in_channels, out_channels = s["patch_embedding.weight"][1], s["proj_out.weight"][0] // 4
        text_dim = s["condition_embedder.text_embedder.linear_1.weight"][1]
        image = "condition_embedder.image_embedder.norm1.bias" in s
        flf = s["condition_embedder.image_embedder.pos_embed"][1] if "condition_embedder.image_embedder.pos_embed" \
            in s else 0
    if dim % HEAD_DIM:
        raise CheckpointError(f"Wan transformer of width {dim}: ComfyUI takes its heads as width / {HEAD_DIM}, and "
                              f"{dim} is no multiple of {HEAD_DIM}")
    if (in_channels, out_channels) not in ((16, 16), (36, 16), (48, 48)) or (image and in_channels != 36):
        raise CheckpointError(f"Wan transformer with {in_channels} input and {out_channels} output channels"
                              f"{' and an image projection' if image else ''}: the engine runs text-to-video (16/16), "
                              f"image-to-video (36/16) and TI2V-5B (48/48) files, not Fun-Control or Camera ones")
    animate = stated(metadata)
    if animate and not (image and in_channels == 36 and out_channels == 16 and not flf):
        raise CheckpointError(f"a file whose header says Wan-Animate 2 but whose tensors are not Wan 2.1 "
                              f"image-to-video's ({in_channels} input channels{', an image projection' if image else ''}"
                              f"): Wan-Animate 2 files hold the image-to-video tensors")
    d = WanDims(dim=dim, ffn=ffn, depth=depth, in_channels=in_channels, out_channels=out_channels, image=image,
                flf_tokens=flf, text_dim=text_dim, animate2=animate)
    config = {"num_attention_heads": dim // HEAD_DIM, "attention_head_dim": HEAD_DIM, "in_channels": in_channels,
              "out_channels": out_channels, "text_dim": text_dim, "freq_dim": FREQ_DIM, "ffn_dim": ffn,
              "num_layers": depth, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
              "image_dim": IMAGE_DIM if image else None, "added_kv_proj_dim": dim if image else None,
              "rope_max_seq_len": 1024, "pos_embed_seq_len": flf or None}
    return config, _variant(d, metadata)
