"""GGUF quantizers (numpy) that write valid blocks for test files (make-tiny): each format's layout as ggml defines it,
the K-quants' asymmetric scales found the simple way; their quality does not matter."""
from __future__ import annotations

import numpy as np

from .quantized import BLOCKS


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 2k) 4-bit values -> (n, k) bytes: the first k in the low nibbles, the second k in the high ones."""
    k = q.shape[1] // 2
    return (q[:, :k] | (q[:, k:] << 4)).astype(np.uint8)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of _scale_min_k4: 8 six-bit scales and mins per block -> 12 bytes."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _k_asymmetric(x: np.ndarray, levels: int):
    """Q4_K/Q5_K: per 32-value sub-block, q = round((x - min) / step) with 6-bit scale and min indices."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    step = (sub.max(axis=2) - lo) / levels
    d = (step.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.rint(np.where(d[:, None] > 0, step / d[:, None], 0)), 0, 63).astype(np.uint8)
        mn = np.clip(np.rint(np.where(dmin[:, None] > 0, -lo / dmin[:, None], 0)), 0, 63).astype(np.uint8)
        scale = d[:, None] * sc
        q = np.rint(np.where(scale[..., None] > 0, (sub + (dmin[:, None] * mn)[..., None]) / scale[..., None], 0))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(-1, 4, 2, 32)     # group g: sub-blocks 2g, 2g+1
    return d, dmin, sc, mn, q


def _quantize_q4_k(x):
    d, dmin, sc, mn, q = _k_asymmetric(x, 15)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, mn), qs], axis=1)


def _quantize_q5_k(x):
    d, dmin, sc, mn, q = _k_asymmetric(x, 31)
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)                                    # bit j of byte l: sub-block j, element l
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j] << j).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, mn), qh, qs], axis=1)


def _quantize_q6_k(x):
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = (step.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.rint(np.where(d[:, None] > 0, step / d[:, None], 0)), -128, 127).astype(np.int8)
        scale = d[:, None] * sc
        q = np.rint(np.where(scale[..., None] != 0, sub / scale[..., None], 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, quarter, element
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_OWN_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 array (rows, n) -> GGUF bytes (rows, n / block * bytes): gguf's own numpy quantizers where it has
    them (legacy quants, floats), ours for the K-quants, which the gguf package cannot write."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype in _OWN_QUANTIZERS:
        _, size, nbytes = BLOCKS[qtype]
        return _OWN_QUANTIZERS[qtype](x.reshape(-1, size)).reshape(*x.shape[:-1], x.shape[-1] // size * nbytes)
    import gguf
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
