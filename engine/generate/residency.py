"""Where the models a rank keeps wait between jobs: on its device, in host memory, or nowhere (read from the file again).

A rank keeps up to RESIDENT_MODELS models: a clip of two experts (Wan 2.2 A14B) switches between them every clip, and
each switch should cost a copy at most, never a file read. Before every job (not only when a model is first loaded:
a longer clip needs more activations than the last) `decide` says what to do with the other models, from figures
measured then: the device's free memory, the host's available memory, this job's need as the planner's memory model
counts it (parallel/memory.py), and the plan's expert placement (the planner's choice, or the user's). Its decision is
a list of moves, applied by the rank (generate/run.py) and reported to the client, which shows it in the Info node.

The rules, in order:
- beyond RESIDENT_MODELS - 1 other models, the least recently used are dropped;
- on the CPU there is nothing else to do (the host is the device);
- placement "host": every other model waits in host memory (the plan was priced so);
- otherwise they stay on the device while this job fits beside them in the device's free memory, the least recently
  used moving to host memory first until it does;
- a model moves to host memory only where the host has room for every local rank's copy of it (each rank moves its
  own at the same time) and a margin; where it has not, it is dropped instead (read from the file when next used).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2 ** 30
RESIDENT_MODELS = 2        # models a rank keeps at once: a two-expert clip switches experts without reading a file
HOST_MARGIN_BYTES = 4 * GiB   # what the host keeps free for everything else after the ranks' copies


@dataclass(frozen=True)
class Held:
    """A model a rank keeps, as the decision sees it: its key, its bytes, where it is ("device" or "host")."""
    key: object
    nbytes: int
    where: str = "device"


@dataclass(frozen=True)
class Move:
    key: object
    action: str    # "offload" (device -> host memory) or "drop"
    why: str


def decide(others: list[Held], *, device: str, need_bytes: int, free_bytes: int | None, host_free_bytes: int | None,
           local_ranks: int, placement: str = "auto", keep: int = RESIDENT_MODELS - 1) -> list[Move]:
    """What to do with the other models a rank keeps (least recently used first) before a job that needs
    `need_bytes` more on the device (its weights unless resident, its activations), with `free_bytes` free there now
    and `host_free_bytes` available on the host (None: unknown, taken as room enough); `local_ranks` ranks of this
    machine move their copies at once; `placement` is the plan's ("resident", "host" or "auto"); `keep`: how many of
    the others may stay kept (a job of another kind, a VAE decode, keeps them all)."""
    moves: list[Move] = []
    kept = list(others)
    while len(kept) > keep:
        held = kept.pop(0)
        moves.append(Move(held.key, "drop", f"a rank keeps {RESIDENT_MODELS} models: the least recently used goes"))
    if device != "cuda":
        return moves
    on_device = [h for h in kept if h.where == "device"]
    host_free = host_free_bytes
    free = free_bytes

    def away(held: Held, why: str) -> None:
        nonlocal host_free, free
        needed = held.nbytes * local_ranks + HOST_MARGIN_BYTES
        if host_free is not None and needed > host_free:
            moves.append(Move(held.key, "drop", f"{why}, and the host has {host_free / GiB:.1f} GiB available for "
                                                f"{local_ranks} rank(s)' copies of {held.nbytes / GiB:.1f} GiB (+ "
                                                f"{HOST_MARGIN_BYTES / GiB:.0f} GiB kept free): read from its file "
                                                f"when next used"))
        else:
            moves.append(Move(held.key, "offload", why))
            if host_free is not None:
                host_free -= held.nbytes * local_ranks
        if free is not None:
            free += held.nbytes
    for held in on_device:
        if placement == "host":
            away(held, "the plan keeps the idle expert in host memory")
        elif free is not None and need_bytes > free:
            away(held, f"this job needs {need_bytes / GiB:.1f} GiB on the device beside it and "
                       f"{free / GiB:.1f} GiB are free")
    return moves


def host_available_bytes() -> int | None:
    """The host's available memory (MemAvailable), or None where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(moves: list[Move], variants: dict) -> list[str]:
    """One line per move for the Info node (variants: key -> the model's name)."""
    return [f"{variants.get(m.key, m.key)}: {'moved to host memory' if m.action == 'offload' else 'dropped'} "
            f"({m.why})" for m in moves]
