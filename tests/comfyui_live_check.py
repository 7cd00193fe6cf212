"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): load this pack through ComfyUI's own
custom-node loader and drive its V3 nodes with ComfyUI's folder paths, progress hook and interrupt. Prints one
JSON report. Usage: python comfyui_live_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import json
import os
import sys

comfyui, pack_parent, models = sys.argv[1:4]
sys.argv = ["main.py", "--cpu"]
from released_prompts import RELEASED, TEXT_ENCODERS, VAE, release_prompt  # noqa: E402 (tests/, this file's folder)
sys.path.insert(0, comfyui)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.model_management as mm  # noqa: E402
import comfy.utils  # noqa: E402
import execution  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

for folder in ("diffusion_models", "loras", "text_encoders", "vae"):
    folder_paths.add_model_folder_path(folder, os.path.join(models, folder))
folder_paths.add_model_folder_path("custom_nodes", pack_parent)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
import comfyui_version  # noqa: E402
report = {"comfyui": comfyui_version.__version__,
          "registered": {n: nodes.NODE_DISPLAY_NAME_MAPPINGS.get(n) for n in nodes.NODE_CLASS_MAPPINGS
                         if n.startswith("XDiT")}}
E, L, S, I = (nodes.NODE_CLASS_MAPPINGS[n] for n in ("XDiTEngine", "XDiTLoRA", "XDiTSampler", "XDiTEngineInfo"))
report["sampler_inputs"] = list(S.INPUT_TYPES()["required"])
report["engine_inputs"] = {kind: list(E.INPUT_TYPES().get(kind, {})) for kind in ("required", "optional")}
# what the frontend folds under "Show advanced inputs" (a ComfyUI whose inputs take the mark: 0.33), and gpus "all"
report["engine_advanced"] = sorted(name for kind in ("required", "optional")
                                   for name, (_, options) in E.INPUT_TYPES().get(kind, {}).items()
                                   if isinstance(options, dict) and options.get("advanced"))
report["gpus_all"] = list(E.EXECUTE_NORMALIZED(**dict(
    {name: entry.get("default") for name, entry in RELEASED[0]["nodes"]["XDiTEngine"]["inputs"].items()},
    model_name="tiny-flux-dev.safetensors", gpus="all")).args[0].gpus)

# A prompt saved with each released version: ComfyUI's own validation (what POST /prompt runs) of a whole FLUX graph
# (the text encoder and VAE names exist as files; nothing here loads them)
assert set(TEXT_ENCODERS) <= set(folder_paths.get_filename_list("text_encoders")) and \
    VAE in folder_paths.get_filename_list("vae")
report["released_prompts"] = {}
for release in RELEASED:
    prompt = release_prompt(release, "tiny-flux-dev.safetensors", "tiny-lora.safetensors", custom_sampler=True)
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt("check", prompt, None))
    report["released_prompts"][release["commit"][:7]] = {"valid": valid, "error": error, "node_errors": node_errors,
                                                         "nodes": sorted({n["class_type"] for n in prompt.values()})}


def run(cls, **kw):
    return cls.EXECUTE_NORMALIZED(**kw).args


# The first release's engine inputs, and only those (ComfyUI passes no value for an input a saved prompt lacks)
first = {name: entry.get("default") for name, entry in RELEASED[0]["nodes"]["XDiTEngine"]["inputs"].items()}
first.update(model_name="tiny-flux-dev.safetensors", gpus="0,1", timeout_s=600)
report["first_release_engine_inputs"] = sorted(first)
first_inputs = dict(first)
g = torch.Generator().manual_seed(0)
engine = run(E, **first)[0]
engine = run(L, engine=engine, lora_name="tiny-lora.safetensors", strength_model=0.5)[0]
cond = [[torch.randn(1, 24, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}]]
job = dict(engine=engine, seed=1, cfg=1.0, sampler_name="euler", scheduler="simple", positive=cond, negative=cond,
           latent_image={"samples": torch.zeros(1, 16, 16, 16)}, denoise=1.0)
progress = []
# what the pack reports, before ComfyUI's progress bar passes it on (newer ComfyUIs throttle the hook by time)
update_absolute = comfy.utils.ProgressBar.update_absolute


def recorded(self, value, total=None, preview=None):
    progress.append([value, total])
    return update_absolute(self, value, total, preview)


comfy.utils.ProgressBar.update_absolute = recorded
first = run(S, steps=4, **job)[0]["samples"]
comfy.utils.ProgressBar.update_absolute = update_absolute
report.update(latent_shape=list(first.shape), finite=bool(torch.isfinite(first).all()), progress=progress[:])

seen = []


def interrupt_at_2(value, total, preview, node_id=None, prompt_id=None):
    seen.append(value)
    if value >= 2 and not any(v >= 2 for v in seen[:-1]):   # the hook may skip steps (throttled by time)
        mm.interrupt_current_processing(True)  # what the UI's cancel and POST /interrupt do


comfy.utils.set_progress_bar_global_hook(interrupt_at_2)
try:
    run(S, steps=200, **job)
    report["interrupt"] = "not interrupted"
except mm.InterruptProcessingException:
    report["interrupt"] = {"steps_seen": seen, "flag_after": mm.processing_interrupted()}
comfy.utils.set_progress_bar_global_hook(None)
again = run(S, steps=4, **job)[0]["samples"]
report["next_job_identical"] = torch.equal(again, first)
try:
    run(S, steps=4, **dict(job, positive=cond + cond))
except ValueError as e:
    report["bad_input_error"] = str(e)
report["info"] = run(I, engine=engine, unload=True, after={"samples": again})[0]
try:   # an engine error as ComfyUI's history and page show it: its type by ComfyUI's own formula, and its message
    run(E, **dict(first_inputs, gpus="0", plan="explicit", ulysses=2))
except ValueError as e:
    report["plan_error"] = [execution.full_type_name(type(e)), str(e)]
print("REPORT " + json.dumps(report))
