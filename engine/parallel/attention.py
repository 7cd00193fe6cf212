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

from ..kernels import attention_with_lse, merge as _merge  # noqa: F401 (the ring's pieces; tests read them here)
from .mesh import Mesh


class SequenceParallelAttention:
    """A layer's attention across the sequence-parallel ranks. Its local arithmetic is two methods (`_local`: all the
    keys at once; `_block`: one ring block, with its log-sum-exp), which the communication benchmark's subclass
    (parallel/comm.py) replaces while every collective stays as it is."""

    def __init__(self, mesh: Mesh, stale=None):
        """stale: a PipeFusion K/V buffer (families/stage.py StaleKV) this layer attends through: the call's fresh keys
        are written into it and the queries see all of it (the other patches' keys from their latest call)."""
        self.mesh = mesh
        self.stale = stale
        self.ulysses = mesh["ulysses"]
        self.ring = mesh["ring"]
        # pad rows at the end of the last sequence-parallel rank's image shard (set per forward by parallelize.py).
        # Ranks are ordered ring-major, ulysses fastest: after Ulysses' exchange the pad rows end the K/V of every
        # rank of the last ring member, and the ring passes them on as that member's block
        self.pad_tokens = 0

    def __call__(self, q, k, v, joint: tuple | None = None, bias=None):
        """q, k, v: this rank's image-token shard (all heads). joint: text (q, k, v), full on every rank. bias: an
        additive bias in the whole sequence's token coordinates, without joint text or a PipeFusion buffer: its
        `attend(q, k, v, first query, first key)` gives a block of queries over a block of keys under it, (out,
        log-sum-exp), through the kernels here. Returns (image out shard, text out or None), all heads."""
        if bias is not None and (joint is not None or self.stale is not None):
            raise ValueError("a guide bias is taken on image tokens alone (no joint text, no PipeFusion)")
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
        if self.ring.size == 1:
            out = self._local(queries, keys, values, bias)
        else:
            out = self._ring(queries, keys, values, k, v, bias)
        text_out, image_out = out[:, :n_text], out[:, n_text:]
        if u.size > 1:
            self.mesh.stats.add("ulysses_all_to_all", image_out.numel() * image_out.element_size() * (u.size - 1) // u.size)
            image_out = all_to_all_4D(image_out.contiguous(), scatter_idx=1, gather_idx=2, group=u.pg)
            if n_text:
                text_out = self.mesh.all_gather(text_out.contiguous(), "ulysses", dim=2, kind="ulysses_text_gather")
            elif joint is not None:   # no text queries in this call: an empty text output of every head
                text_out = image_out.new_zeros(image_out.shape[0], 0, *image_out.shape[2:])
        return image_out, (text_out if joint is not None else None)

    def local_keys(self, q, k, v):
        """Queries every sequence-parallel rank holds whole (all heads) over keys and values that are this rank's
        shard of the image tokens (e.g. audio queries over the video): each rank attends its queries to its own keys
        (the pad rows off), then the ranks exchange only these partial results, each output with its log-sum-exp
        (out in the queries' dtype and lse in fp32, in one all-gather over the sequence group, counted as
        "sp_merge"), and every rank merges them in group order: the same exact softmax over all the keys, the same
        values on every rank. Returns the output (the queries' dtype)."""
        sp = self.mesh["sp"]
        if self.pad_tokens and sp.rank == sp.size - 1:   # this rank's keys end in the pad rows
            k, v = k[:, :k.shape[1] - self.pad_tokens], v[:, :v.shape[1] - self.pad_tokens]
        out, lse = self._block(q, k, v, 0, 0)
        if sp.size == 1:
            return out.to(q.dtype)
        out, lse = out.contiguous(), lse.contiguous()
        split = out.numel() * out.element_size()
        parts = self.mesh.all_gather(torch.cat([out.reshape(-1).view(torch.uint8), lse.reshape(-1).view(torch.uint8)]),
                                     "sp", dim=0, kind="sp_merge").chunk(sp.size)
        merged = merged_lse = None
        for part in parts:   # group order on every rank: every rank's merge is the same to the bit
            merged, merged_lse = _merge(merged, merged_lse, part[:split].view(out.dtype).view(out.shape),
                                        part[split:].view(lse.dtype).view(lse.shape))
        return merged.to(q.dtype)

    def _local(self, queries, keys, values, bias=None):
        """Every key at once: torch's attention (the engine's attention setting chooses its kernel); under a bias the
        engine's own kernels, which take one whatever kernel torch's attention is held to."""
        if bias is not None:
            return bias.attend(queries, keys, values, 0, 0)[0].to(queries.dtype)
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (queries, keys, values))).transpose(1, 2)

    def _block(self, q, k, v, q0: int, k0: int, bias=None):
        """One ring block: queries from token q0 over keys from token k0 -> (out, log-sum-exp)."""
        return bias.attend(q, k, v, q0, k0) if bias is not None else attention_with_lse(q, k, v)

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

    def _ring(self, queries, keys0, values0, k, v, bias=None):
        """Step 0 uses this rank's keys (text included, once); then the image K/V of every other ring member
        arrives in turn. Each hop is posted before the attention of the block in hand (double buffering), so the
        transfer runs while that block computes. Partial results merge exactly through their log-sum-exp. Under a
        bias each block takes its part of it: member m's tokens (after Ulysses' exchange) start at m x its count."""
        r = self.ring
        span = k.shape[1]   # each member's tokens, pad rows included
        def kernel(q, k, v, member):
            return self._block(q, k, v, r.rank * span, member * span, bias)
        nxt, prv = r.ranks[(r.rank + 1) % r.size], r.ranks[(r.rank - 1) % r.size]
        incoming, requests = self._pass_on(torch.stack([k, v]), nxt, prv)
        out, lse = _merge(None, None, *kernel(queries, keys0, values0, r.rank))
        for hop in range(1, r.size):
            for request in requests:
                request.wait()
            kv = incoming
            if hop < r.size - 1:   # the next hop travels while this block computes
                incoming, requests = self._pass_on(kv, nxt, prv)
            if self.pad_tokens and (r.rank - hop) % r.size == r.size - 1:   # the last member's block: pad rows off
                kv = kv[:, :, :kv.shape[2] - self.pad_tokens]
            out, lse = _merge(out, lse, *kernel(queries, kv[0], kv[1], (r.rank - hop) % r.size))
        return out.to(queries.dtype)
