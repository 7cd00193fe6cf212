"""Wan-Animate 2 (a variant of the Wan family: Wan 2.1 I2V 14B weights driven by a pose video): how the engine runs
ComfyUI's forward of it as one token sequence through the unmodified diffusers WanTransformer3DModel.

ComfyUI's conventions, read from ComfyUI 0.33.0 (first in 0.31.0, a464ac33 "Support Wan-Animate2"; also in
docs/families/wan.md):
- comfy/model_detection.py:780: the file is Animate 2 only by its header (`config` -> transformer.model_type
  "animate2"); the same tensors without it load as Wan 2.1 image-to-video. comfy/supported_models.py:1454
  WAN_Animate2: discrete flow, shift 5 (:1461).
- comfy/model_base.py:1827 WAN_Animate2: WAN21's c_concat and clip_fea, plus pose_latents (the pose video's latent,
  process_in'd, :1837), clip_fea_pose (:1841), context_pose (:1845: the positive prompt, on the negative pass too:
  comfy_extras/nodes_wan.py:1339), pose_strength and reference_strength (constants, passed only when not 1: :1847).
- comfy/ldm/wan/model_animate2.py: the generation latent's frame 0 is the reference image's slot (:282); the pose
  branch is the same blocks over the pose latents' tokens, input [pose | ones(4) | pose] (:303), timestep 1 (:313),
  its own text and image context (:328-332), plain self-attention among its tokens; its RoPE starts at frame 1 with
  columns shifted by the latent's width in patches (:261-264); per block its K/V feed the generation branch, whose
  frame j >= 1 attends every generation token plus pose frame j-1's tokens in one softmax, frame 0 every generation
  token (:61-71); the reference slot's values scaled by reference_strength (:49), the pose values (for the generation
  branch only) by pose_strength (:371); without pose latents (a step outside the node's pose window) the plain
  image-to-video forward.

The engine runs both branches as one sequence [generation tokens | pose tokens]: the two latents concatenated along
frames before the patch embedding (frame-local, so exactly each branch's tokens), a per-token timestep (the model
timestep, then 1), each branch's RoPE table, and an attention whose blocks of queries over keys hold exactly ComfyUI's
pairs: generation over generation, generation frame j over pose frame j-1, pose over pose, never pose over generation;
partial results merge through their log-sum-exp. Cross-attention gives each branch's rows its own context. So every
sequence-parallel plan (Ulysses, Ring, padded, and their mix), CFG and data parallel and divided weights run it
through the engine's one attention entry point and token split, unchanged.
"""
from __future__ import annotations

import contextlib
import json

import torch

from ..kernels import attention_with_lse, merge, removed_bias
from .base import forward_hook, job_state

ANIMATE2 = "wan-animate-2"
MODEL_TYPE = "animate2"          # the header's transformer.model_type (comfy/model_detection.py:779)
SHIFT = 5.0                      # supported_models.WAN_Animate2.sampling_settings
COMFYUI_SINCE = "0.31.0"         # a464ac33, first released in ComfyUI 0.31.0
POSE_TIMESTEP = 1.0              # model_animate2.py forward_orig: t_pose = ones
MASK_CHANNELS = 4                # the pose input's mask channels, all ones: every pose frame is known
# ComfyUI's WAN_Animate2.extra_conds, as its model hands them to the diffusion model (the strengths as floats)
EXTRAS = ("pose_latents", "clip_fea_pose", "context_pose", "pose_strength", "reference_strength")
HOST_EXTRAS = ("pose_strength", "reference_strength")
POSE_CACHE = "wan_animate2_pose"   # the job state's entry (families/base.py job_state)
# a forward's peak of live activations per token, in hidden widths (bf16): the Wan I2V file's measured 11.3
# (parallel/memory.py), assumed for this forward (its attention's float32 merge buffers, about 8 widths beside q, k, v,
# stay below the FFN's peak); the planner reads it from here
ACT_WIDTHS = 11.3
CACHE_SHARE = 0.8   # the pose cache and the first call's peak take at most this share of the memory free then


def stated(metadata: dict) -> bool:
    """The file's header says Animate 2 (as ComfyUI's detection reads it)."""
    config = metadata.get("config")
    if not isinstance(config, str):
        return False
    try:
        return (json.loads(config).get("transformer") or {}).get("model_type") == MODEL_TYPE
    except (ValueError, AttributeError):
        return False


def header() -> dict[str, str]:
    """The header entry ComfyUI reads an Animate 2 file by (make-tiny writes it)."""
    return {"config": json.dumps({"transformer": {"model_type": MODEL_TYPE}})}


class AnimateLayout:
    """One forward's sequence [generation (frames x hw) | pose ((frames - 1) x hw)] and the attention over it. `attend`
    is the bias interface of the sequence-parallel entry point (parallel/attention.py): queries from whole-sequence
    token q0 over keys from k0 -> (out fp32, log-sum-exp); rows a block gives no key (pad rows included among the pose
    rows) come back empty (0, the removed bias), which a merge passes over."""

    def __init__(self, frames: int, hw: int, pose: bool, pose_strength: float, reference_strength: float,
                 pose_context: torch.Tensor | None):
        self.frames, self.hw = frames, hw
        self.gen = frames * hw
        self.pose = (frames - 1) * hw if pose else 0
        self.pose_strength, self.reference_strength = pose_strength, reference_strength
        self.pose_context = pose_context   # the pose rows' cross-attention context (image tokens first), projected
        self.fill: PoseCache | None = None     # this forward runs the pose branch and keeps its K/V per block
        self.cached: PoseCache | None = None   # this forward's sequence is the video's alone: the pose K/V from here
        self.block = 0                         # the block whose self-attention runs (set by the processor)

    def attend(self, q, k, v, q0: int, k0: int, kernel=attention_with_lse):
        nq, nk, G = q.shape[1], k.shape[1], self.gen
        gq, gk = min(max(G - q0, 0), nq), min(max(G - k0, 0), nk)   # generation rows / keys in these blocks
        pk = min(max(G + self.pose - k0, 0), nk)                    # keys end (pose keys: gk .. pk)
        removed = removed_bias(torch.float32)
        if self.fill is not None and k0 == 0 and nk == G + self.pose:   # every key here: keep the pose branch's
            self.fill.put(self.block, k[:, G:], v[:, G:])
        outs, lses = [], []
        if gq:
            out = lse = None
            if gk:
                vg = v[:, :gk]
                ref = min(max(self.hw - k0, 0), gk)   # the reference slot's keys in this block
                if ref and self.reference_strength != 1.0:
                    vg = vg.clone()
                    vg[:, :ref] *= self.reference_strength
                out, lse = merge(None, None, *kernel(q[:, :gq], k[:, :gk], vg))
            if pk > gk:
                o, s = self._frame_local(q[:, :gq], q0, k[:, gk:pk], v[:, gk:pk], k0 + gk, kernel, removed)
                out, lse = merge(out, lse, o, s)
            elif self.cached is not None and k0 == 0:   # the pose keys kept from the job's first call, once a row
                kp, vp = self.cached.kv[self.block]
                o, s = self._frame_local(q[:, :gq], q0, kp, vp, G, kernel, removed)
                out, lse = merge(out, lse, o, s)
            if out is None:
                out, lse = self._empty(q[:, :gq], removed)
            outs.append(out)
            lses.append(lse)
        if nq > gq:
            if pk > gk:
                out, lse = merge(None, None, *kernel(q[:, gq:], k[:, gk:pk], v[:, gk:pk]))
            else:
                out, lse = self._empty(q[:, gq:], removed)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)

    @staticmethod
    def _empty(q, removed):
        b, n, h, d = q.shape
        return q.new_zeros(b, n, h, d, dtype=torch.float32), q.new_full((b, h, n), removed, dtype=torch.float32)

    def _frame_local(self, q, q0, k, v, p0, kernel, removed):
        """Generation queries (whole-sequence tokens q0..) over pose keys (from token p0): query frame j >= 1 over
        pose frame j - 1's keys only. Runs of whole frames on both sides go through the kernel as one batch (frames as
        batch items); partial frames at a block's edges alone."""
        b, nq, h, d = q.shape
        hw, G = self.hw, self.gen
        v = v * self.pose_strength if self.pose_strength != 1.0 else v
        out, lse = self._empty(q, removed)
        pieces = []   # (query frame, query rows, key rows) relative to the blocks
        for j in range(max(1, q0 // hw), (q0 + nq - 1) // hw + 1):
            qa, qb = max(j * hw, q0) - q0, min((j + 1) * hw, q0 + nq) - q0
            ka, kb = max(G + (j - 1) * hw, p0) - p0, min(G + j * hw, p0 + k.shape[1]) - p0
            if qb > qa and kb > ka:
                pieces.append((j, qa, qb, ka, kb))
        i = 0
        while i < len(pieces):
            run = i
            while run < len(pieces) and pieces[run][2] - pieces[run][1] == hw \
                    and pieces[run][4] - pieces[run][3] == hw \
                    and (run == i or pieces[run][0] == pieces[run - 1][0] + 1):
                run += 1
            if run > i:   # whole frames: one batched call
                n = run - i
                qa, ka = pieces[i][1], pieces[i][3]
                qs = q[:, qa:qa + n * hw].reshape(b * n, hw, h, d)
                ks, vs = (t[:, ka:ka + n * hw].reshape(b * n, hw, h, d) for t in (k, v))
                o, s = kernel(qs, ks, vs)
                out[:, qa:qa + n * hw] = o.reshape(b, n * hw, h, d).float()
                lse[:, :, qa:qa + n * hw] = s.reshape(b, n, h, hw).permute(0, 2, 1, 3).reshape(b, h, n * hw)
                i = run
                continue
            _, qa, qb, ka, kb = pieces[i]
            o, s = kernel(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb])
            out[:, qa:qb], lse[:, :, qa:qb] = o.float(), s
            i += 1
        return out, lse

    def rows(self, offset: int, count: int) -> int:
        """How many of `count` local rows starting at whole-sequence token `offset` are generation rows."""
        return min(max(self.gen - offset, 0), count)


class PoseCache:
    """The pose branch's keys and values at every block's self-attention, kept for a job: the branch's inputs (the pose
    latents, its prompt and CLIP-vision output) are the same every step and its timestep is fixed at 1, so they are
    too (ComfyUI's WanAnimate2Cache keeps its block inputs for the same reason). Filled by the job's first forward with
    pose inputs, which runs the whole sequence; later forwards with the same inputs run the video's tokens alone and
    read the pose keys from here. Held where the attention has every key: one rank, or after Ulysses' exchange (this
    rank's heads of every pose token); `key` names the inputs (their tensors kept alive in `keep`, so an identity
    cannot be reused while the entry lives)."""

    def __init__(self, key, keep, blocks: int):
        self.key, self.keep = key, keep
        self.kv: list = [None] * blocks

    def put(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[block] = (k.clone(), v.clone())   # not views of the exchange's buffer (q would stay alive with them)

    @property
    def filled(self) -> bool:
        return all(e is not None for e in self.kv)


def _identity(t: torch.Tensor):
    base = t._base if t._base is not None else t
    return (id(base), t.storage_offset(), tuple(t.shape), t.dtype), base


def pose_cache_for(flow, processors, prepared, extras, n: int, frames: int, hw: int) -> tuple:
    """(the cache this forward reads, the cache it fills): one or neither. The cache applies where every key reaches
    one attention call (one rank, Ulysses; not Ring, whose blocks of keys travel) and where there is room for it."""
    attention = [p.attention for p in processors if p.attention is not None]
    if any(a.ring.size > 1 or a.stale is not None for a in attention):
        return None, None
    used = [extras["pose_latents"], extras.get("context_pose", prepared.cond),
            extras.get("clip_fea_pose", prepared.image_context)]
    idents = [_identity(t) for t in used if t is not None]
    key = (tuple(i for i, _ in idents), n, frames, hw)
    state = job_state(flow.model)
    entry = state.get(POSE_CACHE)
    if entry is not None and entry.key == key and entry.filled:
        return entry, None
    state.pop(POSE_CACHE, None)   # other pose inputs: the old entry goes before the new is made
    config = flow.model.config
    ulysses = attention[0].ulysses.size if attention else 1
    width = config.num_attention_heads * config.attention_head_dim
    need = 2 * n * (frames - 1) * hw * (width // ulysses) * flow.dtype.itemsize * len(flow.model.blocks)
    # the first call's own peak (both branches' tokens, this rank's share) is live beside the cache as it fills
    peak = ACT_WIDTHS * n * (2 * frames - 1) * hw / ulysses * width * flow.dtype.itemsize
    if need + peak > CACHE_SHARE * free_bytes(flow.device):
        return None, None
    entry = state[POSE_CACHE] = PoseCache(key, [b for _, b in idents], len(flow.model.blocks))
    return None, entry


def free_bytes(device: torch.device) -> int:
    """Memory free for the cache on `device`: the GPU's free memory and what torch's allocator holds unused (a driver
    query, no wait on the stream); the host's available memory for CPU ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rope_tables(rope, frames: int, ph: int, pw: int, pose: bool):
    """ComfyUI's RoPE of both branches from diffusers' WanRotaryPosEmbed tables (the same float64 angles, looked up at
    ComfyUI's integer positions): generation frames 0.., rows 0.., columns 0..; pose frames 1.., columns pw..
    (rope_encode_pose: t_start 1, shift_x the width in patches). (cos, sin), each [1, tokens, 1, head_dim]."""
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]

    def table(freqs, f0, nf, w0):
        t, hh, ww = freqs.split(sizes, dim=1)
        parts = [t[f0:f0 + nf].view(nf, 1, 1, -1).expand(nf, ph, pw, -1),
                 hh[:ph].view(1, ph, 1, -1).expand(nf, ph, pw, -1),
                 ww[w0:w0 + pw].view(1, 1, pw, -1).expand(nf, ph, pw, -1)]
        return torch.cat(parts, dim=-1).reshape(1, nf * ph * pw, 1, -1)
    out = []
    for freqs in (rope.freqs_cos, rope.freqs_sin):
        gen = table(freqs, 0, frames, 0)
        out.append(torch.cat([gen, table(freqs, 1, frames - 1, pw)], dim=1) if pose else gen)
    return tuple(out)


def strength(extras: dict, name: str) -> float:
    """A constant of the call (host memory: reading it waits for nothing); 1 when ComfyUI passed none."""
    t = extras.get(name)
    return 1.0 if t is None else float(t.reshape(-1)[0])


def animate_forward(flow, x: torch.Tensor, timestep: torch.Tensor, prepared, processors, pad_to_patches,
                    comfys_sinusoid) -> torch.Tensor:
    """v for the generation latent x [n, 36, F, h, w] (frame 0 the reference slot) under ComfyUI's Animate 2 forward:
    see the module. timestep: [n] (the model timestep)."""
    model = flow.model
    extras = prepared.extras or {}
    frames, h, w = x.shape[2:]
    pose = extras.get("pose_latents")
    if timestep.ndim != 1:
        raise ValueError("Wan-Animate 2 takes one timestep per row, not one per frame")
    if pose is not None and pose.shape[2] != frames - 1:
        raise ValueError(f"the pose video's latent has {pose.shape[2]} frames for a latent of {frames} (the reference "
                         f"image's slot and {frames - 1} more): give WanAnimate2ToVideo the same length for both")
    if pose is not None and tuple(pose.shape[3:]) != (h, w):
        raise ValueError(f"the pose video's latent is {list(pose.shape[3:])} for a latent of {[h, w]}: encode it at "
                         f"the video's size (WanAnimate2ToVideo does)")
    image = prepared.image_context
    if image is None:
        raise ValueError("this Wan-Animate 2 model needs CLIP-vision features (clip_vision_output): connect "
                         "CLIPVisionEncode to WanAnimate2ToVideo")
    n = x.shape[0]
    ph, pw = -(-h // 2), -(-w // 2)
    hw = ph * pw
    cached = fill = None
    if pose is not None:
        cached, fill = pose_cache_for(flow, processors, prepared, extras, n, frames, hw)
    seq = x
    if pose is not None and cached is None:
        pose = pose.to(x.dtype)
        seq = torch.cat([x, torch.cat([pose, torch.ones_like(pose[:, :MASK_CHANNELS]), pose], dim=1)], dim=2)
    seq = pad_to_patches(seq)
    in_sequence = pose is not None and cached is None   # the pose tokens run in this forward
    pose_context = None
    embedder = model.condition_embedder
    if in_sequence:
        context_pose = extras.get("context_pose")
        context_pose = (prepared.cond if context_pose is None else context_pose).to(flow.dtype)
        clip_pose = extras.get("clip_fea_pose")
        clip_pose = prepared.image_context if clip_pose is None else clip_pose.to(flow.dtype)
        pose_context = embedder.text_embedder(context_pose)
        if clip_pose is not None and embedder.image_embedder is not None:
            pose_context = torch.cat([embedder.image_embedder(clip_pose), pose_context], dim=1)
    layout = AnimateLayout(frames, hw, pose is not None, strength(extras, "pose_strength"),
                           strength(extras, "reference_strength"), pose_context)
    layout.cached, layout.fill = cached, fill
    t = timestep.to(torch.float32).reshape(n, 1).expand(n, layout.gen)
    if in_sequence:
        t = torch.cat([t, t.new_full((n, layout.pose), POSE_TIMESTEP)], dim=1)
    clip_tokens = image.shape[1]
    if pose is not None and extras.get("clip_fea_pose") is not None and extras["clip_fea_pose"].shape[1] != clip_tokens:
        raise ValueError("the pose branch's CLIP-vision output has another token count than the reference image's: "
                         "encode both with the same CLIP vision model")
    for p in processors:
        p.image_tokens = clip_tokens
        p.animate = layout
    for i, block in enumerate(model.blocks):   # which block's keys a self-attention call holds (the pose cache)
        block.attn1.xdit_block = i
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(comfys_sinusoid(embedder, flow.dtype))
            stack.enter_context(forward_hook(model.rope, lambda module, args, out: rope_tables(
                module, frames, ph, pw, in_sequence), prepend=True))
            out = model(hidden_states=seq, timestep=t, encoder_hidden_states=prepared.cond,
                        encoder_hidden_states_image=image, return_dict=False)[0]
    finally:
        for p in processors:
            p.animate = None
    return out[:, :, :frames, :h, :w]


def cross_rows(processor, attn, hidden_states, encoder_hidden_states, cross):
    """Cross-attention of a block's local rows, each branch's rows over its own context: generation rows over the
    forward's context, pose rows (and pad rows) over the pose context. `cross(attn, rows, context)` is the plain
    cross-attention."""
    layout = processor.animate
    count = hidden_states.shape[1]
    offset = 0
    if processor.attention is not None:   # this rank's shard: equal shares in sequence-parallel rank order
        offset = processor.attention.mesh["sp"].rank * count
    g = layout.rows(offset, count)
    if g == count or layout.pose_context is None:
        return cross(attn, hidden_states, encoder_hidden_states)
    parts = []
    if g:
        parts.append(cross(attn, hidden_states[:, :g], encoder_hidden_states))
    parts.append(cross(attn, hidden_states[:, g:], layout.pose_context))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def local(layout: AnimateLayout, q, k, v):
    """The whole sequence on one rank: the layout's attention with every query over every key."""
    return layout.attend(q, k, v, 0, 0)[0].to(q.dtype)

