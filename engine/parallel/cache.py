"""A step cache in the manner of First-Block-Cache (ParaAttention, cache-dit): every model call runs the first
transformer block; when its output residual (output - input of the image stream) has barely changed since the last
call that ran every block, the remaining blocks are skipped and their contribution from that call is reused.

The decision is taken one call late, so the host never waits for the device: a call skips when the first block's
residual of the stream's previous call had changed little from the last fully computed call's. Each call's change
is measured on the device and agreed by one all-reduce over every rank of the job (sums of |change| and |previous
residual|), posted behind the first block and read at the stream's next call (`Deferred`), long after it completed.
So all ranks skip or compute together and no collective inside the skipped blocks is left waiting; ranks whose shard
has changed little skip only when the whole picture has.

The blocks themselves are untouched (compiled blocks stay compiled, their weights keep their names): the model's
block lists are replaced by lists of the same modules whose iteration yields thin call wrappers, and restored by
`close`. A block is called as block(hidden_states=, encoder_hidden_states=, ...) and returns (encoder_hidden_states,
hidden_states); a block called without an encoder stream (encoder_hidden_states None: FLUX.2's single blocks, which
get text and image joined) returns the one joined stream, the image tokens at its end. A block called with its
arguments in order, hidden states first, that returns one tensor (Wan's: the text enters only its cross-attention)
returns the image tokens alone; one called so that returns a pair (HunyuanVideo 1.5's: hidden states, encoder hidden
states in and out, in that order) returns (image, text). Only the final image tokens are used after the last block.

A threshold of 0 never skips, and then every block runs exactly as without the cache (the wrappers only read).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import syncs


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    """A side stream per device for the step cache's small copies to the host (made once)."""
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class Deferred:
    """A small device tensor's value, read a model call later without making the host or the compute stream wait. On
    CUDA a side stream waits for the collective `work` (posted behind the first block) and copies the value to pinned
    host memory behind it, and an event marks the copy: the compute stream goes on with the next blocks at once (a
    wait on it would hold every rank at the first block until the slowest had posted: a barrier per call), and
    `result`, a call later, waits for that event only, long passed. On the CPU the host is the device: the collective
    runs in the background and `result` waits for it."""

    def __init__(self, t: torch.Tensor, work=None):
        self._event = None
        self._keep = t   # the collective's buffer, while the value is unread
        if t.is_cuda:
            side = _copy_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))   # what produced t (no collective: one rank)
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(side):
                if work is not None:
                    work.wait()   # orders the current stream, here the side stream, after the all-reduce
                self._host.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)
            # t is read on the side stream after the all-reduce writes it: the caching allocator must not hand its
            # block to the compute stream before that copy has run, even when this Deferred is dropped unread
            # (record_stream ties the block's reuse to the side stream's progress, past the all-reduce it waits for)
            t.record_stream(side)
            self._work = work   # the collective's own hold on t lasts as long as this Deferred
        else:
            self._host, self._work = t, work

    def result(self) -> list:
        with syncs.deferred_read():
            if self._event is not None:
                self._event.synchronize()   # the copy, and so the all-reduce before it, has run
            elif self._work is not None:
                self._work.wait()
            self._keep = self._work = None
            return self._host.tolist()


@dataclass
class _Stream:
    """One sequence of model calls (a pass and batch share): what the last fully computed call left."""
    first_residual: torch.Tensor | None = None   # first block's hidden-state residual
    rest_residual: torch.Tensor | None = None    # final hidden states - first block's output
    measured: Deferred | None = None             # the last call's change, agreed, not yet read


@dataclass
class CacheStats:
    calls: int = 0
    skipped: int = 0
    changes: list = field(default_factory=list)      # the agreed relative change each call's decision used: the
    #                                                  stream's previous call's (None: no reference yet)
    skipped_at: list = field(default_factory=list)   # indices of the skipped calls

    def as_dict(self) -> dict:
        return {"model_calls": self.calls, "skipped_calls": self.skipped, "skipped_at": list(self.skipped_at),
                "changes": [None if c is None else round(c, 6) for c in self.changes]}


class StepCache:
    def __init__(self, model: torch.nn.Module, block_lists: tuple[str, ...], threshold: float, group=None,
                 ranks: int = 1):
        """group, ranks: the job's ranks, which agree on every decision (None, 1: this process alone)."""
        self.model = model
        self.threshold = float(threshold)
        # (first row, count) of pad rows in this rank's image shard (sequence parallel padding, parallelize.py): left
        # out of the change measured, so the decision is one rank's
        self.pad_rows = (0, 0)
        self.group, self.ranks = group, ranks
        self.originals = {name: model.get_submodule(name) for name in block_lists}
        blocks = [b for name in block_lists for b in self.originals[name]]
        if len(blocks) < 2:
            raise ValueError(f"a step cache needs at least 2 blocks; the model has {len(blocks)}")
        self.first, self.last = blocks[0], blocks[-1]
        self.streams: dict = {}
        self.stream_key = None
        self.stats = CacheStats()
        self._skip = False
        self._first_out = None
        self._pair = False       # the blocks take (hidden, encoder, ...) in order and give the pair back
        for name, blocks in self.originals.items():
            setattr(model, name, _CachedList(self, blocks))

    # ---- per job and per call ----------------------------------------------------------------------------------
    def reset(self, threshold: float) -> None:
        """A new job: nothing carried over from the last one."""
        self.threshold = float(threshold)
        self.streams.clear()
        self.stats = CacheStats()

    def use_stream(self, key) -> None:
        """The next model call belongs to this stream (a CFG pass and batch share): it is compared with that
        stream's last computed call only."""
        self.stream_key = key

    def close(self) -> None:
        for name, blocks in self.originals.items():
            setattr(self.model, name, blocks)

    # ---- the wrapped block calls -------------------------------------------------------------------------------
    def call(self, block: torch.nn.Module, args, kwargs):
        if block is self.first:
            return self._call_first(block, args, kwargs)
        single = bool(args)   # hidden states first, one tensor back (or, as the first block showed, a pair)
        joined = (single and not self._pair) or (not single and kwargs.get("encoder_hidden_states") is None)
        if self._skip:  # pass the cached result along unchanged
            if single:
                return (args[0], args[1]) if self._pair else args[0]
            hidden_in = kwargs["hidden_states"]
            return hidden_in if joined else (kwargs["encoder_hidden_states"], hidden_in)
        out = block(*args, **kwargs)
        if block is self.last:
            hidden = out if joined else out[0] if single else out[1]
            image = hidden[:, hidden.shape[1] - self._first_out.shape[1]:]   # a joined stream ends in the image
            self.streams[self.stream_key].rest_residual = image - self._first_out
            self._first_out = None
        return out

    def _call_first(self, block, args, kwargs):
        stream = self.streams.setdefault(self.stream_key, _Stream())
        self.stats.calls += 1
        single = bool(args)   # hidden states first, one tensor back or the pair (hidden states, encoder's)
        hidden_in = args[0] if single else kwargs["hidden_states"]
        out = block(*args, **kwargs)
        self._pair = single and isinstance(out, tuple)
        encoder, hidden = (out[1], out[0]) if self._pair else (None, out) if single else out
        residual = hidden - hidden_in
        change = self._agreed(stream.measured) if stream.measured is not None else None
        stream.measured = self._measure(residual, stream)
        self.stats.changes.append(change)
        self._skip = change is not None and change < self.threshold
        if self._skip:
            self.stats.skipped += 1
            self.stats.skipped_at.append(self.stats.calls - 1)
            hidden = hidden + stream.rest_residual
            return self._as_block_gives(hidden, encoder, single)
        stream.first_residual = residual
        self._first_out = hidden
        return self._as_block_gives(hidden, encoder, single)

    def _as_block_gives(self, hidden, encoder, single: bool):
        if single:
            return (hidden, encoder) if self._pair else hidden
        return encoder, hidden

    def _measure(self, residual: torch.Tensor, stream: _Stream) -> Deferred:
        """This call's change against the stream's last fully computed call, summed over every rank's shard: |residual -
        previous|, |previous|, and 1 where this rank has a reference (all on the device, all-reduced, read later)."""
        ready = stream.first_residual is not None and stream.rest_residual is not None and \
            stream.first_residual.shape == residual.shape
        if ready:
            prev = stream.first_residual
            start, count = self.pad_rows
            if count:
                residual, prev = (torch.cat([t[:, :start], t[:, start + count:]], dim=1) for t in (residual, prev))
            sums = torch.stack([(residual - prev).abs().double().sum(), prev.abs().double().sum(),
                                torch.ones((), dtype=torch.float64, device=residual.device)])
        else:
            sums = torch.zeros(3, dtype=torch.float64, device=residual.device)
        work = dist.all_reduce(sums, group=self.group, async_op=True) if self.ranks > 1 else None
        return Deferred(sums, work)

    def _agreed(self, measured: Deferred) -> float | None:
        """mean |residual - previous| / mean |previous| over every rank's shard, the same number on every rank; None
        when some rank had no reference."""
        diff, base, ready_ranks = measured.result()
        if ready_ranks < self.ranks or base == 0.0:
            return None
        return diff / base


class _CachedList(torch.nn.ModuleList):
    """The same block modules (same names in the state dict); iterating yields wrappers that route each call
    through the cache."""

    def __init__(self, cache: StepCache, blocks: torch.nn.ModuleList):
        super().__init__(blocks)
        object.__setattr__(self, "_cache", cache)  # not a submodule

    def __iter__(self):
        return iter([_CachedCall(self._cache, block) for block in super().__iter__()])


class _CachedCall:
    def __init__(self, cache: StepCache, block: torch.nn.Module):
        self._cache, self._block = cache, block

    def __call__(self, *args, **kwargs):
        return self._cache.call(self._block, args, kwargs)

    def __getattr__(self, name):  # the model's loop may read block attributes (SD3: context_pre_only)
        return getattr(self._block, name)
