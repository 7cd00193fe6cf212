"""PipeFusion's rank half: patch-pipelined denoising with stale activations (xDiT's PipeFusion, on ComfyUI's
samplers).

The transformer's blocks are split into P stages, one per rank of a `pipefusion` group; each stage rank holds only
its own blocks (models/load.py `keep`), and the family's stage model (pipefusion/stage.py) cuts its forward. The
latent is split into M row bands (patches, M >= P). The first W steps run synchronously: the whole latent goes
through the stages in turn (every layer's K/V is then fresh everywhere). After the warmup, stage s computes patch m
of model call k with fresh activations for patch m and, in attention, the K/V other patches left in that layer: this
call's for the patches before m, the previous call's for the rest (the "stale" K/V). Patch m's activations go to
stage s+1 asynchronously while stage s starts patch m+1.

The sampler step is applied per patch on the last stage: each patch runs ComfyUI's sampler as its own generator
(sampling/samplers.sampler_steps; every sampler here is elementwise, and the stochastic ones draw the whole latent's
noise and take the patch's region, so a patch sees exactly the noise a whole run gives it). The last stage sends
patch m's next input to the first stage as soon as its step is done: the pipeline never drains between steps.

Text tokens travel with patch 0 (every family): the text stream is computed once per call, with the first
patch, and the later patches attend to its K/V from that layer's buffer. Inside a stage, Ulysses and Ring split each
patch's tokens as they split a whole latent's (text joint: every rank of the stage holds it); CFG and data parallel
run one pipeline per pass / batch share and meet on the last stage, where the velocities are gathered for the
sampler, as parallelize.py does for one model call.

Messages between stages are (header, tensors) over the pipefusion group's process group; the header says what
follows (a request, a piece's activations, the final latent, or stop), so no rank has to guess a shape. Every wait
has a deadline and a stall names the stage, the patch and the step it waited for.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import EngineError, JobCancelledSignal
from ...models.flow import Conditioning, FlowModel
from ...sampling.ksampler import SamplingStart, guided_denoiser
from ...sampling.samplers import sampler_steps
from ..attention import SequenceParallelAttention
from ..mesh import Mesh
from ..parallelize import pass_groups
from .layout import HEADER, Layout, stage_blocks_named

# header kinds
REQUEST, PIECE, FINAL, STOP = 0, 1, 2, 3


# ---- stale K/V: one buffer per attention layer ----------------------------------------------------------------------

class PieceState:
    """What the stage is computing now: the whole latent (band None) or one patch; and which pass group."""

    def __init__(self, layout: Layout, ulysses: int):
        self.band: int | None = None
        self.group = 0
        self.positions = [layout.buffer_positions(m, ulysses) for m in range(layout.patches)]


class StaleKV:
    """One attention layer's K/V for the whole latent (this rank's share), per pass group. A whole-latent call
    replaces it; a patch's call writes its fresh keys in place and attends to all of it."""

    def __init__(self, state: PieceState):
        self.state = state
        self.buffers: dict[int, list] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, text: tuple | None):
        """k, v: this call's image keys and values (after the Ulysses exchange); text: fresh text (k, v) or None.
        Returns (text k, v or None, image k, image v) to attend to."""
        s = self.state
        if s.band is None:
            self.buffers[s.group] = [k.contiguous(), v.contiguous(), text]
            return text, k, v
        buf = self.buffers.get(s.group)
        if buf is None:
            raise RuntimeError("a patch reached attention before a whole-latent call filled its K/V")
        pos = s.positions[s.band].to(k.device)
        buf[0].index_copy_(1, pos, k)
        buf[1].index_copy_(1, pos, v)
        if text is not None:
            buf[2] = text
        return buf[2], buf[0], buf[1]


# ---- one stage's share of the model's forward ---------------------------------------------------------------------


# ---- the pipeline -----------------------------------------------------------------------------------------------

class StageStall(EngineError):
    pass


class Pipeline:
    """One rank's part of a PipeFusion job: its stage's model, the stale K/V, and the loop its stage runs."""

    def __init__(self, flow: FlowModel, mesh: Mesh):
        self.flow, self.mesh = flow, mesh
        self.block_lists, self.processor = flow.family.tokens.blocks, flow.family.tokens.processor
        self.group = mesh["pipefusion"]
        self.stage = self.group.rank
        self.stages = self.group.size
        self.layout: Layout | None = None
        self._originals = dict(flow.model.attn_processors)
        self.kvs: dict[str, StaleKV] = {}

    def close(self) -> None:
        self.flow.model.set_attn_processor(self._originals)

    # ---- per job ----------------------------------------------------------------------------------------------
    def setup(self, layout: Layout) -> None:
        """Processors with stale K/V on this stage's attention layers (rebuilt when the layout changes)."""
        if layout == self.layout:
            return
        self.layout = layout
        self.state = PieceState(layout, self.mesh["ulysses"].size)
        self.model = self.flow.family.stage(self.flow, layout, self.mesh, self.block_lists, self.stage)
        mine = stage_blocks_named(self.flow.loaded.info, layout, self.stage)
        processors = {}
        self.kvs = {}
        for key, original in self._originals.items():
            if key.startswith(mine):
                self.kvs[key] = StaleKV(self.state)
                processors[key] = self.processor(SequenceParallelAttention(self.mesh, stale=self.kvs[key]))
            else:
                processors[key] = original
        self.flow.model.set_attn_processor(processors)

    # ---- transport ------------------------------------------------------------------------------------------
    def _peer(self, offset: int) -> int:
        """The next stage (+1; the last stage's next is the first) or the previous (-1)."""
        return self.group.ranks[(self.stage + offset) % self.stages]

    def _pg(self, to_first: bool):
        """The last stage -> first stage direction has its own communicator (mesh "pipefusion_back")."""
        return self.mesh["pipefusion_back"].pg if to_first else self.group.pg

    def _send(self, tensors: list[torch.Tensor]) -> None:
        pg = self._pg(self.stage == self.stages - 1)
        for t in tensors:
            t = t.contiguous()
            self._pending.append((dist.isend(t, self._peer(1), group=pg), t))
            self.mesh.stats.add("pipefusion_p2p", t.numel() * t.element_size())
        if len(self._pending) > 64:   # completed sends: let their buffers go
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _recv(self, shape, dtype, what: str) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.flow.device)
        work = dist.irecv(t, self._peer(-1), group=self._pg(self.stage == 0))
        self._wait(work, what, self._peer(-1))
        return t

    def _wait(self, work, what: str, peer: int) -> None:
        deadline = time.monotonic() + self.deadline_s
        if self.flow.device.type == "cpu":   # gloo waits with its own timeout
            try:
                work.wait(timedelta(seconds=self.deadline_s))
                return
            except RuntimeError as e:
                if "imeout" not in str(e) and "imed out" not in str(e):
                    raise
        else:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
            else:
                work.wait()
                return
        raise StageStall(f"PipeFusion stage {self.stage} (rank {self.mesh.rank}) waited {self.deadline_s:.0f} s for "
                         f"{what} (peer: rank {peer}) and gave up: that rank is stalled or gone", rank=self.mesh.rank,
                         phase="compute")

    def _header(self, kind, band=-1, sigma=0.0, warm=0, steps_done=0, cancelled=0) -> torch.Tensor:
        return torch.tensor([kind, band, sigma, warm, steps_done, cancelled], dtype=torch.float64,
                            device=self.flow.device)

    def _recv_header(self, what: str) -> list:
        return self._recv((HEADER,), torch.float64, what).tolist()

    # ---- the job ----------------------------------------------------------------------------------------------
    def run(self, ctx, start: SamplingStart | None, positive: Conditioning, negative: Conditioning | None, *,
            latent_shape, cfg: float, sampler: str, seed: int, steps: int, deadline_s: float, cfg_norm: float = 0.0):
        """Run the job's sampling through the pipeline. The last stage gets `start` (every rank can build it) and
        returns the raw latent; the first stage returns the same latent, received from the last; others None."""
        self.deadline_s = deadline_s
        self._pending = []
        self.steps_total = steps
        self.cfg_norm = cfg_norm
        self.bind(positive, negative, latent_shape, cfg)
        try:
            if self.stage == self.stages - 1:
                return self._last(ctx, start, sampler, seed)
            return self._middle(ctx)
        finally:
            pending, self._pending = self._pending, []
            for work, _ in pending:   # with a deadline too: a peer that died must not hang this rank
                self._wait(work, "the next stage to take its last messages", self._peer(1))
            for kv in self.kvs.values():   # the next job's warmup refills them: hold no K/V between jobs
                kv.buffers.clear()

    def bind(self, positive: Conditioning, negative: Conditioning | None, latent_shape, cfg: float) -> None:
        """This job's passes and batch share on this rank, grouped into forwards as parallelize's predictor groups
        them (`pass_groups`)."""
        self.cfg_scale = cfg
        self.batch = latent_shape[0]
        self.latent_shape = tuple(latent_shape)
        sides = [positive] if cfg == 1.0 else [positive, negative]
        cfg_group, dp = self.mesh["cfg"], self.mesh["dp"]
        self.which = ("pos",) if cfg == 1.0 else ("pos", "neg")
        mine, groups = pass_groups(sides, cfg_group)
        per = self.batch // dp.size
        self.items = slice(dp.rank * per, (dp.rank + 1) * per)
        self.groups = [(len(g), self.flow.prepare(g, self.batch, self.items)) for g in groups]
        self.passes_mine = len(mine)
        self.temb_cache: dict = {}

    def _temb(self, g: int, sigma: float) -> torch.Tensor:
        key = (g, sigma)
        if key not in self.temb_cache:
            sigma32 = torch.tensor(sigma, dtype=torch.float32, device=self.flow.device)
            self.temb_cache[key] = self.model.temb(self.groups[g][1], sigma32)
        return self.temb_cache[key]

    def _piece_shapes(self, band: int | None) -> list[tuple]:
        """The shapes of a piece's activations between stages: (text, image) per pass group."""
        hidden = self.flow.model.config.num_attention_heads * self.flow.model.config.attention_head_dim
        n_image = self.layout.image_tokens // self.layout.sp if band is None else \
            self.layout.band_tokens(band) // self.layout.sp
        out = []
        for passes, prepared in self.groups:
            n = prepared.cond.shape[0]
            text = prepared.cond.shape[1] if band in (None, 0) else 0
            out += [(n, text, hidden), (n, n_image, hidden)]
        return out

    def compute(self, band: int | None, sigma: float, x: torch.Tensor | None, received: list | None) -> list:
        """This stage's blocks on one piece, every pass group; returns the activations (or, last stage, velocity
        tokens per group)."""
        self.state.band = band
        out = []
        with_text = band in (None, 0)
        for g, (passes, prepared) in enumerate(self.groups):
            self.state.group = g
            temb = self._temb(g, sigma)
            if self.model.first:
                xs = x.to(self.flow.device, self.flow.dtype)
                xs = torch.cat([xs] * passes) if passes > 1 else xs
                text, image = self.model.embed(xs, prepared, band, with_text)
            else:
                text, image = received[2 * g], received[2 * g + 1]
            text, image = self.model.run_blocks(text, image, temb, band, with_text)
            if self.model.last:
                out.append(self.model.final(image, temb))
            else:
                out += [text, image]
        return out

    # first and middle stages: take pieces from the previous stage (the first: requests from the last), pass them on
    def _middle(self, ctx):
        first = self.stage == 0
        shape = list(self.latent_shape)
        shape[0] = self.items.stop - self.items.start
        reported = 0
        while True:
            header = self._recv_header("the next patch request" if first else "the next activations")
            kind, band, sigma, warm, steps_done, _ = header
            band = int(band)
            if first and steps_done > reported:
                reported = int(steps_done)
                ctx.progress(reported, self.steps_total)
            if kind in (FINAL, STOP):
                return self._stop(header)
            piece = None if warm else band
            x = data = None
            if first:
                x, header = self._take_requests(band, bool(warm), shape, int(steps_done))
                if header is not None:   # the last stage stopped while a warm call's requests came in
                    return self._stop(header)
            else:
                data = [self._recv(s, self.flow.dtype, f"patch {band} activations (step {int(steps_done) + 1})")
                        for s in self._piece_shapes(piece)]
            out = self.compute(piece, sigma, x, data)
            self._send([self._header(PIECE, -1 if piece is None else piece, sigma, warm, steps_done)] + out)

    def _stop(self, header):
        """The end of the job on a first or middle stage: pass the stop on; the first stage takes the final latent."""
        kind, _, _, _, steps_done, cancelled = header
        result = None
        if kind == FINAL:
            result = self._recv(tuple(self.latent_shape), torch.float32, "the final latent")
        self._send([self._header(STOP, steps_done=steps_done, cancelled=cancelled)])
        if cancelled:
            raise JobCancelledSignal(int(steps_done))
        return result

    def _take_requests(self, band: int, warm: bool, shape: list, steps_done: int):
        """The first stage's input: one patch's rows, or for a warm call every patch's, put together into the whole
        latent. Returns (x, None), or (None, header) when a stop came instead of a request."""
        def rows_of(m: int):
            rows = self.model.latent_rows(m)
            return rows, self._recv((shape[0], shape[1], rows.stop - rows.start, shape[3]), torch.float32,
                                    f"patch {m} request (step {steps_done + 1})")
        rows, x = rows_of(band)
        if not warm:
            return x, None
        whole = torch.empty(shape, dtype=torch.float32, device=self.flow.device)
        whole[:, :, rows] = x
        for m in range(1, self.layout.patches):
            header = self._recv_header(f"patch {m} request (step {steps_done + 1})")
            if header[0] != REQUEST:
                return None, header
            rows, x = rows_of(int(header[1]))
            whole[:, :, rows] = x
        return whole, None

    # the last stage: finish each piece, gather the velocities, step that patch's sampler, send its next request
    def _last(self, ctx, start: SamplingStart, sampler: str, seed: int):
        layout = self.layout
        x_all = start.x_model
        done_steps = [0] * layout.patches
        gens = []
        for m in range(layout.patches):
            rows = self.model.latent_rows(m)
            region = (slice(None), slice(None), rows, slice(None))

            def count(step_index, total, m=m):
                done_steps[m] = step_index + 1
            gens.append(sampler_steps(sampler, x_all[region], start.sigmas, seed=seed, callback=count,
                                      percent_to_sigma=start.percent_to_sigma, whole=x_all, region=region))
        finals: list[torch.Tensor | None] = [None] * layout.patches
        pending = [next(g) for g in gens]          # each patch's first request: (x, sigma)
        cancelled = False
        checked = 0   # the last step boundary at which cancel was checked

        def request(m: int) -> None:
            x, sigma = pending[m]
            warm = done_steps[m] < layout.warmup
            self._send([self._header(REQUEST, m, float(sigma), int(warm), done_steps[m]), x[self.items]])

        for m in range(layout.patches):
            request(m)
        while True:
            kind, band, sigma, warm, steps_done, _ = self._recv_header("the next activations")
            piece = None if warm else int(band)
            data = [self._recv(s, self.flow.dtype, f"patch {band} activations (step {int(steps_done) + 1})")
                    for s in self._piece_shapes(piece)]
            tokens = self.compute(piece, sigma, None, data)
            v_bands = self._velocities(tokens, piece)      # per pass: [batch, 16, rows, width] of the piece
            for m in (range(layout.patches) if piece is None else [piece]):
                sl = slice(None) if piece is not None else self.model.latent_rows(m)
                v = tuple(t[:, :, sl] for t in v_bands)
                x, s = pending[m]
                denoised = guided_denoiser(lambda xx, ss, which, v=v: v, self.cfg_scale, self.cfg_norm)(x, s)
                try:
                    pending[m] = gens[m].send(denoised)
                except StopIteration as end:
                    finals[m] = end.value
                    pending[m] = None
            boundary = all(d == done_steps[0] for d in done_steps) and done_steps[0] > checked
            if all(f is not None for f in finals):
                latent = start.finish(torch.cat(finals, dim=2))
                self._send([self._header(FINAL, steps_done=done_steps[0]), latent])
                break
            if boundary:
                checked = done_steps[0]
            if boundary and self._cancel(ctx):
                cancelled = True
                self._send([self._header(STOP, steps_done=done_steps[0], cancelled=1)])
                break
            for m in (range(layout.patches) if piece is None else [piece]):
                if pending[m] is not None:
                    request(m)
        # drain: pieces already on their way, until the stop the first stage sends round the ring
        while True:
            kind, band, sigma, warm, steps_done, _ = self._recv_header("the pipeline's stop")
            if kind == STOP:
                break
            piece = None if warm else int(band)
            for s in self._piece_shapes(piece):
                self._recv(s, self.flow.dtype, "activations in flight")
        if cancelled:
            raise JobCancelledSignal(done_steps[0])
        return latent

    def _velocities(self, tokens: list[torch.Tensor], band: int | None) -> tuple[torch.Tensor, ...]:
        """Velocity tokens of this rank's share, per pass group -> the piece's velocity per pass, whole batch."""
        order = torch.cat([self.layout.local_tokens(band, r) for r in range(self.layout.sp)])
        start = 0 if band is None else self.layout.band_start(band)
        inverse = torch.argsort(order - start).to(self.flow.device)
        per_pass = []
        for (passes, _), t in zip(self.groups, tokens):
            t = self.mesh.all_gather(t, "sp", dim=1, kind="sp_gather")[:, inverse]
            v = self.model.unpatch(t, band).float()
            per_pass += list(v.unflatten(0, (passes, -1)).unbind(0))
        v = torch.stack(per_pass)                                               # [passes, batch share, ...]
        v = self.mesh.all_gather(v, "dp", dim=1, kind="dp_gather")
        if self.passes_mine < len(self.which):
            v = self.mesh.all_gather(v, "cfg", dim=0, kind="cfg_gather")
        return tuple(v.unbind(0))

    def _cancel(self, ctx) -> bool:
        """Agreed by every last-stage rank (they step together); the others learn it from the stop message."""
        flag = torch.tensor([int(ctx.cancel_requested())], dtype=torch.int64, device=self.flow.device)
        group = self.mesh["stage"]
        if group.size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.pg)
        return bool(flag.item())


# ---- the job's layout, the stage's weights ------------------------------------------------------------------------

