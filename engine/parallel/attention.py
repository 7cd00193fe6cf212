"""The one attention entry point: local, Ulysses (q, k and v exchanged in one all-to-all, the output back through
yunchang's), Ring (each hop posted ahead of the block in hand, exact log-sum-exp merge), and any mix, over image
tokens sharded across the sequence-parallel ranks, with optional joint text tokens that every rank holds in full
(their K/V enter each softmax exactly once; their queries see every key). Image tokens the degree does not divide
arrive padded (parallelize.py): the last sequence-parallel rank's shard ends in `pad_tokens` rows, which no softmax
sees as keys (their query rows are computed and dropped at the gather). Nothing here reads a tensor on the host or
waits on the host for a transfer.

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


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp (batch, heads, tokens; fp32), from a kernel that returns a real one
    (yunchang's TORCH_MATH returns zeros, which breaks any ring merge): on CUDA in half precision the fastest of
    HALF_KERNELS that takes these shapes, in fp32 the efficient kernel; on the CPU torch's CPU flash kernel."""
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
        except (RuntimeError, NotImplementedError) as e:   # this kernel does not take these shapes on this GPU
            error = error or e
            continue
        _CHOSEN[key] = name
        return result
    raise error


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint key sets: the block's share of the whole is
    sigmoid(block_lse - lse), so the merged output is one lerp and the merged log-sum-exp one log-sigmoid (three
    elementwise kernels, stable for any gap between the two; under compile they fuse with the blocks' graphs)."""
    if out is None:
        return block_out.float(), block_lse
    share = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)
    return torch.lerp(out, block_out.float(), share), lse - F.logsigmoid(lse - block_lse)


class SequenceParallelAttention:
    """comm_only skips the attention arithmetic (the output is the queries) and keeps every collective, for the
    communication benchmark at full model size on CPU ranks."""

    def __init__(self, mesh: Mesh, comm_only: bool = False, stale=None):
        """stale: a PipeFusion K/V buffer (families/stage.py StaleKV) this layer attends through: the call's fresh keys
        are written into it and the queries see all of it (the other patches' keys from their latest call)."""
        self.mesh = mesh
        self.comm_only = comm_only
        self.stale = stale
        self.ulysses = mesh["ulysses"]
        self.ring = mesh["ring"]
        # pad rows at the end of the last sequence-parallel rank's image shard (set per forward by parallelize.py).
        # Ranks are ordered ring-major, ulysses fastest: after Ulysses' exchange the pad rows end the K/V of every
        # rank of the last ring member, and the ring passes them on as that member's block
        self.pad_tokens = 0

    def __call__(self, q, k, v, joint: tuple | None = None):
        """q, k, v: this rank's image-token shard (all heads). joint: text (q, k, v), full on every rank.
        Returns (image out shard, text out or None), all heads."""
        u = self.ulysses
        if u.size > 1:
            sent = sum(t.numel() * t.element_size() for t in (q, k, v)) * (u.size - 1) // u.size
            self.mesh.stats.add("ulysses_all_to_all", sent)
            q, k, v = self._exchange_qkv(q, k, v)
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
        if self.pad_tokens and self.ring.rank == self.ring.size - 1:   # this rank's own keys end in the pad rows
            keys, values = keys[:, :keys.shape[1] - self.pad_tokens], values[:, :values.shape[1] - self.pad_tokens]
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

    def _exchange_qkv(self, q, k, v):
        """Ulysses' exchange of q, k and v in one all-to-all (one call, not three): this rank's tokens of every head
        out, every rank's tokens of this rank's heads back. Member j's heads of all three go in one block, laid out
        as all_to_all_single scatters them; what comes back is split into q, k, v of (batch, tokens, heads/U, dim),
        the same values yunchang's all_to_all_4D gives each tensor alone."""
        u = self.ulysses
        b, s, h, d = q.shape
        send = q.new_empty(u.size, s, b, 3, h // u.size, d)
        for i, t in enumerate((q, k, v)):
            send[:, :, :, i] = t.reshape(b, s, u.size, h // u.size, d).permute(2, 1, 0, 3, 4)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=u.pg)
        # received[j]: member j's tokens (its sequence shard, in member order) of this rank's heads
        return received.permute(3, 2, 0, 1, 4, 5).reshape(3, b, u.size * s, h // u.size, d).unbind(0)

    def _pass_on(self, kv, nxt: int, prv: int):
        """Post one ring hop: kv to the next member, the previous member's into a new buffer; returns (buffer,
        requests). Waiting on the requests orders the device's stream after the transfer (NCCL); the host goes on."""
        r = self.ring
        incoming = torch.empty_like(kv)
        ops = [dist.P2POp(dist.isend, kv, nxt, group=r.pg), dist.P2POp(dist.irecv, incoming, prv, group=r.pg)]
        self.mesh.stats.add("ring_p2p", kv.numel() * kv.element_size())
        return incoming, dist.batch_isend_irecv(ops)

    def _ring(self, queries, keys0, values0, k, v):
        """Step 0 uses this rank's keys (text included, once); then the image K/V of every other ring member
        arrives in turn. Each hop is posted before the attention of the block in hand (double buffering), so the
        transfer runs while that block computes. Partial results merge exactly through their log-sum-exp."""
        r = self.ring
        kernel = attention_with_lse if not self.comm_only else \
            (lambda q, k, v: (q, torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)))
        nxt, prv = r.ranks[(r.rank + 1) % r.size], r.ranks[(r.rank - 1) % r.size]
        incoming, requests = self._pass_on(torch.stack([k, v]), nxt, prv)
        out, lse = _merge(None, None, *kernel(queries, keys0, values0))
        for hop in range(1, r.size):
            for request in requests:
                request.wait()
            kv = incoming
            if hop < r.size - 1:   # the next hop travels while this block computes
                incoming, requests = self._pass_on(kv, nxt, prv)
            if self.pad_tokens and (r.rank - hop) % r.size == r.size - 1:   # the last member's block: pad rows off
                kv = kv[:, :, :kv.shape[2] - self.pad_tokens]
            out, lse = _merge(out, lse, *kernel(queries, kv[0], kv[1]))
        return out.to(queries.dtype)
