"""`bench project`: every plan of P ranks projected from one rank's share run on this one device (a GPU or the CPU),
beside the planner's estimate; the 1-rank row beside `bench overhead`'s; on the CPU, the method checked against real
2-rank runs with each rank pinned to its own core, the residual printed. The share and the projection arithmetic are
engine/runtime/projection.py's; here are the worker processes that run the shares, the real runs and the tables."""
from __future__ import annotations

import gc
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..errors import EngineError
from ..families import VARIANTS
from ..generate.request import default_dtype
from ..models.load import inspect_model
from ..parallel import cost
from ..parallel.devices import GPUS, LINK_ALIASES, LINKS, Hardware, Interconnect, find_gpu, link_for
from ..parallel.measured import Measured, MeasuredLink
from ..parallel.plan import ParallelPlan, feasible, is_exact, plan_problems
from ..runtime.projection import RESULT, project_job, project_pipefusion, share_request
from ..runtime.client import Engine
from ..runtime.machine import Machine
from ..runtime.launch import PACK_ROOT, cpu_sets, rank_env
from . import args as types
from .bench_overhead import bench_overhead
from .args import UsageError
from .tables import markdown

MEASURED = "measured"   # --link: as calibration measures it
VALIDATE = ("ulysses2", "ring2", "pipefusion2", "cfg2", "dp2")   # the 2-rank plans a CPU run can check
COMMAND_S = 3600.0   # one worker command (a plan's share, all repeats): a full-size model on a CPU takes minutes a step


def register(bench, emit) -> None:
    p = bench.add_parser("project", help="projected s/image of every plan from one rank's share run on one device",
                         description="For each plan of P ranks: one rank's real share of the job (its tokens and "
                                     "heads, ring blocks, stage, CFG pass or batch share) run on this one device with "
                                     "the collectives replaced by local stand-ins of the same shapes, plus the link "
                                     "time of the plan's collectives over the link as calibration measured it (or as "
                                     "the planner models it), beside the planner's own estimate. On the "
                                     "CPU, checked against real 2-rank runs with each rank pinned to its own core.")
    p.add_argument("--model", default="flux-dev", type=types.model_name(), metavar="NAME",
                   help=f"synthetic variant (random weights), by any of its names: {', '.join(VARIANTS)}")
    p.add_argument("--size", default="tiny", choices=["tiny", "full"], help="tiny test dims or the real model's")
    p.add_argument("--gpus", type=types.gpu_list, help="one CUDA GPU index to run the shares on (default: the CPU)")
    p.add_argument("--width", type=types.pixels, default=256, help="image width in pixels")
    p.add_argument("--height", type=types.pixels, default=256, help="image height in pixels")
    p.add_argument("--steps", type=types.request_field("steps", types.integer), default=28, help="euler steps")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype (default: bf16 with --gpus, fp32 on the CPU)")
    p.add_argument("--ranks", type=lambda t: types.int_list(t, types.ranks, "2,4,8"), default="2,4,8",
                   help="rank counts P whose plans are projected (the 1-rank row is always there)")
    p.add_argument("--repeats", type=types.positive_int, default=3, help="timed runs of each share (median)")
    p.add_argument("--link", choices=[MEASURED] + list(LINKS) + list(LINK_ALIASES),
                   help="the link between the P devices: measured (on the CPU: 2 pinned gloo ranks, calibrated "
                        "now; with --gpus: this machine's stored calibration, python -m engine calibrate --gpus), or "
                        "one of the planner's modelled links (default: measured on the CPU, nvlink with --gpus)")
    p.add_argument("--gpu-name", help="the GPU the planner's estimate and link are for (with --gpus; default: the "
                                      "GPU's own)")
    p.add_argument("--validate", type=types.name_list(VALIDATE), default="ulysses2,ring2",
                   help="2-rank plans checked against a real run (CPU, 2 cores or more)")
    p.add_argument("--no-validate", action="store_true", help="skip the real 2-rank runs")
    p.set_defaults(run=lambda a: _run(a, emit), parser=p)


def _run(a, emit) -> int:
    if a.gpus and len(a.gpus) > 1:
        raise UsageError(f"argument --gpus: {','.join(map(str, a.gpus))} names {len(a.gpus)} GPUs: bench project runs "
                         f"every share on one device, give one index")
    if a.gpu_name and not a.gpus:
        raise UsageError(f"argument --gpu-name: {a.gpu_name!r} applies with --gpus (the shares run on that GPU); on "
                         f"the CPU the planner's rate comes from the 1-rank share")
    if a.gpu_name and find_gpu(a.gpu_name) is None:
        raise UsageError(f"argument --gpu-name: {a.gpu_name!r} is not in the planner's GPU table: use one of "
                         f"{', '.join(GPUS)}")
    dtype = a.dtype or default_dtype("cuda" if a.gpus else "cpu")
    rows = bench_project(a.model, a.size, a.gpus, a.width, a.height, a.steps, dtype, a.ranks, a.repeats, a.link,
                         a.gpu_name, () if a.no_validate else tuple(a.validate))
    return emit(a, "project", rows)


# ---- the worker processes that run shares ------------------------------------------------------------------------
class ShareWorker:
    """A process running shares (projection.serve) on `cores` with `threads` threads, or on one GPU. Every answer has a
    deadline; close() kills it. It leads its own process group, so Ctrl-C reaches this process only."""

    def __init__(self, device: str, threads: int, cores: list[int] | None, gpu: int | None, deadline_s: float):
        self.deadline_s = deadline_s
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.runtime.projection"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=rank_env([gpu] if device == "cuda"
                                                                                          else None),
                                     cwd=PACK_ROOT, process_group=0)
        self.buffer = b""
        self.ready = self.ask({"op": "init", "device": device, "threads": threads, "cores": cores}, "start-up")

    def ask(self, command: dict, what: str) -> dict:
        self.send(command, what)
        return self.receive(what)

    def send(self, command: dict, what: str) -> None:
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"bench project: the share worker exited before {what}{self._tail()}") from None

    def receive(self, what: str) -> dict:
        deadline = time.monotonic() + self.deadline_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(RESULT):
                        reply = json.loads(text[len(RESULT):])
                        if "error" in reply:
                            raise EngineError(f"bench project: {what}: {reply['error']}")
                        return reply
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"bench project: {what} took more than {self.deadline_s:.0f} s (the worker's "
                                      f"deadline); try fewer --steps or --repeats")
                if sel.select(timeout=min(left, 1.0)):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        raise EngineError(f"bench project: the share worker exited during {what}{self._tail()}")
                    self.buffer += chunk

    def _tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
        return (": " + " | ".join(lines)) if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def _placement(ranks: int, device: str) -> tuple[int, tuple[int, ...] | None]:
    """(threads, cores) of one rank of a `ranks`-rank engine here: on the CPU, 1 rank as the engine runs it (every
    core, unpinned); more, pinned to rank 0's cores as Engine(pin_cpus=True) would pin it (one core when there are
    more ranks than cores: the projection is then for ranks that each have a core)."""
    if device == "cuda":
        return 1, None
    if ranks == 1:
        return max(1, os.cpu_count() or 1), None
    allowed = sorted(os.sched_getaffinity(0))
    cores = tuple(cpu_sets(ranks)[0]) if ranks <= len(allowed) else (allowed[0],)
    return len(cores), cores


def _hardware(ranks: int, device: str, link, gpu_name: str | None) -> Hardware:
    """`link`: a modelled link's name, or a measured Interconnect."""
    if device == "cpu":
        return Hardware(device="cpu", gpus=ranks, link=link_for(link, None) if isinstance(link, str) else link)
    gpu = find_gpu(gpu_name)
    return Hardware(device="cuda", gpus=ranks, gpu=gpu, gpu_name=gpu.name if gpu else gpu_name,
                    memory_gib=gpu.memory_gib if gpu else None,
                    link=link_for(link, gpu) if isinstance(link, str) else link)


def measured_link(device: str, gpus: list[int] | None, work) -> tuple[Interconnect | None, str]:
    """The link the projection prices collectives on, as calibration measures it: on the CPU two gloo ranks pinned to
    their own cores (the validation's setup), measured now at the sizes this job's plans send and stored as that
    setup's figures; with a GPU, this machine's stored calibration of a GPU list holding it. (None, why) when there is
    none."""
    if device == "cpu":
        if len(os.sched_getaffinity(0)) < 2:
            return None, "pinning 2 CPU ranks needs 2 cores"
        machine = Machine("cpu", 2, pinned=True)
        with Engine(2, device="cpu", pin_cpus=True) as engine:
            measured = machine.calibrate(engine, [], link_work=work, keep_jobs=True)
        return measured.link(LINKS["cpu"]), f"measured now over 2 pinned gloo ranks, stored in {machine.path}"
    machine = Machine("cuda", len(gpus), gpus)
    for setup, figures in machine.stored_setups().items():
        if setup.startswith("cuda:") and figures.get("pairs") and str(gpus[0]) in setup[5:].split(","):
            link = Measured(setup, figures).link(LINKS["nvlink"])
            return link, f"measured by calibration of {setup} ({figures.get('calibrated', '')}), {machine.path}"
    return None, f"nothing measured for a GPU list with GPU {gpus[0]} in {machine.path}: run python -m engine " \
                 f"calibrate --gpus {gpus[0]},... first, or give --link nvlink|pcie|..."


def _command(plan: ParallelPlan, fields: dict, repeats: int, warmups: int = 1, rank: int | None = None) -> dict:
    """The worker command for `plan`'s share: rank 0's job (or `rank`'s), every PipeFusion stage (or stage `rank`)."""
    command = {"plan": plan.describe(), "request": fields, "repeats": repeats}
    if plan.pipefusion > 1:
        return {"op": "stages", **command, **({"stages": [rank]} if rank is not None else {})}
    return {"op": "job", "warmups": warmups, "rank": rank or 0, **command}


def _projection(plan: ParallelPlan, work, link, replies: list[dict]):
    """A plan's projection from its share's replies (PipeFusion: the stages' replies in order, concatenated)."""
    if plan.pipefusion > 1:
        whole = [t for r in replies for t in r["whole_s"]]
        steady = [t for r in replies for t in r["steady_s"]]
        return project_pipefusion(plan, work, link, whole, steady)
    return project_job(plan, work, link, max(statistics.median(r["times_s"]) for r in replies))


def _share(worker: ShareWorker, plan: ParallelPlan, fields: dict, work, link, repeats: int, warmups: int = 1):
    """One plan's projection from rank 0's share (every stage's, one after another, under PipeFusion)."""
    return _projection(plan, work, link, [worker.ask(_command(plan, fields, repeats, warmups),
                                                     f"the share of {plan.describe()}")])


def _shares_at_once(workers: list[ShareWorker], plan: ParallelPlan, fields: dict, work, link):
    """Every rank's share (every stage's under PipeFusion) at the same time, each on its own worker: the slowest
    rank's job (the stages as each measured its own)."""
    what = f"the shares of {plan.describe()} at once"
    for rank, w in enumerate(workers):
        w.send(_command(plan, fields, 1, warmups=0, rank=rank), what)
    return _projection(plan, work, link, [w.receive(what) for w in workers])


# ---- the benchmark -----------------------------------------------------------------------------------------------
def bench_project(variant: str, size: str, gpus: list[int] | None, width: int, height: int, steps: int, dtype: str,
                  ranks: list[int], repeats: int, link: str | None = None, gpu_name: str | None = None,
                  validate: tuple[str, ...] = ("ulysses2", "ring2"), deadline_s: float = COMMAND_S) -> list[dict]:
    """The 1-rank row comes from `bench overhead`'s rounds: on the CPU, where other processes share the cores, the
    1-rank share runs in them, alternating with the engine's job and the plain loop; on a GPU, after them (one copy
    of the model on the device at a time)."""

    device = "cuda" if gpus else "cpu"
    source = f"synthetic:{variant}" + (":tiny" if size == "tiny" else "")
    info = inspect_model(source)
    fields = dict(model=source, width=width, height=height, steps=steps, cfg=info.spec.cfg, dtype=dtype, seed=0)
    try:
        work = share_request(fields, ParallelPlan()).workload(info)
    except ValueError as e:
        raise UsageError(str(e)) from None
    link = link or ("nvlink" if gpus else MEASURED)
    how = "the planner's model"
    if link == MEASURED:
        link, how = measured_link(device, gpus, work)
        if link is None and gpus:
            raise UsageError(f"argument --link: measured: {how}")
        if link is None:
            link, how = "cpu", f"the planner's model ({how})"
    gpu_name = gpu_name or (torch.cuda.get_device_name(gpus[0]) if gpus else None)
    plans = [ParallelPlan()] + [p for n in dict.fromkeys(ranks) if n > 1 for p in feasible(n, work, pipefusion=True)]
    where = f"GPU {gpus[0]} ({torch.cuda.get_device_name(gpus[0])})" if gpus else f"the CPU ({os.cpu_count()} cores)"
    modelled = _hardware(2, device, link, gpu_name).link
    p2p = getattr(modelled, "p2p_latency_us", None)
    print(f"\n{source} {width}x{height}, {steps} euler steps, cfg {fields['cfg']}, {dtype}; shares run on {where}, "
          f"median of {repeats} after a warm-up; link: {modelled.describe()}{' of ' + gpu_name if gpus else ''} "
          f"({modelled.bandwidth_gbs:.3g} GB/s, {modelled.latency_us:.0f} us a call"
          + (f", {p2p:.0f} us a point-to-point message" if p2p else "") + f"; {how}); {len(plans)} plans", flush=True)
    workers: dict[tuple, ShareWorker] = {}

    def worker_for(n: int) -> ShareWorker:
        threads, cores = _placement(n, device)
        if (threads, cores) not in workers:
            workers[(threads, cores)] = ShareWorker(device, threads, list(cores) if cores else None,
                                                    gpus[0] if gpus else None, deadline_s)
        return workers[(threads, cores)]

    def one_rank_share() -> float:
        return worker_for(1).ask(_command(ParallelPlan(), fields, 1, warmups=0), "the 1-rank share")["times_s"][0]

    try:
        print("the 1-rank reference, bench overhead" + (", with the 1-rank share in its rounds:" if device == "cpu"
                                                        else ":"), flush=True)
        overhead = bench_overhead(variant, size, gpus, width, height, steps, dtype, repeats,
                                  alongside=one_rank_share if device == "cpu" else None)[0]
        if device == "cuda":   # the plain loop's model, cached by this process's allocator, leaves the GPU
            gc.collect()
            torch.cuda.empty_cache()
        rows, out = [], []
        one = None
        for plan in plans:
            n = plan.world_size
            hw = _hardware(n, device, link, gpu_name)
            threads, cores = _placement(n, device)
            if n == 1 and "alongside_s" in overhead:
                proj = project_job(plan, work, hw.link, overhead["alongside_s"])
            else:
                proj = _share(worker_for(n), plan, fields, work, hw.link, repeats)
            one = one or proj
            given = cost.estimate(plan, work, hw, one_gpu_ms=one.share_s / steps * 1e3)
            rated = cost.estimate(plan, work, hw) if device == "cuda" else None
            placed = "GPU" if device == "cuda" else f"{threads} thread(s)" + (
                f", core {','.join(map(str, cores))}" if cores else "")
            print(f"  {n} rank(s) {plan.describe()} ({placed}): share {proj.share_s:.3f} s + link "
                  f"{proj.link_s * 1e3:.1f} ms", flush=True)
            rows.append((n, plan.describe(), "yes" if is_exact(plan, work) else "no", f"{proj.share_s:.3f}",
                         f"{proj.link_s:.4f}", f"{proj.s_per_image:.3f}", f"{one.s_per_image / proj.s_per_image:.2f}x",
                         f"{given.s_per_image:.3f}", f"{proj.s_per_image / given.s_per_image:.2f}")
                        + ((f"{rated.s_per_image:.3f}",) if rated else ()))
            out.append({"kind": "plan", "ranks": n, "plan": plan.describe(), "exact": is_exact(plan, work),
                        "share_s": proj.share_s, "link_s": proj.link_s, "projected_s_per_image": proj.s_per_image,
                        "planner_s_per_image": given.s_per_image,
                        "planner_rated_s_per_image": rated.s_per_image if rated else None,
                        "threads": threads, "cores": list(cores) if cores else None})
        header = ("ranks", "plan", "exact", "share s", "link s", "projected s/image", "vs 1 rank",
                  "planner s/image", "projected/planner") + (("planner s/image (rated GPU)",) if device == "cuda"
                                                              else ())
        print(markdown(header, rows))
        print(f"share: one rank's job with every collective a local stand-in of the same shapes (rank 0; PipeFusion: "
              f"every stage, the pipeline assembled as the planner does); link: the plan's collectives over the link "
              f"above ({how}), priced by the planner's communication model; planner: cost.estimate with its "
              f"one-device step taken from the 1-rank share "
              f"({one.share_s / steps * 1e3:.1f} ms){', and with the GPU table rate' if device == 'cuda' else ''}"
              f". P ranks here mean P devices like this one"
              f"{'' if device == 'cuda' else ' (on the CPU: a rank per core set, as pinned above)'}.")
        out.append({"kind": "link", "source": how, "measured": isinstance(modelled, MeasuredLink),
                    "bandwidth_gbs": modelled.bandwidth_gbs, "latency_us": modelled.latency_us,
                    "p2p_latency_us": p2p})
        out.append(_one_rank(one, overhead))
        if validate and device == "cpu":
            out += _validate(validate, fields, work, repeats, worker_for, modelled)
        elif validate:
            print("\nvalidation against real 2-rank runs: skipped on a GPU (it needs two; the CPU run checks the "
                  "method)")
    finally:
        for w in workers.values():
            w.close()
    return out


def _one_rank(one, overhead: dict) -> dict:
    """The 1-rank projection beside `bench overhead`'s 1-rank engine job (the same job, the same rank setup)."""
    engine_s, compute_s, plain_s = overhead["engine_job_s"], overhead["engine_compute_s"], overhead["plain_loop_s"]
    print("\n1 rank: the projection against bench overhead (same job, same threads"
          + (", timed in the same alternating rounds)" if "alongside_s" in overhead else ")"))
    print(markdown(("path", "s/image", "projection / this"), [
        ("projection, 1 rank (share in a worker process)", f"{one.s_per_image:.3f}", "1.000"),
        ("bench overhead: engine job, compute on the rank", f"{compute_s:.3f}", f"{one.s_per_image / compute_s:.3f}"),
        ("bench overhead: engine job, total", f"{engine_s:.3f}", f"{one.s_per_image / engine_s:.3f}"),
        ("bench overhead: plain loop in process", f"{plain_s:.3f}", f"{one.s_per_image / plain_s:.3f}")]))
    return {"kind": "one_rank", "projected_s_per_image": one.s_per_image, "overhead_engine_compute_s": compute_s,
            "overhead_engine_job_s": engine_s, "overhead_plain_loop_s": plain_s,
            "residual_vs_engine_compute": one.s_per_image / compute_s - 1}


def _validate(names: tuple[str, ...], fields: dict, work, repeats: int, worker_for, link_model) -> list[dict]:
    """Each 2-rank plan projected from rank 0's share (alone on its cores), and from both ranks' shares run at once
    (each on its own cores, no communication), against the real 2-rank engine job with each rank pinned to its own
    cores; share, shares at once and real run alternate, so that the machine's drift hits all three. The link is
    `link_model`: gloo between 2 pinned CPU ranks as calibration measured it (or the planner's model of it)."""
    allowed = sorted(os.sched_getaffinity(0))
    print(f"\nvalidation: 2-rank plans, projected vs the real 2-rank engine job with each rank pinned to its own "
          f"core(s); {repeats} alternating runs of each (median)", flush=True)
    if len(allowed) < 2:
        print(f"skipped: this process may use {len(allowed)} core ({allowed[0]}); pinning 2 ranks needs 2")
        return []
    plans = []
    for name in names:
        plan = ParallelPlan.parse(name)
        problems = plan_problems(plan, work)
        if problems:
            print(f"  {name}: skipped, {'; '.join(problems)}")
        else:
            plans.append(plan)
    if not plans:
        return []
    sets = cpu_sets(2)
    workers = [worker_for(2), ShareWorker("cpu", len(sets[1]), sets[1], None, worker_for(2).deadline_s)]
    rows, out = [], []
    try:
        with Engine(2, device="cpu", pin_cpus=True) as engine:
            for plan in plans:
                spec, inputs = share_request(fields, plan).to_job()
                engine.submit("generate", spec, inputs)                   # warm-ups: model built, first-run costs
                _shares_at_once(workers, plan, fields, work, link_model)
                alone, together, real, total = [], [], [], []
                for _ in range(repeats):
                    alone.append(_share(workers[0], plan, fields, work, link_model, 1, warmups=0))
                    together.append(_shares_at_once(workers, plan, fields, work, link_model))
                    timings = engine.submit("generate", spec, inputs).timings
                    real.append(timings["compute_s"] / work.batch)
                    total.append(timings["total_s"] / work.batch)
                row = {"kind": "validation", "plan": plan.describe(),
                       "share_s": statistics.median(p.share_s for p in alone),
                       "shares_at_once_s": statistics.median(p.share_s for p in together),
                       "link_s": statistics.median(p.link_s for p in alone),
                       "projected_s_per_image": statistics.median(p.s_per_image for p in alone),
                       "projected_at_once_s_per_image": statistics.median(p.s_per_image for p in together),
                       "real_s_per_image": statistics.median(real), "real_total_s_per_image": statistics.median(total)}
                row["residual"] = row["projected_s_per_image"] / row["real_s_per_image"] - 1
                row["residual_at_once"] = row["projected_at_once_s_per_image"] / row["real_s_per_image"] - 1
                print(f"  {plan.describe()}: projected {row['projected_s_per_image']:.3f} s, real "
                      f"{row['real_s_per_image']:.3f} s ({row['residual'] * 100:+.1f}%)", flush=True)
                rows.append((plan.describe(), f"{row['share_s']:.3f}", f"{row['shares_at_once_s']:.3f}",
                             f"{row['link_s'] * 1e3:.1f}",
                             f"{(row['real_s_per_image'] * work.batch - row['shares_at_once_s']) * 1e3:.1f}",
                             f"{row['projected_s_per_image']:.3f}",
                             f"{row['projected_at_once_s_per_image']:.3f}", f"{row['real_s_per_image']:.3f}",
                             f"{row['residual'] * 100:+.1f}%", f"{row['residual_at_once'] * 100:+.1f}%"))
                out.append(row)
    finally:
        workers[1].close()
    print(markdown(("plan", "share s (rank 0 alone)", "shares at once s", "link ms",
                    "real - at once ms", "projected s/image",
                    "projected, shares at once", "real 2 ranks s/image", "residual", "residual, at once"), rows))
    print(f"cores: rank 0 {sets[0]}, rank 1 {sets[1]}, for the shares and the real ranks alike. real: the engine job's "
          f"compute on the slower rank. residual = projected / real - 1: the method (one rank's share alone + the "
          f"link's time for the plan's collectives). at once: both ranks' shares run together without communicating "
          f"(the slower one counts), which "
          f"takes out what running side by side costs on a shared CPU (caches, memory bandwidth, other processes on "
          f"the machine) and leaves the collectives' real cost, real - at once, against the link's.")
    return out
