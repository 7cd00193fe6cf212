"""PipeFusion: patch-pipelined denoising with stale activations (xDiT's PipeFusion, on ComfyUI's samplers).

The transformer's blocks are split into P stages, one per rank of a `pipefusion` group; each stage rank holds only
its own blocks (models/load.py `keep`). The latent is split into M row bands (patches, M >= P). The first W steps
run synchronously: the whole latent goes through the stages in turn (every layer's K/V is then fresh everywhere).
After the warmup, stage s computes patch m of model call k with fresh activations for patch m and, in attention, the
K/V other patches left in that layer: this call's for the patches before m, the previous call's for the rest (the
"stale" K/V). Patch m's activations go to stage s+1 asynchronously while stage s starts patch m+1.

The sampler step is applied per patch on the last stage: each patch runs ComfyUI's sampler as its own generator
(sampling/samplers.sampler_steps; every sampler here is elementwise, and the stochastic ones draw the whole latent's
noise and take the patch's region, so a patch sees exactly the noise a whole run gives it). The last stage sends
patch m's next input to the first stage as soon as its step is done: the pipeline never drains between steps.

Text tokens travel with patch 0 (FLUX and SD3 alike): the text stream is computed once per call, with the first
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
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import EngineError
from ..runtime.jobs import JobCancelledSignal
from ..models.flow import Conditioning, FlowModel, Prepared
from ..sampling.ksampler import SamplingStart, guided_denoiser
from ..sampling.samplers import sampler_steps
from .attention import SequenceParallelAttention
from .mesh import Mesh
from .parallelize import pass_groups

# header kinds
REQUEST, PIECE, FINAL, STOP = 0, 1, 2, 3
HEADER = 6  # kind, band (-1: the whole latent), sigma, warm, steps done, cancelled


# ---- layout: patches, stages, which tokens a rank holds -----------------------------------------------------------

def split_rows(rows: int, patches: int) -> list[int]:
    """Token rows per patch, as even as possible, the larger patches first."""
    base, extra = divmod(rows, patches)
    return [base + (1 if m < extra else 0) for m in range(patches)]


def block_costs(model: torch.nn.Module, block_lists: tuple[str, ...], image_tokens: int,
                text_tokens: int) -> list[float]:
    """A block's FLOPs per forward, from its weights' shapes (works on the meta model): matrices of the text stream
    (FLUX `context`/`add_` modules, SD3's context blocks) see the text tokens, the others every token they are given;
    attention adds 4 * tokens^2 * width."""
    costs = []
    for name in block_lists:
        for block in model.get_submodule(name):
            single = not hasattr(block, "norm1_context")     # FLUX single blocks: text and image in one stream
            flops = 0.0
            for pname, p in block.named_parameters():
                if p.ndim != 2 or "norm" in pname:           # modulation matrices act once per image, not per token
                    continue
                text_side = not single and any(t in pname for t in ("context", "add_", "to_add_out"))
                flops += 2 * p.numel() * (text_tokens if text_side else image_tokens + (text_tokens if single else 0))
            width = block.attn.inner_dim if hasattr(block.attn, "inner_dim") else 0
            attentions = 2 if getattr(block, "attn2", None) is not None else 1
            flops += attentions * 4 * (image_tokens + text_tokens) ** 2 * width
            costs.append(flops)
    return costs


def balanced_split(costs: list[float], stages: int, fits=None) -> list[int] | None:
    """Blocks per stage (contiguous, at least one each): the costliest stage as cheap as possible, and among such
    splits the most even one (dynamic programming over prefix sums; a stage costs the sum of its blocks').
    fits(stage, first block, end block) -> bool restricts the stages (memory); None when no split fits."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: (max stage cost, sum of squares, counts) splitting the first i blocks into s stages
    best: list[dict[int, tuple]] = [{0: (0.0, 0.0, ())}]
    for s in range(1, stages + 1):
        row = {}
        for i in range(s, n - (stages - s) + 1):
            options = []
            for j, (worst, squares, counts) in best[s - 1].items():
                if j < i and (fits is None or fits(s - 1, j, i)):
                    part = prefix[i] - prefix[j]
                    options.append((max(worst, part), squares + part * part, counts + (i - j,)))
            if options:
                row[i] = min(options, key=lambda o: (round(o[0], 6), o[1]))
        best.append(row)
    return list(best[stages][n][2]) if n in best[stages] else None


@dataclass(frozen=True)
class Layout:
    """Everything every rank of a PipeFusion job agrees on, derived from the job alone."""
    stages: int
    patches: int
    warmup: int
    rows: int                       # token rows of the latent
    cols: int                       # tokens per row
    band_rows: tuple[int, ...]      # token rows per patch
    stage_blocks: tuple[int, ...]   # blocks per stage, over the family's block lists in order
    sp: int                         # ulysses x ring inside a stage

    @property
    def image_tokens(self) -> int:
        return self.rows * self.cols

    def band_tokens(self, m: int) -> int:
        return self.band_rows[m] * self.cols

    def band_start(self, m: int) -> int:
        return sum(self.band_rows[:m]) * self.cols

    def blocks_of(self, stage: int) -> range:
        start = sum(self.stage_blocks[:stage])
        return range(start, start + self.stage_blocks[stage])

    def local_tokens(self, band: int | None, sp_rank: int) -> torch.Tensor:
        """Global image-token indices (row-major) this sequence-parallel rank holds of a patch (None: the whole
        latent, which is every patch's share in patch order, so both kinds of call hold the same tokens)."""
        bands = range(self.patches) if band is None else [band]
        parts = []
        for m in bands:
            share = self.band_tokens(m) // self.sp
            start = self.band_start(m) + sp_rank * share
            parts.append(torch.arange(start, start + share))
        return torch.cat(parts)

    def buffer_positions(self, band: int, ulysses: int) -> torch.Tensor:
        """Where a patch's keys go in a stage rank's K/V buffer after the Ulysses exchange. The buffer holds the keys of
        a whole-latent call in the order that exchange leaves them: each Ulysses member's share of every patch, member
        after member; a patch's keys arrive member after member too."""
        per_member = self.image_tokens // self.sp
        share = self.band_tokens(band) // self.sp
        offset = self.band_start(band) // self.sp
        return torch.cat([torch.arange(i * per_member + offset, i * per_member + offset + share)
                          for i in range(ulysses)])


def pipefusion_problems(stages: int, patches: int, warmup: int, steps: int, layers: int, token_rows: int,
                        tokens_per_row: int, sp: int, stage_blocks: tuple[int, ...] | None) -> list[str]:
    """Why a PipeFusion setting cannot run this job, each with the numbers and what would work (empty: it can)."""
    problems = []
    if stages > layers:
        problems.append(f"pipefusion {stages} exceeds the model's {layers} blocks: use at most {layers} stages")
    if patches < stages:
        problems.append(f"patches {patches} is fewer than the {stages} stages: use patches >= {stages} (default: "
                        f"{stages})")
    if patches > token_rows:
        problems.append(f"patches {patches} exceeds the latent's {token_rows} token rows: use at most {token_rows} "
                        f"(or a taller image)")
    elif sp > 1:
        rows = split_rows(token_rows, patches)
        bad = sorted({r * tokens_per_row for r in rows if (r * tokens_per_row) % sp})
        if bad:
            fits = [p for p in range(stages, token_rows + 1)
                    if all((r * tokens_per_row) % sp == 0 for r in split_rows(token_rows, p))]
            problems.append(f"patches of {bad} image tokens ({token_rows} token rows of {tokens_per_row} in "
                            f"{patches} patches) are not divisible by ulysses x ring = {sp}: "
                            + (f"use patches {min(fits, key=lambda p: (abs(p - patches), -p))}" if fits
                               else "use a smaller ulysses x ring or another size"))
    if not 1 <= warmup <= steps:
        problems.append(f"warmup steps {warmup} is outside 1..{steps} (the job's steps): the first step fills the "
                        f"stale K/V, so use 1 to {steps}")
    if stage_blocks is not None:
        if len(stage_blocks) != stages or sum(stage_blocks) != layers or min(stage_blocks) < 1:
            problems.append(f"stage blocks {list(stage_blocks)} do not split the model's {layers} blocks into "
                            f"{stages} stages of at least 1: give {stages} counts summing to {layers}")
    return problems


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

class StageModel:
    """The model's forward cut at stage boundaries: embed (first stage), this stage's blocks, the final layer (last
    stage). Families differ only in embedding, positions and unpatching."""

    def __init__(self, flow: FlowModel, layout: Layout, mesh: Mesh, block_lists: tuple[str, ...], stage: int):
        self.flow, self.model, self.layout, self.mesh = flow, flow.model, layout, mesh
        self.first, self.last = stage == 0, stage == layout.stages - 1
        every = [b for name in block_lists for b in flow.model.get_submodule(name)]
        self.blocks = [every[i] for i in layout.blocks_of(stage)]
        self.patch = flow.loaded.info.latent_patch
        self.sp = mesh["sp"]
        self._ropes: dict = {}

    def local(self, band: int | None) -> torch.Tensor:
        return self.layout.local_tokens(band, self.sp.rank)

    def latent_rows(self, band: int | None) -> slice:
        if band is None:
            return slice(0, self.layout.rows * self.patch)
        start = sum(self.layout.band_rows[:band]) * self.patch
        return slice(start, start + self.layout.band_rows[band] * self.patch)

    def run_blocks(self, text, image, temb, band, with_text: bool):
        raise NotImplementedError

    def unpatch(self, tokens: torch.Tensor, band: int | None) -> torch.Tensor:
        """[b, tokens of the piece in row-major order, p*p*16] -> latent rows [b, 16, rows * p, width]."""
        p, rows = self.patch, self.latent_rows(band)
        h, w = (rows.stop - rows.start) // p, self.layout.cols
        b = tokens.shape[0]
        if self.flow.family == "flux":   # FLUX packs (channel, row, col) per token, SD3 (row, col, channel)
            grid = tokens.reshape(b, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5)
        else:
            grid = tokens.reshape(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return grid.reshape(b, -1, h * p, w * p)


class FluxStage(StageModel):
    def temb(self, prepared: Prepared, sigma32: torch.Tensor) -> torch.Tensor:
        n = prepared.cond.shape[0]
        t = sigma32.reshape(-1).expand(n) * 1000.0
        embed = self.model.time_text_embed
        if self.model.config.guidance_embeds:
            return embed(t, prepared.guidance * 1000.0, prepared.pooled)
        return embed(t, prepared.pooled)

    def embed(self, x: torch.Tensor, prepared: Prepared, band: int | None, with_text: bool):
        b, c, h, w = x.shape
        packed = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        start = 0 if band is None else self.layout.band_start(band)
        image = self.model.x_embedder(packed[:, self.local(band) - start])
        text = self.model.context_embedder(prepared.cond) if with_text else image.new_zeros(b, 0, image.shape[2])
        return text, image

    def _rope(self, band, n_text: int, device):
        key = (band, n_text)
        if key not in self._ropes:
            self._ropes[key] = self._rope_for(band, n_text, device)
        return self._ropes[key]

    def _rope_for(self, band, n_text: int, device):
        idx = self.local(band)
        rows, cols = idx // self.layout.cols, idx % self.layout.cols
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(torch.float32)
        ids = torch.cat([torch.zeros(n_text, 3), img_ids]).to(device)
        return self.model.pos_embed(ids)

    def run_blocks(self, text, image, temb, band, with_text: bool):
        n_text = text.shape[1]
        rope = self._rope(band, n_text, image.device)
        kwargs = {"joint_text_tokens": n_text}
        for block in self.blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope,
                                joint_attention_kwargs=kwargs)
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb))


class SD3Stage(StageModel):
    def temb(self, prepared: Prepared, sigma32: torch.Tensor) -> torch.Tensor:
        n = prepared.cond.shape[0]
        return self.model.time_text_embed(sigma32.reshape(-1).expand(n) * 1000.0, prepared.pooled)

    def embed(self, x: torch.Tensor, prepared: Prepared, band: int | None, with_text: bool):
        pe = self.model.pos_embed   # PatchEmbed's forward, on a band of rows: the conv is per patch, positions cropped
        tokens = pe.proj(x).flatten(2).transpose(1, 2)
        start = 0 if band is None else self.layout.band_start(band)
        idx = self.local(band)
        height, width = self.layout.rows * self.patch, self.layout.cols * self.patch
        positions = pe.cropped_pos_embed(height, width)[:, idx]
        image = (tokens[:, idx - start] + positions).to(tokens.dtype)
        text = (self.model.context_embedder(prepared.cond) if with_text
                else image.new_zeros(x.shape[0], 0, image.shape[2]))
        return text, image

    def run_blocks(self, text, image, temb, band, with_text: bool):
        for block in self.blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb)
            if text is None:  # the last block keeps no text stream
                text = image.new_zeros(image.shape[0], 0, image.shape[2])
        return text, image

    def final(self, image, temb):
        return self.model.proj_out(self.model.norm_out(image, temb))


STAGES = {"flux": FluxStage, "sd3": SD3Stage}


# ---- the pipeline -----------------------------------------------------------------------------------------------

class StageStall(EngineError):
    pass


class Pipeline:
    """One rank's part of a PipeFusion job: its stage's model, the stale K/V, and the loop its stage runs."""

    def __init__(self, flow: FlowModel, mesh: Mesh, block_lists: tuple[str, ...], processor: type):
        self.flow, self.mesh, self.block_lists, self.processor = flow, mesh, block_lists, processor
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
        family = self.flow.family
        self.model = STAGES[family](self.flow, layout, self.mesh, self.block_lists, self.stage)
        mine = stage_blocks_named(self.block_lists, block_counts(self.flow.loaded.info), layout, self.stage)
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
            latent_shape, cfg: float, sampler: str, seed: int, steps: int, deadline_s: float):
        """Run the job's sampling through the pipeline. The last stage gets `start` (every rank can build it) and
        returns the raw latent; the first stage returns the same latent, received from the last; others None."""
        self.deadline_s = deadline_s
        self._pending = []
        self.steps_total = steps
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
                denoised = guided_denoiser(lambda xx, ss, which, v=v: v, self.cfg_scale)(x, s)
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

REFERENCE_TEXT = {"flux": 512, "sd3": 77 + 256}
_META: dict = {}   # checkpoint config -> (meta model, reference block costs): built once per model, not per job


def _meta(info):
    import json
    from ..models.load import build_empty
    key = (info.family, json.dumps(info.config, sort_keys=True, default=str))
    if key not in _META:
        _META[key] = (build_empty(info), {})
    return _META[key]


def meta_model(info) -> torch.nn.Module:
    """The diffusers transformer of `info` on the meta device (shapes only), cached."""
    return _meta(info)[0]


def reference_costs(info, block_lists: tuple[str, ...]) -> list[float]:
    """Block costs at 1024x1024 and the encoders' usual text length: the balanced split depends on the model only,
    so a new image size never moves blocks between stages (which would mean loading weights again)."""
    model, costs = _meta(info)
    if block_lists not in costs:
        tokens = (1024 // 8 // info.latent_patch) ** 2
        costs[block_lists] = block_costs(model, block_lists, tokens, REFERENCE_TEXT[info.family])
    return costs[block_lists]


def make_layout(info, block_lists: tuple[str, ...], plan, latent_h: int, latent_w: int, patches: int | None,
                warmup: int, stage_blocks) -> Layout:
    """The layout every rank of the job derives (the client checks it first with `layout_problems`)."""
    p = info.latent_patch
    rows, cols = latent_h // p, latent_w // p
    stages = plan.pipefusion
    m = patches or stages
    counts = tuple(stage_blocks) if stage_blocks else tuple(balanced_split(reference_costs(info, block_lists), stages))
    return Layout(stages, m, warmup, rows, cols, tuple(split_rows(rows, m)), counts, plan.ulysses * plan.ring)


def layout_problems(info, plan, latent_h: int, latent_w: int, patches: int | None, warmup: int, steps: int,
                    stage_blocks) -> list[str]:
    p = info.latent_patch
    return pipefusion_problems(plan.pipefusion, patches or plan.pipefusion, warmup, steps, info.layers, latent_h // p,
                               latent_w // p, plan.ulysses * plan.ring,
                               tuple(stage_blocks) if stage_blocks else None)


def stage_memory(info, block_lists: tuple[str, ...], plan, work) -> tuple:
    """What a stage holds, in bytes: (per block: weights + its layers' K/V buffers, per stage: the embedders or final
    layer it holds plus the activations and runtime every stage has)."""
    from . import cost
    model = meta_model(info)
    per_parameter = work.weight_bytes / max(1, info.parameters)
    sp = plan.ulysses * plan.ring
    forward = cost.items_per_rank(plan, work)
    kv = 2 * forward * (work.image_tokens + work.text_tokens) / sp * work.heads * work.head_dim \
        * cost.DTYPE_BYTES[work.dtype]
    blocks = []
    for name in block_lists:
        for block in model.get_submodule(name):
            attentions = 2 if getattr(block, "attn2", None) is not None else 1
            blocks.append(sum(p.numel() for p in block.parameters()) * per_parameter + attentions * kv)

    def params(prefixes):
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes)) * per_parameter
    m = cost.memory_gib(plan, work)
    base = (m["activations"] + m["runtime"]) * cost.GiB + params(("time_text_embed.",))
    extras = [base] * plan.pipefusion
    extras[0] += params(("x_embedder.", "context_embedder.", "pos_embed."))
    extras[-1] += params(("norm_out.", "proj_out."))
    return blocks, extras


def fit_stages(info, block_lists: tuple[str, ...], plan, work, memory_gib: float):
    """The compute-balanced split if every stage fits `memory_gib`, else the most compute-balanced split that fits:
    (blocks per stage or None, GiB per stage of that split or of the compute-balanced one, whether the split is the
    compute-balanced one)."""
    from .cost import GiB
    costs = reference_costs(info, block_lists)
    blocks, extras = stage_memory(info, block_lists, plan, work)
    prefix = [0.0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def need(stage, start, end):
        return (extras[stage] + prefix[end] - prefix[start]) / GiB

    def gib(counts):
        edges = [sum(counts[:k]) for k in range(len(counts) + 1)]
        return [need(k, edges[k], edges[k + 1]) for k in range(len(counts))]
    balanced = balanced_split(costs, plan.pipefusion)
    if max(gib(balanced)) <= memory_gib:
        return balanced, gib(balanced), True
    fitted = balanced_split(costs, plan.pipefusion, lambda st, a, b: need(st, a, b) <= memory_gib)
    return fitted, gib(fitted if fitted else balanced), False


def block_counts(info) -> list[int]:
    """Blocks in each of the family's block lists (FLUX: double, single; SD3: joint)."""
    if info.family == "flux":
        return [info.config["num_layers"], info.config["num_single_layers"]]
    return [info.config["num_layers"]]


def stage_blocks_named(block_lists: tuple[str, ...], counts: list[int], layout: Layout, stage: int) -> tuple:
    """Module-name prefixes of a stage's blocks ("transformer_blocks.3.", ...)."""
    flat = [f"{name}.{i}." for name, n in zip(block_lists, counts) for i in range(n)]
    return tuple(flat[i] for i in layout.blocks_of(stage))


def stage_keep(block_lists: tuple[str, ...], counts: list[int], layout: Layout, stage: int):
    """The diffusers parameter names a stage holds: its blocks, the timestep/pooled embedder (every stage modulates
    with it), the image and text embedders on the first stage, the final layer on the last."""
    prefixes = ("time_text_embed.",) + stage_blocks_named(block_lists, counts, layout, stage)
    if stage == 0:
        prefixes += ("x_embedder.", "context_embedder.", "pos_embed.")
    if stage == layout.stages - 1:
        prefixes += ("norm_out.", "proj_out.")
    return lambda name: name.startswith(prefixes)


def analytic_p2p_bytes(stage: int, stages: int, *, calls: int, image_tokens: int, text_tokens: int, hidden: int,
                       batch: int, latent: tuple[int, int, int], patches: int, act_bytes: int, warm_calls: int = 1,
                       sp: int = 1, batch_share: int | None = None, images: int = 1) -> int:
    """Bytes one rank sends between stages over a job of `calls` model calls (the first `warm_calls` whole): a stage
    before the last sends each piece's activations (the text once per call, with patch 0; its share of the image
    tokens) and one stop; the last stage sends each patch's next input per call and the final latent. A header is
    6 float64s. `batch` counts the rows of one forward (both passes when they share it), `batch_share` the images
    of this rank's pipeline (its data-parallel share), `images` the job's."""
    header = HEADER * 8
    share = images if batch_share is None else batch_share
    c, h, w = latent
    if stage < stages - 1:
        activations = batch * (text_tokens + image_tokens // sp) * hidden * act_bytes
        return (warm_calls * (header + activations) + (calls - warm_calls) * (patches * header + activations)
                + header)
    return calls * (patches * header + share * c * h * w * 4) + header + images * c * h * w * 4
