"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): every API workflow in workflows/api/ that the
running ComfyUI is new enough for (the version its UI twin's note names), through ComfyUI's own prompt validation
(execution.validate_prompt, what POST /prompt runs before anything executes): node types, each input's type and range,
links, combo values, the nodes' own validate_inputs. The model files a workflow names are there as empty files of a
folder of the check's own (validation reads names, never files); the images it loads are copies of ComfyUI's own
input/example.png under their names, the videos empty files of theirs (Load Video checks that the file is there), in an
input folder of the check's own (a template's own pictures and videos are the user's).
Prints one JSON report: per workflow "valid" with ComfyUI's error and node errors, or the release it needs.
Usage: python comfyui_workflow_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import glob
import json
import os
import re
import shutil
import sys

from comfyui_live_common import start  # tests/, this file's folder

HERE = os.path.dirname(os.path.abspath(__file__))
WORKFLOWS = os.path.join(HERE, "..", "workflows")
# the folders a workflow's file names can be looked up in (each name is put in every one: only names are read)
FOLDERS = ("diffusion_models", "checkpoints", "loras", "text_encoders", "vae", "latent_upscale_models", "clip_vision")
MODEL_FILE = re.compile(r".+\.(safetensors|gguf|sft|ckpt|pt|pth|bin)$")

models, VERSION = start(sys.argv, folders=())
import execution  # noqa: E402
import folder_paths  # noqa: E402

own = os.path.join(os.path.dirname(os.path.abspath(models)), "workflow-models")


def release(text: str):
    return tuple(int(v) for v in text.split(".")[:3])


def needs(name: str) -> str | None:
    """The release the workflow's note names (workflows without a note run on the oldest supported)."""
    with open(os.path.join(WORKFLOWS, f"{name}.json")) as f:
        ui = json.load(f)
    for node in ui["nodes"]:
        if node["type"] == "MarkdownNote":
            found = re.search(r"Needs ComfyUI ([0-9.]+) or later", node["widgets_values"][0])
            if found:
                return found.group(1)
    return None


report = {"comfyui": VERSION, "workflows": {}}
prompts = {}
for path in sorted(glob.glob(os.path.join(WORKFLOWS, "api", "*.api.json"))):
    with open(path) as f:
        prompts[os.path.basename(path)[:-len(".api.json")]] = json.load(f)
nodes = [node for prompt in prompts.values() for node in prompt.values()]
files = {v for node in nodes for v in node["inputs"].values() if isinstance(v, str) and MODEL_FILE.match(v)}
images = {node["inputs"]["image"] for node in nodes
          if node["class_type"] == "LoadImage" and isinstance(node["inputs"].get("image"), str)}
videos = {node["inputs"]["file"] for node in nodes
          if node["class_type"] == "LoadVideo" and isinstance(node["inputs"].get("file"), str)}
example = os.path.join(folder_paths.get_input_directory(), "example.png")
os.makedirs(os.path.join(own, "input"), exist_ok=True)
for name in images:
    shutil.copyfile(example, os.path.join(own, "input", name))
for name in videos:
    open(os.path.join(own, "input", name), "wb").close()
folder_paths.set_input_directory(os.path.join(own, "input"))
for folder in FOLDERS:
    os.makedirs(os.path.join(own, folder), exist_ok=True)
    for name in files:
        open(os.path.join(own, folder, name), "wb").close()
    folder_paths.add_model_folder_path(folder, os.path.join(own, folder))
for name, prompt in prompts.items():
    wanted = needs(name)
    if wanted and VERSION != "unknown" and release(VERSION) < release(wanted):
        report["workflows"][name] = {"needs": wanted}
        continue
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(name, prompt, None))
    report["workflows"][name] = {"valid": valid, "error": error, "node_errors": node_errors, "outputs": len(outputs),
                                 "nodes": len(prompt)}
    print(name, valid, (error or {}).get("message", ""), flush=True)
print("REPORT " + json.dumps(report, default=str), flush=True)
