"""PipeFusion's planning half: the layout every rank of a job derives (patches, stages, which tokens a rank holds),
the split of the blocks into stages balanced by compute, which weights a stage holds, and the bytes stages send one
another. The client checks a job with it before launch; the planner prices plans with it (what a stage needs in memory
is memory.py's). Nothing here runs a model: the rank half is pipefusion/pipeline.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ...models.load import build_empty

HEADER = 6  # floats of a message header: kind, band (-1: the whole latent), sigma, warm, steps done, cancelled


def split_rows(rows: int, patches: int) -> list[int]:
    """Token rows per patch, as even as possible, the larger patches first."""
    base, extra = divmod(rows, patches)
    return [base + (1 if m < extra else 0) for m in range(patches)]


def block_costs(model: torch.nn.Module, block_lists: tuple[str, ...], image_tokens: int, text_tokens: int,
                text_stream: tuple[str, ...], modulation: tuple[str, ...]) -> list[float]:
    """A block's FLOPs per forward, from its weights' shapes (works on the meta model): matrices of the text stream
    (names with one of `text_stream` in them) see the text tokens, the others every token they are given (a block
    without a text stream carries text and image in one); modulation matrices (`modulation`) act once per image, not
    per token; attention adds 4 * tokens^2 * width."""
    costs = []
    for name in block_lists:
        for block in model.get_submodule(name):
            matrices = [(n, p) for n, p in block.named_parameters()
                        if p.ndim == 2 and not any(m in n for m in modulation)]
            single = not any(t in n for n, _ in matrices for t in text_stream)
            flops = 0.0
            for pname, p in matrices:
                text_side = not single and any(t in pname for t in text_stream)
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



_META: dict = {}   # checkpoint config -> (meta model, reference block costs): built once per model, not per job


def _meta(info):
    key = (info.family, json.dumps(info.config, sort_keys=True, default=str))
    if key not in _META:
        _META[key] = (build_empty(info), {})
    return _META[key]


def meta_model(info) -> torch.nn.Module:
    """The diffusers transformer of `info` on the meta device (shapes only), cached."""
    return _meta(info)[0]


def block_lists(info) -> tuple[str, ...]:
    """The family's block lists, in order: what the stages divide."""
    return info.spec.tokens.blocks


def block_counts(info) -> list[int]:
    """Blocks in each of the family's block lists (e.g. FLUX: double, single)."""
    model = meta_model(info)
    return [len(model.get_submodule(name)) for name in block_lists(info)]


def reference_costs(info) -> list[float]:
    """Block costs at 1024x1024 and the encoders' usual text length: the balanced split depends on the model only,
    so a new image size never moves blocks between stages (which would mean loading weights again)."""
    model, costs = _meta(info)
    if "reference" not in costs:
        family = info.spec
        tokens = (1024 // info.latent.downscale // info.latent_patch) ** 2
        costs["reference"] = block_costs(model, block_lists(info), tokens, family.text_tokens, family.text_stream,
                                         family.modulation)
    return costs["reference"]


def make_layout(info, plan, latent_h: int, latent_w: int, patches: int | None, warmup: int, stage_blocks) -> Layout:
    """The layout every rank of the job derives (the client checks it first with `layout_problems`)."""
    p = info.latent_patch
    rows, cols = latent_h // p, latent_w // p
    stages = plan.pipefusion
    m = patches or stages
    counts = tuple(stage_blocks) if stage_blocks else tuple(balanced_split(reference_costs(info), stages))
    return Layout(stages, m, warmup, rows, cols, tuple(split_rows(rows, m)), counts, plan.ulysses * plan.ring)


def layout_problems(info, plan, latent_h: int, latent_w: int, patches: int | None, warmup: int, steps: int,
                    stage_blocks) -> list[str]:
    p = info.latent_patch
    return pipefusion_problems(plan.pipefusion, patches or plan.pipefusion, warmup, steps, info.layers, latent_h // p,
                               latent_w // p, plan.ulysses * plan.ring,
                               tuple(stage_blocks) if stage_blocks else None)


def stage_blocks_named(info, layout: Layout, stage: int) -> tuple:
    """Module-name prefixes of a stage's blocks ("transformer_blocks.3.", ...)."""
    flat = [f"{name}.{i}." for name, n in zip(block_lists(info), block_counts(info)) for i in range(n)]
    return tuple(flat[i] for i in layout.blocks_of(stage))


def stage_keep(info, layout: Layout, stage: int):
    """The diffusers parameter names a stage holds: its blocks, what every stage needs (the timestep embedding every
    block modulates with), the embedders on the first stage, the final layer on the last (the family says which)."""
    held = info.spec.stage_params
    prefixes = held.every + stage_blocks_named(info, layout, stage)
    if stage == 0:
        prefixes += held.first
    if stage == layout.stages - 1:
        prefixes += held.last
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

