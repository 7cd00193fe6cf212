"""The rank mesh: which ranks share a dp / cfg / pipefusion / ring / ulysses group, built once from the plan, and the
communicators of those groups (destroyed with the mesh: runtime/jobs.py keeps the last few).

Rank order is (dp, cfg, pipefusion, ring, ulysses) with ulysses fastest, so a Ulysses group is consecutive
ranks (on one machine, the fastest links). Nothing else in the engine computes ranks.

A plan may use fewer ranks than the engine has (the planner found fewer GPUs faster): it runs on the first
plan.world_size ranks, and the others are idle for the job (`active` False, no group of the plan, `job_pg` None).
"""
from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .plan import ParallelPlan

ORDER = ("dp", "cfg", "pipefusion", "ring", "ulysses")
# A link made slow on purpose, for tests only: each collective a rank counts (and each calibration message) waits this
# many ms more, as on a link with that much more latency (read from the ranks' environment).
LINK_DELAY_ENV = "XDIT_LINK_DELAY_MS"


def _link_delay_s() -> float:
    text = os.environ.get(LINK_DELAY_ENV, "").strip()
    try:
        return max(0.0, float(text)) / 1e3 if text else 0.0
    except ValueError:
        raise ValueError(f"{LINK_DELAY_ENV}={text!r} is invalid: give milliseconds, e.g. 20, or leave it "
                         f"unset") from None


LINK_DELAY_S = _link_delay_s()


def link_delay() -> None:
    """The injected delay of one collective (none unless LINK_DELAY_ENV is set)."""
    if LINK_DELAY_S:
        time.sleep(LINK_DELAY_S)


@dataclass
class CommStats:
    """Bytes this rank sent, per collective kind (counted at the call, from the tensor sizes)."""
    sent: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += int(nbytes)
        link_delay()

    def reset(self) -> None:
        self.sent.clear()


@dataclass
class Group:
    name: str
    ranks: list[int]          # global ranks, in group-rank order
    rank: int                 # this rank's index in the group
    pg: object | None         # process group; None when the group has one member

    @property
    def size(self) -> int:
        return len(self.ranks)


class Mesh:
    def __init__(self, plan: ParallelPlan, rank: int, world: int, device_type: str = "cpu"):
        plan.check_engine(world)
        self.plan, self.rank, self.world = plan, rank, world
        self.device_type = device_type   # the ranks' device kind ("cpu", "cuda"): a DeviceMesh over a group needs it
        self.active = rank < plan.world_size   # this rank runs the job (the ranks past the plan's idle)
        self.shape = tuple(getattr(plan, n) for n in ORDER)
        self.coords = dict(zip(ORDER, self._unravel(rank))) if self.active else {}
        self.stats = CommStats()
        self.groups: dict[str, Group] = {}
        self._made: list = []          # the communicators made for this mesh that hold this rank, in creation order
        # (ranks, backend) -> the communicator of every group of those ranks. Never the world's: a job that fails on
        # one rank ends on the others by that rank tearing its mesh's communicators down (abort), which the world's
        # group, carrying the ranks' jobs, must survive
        self._shared: dict = {}
        # dist.new_group is collective over the world: every rank creates every group, in the same order, and groups
        # of the same ranks share one communicator (sp is the ulysses or the ring group when the other degree is 1)
        for name, dims in [(n, (n,)) for n in ORDER if n != "pipefusion"] + [("sp", ("ring", "ulysses"))]:
            for members in self._partition(dims):
                pg = self._group(members) if len(members) > 1 and world > 1 else None
                if rank in members:
                    self.groups[name] = Group(name, members, members.index(rank), pg)
        self._pipefusion_links(rank, world)
        # the weights divided among groups of plan.shard consecutive ranks of the plan's (parallel/shard.py), on a
        # communicator of their own: a block's gather, posted ahead, never queues behind the sequence group's traffic
        for start in range(0, plan.world_size, plan.shard):
            members = list(range(start, start + plan.shard))
            pg = self._group(members, shared=False) if len(members) > 1 and world > 1 else None
            if rank in members:
                self.groups["shard"] = Group("shard", members, members.index(rank), pg)
        # the ranks that run the job agree on its per-step decisions (cancel) among themselves: the whole world's
        # group when the plan uses every rank, else a group of the first world_size ranks (None: one rank)
        job = plan.world_size
        self.job_pg = self._group(list(range(job))) if job > 1 else None
        # and agree over host memory (gloo, beside NCCL too): None = the rank group's own control group (every rank)
        self.control_pg = self._group(list(range(job)), backend="gloo") if 1 < job < world else None
        if not self.active:
            self.job_pg = self.control_pg = None

    def _group(self, members: list[int], backend: str | None = None, shared: bool = True):
        """The communicator of `members` (a collective over the world: every rank asks for every group, in the same
        order); None on a rank outside it."""
        key = (tuple(sorted(members)), backend)
        if shared and key in self._shared:
            pg = self._shared[key]
        else:
            pg = dist.new_group(members, backend=backend)
            if self.rank in members:
                self._made.append(pg)
            if shared:
                self._shared[key] = pg
        return pg if self.rank in members else None

    @property
    def communicators(self) -> int:
        """Communicators this mesh made that hold this rank (the world's group, which it may share, not counted)."""
        return len(self._made)

    def destroy(self) -> None:
        """Destroy this mesh's communicators: a collective, so every rank destroys a dropped mesh at the same point,
        and each its own, in creation order. The mesh is unusable after."""
        made, self._made = self._made, []
        for pg in made:
            dist.destroy_process_group(pg)
        self.groups.clear()
        self._shared.clear()
        self.job_pg = self.control_pg = None
        self.destroyed = True

    destroyed = False

    def abort(self) -> list:
        """After a job failed, on a rank that may have left others waiting in this mesh's collectives (or, on GPUs,
        with such a collective still queued on its own stream): end this mesh's data-plane communicators now, without
        the collective `destroy` is. On NCCL each is aborted (ncclCommAbort: a kernel waiting in it returns); gloo has
        no abort, and a gloo communicator closes its connections only when its last reference goes, which makes a
        peer's pending collective on it fail at once ("Connection closed by peer"), so the communicators are returned
        for the caller to let go of (JobContext.drop_mesh). The job's control group (`control_pg`), which the ranks
        agree over about the failure, is kept for `destroy` to end after the agreement. The mesh is unusable after."""
        made, keep = [pg for pg in self._made if pg is not self.control_pg], [self.control_pg]
        self._made = [pg for pg in keep if pg is not None]
        for group in self.groups.values():
            group.pg = None   # a Group still held elsewhere (an attention processor) holds no communicator
        self.groups.clear()
        self._shared.clear()
        self.job_pg = None
        self.destroyed = True
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)   # (torch's, experimental)
        for pg in made:
            try:   # NCCL: aborted; gloo: unregistered (its abort does nothing)
                abort(pg) if abort is not None else dist.destroy_process_group(pg)
            except (ValueError, RuntimeError):   # unregistered already, or its backend refuses: still let go of
                pass
        return made

    def abort_communicators(self) -> None:
        """From another thread while the rank's main thread may wait in one of this mesh's collectives (the client
        said the job failed): abort its NCCL communicators, so a collective queued on the device that a failed rank
        will never enter returns, and the main thread reaches its next agreement. The main thread then drops the mesh
        (`abort`). Nothing on gloo: it cannot abort, and its waits fail by themselves once the failed rank lets go of
        its communicators."""
        if self.device_type != "cuda":
            return
        for pg in list(self._made):
            if pg is not self.control_pg:
                try:
                    pg.abort()
                except RuntimeError:
                    pass

    def spans(self, group: str, dim: str) -> bool:
        """Do `group`'s members differ in their `dim` coordinate (a shard group across CFG groups, say)?"""
        g = self.groups.get(group)
        return g is not None and len({self._unravel(r)[ORDER.index(dim)] for r in g.ranks}) > 1

    def _pipefusion_links(self, rank: int, world: int) -> None:
        """PipeFusion's stages pass messages round a ring (stage s -> s+1, the last -> the first). Each link gets a
        communicator of its own that carries that one direction only, and "pipefusion" itself none (it names the
        stages; nothing is sent over it). A stage's receives, posted a step ahead, then never share a communicator
        with its own sends: on one communicator NCCL runs a rank's operations in the order they were posted, so a
        send queued behind receives that wait for the pipeline to come round would never start (with three or more
        stages, the middle ones would deadlock). Group "pipefusion_in": this stage's link from the previous stage;
        "pipefusion_out": its link to the next."""
        for members in self._partition(("pipefusion",)):
            if rank in members:
                self.groups["pipefusion"] = Group("pipefusion", members, members.index(rank), None)
            if len(members) < 2:
                continue
            for s, sender in enumerate(members):
                receiver = members[(s + 1) % len(members)]
                pg = self._group([sender, receiver], shared=False) if world > 1 else None
                if rank == sender:
                    self.groups["pipefusion_out"] = Group("pipefusion_out", [sender, receiver], 0, pg)
                if rank == receiver:
                    self.groups["pipefusion_in"] = Group("pipefusion_in", [sender, receiver], 1, pg)

    def _unravel(self, rank: int) -> tuple[int, ...]:
        coords = []
        for size in reversed(self.shape):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))

    def _ravel(self, coords: tuple[int, ...]) -> int:
        rank = 0
        for c, size in zip(coords, self.shape):
            rank = rank * size + c
        return rank

    def _partition(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that differ only in `dims` (members ordered with the last dim fastest)."""
        varying = [ORDER.index(d) for d in dims]
        fixed = [i for i in range(len(ORDER)) if i not in varying]
        out = []
        for fixed_coords in itertools.product(*[range(self.shape[i]) for i in fixed]):
            members = []
            for var_coords in itertools.product(*[range(self.shape[i]) for i in varying]):
                coords = [0] * len(ORDER)
                for i, c in zip(fixed, fixed_coords):
                    coords[i] = c
                for i, c in zip(varying, var_coords):
                    coords[i] = c
                members.append(self._ravel(tuple(coords)))
            out.append(members)
        return out

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    # ---- collectives used by the parallel methods, counted in stats ------------------------------
    def all_gather(self, t: torch.Tensor, group: str, dim: int, kind: str) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every member of `group` along `dim`, in group-rank order."""
        g = self.groups[group]
        if g.size == 1:
            return t
        if g.pg is None:
            raise RuntimeError(f"mesh group {group!r} has no communicator: nothing is gathered over it")
        t = t.contiguous()
        out = torch.empty((g.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=g.pg)
        self.stats.add(kind, t.numel() * t.element_size() * (g.size - 1))
        parts = out.chunk(g.size, dim=0)
        return torch.cat(parts, dim=dim) if dim != 0 else out

    def gather_to_first(self, t: torch.Tensor, group: str, kind: str) -> torch.Tensor | None:
        """Member 0 of `group` gets every member's equal-shaped `t` concatenated along dim 0, in group-rank order; the
        others send theirs to it and get None (what only one rank answers with needs no all-gather)."""
        g = self.groups[group]
        if g.size == 1:
            return t
        t = t.contiguous()
        if g.rank:
            self.send_to_first(t, group, kind)
            return None
        return torch.cat([t] + self.receive_at_first(group, [(m, t.shape, t.dtype) for m in range(1, g.size)],
                                                     t.device))

    def send_to_first(self, t: torch.Tensor, group: str, kind: str) -> None:
        """Send `t` to member 0 of `group` (it receives with receive_at_first, in the same order)."""
        g = self.groups[group]
        if g.pg is None:
            raise RuntimeError(f"mesh group {group!r} has no communicator: nothing is sent over it")
        dist.send(t.contiguous(), dst=g.ranks[0], group=g.pg)
        self.stats.add(kind, t.numel() * t.element_size())

    def receive_at_first(self, group: str, expected: list[tuple[int, tuple, torch.dtype]],
                         device: torch.device) -> list[torch.Tensor]:
        """At member 0 of `group`: the tensors (member, shape, dtype) the other members send it, in that order, their
        receives posted together, on `device`."""
        g = self.groups[group]
        if not expected:
            return []
        if g.pg is None:
            raise RuntimeError(f"mesh group {group!r} has no communicator: nothing is received over it")
        out, works = [], []
        for member, shape, dtype in expected:
            buf = torch.empty(shape, dtype=dtype, device=device)
            works.append(dist.irecv(buf, src=g.ranks[member], group=g.pg))
            out.append(buf)
        for work in works:
            work.wait()
        return out

