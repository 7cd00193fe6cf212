"""LTX-2.3 (Lightricks, audio + video) and its variant LTX-2.5 (what 2.5 adds, and why a variant: ltx25.py): how the
engine runs this family (its checkpoints' dims, layout and detection: ltx23_layout.py). The engine runs it as
ComfyUI's diffusion model only (ComfyUI's KSampler / SamplerCustomAdvanced on the xDiT Engine's MODEL): its sampler
carries the two latents packed, which the engine's own loop does not sample.

ComfyUI's conventions, read from ComfyUI 0.33.0 (C = the ComfyUI checkout):
- C/comfy/model_detection.py:419-429: `adaln_single.emb.timestep_embedder.linear_1.bias` marks Lightricks' LTX, with
  `audio_adaln_single.linear.weight` the audio-video LTXAV; the tensors give the block count, attention_head_dim =
  attn2.to_k rows / 32 and cross_attention_dim; every LTX-2.3 setting comes from the header's `config` -> `transformer`.
- C/comfy/supported_models.py:913-958 (LTXV, LTXAV): sampling shift 2.37, latent format LTXAV, model_base.LTXAV, whose
  model type FLUX (C/comfy/model_base.py:1172-1174, 132-134) makes the model sampling ModelSamplingFlux
  (C/comfy/model_sampling.py:403-440: exponential shift, timestep(sigma) = sigma) with CONST's denoised = x - v sigma
  (model_sampling.py:86-92): the model gets sigma in [0, 1] and its velocity is used as it is (not negated).
- C/comfy/latent_formats.py:346-351, 486 (LTXV, LTXAV): 128 channels, no scale or shift;
  C/comfy_extras/nodes_lt.py:63-84 (EmptyLTXVLatentVideo): [B, 128, (length - 1) // 8 + 1, H/32, W/32];
  C/comfy_extras/nodes_lt_audio.py:93-160 (LTXVEmptyLatentAudio): [B, 8, round(frames / fps x 25), 16];
  nodes_lt.py:747-819 (LTXVConcatAVLatent): the two as one NestedTensor, with a nested noise mask when either has one;
  C/comfy/utils.py:1410-1430 (pack_latents): the sampler carries them as one [B, 1, N] row, video flattened first.
- C/comfy/model_base.py:1176-1226 (LTXAV.extra_conds): the text through diffusion_model.preprocess_text_embeds (once a
  sampling run, in ComfyUI's process: on LTX-2.3 both text connectors); frame_rate (a constant, 25 unless
  LTXVConditioning sets it, nodes_lt.py:543-564); denoise_mask / audio_denoise_mask (the packed noise mask split by the
  streams' shapes); keyframe_idxs, guide_attention_entries (LTXVAddGuide, nodes_lt.py:250-497), ref_audio.
  model_base.py:1228-1237 (process_timestep): a (video, audio) tuple, each the model timestep [B] without a mask and
  the patchified mask x timestep with one ([B, N_video, 1], [B, T_audio, 1]); model_base.py:1239-1240
  (scale_latent_inpaint): the masked-out latent enters as it is; model_base.py:240-251 (_apply_model): the latent
  unpacked into [video, audio] for the diffusion model and its [video, audio] output packed again.
- C/comfy/ldm/lightricks/av_model.py:583-600 (preprocess_text_embeds) and embeddings_connector.py:282-313: the text
  [B, L, video inner + audio inner] split by the inner widths, each half through its connector: learnable registers
  appended up to ceil(max(1024, L) / 128) x 128 tokens, 1-D split RoPE over positions / 4096, gated blocks, a final RMS
  norm; the diffusion model then splits the context the same way (av_model.py:849-869).
- av_model.py:685-736 (_process_input) and symmetric_patchifier.py: one token per video latent voxel (patch 1), frames
  then rows then columns, 128 features; audio rows `b c t f -> b t (c f)`. Positions (symmetric_patchifier.py:9-33,
  63-93, 135-183; model.py:925-937; av_model.py:871-908): video (start, end) latent coordinates x (8, 32, 32), the
  causal fix t = max(0, t + 1 - 8), then time x (1 / frame_rate) in float32; audio (start, end) in seconds, max(0, 4t-3)
  x 160 / 16000 (AudioPatchifier, causal); the midpoint of each, as fractions of (20, 2048, 2048) and 20;
  frequencies theta^linspace(0, 1) x pi / 2 in float64, cast to float32; split RoPE, cos 1 / sin 0 padding in front.
  The audio-video cross-attention RoPE: time only, the video's (already / fps) and the audio's, over the audio
  cross-attention width, max(20, 20), split by the audio head count.
- av_model.py:738-847 (_prepare_timestep): the adaLN of each stream from its own timestep x 1000 (per token under a
  mask); the text K/V modulation from the per-row max over tokens (model.py:571-590, compute_prompt_timestep); the
  audio-video cross-attention scale/shift from each stream's own timestep, their gates crossed: the a2v gate from the
  audio timestep's max, the v2a gate from the video's, each over the whole call (batch included) x av_ca / 1000
  (av_model.py:803-814).
- av_model.py:260-389 (BasicAVTransformerBlock.forward): video self-attention and text cross-attention, the same for
  audio, then a2v (video queries over the audio), then v2a (audio queries over the video), the video normalised again
  after the a2v update for v2a's keys and values (av_model.py:339-352), then both feed-forwards. model.py:425-503
  (CrossAttention): q/k RMS norms over all heads with eps 1e-5, RoPE, per-head gates 2 sigmoid(to_gate_logits(x)).
- av_model.py:1022-1059 (_process_output): LayerNorm (eps 1e-6, no affine) x (1 + scale) + shift from the embedded
  timestep, proj_out, for each stream; returned as [video, audio].

The engine drives the unmodified diffusers LTX2VideoTransformer3DModel (use_prompt_embeddings False, gated attention,
cross-attention modulation, split RoPE) and two unmodified LTX2ConnectorTransformer1d, held by it as submodules,
with ComfyUI's positions and timesteps as its forward arguments, and three compensations registered once at load:
the q/k norms' eps set to ComfyUI's 1e-5 (diffusers' default 1e-6), forward pre-hooks that give the a2v and v2a gate
embeddings ComfyUI's crossed timesteps (read from per-forward state the family sets), and hooks that give v2a the
video normalised after the a2v update (diffusers normalises once before both). Measured against ComfyUI 0.33's own
LTXAV on a tiny file: tests/comfyui_ltx_check.py.

LTXVAddGuide's guides (C/comfy_extras/nodes_lt.py:250-497; the model's side C/comfy/ldm/lightricks/model.py:1108-1170,
1229-1320, 370-421): the guide latent frames appended to the video latent are tokens at the end of the sequence, their
positions replaced by keyframe_idxs (pixel coordinates; then / frame rate as the others); the tokens under a negative
noise mask value in row 0 (an IC-LoRA reference's dilation) leave the sequence (their output zeros); where a guide's
strength is not 1 or it has a pixel attention mask, each tracked guide token's weight (strength x its mask reduced to
the latent grid) enters the video self-attention as an additive log weight (ltx23_guides.py). comfy_call reads all of it on
the ComfyUI side, as ComfyUI's model reads it, into the guide extras.

The guidance nodes' extra passes (C/comfy_extras/nodes_lt.py:855-1050): LTXVSpatioTemporalGuidance's
stg_self_attn_blocks (those blocks' video and audio self-attentions give their value projection, gated and projected
out as always: model.py:471-474, av_model.py:938-945), LTXVModalityGuidance's a2v_cross_attn / v2a_cross_attn off (both:
diffusers' isolate_modalities), LTXVReferenceAudio's ref_audio (ID-LoRA: its tokens ahead of the audio at timestep 0,
their times moved back to end one latent before 0, trimmed from the output: av_model.py:707-732, 775-783, 1028-1033).

Conditioning the engine does not take yet (refused in one line on the MODEL route): one direction of the coupling
severed alone, a pass without one stream (run_vx / run_ax off). A text ComfyUI did not mark unprocessed (its
connectors already run) is refused too: the ranks run the connectors, as ComfyUI does once a sampling run: once for
each context the ranks hold for a session (the family's `hold`), on every rank when it is first held; under divided
weights each connector is a unit of its own, gathered only while it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling
from .base import PACKED_SHAPE, Family, Marker, StockJob, TokenTable, placed
from .ltx23_guides import GuideBias, guide_extras, log_weights, mask_per_token  # noqa: F401 (read here)
from .ltx23_call import (  # noqa: F401 (positions and the call's extras, read here)
    AUDIO_DOWNSAMPLE, EXTRAS, FPS, HOP, HOST_EXTRAS, REFUSED_OPTIONS, SAMPLE_RATE, audio_coords, comfy_call,
    reference_coords, video_coords)
from .ltx23_layout import DIMS, REGISTERS, build_model, infer, key_map, shapes, tiny_metadata  # noqa: F401
from . import ltx25

SHIFT = 2.37                          # supported_models.LTXV.sampling_settings
AUDIO_LATENTS_PER_SECOND = 25.0       # 16000 Hz / 160 hop / 4 (ComfyUI's audio VAE)
AUDIO_CHANNELS, AUDIO_BINS = 8, 16    # av_model.py: num_audio_channels, audio_frequency_bins
TEXT_TOKENS = 1024                    # the connected text: registers fill it to at least 1024 tokens
QK_EPS = 1e-5                         # ComfyUI's q/k RMSNorm eps (model.py CrossAttention)

# LTX-2.3: ComfyUI's templates' two passes (half size with 8 steps, then the x2 upsampled latent with 3, the distilled
# LoRA at cfg 1; 5 s at 25 fps + 1 frame, its audio 25 latents a second) and the dev model alone at cfg > 1. GGUF
# files carry the header's config as a GGUF string (the engine reads it as ComfyUI does through ComfyUI-GGUF)
FIT_JOBS = (("template pass 1, cfg 1", 640, 352, 121, 8, False), ("template pass 2 (x2), cfg 1", 1280, 704, 121, 3, False),
            ("dev, cfg > 1", 1280, 704, 121, 30, True))


@dataclass(frozen=True)
class LtxLatent(LatentFormat):
    """The video stream of ComfyUI's LTXAV latent (the one the engine plans and checks against; the audio rides with
    it in the packed tensor, its rows counted by audio_frames)."""


LTX_VIDEO = LtxLatent("LTXAV", channels=128, spatial_dims=3, downscale=32, temporal_downscale=8)


def audio_frames(pixel_frames: int, fps: float = FPS) -> int:
    """Audio latent frames of a clip (LTXVEmptyLatentAudio: its duration at 25 latents a second)."""
    return round(pixel_frames / fps * AUDIO_LATENTS_PER_SECOND)


def _template_audio(config: dict, latent_frames: int) -> int:
    """A clip's audio rows at its variant's templates' frame rate (LTX-2.3's 25, LTX-2.5's 24)."""
    return audio_frames(LTX_VIDEO.pixel_frames(latent_frames), ltx25.TEMPLATE_FPS if ltx25.is_ltx25(config) else FPS)


# ---- the model: diffusers' transformer with its two text connectors as submodules ----------------------------------
def _model_class():
    build_model.model_class = __import__("diffusers").LTX2VideoTransformer3DModel
    return build_model


# ---- attention: diffusers' LTX2AudioVideoAttnProcessor, the video self-attention sequence parallel -----------------
class LtxProcessor:
    """What diffusers' LTX2AudioVideoAttnProcessor computes (per-head gates from the query input, q/k RMS norms over
    all heads, split RoPE with separate query and key embeddings), the video self-attention (marked `xdit_sequence` at
    load) through the sequence-parallel entry point when one is given; the text cross-attentions, the audio attentions,
    a2v (video queries over the whole audio) local; v2a (the audio, whole on every rank, over the video) over each
    rank's own video keys, merged across the ranks through the log-sum-exp (the token table's local_keys). The text
    connectors' mask is all zeros by construction (diffusers' connector replaces it so after filling the registers:
    their attentions are marked `xdit_zero_mask` at load) and is no mask; any other is refused (ComfyUI's LTX text
    encoder gives none), without reading it.

    Under torch.compile (each block compiled) the graph stays the same across blocks and calls: what the processor
    reads in it is the same for every block (flags set at load, STG's `xdit_perturbed` per forward, whether the
    forward has guides), and the guides' bias (a new object each forward) and the sequence group's exchanges run
    outside the graph (`_outside_graph`)."""

    takes_local_keys = True   # v2a's video keys stay split under sequence parallel (TokenTable.local_keys)

    def __init__(self, attention=None):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb
        if getattr(attn, "xdit_perturbed", False):   # this forward is STG's pass and this block one it perturbs
            return self._passthrough(attn, hidden_states)
        if attention_mask is not None:   # all zeros by construction in a connector with registers (marked at load)
            if not getattr(attn, "xdit_zero_mask", False):
                raise ValueError("LTX-2.3 attention takes no attention mask (ComfyUI's LTX text encoder gives none)")
            attention_mask = None
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if query_rotary_emb is not None:
            q = apply_split_rotary_emb(q, query_rotary_emb)
            k = apply_split_rotary_emb(k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        sequence = getattr(attn, "xdit_sequence", False)
        guided = sequence and "guide" in attn.xdit_ltx_state   # the guides' attention weights, this forward
        if guided or (self.attention is not None and getattr(attn, "xdit_local_keys", False)):
            out = _outside_graph(self.attention, attn, q, k, v)
        elif self.attention is not None and sequence:
            out = self.attention(q, k, v)[0]
        else:
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        out = out.flatten(2, 3).to(q.dtype)
        return self._out(attn, out, gate_logits)

    @staticmethod
    def _out(attn, out, gate_logits):
        if gate_logits is not None:
            out = (out.unflatten(2, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))

    def _passthrough(self, attn, hidden_states):
        """STG's perturbed self-attention (LTXVSpatioTemporalGuidance's extra pass; ComfyUI's CrossAttention with
        stg_skip_self_attn, C/comfy/ldm/lightricks/model.py:471-474): the value projection in place of the attention,
        then the gates and the output projection as always. Each token's own: no exchange under sequence parallel."""
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        return self._out(attn, attn.to_v(hidden_states), gate_logits)


@torch.compiler.disable
def _outside_graph(attention, attn, q, k, v):
    """The attentions a compiled block leaves to eager code: the video self-attention under the guides' bias (the
    bias is a new object each forward, with the block layouts it lays out on first use: Dynamo would guard on it and
    compile every block again each call) through the sequence-parallel entry point or, on one rank, the kernels that
    take a mask whatever torch's attention is held to; and v2a over each rank's own video keys, merged across them."""
    if not getattr(attn, "xdit_sequence", False):
        return attention.local_keys(q, k, v)
    bias = attn.xdit_ltx_state["guide"]
    if attention is not None:
        return attention(q, k, v, bias=bias)[0]
    return bias.attend(q, k, v, 0, 0)[0]


# ---- the compensations, registered once at load ------------------------------------------------------------------
def _gate_hook(which: str):
    """ComfyUI's crossed gate timestep for the a2v / v2a gate embedding: the other stream's max over the whole call,
    expanded over this stream's entries and times av_ca / 1000 (diffusers passes this stream's own)."""
    def hook(module, args):
        state = getattr(module, "xdit_ltx_state", None)
        if not state or which not in state:
            return None
        value, factor = state[which]
        return (value.to(args[0].dtype).expand(args[0].shape) * factor,) + tuple(args[1:])
    return hook


def _v2a_renorm(block) -> None:
    """ComfyUI normalises the video again for the v2a keys and values after the a2v update (av_model.py:339-352);
    diffusers normalises it once before both (transformer_ltx2.py LTX2VideoTransformerBlock.forward). On the unmodified
    block: the video is captured where audio_to_video_norm reads it, the a2v residual formed as the block forms it, and
    video_to_audio_attn's keys and values replaced by that residual normalised and modulated with v2a's own scale and
    shift (diffusers' arithmetic, in its order)."""
    state: dict = {}
    norm = block.audio_to_video_norm

    def block_pre(module, args, kwargs):
        state.clear()
        state["scale_shift"], state["gate"] = kwargs["temb_ca_scale_shift"], kwargs["temb_ca_gate"]

    def norm_pre(module, args):
        state["video"] = args[0]

    def a2v_out(module, args, kwargs, out):
        gate = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[4:, :], state.pop("gate"),
                                    out.shape[0])[0].squeeze(2)
        state["after"] = state.pop("video") + gate * out

    def v2a_pre(module, args, kwargs):   # (what it read is let go: nothing of a forward is held past it)
        after, scale_shift = state.pop("after", None), state.pop("scale_shift", None)
        if after is None:   # a2v did not run (diffusers' use_a2v_cross_attention off): its input is the video's own
            return None
        mod = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[:4, :], scale_shift, after.shape[0])
        return args, {**kwargs, "encoder_hidden_states": norm.forward(after) * (1 + mod[2].squeeze(2))
                      + mod[3].squeeze(2)}

    block.register_forward_pre_hook(block_pre, with_kwargs=True)
    norm.register_forward_pre_hook(norm_pre)
    block.audio_to_video_attn.register_forward_hook(a2v_out, with_kwargs=True)
    block.video_to_audio_attn.register_forward_pre_hook(v2a_pre, with_kwargs=True)


def _after_load(model) -> None:
    """ComfyUI's q/k eps on every attention (the transformer's and the connectors'), the engine's processor (the blocks'
    video self-attention marked for sequence parallel), and the compensating hooks, each registered once."""
    if getattr(model, "xdit_ltx_ready", False):
        return
    for name, module in model.named_modules():
        if name.endswith(("norm_q", "norm_k")):
            module.eps = QK_EPS
    state: dict = {}   # per forward: the crossed gate timesteps, the guides' attention bias
    for block in model.transformer_blocks:
        block.attn1.xdit_sequence = True
        for attn in (block.attn1, block.audio_attn1):   # the self-attentions STG perturbs (per forward)
            attn.xdit_ltx_state, attn.xdit_perturbed = state, False
        _v2a_renorm(block)
    for connector in (model.video_connector, model.audio_connector):   # their mask: zeros once registers fill it
        if connector.learnable_registers is not None:
            for module in connector.modules():
                if hasattr(module, "set_processor"):
                    module.xdit_zero_mask = True
    model.set_attn_processor(LtxProcessor())
    model.xdit_ltx_state = state
    for name, which in (("av_cross_attn_video_a2v_gate", "a2v"), ("av_cross_attn_audio_v2a_gate", "v2a")):
        module = getattr(model, name)
        module.xdit_ltx_state = state
        module.register_forward_pre_hook(_gate_hook(which))
    model.xdit_ltx_ready = True


# ---- the one forward ------------------------------------------------------------------------------------------------
def connect(connector, text: torch.Tensor) -> torch.Tensor:
    """One text connector on [n, L, width] as ComfyUI's Embeddings1DConnector runs it: the text followed by the
    learnable registers up to ceil(max(1024, L) / 128) x 128 tokens (diffusers' connector fills the masked tail with
    them, by absolute position), every token attending to every other."""
    n, length, _ = text.shape
    total = math.ceil(max(1024, length) / REGISTERS) * REGISTERS
    mask = torch.zeros(n, total, dtype=torch.float32, device=text.device)
    mask[:, length:] = -1e4
    return connector(F.pad(text, (0, 0, 0, total - length)), attention_mask=mask)[0]


@torch.no_grad()
def connected(flow, text: torch.Tensor) -> dict[str, torch.Tensor]:
    """The raw text [n, L, video inner + audio inner] through both connectors: what ComfyUI's preprocess_text_embeds
    computes once a sampling run. The family's `hold`: once for each context the ranks hold for a session."""
    model = flow.model
    inner = flow.loaded.info.config["num_attention_heads"] * flow.loaded.info.config["attention_head_dim"]
    text = text.to(flow.device, flow.dtype)
    return {"video_text": connect(model.video_connector, text[..., :inner]),
            "audio_text": connect(model.audio_connector, text[..., inner:])}


def _hold(flow, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    return connected(flow, tensor) if name == "context" else None


def forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared) -> torch.Tensor:
    """The packed velocity [n, 1, N] for packed latents x [n, 1, N] (ComfyUI's pack_latents of the video and audio
    streams) at ComfyUI's video timestep ([n], or [n, F*H*W] per token under a noise mask): what ComfyUI's LTXAVModel
    returns for the batch, through the unmodified diffusers transformer and connectors."""
    extras = prepared.extras or {}
    if PACKED_SHAPE not in extras:
        raise ValueError("an LTX-2.3 model call needs the packed streams' shapes (ComfyUI's latent_shapes)")
    model, dtype, device = flow.model, flow.dtype, flow.device
    config = flow.loaded.info.config
    n = x.shape[0]
    cv, frames, h, w, ca, ta, bins = (int(v) for v in extras[PACKED_SHAPE][0].tolist())
    nv, na = cv * frames * h * w, ca * ta * bins
    flat = x.reshape(n, -1)
    if flat.shape[1] != nv + na:
        raise ValueError(f"a packed LTX-2.3 latent of {flat.shape[1]} values does not hold a video of "
                         f"{[cv, frames, h, w]} and an audio latent of {[ca, ta, bins]}")
    rates = extras["frame_rate"].reshape(-1) if "frame_rate" in extras else None
    if rates is not None and not bool((rates == rates[0]).all()):
        raise ValueError("the rows of one LTX-2.3 model call have different frame rates")
    fps = float(rates[0]) if rates is not None else FPS
    video = flat[:, :nv].reshape(n, cv, frames, h, w).to(device, dtype)
    audio = flat[:, nv:].reshape(n, ca, ta, bins).to(device, dtype)
    v_rows = video.permute(0, 2, 3, 4, 1).reshape(n, frames * h * w, cv)
    a_rows = audio.permute(0, 2, 1, 3).reshape(n, ta, ca * bins)
    coords = video_coords(frames, h, w, fps, n, tuple(config["vae_scale_factors"]), device)
    guides, tracked, kept = (int(v) for v in extras["guide"][0].tolist()) if "guide" in extras \
        else (0, 0, frames * h * w)
    keep = None
    if kept < frames * h * w:   # tokens under a negative noise mask value: not in the sequence (ComfyUI's grid_mask)
        keep = placed(model, extras["keep"][0].nonzero().reshape(-1), device)
        v_rows, coords = v_rows.index_select(1, keep), coords.index_select(2, keep)
    if guides:   # the guide tokens end the sequence, at the positions LTXVAddGuide gave them
        at = extras["guide_coords"].to(device, torch.float32).reshape(n, 3, guides, 2)
        at[:, 0] = at[:, 0] * (1.0 / fps)
        coords[:, :, -guides:] = at
    slots = tuple(int(v) for v in extras["keyframe_slots"][0].tolist()) if "keyframe_slots" in extras else None
    marks = ltx25.keyframe_mask(coords, guides, slots, keep, h * w, frames * h * w, dtype) \
        if ltx25.is_ltx25(config) else None   # LTX-2.5's keyframe embedding, on the tokens ComfyUI marks
    mult, cross = float(config["timestep_scale_multiplier"]), float(config["cross_attn_timestep_scale_multiplier"])
    v_t = timestep.to(device, torch.float32)
    a_t = extras["audio_t"].to(device, torch.float32) if "audio_t" in extras else v_t
    if v_t.ndim == 2 and v_t.shape[1] != kept:
        raise ValueError(f"an LTX-2.3 video timestep of {v_t.shape[1]} tokens for {kept} video tokens")
    a_coords = audio_coords(ta, n, device)
    refs = extras["ref_audio"].shape[-1] // (ca * bins) if "ref_audio" in extras else 0
    if refs:   # the reference's tokens ahead of the audio, at timestep 0, ending just before time 0
        a_rows = torch.cat([extras["ref_audio"].to(device, dtype).reshape(n, refs, ca * bins), a_rows], dim=1)
        a_coords = torch.cat([reference_coords(refs, n, device), a_coords], dim=2)
        a_t = torch.cat([a_t.new_zeros(n, refs), a_t.reshape(n, -1).expand(n, ta)], dim=1)
    v_scaled, a_scaled = v_t * mult, a_t * mult
    sigma = v_scaled.amax(dim=1) if v_scaled.ndim == 2 else v_scaled
    audio_sigma = a_scaled.amax(dim=1) if a_scaled.ndim == 2 else a_scaled
    gates = extras["gate_t"][0].to(device, torch.float32) if "gate_t" in extras \
        else torch.stack([a_t.max(), v_t.max()])
    # the connectors' output, held with the context for the session (Family.hold), else computed for this call
    text = prepared.held if prepared.held and "video_text" in prepared.held else connected(flow, prepared.cond)
    state = model.xdit_ltx_state
    state.update(a2v=(gates[0] * mult, cross / mult), v2a=(gates[1] * mult, cross / mult))
    perturbed = []   # STG's pass: these blocks' self-attentions pass their values through
    if "stg" in extras:
        blocks = model.transformer_blocks
        perturbed = [a for b in sorted({int(b) for b in extras["stg"][0].tolist()}) if 0 <= b < len(blocks)
                     for a in (blocks[b].attn1, blocks[b].audio_attn1)]
    coupled = "coupled" not in extras or bool(extras["coupled"][0] != 0)   # (host values: nothing waits)
    if tracked:   # the guides' attention weights as log weights in the model's dtype (log_weights)
        state["guide"] = GuideBias(kept - guides, tracked, log_weights(extras["guide_weights"][0].to(device), dtype))
    try:
        for attn in perturbed:
            attn.xdit_perturbed = True
        v_out, a_out = model(
            hidden_states=v_rows, audio_hidden_states=a_rows,
            encoder_hidden_states=text["video_text"], audio_encoder_hidden_states=text["audio_text"],
            timestep=v_scaled, audio_timestep=a_scaled, sigma=sigma, audio_sigma=audio_sigma,
            video_coords=coords, audio_coords=a_coords, isolate_modalities=not coupled, video_keyframes_mask=marks,
            return_dict=False)
    finally:
        state.clear()
        for attn in perturbed:
            attn.xdit_perturbed = False
    a_out = a_out[:, refs:]
    if keep is not None:   # the dropped tokens' output: zeros
        v_out = v_out.new_zeros(n, frames * h * w, v_out.shape[-1]).index_copy(1, keep, v_out)
    v = v_out.reshape(n, frames, h, w, cv).permute(0, 4, 1, 2, 3)
    a = a_out.reshape(n, ta, ca, bins).permute(0, 2, 1, 3)
    return torch.cat([v.reshape(n, 1, -1), a.reshape(n, 1, -1)], dim=-1).to(x.dtype)


def _comfy_model(config: dict) -> tuple[str, dict]:
    return "LTXAV", {"image_model": "ltxav", "num_layers": config["num_layers"]}


def _linear_width(config: dict) -> float:
    """Weights a video token meets per block, in hidden^2: self-attention q, k, v, out (4), the text cross-attention's
    q and out (2), a2v's q and out and v2a's k and v (4 x audio / video width), the 4x feed-forward (8)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    audio = config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
    return 14 + 4 * audio / inner


FAMILY = Family(
    name="ltx23", title="LTX-2.3/2.5", variants=tuple(DIMS["full"]),
    variant_aliases={"ltx23": "ltx-2.3", "ltx2.3": "ltx-2.3", "ltx-2.3-22b": "ltx-2.3", "ltx25": "ltx-2.5",
                     "ltx2.5": "ltx-2.5", "ltx-2.5-22b": "ltx-2.5"},
    markers=(Marker("audio_adaln_single.linear.weight", "ltx"),),
    infer=infer, key_map=key_map, model_class=_model_class, gguf_arches=("ltxv",),
    compute_dtypes=("fp32", "bf16"), compute_dtypes_cite="comfy/supported_models.py:927 (LTXV, LTXAV's base)",
    layers=lambda config: config["num_layers"],
    latent=LTX_VIDEO, latent_patch=lambda config: 1, frames=True,
    sampling=lambda variant: FlowSampling.flux(SHIFT),
    comfy_model=_comfy_model,
    cond_width=lambda config: config["cross_attention_dim"] + config["audio_cross_attention_dim"],
    pooled_width=lambda config: None,
    takes_guidance=lambda config: False,
    forward=forward, cfg=1.0, text_tokens=TEXT_TOKENS, hold=_hold, fit_jobs=FIT_JOBS,
    shard_units=("video_connector", "audio_connector"),
    stock_jobs={v: StockJob(f"{v}-t2v", 640, 352, 8, 1.0, frames=121, shift=SHIFT, note="its first pass; the "
                            "second: --width 1280 --height 704 --steps 3") for v in DIMS["full"]},
    tokens=TokenTable(processor=LtxProcessor, gather_after="proj_out",
                      split_inputs=(("hidden_states", 1), ("video_coords", 2), ("timestep", 1),
                                    ("video_keyframes_mask", 1)),
                      local_keys=("transformer_blocks.*.video_to_audio_attn",),
                      blocks=("transformer_blocks",), kwargs_name="attention_kwargs"),
    linear_width=_linear_width,
    native_layout="ltx", dims=DIMS, shapes=shapes, rebuild_off_meta=_after_load, tiny_metadata=tiny_metadata,
    full_extras=("text_embedding_projection.video_aggregate_embed.weight",
                 "text_embedding_projection.audio_aggregate_embed.weight", "vae.decoder.conv_in.conv.weight",
                 "audio_vae.decoder.conv_in.conv.weight", "vocoder.conv_pre.weight"),
    packed_streams=True, extras=EXTRAS, host_extras=HOST_EXTRAS, call_extras=comfy_call,
    extra_tokens=_template_audio,
    local_key_queries=lambda config, latent_frames: (_template_audio(config, latent_frames),
                                                     config["audio_num_attention_heads"],
                                                     config["audio_attention_head_dim"]),
    describe_blocks=lambda c: (f"{c['num_layers']} audio-video blocks (video {c['num_attention_heads']} x "
                               f"{c['attention_head_dim']}, audio {c['audio_num_attention_heads']} x "
                               f"{c['audio_attention_head_dim']}) and two {c['connector_num_layers']}-block text "
                               f"connectors"),
    describe_conditioning=lambda c: (f"cond [1, L, {c['cross_attention_dim'] + c['audio_cross_attention_dim']}] "
                                     f"(Gemma {4 if ltx25.is_ltx25(c) else 3} through the file's text projection, "
                                     f"unprocessed), no pooled output; "
                                     f"latent: ComfyUI's packed video [1, 128, F, H/32, W/32] and audio "
                                     f"[1, 8, T, 16] (LTXVConcatAVLatent)"),
    text_encoder=lambda variant: ltx25.TEXT_ENCODER if variant == "ltx-2.5" else
    "Gemma 3 12B (LTXAVTextEncoderLoader, with the LTX-2.3 file's text projection)",
    comfyui_since=lambda variant: ltx25.COMFYUI_SINCE if variant == "ltx-2.5" else "0.33",
)
