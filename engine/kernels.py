"""Local attention kernels that return a log-sum-exp, and the exact merge of two partial softmax results: the pieces
sequence parallel (parallel/attention.py) and a family's attention bias (families/ltx23_guides.py) compute a block
with. Tensors are (batch, tokens, heads, head_dim), diffusers' layout; a log-sum-exp is (batch, heads, tokens), fp32.

An out-of-memory error is never caught here: falling back to another kernel (the written-out one needs far more
memory) would only hide the first error behind a bigger one.
"""
from __future__ import annotations

import torch

try:  # optional extra, CUDA only: pip install flash-attn
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


def removed_bias(dtype: torch.dtype) -> float:
    """The additive bias that removes a key: a quarter of the dtype's lowest. exp of it underflows to exactly 0 beside
    any real score, and it stays finite through the CUDA kernels' log2(e) scaling (the dtype's lowest itself becomes
    -inf there, and a row of such keys then reports a log-sum-exp a merge cannot use)."""
    return torch.finfo(dtype).min / 4


def _cudnn(q, k, v):
    b, s, h, _ = q.shape
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), None, True, 0.0, False, False)[:2]
    return out.transpose(1, 2), lse.reshape(b, h, -1)[..., :s].float()   # cuDNN may keep a trailing dim of 1


def _flash_attn(q, k, v):
    if flash_attn_func is None:
        raise NotImplementedError("flash-attn is not installed")
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)  # takes (batch, tokens, heads, dim) as is
    return out, lse.float()


def _aten(op, q, k, v, *extra):
    out, lse = op(*(t.transpose(1, 2) for t in (q, k, v)), *extra)[:2]
    return out.transpose(1, 2), lse[..., :q.shape[1]].float()   # the efficient kernel pads its LSE


# CUDA half-precision kernels that return a log-sum-exp, fastest first (FLUX.1-dev on one H100: cuDNN 183 ms a step,
# flash 207); the first that takes a call's shapes is remembered per device, dtype and head width
HALF_KERNELS = {"cudnn": _cudnn, "flash-attn": _flash_attn,
                "flash": lambda q, k, v: _aten(torch.ops.aten._scaled_dot_product_flash_attention, q, k, v)}
_CHOSEN: dict = {}


def _math_with_lse(q, k, v, mask):
    """Softmax attention with an additive mask and its log-sum-exp, written out (where no fused kernel takes the mask)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5 + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


def _masked_with_lse(q, k, v, mask):
    """attention_with_lse under an additive mask (broadcast to batch, heads, queries, keys; its key axis may be longer
    than the keys, e.g. stored padded to a multiple of 16 once for the CUDA kernel's alignment: the first keys' part is
    used): on the CPU torch's CPU flash kernel, on CUDA the efficient kernel (its bias laid out as it requires: the key
    axis padded to a multiple of 16 and sliced back), the written-out arithmetic where the kernel refuses the shapes."""
    n = k.shape[1]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask[..., :n])
        return out.transpose(1, 2), lse[..., :q.shape[1]].float()
    b, s, h, _ = q.shape
    if mask.shape[-1] < -(-n // 16) * 16:   # not stored aligned: padded here
        padded = mask.new_zeros(*mask.shape[:-1], -(-n // 16) * 16)
        padded[..., :n] = mask[..., :n]
        mask = padded
    try:
        return _aten(torch.ops.aten._scaled_dot_product_efficient_attention, q, k, v,
                     mask[..., :n].expand(b, h, s, n), True)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:   # shapes the kernel does not take
        return _math_with_lse(q, k, v, mask[..., :n])


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp (batch, heads, tokens; fp32), from a kernel that returns a real one
    (yunchang's TORCH_MATH returns zeros, which breaks any ring merge): on CUDA in half precision the fastest of
    HALF_KERNELS that takes these shapes, in fp32 the efficient kernel; on the CPU torch's CPU flash kernel. With an
    additive `mask`: _masked_with_lse."""
    if mask is not None:
        return _masked_with_lse(q, k, v, mask)
    if q.device.type == "cpu":
        return _aten(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return _aten(torch.ops.aten._scaled_dot_product_efficient_attention, q, k, v, None, True)
    key = (q.device, q.dtype, q.shape[-1])
    chosen = _CHOSEN.get(key)
    order = ([chosen] if chosen else []) + [name for name in HALF_KERNELS if name != chosen]
    error = None
    for name in order:
        try:
            result = HALF_KERNELS[name](q, k, v)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError) as e:   # this kernel does not take these shapes on this GPU
            error = error or e
            continue
        _CHOSEN[key] = name
        return result
    raise error


def merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint key sets (out None: the first): the block's share of the whole
    is sigmoid(block_lse - lse), so the merged output is one lerp and the merged log-sum-exp one logaddexp (three
    elementwise kernels, stable for any gap between the two, a block whose keys a bias all but removed included (its
    log-sum-exp near the bias); under compile they fuse with the blocks' graphs). The output is fp32."""
    if out is None:
        return block_out.float(), block_lse
    share = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)
    return torch.lerp(out, block_out.float(), share), torch.logaddexp(lse, block_lse)
