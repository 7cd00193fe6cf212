"""What `python -m engine plan` prices: the flags checked against each other (a flag that conflicts with another or
would go unused is refused in one line), the job the model's stock workflow runs filled in where the flags leave it
(Family.stock_jobs), and the size as the model's latent and patches round it."""
from __future__ import annotations

from argparse import Namespace

from ..families.base import StockJob
from .args import UsageError

TABLES = ("validate", "memory_table", "fit_table", "shard_table", "av_table")   # fixed tables: no job flags
JOB = ("width", "height", "frames", "steps", "cfg")   # flags whose default is the stock workflow's
HARDWARE = ("gpus", "interconnect", "gpu_name", "gpu_memory_gb")   # what --measured replaces


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given(a: Namespace) -> list[str]:
    """The flags the command line set to something other than their default, as dests, in the parser's order."""
    return [dest for dest, value in vars(a).items()
            if dest not in ("run", "parser", "command") and value != a.parser.get_default(dest)]


def check_flags(a: Namespace) -> None:
    """Refuse flags that conflict or that the command would not use, naming them and what works."""
    said = given(a)
    tables = [d for d in said if d in TABLES]
    if len(tables) > 1:
        raise UsageError(f"{', '.join(map(flag, tables))}: one table at a time: give one of them")
    if tables:
        table = tables[0]
        extra = [d for d in said if d not in tables and not (d == "markdown" and table != "validate")]
        if extra:
            takes = "" if table == "validate" else " but --markdown"
            raise UsageError(f"argument {flag(table)}: it prints a fixed table and takes no other flag{takes}: leave "
                             f"out {', '.join(map(flag, extra))} (or leave out {flag(table)} to plan a job with them)")
        return
    if a.fp8 and a.quant:
        raise UsageError(f"argument --fp8: not with --quant {a.quant}: the weights are priced one way, --fp8 (a byte a "
                         f"weight) or --quant (the GGUF block type's bytes): give one")
    if a.json and a.markdown:
        raise UsageError("argument --markdown: not with --json: --json prints data, --markdown the tables as the "
                         "README has them: give one")
    if a.measured:
        clash = [d for d in said if d in HARDWARE]
        if clash:
            raise UsageError(f"argument --measured: it replaces {', '.join(map(flag, clash))} with what was measured "
                             f"on this machine: leave {'them' if len(clash) > 1 else 'it'} out")
    elif a.folder is not None:
        raise UsageError("argument --folder: it says where --measured reads the machine's measurements: give "
                         "--measured too, or leave --folder out")


def stock_job(info) -> StockJob:
    """The job the model's stock workflow runs (its family's table), else its family's usual cfg at 1024x1024."""
    job = info.spec.stock_jobs.get(info.variant)
    return job or StockJob("", 1024, 1024, 28, info.spec.cfg, note=f"no workflow for {info.variant}")


def fill_job(a: Namespace, info) -> str:
    """Set the job flags the command line left out to the stock workflow's values; returns the line that says which
    values came from where ("" when the flags gave every one)."""
    job = stock_job(info)
    video = info.spec.frames
    taken = [d for d in JOB if getattr(a, d) is None]
    for d in taken:
        setattr(a, d, getattr(job, d) if d != "frames" or video else 1)
    shown = [d for d in taken if d != "frames" or video]
    if not shown:
        return ""
    words = {"width": f"width {a.width}", "height": f"height {a.height}", "frames": f"{a.frames} frames",
             "steps": f"{a.steps} steps", "cfg": f"cfg {a.cfg:g}"}
    if "width" in shown and "height" in shown:
        words["width"] = f"{a.width}x{a.height}"
    source = f"workflows/{job.workflow}.json (ComfyUI's template)" if job.workflow else "the family's usual values"
    extras = ([f"shift {job.shift:g}, on which the estimate does not depend"] if job.shift is not None else []) + \
        ([job.note] if job.note else [])
    said = [f"{flag(d)} {getattr(a, d):g}" for d in JOB if d not in taken and (d != "frames" or video)]
    return (f"defaults  {', '.join(words[d] for d in shown if d != 'height' or 'width' not in shown)} from {source}"
            + (f" ({'; '.join(extras)})" if extras else "") + f"; {', '.join(map(flag, shown))} to change"
            + (f"; given: {', '.join(said)}" if said else ""))


def check_experts(a: Namespace, experts: int, variant: str) -> None:
    """--placement says where a clip's idle expert waits: a job of one expert has none."""
    if a.placement != "auto" and experts < 2:
        raise UsageError(f"argument --placement: {a.placement} places the idle one of a clip's experts, and "
                         f"{variant} runs one: leave --placement out, or give --experts 2 to price two")


def size_note(info, width: int, height: int, token_rows: int, token_cols: int) -> str:
    """"" when the model runs the size asked; else the line that says the size it is planned at and why (its latent
    floors the pixels, the model pads the latent to whole patches)."""
    fmt, patch = info.latent, info.latent_patch
    down = fmt.downscale
    run_w, run_h = token_cols * patch * down, token_rows * patch * down
    if (run_w, run_h) == (width, height):
        return ""
    why = []
    latent_w, latent_h = width // down, height // down
    if (latent_w * down, latent_h * down) != (width, height):
        why.append(f"its latent has a pixel per {down} px a side, {latent_w} x {latent_h}, as ComfyUI's empty-latent "
                   f"node floors it")
    if (token_cols * patch, token_rows * patch) != (latent_w, latent_h):
        why.append(f"padded to whole {patch}x{patch} patches as ComfyUI's model pads it")
    return (f"size      {width}x{height} is planned as {run_w}x{run_h} ({'; '.join(why)}): {token_cols} x "
            f"{token_rows} tokens a frame")
