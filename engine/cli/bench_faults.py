"""`bench faults`: the engine's fault matrix. Each case starts an engine of three CPU ranks with one fault armed
(engine/runtime/faults.py): kill -9 or SIGSTOP of the rank that receives the job (0), the one that returns the result
(1) or another (2), at start-up, as the job is broadcast, mid-step and during the result's return; an out-of-memory
error; the client killed at each of those points; and an interrupt storm (cancels interleaved with jobs). It prints
fault x phase -> the error's first line, detected in s, recovered (the next job returns its data on fresh ranks, or,
with the client dead, every rank gone and its shared memory removed)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..errors import EngineError, JobCancelled
from ..runtime import bridge
from ..runtime.client import Deadlines, Engine
from ..runtime.faults import Fault
from ..runtime.launch import PACK_ROOT, proc_stat
from .tables import markdown

ROLES = {"receiver": 0, "returner": 1, "other": 2}   # rank 0 receives every job; echo's return_rank 1 returns it
PHASES = {"start": "start-up", "broadcast": "job broadcast", "step": "mid-step", "return": "result return"}
WORLD = 3
STEP = 3            # the step a mid-step fault fires at
# Short enough that a stopped rank is found in seconds, long enough for three ranks starting on two busy cores.
MATRIX_DEADLINES = Deadlines(start_s=120, broadcast_s=60, compute_s=120, step_s=60, return_s=60, heartbeat_s=3,
                             error_grace_s=2, shutdown_s=10, backoff_s=1)
SLOW_JOB = {"steps": 400, "step_sleep_s": 0.02, "return_rank": ROLES["returner"]}   # a mid-step fault hits it
SHORT_JOB = {"steps": STEP + 2, "step_sleep_s": 0.02, "return_rank": ROLES["returner"]}


def register(bench, emit) -> None:
    p = bench.add_parser("faults", help="fault matrix: kill -9 / SIGSTOP / OOM per rank role and phase, client death, "
                                        "interrupt storm",
                         description="Runs every fault case on fresh CPU ranks and prints fault x phase -> detected in "
                                     "s, recovered. About 3 to 6 minutes on two cores.")
    p.add_argument("--quick", action="store_true", help="one role per fault and phase, and a storm of 10 cancels")
    p.set_defaults(run=lambda a: _report(a, emit), parser=p)


def _report(a, emit) -> int:
    rows = bench_faults(quick=a.quick)
    emit(a, "faults", rows)
    return 0 if all(r["recovered"] for r in rows) else 1


def bench_faults(quick: bool = False) -> list[dict]:
    roles = ["returner"] if quick else list(ROLES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="xdit-faults-") as tmp:
        for point in PHASES:
            for action in ("kill", "stop"):
                for role in roles:
                    rows.append(rank_fault(role, point, action, tmp))
                    _print_row(rows[-1])
        for point in ("broadcast", "step"):
            rows.append(rank_fault("other", point, "oom", tmp))
            _print_row(rows[-1])
        for point in PHASES:
            rows.append(client_death(point, tmp))
            _print_row(rows[-1])
    rows.append(interrupt_storm(10 if quick else 50))
    _print_row(rows[-1])
    print()
    print(markdown(("fault", "role (rank)", "phase", "detected in s", "recovered", "error"),
                   [(r["fault"], r["role"], r["phase"], _fmt(r["detected_s"]), "yes" if r["recovered"] else "NO",
                     r["error"][:110]) for r in rows]))
    return rows


def _fmt(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _print_row(r: dict) -> None:
    print(f"{r['fault']:>12} {r['role']:>14} {r['phase']:>14}: detected in {_fmt(r['detected_s'])} s, recovered "
          f"{'yes' if r['recovered'] else 'NO'}: {r['error'][:140]}", flush=True)


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`."""
    alive = []
    for name in os.listdir("/proc"):
        stat = proc_stat(int(name)) if name.isdigit() else None
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            alive.append(int(name))
    return alive


def _wait_gone(pgid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while group_alive(pgid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def rank_fault(role: str, point: str, action: str, tmp: str) -> dict:
    """One rank of three, by role, killed (kill -9), stopped (SIGSTOP) or out of memory at `point` of a slow echo job
    (or of start-up): the error must name that rank, the old group must be gone, no shared memory of it left, and the
    next job must return its data."""
    rank = ROLES[role]
    fault = Fault(rank=rank, point=point, action=action, step=STEP,
                  marker=os.path.join(tmp, f"{role}-{point}-{action}.jsonl"))
    x = torch.arange(4096, dtype=torch.float32)
    engine = Engine(WORLD, device="cpu", deadlines=MATRIX_DEADLINES, env=fault.env(), start=False)
    error, t_error = None, None
    try:
        try:
            engine.start()
            engine.submit("echo", SLOW_JOB if point == "step" else SHORT_JOB, {"x": x})
        except EngineError as e:
            error, t_error = e, time.time()
        fired = fault.firings()
        checks = []
        if not fired:
            checks.append("the fault did not fire")
        if error is None:
            checks.append("no error")
        elif action == "oom":
            if not (error.oom and f"rank {rank} (cpu) ran out of memory" in str(error)):
                checks.append("the error does not name the rank's out-of-memory")
        elif f"rank {rank}" not in str(error).splitlines()[0]:
            checks.append(f"the error does not name rank {rank}")
        if fired and action != "oom" and not _wait_gone(fired[0]["pgid"], 10):
            checks.append(f"ranks of the failed group still alive: {group_alive(fired[0]['pgid'])}")
        try:
            out = engine.submit("echo", {"return_rank": ROLES["returner"]}, {"x": x}).outputs["x"]
            if not torch.equal(out, x):
                checks.append("the next job returned wrong data")
        except EngineError as e:
            checks.append(f"the next job failed: {str(e).splitlines()[0]}")
        if bridge.engine_dirs(os.getpid()) != {os.path.basename(engine.engine_dir or "")}:
            checks.append(f"shared memory left behind: {sorted(bridge.engine_dirs(os.getpid()))}")
        left = [n for n in os.listdir(engine.engine_dir) if n.startswith("j")] if engine.engine_dir else []
        if left:
            checks.append(f"job segments left: {left}")
    finally:
        engine.close()
    return {"fault": {"kill": "kill -9", "stop": "SIGSTOP", "oom": "OOM"}[action], "role": f"{role} ({rank})",
            "phase": PHASES[point], "detected_s": (t_error - fired[0]["time"]) if error is not None and fired else None,
            "recovered": not checks, "error": "; ".join(checks) if checks else str(error).splitlines()[0],
            "restarts": len(engine.restarts)}


CLIENT = r"""
import json, sys, torch
from engine.runtime.client import Engine
from engine.cli.bench_faults import MATRIX_DEADLINES, SLOW_JOB, WORLD
from engine.runtime.faults import Fault
fault = Fault(**json.loads(sys.argv[1]))
e = Engine(WORLD, device="cpu", deadlines=MATRIX_DEADLINES, env=fault.env())
e.submit("echo", SLOW_JOB, {"x": torch.zeros(1 << 20)})
"""


def client_death(point: str, tmp: str) -> dict:
    """The client (ComfyUI's process) killed by kill -9 at `point` (a rank kills its parent there): every rank must
    be gone and the engine's shared memory removed, with no one left to ask them."""
    fault = Fault(rank=ROLES["returner"], point=point, action="kill_client", step=STEP,
                  marker=os.path.join(tmp, f"client-{point}.jsonl"))
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(fault.__dict__)], cwd=PACK_ROOT,
                            env=dict(os.environ, PYTHONPATH=PACK_ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    checks = []
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        checks.append("the client was not killed")
    fired = fault.firings()
    detected = None
    if fired:
        pgid = fired[0]["pgid"]
        end = time.monotonic() + 15
        while (group_alive(pgid) or bridge.engine_dirs(proc.pid)) and time.monotonic() < end:
            time.sleep(0.05)
        detected = time.time() - fired[0]["time"]
        if group_alive(pgid):
            checks.append(f"orphaned ranks: {group_alive(pgid)}")
            for pid in group_alive(pgid):
                os.kill(pid, 9)
        if bridge.engine_dirs(proc.pid):
            checks.append(f"shared memory left behind: {sorted(bridge.engine_dirs(proc.pid))}")
    else:
        checks.append("the fault did not fire")
    return {"fault": "client kill -9", "role": "client", "phase": PHASES[point], "detected_s": detected,
            "recovered": not checks,
            "error": "; ".join(checks) if checks else "all ranks exited and removed the shared memory", "restarts": 0}


def interrupt_storm(cancels: int) -> dict:
    """`cancels` jobs cancelled at varying steps (from before the first step on), each followed by a job that must
    return its data, on one engine that must never restart. Detected: the slowest cancel, from the request to the
    JobCancelled."""
    x = torch.randn(1000)
    latencies, checks = [], []
    with Engine(WORLD, device="cpu", deadlines=MATRIX_DEADLINES) as engine:
        for i in range(cancels):
            at_step = i % 6     # 0: cancelled before the job's first step
            asked = []

            def should_cancel():
                if not asked and reported[0] >= at_step:
                    asked.append(time.monotonic())
                return bool(asked)

            reported = [0]
            try:
                engine.submit("echo", {"steps": 200, "step_sleep_s": 0.01, "return_rank": i % WORLD}, {"x": x},
                              on_progress=lambda s, t: reported.__setitem__(0, s), should_cancel=should_cancel)
                checks.append(f"job {i} was not cancelled")
            except JobCancelled:
                latencies.append(time.monotonic() - asked[0])
            out = engine.submit("echo", {"return_rank": (i + 1) % WORLD}, {"x": x * i}).outputs["x"]
            if not torch.equal(out, x * i):
                checks.append(f"the job after cancel {i} returned wrong data")
        if engine.restarts:
            checks.append(f"the engine restarted: {engine.restarts}")
    median = statistics.median(latencies) if latencies else float("nan")
    return {"fault": f"{cancels} cancels", "role": "caller", "phase": "interleaved with jobs",
            "detected_s": max(latencies) if latencies else None, "recovered": not checks,
            "error": "; ".join(checks) if checks else (f"{len(latencies)} JobCancelled, median {median:.3f} s; every "
                                                       f"following job returned its data; no restart"),
            "restarts": 0}
