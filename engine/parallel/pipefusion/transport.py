"""PipeFusion's messages between stages: the job's schedule of model calls and messages (known on every rank before the
loop, so no rank reads a header on the host to learn what comes next), a stage's inbox of receives posted ahead and
taken in the device's stream order, its outbox of sends, and waits that each have a deadline.

Waits. On a GPU, waiting on a transfer (NCCL) orders the device's stream after it and the host goes on; the host may
run ahead of the device, but never more than `run_ahead` messages past one that has not arrived: it polls that one
until the deadline (in a running pipeline it has long arrived). On the CPU (gloo) a wait blocks the host, bounded by
the process group's timeout, which is the job's deadline. Either way a transfer that never comes raises a StageStall
that names the stage, the rank, what it waited for and the peer.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import syncs
from ...errors import EngineError
from ...sampling.ksampler import SamplingStart
from ...sampling.samplers import sampler_steps
from .layout import HEADER


# ---- the job's schedule: every model call, every message ------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    sigma: float     # the sigma the sampler asks at (a float32 value)
    step: int        # steps done before this call
    warm: bool       # a whole-latent call (a warmup step)


def call_schedule(sampler: str, start: SamplingStart, sigmas_host: torch.Tensor, seed: int, warmup: int) -> list[Call]:
    """Every model call of the job, in order. The samplers ask for the same sigmas whatever the model returns, so a
    run of the sampler on one number, on the host (sigmas_host: the job's sigmas in host memory), gives the schedule
    every stage follows."""
    done = [0]

    def count(step_index, total):
        done[0] = step_index + 1
    calls = []
    with syncs.on_host():
        steps = sampler_steps(sampler, torch.zeros(1), sigmas_host, seed=seed, callback=count,
                              percent_to_sigma=start.percent_to_sigma, host_sigmas=sigmas_host)
        try:
            x, sigma = next(steps)
            while True:
                calls.append(Call(float(sigma), done[0], done[0] < warmup))
                x, sigma = steps.send(x)
        except StopIteration:
            return calls


@dataclass(frozen=True)
class Message:
    what: str                 # for a stall: what the stage waited for
    shapes: tuple             # (shape, dtype) of each tensor after the header
    header: int               # the header table's row it must carry
    step: int                 # the step it belongs to (posted once that step is agreed to run)


# ---- waits ----------------------------------------------------------------------------------------------------------

class StageStall(EngineError):
    pass


class Link:
    """Who waits (for a stall's message) and for how long."""

    def __init__(self, stage: int, rank: int, deadline_s: float):
        self.stage, self.rank, self.deadline_s = stage, rank, deadline_s

    def stall(self, what: str, peer: int) -> StageStall:
        return StageStall(f"PipeFusion stage {self.stage} (rank {self.rank}) waited {self.deadline_s:.0f} s for "
                          f"{what} (peer: rank {peer}) and gave up: that rank is stalled or gone", rank=self.rank,
                          phase="compute")

    def wait(self, work, what: str, peer: int) -> None:
        """Order what follows after `work` (NCCL: on the device's stream; gloo: on the host, within the process
        group's timeout)."""
        try:
            work.wait()
        except RuntimeError as e:
            if "imeout" not in str(e) and "imed out" not in str(e):
                raise
            raise self.stall(what, peer) from None

    def bound(self, work, what: str, peer: int) -> None:
        """The host goes no further until `work`'s transfer has arrived, polling up to the deadline."""
        if work.is_completed():
            return
        deadline = time.monotonic() + self.deadline_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise self.stall(what, peer)
            time.sleep(0.0005)


# ---- a stage's incoming and outgoing messages -----------------------------------------------------------------------

class Inbox:
    """A stage's incoming messages from one peer, in the order the job sends them: receives are posted ahead, up to
    the last step agreed to run (`allow`), and each message is waited for in the device's stream order when taken.
    Each message's header lands in a row of `headers`, on the device, read once after the job (Pipeline.check_headers).
    """

    def __init__(self, link: Link, messages: list[Message], peer: int, pg, device: torch.device, run_ahead: int):
        self.link, self.messages, self.peer, self.pg, self.device = link, messages, peer, pg, device
        self.run_ahead = run_ahead
        # the received headers: the schedule's messages, then at most two more (the final latent and the stop)
        self.headers = torch.empty(len(messages) + 2, HEADER, dtype=torch.float64, device=device)
        self.posted: dict[int, tuple] = {}   # message index -> (tensors, works)
        self.next_post = 0
        self.limit = 0        # messages before this index may be posted
        self.taken = 0
        self.most_ahead = 0     # the most receives posted and not yet taken at once, for the job's report
        self.window = deque()   # works of recently taken messages: the host runs at most this far ahead

    def allow(self, through_step: int) -> None:
        """Post the receives of every message up to step `through_step` (agreed to run)."""
        while self.limit < len(self.messages) and self.messages[self.limit].step <= through_step:
            self.limit += 1
        self._post()

    def allow_count(self, n: int) -> None:
        """Post the receives of the next n messages (known to be sent)."""
        self.limit = min(len(self.messages), max(self.limit, self.taken + n))
        self._post()

    def expect(self, message: Message) -> None:
        """The job ends: the next message to take is `message`, posted now (the schedule's messages not posted yet
        will never come: a cancelled job stops before them)."""
        del self.messages[self.next_post:]
        self.messages.append(message)
        self.limit = len(self.messages)
        self._post()

    def _post(self) -> None:
        while self.next_post < self.limit:
            i = self.next_post
            m = self.messages[i]
            tensors = [self.headers[i]] + [torch.empty(shape, dtype=dtype, device=self.device)
                                           for shape, dtype in m.shapes]
            self.posted[i] = (tensors, [dist.irecv(t, self.peer, group=self.pg) for t in tensors])
            self.next_post += 1
        self.most_ahead = max(self.most_ahead, self.next_post - self.taken)

    def take(self) -> list[torch.Tensor]:
        """The next message's tensors after its header, ordered after their arrival (device stream order)."""
        i = self.taken
        if i >= self.limit:
            raise RuntimeError(f"PipeFusion stage {self.link.stage} took message {i} ({self.messages[i].what}) "
                               f"before its step was agreed to run")
        message = self.messages[i]
        tensors, works = self.posted.pop(i)
        for work in works:
            self.link.wait(work, message.what, self.peer)
        self.window.append((works[-1], message.what))
        if len(self.window) > self.run_ahead:
            self.link.bound(*self.window.popleft(), self.peer)
        self.taken += 1
        return tensors[1:]

    def drain(self) -> None:
        """Take every message posted and not taken (a cancelled job's messages in flight)."""
        while self.taken < self.next_post:
            self.take()


class Outbox:
    """A stage's sends to one peer: posted at once; their buffers are held until a later wait (at most `keep`
    outstanding, and all of them at the end of the job) says they are no longer needed."""

    def __init__(self, link: Link, peer: int, pg, stats, keep: int = 64):
        self.link, self.peer, self.pg, self.stats, self.keep = link, peer, pg, stats, keep
        self.pending = deque()

    def send(self, tensors: list[torch.Tensor], what: str) -> None:
        for t in tensors:
            t = t.contiguous()
            self.pending.append((dist.isend(t, self.peer, group=self.pg), t, what))
            self.stats.add("pipefusion_p2p", t.numel() * t.element_size())
        while len(self.pending) > self.keep:   # sends posted long ago: let their buffers go
            self._finish(*self.pending.popleft())

    def close(self) -> None:
        """Wait for every send still outstanding (with a deadline too: a peer that died must not hang this rank)."""
        pending, self.pending = self.pending, deque()
        for item in pending:
            self._finish(*item)

    def _finish(self, work, tensor, what: str) -> None:
        self.link.wait(work, f"the next stage to take {what}", self.peer)
