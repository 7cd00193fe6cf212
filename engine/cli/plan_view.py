"""How `python -m engine plan` shows its answer: the header (model, job, hardware, link, code), the ranked plans as
aligned columns with auto's choice marked and, where auto passed over rows its table prices faster, why (`--markdown`:
the README's markdown), the experts' placements, and the fixed tables (`--fit-table` ...) in sections a terminal
shows whole or as the README's markdown."""
from __future__ import annotations

import textwrap
from dataclasses import replace

from ..parallel import cost, fits
from ..parallel.devices import GPUS, LINK_NAMES, PCIE_A2A_CONTENTION, host_link_gbs
from ..parallel.plan import HOST, RESIDENT, GiB, Workload
from ..parallel.planner import FEWER_RANKS_TIE, pipefusion_refusal, tokens_said
from . import describe
from .tables import TERMINAL_WIDTH, aligned, sections

PLACED = {RESIDENT: "all resident", HOST: "idle in host memory"}
SHORT_PLACED = {RESIDENT: "resident", HOST: "host"}   # the terminal table's: the idle expert in host memory


def header(info, work: Workload, hw, a) -> list[str]:
    tflops, source = cost.throughput_tflops(hw, work)
    weights = f"GGUF {a.quant}" if a.quant else "fp8" if a.fp8 else info.format if info.stored_fp8 else work.dtype
    cfg = f"cfg {a.cfg:g}" + ("" if work.negative_pass else " (no negative pass)")
    frames = f", {a.frames} frames ({work.latent_frames} latent)" if work.video else ""
    link = hw.link
    lines = [f"model     {describe.summary(info)}",
             f"job       {a.width}x{a.height}{frames}, batch {a.batch}, {cfg}, {work.steps} steps"
             f"{', compiled' if work.compiled else ', eager'}, {tokens_said(work)} + {work.text_tokens} text "
             f"tokens, {work.dtype} compute, {weights} weights ({work.weight_bytes / GiB:.1f} GiB): "
             f"{cost.step_tflop(work):.1f} TFLOP per step",
             (f"hardware  {hw.gpus}x {hw.gpu_name}, {hw.memory_gib:.4g} GiB each "
              f"{'free once a CUDA context exists (measured)' if hw.measured else 'as torch reports it'}, "
              f"{tflops:.0f} TFLOP/s effective on one GPU ({source})" if hw.device == "cuda" else
              f"hardware  {hw.describe()}, {tflops * 1e3:.3g} GFLOP/s on one rank ({source})")]
    if hw.gpus > 1:
        contention = PCIE_A2A_CONTENTION if link.contention is None else link.contention
        lines.append(f"link      {link.describe()}: {link.bandwidth_gbs:.4g} GB/s per GPU, {link.latency_us:.4g} us per "
                     f"call" + (f"; an all-to-all of n GPUs gets 1 / (1 + {contention:.2f} x (n - 2)) of that (flows "
                                f"through the CPU)" if link.tree else ""))
    code = cost.engine_code()
    lines.append(f"code      {code.name}: ring overlap {code.ring_overlap:g}, PipeFusion overlap "
                 f"{code.pipefusion_overlap:g}, {code.ulysses_calls_per_layer} all-to-alls per attention layer; launches "
                 f"{cost.launches.ops_per_block(work.variant):.0f} a block, + {code.ulysses_ops} a Ulysses layer, "
                 f"+ {code.ring_layer_ops} a ring layer and {code.ring_hop_ops} a hop, {cost.LAUNCH_US:.1f} us each"
                 + (f", {cost.COMPILED_LAUNCH_SHARE:.0%} of the blocks' compiled" if work.compiled else ""))
    if hw.measured is not None:
        lines.append(f"measured  {', '.join(hw.measured.sources(work))}: {'; '.join(hw.measured.summary())}")
    else:
        lines.append("figures   modelled (stated hardware; --measured uses what was measured on this machine)")
    return lines


def entry(e: cost.Estimate, work: Workload) -> dict:
    """One plan's estimate as `--json` gives it (with several experts: where the idle one waits, its copies' seconds
    per clip and the host memory per machine); s_per_image is seconds per `per` (a clip for a video model)."""
    out = {"plan": e.plan.describe(), "gpus": e.ranks, "s_per_image": round(e.s_per_image, 4), "per": work.per,
           "ms_per_step": round(e.step_ms, 3), "compute_ms": round(e.compute_ms, 3), "comm_ms": round(e.comm_ms, 3),
           "host_ms": round(e.host_ms, 3), "comm_gb_per_step": round(e.comm_bytes / 1e9, 4),
           "memory_gib": round(e.memory["total"], 3), "fits": e.fits, "exact": e.exact}
    if e.placement:
        out.update(placement=e.placement, swap_s=round(e.swap_ms / 1e3, 3), host_gib=round(e.host_gib, 3))
    return out


def table(ranked: list[cost.Estimate], work: Workload, chosen: cost.Estimate | None = None,
          markdown: bool = False) -> list[str]:
    """The ranked plans: aligned columns with auto's choice marked "*" (markdown: the README's columns, unmarked)."""
    experts = any(e.placement for e in ranked)
    if markdown:
        rows = [("#", "plan", "GPUs", f"s/{work.per}", "ms/step", "compute ms", "comm ms", "host ms",
                 "comm GB/step per GPU", "memory GiB per GPU") + (("experts",) if experts else ()) + ("fits", "exact")]
        for i, e in enumerate(ranked, 1):
            rows.append((str(i), e.plan.describe(), str(e.ranks), f"{e.s_per_image:.2f}", f"{e.step_ms:.1f}",
                         f"{e.compute_ms:.1f}", f"{e.comm_ms:.1f}", f"{e.host_ms:.1f}", f"{e.comm_bytes / 1e9:.3f}",
                         f"{e.memory['total']:.1f}") + ((PLACED[e.placement],) if experts else ())
                        + ("yes" if e.fits else "no", "yes" if e.exact else "no"))
        return ["| " + " | ".join(r) + " |" for r in rows[:1]] + ["|" + "---|" * len(rows[0])] + \
            ["| " + " | ".join(r) + " |" for r in rows[1:]]
    head = ("", "#", "plan", "GPUs", f"s/{work.per}", "ms/step", "compute", "comm", "host", "GB/step", "GiB/GPU") + \
        (("experts",) if experts else ()) + ("fits", "exact")
    rows = [("*" if e is chosen else "", str(i), e.plan.describe() + " ", str(e.ranks), f"{e.s_per_image:.2f}",
             f"{e.step_ms:.1f}", f"{e.compute_ms:.1f}", f"{e.comm_ms:.1f}", f"{e.host_ms:.1f}",
             f"{e.comm_bytes / 1e9:.3f}", f"{e.memory['total']:.1f}")
            + ((SHORT_PLACED[e.placement],) if experts else ())
            + ("yes" if e.fits else "NO", "yes" if e.exact else "no") for i, e in enumerate(ranked, 1)]
    lines = aligned(head, rows, right=(1,) + tuple(range(3, 11)), gap=1)
    return lines[:1] + ["-" * max(map(len, lines))] + lines[1:]


def passed_over(e: cost.Estimate, chosen: cost.Estimate, found, approximate: bool) -> tuple[str, str]:
    """Why auto did not choose `e`, a plan its table prices faster than its choice: (verb for one row, for several,
    the rest of the clause)."""
    if not e.fits:
        return "does", "do", "not fit"
    if not e.exact and chosen.exact and not approximate:
        return "is", "are", "approximate (PipeFusion), and auto picks among exact plans (--plan fastest allows it)"
    if e.plan.shard > 1 and any(x.fits and x.plan == e.plan.without_shard() for x in found.estimates):
        return "divides", "divide", "the weights, where the same plan with whole weights fits"
    if e.ranks > chosen.ranks:
        return "runs", "run", (f"on {e.ranks} GPUs, within {FEWER_RANKS_TIE:.0%} of the fastest on {chosen.ranks}: "
                               f"fewer GPUs win")
    why = ("is exact" if chosen.exact and not e.exact else "sends less" if chosen.comm_bytes < e.comm_bytes
           else "is the simpler plan")
    return "is", "are", f"within {cost.TIE:.0%}: a tie, and {chosen.plan.describe()} {why}"


def choice_note(ranked: list[cost.Estimate], chosen: cost.Estimate, found, approximate: bool) -> str:
    """The line under the table: which row auto chose, and why the rows above it were passed over (rows passed over
    for one reason named together)."""
    row = next(i for i, e in enumerate(ranked, 1) if e is chosen)
    groups: dict[tuple, list[str]] = {}
    for i, e in enumerate(ranked[:row - 1], 1):
        if e.fits and e.job_ms < chosen.job_ms:
            groups.setdefault(passed_over(e, chosen, found, approximate), []).append(f"row {i} {e.plan.describe()}")
    note = f"* auto's choice, row {row}: {chosen.plan.describe()}"
    if groups:
        note += "; priced faster but passed over: " + "; ".join(
            f"{', '.join(rows)} {one if len(rows) == 1 else many} {rest}" for (one, many, rest), rows in groups.items())
    return note


def experts_lines(work: Workload, hw, e: cost.Estimate) -> list[str]:
    """Each placement of a clip's experts under the chosen plan, priced in memory and time."""
    plan = e.plan
    lines = [f"experts   {work.experts} per clip, one after the other, {work.weight_bytes / GiB:.1f} GiB each; "
             f"under {plan.describe()}:"]
    for placement in (RESIDENT, HOST):
        one = cost.estimate(plan, replace(work, placement=placement), hw)
        fits = "fits" if one.fits else f"does not fit {hw.memory_gib:.4g} GiB"
        extra = (f"; + {one.swap_ms / 1e3:.1f} s a clip copying each expert to the GPU and back "
                 f"({host_link_gbs(hw.gpu):g} GB/s), host memory {one.host_gib:.0f} GiB per machine"
                 if placement == HOST else "; no copies between clips")
        lines.append(f"  {PLACED[placement]}: {one.memory['total']:.1f} GiB per GPU ({fits}), est. "
                     f"{one.s_per_image:.2f} s a clip{extra}")
    if work.pipefusion_conflict:
        lines.append(f"  PipeFusion stages (a share of each expert's blocks per GPU): refused, "
                     f"{pipefusion_refusal(work)}")
    return lines


def av_title(variant: str) -> str:
    """The model an audio-video table is for, as `--model` names it."""
    from ..families import by_variant
    return f"{by_variant(variant).title} (--model {variant}):"


def fixed_table(a) -> list[str]:
    """The table a table flag asks for: as the README has it (--markdown), else one aligned section per machine."""
    def show(head_rows, keys, machines, pivot=None):
        titles = [f"{m.label}: {m.gpus}x {m.gpu}, {GPUS[m.gpu].memory_gib:.4g} GiB each as torch reports it, "
                  f"{LINK_NAMES[m.link]}" for m in machines]
        return fits.markdown(*head_rows) if a.markdown else sections(*head_rows, keys=keys, pivot=pivot, titles=titles)

    def prose(lines):
        return lines if a.markdown else [w for line in lines for w in (textwrap.wrap(line, TERMINAL_WIDTH) or [""])]
    if a.fit_table:
        return prose(fits.header()) + show(fits.fit_rows(), 3, fits.MACHINES)
    if a.memory_table:
        rows = fits.memory_rows()
        return fits.markdown(*rows) if a.markdown else aligned(*rows)
    if a.shard_table:
        return prose(fits.shard_header()) + show(fits.shard_rows(), 3, fits.SHARD_MACHINES)
    return (prose([av_title("minimax-h3")] + fits.av_header())
            + show(fits.av_rows(), 3, fits.AV_MACHINES, pivot=2) + [""]
            + prose([av_title("ltx-2.3")] + fits.ltx_header())
            + show(fits.av_rows("ltx-2.3"), 3, fits.AV_MACHINES, pivot=2) + [""]
            + prose([av_title("ltx-2.5")] + fits.ltx25_header())
            + show(fits.av_rows("ltx-2.5"), 3, fits.AV_MACHINES, pivot=2))
