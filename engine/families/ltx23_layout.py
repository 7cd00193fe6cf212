"""LTX-2.3's and LTX-2.5's checkpoints: the dimensions of the released models and of the tiny test ones, the tensors
of ComfyUI's single-file layout (Lightricks' ltx-2.3 and ltx-2.5 files, as ComfyUI 0.33's LTXAVModel names them), the
key map into diffusers' LTX2VideoTransformer3DModel (with diffusers' two LTX2ConnectorTransformer1d text connectors held
as its submodules `video_connector` and `audio_connector`), and the config, as ComfyUI's model_detection reads it
(C/comfy/model_detection.py:419-429, the branch keyed on `adaln_single.emb.timestep_embedder.linear_1.bias`, "ltxav"
with `audio_adaln_single.linear.weight`): the block count, attention_head_dim = attn2.to_k rows / 32 and
cross_attention_dim from the tensors, every other setting (LTX-2.5's ff_bias false among them) from the file's
safetensors header `config` -> `transformer`, which ComfyUI requires of these files (detection assumes 32 heads and
LTX-2.0's switches without it), and, after the header, use_keyframes_abs_pos_embedding from the presence of the
`keyframes_abs_pos_embedding` tensor: the one mark of an LTX-2.5 file (ComfyUI builds both with the same LTXAV model
class, so the engine runs them as two variants of one family). The family's behaviour is in ltx23.py.

Every tensor is a 1:1 rename (no fused or split tensors, no transposes); the rename is written out below (TOP,
CONNECTORS, LEAVES) and the table of ComfyUI's keys and shapes is diffusers' modules' state dict (built on the meta
device) renamed back through it.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

from ..errors import CheckpointError
from .base import count

REGISTERS = 128   # learnable registers of each text connector (ComfyUI's Embeddings1DConnector default)
CONNECTOR_KEYS = ("connector_num_layers", "connector_num_attention_heads", "connector_attention_head_dim",
                  "audio_connector_num_attention_heads", "audio_connector_attention_head_dim")


@dataclass(frozen=True)
class LtxDims:
    heads: int = 32                 # video attention heads
    head_dim: int = 128
    audio_heads: int = 32
    audio_head_dim: int = 64
    depth: int = 48                 # transformer blocks
    depth_connector: int = 8        # blocks of each text connector
    connector_heads: int = 32       # video connector (its width is the video inner width: ComfyUI's context split)
    connector_head_dim: int = 128
    audio_connector_heads: int = 32
    audio_connector_head_dim: int = 64
    in_channels: int = 128          # video latent channels (patch size 1)
    audio_in_channels: int = 128    # 8 audio channels x 16 mel bins (hard-coded in ComfyUI's model)
    caption_channels: int = 3840    # Gemma 3's width (LTX-2.0's caption projection; unused by 2.3 and 2.5)
    ff_bias: bool = True            # the video feed-forward's biases (LTX-2.5's header: false; its audio keeps them)
    keyframes: bool = False         # the keyframe embedding (LTX-2.5: keyframes_abs_pos_embedding [1, inner])

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def audio_inner(self) -> int:
        return self.audio_heads * self.audio_head_dim


_TINY = LtxDims(heads=4, head_dim=16, audio_heads=4, audio_head_dim=8, depth=4, depth_connector=2, connector_heads=4,
                connector_head_dim=16, audio_connector_heads=4, audio_connector_head_dim=8)
LTX25 = {"ff_bias": False, "keyframes": True}   # what an LTX-2.5 file differs in (the 2.3 block otherwise)
DIMS = {
    "full": {"ltx-2.3": LtxDims(), "ltx-2.5": LtxDims(**LTX25)},
    # 4 heads each (4-way plans), equal video and audio head counts (ComfyUI splits the a2v/v2a RoPE by the audio head
    # count, diffusers by the video one), each head count dividing half its RoPE's width; the connectors as wide as
    # their stream (ComfyUI splits the context by the inner widths)
    "tiny": {"ltx-2.3": _TINY, "ltx-2.5": replace(_TINY, **LTX25)},
}


# ---- ComfyUI's settings of an LTX-2.3 file (its header's config -> transformer) ------------------------------------
# the switches of LTX-2.3 as its released header states them; the engine runs this combination (another value names
# another model: LTX-2.0 or a variant diffusers' modules do not compute as ComfyUI does)
SWITCHES = {"cross_attention_adaln": True, "apply_gated_attention": True, "connector_apply_gated_attention": True,
            "caption_proj_before_connector": True, "caption_projection_first_linear": False, "rope_type": "split",
            "frequencies_precision": "float64", "use_middle_indices_grid": True, "causal_temporal_positioning": True}
# LTXAVModel's defaults (C/comfy/ldm/lightricks/av_model.py:395-424 LTXAVModel.__init__, model.py:704-737
# LTXBaseModel.__init__) for what a header leaves out
COMFY_DEFAULTS = {"in_channels": 128, "audio_in_channels": 128, "cross_attention_dim": 4096,
                  "audio_cross_attention_dim": 2048, "attention_head_dim": 128, "audio_attention_head_dim": 64,
                  "num_attention_heads": 32, "audio_num_attention_heads": 32, "caption_channels": 3840,
                  "positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
                  "audio_positional_embedding_max_pos": [20], "vae_scale_factors": [8, 32, 32],
                  "timestep_scale_multiplier": 1000.0, "av_ca_timestep_scale_multiplier": 1.0,
                  "ff_bias": True, "audio_ff_bias": True, "use_prompt_adaln_single": True,
                  "connector_num_layers": 2, "connector_num_attention_heads": 30, "connector_attention_head_dim": 128}


def header_config(d: LtxDims) -> dict:
    """What an LTX-2.3 (or LTX-2.5) file's header `config` -> `transformer` says for these dims (the released files'
    settings; LTX-2.5's states ff_bias false, and never the keyframe embedding, which ComfyUI takes from the tensor)."""
    return {"num_attention_heads": d.heads, "attention_head_dim": d.head_dim, "cross_attention_dim": d.inner,
            "audio_num_attention_heads": d.audio_heads, "audio_attention_head_dim": d.audio_head_dim,
            "audio_cross_attention_dim": d.audio_inner, "in_channels": d.in_channels,
            "audio_in_channels": d.audio_in_channels, "num_layers": d.depth, "caption_channels": d.caption_channels,
            "positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
            "audio_positional_embedding_max_pos": [20], "timestep_scale_multiplier": 1000,
            "av_ca_timestep_scale_multiplier": 1000, **SWITCHES,
            "connector_num_layers": d.depth_connector, "connector_num_attention_heads": d.connector_heads,
            "connector_attention_head_dim": d.connector_head_dim,
            "audio_connector_num_attention_heads": d.audio_connector_heads,
            "audio_connector_attention_head_dim": d.audio_connector_head_dim,
            **({} if d.ff_bias else {"ff_bias": False})}


def tiny_metadata(d: LtxDims) -> dict[str, str]:
    """The header entries an LTX-2.3 or LTX-2.5 file carries (make-tiny writes them as the released files have them)."""
    return {"config": json.dumps({"transformer": header_config(d)})}


# ---- the rename: ComfyUI's names <-> diffusers' -------------------------------------------------------------------
TOP = {   # the first name of a key (ComfyUI -> diffusers); names not listed are the same in both
    "patchify_proj": "proj_in", "audio_patchify_proj": "audio_proj_in",
    "adaln_single": "time_embed", "audio_adaln_single": "audio_time_embed",
    "prompt_adaln_single": "prompt_adaln", "audio_prompt_adaln_single": "audio_prompt_adaln",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "video_embeddings_connector": "video_connector", "audio_embeddings_connector": "audio_connector"}
CONNECTORS = {"transformer_1d_blocks": "transformer_blocks"}   # inside a connector
LEAVES = {   # any later name of a key
    "q_norm": "norm_q", "k_norm": "norm_k",
    "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
    "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table"}
_TOP_BACK, _CONNECTORS_BACK, _LEAVES_BACK = ({v: k for k, v in m.items()} for m in (TOP, CONNECTORS, LEAVES))


def to_diffusers(key: str) -> str:
    """ComfyUI's key (prefix stripped) -> diffusers' (the transformer's, or its connectors' under their names)."""
    first, *rest = key.split(".")
    top = TOP.get(first, first)
    inner = CONNECTORS if top in ("video_connector", "audio_connector") else {}
    rest = [inner.get(p, p) if i == 0 else p for i, p in enumerate(rest)]
    return ".".join([top] + [LEAVES.get(p, p) for p in rest])


def to_comfy(key: str) -> str:
    """diffusers' key -> ComfyUI's (to_diffusers undone)."""
    first, *rest = key.split(".")
    inner = _CONNECTORS_BACK if first in ("video_connector", "audio_connector") else {}
    rest = [inner.get(p, p) if i == 0 else p for i, p in enumerate(rest)]
    return ".".join([_TOP_BACK.get(first, first)] + [_LEAVES_BACK.get(p, p) for p in rest])


def diffusers_config(d: LtxDims) -> dict:
    """The engine's config of these dims (what infer gives for a file of them: the keyframe embedding as its tensor
    says)."""
    config, _ = infer("ltx", {}, {"config": tiny_metadata(d)["config"]}, shapes_checked=False)
    return {**config, "use_keyframes_abs_pos_embedding": d.keyframes}


@functools.lru_cache(maxsize=8)
def _diffusers_tensors(config_json: str) -> tuple[tuple[str, tuple], ...]:
    """(name, shape) of every tensor of the diffusers model (with its connectors) for a config, built on the meta
    device once per config."""
    import torch
    with torch.device("meta"):
        model = build_model(**json.loads(config_json))
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


def _tensors(config: dict) -> tuple[tuple[str, tuple], ...]:
    return _diffusers_tensors(json.dumps(config, sort_keys=True))


def shapes(d: LtxDims) -> dict[str, tuple]:
    """Every tensor of an LTX-2.3 transformer (and its two text connectors) in ComfyUI's layout, with its shape: the
    diffusers model's state dict built on the meta device, its names renamed back."""
    return {to_comfy(k): shape for k, shape in _tensors(diffusers_config(d))}


def key_map(layout: str, config: dict) -> list | None:
    """ComfyUI's keys -> diffusers' LTX2VideoTransformer3DModel keys (and its connectors'): one rename each."""
    return [(k, to_comfy(k), None) for k, _ in _tensors(config)]


def _stated(metadata: dict) -> dict | None:
    """The header's config -> transformer (None: the file has none); a synthetic model's, from its recorded dims."""
    raw = metadata.get("config")
    if raw:
        try:
            stated = json.loads(raw).get("transformer")
        except (ValueError, AttributeError):
            raise CheckpointError("an LTX file whose header `config` is not JSON with a `transformer` entry: the file "
                                  "is damaged") from None
        return stated if isinstance(stated, dict) else None
    synthetic = metadata.get("xdit.synthetic")
    if synthetic:   # a synthetic model (random weights at named dims) states its dims instead
        return header_config(LtxDims(**json.loads(synthetic)["dims"]))
    return None


def infer(layout: str, s: dict, metadata: dict, shapes_checked: bool = True) -> tuple[dict, str]:
    """The engine's config of an LTX-2.3 or LTX-2.5 file: diffusers' LTX2VideoTransformer3DModel arguments and the
    connectors' (connector_*), from what ComfyUI's detection reads of the shapes, then the header's transformer config
    over it, LTXAVModel's defaults for what it leaves out, then the keyframe embedding as the tensors say (the variant:
    ltx-2.5 with it). CheckpointError, in one line, for a file without the header, an LTX-2.0 file, a header the
    tensors contradict, or settings the engine does not compute as ComfyUI does."""
    stated = _stated(metadata)
    if stated is None:
        raise CheckpointError("an LTX audio-video transformer without the `config` -> `transformer` entry in its "
                              "safetensors header, which ComfyUI requires to build LTX-2.3 and LTX-2.5 (their released "
                              "files carry it); the file was re-saved without its header: use the released file")
    if shapes_checked and "caption_projection.linear_1.weight" in s:
        raise CheckpointError("an LTX-2.0 transformer (caption_projection, no prompt modulation): the engine runs "
                              "LTX-2.3 and LTX-2.5; use one of their files")
    keyframes = shapes_checked and "keyframes_abs_pos_embedding" in s   # (model_detection.py:428: after the header)
    name = "LTX-2.5" if keyframes else "LTX-2.3"
    c = dict(COMFY_DEFAULTS)
    if shapes_checked:   # what ComfyUI's detection reads of the tensors
        to_k = s["transformer_blocks.0.attn2.to_k.weight"]
        c.update(num_layers=count(s, r"transformer_blocks\.(\d+)\."), attention_head_dim=to_k[0] // 32,
                 cross_attention_dim=to_k[1])
    c.update(stated)
    other = {k: c.get(k) for k, v in SWITCHES.items() if c.get(k, None) != v}
    if other:
        if c.get("cross_attention_adaln") is not True or c.get("caption_proj_before_connector") is not True:
            raise CheckpointError("an LTX-2.0 transformer (its header has no cross_attention_adaln / "
                                  "caption_proj_before_connector): the engine runs LTX-2.3 and LTX-2.5; use one of "
                                  "their files")
        raise CheckpointError(f"an {name} transformer whose header sets {other} where {name} has "
                              f"{ {k: SWITCHES[k] for k in other} }: the engine runs the released settings")
    if c.get("use_prompt_adaln_single") is not True:   # ComfyUI's cross-attention reads the prompt timestep it gives
        raise CheckpointError(f"an {name} transformer whose header sets use_prompt_adaln_single false: ComfyUI 0.33 "
                              f"cannot sample it either (its text cross-attention modulation needs that module's "
                              f"timestep, comfy/ldm/lightricks/model.py:593-606); the released files keep it")
    for flag, key in (("ff_bias", "ff"), ("audio_ff_bias", "audio_ff")):   # ComfyUI builds biases as the header says
        held = f"transformer_blocks.0.{key}.net.0.proj.bias" in s
        if shapes_checked and bool(c[flag]) != held:
            raise CheckpointError(f"an {name} transformer whose header sets {flag} {bool(c[flag])} but whose "
                                  f"{key} layers {'have' if held else 'have no'} biases: the header does not "
                                  f"describe the file")
    heads, audio_heads = int(c["num_attention_heads"]), int(c["audio_num_attention_heads"])
    inner, audio_inner = heads * int(c["attention_head_dim"]), audio_heads * int(c["audio_attention_head_dim"])
    if heads != audio_heads:
        raise CheckpointError(f"an {name} transformer with {heads} video and {audio_heads} audio heads: ComfyUI "
                              f"splits the audio-video cross-attention RoPE by the audio head count and diffusers by "
                              f"the video one, which agree only for equal counts (32 and 32 released)")
    if int(c["cross_attention_dim"]) != inner or int(c["audio_cross_attention_dim"]) != audio_inner:
        raise CheckpointError(f"an {name} transformer whose text widths ({c['cross_attention_dim']}, "
                              f"{c['audio_cross_attention_dim']}) are not its inner widths ({inner}, {audio_inner}): "
                              f"ComfyUI splits the connected text by the inner widths")
    vheads = int(c["connector_num_attention_heads"])
    vhead_dim = int(c["connector_attention_head_dim"])
    aheads = int(c.get("audio_connector_num_attention_heads", vheads))
    ahead_dim = int(c.get("audio_connector_attention_head_dim", vhead_dim))
    if vheads * vhead_dim != inner or aheads * ahead_dim != audio_inner:
        raise CheckpointError(f"an {name} transformer whose text connectors ({vheads} x {vhead_dim}, {aheads} x "
                              f"{ahead_dim}) are not as wide as its streams ({inner}, {audio_inner})")
    max_pos, audio_max_pos = list(c["positional_embedding_max_pos"]), list(c["audio_positional_embedding_max_pos"])
    config = {
        "in_channels": int(c["in_channels"]), "out_channels": int(c["in_channels"]),
        "num_attention_heads": heads, "attention_head_dim": int(c["attention_head_dim"]),
        "cross_attention_dim": inner, "vae_scale_factors": tuple(int(v) for v in c["vae_scale_factors"]),
        "pos_embed_max_pos": int(max_pos[0]), "base_height": int(max_pos[1]), "base_width": int(max_pos[2]),
        "gated_attn": True, "cross_attn_mod": True,
        "audio_in_channels": int(c["audio_in_channels"]), "audio_out_channels": int(c["audio_in_channels"]),
        "audio_num_attention_heads": audio_heads, "audio_attention_head_dim": int(c["audio_attention_head_dim"]),
        "audio_cross_attention_dim": audio_inner, "audio_pos_embed_max_pos": int(audio_max_pos[0]),
        "audio_gated_attn": True, "audio_cross_attn_mod": True,
        "num_layers": int(c["num_layers"]), "caption_channels": int(c["caption_channels"]),
        "rope_theta": float(c["positional_embedding_theta"]), "rope_double_precision": True, "rope_type": "split",
        "timestep_scale_multiplier": float(c["timestep_scale_multiplier"]),
        "cross_attn_timestep_scale_multiplier": float(c["av_ca_timestep_scale_multiplier"]),
        "use_prompt_embeddings": False, "ff_bias": bool(c["ff_bias"]), "audio_ff_bias": bool(c["audio_ff_bias"]),
        "use_keyframes_abs_pos_embedding": keyframes,
        # the text connectors (diffusers' LTX2ConnectorTransformer1d), held by the model as submodules
        "connector_num_layers": int(c["connector_num_layers"]),
        "connector_num_attention_heads": vheads, "connector_attention_head_dim": vhead_dim,
        "audio_connector_num_attention_heads": aheads, "audio_connector_attention_head_dim": ahead_dim,
    }
    if shapes_checked and tuple(s["patchify_proj.weight"]) != (inner, config["in_channels"]):
        raise CheckpointError(f"an {name} transformer whose patchify_proj is {list(s['patchify_proj.weight'])} but "
                              f"whose header gives {heads} x {c['attention_head_dim']} heads: the header does not "
                              f"describe the file")
    return config, "ltx-2.5" if keyframes else "ltx-2.3"


def dims_of(config: dict) -> LtxDims:
    return LtxDims(heads=config["num_attention_heads"], head_dim=config["attention_head_dim"],
                   audio_heads=config["audio_num_attention_heads"], audio_head_dim=config["audio_attention_head_dim"],
                   depth=config["num_layers"], depth_connector=config["connector_num_layers"],
                   connector_heads=config["connector_num_attention_heads"],
                   connector_head_dim=config["connector_attention_head_dim"],
                   audio_connector_heads=config["audio_connector_num_attention_heads"],
                   audio_connector_head_dim=config["audio_connector_attention_head_dim"],
                   in_channels=config["in_channels"], audio_in_channels=config["audio_in_channels"],
                   caption_channels=config["caption_channels"], ff_bias=config["ff_bias"],
                   keyframes=config.get("use_keyframes_abs_pos_embedding", False))


# ---- the model: diffusers' transformer with its two text connectors as submodules ----------------------------------
def build_model(**config):
    """The unmodified diffusers LTX2VideoTransformer3DModel for `config`, with two unmodified LTX2ConnectorTransformer1d
    (the text connectors ComfyUI's model holds) as its submodules `video_connector` and `audio_connector`, so the
    loader fills them from the file with the rest."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d
    config = dict(config)
    conn = {k: config.pop(k) for k in CONNECTOR_KEYS}
    model = LTX2VideoTransformer3DModel(**config)
    for name, heads, head_dim in (
            ("video_connector", conn["connector_num_attention_heads"], conn["connector_attention_head_dim"]),
            ("audio_connector", conn["audio_connector_num_attention_heads"],
             conn["audio_connector_attention_head_dim"])):
        setattr(model, name, LTX2ConnectorTransformer1d(
            num_attention_heads=heads, attention_head_dim=head_dim, num_layers=conn["connector_num_layers"],
            num_learnable_registers=REGISTERS, rope_type="split", rope_double_precision=True, gated_attention=True))
    return model
