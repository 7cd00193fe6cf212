"""`python -m engine calibrate`: measure the machine the planner plans for (runtime/calibrate.py) and store it
(runtime/machine.py): the topology, each pair's and each group's link at the sizes the plans send, a model's step at
its real widths on every device, and the memory a GPU has free once a CUDA context exists. `generate`, `plan
--measured` and the nodes use what it stored; the engine's first start on GPUs measures the same by itself."""
from __future__ import annotations

import json
import os
import time
from argparse import ArgumentTypeError

from ..families import VARIANTS
from ..generate.request import GenerateRequest, default_dtype
from ..models.load import COMPUTE_DTYPES
from ..runtime.client import Engine
from ..runtime.machine import Machine, default_folder, job_of
from . import args as types
from . import output
from .args import UsageError


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's GPUs (or CPU ranks) and links for the planner",
                       description="Start the engine's ranks on --gpus (or --ranks CPU ranks) and measure: the "
                                   "topology (nvidia-smi topo -m, CUDA peer access), each pair's and each group's all-to-all "
                                   "latency and bandwidth at the sizes the plans send, a model's step at its real "
                                   "widths on every device, and each GPU's memory free once a CUDA context exists. The "
                                   "figures are stored per machine (GPUs, driver, torch) and the planner uses them in "
                                   "place of its model; plans measured by finished jobs are kept until the next "
                                   "calibration.")
    p.add_argument("--gpus", type=types.gpu_list, help="CUDA GPU indices, one rank each (default: CPU ranks)")
    p.add_argument("--ranks", type=types.ranks, help="CPU ranks (without --gpus; default 2)")
    p.add_argument("--pin-cpus", action="store_true", help="CPU ranks each on their own cores (as bench project's "
                                                           "2-rank check runs them): a setup of its own")
    p.add_argument("--model", default="flux-dev", type=_model,
                   help=f"the model whose step is measured: a known variant, by any of its names "
                        f"({', '.join(VARIANTS)}), or a checkpoint (only its header is read: the weights are random, "
                        f"at its widths)")
    p.add_argument("--size", choices=["tiny", "full"],
                   help="a known variant's dims (default: full with --gpus, tiny on CPU ranks)")
    p.add_argument("--width", type=types.pixels, help="image width in pixels (default 1024 with --gpus, 128 on CPU)")
    p.add_argument("--height", type=types.pixels, help="image height in pixels (as --width)")
    p.add_argument("--frames", type=types.positive_int, default=1, help="video frames (Wan: 4k + 1)")
    p.add_argument("--dtype", choices=list(COMPUTE_DTYPES),
                   help="compute dtype (default: bf16 with --gpus, fp32 on CPU ranks)")
    p.add_argument("--folder", type=types.output_dir,
                   help=f"where the machine's file lives (default: {default_folder()}; inside ComfyUI the nodes use "
                        f"ComfyUI's user folder)")
    p.add_argument("--keep-jobs", action="store_true", help="keep the steps finished jobs measured (default: a new "
                                                            "calibration starts them afresh)")
    p.add_argument("--json", action="store_true", help="print the stored figures as JSON")
    p.set_defaults(run=run, parser=p)


def _model(text: str) -> str:
    """A known model by any of its names (its canonical variant), else a checkpoint."""
    from .. import families

    try:
        return families.variant(text)
    except ValueError as e:
        if os.path.lexists(text) or text.startswith("synthetic:"):
            return types.model_source(text)
        try:   # a family of several models: say which to name
            families.resolve(text)
        except ValueError:
            return types.model_source(text)
        raise ArgumentTypeError(str(e)) from None


def run(a) -> int:
    if a.gpus and (a.ranks or a.pin_cpus):
        raise UsageError(f"argument --{'ranks' if a.ranks else 'pin-cpus'}: applies to CPU ranks; with --gpus the "
                         f"ranks are the GPUs listed")
    device = "cuda" if a.gpus else "cpu"
    ranks = len(a.gpus) if a.gpus else (a.ranks or 2)
    size = a.size or ("full" if a.gpus else "tiny")
    source = a.model if a.model not in VARIANTS else f"synthetic:{a.model}" + (":tiny" if size == "tiny" else "")
    side = 1024 if a.gpus else 128
    try:
        request = GenerateRequest.random_conditioning(source, a.width or side, a.height or side, frames=a.frames,
                                                      dtype=a.dtype or default_dtype(device)).validate(1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    machine = Machine(device, ranks, a.gpus, folder=a.folder, pinned=a.pin_cpus)
    output.refuse_inputs("--folder", machine.path, a)   # the file it stores the figures in: never the model
    print(f"calibrating {machine.setup} on {machine.describe()}: {ranks} rank(s), {source} "
          f"{a.width or side}x{a.height or side}, {request.dtype}", flush=True)
    t0 = time.perf_counter()
    try:
        engine = Engine(ranks, device=device, gpus=a.gpus, pin_cpus=a.pin_cpus)
    except ValueError as e:   # e.g. more pinned ranks than cores
        raise UsageError(f"argument --{'pin-cpus' if a.pin_cpus else 'ranks'}: {e}") from None
    with engine:
        t_start = time.perf_counter() - t0
        measured = machine.calibrate(engine, [job_of(request)], keep_jobs=a.keep_jobs)
    if a.json:
        print(json.dumps(measured.figures, indent=1))
    else:
        for line in measured.summary():
            print("  " + line)
        for error in measured.figures.get("compute_errors", []):
            print(f"  compute not measured: {error}")
    print(f"measured in {measured.figures['calibrate_s']:.1f} s (ranks {measured.figures['ranks_s']:.1f} s; engine "
          f"start {t_start:.1f} s); stored in {machine.path} as setup {machine.setup}")
    return 0
