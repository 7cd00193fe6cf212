"""Where this machine's measurements live and when they are taken: one JSON file per machine (its GPUs, driver and
torch, or its CPU and torch), in ComfyUI's user folder when the pack runs inside ComfyUI (the node layer passes the
folder in: the engine never imports ComfyUI), else in a per-user cache folder ($XDG_CACHE_HOME/comfyui-xdit, default
~/.cache/comfyui-xdit). The file holds a setup's figures (parallel/measured.py) per engine setup: the GPU list
("cuda:0,1") or the CPU rank count ("cpu:2", "cpu:2:pinned").

`Machine` is what the CLI and the nodes use: `hardware()` is the planner's view with the stored figures applied,
`ensure()` calibrates on the engine's first start (GPUs; CPU ranks only once `python -m engine calibrate` measured
them, since their plans are what the tests and the demos check) and measures a model not measured yet, `record_job()`
keeps each generate job's measured step for the plan it ran.

    {"schema": 1, "machine": {"gpus": [...], "driver": "...", "torch": "...", ...},
     "setups": {"cuda:0,1": {figures}, ...}}
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from ..generate.request import GenerateRequest
from ..models.load import inspect_model
from ..parallel import cost
from ..parallel.devices import Hardware, _physical, hardware_for, parse_topo
from ..parallel.measured import SCHEMA, Measured, job_key, model_key
from ..parallel.plan import Workload
from .calibrate import run_calibration

FOLDER_NAME = "comfyui-xdit"
STEPS_KEPT = 3        # a plan's measured step is the median of its last jobs on a workload
SMI_TIMEOUT_S = 5.0


def default_folder() -> str:
    """The per-user cache folder outside ComfyUI."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, FOLDER_NAME)


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=4)   # the machine does not change under a running process; nvidia-smi is slow
def machine_facts(device: str) -> dict:
    """What identifies the machine's measurements: its GPUs (every visible one, by name), the driver and torch; on
    CPU ranks the CPU, the cores this process may use and torch."""
    facts = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cuda"] = torch.version.cuda
        driver = (_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").strip().splitlines()
        facts["driver"] = driver[0] if driver else "unknown"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            facts["visible"] = visible
    else:
        facts["cpu"] = _cpu_name()
        facts["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return facts


def setup_key(device: str, ranks: int, gpus=None, pinned: bool = False) -> str:
    if device == "cuda":
        return "cuda:" + ",".join(str(g) for g in gpus)
    return f"cpu:{ranks}" + (":pinned" if pinned else "")


def _topology(gpus: list[int]) -> dict:
    """Each pair's link as `nvidia-smi topo -m` names it and whether CUDA gives the pair peer access (the client's
    view, as devices.detect_hardware reads it)."""
    topo = parse_topo(_nvidia_smi("topo", "-m") or "")
    physical = _physical(list(gpus))   # nvidia-smi's indices (None: CUDA_VISIBLE_DEVICES names them by UUID)
    pairs = {}
    for a in range(len(gpus)):
        for b in range(a + 1, len(gpus)):
            entry = {"peer": bool(torch.cuda.can_device_access_peer(gpus[a], gpus[b]))}
            if physical is not None and (physical[a], physical[b]) in topo:
                entry["topo"] = topo[(physical[a], physical[b])]
            pairs[f"{a}-{b}"] = entry
    return {"pairs": pairs, "source": "nvidia-smi topo -m" if topo else "CUDA peer access"}


@dataclass(frozen=True)
class MachineView:
    """What the planner knows of a setup for one job, read once before it is planned and read-only after: the stored
    figures (None: nothing measured) and the hardware with them applied. `Machine.view()` makes it; the job's plan,
    its record and the Info node read it; `Machine.ensure` gives a new one when it measured more."""
    setup: str
    measured: Measured | None
    hardware: Hardware


class Machine:
    """One engine setup on this machine and its stored figures: the only reader and writer of the machine's file.
    folder: where the file lives (None: default_folder). Callers take a `view()` per job and pass it down."""

    def __init__(self, device: str, ranks: int, gpus=None, folder: str | None = None, pinned: bool = False):
        self.device, self.ranks = device, ranks
        self.gpus = list(gpus) if gpus is not None else None
        self.folder = folder or default_folder()
        self.pinned = pinned
        self.setup = setup_key(device, ranks, self.gpus, pinned)
        self.facts = machine_facts(device)
        self.label = self.describe()   # the machine in words, as each Measured names it
        self.unsaved = ""          # why the file could not be written, if it could not
        self._data: dict = {}
        self._read_at = None       # the file's (mtime, size) when _data was read from it
        digest = hashlib.sha1(json.dumps(self.facts, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(self.folder, f"machine-{digest}.json")

    # ---- the file
    def _read(self) -> dict:
        """The file's data, read again only when the file changed (another process may measure too)."""
        if self.unsaved:   # the file could not be written: what this process measured is kept in memory
            return self._data
        try:
            st = os.stat(self.path)
            if self._read_at == (st.st_mtime_ns, st.st_size):
                return self._data
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {"schema": SCHEMA, "machine": self.facts, "setups": {}}
        except (OSError, ValueError) as e:   # a damaged file is measured again, never fatal
            return {"schema": SCHEMA, "machine": self.facts, "setups": {}, "replaced": f"{type(e).__name__}: {e}"}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("setups"), dict):
            return {"schema": SCHEMA, "machine": self.facts, "setups": {}}
        self._data, self._read_at = data, (st.st_mtime_ns, st.st_size)
        return data

    def _write(self, data: dict) -> None:
        """Store `data` (readers see the old file or the new one, never half of one). A folder that cannot be written
        is not an error: the figures stay in this process's memory and `unsaved` says why."""
        self._data = data
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".machine-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            os.replace(tmp, self.path)
            self.unsaved = ""
            st = os.stat(self.path)
            self._read_at = (st.st_mtime_ns, st.st_size)
        except OSError as e:
            self.unsaved = f"{self.path} could not be written ({e.strerror or e}): kept in memory only"
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def stored_setups(self) -> dict:
        """Every setup this machine's file holds: {setup: figures}."""
        return self._read()["setups"]

    def figures(self) -> dict | None:
        return self._read()["setups"].get(self.setup)

    def measured(self) -> Measured | None:
        figures = self.figures()
        return Measured(self.setup, figures, self.label) if figures else None

    def describe(self) -> str:
        f = self.facts
        if self.device == "cuda":
            return f"{', '.join(f['gpus'])}; driver {f['driver']}; torch {f['torch']} (CUDA {f['cuda']})"
        return f"{f['cpu']}, {f['cores']} core(s); torch {f['torch']}"

    # ---- the planner's view
    def view(self) -> MachineView:
        """This setup as the planner sees it now: the stored figures and the hardware (detected, or CPU ranks) with
        them applied."""
        base = hardware_for(self.device, self.ranks, self.gpus)
        figures = self._read()["setups"].get(self.setup)
        measured = Measured(self.setup, figures, self.label) if figures else None
        return MachineView(self.setup, measured, measured.apply(base) if measured else base)

    def hardware(self) -> Hardware:
        """The planner's hardware for this setup (view().hardware)."""
        return self.view().hardware

    # ---- measuring
    def calibrate(self, engine, jobs: list, *, link: bool = True, link_work: Workload | None = None,
                  keep_jobs: bool = False, should_cancel=None) -> Measured:
        """Measure this setup on `engine` (its ranks must be this setup's): memory, the link (at the sizes the plans of
        `link_work`, default the first job's, send), and each job's model (source, workload, width, height, frames);
        replaces the stored figures (the jobs' measured steps too, unless keep_jobs)."""
        figures = run_calibration(engine, jobs, link=link, link_work=link_work, should_cancel=should_cancel)
        if self.device == "cuda":
            figures["topology"] = _topology(self.gpus)
        data = self._read()
        old = data["setups"].get(self.setup, {})
        if keep_jobs and old.get("jobs"):
            figures["jobs"] = old["jobs"]
        data["machine"] = self.facts
        data["setups"][self.setup] = figures
        self._write(data)
        return Measured(self.setup, figures, self.label)

    def measure_model(self, engine, jobs: list, should_cancel=None) -> Measured:
        """Add the compute curves of models not measured yet (no link, the rest kept)."""
        figures = run_calibration(engine, jobs, link=False, should_cancel=should_cancel)
        data = self._read()
        setup = data["setups"].setdefault(self.setup, {"device": self.device})
        keys = {c["key"] for c in figures["compute"]}
        setup["compute"] = [c for c in setup.get("compute", []) if c["key"] not in keys] + figures["compute"]
        if figures.get("compute_errors"):
            setup["compute_errors"] = figures["compute_errors"]
        setup.setdefault("devices", figures["devices"])
        self._write(data)
        return Measured(self.setup, setup, self.label)

    def ensure(self, engine, request: GenerateRequest, view: MachineView, should_cancel=None) -> MachineView | None:
        """Before a job on `engine`, planned on `view`: a GPU setup never measured is calibrated (memory, link, the
        job's model); a setup that was measured (on CPU ranks: only by `python -m engine calibrate`) gets the job's
        model measured when it was not. Returns the new view when new figures were stored (the caller plans again),
        else None. should_cancel: the caller's interrupt, honoured between the measurement's parts (JobCancelled;
        nothing is stored)."""
        measured = view.measured
        if measured is None or not measured.calibrated:
            if self.device != "cuda":
                return None
            self.calibrate(engine, [job_of(request)], keep_jobs=True, should_cancel=should_cancel)
            return self.view()
        job = job_of(request)
        work = job[1]
        if work.compiled or any(c.get("key") == model_key(work) for c in measured.figures.get("compute", [])):
            return None
        if any(e.startswith(job[0] + ":") for e in measured.figures.get("compute_errors", [])):
            return None   # measured once and could not be: modelled
        self.measure_model(engine, [job], should_cancel=should_cancel)
        return self.view()

    # ---- what jobs measured
    def record_job(self, request: GenerateRequest, result, view: MachineView | None = None) -> dict | None:
        """Keep a finished generate job's steady step (the slowest rank's, after the first step) for the plan it ran,
        beside the model's estimate for it (on `view`, the one the job was planned on). Jobs with the step cache
        (which skips calls) or of one step are not kept. Returns the stored entry."""
        step_s = result.timings.get("step_s")
        if step_s is None or request.cache_threshold:
            return None
        return self.record_step(request, step_s, view)

    def record_step(self, request: GenerateRequest, step_s: float, view: MachineView | None = None) -> dict:
        """Keep one measured step (a model call of the request's whole batch) of the request's plan on its
        workload: a generate job's steady step, or a model session's round trip as ComfyUI's sampler made it (the
        model's time, as rank 0 measured it)."""
        work = request.workload(inspect_model(request.model))
        hw = (view or self.view()).hardware
        # CPU ranks have an estimate only from measured compute (their modelled figures are a GPU's)
        known = hw.device == "cuda" or (hw.measured is not None and hw.measured.covers(work, request.plan.world_size))
        predicted = cost.estimate(request.plan, work, hw).step_ms if known else None
        data = self._read()
        setup = data["setups"].setdefault(self.setup, {"device": self.device})
        runs = setup.setdefault("jobs", {}).setdefault(job_key(work), {})
        entry = runs.get(request.plan.describe(), {"last_ms": [], "jobs": 0})
        entry["last_ms"] = (entry["last_ms"] + [step_s * 1e3])[-STEPS_KEPT:]
        entry.update(step_ms=statistics.median(entry["last_ms"]), predicted_ms=predicted, jobs=entry["jobs"] + 1)
        runs[request.plan.describe()] = entry
        data["machine"] = self.facts
        self._write(data)
        return entry


def job_of(request: GenerateRequest) -> tuple[str, Workload, int, int, int]:
    """(source, workload, width, height, frames) of a request: what calibration measures of its model."""
    info = inspect_model(request.model)
    work = request.workload(info)
    lat = request.latent_raw
    down = info.latent.downscale
    frames = lat.shape[2] if info.spec.frames and lat.ndim == 5 else 1
    pixel_frames = info.latent.pixel_frames(frames) if info.spec.frames else 1
    return request.model, work, lat.shape[-1] * down, lat.shape[-2] * down, pixel_frames
