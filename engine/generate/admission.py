"""Memory admission for a generate job, from the planner's cost model: refuse a job too large for the machine before
anything is allocated, fit PipeFusion's stages to the GPUs, and after an out-of-memory failure say which plans and
settings would need less."""
from __future__ import annotations

import os

from .. import wording
from ..errors import PlanError
from ..parallel.devices import Hardware, assumed_hardware
from ..parallel.memory import fit_stages, memory_gib
from ..parallel.plan import MAX_RANKS, GiB, ParallelPlan, PlanChoice, Workload, feasible
from ..parallel.planner import memory_helps, shrink_advice


def host_memory_gib() -> float | None:
    """The host's RAM in GiB (MemTotal of /proc/meminfo, else sysconf), None when neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(plan, inputs_gib: float, work: Workload, ranks, hardware: Hardware | None, size_px: str) -> None:
    """Refuse a job too large for the machine from the cost model's estimate (memory.memory_gib), before anything is
    allocated. CPU ranks share the host's RAM: weights and activations of every rank must fit it. A GPU must hold at
    least the activations of the best plan (weights that do not fit are the planner's to explain, with fp8 and
    PipeFusion advice). `plan`: the request's (explicit, or "auto"); `inputs_gib`: what every rank receives."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        return   # resolve_plan names a bad rank count
    plans = [plan] if isinstance(plan, ParallelPlan) and plan.world_size == ranks else feasible(ranks, work)
    if not plans:
        return   # resolve_plan says why no plan runs it
    cpu = hardware is not None and hardware.device == "cpu"
    if cpu:
        have = host_memory_gib()
        if have is None:
            return
        parts = min((memory_gib(p, work) for p in plans), key=lambda m: m["weights"] + m["activations"])
        need = (parts["weights"] + parts["activations"] + inputs_gib) * ranks
        where = f"this machine has {have:.0f} GiB of RAM for {ranks} CPU rank(s)"
    else:
        hw = hardware or assumed_hardware(ranks)
        have = hw.memory_gib
        if have is None:
            return
        parts = min((memory_gib(p, work) for p in plans), key=lambda m: m["activations"])
        need = parts["activations"] + inputs_gib
        where = f"the GPUs have {have:.4g} GiB each"
    if need <= have:
        return
    if parts["weights"] * (ranks if cpu else 1) >= have / 2:   # the model itself is the most of it
        help = f"the weights alone need {parts['weights'] * (ranks if cpu else 1):,.1f} GiB: " \
               f"{wording.say('lighter weights')}"
    else:
        help = shrink_advice(work, imperative=True)
    raise ValueError(f"{work.variant} with latent {size_px}, batch {work.batch}, {work.text_tokens} text tokens needs "
                     f"about {need:,.0f} GiB {'in all' if cpu else 'per GPU'} (per rank: activations "
                     f"{parts['activations']:,.1f} GiB, inputs {inputs_gib:,.1f} GiB, weights "
                     f"{parts['weights']:,.1f} GiB); {where}: {help}")


def fitted_stages(info, choice: PlanChoice, work: Workload, hardware: Hardware) -> tuple[PlanChoice, list | None]:
    """PipeFusion on GPUs: each stage's weights, K/V buffers and activations must fit a GPU. The stages are balanced
    by compute; when that split does not fit, the most balanced split that fits is returned (for the ranks, as
    stage_blocks; None: the balanced one); when none fits, the job is refused with the numbers."""
    plan = choice.plan
    counts, gib, balanced = fit_stages(info, plan, work, hardware.memory_gib)
    per_stage = ", ".join(f"{g:.1f}" for g in gib)
    if counts is None:
        raise PlanError(f"{wording.say('plan subject', plan=wording.plan(plan))} does not fit {work.variant} in "
                        f"{hardware.memory_gib:.4g} GiB per GPU: its stages need {per_stage} GiB (weights, K/V "
                        f"buffers, activations) however the blocks are split; {wording.say('stages do not fit')}")
    if balanced:
        return PlanChoice(plan, f"{choice.reason}; stages of {counts} blocks need {per_stage} GiB"), None
    return PlanChoice(plan, f"{choice.reason}; stages of {counts} blocks (the compute-balanced split does not fit "
                            f"{hardware.memory_gib:.4g} GiB) need {per_stage} GiB"), list(counts)


def memory_advice(plan: ParallelPlan, work: Workload, ranks: int, memory: dict | None, smaller=None) -> str:
    """After an out-of-memory failure under `plan`: the planner's estimate, the plans of `ranks` GPUs it expects to
    need less, and what else would (fp8 weights, PipeFusion, more GPUs), measured against the device's size when the
    rank reported it, else against the estimate that proved too small; and a smaller image: `smaller(part)` names the
    largest of the job's shape whose activations are at most `part` of the job's, with its estimate."""
    estimate = memory_gib(plan, work)
    failed = estimate["total"]
    total = (memory or {}).get("device_total_gib")
    budget = total or failed
    lighter = sorted((memory_gib(p, work)["total"], wording.plan(p)) for p in feasible(ranks, work) if p != plan)
    lighter = [(g, name) for g, name in lighter if g < min(failed, budget)]
    advice = [f"the planner estimated {failed:.1f} GiB per rank for {wording.plan(plan)} (weights "
              f"{estimate['weights']:.1f}, activations {estimate['activations']:.1f}, runtime "
              f"{estimate['runtime']:.1f})" + (f" on a {total:.0f} GiB device" if total else "")]
    if lighter:
        advice.append("plans that need less: " + ", ".join(f"{name} (est. {g:.1f} GiB)" for g, name in lighter[:3]))
    advice += memory_helps(ranks, work, budget * (1 if total else 0.99))
    image = smaller(0.5) if smaller is not None and estimate["activations"] >= 0.05 else None
    advice.append(shrink_advice(work) + (f" ({image[0]} halves them: est. {image[1]['total']:.1f} GiB per rank under "
                                         f"{wording.plan(plan)})" if image else ""))
    return "; ".join(advice)
