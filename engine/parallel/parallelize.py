"""`parallelize`: the parallel plan applied to a FlowModel, for any family.

Each family declares in a small table (engine/families, `TokenTable`) where its tokens are split across the
sequence-parallel group and where they are gathered again; one set of generic hooks here applies any table (the
idea of diffusers' `_cp_plan`), plus the family's attention processor, which routes attention through the one
sequence-parallel entry point (Ulysses, Ring, joint text). CFG and data parallel split the model call itself: each
rank evaluates its pass and its share of the batch, and the velocities are gathered, so the sampler always runs on
the whole batch (whole-batch noise draws stay exact). The job handler and FlowModel hold no parallel branch: with a
one-rank mesh every group has one member and every split and gather is a no-op.

Reference tokens (FLUX.1 Kontext) follow the image tokens in the same inputs. Where image and reference tokens
together divide the degree they are split as one sequence; otherwise every rank holds the reference tokens in full
(joint, like text that does not divide), the processor is told so (`joint_reference_tokens`), and the gather takes
only the image shards.

Image tokens the degree does not divide are padded at the split: each rank holds ceil(N / degree) of them, the last
rank's shard ending in copies of the last token (`plan.pad_tokens` of them, fewer than a shard). The attention
entry point drops the padded keys before every softmax, so the real tokens' outputs are exact; the padded rows'
outputs are dropped at the gather.

Seams: a new family is a table and a processor in its module. PipeFusion (pipefusion.py) splits the table's `blocks`
into stages and runs its own loop with the same processors. The step cache (engine/parallel/cache.py) wraps the same
block lists, its skip decision agreed over every rank of the job, one call late; the predictor tells it which stream
(pass and batch share) each model call belongs to.
"""
from __future__ import annotations

import torch

from ..families.base import TokenTable
from ..models.flow import Conditioning, FlowModel, Prepared
from ..models.sharded import gathered
from .attention import SequenceParallelAttention
from .cache import StepCache
from .mesh import Mesh


def pass_groups(sides: list[Conditioning], cfg_group) -> tuple[list[Conditioning], list[list[Conditioning]]]:
    """The passes this rank computes (CFG parallel: one per rank, in group order) and the forwards they take: both
    passes in one forward when their text lengths and reference latents' shapes agree (exactly the same math), else
    one forward each (ComfyUI does not concatenate such conds either)."""
    mine = [sides[cfg_group.rank]] if cfg_group.size > 1 and len(sides) == 2 else sides
    if len(mine) == 2 and mine[0].forward_shape != mine[1].forward_shape:
        return mine, [[s] for s in mine]
    return mine, [mine]


class ParallelFlow:
    """A FlowModel under a mesh: `predictor` gives the sampler its Predict; `close` gives the model back unchanged."""

    def __init__(self, flow: FlowModel, mesh: Mesh, table: TokenTable):
        self.flow, self.mesh, self.table = flow, mesh, table
        self.family = flow.family
        self._hooks: list = []
        self._original_processors: dict | None = None
        self.cache: StepCache | None = None
        self._joint_references = 0   # reference tokens every rank holds in full in the current forward
        self._joint_text = False     # the current forward's text is held in full by every rank
        self._image_tokens = 0       # image tokens (before padding) of the current forward
        self._pad = 0                # pad rows at the end of the last rank's image shard in the current forward
        self.attention: SequenceParallelAttention | None = None
        self._marked: list = []      # modules marked for the processor (local_keys), unmarked at close
        if mesh["sp"].size > 1:
            self._split_tokens()

    # ---- sequence parallel: the table applied by hooks ---------------------------------------------------------
    def _split_tokens(self) -> None:
        model, table = self.flow.model, self.table
        self._original_processors = dict(model.attn_processors)
        self.attention = SequenceParallelAttention(self.mesh)
        model.set_attn_processor(table.processor(self.attention))
        if table.split_inputs or table.text_inputs:
            self._hooks.append(model.register_forward_pre_hook(self._split_forward_inputs, with_kwargs=True))
        for name, first in table.split_grid_after:
            self._hooks.append(model.get_submodule(name).register_forward_hook(
                lambda module, args, out, first=first, name=name: self._shard_image(out.flatten(first), first, name)))
        for name, item, dim in table.split_after:
            self._hooks.append(model.get_submodule(name).register_forward_hook(self._split_output(name, item, dim)))
        for name, index, dim in table.split_args:
            for module in modules_at(model, name):
                self._hooks.append(module.register_forward_pre_hook(self._split_arg(name, index, dim)))
        if table.local_keys and not getattr(table.processor, "takes_local_keys", False):
            raise ValueError(f"{self.family.title}'s token table names modules whose keys stay split "
                             f"(local_keys), which its attention processor does not take")
        for name in table.local_keys:   # the processor sends these through the entry point's local_keys
            for module in modules_at(model, name):
                module.xdit_local_keys = True
                self._marked.append(module)
        for name, item, dim in table.text_after:
            self._hooks.append(model.get_submodule(name).register_forward_hook(
                self._split_output(name, item, dim, text=True)))
        self._hooks.append(model.get_submodule(table.gather_after).register_forward_hook(
            lambda module, args, out: self._gather(out)))

    def _split_output(self, name: str, item: int | None, dim: int, text: bool = False):
        """A forward hook that keeps this rank's shard of a module's output (or of one item of a tuple output): image
        tokens (joint reference tokens at their end kept whole), or with `text` text tokens, split only when the
        forward split the text."""
        def shard(t):
            if text:
                return t if self._joint_text else self._shard(t, dim, name)
            return self._shard_image(t, dim, name)

        def hook(module, args, out):
            if item is None:
                return shard(out)
            return tuple(shard(o) if i == item else o for i, o in enumerate(out))
        return hook

    def _split_arg(self, name: str, index: int, dim: int):
        """A forward pre-hook that keeps this rank's shard of a module's positional input `index` (image tokens,
        padded to an equal share as `_shard_image` pads them)."""
        def hook(module, args):
            if len(args) <= index:
                raise ValueError(f"{name} was called with {len(args)} positional inputs; the family's token table "
                                 f"splits input {index}")
            return args[:index] + (self._shard_image(args[index], dim, name),) + args[index + 1:]
        return hook

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's output tokens -> the whole sequence, the pad rows dropped; joint reference tokens (the same on
        every rank) are appended once, after the gathered image tokens."""
        m = self._joint_references
        image = self.mesh.all_gather(tokens[:, :tokens.shape[1] - m], "sp", dim=1, kind="sp_gather")
        if self._pad:
            image = image[:, :self._image_tokens]
        return torch.cat([image, tokens[:, tokens.shape[1] - m:]], dim=1) if m else image

    def _shard(self, tokens: torch.Tensor, dim: int, what: str, pad: bool = False) -> torch.Tensor:
        """This rank's equal share of `tokens` along dim; with `pad` a count the degree does not divide is padded at
        the end with copies of the last token, else refused."""
        sp = self.mesh["sp"]
        count = tokens.shape[dim]
        if count % sp.size and not pad:
            raise ValueError(f"{what} has {count} tokens, which ulysses x ring = {sp.size} does not divide")
        n = -(-count // sp.size)
        if count - (sp.size - 1) * n < 1:
            raise ValueError(f"{what} has {count} tokens, too few for ulysses x ring = {sp.size}: padded to "
                             f"{n} a rank, the last rank would hold none")
        start = sp.rank * n
        shard = tokens.narrow(dim, start, min(n, count - start))
        missing = n - shard.shape[dim]
        if missing:   # the last rank: copies of the last token (finite values; their outputs are dropped)
            last = tokens.narrow(dim, count - 1, 1)
            shard = torch.cat([shard, last.expand(*(missing if d == dim else -1 for d in range(last.dim())))], dim=dim)
        return shard

    def _shard_image(self, t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's shard of image tokens, padded to an equal share; joint reference tokens at the end stay whole
        on every rank. Tells the attention how many pad rows the last shard ends in."""
        m = self._joint_references
        count = t.shape[dim] - m
        self._image_tokens, self._pad = count, -count % self.mesh["sp"].size
        self.attention.pad_tokens = self._pad
        if self.cache is not None:   # the pad rows end the last rank's image shard
            sp = self.mesh["sp"]
            last = self._pad and sp.rank == sp.size - 1
            self.cache.pad_rows = (-(-count // sp.size) - self._pad, self._pad) if last else (0, 0)
        if not m:
            return self._shard(t, dim, what, pad=True)
        image = t.narrow(dim, 0, count)
        return torch.cat([self._shard(image, dim, what, pad=True), t.narrow(dim, count, m)], dim=dim)

    def _split_forward_inputs(self, module, args, kwargs):
        kwargs = dict(kwargs)
        table, extra = self.table, {}
        refs = self.flow.reference_tokens if table.reference_tokens else 0
        joint_refs = 0
        if refs:
            first, dim = table.split_inputs[0]
            joint_refs = refs if kwargs[first].shape[dim] % self.mesh["sp"].size else 0
        self._joint_references = joint_refs
        for name, dim in table.split_inputs:
            if kwargs.get(name) is not None and kwargs[name].ndim > dim:   # else no token axis this forward
                kwargs[name] = self._shard_image(kwargs[name], dim, name)
        if table.reference_tokens:
            extra["joint_reference_tokens"] = joint_refs
        self._joint_text = False
        if table.text_inputs:
            first, dim = table.text_inputs[0]
            count = kwargs[first].shape[dim]
            self._joint_text = count % self.mesh["sp"].size != 0
            if not self._joint_text:
                for name, d in table.text_inputs:
                    kwargs[name] = self._shard(kwargs[name], d, name)
            extra["joint_text_tokens"] = count if self._joint_text else 0
        if extra:   # to the processor, through the model's own attention kwargs
            kwargs[table.kwargs_name] = {**(kwargs.get(table.kwargs_name) or {}), **extra}
        return args, kwargs

    # ---- the step cache ----------------------------------------------------------------------------------------
    def set_step_cache(self, threshold: float | None) -> None:
        """Before each job: None takes the cache off; a threshold (0 never skips) starts it afresh."""
        if threshold is None:
            if self.cache is not None:
                self.cache.close()
                self.cache = None
            return
        if self.cache is None:
            self.cache = StepCache(self.flow.model, self.table.blocks, threshold, group=self.mesh.job_pg,
                                   ranks=self.mesh.plan.world_size)
        self.cache.reset(threshold)

    def close(self) -> None:
        self.set_step_cache(None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._marked:
            del module.xdit_local_keys
        self._marked.clear()
        if self._original_processors is not None:
            self.flow.model.set_attn_processor(self._original_processors)
            self._original_processors = None

    # ---- CFG and data parallel: the model call split, the velocities gathered ----------------------------------
    def predictor(self, positive: Conditioning, negative: Conditioning | None,
                  denoise_mask: torch.Tensor | None = None):
        """A Predict for the sampler, bound to this job's conditioning (prepared once per batch share, not per
        step): predict(x_model, sigma, which) -> one velocity per entry of which ("pos", "neg"). denoise_mask: the
        job's noise mask fitted to the latent (the model's process_timestep and c_concat read it)."""
        cfg, dp = self.mesh["cfg"], self.mesh["dp"]
        prepared: dict[tuple, object] = {}

        def prepare(sides: list[Conditioning], batch: int, items: slice):
            key = (tuple(id(s) for s in sides), batch, items.start)
            if key not in prepared:
                prepared[key] = self.flow.prepare(sides, batch, items, denoise_mask)
            return prepared[key]

        def predict(x_model: torch.Tensor, sigma: torch.Tensor, which: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
            sides = [positive if w == "pos" else negative for w in which]
            if any(s is None for s in sides):
                raise ValueError("the sampler asked for the negative pass but the job has no negative conditioning")
            batch = x_model.shape[0]
            mine, groups = pass_groups(sides, cfg)
            per = batch // dp.size                                                      # dp: a contiguous share
            items = slice(dp.rank * per, (dp.rank + 1) * per)
            x = x_model[items]

            def velocity(passes: list[Conditioning], x_in: torch.Tensor) -> torch.Tensor:
                if self.cache is not None:  # the cache compares a call with the last one of the same passes
                    self.cache.use_stream((tuple(s is positive for s in passes), items.start))
                return self.flow.velocity(x_in, sigma, prepare(passes, batch, items))

            if len(groups) == 1 and len(mine) == 2:
                v = velocity(mine, torch.cat([x, x])).unflatten(0, (2, -1))
            else:
                v = torch.stack([velocity([s], x) for s in mine])
            v = self.mesh.all_gather(v, "dp", dim=1, kind="dp_gather")                  # [passes, batch, ...]
            if len(mine) < len(sides):
                v = self.mesh.all_gather(v, "cfg", dim=0, kind="cfg_gather")            # pos, neg in group order
            return tuple(v.unbind(0))
        return predict


    # ---- model calls of independent rows (ComfyUI's diffusion model, driven by ComfyUI's sampler) --------------------
    def call(self, x_model: torch.Tensor, timestep: torch.Tensor, prepared: Prepared) -> torch.Tensor | None:
        """The model's output (in the model's own dtype) for a batch of rows that each carry their own conditioning
        (what ComfyUI's diffusion model computes for one call: the positive and negative passes concatenated along the
        batch when ComfyUI batches them), on the job's first rank; None on the others. CFG parallel halves the rows
        when their count divides, data parallel then splits each half; a group whose degree does not divide the rows
        computes them all (the same result, nothing gathered). The shares travel to the first rank only: the first
        member of each sequence-parallel group sends its dp share to its dp group's first member, which sends the
        pass to rank 0."""
        n = x_model.shape[0]
        cfg = self.mesh["cfg"]
        split_cfg = cfg.size > 1 and n % cfg.size == 0
        per_cfg = n // cfg.size if split_cfg else n
        rows = slice(cfg.rank * per_cfg, (cfg.rank + 1) * per_cfg) if split_cfg else slice(0, n)
        out = self._rows(x_model[rows], timestep[rows], prepared.rows(rows))
        if out is None:
            return None
        if split_cfg:
            out = self.mesh.gather_to_first(out, "cfg", kind="cfg_gather")
        return out if cfg.rank == 0 else None

    def call_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor, Prepared]]) -> list[torch.Tensor] | None:
        """The outputs of several model calls (x_model, timestep, prepared), as `call` gives each, on the job's first
        rank; None on the others. One call: its rows split as `call` splits them. Several (a step's positive and
        negative passes, each at its own text length): CFG parallel runs call i on CFG group i mod 2, so the passes
        run side by side with no padding of one to the other, and group 1 sends its outputs to rank 0."""
        with gathered(self.flow.model):   # the root once for all the parts (each group's collectives the same)
            return self._call_parts(parts)

    def _call_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor, Prepared]]) -> list[torch.Tensor] | None:
        if len(parts) == 1:
            out = self.call(*parts[0])
            return None if out is None else [out]
        cfg = self.mesh["cfg"]
        mine = {i: self._rows(*parts[i]) for i in range(cfg.rank, len(parts), cfg.size)}
        if self.mesh.spans("shard", "cfg"):
            # weights divided across CFG groups: every forward gathers each block over members of both, so every
            # group makes as many forwards (a family may make one a row); a group short of the most runs forwards of
            # one row of its first part (it would wait idle as long)
            work = [sum(self._forwards(parts[i][0].shape[0]) for i in range(g, len(parts), cfg.size))
                    for g in range(cfg.size)]
            x, t, prepared = parts[cfg.rank % len(parts)]
            for _ in range(max(work) - work[cfg.rank]):
                self._rows(x[:1], t[:1], prepared.rows(slice(0, 1)), answer=False)
        if any(v is None for v in mine.values()):
            return None
        if cfg.rank:
            for i in sorted(mine):
                self.mesh.send_to_first(mine[i], "cfg", kind="cfg_gather")
            return None
        first = mine[0]
        others = [i for i in range(len(parts)) if i not in mine]
        expected = [(i % cfg.size, (parts[i][0].shape[0], first.shape[1]) + tuple(parts[i][0].shape[2:]), first.dtype)
                    for i in others]
        received = self.mesh.receive_at_first("cfg", sorted(expected, key=lambda e: e[0]), first.device)
        by_member = {}
        for (member, _, _), t in zip(sorted(expected, key=lambda e: e[0]), received):
            by_member.setdefault(member, []).append(t)
        for i in others:   # each member's in the order it sent them
            mine[i] = by_member[i % cfg.size].pop(0)
        return [mine[i] for i in range(len(parts))]

    def _forwards(self, rows: int) -> int:
        """The model forwards this rank makes for a CFG group's call of `rows` rows (`_rows`: data parallel's share)."""
        dp = self.mesh["dp"]
        return self.family.forwards(rows // dp.size if dp.size > 1 and rows % dp.size == 0 else rows)

    def _rows(self, x_model: torch.Tensor, timestep: torch.Tensor, prepared: Prepared,
              answer: bool = True) -> torch.Tensor | None:
        """One CFG group's rows: data parallel splits them when its degree divides them; the output (the model's
        dtype) on the group's first rank (its sequence-parallel and dp coordinates 0), None on the others. answer
        False: the forward only (its output dropped, nothing gathered)."""
        n = x_model.shape[0]
        dp = self.mesh["dp"]
        split_dp = dp.size > 1 and n % dp.size == 0
        per = n // dp.size if split_dp else n
        items = slice(dp.rank * per, dp.rank * per + per) if split_dp else slice(0, n)
        out = self.flow.output(x_model[items], timestep[items], prepared.rows(items), dtype=None)
        if self.mesh["sp"].rank or not answer:   # every member of the sequence group holds the whole output: the first answers
            return None
        if split_dp:
            out = self.mesh.gather_to_first(out, "dp", kind="dp_gather")
        return out if dp.rank == 0 else None


def modules_at(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """The modules a token table's path names: one module, or with ".*" every module of a list ("blocks.*") or the
    same submodule of each ("blocks.*.attn")."""
    if ".*" not in path:
        return [model.get_submodule(path)]
    head, _, tail = path.partition(".*")
    listed = list(model.get_submodule(head))
    tail = tail.lstrip(".")
    return [m.get_submodule(tail) for m in listed] if tail else listed


def parallelize(flow: FlowModel, mesh: Mesh) -> ParallelFlow:
    """The plan of `mesh` applied to `flow` through its family's token table."""
    if flow.family.tokens is None:
        raise ValueError(f"family {flow.family.name!r} declares no token table: it has no parallel plan")
    return ParallelFlow(flow, mesh, flow.family.tokens)
