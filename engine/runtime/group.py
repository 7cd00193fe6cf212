"""The engine's rank group, as the client in the caller's process owns it: starts the rank processes (here and, through
remote.py, on other machines), waits for each to be ready, checks the idle group before each job, replaces it after a
failure, and shuts it down. It is never a rank and never joins the process group.

Control: one inherited Unix socketpair per rank (nothing listens anywhere); rendezvous through a FileStore in the
engine's private 0700 directory; gloo/NCCL bound to loopback for a local engine.
"""
from __future__ import annotations

import itertools
import os
import selectors
import subprocess
import threading
import time
import weakref

import torch

from . import bridge
from ..errors import EngineError
from ..parallel.plan import MAX_RANKS
from .launch import cpu_sets, kill_all, log_tail, rank_env, signal_name, spawn_rank
from .protocol import Channel, ChannelClosed, ProtocolError
from .remote import Cluster
from .storelink import secret_from
from .watch import Deadlines


class RankGroup:
    """The rank processes of an engine and their lifecycle: start (rendezvous, every rank ready), health between jobs,
    replacement after a failure (with backoff when failures repeat), shutdown. Engine adds the jobs."""

    def __init__(self, ranks: int = 1, *, device: str = "cpu", gpus: list[int] | None = None,
                 deadlines: Deadlines | None = None, heartbeat_interval_s: float = 0.5,
                 collective_timeout_s: float = 1800.0, rank_stdio: str = "log", env: dict[str, str] | None = None,
                 start: bool = True, listen: str | None = None, remote_ranks: list[int] | None = None,
                 secret: str | bytes | None = None, interface: str | None = None, pin_cpus: bool = False):
        if not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks={ranks!r} is invalid: use 1 to {MAX_RANKS} (one rank per GPU)")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is invalid: use 'cpu' (gloo) or 'cuda' (NCCL)")
        if device == "cuda":
            gpus = list(range(ranks)) if gpus is None else [int(g) for g in gpus]
            if len(gpus) != ranks or len(set(gpus)) != ranks:
                raise ValueError(f"gpus={gpus} is invalid for {ranks} ranks: list {ranks} distinct GPU indices, "
                                 f"e.g. {list(range(ranks))}")
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but this torch sees no CUDA device: use device='cpu'")
            if max(gpus) >= torch.cuda.device_count():
                raise ValueError(f"gpus={gpus} names GPU {max(gpus)} but only {torch.cuda.device_count()} "
                                 f"are visible (0..{torch.cuda.device_count() - 1})")
        elif gpus:
            raise ValueError(f"gpus={gpus} given with device='cpu': drop gpus or use device='cuda'")
        if pin_cpus and device != "cpu":
            raise ValueError("pin_cpus=True pins CPU ranks to cores: use it with device='cpu'")
        self.cores = cpu_sets(ranks) if pin_cpus else None
        if rank_stdio not in ("log", "inherit"):
            raise ValueError(f"rank_stdio={rank_stdio!r} is invalid: use 'log' or 'inherit'")
        if (listen is None) != (not remote_ranks):
            raise ValueError(f"listen={listen!r} and remote_ranks={remote_ranks!r}: give both (ranks on other machines) "
                             f"or neither (this machine only)")
        if remote_ranks and not all(isinstance(n, int) and 1 <= n <= MAX_RANKS for n in remote_ranks):
            raise ValueError(f"remote_ranks={remote_ranks!r} is invalid: list each node's ranks, 1 to {MAX_RANKS} each, "
                             f"e.g. [2]")
        self.local_ranks = ranks
        self.remote_ranks = list(remote_ranks or [])
        self.world = ranks + sum(self.remote_ranks)
        self.device = device
        self.gpus = gpus
        self.deadlines = deadlines or Deadlines()
        self.deadlines.validate()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.collective_timeout_s = collective_timeout_s
        self.rank_stdio = rank_stdio
        self.env = dict(env or {})   # added to the ranks' environment (e.g. NCCL settings, faults.ENV)
        self.generation = 0          # how many times the rank group was (re)started
        self.held: dict = {}         # what the client records of what the ranks keep (e.g. models/lora.HeldPatches)
        self.restarts: list[str] = []  # why each replacement happened
        self._stale_meshes: list[dict] = []   # plans whose meshes a failed job dropped (ending.py forget_meshes)
        self._procs: list[subprocess.Popen] = []
        self._chans: list[Channel] = []
        self.engine_dir: str | None = None
        self.rank_info: list[dict] = []
        self._broken: str | None = None
        self._failures = 0           # failures in a row (a job every rank answered ends the run)
        self._retry_at = 0.0         # monotonic time before which no restart is tried (backoff)
        self._last_failure = ""
        self._job_ids = itertools.count(1)
        self._finalizer = None
        self._lock = threading.RLock()  # one job (or lifecycle change) at a time
        self._cluster = None
        if listen is not None:
            self._cluster = Cluster(listen, list(remote_ranks), ranks, secret_from(secret), device,
                                    self.deadlines.heartbeat_s, interface)
        if start:
            try:
                self.start()
            except BaseException:
                self._close_cluster()  # stop listening: nobody holds this engine to close it
                raise

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def listen_address(self) -> str | None:
        """HOST:PORT where workers join (None for an engine on this machine only)."""
        return self._cluster.address if self._cluster else None

    @property
    def calls_by_shared_memory(self) -> bool:
        """Every rank is on this machine: each reads a session call's segment itself (no broadcast)."""
        return self._cluster is None

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._procs:
            raise RuntimeError("engine already started")
        bridge.sweep_stale_dirs()
        self.engine_dir = bridge.make_engine_dir()
        self.generation += 1
        self._stale_meshes = []   # new ranks hold no mesh
        store_path = os.path.join(self.engine_dir, f"store-{self.generation}")
        env = {**rank_env(self.gpus if self.device == "cuda" else None), **self.env}
        threads = max(1, (os.cpu_count() or 1) // self.local_ranks)
        if self._cluster:
            env.update(self._cluster.rank_env())
        self._finalizer = weakref.finalize(self, kill_all, self._procs, self._chans, self.engine_dir)
        pgid = 0
        try:
            if self._cluster:
                self._cluster.begin(self.generation, self.deadlines.start_s)
            for rank in range(self.world):
                log = os.path.join(self.engine_dir, f"rank{rank}.log") if self.rank_stdio == "log" else None
                if rank >= self.local_ranks:  # on another machine: its worker starts it, the store relays its channel
                    proc, chan = self._cluster.spawn(rank, self.generation)
                else:
                    proc, chan = spawn_rank(env, pgid, log)
                    pgid = pgid or proc.pid  # this machine's ranks share one process group, led by rank 0
                self._procs.append(proc)
                self._chans.append(chan)
                chan.send({"op": "init", "rank": rank, "world": self.world,
                           "backend": "nccl" if self.device == "cuda" else "gloo",
                           "local_device": rank, "engine_dir": self.engine_dir, "store_path": store_path,
                           "heartbeat_interval_s": self.heartbeat_interval_s,
                           "collective_timeout_s": self.collective_timeout_s,
                           "threads": len(self.cores[rank]) if self.cores and rank < self.local_ranks else threads,
                           "cores": self.cores[rank] if self.cores and rank < self.local_ranks else None,
                           "tcp_store": self._cluster.store_info(self.generation) if self._cluster else None,
                           "machine_ranks": self._machine_ranks(rank),
                           "calls_by_shared_memory": self.calls_by_shared_memory})
            self.rank_info = self._wait_ready()
        except BaseException as e:
            self._teardown()
            if isinstance(e, Exception):
                self._note_failure(f"start-up failed: {str(e).splitlines()[0]}")
            raise
        self._broken = None

    def _machine_ranks(self, rank: int) -> int:
        """How many ranks share rank `rank`'s machine (this one's, or its node's)."""
        if rank < self.local_ranks:
            return self.local_ranks
        first = self.local_ranks
        for count in self.remote_ranks:
            if rank < first + count:
                return count
            first += count
        return 1

    def _wait_ready(self) -> list[dict]:
        """Every rank's "ready". A rank heard from (it says hello once its runtime is up, then beats) that falls silent
        past heartbeat_s is stopped or hung; one never heard from has until start_s."""
        ready: dict[int, dict] = {}
        heard: dict[int, float] = {}
        deadline = time.monotonic() + self.deadlines.start_s
        sel = selectors.DefaultSelector()
        for rank, chan in enumerate(self._chans):
            sel.register(chan.sock, selectors.EVENT_READ, rank)
        try:
            while len(ready) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.world) if r not in ready]
                    raise EngineError(f"ranks {missing} did not start within {self.deadlines.start_s:.0f} s "
                                      f"(deadline start_s){self._log_tail(missing[0])}", rank=missing[0], phase="start")
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    rank = key.data
                    try:
                        for message in self._chans[rank].recv_ready():
                            heard[rank] = time.monotonic()
                            if message.get("op") == "ready":
                                ready[rank] = message
                    except ChannelClosed as e:
                        if isinstance(e, ProtocolError):
                            raise EngineError(f"rank {rank} broke the control protocol during start-up ({e})",
                                              rank=rank, phase="start") from None
                        status = self._reap(rank)
                        raise EngineError(f"rank {rank} exited during start-up ({status})"
                                          f"{self._log_tail(rank)}", rank=rank, phase="start") from None
                now = time.monotonic()
                silent = [r for r, t in heard.items() if r not in ready and now - t > self.deadlines.heartbeat_s]
                if silent:
                    raise EngineError(f"rank {silent[0]} stopped answering during start-up (no heartbeat for "
                                      f"{self.deadlines.heartbeat_s:g} s, deadline heartbeat_s; pid "
                                      f"{self._procs[silent[0]].pid}){self._log_tail(silent[0])}",
                                      rank=silent[0], phase="start")
        finally:
            sel.close()
        return [ready[r] for r in range(self.world)]

    def _reap(self, rank: int, timeout_s: float = 2.0) -> str:
        try:
            self._procs[rank].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        return getattr(self._procs[rank], "reason", None) or signal_name(self._procs[rank].poll())

    def _log_tail(self, rank: int) -> str:
        if rank >= self.local_ranks:
            return getattr(self._procs[rank], "log_tail", "") if rank < len(self._procs) else ""
        return log_tail(self.engine_dir, rank)

    def _teardown(self) -> None:
        kill_all(self._procs, self._chans, self.engine_dir)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._procs.clear()
        self._chans.clear()
        self.engine_dir = None

    def close(self) -> None:
        """Ask the ranks to exit, wait up to deadlines.shutdown_s, then make sure they are gone."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for chan in self._chans:
            try:
                chan.send({"op": "shutdown"})
            except (ChannelClosed, OSError):
                pass
        end = time.monotonic() + self.deadlines.shutdown_s
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._teardown()
        self._close_cluster()

    def _close_cluster(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def restart(self, reason: str = "requested") -> None:
        with self._lock:
            self._restart_locked(reason)

    def _restart_locked(self, reason: str = "requested") -> None:
        self.restarts.append(reason)
        self._teardown()
        self.start()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._teardown()  # Ctrl-C (KeyboardInterrupt), SystemExit: kill the ranks now, do not wait for a busy job
            self._close_cluster()
        else:
            self.close()

    def _ensure_healthy(self) -> None:
        if not self._procs:
            self._check_backoff()
            self.start()
            return
        if self._broken:
            self._check_backoff()
            self.restart(self._broken)
            return
        problem = self._idle_problem()
        if problem:
            self._replace_idle_group(problem)

    def _idle_problem(self) -> str | None:
        """Why the idle rank group cannot take a job, or None. A rank that loses its client (a closed or garbled
        channel) removes the engine directory first and then kills its group, so a group can look alive while it is
        being torn down: an exited rank or a missing engine directory each mean it is going. (A rank's garbage that
        waits unread on its channel fails the next job, naming the rank and the protocol.)"""
        dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
        if dead:
            return f"rank {dead[0]} had exited while idle ({signal_name(self._procs[dead[0]].poll())})"
        if not self.engine_dir or not os.path.isdir(self.engine_dir):
            return "the engine directory was removed while idle (a rank was taking the group down)"
        return None

    def _replace_idle_group(self, reason: str) -> None:
        """A group found going down between jobs is replaced; no job is handed to it. When a rank is tearing it down
        (the engine directory is gone: the rank kills its group next), the client waits for that to finish, up to
        shutdown_s, before killing what is left and starting the new group."""
        self._check_backoff()
        if not self.engine_dir or not os.path.isdir(self.engine_dir):
            end = time.monotonic() + self.deadlines.shutdown_s
            for p in self._procs[:self.local_ranks]:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        self._restart_locked(reason)

    def _note_failure(self, reason: str) -> None:
        """A failure that took the rank group down (or kept it from starting). From the second in a row on, the next
        start waits backoff_s, doubling with each further failure (up to 16x): a fault that repeats is reported at
        once instead of restarting the ranks in a loop."""
        self._failures += 1
        self._last_failure = reason
        if self._failures >= 2:
            self._retry_at = time.monotonic() + self.deadlines.backoff_s * min(16, 2 ** (self._failures - 2))

    def _check_backoff(self) -> None:
        left = self._retry_at - time.monotonic()
        if self._failures >= 2 and left > 0:
            raise EngineError(f"the engine failed {self._failures} times in a row (last: {self._last_failure}); it "
                              f"starts its ranks again in {left:.0f} s (deadline backoff_s), so a repeating fault does "
                              f"not loop: check the rank logs, the GPUs and the model", phase="start")

    def _fail(self, reason: str) -> None:
        """The group may be mid-collective: kill it now (frees GPUs at once); start anew on the next job."""
        self._broken = reason
        self._note_failure(reason)
        kill_all(self._procs, [], None)
