"""`bench soak`: many small jobs on one engine with interrupts mixed in, and the engine's resources before and after.

One engine (2 CPU ranks by default) runs a rotation of real jobs on tiny synthetic models: FLUX generate jobs under
ulysses, ring and data parallel (batch of one image per rank), an SD3 generate job under CFG parallel, an echo job
(tensors through the bridge and back from the last rank) and an SD3 model session (the route of ComfyUI's samplers on
the xDiT Engine's MODEL: a few model calls, both passes batched). Every configuration's first run is its reference; every later run of it must be
bitwise equal (same code, same process group, same inputs). One job in INTERRUPT_EVERY is interrupted: a job is
cancelled through should_cancel once rank 0 has reported a varying number of steps (0: before the first), a session
is aborted by an exception raised inside its with-block after a varying number of calls. The engine must never
restart, and the job after an interrupt must still match.

Before (after a warm-up: each configuration twice and interrupted once) and after the jobs, it counts what a leak
would grow: files in the engine's shared-memory directory, engine directories this process owns under SHM_ROOT,
open file descriptors of the client and of each rank, the client's threads; RSS of every process is reported (not
judged: allocators keep freed memory), with its growth per 100 jobs. After close, no rank may be alive and the
engine's directory must be gone.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from ..errors import JobCancelled
from ..generate.model_call import ModelSession, request_conditioning
from ..generate.request import GenerateRequest
from ..parallel.plan import ParallelPlan
from ..runtime import bridge
from ..runtime.client import Engine
from ..runtime.launch import pid_gone
from .args import UsageError
from .tables import markdown

DEFAULT_JOBS, QUICK_JOBS = 500, 60
ROTATION = 6                # configurations (make_configs)
STEPS = 4                   # euler steps per generate job
SIGMAS = (1.0, 0.6, 0.3)    # one model call each
SIZE = 128                  # pixels: a 16x16 latent


def register(bench, emit) -> None:
    from . import args as types
    p = bench.add_parser("soak", help="many jobs with interrupts: results vs references, resources before/after",
                         description="Runs jobs of every plan on one engine, interrupting one in "
                                     f"{interrupt_period(ROTATION)} (a cancel at a varying step, or a session aborted by an "
                                     "exception), and checks every result against the first run of its "
                                     "configuration; reports RSS, shared-memory entries, file descriptors and "
                                     "threads before and after. Exit 0: every result matched and the counts are "
                                     "flat; 1 otherwise.")
    p.add_argument("--jobs", type=types.positive_int, default=None,
                   help=f"jobs after the warm-up (default {DEFAULT_JOBS}; {QUICK_JOBS} with --quick)")
    p.add_argument("--quick", dest="soak_quick", action="store_true", help=f"{QUICK_JOBS} jobs unless --jobs says")
    p.add_argument("--ranks", type=types.ranks, default=2, help="CPU ranks, an even number; with --gpus one rank per "
                                                                "GPU")
    p.add_argument("--gpus", type=types.gpu_list, help="CUDA GPUs, one per rank, an even number (default: CPU ranks)")
    p.set_defaults(run=lambda a: _run(a, emit), parser=p)


def _run(a, emit) -> int:
    if a.gpus and a.ranks != 2 and a.ranks != len(a.gpus):
        raise UsageError(f"argument --ranks: {a.ranks} does not match --gpus {','.join(map(str, a.gpus))} "
                         f"({len(a.gpus)} GPUs): give one of them, or as many ranks as GPUs")
    ranks = len(a.gpus) if a.gpus else a.ranks
    if ranks % 2:
        flag = f"--gpus {','.join(map(str, a.gpus))}" if a.gpus else f"--ranks {ranks}"
        raise UsageError(f"argument {flag.split()[0]}: {flag.split()[1]} gives {ranks} rank(s): bench soak rotates a "
                         f"cfg plan (2 ranks per CFG group), give an even number, e.g. 2")
    quick = a.soak_quick or getattr(a, "quick", False)
    jobs = a.jobs or (QUICK_JOBS if quick else DEFAULT_JOBS)
    summary = bench_soak(jobs, ranks, a.gpus)
    emit(a, "soak", [summary])
    if summary["problems"]:
        print(f"{a.parser.prog}: failed: {'; '.join(summary['problems'])}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- the rotation ----------------------------------------------------------------------------------------------
def interrupt_period(configs: int, at_least: int = 4) -> int:
    """One job in this many is interrupted: the smallest period >= at_least sharing no factor with the rotation's
    length, so that the interrupts fall on every configuration in turn."""
    p = at_least
    while math.gcd(p, configs) != 1:
        p += 1
    return p


@dataclass
class Config:
    name: str
    kind: str                    # generate | echo | model
    spec: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    request: GenerateRequest | None = None   # model
    x: torch.Tensor | None = None            # model: the latent each call sends
    reference: list[torch.Tensor] | None = None
    runs: int = 0
    matched: int = 0
    interrupted: int = 0
    max_diff: float = 0.0

    @property
    def interrupt_targets(self) -> int:
        """How many points an interrupt rotates over: steps reported (0 .. STEPS) or calls answered."""
        return {"generate": STEPS + 1, "echo": 4, "model": len(SIGMAS)}[self.kind]


def _generate(name: str, model: str, plan: ParallelPlan, batch: int = 1, cfg: float = 1.0) -> Config:
    r = GenerateRequest.random_conditioning(model, SIZE, SIZE, text_tokens=16, batch=batch, draw_seed=7, seed=11,
                                            steps=STEPS, cfg=cfg, plan=plan)
    try:
        r = r.validate(plan.world_size)
    except ValueError as e:
        raise UsageError(f"bench soak: plan {plan.describe()} for {model}: {e}") from None
    spec, inputs = r.to_job()
    return Config(name, "generate", spec, inputs)


def make_configs(ranks: int) -> list[Config]:
    """The rotation, ordered so that the rank's model (kept between jobs) changes twice per round."""
    flux, sd3 = "synthetic:flux-dev:tiny", "synthetic:sd3-medium:tiny"
    half = ranks // 2
    g = torch.Generator().manual_seed(5)
    calls = GenerateRequest.random_conditioning(sd3, SIZE, SIZE, text_tokens=16, draw_seed=9, cfg=4.0,
                                                plan=ParallelPlan(cfg=2, ulysses=half))
    calls = calls.validate(ranks)
    return [
        _generate(f"flux ulysses{ranks}", flux, ParallelPlan(ulysses=ranks)),
        _generate(f"flux ring{ranks}", flux, ParallelPlan(ring=ranks)),
        _generate(f"flux dp{ranks} (batch {ranks})", flux, ParallelPlan(dp=ranks), batch=ranks),
        _echo(ranks, g),
        _generate(f"sd3 cfg2{f' ulysses{half}' if half > 1 else ''} (cfg 4)", sd3,
                  ParallelPlan(cfg=2, ulysses=half), cfg=4.0),
        Config(f"sd3 model calls cfg2{f' ulysses{half}' if half > 1 else ''}", "model", request=calls,
               x=torch.randn(calls.latent_raw.shape, generator=g)),
    ]


def _echo(ranks: int, g: torch.Generator) -> Config:
    inputs = {"x": torch.randn(1, 16, 64, 64, generator=g), "ids": torch.arange(4096).reshape(1, 4096),
              "half": torch.randn(1, 64, 512, generator=g).bfloat16()}
    return Config("echo (3 steps)", "echo", {"return_rank": ranks - 1, "steps": 3, "step_sleep_s": 0.005}, inputs,
                  reference=[inputs[k] for k in sorted(inputs)])


class _Abort(Exception):
    """Raised inside a model session's with-block to abort it."""


class _Cancel:
    """should_cancel turns true once rank 0 has reported `at` steps (0: at once, before the first)."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def on_progress(self, step: int, total: int) -> None:
        self.seen = step

    def should_cancel(self) -> bool:
        return self.seen >= self.at


def run_once(engine: Engine, c: Config, interrupt_at: int | None) -> tuple[list[torch.Tensor] | None, dict]:
    """One run of `c`: its outputs (None when interrupted) and what happened."""
    if c.kind == "model":
        outs = []
        try:
            with ModelSession(engine, c.request) as s:
                for i, sigma in enumerate(SIGMAS):
                    if interrupt_at is not None and i == interrupt_at:
                        raise _Abort(f"aborted after {i} calls")
                    rows = c.x.shape[0]
                    conditioning = request_conditioning(c.request, ("pos", "neg"), rows)
                    outs.extend(s.call(torch.cat([c.x, c.x]), torch.full((2 * rows,), sigma * 1000.0),
                                       conditioning).chunk(2))
        except _Abort:
            return None, {"aborted": True, "at": interrupt_at}
        return outs, {"info": s.result.ranks if s.result else []}
    watch = _Cancel(interrupt_at) if interrupt_at is not None else None
    try:
        result = engine.submit(c.kind, c.spec, c.inputs, on_progress=watch.on_progress if watch else None,
                               should_cancel=watch.should_cancel if watch else None)
    except JobCancelled as e:
        return None, {"cancelled": True, "at": interrupt_at, "step": e.step}
    outs = [result.outputs[k] for k in sorted(result.outputs)]
    return outs, {"info": result.ranks, "late": watch is not None}


def compare(c: Config, outs: list[torch.Tensor]) -> bool | None:
    """None when this run sets the configuration's reference (its first complete run; an echo's reference is its
    own inputs), else whether the outputs are bitwise equal to it; the largest difference seen is kept."""
    if c.reference is None:
        c.reference = [t.clone() for t in outs]
        return None
    if len(outs) != len(c.reference) or any(a.shape != b.shape or a.dtype != b.dtype
                                            for a, b in zip(outs, c.reference)):
        c.max_diff = math.inf
        return False
    for a, b in zip(outs, c.reference):
        if a.numel():
            c.max_diff = max(c.max_diff, float((a.float() - b.float()).abs().max()))
    return all(torch.equal(a, b) for a, b in zip(outs, c.reference))


# ---- what a leak would grow ------------------------------------------------------------------------------------
def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def snapshot(engine: Engine, gpu_mib: dict[int, float]) -> dict:
    """Counts (judged: must stay flat) and memory (reported)."""
    procs = {"client": os.getpid(), **{f"rank {r}": pid for r, pid in enumerate(engine.pids)}}
    counts = {"engine dir files": len(os.listdir(engine.engine_dir)),
              "own engine dirs in " + bridge.SHM_ROOT: len(sorted(bridge.engine_dirs(os.getpid()))),
              "client threads": _status(os.getpid(), "Threads")}
    counts.update({f"{name} fds": len(os.listdir(f"/proc/{pid}/fd")) for name, pid in procs.items()})
    memory = {f"{name} RSS MiB": _status(pid, "VmRSS") / 1024 for name, pid in procs.items()}
    memory.update({f"rank {r} GPU allocated MiB": v for r, v in sorted(gpu_mib.items())})
    return {"counts": counts, "memory": memory}


SETTLE_S = 2.0   # how long a snapshot waits for the ranks to finish closing what the last job used


def settled(engine: Engine, gpu_mib: dict[int, float], like: dict | None = None) -> dict:
    """A snapshot once the counts hold still: a rank closes the last job's answer segment and call mappings just
    after the client has its result, so a snapshot taken at once can catch one of them still open. Taken again every
    50 ms until two agree (and, given `like`, equal its counts) or SETTLE_S passes; a leak stays and is still seen."""
    deadline = time.monotonic() + SETTLE_S
    last = snapshot(engine, gpu_mib)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = snapshot(engine, gpu_mib)
        if now["counts"] == last["counts"] and (like is None or now["counts"] == like["counts"]):
            return now
        last = now
    return last


def _gpu_mib(info: list[dict], into: dict[int, float]) -> None:
    for rank in info:
        mem = rank.get("memory", {})
        if "allocated_gib" in mem:
            into[rank["rank"]] = mem["allocated_gib"] * 1024


# ---- the soak --------------------------------------------------------------------------------------------------
def bench_soak(jobs: int, ranks: int = 2, gpus: list[int] | None = None, log_every: int | None = None) -> dict:
    configs = make_configs(ranks)
    period = interrupt_period(len(configs))
    device = "cuda" if gpus else "cpu"
    print(f"soak: {jobs} jobs on {ranks} {device.upper()} ranks after a warm-up, rotating "
          f"{', '.join(c.name for c in configs)}; tiny synthetic models, {SIZE}x{SIZE}, {STEPS} euler steps, "
          f"{len(SIGMAS)} model calls; one job in {period} interrupted (a cancel at a varying step, or a session "
          f"aborted by an exception); every result against its configuration's first run (torch.equal)", flush=True)

    def tally() -> dict:
        return {"jobs": 0, "generate": 0, "echo": 0, "model sessions": 0, "cancels asked": 0, "cancelled": 0,
                "finished before the cancel landed": 0, "sessions aborted": 0, "compared": 0, "matched": 0,
                "mismatches": 0, "matched right after an interrupt": 0, "cancelled at step": {}}
    warm, counts = tally(), tally()
    mismatches: list[str] = []
    gpu_mib: dict[int, float] = {}
    problems: list[str] = []

    def one(c: Config, interrupt_at: int | None, after_interrupt: bool, counts: dict) -> None:
        outs, what = run_once(engine, c, interrupt_at)
        c.runs += 1
        _gpu_mib(what.get("info", []), gpu_mib)
        counts["jobs"] += 1
        counts["model sessions" if c.kind == "model" else c.kind] += 1
        if interrupt_at is not None:
            c.interrupted += 1
            if c.kind == "model":
                counts["sessions aborted"] += 1
            else:
                counts["cancels asked"] += 1
                if what.get("cancelled"):
                    counts["cancelled"] += 1
                    steps = counts["cancelled at step"]
                    steps[what["step"]] = steps.get(what["step"], 0) + 1
                else:
                    counts["finished before the cancel landed"] += 1
        if outs is None:
            return
        same = compare(c, outs)
        if same is None:
            return
        counts["compared"] += 1
        if same:
            counts["matched"] += 1
            counts["matched right after an interrupt"] += after_interrupt
        else:
            counts["mismatches"] += 1
            note = f"{c.name} run {c.runs} differs from its reference (max abs diff so far {c.max_diff:.3g})"
            mismatches.append(note)
            print(f"soak: MISMATCH: {note}", flush=True)

    t0 = time.perf_counter()
    with Engine(ranks, device=device, gpus=gpus) as engine:
        # warm-up: references, a matching second run, one interrupt each (models, meshes, allocator, gloo buffers)
        for c in configs:
            one(c, None, False, warm)
        for c in configs:
            one(c, None, False, warm)
        for c in configs:
            one(c, 1, False, warm)
            one(c, None, True, warm)
        warm_s = time.perf_counter() - t0
        engine_dir, pids = engine.engine_dir, list(engine.pids)
        before = settled(engine, gpu_mib)
        print(f"soak: warm-up done in {warm_s:.1f} s ({sum(c.runs for c in configs)} runs); before: "
              + ", ".join(f"{k} {v}" for k, v in before["counts"].items()), flush=True)
        t1 = time.perf_counter()
        log_every = log_every or max(10, jobs // 10)
        previous_interrupted = False
        for i in range(jobs):
            c = configs[i % len(configs)]
            interrupt_at = None
            if i % period == period - 1:
                interrupt_at = (c.interrupted + i % len(configs)) % c.interrupt_targets  # its targets in turn
            one(c, interrupt_at, previous_interrupted, counts)
            previous_interrupted = interrupt_at is not None
            if (i + 1) % log_every == 0 or i + 1 == jobs:
                print(f"soak: {i + 1}/{jobs} jobs, {counts['cancelled']} cancelled, {counts['sessions aborted']} "
                      f"sessions aborted, {counts['mismatches']} mismatches, {time.perf_counter() - t1:.1f} s",
                      flush=True)
        soak_s = time.perf_counter() - t1
        after = settled(engine, gpu_mib, like=before)
        restarts = list(engine.restarts)
        generation = engine.generation
    alive = [pid for pid in pids if not pid_gone(pid)]
    dir_left = os.path.exists(engine_dir)
    own_left = sorted(bridge.engine_dirs(os.getpid()))

    rows = []
    for group in ("counts", "memory"):
        for key, b in before[group].items():
            a = after[group].get(key, b)
            per100 = (a - b) / jobs * 100
            fmt = (lambda v: f"{v:.1f}") if group == "memory" else str
            rows.append((key, fmt(b), fmt(a), f"{a - b:+.1f}" if group == "memory" else f"{a - b:+d}",
                         f"{per100:+.2f}" if group == "memory" else ("flat" if a == b else "GREW" if a > b else
                                                                     "fell")))
    print(markdown(("metric", "before", "after", "delta", "per 100 jobs"), rows))
    max_diff = max(c.max_diff for c in configs)
    print(markdown(("configuration", "runs", "interrupted", "max abs diff vs reference"),
                   [(c.name, c.runs, c.interrupted, f"{c.max_diff:.3g}") for c in configs]))

    def at(steps: dict) -> str:
        return ", ".join(f"{s}: {n}" for s, n in sorted(steps.items())) or "-"
    print(markdown(("count", "warm-up", "soak"),
                   [(k, at(warm[k]) if isinstance(v, dict) else warm[k], at(v) if isinstance(v, dict) else v)
                    for k, v in counts.items()] + [
        ("engine restarts", "", len(restarts)), ("rank pids alive after close", "", len(alive)),
        ("engine dir left after close", "", "yes" if dir_left else "no"),
        ("wall time", f"{warm_s:.1f} s", f"{soak_s:.1f} s"), ("jobs per second", "", f"{jobs / soak_s:.2f}")]))
    for key, b in before["counts"].items():
        if after["counts"][key] != b:
            problems.append(f"{key} went from {b} to {after['counts'][key]}")
    if counts["mismatches"] + warm["mismatches"]:
        problems.append(f"{counts['mismatches'] + warm['mismatches']} of {counts['compared'] + warm['compared']} "
                        f"results differed from their reference ({mismatches[0]})")
    if restarts or generation != 1:
        problems.append(f"the engine restarted {len(restarts)} time(s): {restarts[:1]}")
    if alive:
        problems.append(f"rank pid(s) {alive} still alive after close")
    if dir_left or own_left:
        problems.append(f"engine dir(s) left after close: {own_left or [engine_dir]}")
    rss = {k: (after["memory"][k] - v) / jobs * 100 for k, v in before["memory"].items() if "RSS" in k}
    verdict = ("PASS" if not problems else "FAIL") + (
        f": {counts['matched'] + warm['matched']}/{counts['compared'] + warm['compared']} results (warm-up "
        f"included) bitwise equal to their reference (max abs diff "
        f"{max_diff:.3g}), {counts['cancelled']} cancels and {counts['sessions aborted']} aborted sessions, "
        f"{len(restarts)} restarts; files, shared memory, fds and threads "
        f"{'flat' if not any('went from' in p for p in problems) else 'NOT flat'}; RSS growth per 100 jobs "
        + ", ".join(f"{k.split(' RSS')[0]} {v:+.1f} MiB" for k, v in rss.items())
        + " (reported, not judged: allocators keep freed pages)")
    print(f"verdict: {verdict}", flush=True)
    return {"jobs": jobs, "ranks": ranks, "device": device, "interrupt_every": period, "counts": counts,
            "warmup_counts": warm, "restarts": restarts, "before": before, "after": after,
            "max_abs_diff": max_diff, "configs": {c.name: {"runs": c.runs, "interrupted": c.interrupted,
                                                           "max_abs_diff": c.max_diff} for c in configs},
            "alive_after_close": alive, "engine_dir_left": dir_left or bool(own_left), "soak_s": soak_s, "warmup_s": warm_s,
            "problems": problems, "verdict": verdict}
