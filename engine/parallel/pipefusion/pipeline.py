"""PipeFusion's rank half: patch-pipelined denoising with stale activations (xDiT's PipeFusion, on ComfyUI's
samplers).

The transformer's blocks are split into P stages, one per rank of a `pipefusion` group; each stage rank holds only
its own blocks (models/load.py `keep`), and the family's stage model (families/stage.py) cuts its forward. The
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

No host read per piece, patch or layer: the samplers ask for the same sigmas whatever the model returns, so every
rank derives the job's call schedule before the loop (transport.py `call_schedule`: each call's sigma and step) and
with it every message it will receive, in order, with its shapes. A stage posts the receives of a step's messages ahead and waits
on each in the device's stream order when it needs it, so the transfer of patch m+1 runs while patch m computes.
Each message still starts with its header (kind, band, sigma, warm, steps done, cancelled), taken from a table on
the device built once; the receiver keeps the headers on the device and checks them once, after the job
(`check_headers`). The token indices, K/V positions and sigmas the loop uses are device tensors built once per job.

Cancelling is agreed by every rank of the job (JobContext.cancel_agreed, host memory, one step late) at the start of
each step's last piece, before any receive of the next step is posted: so every rank knows the job stops after step
T before it could wait for a message of step T+1, and the messages in flight are exactly known (the last stage's
requests for the next step sent before its decision point), which the first stage takes and drops. Every wait has a
deadline and a stall names the stage, the patch and the step it waited for (transport.py: on the CPU the process
group's timeout bounds each wait; on a GPU the host may run ahead of the device, but never past a message a step
back that has not arrived, which it polls until the deadline).
"""
from __future__ import annotations

import torch

from ...errors import EngineError, JobCancelledSignal
from ...models.flow import Conditioning, FlowModel
from ... import syncs
from ...sampling.ksampler import SamplingStart, guided_denoiser
from ...sampling.samplers import sampler_steps
from ..attention import SequenceParallelAttention
from ..mesh import Mesh
from ..parallelize import pass_groups
from .layout import Layout, stage_blocks_named
from ...families.stage import PieceState, StaleKV
from .transport import Call, Inbox, Link, Message, Outbox, call_schedule

# header kinds
REQUEST, PIECE, FINAL, STOP = 0, 1, 2, 3


# ---- the pipeline -----------------------------------------------------------------------------------------------

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
        self.inbox: Inbox | None = None

    def close(self) -> None:
        self.flow.model.set_attn_processor(self._originals)

    # ---- per job ----------------------------------------------------------------------------------------------
    def setup(self, layout: Layout) -> None:
        """Processors with stale K/V on this stage's attention layers, and the token orders the loop uses, on the
        device (rebuilt when the layout changes)."""
        if layout == self.layout:
            return
        self.layout = layout
        device = self.flow.device
        self.state = PieceState(layout, self.mesh["ulysses"].size, device)
        self.model = self.flow.family.stage(self.flow, layout, self.mesh, self.block_lists, self.stage)
        # the gathered velocity tokens of a piece (each sequence-parallel rank's share in turn) back in row order
        self._inverse = {}
        for band in [None] + list(range(layout.patches)):
            order = torch.cat([layout.local_tokens(band, r) for r in range(layout.sp)])
            self._inverse[band] = torch.argsort(order - (0 if band is None else layout.band_start(band))).to(device)
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

    def _link(self, direction: str):
        """This stage's link from the previous stage ("in") or to the next ("out"): each link its own communicator,
        carrying that one direction (mesh.py `_pipefusion_links`)."""
        return self.mesh[f"pipefusion_{direction}"].pg

    def _send(self, header: int, tensors: list[torch.Tensor], what: str) -> None:
        """A message to the next stage: its header (a row of the table on the device) and its tensors."""
        self.outbox.send([self._headers[header]] + tensors, what)

    # ---- the job's schedule ---------------------------------------------------------------------------------
    def _pieces(self, call: Call) -> list:
        return [None] if call.warm else list(range(self.layout.patches))

    def _plan(self, start: SamplingStart, sampler: str, seed: int) -> None:
        """The job's calls, the header table (on the device), and this stage's incoming messages, in order."""
        layout = self.layout
        self._sigmas_host = start.sigmas.detach().cpu()   # read once per job
        self.calls = call_schedule(sampler, start, self._sigmas_host, seed, layout.warmup)
        self.steps_total = self.calls[-1].step + 1 if self.calls else 0
        rows, self._row = [], {}

        def row(key, values):
            self._row[key] = len(rows)
            rows.append(values)
        for k, c in enumerate(self.calls):
            for m in range(layout.patches):
                row(("request", k, m), [REQUEST, m, c.sigma, int(c.warm), c.step, 0])
            for p in self._pieces(c):
                row(("piece", k, p), [PIECE, -1 if p is None else p, c.sigma, int(c.warm), c.step, 0])
        row(("final",), [FINAL, -1, 0.0, 0, self.steps_total, 0])
        for t in range(self.steps_total + 1):
            for cancelled in (0, 1):
                row(("stop", t, cancelled), [STOP, -1, 0.0, 0, t, cancelled])
        device = self.flow.device
        self._headers = torch.tensor(rows, dtype=torch.float64, device=device)
        self._sigma32 = torch.tensor([c.sigma for c in self.calls], dtype=torch.float32, device=device)
        # the last piece of each step: where every rank agrees whether the next step runs
        self._last_piece = {}
        for k, c in enumerate(self.calls):
            self._last_piece[c.step] = (k, self._pieces(c)[-1])
        messages = []
        if self.stage == 0:
            shape = list(self.latent_shape)
            shape[0] = self.items.stop - self.items.start
            for k, c in enumerate(self.calls):
                for m in range(layout.patches):
                    rows_m = self.model.latent_rows(m)
                    messages.append(Message(f"patch {m} request (step {c.step + 1})",
                                            (((shape[0], shape[1], rows_m.stop - rows_m.start, shape[3]),
                                              torch.float32),), self._row[("request", k, m)], c.step))
        else:
            for k, c in enumerate(self.calls):
                for p in self._pieces(c):
                    messages.append(Message(
                        f"{'the whole latent' if p is None else f'patch {p}'} activations (step {c.step + 1})",
                        tuple((s, self.flow.dtype) for s in self._piece_shapes(p)), self._row[("piece", k, p)], c.step))
        link = Link(self.stage, self.mesh.rank, self.deadline_s)
        # the host runs at most two steps' requests (or one step's pieces) ahead of what has arrived
        self.inbox = Inbox(link, messages, self._peer(-1), self._link("in"), device, run_ahead=2 * layout.patches + 2)
        self.outbox = Outbox(link, self._peer(1), self._link("out"), self.mesh.stats)

    def check_headers(self) -> None:
        """After a job: every header this stage took is the one the schedule says (one read per job)."""
        inbox = self.inbox
        if inbox is None or inbox.taken == 0:
            return
        expected = self._headers[torch.tensor([m.header for m in inbox.messages[:inbox.taken]],
                                              device=self._headers.device)]
        bad = (inbox.headers[:inbox.taken] != expected).any(dim=1).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise EngineError(f"PipeFusion stage {self.stage} (rank {self.mesh.rank}) received "
                              f"{inbox.headers[i].tolist()} where the job's schedule says {expected[i].tolist()} "
                              f"({inbox.messages[i].what}): the stages did not follow the same schedule",
                              rank=self.mesh.rank, phase="compute")

    # ---- the job ----------------------------------------------------------------------------------------------
    def run(self, ctx, start: SamplingStart | None, positive: Conditioning, negative: Conditioning | None, *,
            latent_shape, cfg: float, sampler: str, seed: int, steps: int, deadline_s: float, cfg_norm: float = 0.0):
        """Run the job's sampling through the pipeline. The last stage gets `start` (every rank can build it) and
        returns the raw latent; the first stage returns the same latent, received from the last; others None."""
        self.deadline_s = deadline_s
        self.cfg_norm = cfg_norm
        syncs.start()
        self.bind(positive, negative, latent_shape, cfg)
        self._plan(start, sampler, seed)
        try:
            stopped_after = self._loop(ctx, start, sampler, seed)
            return self._end(ctx, stopped_after)
        finally:
            self.outbox.close()
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

    def _temb(self, g: int, sigma, key) -> torch.Tensor:
        """The group's timestep embedding at sigma: a float, or in the loop the call's sigma on the device with the
        call as key (each piece of a call reuses it)."""
        if key is None:
            return self.model.temb(self.groups[g][1], torch.tensor(sigma, dtype=torch.float32, device=self.flow.device))
        if self.temb_cache.get("call") != key:
            self.temb_cache = {"call": key}
        if g not in self.temb_cache:
            self.temb_cache[g] = self.model.temb(self.groups[g][1], sigma)
        return self.temb_cache[g]

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

    def compute(self, band: int | None, sigma, x: torch.Tensor | None, received: list | None, key=None) -> list:
        """This stage's blocks on one piece, every pass group; returns the activations (or, last stage, velocity
        tokens per group). sigma: a float, or (in the loop) the call's sigma on the device with the call as key."""
        self.state.band = band
        out = []
        with_text = band in (None, 0)
        for g, (passes, prepared) in enumerate(self.groups):
            self.state.group = g
            temb = self._temb(g, sigma, key)
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

    def _loop(self, ctx, start: SamplingStart | None, sampler: str, seed: int) -> int | None:
        """Every piece of the schedule through this stage; returns None at the end of the job, or the step after
        which every rank agreed to stop (a cancel)."""
        layout = self.layout
        first, last = self.stage == 0, self.stage == self.stages - 1
        if last:
            self._start_patches(start, sampler, seed)
        self.inbox.allow(0)
        reported = 0
        for k, call in enumerate(self.calls):
            if call.step > reported:   # every rank notes the step (heartbeats name it); rank 0 reports it
                reported = call.step
                ctx.progress(call.step, self.steps_total)
            for p in self._pieces(call):
                stop = False
                if (k, p) == self._last_piece[call.step] and call.step + 1 < self.steps_total:
                    stop = ctx.cancel_agreed(call.step + 1)
                    if not stop:
                        self.inbox.allow(call.step + 1)
                x = data = None
                if first:
                    x = self._take_requests(p)
                else:
                    data = self.inbox.take()
                out = self.compute(p, self._sigma32[k], x, data, key=k)
                if last:
                    self._step_patches(k, p, out, send_requests=not stop)
                else:
                    self._send(self._row[("piece", k, p)], out, f"patch {p} activations (step {call.step + 1})"
                               if p is not None else f"the whole latent's activations (step {call.step + 1})")
                if stop:
                    if first and not call.warm:   # the last stage's requests sent before it decided
                        self.inbox.allow_count(layout.patches - 1)
                    self.inbox.drain()
                    return call.step + 1
        return None

    def _take_requests(self, band: int | None) -> torch.Tensor:
        """The first stage's input: one patch's rows, or for a whole-latent call every patch's, put together."""
        if band is not None:
            return self.inbox.take()[0]
        shape = list(self.latent_shape)
        shape[0] = self.items.stop - self.items.start
        whole = torch.empty(shape, dtype=torch.float32, device=self.flow.device)
        for m in range(self.layout.patches):
            whole[:, :, self.model.latent_rows(m)] = self.inbox.take()[0]
        return whole

    def _end(self, ctx, stopped_after: int | None):
        """The job's last messages: the final latent (last stage -> first), a stop down the stages (every stage but
        the last sends one, every stage but the first takes one); a cancel raises on every rank once they are
        through."""
        cancelled = stopped_after is not None
        done = stopped_after if cancelled else self.steps_total
        result = None
        if self.stage == self.stages - 1 and not cancelled:
            result = self._latent
            self._send(self._row[("final",)], [result], "the final latent")
        elif self.stage == 0 and not cancelled:
            self.inbox.expect(Message("the final latent", ((tuple(self.latent_shape), torch.float32),),
                                      self._row[("final",)], done))
            (result,) = self.inbox.take()
        if self.stage > 0:
            self.inbox.expect(Message("the pipeline's stop", (), self._row[("stop", done, int(cancelled))], done))
            self.inbox.take()
        if self.stage < self.stages - 1:
            self._send(self._row[("stop", done, int(cancelled))], [], "the pipeline's stop")
        if cancelled:
            raise JobCancelledSignal(done)
        ctx.progress(done, self.steps_total)
        return result if self.stage in (0, self.stages - 1) else None

    # the last stage: finish each piece, gather the velocities, step that patch's sampler, send its next request
    def _start_patches(self, start: SamplingStart, sampler: str, seed: int) -> None:
        layout = self.layout
        self._start = start
        x_all = start.x_model
        self._gens, self._finals = [], [None] * layout.patches
        shared_noise: dict = {}   # one draw of the whole latent's step noise, each patch taking its rows
        for m in range(layout.patches):
            rows = self.model.latent_rows(m)
            region = (slice(None), slice(None), rows, slice(None))
            self._gens.append(sampler_steps(sampler, x_all[region], start.sigmas, seed=seed,
                                            percent_to_sigma=start.percent_to_sigma, whole=x_all, region=region,
                                            host_sigmas=self._sigmas_host, shared_noise=shared_noise))
        self._next = [next(g) for g in self._gens]          # each patch's next request: (x, sigma)
        for m in range(layout.patches):
            self._request(0, m)

    def _request(self, k: int, m: int) -> None:
        x, _ = self._next[m]
        self._send(self._row[("request", k, m)], [x[self.items]],
                   f"patch {m} request (step {self.calls[k].step + 1})")

    def _step_patches(self, k: int, piece: int | None, tokens: list, send_requests: bool) -> None:
        v_bands = self._velocities(tokens, piece)      # per pass: [batch, 16, rows, width] of the piece
        for m in (range(self.layout.patches) if piece is None else [piece]):
            sl = slice(None) if piece is not None else self.model.latent_rows(m)
            v = tuple(t[:, :, sl] for t in v_bands)
            x, s = self._next[m]
            denoised = guided_denoiser(lambda xx, ss, which, v=v: v, self.cfg_scale, self.cfg_norm)(x, s)
            try:
                self._next[m] = self._gens[m].send(denoised)
            except StopIteration as end:
                self._finals[m] = end.value
                self._next[m] = None
            if send_requests and self._next[m] is not None:
                self._request(k + 1, m)
        if all(f is not None for f in self._finals):
            self._latent = self._start.finish(torch.cat(self._finals, dim=2))

    def _velocities(self, tokens: list[torch.Tensor], band: int | None) -> tuple[torch.Tensor, ...]:
        """Velocity tokens of this rank's share, per pass group -> the piece's velocity per pass, whole batch."""
        inverse = self._inverse[band]
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
