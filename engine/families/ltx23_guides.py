"""LTX-2.3's guides (LTXVAddGuide): what ComfyUI's LTX model reads of them, and their attention bias computed as the
few guide keys need it, on the fast kernels everywhere else.

ComfyUI's side (C = ComfyUI 0.33.0): C/comfy_extras/nodes_lt.py:250-497 (LTXVAddGuide: guide latent frames appended to
the video latent, keyframe_idxs, guide_attention_entries with each guide's strength and pixel mask); the model's side
C/comfy/ldm/lightricks/model.py:1108-1170 (the guide tokens, the tokens a negative noise mask drops), 1229-1320 (their
positions), 370-421 (GuideAttentionMask: where a guide's strength is not 1 or it has a pixel attention mask, each
tracked guide token's weight w enters the video self-attention as log w, 0 -> the dtype's lowest: on the guide keys
for the generated queries, on the generated keys for that guide's queries).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import attention_with_lse, merge, removed_bias


def log_weights(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tracked guide tokens' weights as the attention's additive bias: log w computed in float32 (the weights are
    ComfyUI's float64 values; rounding them to bf16 first moves log w by up to 0.4%), a weight of 0 (the guide not
    seen) the removing bias, then cast to the attention's dtype."""
    return torch.log(weights.float()).clamp(min=removed_bias(dtype)).to(dtype)


class GuideBias:
    """The guides' additive self-attention bias (GuideAttentionMask) in the whole sequence's token coordinates: tokens
    [start, start + count) are tracked guide tokens with log weights `log_w` [count] (log_weights: on the device, the
    attention's dtype). A query before `start` gets L(j) on each key j; a tracked query i gets L(i) on each key before
    `start`; every other pair 0 (L: log_w on the tracked tokens, 0 elsewhere).

    Only the few guide keys carry a bias, so a block of queries over a block of keys is computed in pieces merged
    through their log-sum-exp: the generated queries over the unbiased keys on the fast kernels (no mask), and over
    the tracked guide keys alone through a mask-taking kernel with that short row of weights; a tracked query's bias
    is one constant over the keys before `start`, so its piece there runs unmasked and the constant is added to the
    piece's log-sum-exp (the output does not change). A piece whose keys the bias removes entirely (every weight 0)
    counts as empty (output 0, log-sum-exp the removing bias) whatever a kernel reports for a fully masked row. The
    pieces of each block shape are laid out once a forward (the bias is made per forward and every layer shares them);
    everything is shaped from host integers: nothing reads the device."""

    def __init__(self, start: int, count: int, log_w: torch.Tensor):
        self.start, self.count, self.log_w = start, count, log_w
        self.removed = removed_bias(log_w.dtype)
        self._made: dict = {}

    def groups(self, q0: int, nq: int, k0: int, nk: int) -> list:
        """Queries [q0, q0 + nq) over keys [k0, k0 + nk) as (first, end, pieces): row ranges of the queries (local),
        each with the pieces its softmax is merged from: (first key, end key, mask row or None, shift or None, removed
        or None) (a mask row [1, 1, 1, keys padded to 16]; a shift [rows] added to the piece's log-sum-exp; removed: a
        0-d bool, every key of the piece removed)."""
        key = (q0, nq, k0, nk)
        if key not in self._made:
            self._made[key] = self._groups(q0, nq, k0, nk)
        return self._made[key]

    def _groups(self, q0: int, nq: int, k0: int, nk: int) -> list:
        start, end, lw = self.start, self.start + self.count, self.log_w
        a, b = min(max(start - k0, 0), nk), min(max(end - k0, 0), nk)   # this block's tracked guide keys, [a, b)

        def plain(lo, hi):
            return [(lo, hi, None, None, None)] if hi > lo else []
        out = []
        noisy = (q0, min(q0 + nq, start))
        if noisy[1] > noisy[0]:   # the unbiased keys on either side, and the tracked guide keys with their weights
            pieces = plain(0, a) + plain(b, nk)
            if b > a:
                row = lw.new_zeros(1, 1, 1, -(-(b - a) // 16) * 16)   # stored aligned for the CUDA kernel
                row[..., :b - a] = lw[k0 + a - start:k0 + b - start]
                pieces.append((a, b, row, None, row[..., :b - a].amax() <= self.removed))
            out.append((noisy[0] - q0, noisy[1] - q0, pieces))
        tracked = (max(q0, start), min(q0 + nq, end))
        if tracked[1] > tracked[0]:   # each tracked query's own weight, one constant over the keys before start
            pieces = plain(a, nk)
            if a:
                pieces.append((0, a, None, lw[tracked[0] - start:tracked[1] - start].float(), None))
            out.append((tracked[0] - q0, tracked[1] - q0, pieces))
        rest = max(q0, end)
        if rest < q0 + nq:   # untracked guide tokens (and pad rows): no bias
            out.append((rest - q0, nq, plain(0, nk)))
        return out

    def attend(self, q, k, v, q0: int, k0: int, kernel=attention_with_lse):
        """Queries starting at token q0 over keys starting at k0 under this bias: (out fp32, log-sum-exp), by query
        group in the queries' order. kernel(q, k, v, mask or None) -> (out, log-sum-exp): attention_with_lse."""
        outs, lses = [], []
        for first, end, pieces in self.groups(q0, q.shape[1], k0, k.shape[1]):
            queries = q[:, first:end]
            out = lse = None
            for lo, hi, mask, shift, removed in pieces:
                o, s = kernel(queries, k[:, lo:hi], v[:, lo:hi], mask)
                if shift is not None:
                    s = s + shift
                if removed is not None:
                    o, s = torch.where(removed, 0.0, o), torch.where(removed, self.removed, s)
                out, lse = merge(out, lse, o, s)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def mask_per_token(mask: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
    """LTXVAddGuide's attention mask (pixels [B, 1, F', H', W'], values in [0, 1]) as one weight per latent token of
    a guide of frames x h x w latents, as ComfyUI's LTX model reduces it (model.py _downsample_mask_to_latent): each
    pixel frame's area average over the latent grid; the first pixel frame is the first latent frame, the others
    averaged in whole groups of (F' - 1) // (frames - 1) (the frames past the last whole group left out), or, with
    fewer pixel frames than latent frames, repeated nearest; one pixel frame repeated over all latent frames.
    [B, frames * h * w]."""
    b, _, pixel_frames = mask.shape[:3]
    area = F.interpolate(mask.flatten(0, 2).unsqueeze(1), size=(h, w), mode="area").reshape(b, pixel_frames, h, w)
    first, rest = area[:, :1], area[:, 1:]
    if frames == 1:
        latent = first
    elif pixel_frames == 1:
        latent = first.expand(b, frames, h, w)
    else:
        group = (pixel_frames - 1) // (frames - 1)
        if group < 1:
            spread = F.interpolate(rest.permute(0, 2, 3, 1).reshape(-1, 1, pixel_frames - 1), size=frames - 1,
                                   mode="nearest")
            rest = spread.reshape(b, h, w, frames - 1).permute(0, 3, 1, 2)
        else:
            rest = rest[:, :(frames - 1) * group].reshape(b, frames - 1, group, h, w).mean(dim=2)
        latent = torch.cat([first, rest], dim=1)
    return latent.reshape(b, -1)


def guide_extras(shape: tuple, keyframes: torch.Tensor, entries, mask) -> tuple[dict, torch.Tensor]:
    """LTXVAddGuide's guides as the engine's extras (see EXTRAS), and which video tokens the model keeps ([N] bool),
    as ComfyUI's LTX model reads them (model.py 1108-1170, 1229-1320): the tokens under a negative noise mask value
    dropped (row 0's mask), the kept guide tokens' positions taken from keyframe_idxs, and, where a guide's strength is
    not 1 or it has an attention mask, one weight per tracked guide token (its entry's strength, times its attention
    mask reduced to the latent grid)."""
    rows, _, frames, h, w = shape
    count, per_frame = keyframes.shape[2], h * w
    if count % per_frame:
        raise ValueError(f"keyframe_idxs holds {count} guide tokens, not a whole number of {per_frame}-token latent "
                         f"frames: the guides were added at another resolution than the latent's; crop the guides "
                         f"(LTXVCropGuides) before upscaling the latent")
    if mask is None:
        raise ValueError("LTXVAddGuide's guide frames without the latent's noise mask (the guide node sets one)")
    m = torch.as_tensor(mask).detach()[0].to("cpu", torch.float32)
    keep = ~(m.expand(m.shape[0], frames, h, w) < 0).any(dim=0).reshape(-1)
    guide_keep = keep[-count:]
    coords = torch.as_tensor(keyframes).detach().to("cpu", torch.float64)[..., guide_keep, :]
    kept_guides = coords.shape[2]
    if coords.shape[0] not in (1, rows):
        raise ValueError(f"keyframe_idxs of {coords.shape[0]} rows for a call of {rows}")
    weights = []
    if entries:
        total = sum(int(e["pre_filter_count"]) for e in entries)
        if total != count:
            raise ValueError(f"the guides' token counts ({total}) are not keyframe_idxs' ({count} guide tokens)")
        if any(float(e["strength"]) != 1.0 or e.get("pixel_mask") is not None for e in entries):
            offset = 0
            for e in entries:
                size = int(e["pre_filter_count"])
                surviving = int(guide_keep[offset:offset + size].sum())
                offset += size
                if not surviving:
                    continue
                strength = float(e["strength"])
                pixel, latent_shape = e.get("pixel_mask"), e.get("latent_shape")
                if pixel is not None and latent_shape is not None:
                    per_token = mask_per_token(torch.as_tensor(pixel).detach().to("cpu", torch.float32),
                                               *(int(v) for v in latent_shape))[:1]
                    weights.append(per_token[0, :surviving].to(torch.float64) * strength)
                else:
                    weights.append(torch.full((surviving,), strength, dtype=torch.float64))
    tracked = torch.cat(weights) if weights else torch.zeros(0, dtype=torch.float64)
    if bool((tracked == 1.0).all()):   # every weight 1: no bias
        tracked = tracked[:0]
    kept = int(keep.sum())
    f64 = torch.float64
    extras = {"guide": torch.tensor([[kept_guides, tracked.shape[0], kept]], dtype=f64).expand(rows, -1)}
    if kept_guides:
        extras["guide_coords"] = coords.reshape(coords.shape[0], -1).expand(rows, -1)
    if tracked.shape[0]:
        extras["guide_weights"] = tracked.reshape(1, -1).expand(rows, -1)
    if kept < keep.shape[0]:
        extras["keep"] = keep.to(f64).reshape(1, -1).expand(rows, -1)
    return extras, keep


