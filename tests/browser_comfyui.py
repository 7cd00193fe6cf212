"""A ComfyUI server for tests/test_browser.py: a temporary base directory (custom_nodes with this pack linked in and
the test's scaffolding pack, models with empty stand-ins of every file the example workflows name, an input image,
settings that skip the first-run template browser) and the server started on the CPU in it."""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import comfyui_stock_nodes as stock
from conftest import ROOT

WORKFLOW_DIR = os.path.join(ROOT, "workflows")
MODEL_FOLDERS = ("diffusion_models", "checkpoints", "text_encoders", "clip", "vae", "loras")
MODEL_EXTENSIONS = (".safetensors", ".sft", ".gguf", ".ckpt", ".pt", ".pth", ".bin")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
OUR_FOLDERS = {"XDiTEngine": "diffusion_models", "XDiTLoRA": "loras"}
# No template browser on the first start, node text drawn at any zoom (screenshots of whole workflows), no minimap
SETTINGS = {"Comfy.TutorialCompleted": True, "LiteGraph.Canvas.MinFontSizeForLOD": 0, "Comfy.Minimap.Visible": False}


def ui_workflows() -> list[str]:
    """Every drag-and-drop (UI format) workflow in workflows/, whatever their names: not the .api.json prompts."""
    return sorted(p for p in glob.glob(os.path.join(WORKFLOW_DIR, "*.json")) if not p.endswith(".api.json"))


def named_files(workflow: dict) -> dict[str, set[str]]:
    """{folder: file names} a workflow's widgets name: the folder the node's properties.models gives the file (where
    the frontend looks for it: the engine's checkpoint in checkpoints/), else a stock loader's own folder where
    tests/comfyui_stock_nodes.py knows the node, else every model folder (an empty stand-in in a folder its loader
    does not read costs nothing)."""
    found: dict[str, set[str]] = {}
    for node in workflow.get("nodes", []):
        folders = {i["folder"] for i in stock.STOCK_NODES.get(node["type"], {}).get("inputs", ()) if "folder" in i}
        if node["type"] in OUR_FOLDERS:
            folders = {OUR_FOLDERS[node["type"]]}
        listed = {m["name"]: m["directory"] for m in (node.get("properties") or {}).get("models", [])}
        for value in node.get("widgets_values") or []:
            if not isinstance(value, str):
                continue
            name = value.lower()
            if name.endswith(IMAGE_EXTENSIONS):
                found.setdefault("input", set()).add(value)
            elif name.endswith(MODEL_EXTENSIONS):
                for folder in ({listed[value]} if value in listed else (folders - {"input"}) or MODEL_FOLDERS):
                    found.setdefault(folder, set()).add(value)
    return found


def _write_png(path: str, size: int = 64) -> None:
    from PIL import Image
    Image.new("RGB", (size, size), (90, 120, 160)).save(path)


def make_base_directory(base: str, tiny_flux: str) -> None:
    """custom_nodes/ComfyUI-xDiT links to this checkout (loaded by path under its folder name, as a user's clone);
    custom_nodes/xdit_test_nodes holds tests/browser_scaffold_nodes.py; models/ holds the tiny FLUX model, real, and an
    empty stand-in of every other file the workflows name."""
    packs = os.path.join(base, "custom_nodes")
    os.makedirs(os.path.join(packs, "xdit_test_nodes"))
    os.symlink(ROOT, os.path.join(packs, "ComfyUI-xDiT"))
    shutil.copy(os.path.join(ROOT, "tests", "browser_scaffold_nodes.py"),
                os.path.join(packs, "xdit_test_nodes", "__init__.py"))
    for folder in MODEL_FOLDERS + ("input",):
        os.makedirs(os.path.join(base, "models" if folder != "input" else "", folder), exist_ok=True)
    for path in ui_workflows():
        with open(path) as f:
            for folder, names in named_files(json.load(f)).items():
                for name in names:
                    target = os.path.join(base, "input", name) if folder == "input" else \
                        os.path.join(base, "models", folder, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    if folder == "input":
                        _write_png(target)
                    else:
                        open(target, "wb").close()
    shutil.copy(tiny_flux, os.path.join(base, "models", "diffusion_models", os.path.basename(tiny_flux)))
    user = os.path.join(base, "user", "default")
    os.makedirs(user)
    with open(os.path.join(user, "comfy.settings.json"), "w") as f:
        json.dump(SETTINGS, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class Server:
    comfyui: str
    python: str
    pythonpath: str | None
    base: str
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240) -> dict:
        """Starts ComfyUI on the CPU and waits for its node list; returns GET /object_info."""
        self.port = self.port or free_port()
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if self.pythonpath:   # e.g. an older comfyui-frontend-package than the venv's, put in front
            env["PYTHONPATH"] = self.pythonpath
        self.log_path = os.path.join(self.base, "comfyui.log")
        with open(self.log_path, "w") as log:   # the server writes to its own copy of the file descriptor
            self.process = subprocess.Popen(
                [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                 "--disable-auto-launch", "--base-directory", self.base,
                 "--database-url", f"sqlite:///{os.path.join(self.base, 'comfyui.db')}"],
                cwd=self.comfyui, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return get_json(f"{self.url}/object_info", timeout=30)
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"ComfyUI at {self.comfyui} exited with {self.process.returncode}:\n"
                                       + self.log_tail()) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ComfyUI at {self.comfyui} did not answer within {timeout_s:.0f} s:\n"
                                       + self.log_tail()) from None
                time.sleep(1)

    def version(self) -> str:
        stats = get_json(f"{self.url}/system_stats")["system"]
        return f"ComfyUI {stats.get('comfyui_version', '?')}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
