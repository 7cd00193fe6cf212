"""`python -m engine plan` answers a user can act on: a card's memory as torch reports it and the headroom a real card
keeps (so auto never calls a plan a fit that would not load), each model's stock workflow job unless flags say
otherwise, a clip priced per clip with its audio counted as audio, a size the latent rounds said, auto's row marked in
a table a terminal shows whole, and flags that conflict or would go unused refused in one line."""
import json
import os
import re

import pytest

from engine.cli import main
from engine.families import FAMILIES
from engine.generate.admission import check_memory
from engine.parallel.devices import stated_hardware
from engine.parallel.memory import ALLOCATOR_HEADROOM_GIB, CUDA_CONTEXT_GIB, memory_gib
from engine.parallel.plan import ParallelPlan, Workload

WORKFLOWS = os.path.join(os.path.dirname(__file__), "..", "workflows", "api")


def plan(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    with capsys.disabled():
        print(captured.out, captured.err)
    return code, captured.out, captured.err


# ---- memory: what a card really gives ------------------------------------------------------------------------------
def test_a_24_gb_card_is_planned_with_the_total_torch_reports_less_the_context_and_allocator_headroom():
    """An RTX 4090's 24 GB are 23.64 GiB as torch reports them on Linux; the rank's CUDA context and the allocator's
    unallocated blocks leave 22.14 GiB to weights, activations and NCCL's buffers."""
    hw = stated_hardware(2, "RTX 4090", "pcie-no-peer")
    parts = memory_gib(ParallelPlan(ulysses=2), Workload.for_variant("flux-dev"))
    usable = hw.memory_gib - parts["runtime"]
    print(f"RTX 4090: {hw.memory_gib} GiB, runtime {parts['runtime']} GiB, {usable:.2f} GiB usable")
    assert hw.memory_gib == 23.64 and parts["runtime"] == CUDA_CONTEXT_GIB + ALLOCATOR_HEADROOM_GIB == 1.5
    assert usable == pytest.approx(22.14)


def test_flux_bf16_on_two_4090s_is_not_called_a_fit_under_sequence_parallel_and_auto_picks_a_plan_that_fits(capsys):
    """The README's word: FLUX.1 in bf16 fits no 24 GB card under a sequence-parallel plan with whole weights (24.0
    GiB); auto divides the weights instead, and what it picks fits."""
    code, out, _ = plan(capsys, "--model", "flux-dev", "--gpus", "2", "--interconnect", "pcie", "--gpu-name",
                        "RTX 4090", "--json")
    data = json.loads(out)
    listed = {e["plan"]: e for e in data["candidates"]}
    assert code == 0 and not listed["ulysses2"]["fits"] and not listed["ring2"]["fits"]
    assert data["chosen"]["fits"] and data["chosen"]["memory_gib"] <= 23.64
    assert data["chosen"]["plan"] not in ("ulysses2", "ring2") and data["chosen"]["exact"]


# ---- each model's stock workflow -------------------------------------------------------------------------------------
def _workflow_job(name: str) -> dict:
    """Steps, cfg, size, frames and shift as the pack's API workflow sets them on its nodes (the first pass's)."""
    with open(os.path.join(WORKFLOWS, f"{name}.api.json")) as f:
        api = json.load(f)
    nodes = [n for _, n in sorted(api.items(), key=lambda kv: int(kv[0]))]

    def size(value, axis):   # a linked size (Wan-Animate 2): Get Image Size of the Resize Image/Mask it measures
        if not isinstance(value, list):
            return value
        return api[api[value[0]]["inputs"]["image"][0]]["inputs"][f"resize_type.{axis}"]
    job = {"cfg": 1.0}   # BasicGuider: no negative pass
    for n in nodes:
        kind, given = n["class_type"], n["inputs"]
        latent = kind not in ("ImageScale", "Flux2Scheduler", "ResizeImageMaskNode") and "width" in given \
            and "height" in given
        if latent and "width" not in job:
            job.update(width=size(given["width"], "width"), height=size(given["height"], "height"),
                       frames=given.get("length", 1))
        if kind in ("XDiTSampler", "XDiTSamplerAdvanced", "BasicScheduler", "Flux2Scheduler") and "steps" not in job:
            job["steps"] = given["steps"]
        if kind == "ManualSigmas" and "steps" not in job:
            job["steps"] = len(given["sigmas"].split(",")) - 1
        if "cfg" in given and not isinstance(given["cfg"], list):
            job["cfg"] = given["cfg"]
        if kind.startswith("ModelSampling") and "shift" in given:
            job["shift"] = given["shift"]
    return job


@pytest.mark.parametrize("variant,stock", [(v, j) for f in FAMILIES for v, j in f.stock_jobs.items()])
def test_each_models_stock_job_is_its_workflows(variant, stock):
    job = _workflow_job(stock.workflow)
    print(variant, stock, job)
    assert (stock.width, stock.height, stock.frames, stock.steps, stock.cfg) == (
        job["width"], job["height"], job["frames"], job["steps"], job["cfg"])
    assert "shift" not in job or stock.shift == job["shift"]


def test_every_variant_has_a_stock_job():
    assert all(set(f.stock_jobs) == set(f.variants) for f in FAMILIES)


def test_wan22_a14b_is_priced_at_its_workflows_20_steps_and_cfg_3_5_and_says_so(capsys):
    base = ["--model", "wan2.2-a14b", "--gpus", "4", "--interconnect", "pcie-no-peer", "--gpu-name", "RTX 4090",
            "--width", "1280", "--height", "720", "--frames", "81"]
    code, out, _ = plan(capsys, *base)
    assert code == 0 and "defaults  20 steps, cfg 3.5 from workflows/wan2.2-t2v-a14b.json" in out
    assert "given: --width 1280, --height 720, --frames 81" in out and "cfg 3.5, 20 steps" in out
    _, stock, _ = plan(capsys, *base, "--json")
    _, said, _ = plan(capsys, *base, "--steps", "20", "--cfg", "3.5", "--json")
    assert json.loads(stock)["chosen"] == json.loads(said)["chosen"]
    assert json.loads(stock)["job"]["steps"] == 20 and json.loads(stock)["job"]["cfg"] == 3.5


def test_a_flag_overrides_the_stock_value(capsys):
    code, out, _ = plan(capsys, "--model", "wan2.2-a14b", "--gpus", "2", "--interconnect", "nvlink", "--steps", "4",
                        "--json")
    job = json.loads(out)["job"]
    assert code == 0 and (job["steps"], job["cfg"], job["width"], job["height"], job["frames"]) == (4, 3.5, 640, 640,
                                                                                                     81)


# ---- units and sizes -------------------------------------------------------------------------------------------------
def test_a_clip_is_priced_per_clip_and_its_audio_counted_as_audio_tokens(capsys):
    code, out, _ = plan(capsys, "--model", "ltx-2.3", "--gpus", "2", "--interconnect", "nvlink")
    assert code == 0 and "s/clip" in out and "s/image" not in out and "image tokens" not in out
    assert "3520 video + 121 audio tokens + 1024 text tokens" in out   # 16 latent frames of 11 x 20, 5 s of audio


def test_a_size_the_latent_rounds_is_said_with_the_size_planned(capsys):
    _, out, _ = plan(capsys, "--model", "ltx-2.3", "--gpus", "2", "--interconnect", "nvlink", "--width", "1280",
                     "--height", "720")
    assert re.search(r"^size      1280x720 is planned as 1280x704 \(.*32 px.*\): 40 x 22 tokens a frame$", out, re.M)
    _, out, _ = plan(capsys, "--model", "wan2.2-ti2v-5b", "--gpus", "2", "--interconnect", "nvlink", "--width",
                     "1280", "--height", "720")
    assert "1280x720 is planned as 1280x736 (padded to whole 2x2 patches" in out
    _, out, _ = plan(capsys, "--model", "flux-dev", "--gpus", "2", "--interconnect", "nvlink")
    assert "\nsize " not in out


def test_a_latent_the_model_pads_is_priced_at_the_tokens_it_runs():
    """TI2V-5B at 1280x720: a 45-row latent, which ComfyUI's model pads to 46 rows of 2x2 patches: 23 token rows."""
    work = Workload.for_variant("wan2.2-ti2v-5b", 1280, 720, frames=81)
    assert (work.token_rows, work.image_tokens) == (23, 21 * 23 * 40)


# ---- tables -------------------------------------------------------------------------------------------------------
def test_the_table_marks_autos_row_and_says_why_it_passed_over_a_faster_one(capsys):
    """Two 4090s over PCIe: PipeFusion is priced fastest, but it is approximate; auto takes the exact plan that fits."""
    _, out, _ = plan(capsys, "--model", "flux-dev", "--gpus", "2", "--interconnect", "pcie", "--gpu-name", "RTX 4090")
    marked = [line for line in out.splitlines() if re.match(r"\* +\d+ ", line)]
    assert len(marked) == 1 and " ring2 x shard2 " in marked[0]
    assert ("* auto's choice, row 2: ring2 x shard2; priced faster but passed over: row 1 pipefusion2 is approximate "
            "(PipeFusion), and auto picks among exact plans") in out


def test_a_tie_says_which_rule_chose(capsys):
    _, out, _ = plan(capsys, "--model", "flux-dev", "--gpus", "2", "--interconnect", "nvlink")
    assert ("* auto's choice, row 3: ulysses2; priced faster but passed over: row 1 pipefusion2 is approximate "
            "(PipeFusion), and auto picks among exact plans (--plan fastest allows it); row 2 ring2 is within 10%: a "
            "tie, and ulysses2 is the simpler plan") in out


def test_the_terminal_table_stays_within_120_characters(capsys):
    _, out, _ = plan(capsys, "--model", "wan2.2-a14b", "--gpus", "8", "--interconnect", "pcie-no-peer", "--gpu-name",
                     "RTX 4090")
    table = out[out.index("\n\n") + 2:out.index("* auto's choice")].splitlines()
    assert len(table) > 3 and max(map(len, table)) <= 120 and "|" not in "".join(table)


def test_the_fit_tables_print_for_a_terminal_by_default_and_as_the_readme_has_them_with_markdown(capsys):
    _, out, _ = plan(capsys, "--shard-table")
    assert "|" not in out and max(map(len, out.splitlines())) <= 125
    assert "\n2x24 GB: 2x RTX 4090, 23.64 GiB each as torch reports it, PCIe (no peer access)\n" in out
    _, out, _ = plan(capsys, "--shard-table", "--markdown")
    assert "| model | weights | size | 2x16 GB | 2x24 GB | 4x24 GB | 8x24 GB | 2x48 GB |" in out


def test_the_av_table_names_its_models(capsys):
    for form in ([], ["--markdown"]):
        _, out, _ = plan(capsys, "--av-table", *form)
        assert "MiniMax-H3 (--model minimax-h3):" in out and "LTX-2.3/2.5 (--model ltx-2.3):" in out
        assert "LTX-2.3/2.5 (--model ltx-2.5):" in out


# ---- flags ------------------------------------------------------------------------------------------------------
JOB = ["--model", "flux-dev", "--gpus", "2", "--interconnect", "nvlink"]


@pytest.mark.parametrize("argv,expected", [
    (JOB + ["--fp8", "--quant", "Q4_K"], r"argument --fp8: not with --quant Q4_K: .*give one"),
    (JOB + ["--placement", "host"], r"argument --placement: host places the idle one of a clip's experts, and "
                                    r"flux-dev runs one: leave --placement out, or give --experts 2"),
    (["--memory-table", "--model", "flux-dev"], r"argument --memory-table: it prints a fixed table and takes no "
                                                r"other flag but --markdown: leave out --model"),
    (["--memory-table", "--fit-table"], r"--memory-table, --fit-table: one table at a time"),
    (["--validate", "--gpus", "2"], r"argument --validate: .* leave out --gpus"),
    (JOB + ["--json", "--markdown"], r"argument --markdown: not with --json"),
    (JOB + ["--folder", "/tmp"], r"argument --folder: it says where --measured reads .*give --measured too"),
    (["--measured", "cpu:2", "--model", "flux-dev", "--gpus", "2"], r"argument --measured: it replaces --gpus"),
])
def test_conflicting_or_unused_flags_are_refused_in_one_line(capsys, argv, expected):
    code, _, err = plan(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("python -m engine plan: error: "), err
    assert re.search(expected, err), err


# ---- a clip too large for the memory ---------------------------------------------------------------------------
def test_a_clips_memory_refusal_names_its_frames(capsys):
    code, _, err = plan(capsys, "--model", "wan2.1-14b", "--gpus", "2", "--interconnect", "nvlink", "--frames",
                        "1000001")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("python -m engine plan: error: argument --frames: 1000001 frames at 832x480: no parallel "
                          "plan fits wan2.1-14b")
    assert "fewer frames shrink the activations most (250001 latent frames of 1560 tokens each)" in err


def test_a_generate_jobs_memory_refusal_names_the_frames_of_a_clip():
    work = Workload.for_variant("wan2.1-1.3b", 832, 480, frames=40001)
    with pytest.raises(ValueError, match=r"use fewer frames \(10001 latent frames of 1560 tokens each\), a smaller "
                                         r"size or batch$") as refused:
        check_memory("auto", 0.0, work, 1, stated_hardware(1, "RTX 4090", "pcie"), "104x60x10001")
    print(refused.value)


# ---- a compute dtype ComfyUI never runs the model in ------------------------------------------------------------
@pytest.mark.parametrize("model,cite", [("ltx-2.3", "comfy/supported_models.py:927"),
                                        ("minimax-h3", "comfy/supported_models.py:975"),
                                        ("qwen-image", "comfy/supported_models.py:2000")])
def test_fp16_is_refused_in_one_line_for_the_families_comfyui_never_runs_in_it(capsys, model, cite):
    code, _, err = plan(capsys, "--model", model, "--gpus", "2", "--interconnect", "nvlink", "--dtype", "fp16")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"python -m engine plan: error: argument --dtype: dtype fp16: ComfyUI never runs {model} "
                          f"in fp16 (its dtypes are fp32 and bf16, {cite}"), err
    # the request's own validation (both routes: generate and the engine's MODEL) refuses it before any rank starts
    from engine.generate.request import GenerateRequest
    request = GenerateRequest.random_conditioning(f"synthetic:{model}:tiny", 64, 64, dtype="fp16",
                                                  frames=9 if model != "qwen-image" else 1)
    with pytest.raises(ValueError, match=r"^dtype fp16: ComfyUI never runs .* use bf16 on GPUs or fp32$"):
        request.validate(1)
    request = GenerateRequest.random_conditioning(f"synthetic:{model}:tiny", 64, 64, dtype="bf16",
                                                  frames=9 if model != "qwen-image" else 1)
    assert request.validate(1).dtype == "bf16"


@pytest.mark.parametrize("model", ["wan2.1-1.3b", "flux-dev", "krea-2"])
def test_fp16_stays_open_where_comfyui_runs_the_model_in_it(capsys, model):
    code, out, err = plan(capsys, "--model", model, "--gpus", "2", "--interconnect", "nvlink", "--dtype", "fp16")
    assert code == 0 and "auto chose" in out, (out, err)
