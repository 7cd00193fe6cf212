"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): load this pack through ComfyUI's own
custom-node loader and drive its V3 nodes with ComfyUI's folder paths, progress hook and interrupt. Prints one
JSON report. Usage: python comfyui_live_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import json
import os
import sys

comfyui, pack_parent, models = sys.argv[1:4]
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.model_management as mm  # noqa: E402
import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

folder_paths.add_model_folder_path("diffusion_models", os.path.join(models, "diffusion_models"))
folder_paths.add_model_folder_path("loras", os.path.join(models, "loras"))
folder_paths.add_model_folder_path("custom_nodes", pack_parent)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
report = {"registered": {n: nodes.NODE_DISPLAY_NAME_MAPPINGS.get(n) for n in nodes.NODE_CLASS_MAPPINGS
                         if n.startswith("XDiT")}}
E, L, S, I = (nodes.NODE_CLASS_MAPPINGS[n] for n in ("XDiTEngine", "XDiTLoRA", "XDiTSampler", "XDiTEngineInfo"))
report["sampler_inputs"] = list(S.INPUT_TYPES()["required"])


def run(cls, **kw):
    return cls.EXECUTE_NORMALIZED(**kw).args


g = torch.Generator().manual_seed(0)
engine = run(E, model_name="tiny-flux-dev.safetensors", family="auto", weight_dtype="default", gpus="0,1", plan="auto",
             ulysses=1, ring=1, cfg_parallel=False, dp=1, timeout_s=600)[0]
engine = run(L, engine=engine, lora_name="tiny-lora.safetensors", strength_model=0.5)[0]
cond = [[torch.randn(1, 24, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}]]
job = dict(engine=engine, seed=1, cfg=1.0, sampler_name="euler", scheduler="simple", positive=cond, negative=cond,
           latent_image={"samples": torch.zeros(1, 16, 16, 16)}, denoise=1.0)
progress = []
comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: progress.append([value, total]))
first = run(S, steps=4, **job)[0]["samples"]
report.update(latent_shape=list(first.shape), finite=bool(torch.isfinite(first).all()), progress=progress[:])

seen = []


def interrupt_at_2(value, total, preview, node_id=None):
    seen.append(value)
    if value == 2:
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
print("REPORT " + json.dumps(report))
