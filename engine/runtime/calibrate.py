"""Calibration: what the engine's ranks measure of the devices they run on (the `calibrate` job), and the client's side
that asks for it and turns the ranks' reports into a setup's figures (parallel/measured.py says what they are and
how the planner reads them; runtime/machine.py stores them).

Every rank measures, in one job: its device's memory free once its CUDA context exists; then, in step with the others,
each pair of ranks exchanging messages in both directions at once and an all-to-all of the first n ranks, at the sizes
the plans send; then, all at once (as a job runs them), a model at its real widths on its own device (random weights,
nothing read from a file; one block of each list, run as many times as the list has blocks) at the token counts a rank
holds under 1, 2, 4, ... ranks. The collectives go through the same link the jobs use (gloo or NCCL over the engine's
process group) and pay what a job's collectives pay, an injected delay included (parallel/mesh.py's
XDIT_LINK_DELAY_MS, for tests).
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ..errors import JobCancelledSignal
from ..models.flow import Conditioning, FlowModel
from ..models.load import inspect_model, random_model
from ..parallel import cost
from ..parallel.measured import fit_link, model_key
from ..parallel.mesh import link_delay
from ..parallel.plan import ParallelPlan, Workload

SMALL_BYTES = 4096            # a message whose time is the link's latency
LARGE_BYTES = 16 * 2**20      # a message whose time is mostly the link's bandwidth
MAX_BYTES = 256 * 2**20       # the largest message measured (a plan's larger messages are priced at its rate)
LINK_BUDGET_BYTES = 512 * 2**20   # per size, repeats x bytes: large messages are timed fewer times
COMPUTE_BUDGET_S = 2.0        # per share, the timed steps after the warm-up (at least one)


# ---- the ranks' side ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _repeats(nbytes: int) -> int:
    return max(3, min(10, LINK_BUDGET_BYTES // max(nbytes, 1)))


def _timed(fn, device: torch.device, repeats: int, warmups: int = 2) -> float:
    """Seconds per call of fn, over `repeats` calls back to back after `warmups`."""
    for _ in range(warmups):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def _exchange(peer: int, nbytes: int, device: torch.device) -> float:
    """Seconds of one exchange with `peer`: each side sends `nbytes` and receives as many, at once."""
    send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def once():
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                               dist.P2POp(dist.irecv, recv, peer)]):
            request.wait()
        link_delay()
    return _timed(once, device, _repeats(nbytes))


def _all_to_all(pg, n: int, nbytes: int, device: torch.device) -> float:
    """Seconds of one all-to-all of `n` ranks, each holding `nbytes` (and sending (n - 1) / n of it)."""
    elements = max(n, nbytes // 4 // n * n)
    send = torch.zeros(elements, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def once():
        dist.all_to_all_single(recv, send, group=pg)
        link_delay()
    return _timed(once, device, _repeats(nbytes))


def _memory(device: torch.device) -> dict:
    """The device's memory as a job would find it: free once this rank's CUDA context exists, what this rank's
    allocator caches counted as free (it is the rank's to use)."""
    if device.type != "cuda":
        return {"device": "cpu"}
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device)
    return {"device": "cuda", "name": torch.cuda.get_device_name(device), "free_gib": free / 2**30,
            "total_gib": total / 2**30}


def _link(ctx, sizes: list[int], groups: list[int]) -> dict:
    """Every pair's exchanges and the first n ranks' all-to-alls, at every size; every rank takes part in every
    barrier, so they stay in step. Returns what this rank measured (a pair is reported by its lower rank)."""
    out = {"pairs": [], "all_to_all": []}
    world, rank, device = ctx.world, ctx.rank, ctx.device
    for i in range(world):
        for j in range(i + 1, world):
            if rank in (i, j):
                points = [[b, _exchange(j if rank == i else i, b, device)] for b in sizes]
                if rank == i:
                    out["pairs"].append({"ranks": [i, j], "points": points})
            dist.barrier(group=ctx.group)
    for n in groups:
        pg = ctx.group if n == world else dist.new_group(list(range(n)))
        if rank < n:
            points = [[b * (n - 1) // n, _all_to_all(pg, n, b, device)] for b in sizes]
            if rank == 0:
                out["all_to_all"].append({"ranks": list(range(n)), "points": points})
        dist.barrier(group=ctx.group)
        if n != world and rank < n:   # each member destroys its own, as parallel/mesh.py does
            dist.destroy_process_group(pg)
    return out


def _set_blocks(model: torch.nn.Module, name: str, blocks: list) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, torch.nn.ModuleList(blocks))


def _compute(model_spec: dict, device: torch.device, repeats: int, between=lambda: None) -> dict:
    """The model's one-device step at each share of its tokens, at its real widths: the embedders, the final layer and
    the first block of each block list, each list run as that one block as many times as the list has blocks (one
    block's weights, the whole depth's work), timed as a forward of the whole model. between(): called by every rank
    before the model is built (where the ranks agree whether to stop: once a model, before anything that can fail on
    one rank only, so every rank calls it as often)."""
    from ..generate.request import GenerateRequest

    source, dtype = model_spec["model"], model_spec["dtype"]
    info = inspect_model(source)
    lists = info.spec.tokens.blocks
    prefixes = tuple(f"{name}." for name in lists)
    firsts = tuple(f"{name}.0." for name in lists)
    between()
    loaded = random_model(info, source, dtype=dtype, device=device, fp8_weights=model_spec.get("fp8", False),
                          keep=lambda n: not n.startswith(prefixes) or n.startswith(firsts))
    model = loaded.model
    counts = {name: len(model.get_submodule(name)) for name in lists}
    first = {name: model.get_submodule(name)[0] for name in lists}
    for name in lists:
        _set_blocks(model, name, [first[name]] * counts[name])
    flow = FlowModel(loaded)
    points = []
    try:
        for share in model_spec["shares"]:
            height, text = model_spec["heights"][str(share)], model_spec["text_tokens"][str(share)]
            request = GenerateRequest.random_conditioning(source, model_spec["width"], height, text_tokens=text,
                                                          frames=model_spec.get("frames", 1))
            prepared = flow.prepare([Conditioning(request.cond, request.pooled, 3.5)], 1)
            x = torch.randn(request.latent_raw.shape, generator=torch.Generator().manual_seed(0)).to(device)
            sigma = torch.tensor([0.5])
            forward = lambda: flow.velocity(x, sigma, prepared)   # noqa: E731
            first = _timed(forward, device, 1, warmups=0)   # the warm-up, timed: a long step is timed fewer times
            step = _timed(forward, device, max(1, min(repeats, int(COMPUTE_BUDGET_S / first))), warmups=0) * 1e3
            points.append({"share": share, "latent": list(request.latent_raw.shape), "text_tokens": text,
                           "step_ms": step})
    finally:
        del flow, loaded, model, first
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": source, "dtype": dtype, "counts": counts, "points": points}


def measure(ctx, spec: dict) -> None:
    """The `calibrate` job on one rank: what spec asks for ("memory", "link": {"sizes", "groups"}, "compute": [model
    specs]), reported in ctx.info["calibration"]."""
    t0 = time.perf_counter()
    report = {"rank": ctx.rank}
    if spec.get("memory", True):
        report["memory"] = _memory(ctx.device)
    link = spec.get("link")
    if link and ctx.world > 1:
        ctx.stop_here()   # a cancel (ComfyUI's interrupt during a first start) ends it between its parts
        report.update(_link(ctx, [int(b) for b in link["sizes"]], [int(n) for n in link["groups"]]))
    report["link_s"] = time.perf_counter() - t0
    report["compute"] = []
    for model_spec in spec.get("compute", []):
        try:
            report["compute"].append(_compute(model_spec, ctx.device, int(spec.get("repeats", 3)),
                                              between=ctx.stop_here))
        except JobCancelledSignal:
            raise
        except Exception as e:   # a model this measurement cannot drive (e.g. inputs it has no random stand-in for)
            report["compute"].append({"model": model_spec["model"], "error": f"{type(e).__name__}: {e}"})
    report["seconds"] = time.perf_counter() - t0
    ctx.info["calibration"] = report


# ---- the client's side -------------------------------------------------------------------------------------------
def message_sizes(work: Workload) -> list[int]:
    """The bytes of one call of each collective a 2-rank plan of `work` sends (Ulysses' all-to-all, a ring hop, the
    velocity gather), a small message for the latency and a large one for the bandwidth: the sizes the link is
    measured at."""
    layers = max(1, work.layers)
    sizes = {SMALL_BYTES, LARGE_BYTES}
    two = cost.comm_bytes(ParallelPlan(ulysses=2), work)
    sizes.add(two["ulysses_all_to_all"] // (2 * layers))
    sizes.add(cost.comm_bytes(ParallelPlan(ring=2), work)["ring_p2p"] // layers)
    sizes.add(two["sp_gather"])
    return sorted(min(MAX_BYTES, max(SMALL_BYTES, s)) for s in sizes)


def group_sizes(world: int) -> list[int]:
    """The all-to-alls measured: the first n ranks for n = 2, 4, 8 and the whole group."""
    return sorted({n for n in (2, 4, 8) if n <= world} | ({world} if world > 1 else set()))


def compute_spec(source: str, work: Workload, width: int, height: int, frames: int, ranks: int) -> dict:
    """What a rank measures of a model: its step on the tokens a rank holds under sequence parallel of 1, 2, 4, ... up
    to `ranks` ranks: that share of `height` (whole latent rows, at least one token row) and of the text where the
    text splits with the image tokens."""
    info = inspect_model(source)
    row = info.latent_patch * info.latent.downscale   # pixels per token row
    shares = [p for p in (1, 2, 4, 8) if p <= ranks]
    heights = {str(p): max(row, height // p // row * row) for p in shares}
    texts = {str(p): work.text_tokens // p if work.text_splits and work.text_tokens % p == 0 else work.text_tokens
             for p in shares}
    return {"model": source, "dtype": work.dtype, "fp8": work.fp8_weights, "width": width, "heights": heights,
            "text_tokens": texts, "shares": shares, "frames": frames}


def compute_figures(reports: list[dict], jobs: list) -> list[dict]:
    """Each rank's measured steps of each job's model (the spec's order), as points of measured.Measured's compute
    curve: tokens, the size of the matrix products (cost.gemm_work), the step's TFLOP (cost.rank_flops), its ms at 1
    TFLOP/s as the model counts it (cost.unit_ms) and its measured ms."""
    out = []
    for report in reports:
        for (source, work, *_), c in zip(jobs, report.get("compute", [])):
            if "error" in c or not c["points"]:
                continue
            info = inspect_model(source)
            points = []
            for p in c["points"]:
                lat = p["latent"]
                one = Workload.from_info(info, lat[-2], lat[-1], batch=1, negative_pass=False,
                                         text_tokens=p["text_tokens"], dtype=work.dtype, fp8_weights=work.fp8_weights,
                                         frames=lat[2] if info.spec.frames and len(lat) == 5 else 1)
                plan = ParallelPlan()
                points.append({"share": p["share"], "tokens": one.image_tokens + one.text_tokens,
                               "gemm_work": cost.gemm_work(plan, one), "tflop": cost.rank_flops(plan, one)[0] / 1e12,
                               "unit_ms": cost.unit_ms(plan, one)[0], "ms": p["step_ms"]})
            out.append({"rank": report["rank"], "key": model_key(work), "model": work.variant, "source": source,
                        "counts": c["counts"], "points": points})
    return out


def compute_errors(reports: list[dict]) -> list[str]:
    return sorted({f"{c['model']}: {c['error']}" for r in reports for c in r.get("compute", []) if "error" in c})


def link_figures(reports: list[dict]) -> dict:
    """Pairs and all-to-alls with their fitted latency and bandwidth."""
    out = {"pairs": [], "all_to_all": []}
    for report in reports:
        for kind in out:
            for entry in report.get(kind, []):
                latency, gbs = fit_link([tuple(p) for p in entry["points"]])
                out[kind].append(dict(entry, latency_us=latency, gbs=gbs))
    return out


def run_calibration(engine, jobs: list[tuple[str, Workload, int, int, int]], *, link: bool = True,
                    link_work: Workload | None = None, repeats: int | None = None, should_cancel=None) -> dict:
    """Run the `calibrate` job on `engine`: memory, the link (when `link` and more than one rank) at the sizes the
    plans of `link_work` (default: the first job's) send, and each job's model ((source, workload, width, height,
    frames)) on every rank. Returns the figures measured.Measured reads (without topology: machine.py adds what it
    reads on the client)."""
    t0 = time.perf_counter()
    world = engine.world
    spec = {"memory": True, "repeats": repeats or (5 if engine.device == "cuda" else 3),
            "compute": [compute_spec(source, work, w, h, f, world) for source, work, w, h, f in jobs]}
    link_work = link_work or (jobs[0][1] if jobs else None)
    if link and world > 1 and link_work is not None:
        spec["link"] = {"sizes": message_sizes(link_work), "groups": group_sizes(world)}
    result = engine.submit("calibrate", spec, should_cancel=should_cancel)   # the ranks stop between its parts
    reports = sorted((r["calibration"] for r in result.ranks), key=lambda r: r["rank"])
    figures = {"device": engine.device, "devices": [r["memory"] for r in reports],
               "compute": compute_figures(reports, jobs)}
    if "link" in spec:
        figures.update(link_figures(reports))
    errors = compute_errors(reports)
    if errors:
        figures["compute_errors"] = errors
    figures["calibrated"] = datetime.datetime.now().isoformat(timespec="seconds")
    figures["calibrate_s"] = time.perf_counter() - t0
    figures["ranks_s"] = max(r["seconds"] for r in reports)
    return figures
