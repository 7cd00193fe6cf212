"""Measured step times per GPU, stored as data in the repository (`calibration.json` beside this file), from which
the planner takes an effective TFLOP/s in place of the rated figure times an efficiency guess.

An entry is one benchmark: on GPU <gpu>, one denoising step of <workload> took <ms_per_step> ms and holds
<tflop_per_step> TFLOP, so the GPU sustains tflop_per_step / ms_per_step * 1000 TFLOP/s on this kind of work.
The file (schema 1):

    {"schema": 1,
     "entries": [{"gpu": "H100 SXM",
                  "workload": {"model": "flux-dev", "width": 1024, "height": 1024, "batch": 1, "dtype": "bf16",
                               "mode": "eager"},
                  "ms_per_step": 240.0, "tflop_per_step": 74.4, "effective_tflops": 310.0,
                  "recorded": "2026-05-01", "note": "transformer loop only, synthetic weights"}]}

`gpu` is the planner's table name when the GPU is in it (devices.GPUS), else the name torch reports. `mode` is
"eager" or "compiled" (torch.compile); the planner uses the entry of the job's mode. Write entries with
`record_calibration`, never by hand.
"""
from __future__ import annotations

import datetime
import json
import math
import os

from .devices import find_gpu

CALIBRATION_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
SCHEMA = 1
MODES = ("eager", "compiled")
WORKLOAD_KEYS = ("model", "width", "height", "dtype", "mode")   # required; others (batch, attention...) are kept


def load_calibration(path: str | None = None) -> list[dict]:
    """The entries of a calibration file (default: the repository's; [] when it does not exist). Raises ValueError
    for a malformed one."""
    path = path or CALIBRATION_PATH
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"calibration file {path} cannot be read: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), list):
        raise ValueError(f"calibration file {path} is not schema {SCHEMA} ({{'schema': 1, 'entries': [...]}}): "
                         f"rewrite it with record_calibration")
    return data["entries"]


def _gpu_key(gpu_name: str) -> str:
    gpu = find_gpu(gpu_name)
    return gpu.name if gpu else gpu_name.strip()


def record_calibration(gpu_name: str, workload: dict, ms_per_step: float, tflop_per_step: float, *,
                       path: str | None = None, note: str = "") -> dict:
    """Add or replace (same GPU, same workload) the entry for one benchmark and write the file; returns the entry.

    gpu_name: as torch.cuda.get_device_name() gives it, or the table's name. workload: at least model, width,
    height, dtype and mode ("eager" | "compiled"); batch and any other keys are kept. ms_per_step: measured time of
    one denoising step (one model call of the whole batch), transformer only. tflop_per_step: that step's work,
    e.g. `cost.step_tflop(Workload.for_variant("flux-dev", 1024, 1024))` (74.4 for FLUX.1-dev at 1024^2).
    path: the file to update (default: the repository's calibration.json). Raises ValueError for a value that
    cannot be right."""
    path = path or CALIBRATION_PATH
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise ValueError(f"gpu_name={gpu_name!r} is invalid: give the GPU's name, e.g. 'NVIDIA H100 80GB HBM3'")
    missing = [k for k in WORKLOAD_KEYS if k not in (workload or {})]
    if missing:
        raise ValueError(f"workload {workload!r} lacks {', '.join(missing)}: give {', '.join(WORKLOAD_KEYS)}")
    if workload["mode"] not in MODES:
        raise ValueError(f"workload mode={workload['mode']!r} is invalid: use one of {', '.join(MODES)}")
    for name, value in (("ms_per_step", ms_per_step), ("tflop_per_step", tflop_per_step)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} is invalid: use a positive number")
    entry = {"gpu": _gpu_key(gpu_name), "workload": dict(workload), "ms_per_step": float(ms_per_step),
             "tflop_per_step": float(tflop_per_step),
             "effective_tflops": round(tflop_per_step / ms_per_step * 1000, 1),
             "recorded": datetime.date.today().isoformat(), "note": note}
    entries = [e for e in load_calibration(path)
               if not (e.get("gpu") == entry["gpu"] and e.get("workload") == entry["workload"])]
    entries.append(entry)
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, "entries": entries}, f, indent=2)
        f.write("\n")
    return entry


def measured(gpu_name: str, mode: str = "eager", path: str | None = None, model: str | None = None) -> dict | None:
    """The latest entry for this GPU in this mode, of this model when there is one (models sustain different
    rates: SD3-medium's narrower blocks run at about 80% of FLUX's TFLOP/s on an H100), or None (then the planner
    uses the rated figure)."""
    key = _gpu_key(gpu_name)
    found = [e for e in load_calibration(path) if e.get("gpu") == key and e.get("workload", {}).get("mode") == mode]
    same = [e for e in found if e["workload"].get("model") == model]
    return (same or found or [None])[-1]
