"""The one attention entry point: local, Ulysses (yunchang's all-to-all), Ring (exact log-sum-exp merge), and any
mix, over image tokens sharded across the sequence-parallel ranks, with optional joint text tokens that every
rank holds in full (their K/V enter each softmax exactly once; their queries see every key).

Tensors are (batch, tokens, heads, head_dim), diffusers' layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from yunchang.comm.all_to_all import all_to_all_4D

from .mesh import Mesh

try:  # optional extra, CUDA only: pip install flash-attn
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp (batch, heads, tokens; fp32), from a kernel that returns a real one
    (yunchang's TORCH_MATH returns zeros, which breaks any ring merge)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.is_cuda and half and flash_attn_func is not None:
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)  # takes (batch, tokens, heads, dim) as is
        return out, lse.float()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)[:2]
    elif half:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True)[:2]
    return out.transpose(1, 2), lse[..., :q.shape[1]].float()  # the efficient kernel pads its LSE


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint key sets."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out.float() * w_new, new_lse


class SequenceParallelAttention:
    """comm_only skips the attention arithmetic (the output is the queries) and keeps every collective, for the
    communication benchmark at full model size on CPU ranks."""

    def __init__(self, mesh: Mesh, comm_only: bool = False, stale=None):
        """stale: a PipeFusion K/V buffer (pipefusion.StaleKV) this layer attends through: the call's fresh keys are
        written into it and the queries see all of it (the other patches' keys from their latest call)."""
        self.mesh = mesh
        self.comm_only = comm_only
        self.stale = stale
        self.ulysses = mesh["ulysses"]
        self.ring = mesh["ring"]

    def __call__(self, q, k, v, joint: tuple | None = None):
        """q, k, v: this rank's image-token shard (all heads). joint: text (q, k, v), full on every rank.
        Returns (image out shard, text out or None), all heads."""
        u = self.ulysses
        if u.size > 1:
            sent = sum(t.numel() * t.element_size() for t in (q, k, v)) * (u.size - 1) // u.size
            self.mesh.stats.add("ulysses_all_to_all", sent)
            q, k, v = (all_to_all_4D(t.contiguous(), scatter_idx=2, gather_idx=1, group=u.pg) for t in (q, k, v))
            if joint is not None:
                heads = q.shape[2]
                joint = tuple(t[:, :, u.rank * heads:(u.rank + 1) * heads] for t in joint)
        n_text = joint[0].shape[1] if joint is not None else 0   # text queries (0: none in this call)
        text_kv = (joint[1], joint[2]) if n_text else None
        if self.stale is not None:
            text_kv, k, v = self.stale.update(k, v, text_kv)
        queries = torch.cat([joint[0], q], dim=1) if n_text else q
        keys = torch.cat([text_kv[0], k], dim=1) if text_kv is not None else k
        values = torch.cat([text_kv[1], v], dim=1) if text_kv is not None else v
        if self.comm_only:
            out = queries.clone()
            if self.ring.size > 1:
                self._ring(queries, keys, values, k, v)
        elif self.ring.size == 1:
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (queries, keys, values))).transpose(1, 2)
        else:
            out = self._ring(queries, keys, values, k, v)
        text_out, image_out = out[:, :n_text], out[:, n_text:]
        if u.size > 1:
            self.mesh.stats.add("ulysses_all_to_all", image_out.numel() * image_out.element_size() * (u.size - 1) // u.size)
            image_out = all_to_all_4D(image_out.contiguous(), scatter_idx=1, gather_idx=2, group=u.pg)
            if n_text:
                text_out = self.mesh.all_gather(text_out.contiguous(), "ulysses", dim=2, kind="ulysses_text_gather")
            elif joint is not None:   # no text queries in this call: an empty text output of every head
                text_out = image_out.new_zeros(image_out.shape[0], 0, *image_out.shape[2:])
        return image_out, (text_out if joint is not None else None)

    def _ring(self, queries, keys0, values0, k, v):
        """Step 0 uses this rank's keys (text included, once); then the image K/V of every other ring member
        arrives in turn. Partial results merge exactly through their log-sum-exp."""
        r = self.ring
        kernel = attention_with_lse if not self.comm_only else \
            (lambda q, k, v: (q, torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)))
        out, lse = _merge(None, None, *kernel(queries, keys0, values0))
        kv = torch.stack([k, v]).contiguous()
        nxt, prv = r.ranks[(r.rank + 1) % r.size], r.ranks[(r.rank - 1) % r.size]
        for _ in range(r.size - 1):
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, nxt, group=r.pg), dist.P2POp(dist.irecv, incoming, prv, group=r.pg)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            self.mesh.stats.add("ring_p2p", kv.numel() * kv.element_size())
            kv = incoming
            out, lse = _merge(out, lse, *kernel(queries, kv[0], kv[1]))
        return out.to(queries.dtype)
