"""The one place a plan is resolved and validated: `resolve_plan` turns `auto` (or `fastest`) or explicit degrees into
a plan that runs this model and job on this many ranks, or refuses with the numbers and a plan that works. `auto`
ranks the plans that can run by the cost model (cost.py, memory.py) on the ranks' hardware (devices.py), on every
number of ranks up to the engine's: when fewer GPUs are faster the job runs on the first of them and the others idle.
It picks among exact plans (the result equals one GPU's); PipeFusion, whose patches see the previous step's
activations, only when approximate plans are allowed (`fastest`) or no exact plan fits the GPUs' memory. The client
calls it before any rank starts; the ranks only build the mesh it names."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import wording
from ..errors import PlanError
from ..models.synthetic import synthetic_info
from . import cost
from .devices import Hardware, assumed_hardware, host_link_gbs
from .memory import fit_stages, memory_gib
from .plan import (DTYPE_BYTES, FASTEST, MAX_RANKS, PLAN_MODES, RESIDENT, GiB, ParallelPlan, PlanChoice, Workload,
                   feasible, plan_problems)


def _why(plan: ParallelPlan, work: Workload) -> str:
    parts = []
    if plan.cfg == 2:
        parts.append("positive and negative passes on separate ranks")
    if plan.dp > 1:
        parts.append(f"batch of {work.batch} split {plan.dp} ways")
    if plan.ulysses > 1:
        parts.append(f"{tokens_said(work)} split {plan.ulysses} ways, {work.heads} heads exchanged")
    if plan.ring > 1:
        parts.append(f"K/V passed around a ring of {plan.ring}")
    if plan.pipefusion > 1:
        parts.append(f"{work.layers} blocks in {plan.pipefusion} pipelined stages, each GPU holding its own")
    if plan.shard > 1:
        parts.append(f"weights divided {plan.shard} ways, each GPU holding 1/{plan.shard} of every block and "
                     f"gathering a block's whole weights as it runs")
    return "; ".join(parts) if parts else "one rank runs the whole job"


def tokens_said(work: Workload) -> str:
    """The tokens a model call splits, by stream: "4096 image tokens", "75600 video tokens", "14080 video + 121 audio
    tokens"."""
    if not work.video:
        return f"{work.image_tokens} image tokens"
    audio = f" + {work.audio_tokens} {work.extra_kind}" if work.audio_tokens else ""
    return f"{work.image_tokens - work.audio_tokens} video{audio} tokens"


def shrink_advice(work: Workload, imperative: bool = False) -> str:
    """What shrinks the activations, naming the input that drives them: a clip's frames before its size."""
    if not work.video:
        return "use a smaller image, batch or prompt" if imperative else \
            "a smaller image or batch shrinks the activations"
    per_frame = (work.image_tokens - work.audio_tokens) // max(1, work.latent_frames)
    frames = f"{work.latent_frames} latent frames of {per_frame} tokens each"
    return (f"use fewer frames ({frames}), a smaller size or batch" if imperative else
            f"fewer frames shrink the activations most ({frames}), then a smaller size or batch")


def _fmt_estimate(e: cost.Estimate, work: Workload) -> str:
    return (f"est. {e.step_ms:.0f} ms/step, {e.s_per_image:.2f} s/{work.per} (compute {e.compute_ms:.0f}, comm "
            f"{e.comm_ms:.0f}, host {e.host_ms:.0f})")


def pipefusion_refusal(work: Workload) -> str:
    """Why PipeFusion cannot run the job, as a clause (Workload.pipefusion_conflict leads into a remedy)."""
    return work.pipefusion_conflict.rstrip(":").removesuffix(" or").rstrip(":")


def experts_note(e: cost.Estimate, work: Workload, hw: Hardware) -> str:
    """Where a clip's idle expert waits under the estimate's plan, and why: both resident when they fit, else in host
    memory, with the copies' time and the host memory it takes; and that PipeFusion, which would divide each expert's
    blocks between the GPUs, cannot run the model when it cannot. "" for one model."""
    if work.experts < 2:
        return ""
    one = work.weight_bytes / e.plan.shard / GiB   # what a GPU keeps of one expert (its share under a sharded plan)
    share = f" (1/{e.plan.shard} of each)" if e.plan.shard > 1 else ""
    both = memory_gib(e.plan, work, RESIDENT)["total"]
    if e.placement == RESIDENT:
        note = (f"the {work.experts} experts both resident on every GPU{share} ({work.experts} x {one:.1f} GiB, "
                f"{both:.1f} GiB per GPU with the activations): no copies between clips")
    else:
        why = (f"both need {both:.1f} GiB per GPU, more than {hw.memory_gib:.4g}" if hw.memory_gib is not None
               and both > hw.memory_gib else "as asked")
        note = (f"the idle expert in host memory ({why}): each expert copied to the GPU and back once per clip, "
                f"{e.swap_ms / 1e3:.1f} s at {host_link_gbs(hw.gpu):g} GB/s; host memory {e.host_gib:.0f} GiB per "
                f"machine ({e.ranks} rank(s) x {one:.1f} GiB)")
    if work.pipefusion_conflict:
        note += ("; PipeFusion, which would divide each expert's blocks between the GPUs, is refused: "
                 + pipefusion_refusal(work))
    return note


def shard_note(best: cost.Estimate, found: "Survey", work: Workload, hw: Hardware) -> str:
    """Why auto divided the weights: no plan of whole weights fits (with the least they need), or the divided plan
    is faster than the fastest whole one."""
    whole = [e for e in found.estimates if e.ranks == best.ranks and e.plan.shard == 1]
    fitting = [e for e in whole if e.fits]
    gathered = cost.shard_gather_ms(best.plan, work, hw.link, best.compute_ms)[1]
    if not fitting:
        least = min((e.memory["total"] for e in whole), default=float("nan"))
        return (f"the weights are divided {best.plan.shard} ways because no plan with whole weights on every GPU fits "
                f"{hw.memory_gib:.4g} GiB (the least needs {least:.1f} GiB); each GPU holds "
                f"{best.memory['weights']:.1f} GiB of weights, and the gathers add about {gathered:.0f} ms a step")
    fastest = min(fitting, key=lambda e: e.job_ms)
    return (f"the weights are divided {best.plan.shard} ways: faster than {fastest.plan.describe()} with whole weights "
            f"(est. {fastest.step_ms:.0f} ms/step)")


def memory_helps(ranks: int, work: Workload, gib: float) -> list[str]:
    """What would bring `work` on `ranks` GPUs under `gib` per GPU: fp8 weights, an explicit PipeFusion plan (it
    divides the blocks' weights between the GPUs), more GPUs. Empty when none of these would."""
    helps = []
    if work.weight_bytes and not work.fp8_weights:
        per = DTYPE_BYTES[work.dtype]
        light = Workload(**{**asdict(work), "weight_bytes": work.weight_bytes // per,
                            "block_weight_bytes": work.block_weight_bytes // per, "fp8_weights": True})
        if min(memory_gib(p, light)["total"] for p in feasible(ranks, light)) <= gib:
            helps.append(wording.say("fp8 would fit", gib=light.weight_bytes / GiB))
    if ranks > 1:   # the weights divided among the GPUs: the least memory of each plan, all of them sharded
        divided = [p for p in feasible(ranks, work) if p.shard == ranks]
        if divided:
            least = min(divided, key=lambda p: memory_gib(p, work)["total"])
            if memory_gib(least, work)["total"] <= gib:
                helps.append(wording.say("plan would fit", plan=wording.plan(least), detail=f"each GPU holds 1/{ranks} "
                                         f"of the weights, {memory_gib(least, work)['total']:.1f} GiB in all"))
        info = synthetic_info(f"synthetic:{work.variant}")
        for p in range(2, min(ranks, work.layers) + 1):
            plan = ParallelPlan(pipefusion=p, dp=ranks // p) if ranks % p == 0 else None
            if plan is None or plan_problems(plan, work):
                continue
            counts, stage_gib, _ = fit_stages(info, plan, work, gib)
            if counts:
                helps.append(wording.say("plan would fit", plan=wording.plan(plan), detail=f"stages of {counts} "
                                         f"blocks need {', '.join(f'{g:.1f}' for g in stage_gib)} GiB"))
                break
    more = next((n for n in range(ranks + 1, MAX_RANKS + 1)
                 if any(memory_gib(p, work)["total"] <= gib for p in feasible(n, work))), None)
    if more:
        helps.append(wording.say("more gpus would fit", n=more))
    return helps


def _no_fit(ranks: int, work: Workload, hw: Hardware, best: cost.Estimate) -> str:
    """Why no plan fits the GPUs' memory, with the numbers and what would help."""
    m = best.memory
    helps = memory_helps(ranks, work, hw.memory_gib)
    helps.append(shrink_advice(work) if m["activations"] > 1 else
                 "GPUs with more memory")
    pipefusion = (f"PipeFusion, which would divide the blocks, cannot run it ({pipefusion_refusal(work)})"
                  if work.pipefusion_conflict else "no PipeFusion split of the blocks fits either")
    held = (f" (the idle one of its {work.experts} experts in host memory)" if work.experts > 1 and
            best.placement != RESIDENT else "")
    divided = (f"with the weights divided {best.plan.shard} ways the blocks in flight and the root stay whole" if
               best.plan.shard > 1 else "sequence, CFG and data parallel keep a full copy of the weights on every GPU")
    return (f"no parallel plan fits {work.variant}{held} in {hw.memory_gib:.4g} GiB per GPU on {hw.describe()}: the "
            f"least needs {m['total']:.1f} GiB ({wording.plan(best.plan)}: weights {m['weights']:.1f}, activations "
            f"{m['activations']:.1f}, runtime {m['runtime']:.1f}; {divided}, and {pipefusion}); " + "; ".join(helps))


def rank_plans(ranks: int, work: Workload, hardware: Hardware, pipefusion: bool = False) -> list[cost.Estimate]:
    """Every feasible plan for `ranks` GPUs with its estimate, the planner's choice first (cost.rank)."""
    return cost.rank([cost.estimate(p, work, hardware) for p in feasible(ranks, work, pipefusion)])


@dataclass(frozen=True)
class Survey:
    """Every plan auto weighs for an engine of `ranks` GPUs, on every rank count up to it, and its choice."""
    ranks: int
    estimates: list          # cost.Estimate of every feasible plan on 1..ranks GPUs, fewer ranks first
    chosen: cost.Estimate | None   # None: nothing fits the GPUs' memory
    pool: str                # "exact" | "approximate allowed" | "no exact plan fits"
    modelled: cost.Estimate | None = None   # the model's own choice, before measured steps replaced estimates

    def best_on(self, k: int, exact_only: bool = False) -> cost.Estimate | None:
        own = [e for e in self.estimates if e.ranks == k and e.fits and (e.exact or not exact_only)]
        return min(own, key=lambda e: e.job_ms) if own else None


FEWER_RANKS_TIE = 0.02   # rank counts whose best estimates are this close are equal: the fewer GPUs win


def pick(estimates: list[cost.Estimate], approximate: bool = False) -> tuple[cost.Estimate | None, str]:
    """auto's choice among estimates of plans on any rank counts, and which plans it chose among: the exact plans
    that fit ("exact"), all that fit when `approximate` ("approximate allowed"), all that fit when no exact plan does
    ("no exact plan fits"). The rank count: the fastest (fewer GPUs when within FEWER_RANKS_TIE), so never a plan
    slower than fewer GPUs; on it, among the plans within TIE of its fastest and no slower than any fewer GPUs'
    fastest: the exact one, then the one that sends least, then the earliest (simplest). A plan dividing the weights
    is weighed only where the same plan with whole weights does not fit."""
    # a plan that divides the weights only where the same plan with whole weights does not fit: with them whole it
    # computes the same and gathers nothing (a measured step of the whole plan speaks for its divided forms too)
    whole_fits = {e.plan for e in estimates if e.fits and e.plan.shard == 1}
    fitting = [e for e in estimates if e.fits and not (e.plan.shard > 1 and e.plan.without_shard() in whole_fits)]
    pool, label = [e for e in fitting if e.exact], "exact"
    if approximate:
        pool, label = fitting, "approximate allowed"
    elif not pool:
        pool, label = fitting, "no exact plan fits"
    if not pool:
        return None, label
    order = {id(e): i for i, e in enumerate(estimates)}
    fastest = {}
    for e in pool:
        fastest[e.ranks] = min(fastest.get(e.ranks, math.inf), e.job_ms)
    overall = min(fastest.values())
    k = min(n for n, t in fastest.items() if t <= overall * (1 + FEWER_RANKS_TIE))
    cap = min((t for n, t in fastest.items() if n < k), default=math.inf)
    ties = [e for e in pool if e.ranks == k and e.job_ms <= min(fastest[k] * (1 + cost.TIE), cap)]
    return min(ties, key=lambda e: (not e.exact, e.comm_bytes, order[id(e)])), label


def survey(ranks: int, work: Workload, hw: Hardware, approximate: bool = False, *, code: cost.Code | None = None,
           one_gpu_ms: float | None = None, pipefusion: bool | None = None) -> Survey:
    """The cost model on every feasible plan of 1..ranks GPUs, and the one auto picks (`pick`). PipeFusion plans and
    hybrids are estimated when they may be picked (approximate plans allowed, or no exact plan fits) or when
    `pipefusion` asks for them (True) or not (False). code, one_gpu_ms: as cost.estimate takes them (the validation
    against published runs passes xDiT's code and its one-GPU time)."""
    def estimates_of(plans):
        return [cost.estimate(p, work, hw, code=code, one_gpu_ms=one_gpu_ms) for p in plans]
    estimates = estimates_of(p for k in range(1, ranks + 1) for p in feasible(k, work))
    if pipefusion or (pipefusion is None and (approximate or not any(e.fits for e in estimates))):
        estimates += estimates_of(p for k in range(2, ranks + 1) for p in feasible(k, work, pipefusion=True)
                                  if p.pipefusion > 1)
        estimates.sort(key=lambda e: e.ranks)   # stable: each rank count's plans stay in candidates order
    modelled = None
    if hw.measured is not None:   # plans that ran on this workload: their measured steps (parallel/measured.py)
        modelled, estimates = pick(estimates, approximate)[0], hw.measured.observed(estimates, work)
    chosen, label = pick(estimates, approximate)
    return Survey(ranks, estimates, chosen, label, modelled)


def _auto(ranks: int, work: Workload, hw: Hardware, approximate: bool = False) -> PlanChoice:
    measured = hw.measured is not None and hw.measured.covers(work, ranks)
    if hw.device == "cpu" and not measured:  # the ranks share the host's cores: unmeasured, send the least
        plans = feasible(ranks, work)
        if not plans:
            raise PlanError(f"no parallel plan runs this job on {ranks} ranks ({work.variant}: {work.heads} heads, "
                            f"{tokens_said(work)}, batch {work.batch}"
                            f"{', cfg 1.0' if not work.negative_pass else ''}): {wording.say('change ranks or size')}")
        plan = min(plans, key=lambda p: sum(cost.comm_bytes(p, work).values()))
        return PlanChoice(plan, f"auto chose {plan.describe()} for {ranks} rank(s): {_why(plan, work)}")
    found = survey(ranks, work, hw, approximate)
    best = found.chosen
    if best is None:
        raise PlanError(_no_fit(ranks, work, hw, min(found.estimates, key=lambda e: e.memory["total"])))
    k = best.ranks
    where = f"for {ranks} rank(s)" if k == ranks else f"on {k} of {ranks} ranks (the other {ranks - k} idle)"
    reason = f"auto chose {best.plan.describe()} {where}: {_fmt_estimate(best, work)} on {hw.describe()}"
    same = sorted((e for e in found.estimates if e.ranks == k and e.fits and e is not best
                   and (e.exact or found.pool != "exact")), key=lambda e: e.job_ms)
    if same:
        nxt = same[0]
        reason += f"; {nxt.plan.describe()} est. {nxt.step_ms:.0f}"
        if nxt.job_ms < best.job_ms:
            why = ("is exact" if best.exact and not nxt.exact else "sends less" if best.comm_bytes < nxt.comm_bytes
                   else "is the simpler plan")
            reason += f" (within {cost.TIE:.0%}: a tie, and {best.plan.describe()} {why})"
    if k < ranks:
        full = found.best_on(ranks, exact_only=found.pool == "exact")
        faster = "as fast on fewer GPUs" if full and full.job_ms <= best.job_ms * (1 + FEWER_RANKS_TIE) else \
            "fewer GPUs are faster"
        reason += (f"; on all {ranks} the best is {full.plan.describe()} est. {full.step_ms:.0f} ms/step, "
                   f"{full.s_per_image:.2f} s/{work.per}: {faster}" if full else
                   f"; no plan of {ranks} ranks runs this job and fits")
    elif ranks > 1:
        fewer = [found.best_on(n, exact_only=found.pool == "exact") for n in range(1, ranks)]
        fewer = [e for e in fewer if e is not None]
        if fewer:
            near = min(fewer, key=lambda e: e.job_ms)
            reason += f"; {near.ranks} GPU{'s' if near.ranks > 1 else ''} est. {near.s_per_image:.2f} s/{work.per}"
    if best.plan.shard > 1:
        reason += f"; {shard_note(best, found, work, hw)}"
    if work.experts > 1:
        reason += f"; {experts_note(best, work, hw)}"
    if hw.measured is not None:
        reason += f"; {hw.measured.explain(best, found.modelled, work)}"
    if not best.exact:
        warm = min(work.warmup_steps, work.steps)
        reason += (f"; PipeFusion is approximate (after {warm} warmup step(s) its patches see the previous step's "
                   f"activations), chosen because "
                   + ("approximate plans are allowed (plan fastest)" if found.pool == "approximate allowed" else
                      f"no exact plan fits {hw.memory_gib:.4g} GiB per GPU"))
    return PlanChoice(best.plan, reason)


def resolve_plan(requested: ParallelPlan | str, ranks: int, work: Workload, hardware: Hardware | None = None, *,
                 approximate: bool = False) -> PlanChoice:
    """The plan that runs `work` on an engine of `ranks` ranks: `auto` picks the fastest exact plan that fits by the
    cost model (cost.py) on `hardware` (None: assumed, see devices.assumed_hardware), on the first k <= ranks ranks
    when fewer GPUs are faster; `fastest` (or approximate=True) lets it pick PipeFusion too. An explicit plan is only
    checked, never replaced, and needs exactly `ranks` ranks. Raises PlanError naming every problem and a plan that
    works for the same rank count."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise PlanError(f"ranks={ranks!r} is invalid: use 1 to {MAX_RANKS} (one rank per GPU)")
    hw = hardware or assumed_hardware(ranks)
    if isinstance(requested, str):
        if requested not in PLAN_MODES:
            raise PlanError(f"plan={requested!r} is invalid: use 'auto', 'fastest' or explicit degrees")
        return _auto(ranks, work, hw, approximate or requested == FASTEST)
    if not isinstance(requested, ParallelPlan):
        raise PlanError(f"plan={requested!r} is invalid: use 'auto', 'fastest' or a ParallelPlan")
    requested.check_world(ranks)
    problems = plan_problems(requested, work)
    if problems:
        plans = feasible(ranks, work)
        if not plans:
            hint = f"; {wording.say('no plan fits the ranks', ranks=ranks)}"
        elif hw.device == "cpu":
            hint = f"; try {wording.plan(_auto(ranks, work, hw).plan)}"
        else:
            hint = f"; try {wording.plan(rank_plans(ranks, work, hw)[0].plan)}"
        raise PlanError(f"{wording.say('plan subject', plan=wording.plan(requested))} cannot run this job: "
                        + "; ".join(problems) + hint)
    reason = f"explicit plan {requested.describe()} on {ranks} rank(s): {_why(requested, work)}"
    if hw.device != "cpu":
        e = cost.estimate(requested, work, hw)
        reason += f"; {_fmt_estimate(e, work)} on {hw.describe()}"
        if work.experts > 1:
            reason += f"; {experts_note(e, work, hw)}"
    return PlanChoice(requested, reason)
