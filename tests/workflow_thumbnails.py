"""Draws the picture ComfyUI's template browser shows for each workflow (workflows/NAME.jpg: both frontends fetch a
custom node template's card picture as <name>.jpg beside its JSON): the graph as the page draws it, in headless
Chromium, on a ComfyUI started here with this pack, placeholder model files of the names the workflows use (so no
node shows a missing-model error), ComfyUI's example.png as every image the workflows load and a short video of it
as every video they load.

    python tests/workflow_thumbnails.py COMFYUI_DIR [--python PYTHON] [--port 8189] [--only NAME ...]

PYTHON runs ComfyUI (default: this one) and needs selenium, Pillow and (for a workflow that loads a video) PyAV
here; Chromium and chromedriver are taken
from PATH (or CHROMIUM / CHROMEDRIVER). Run it after tests/make_workflows.py when a graph changes; --only redraws
just the named workflows (each workflow's picture needs a ComfyUI that has its nodes: the MiniMax-H3 ones 0.33.0)."""
import argparse
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOW_DIR = os.path.join(ROOT, "workflows")
WIDTH = 960           # the picture's width in pixels (the cards show it at about 300)
SCALE = 1.0           # canvas scale while drawing: text is drawn only above the frontends' low-quality zoom
MARGIN = 40           # graph units around the nodes
BADGE_ROOM = 30       # above the first row: the badges drawn over a node's title bar


def workflow_names():
    return sorted(os.path.basename(p)[:-len(".json")] for p in glob.glob(os.path.join(WORKFLOW_DIR, "*.json")))


def prepare_base(base, comfyui):
    """custom_nodes/ with this pack, models/ with empty files of the names the workflows' models entries give, and
    input/ with ComfyUI's example.png under every image name the workflows load and a video of it under every video
    name."""
    os.makedirs(os.path.join(base, "custom_nodes"))
    os.symlink(ROOT, os.path.join(base, "custom_nodes", "ComfyUI-xDiT"))
    images, videos = set(), set()
    for name in workflow_names():
        with open(os.path.join(WORKFLOW_DIR, f"{name}.json")) as f:
            ui = json.load(f)
        for node in ui["nodes"]:
            for model in node["properties"].get("models", []):
                folder = os.path.join(base, "models", model["directory"])
                os.makedirs(folder, exist_ok=True)
                open(os.path.join(folder, model["name"]), "wb").close()
            if node["type"] == "LoadImage":
                images.add(node["widgets_values"][0])
            if node["type"] == "LoadVideo":
                videos.add(node["widgets_values"][0])
    os.makedirs(os.path.join(base, "input"))
    for image in images:
        shutil.copy(os.path.join(comfyui, "input", "example.png"), os.path.join(base, "input", image))
    for video in videos:
        write_video(os.path.join(comfyui, "input", "example.png"), os.path.join(base, "input", video))


def write_video(image, path, seconds=1, fps=8):
    """An H.264 MP4 of `image` held still: what a Load Video node shows in the picture."""
    import av
    from PIL import Image
    picture = Image.open(image).convert("RGB")
    picture = picture.crop((0, 0, picture.width // 2 * 2, picture.height // 2 * 2))
    with av.open(path, "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = picture.width, picture.height, "yuv420p"
        for _ in range(seconds * fps):
            out.mux(stream.encode(av.VideoFrame.from_image(picture)))
        out.mux(stream.encode())


def start_comfyui(comfyui, python, base, port):
    command = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
               "--base-directory", base, "--database-url", f"sqlite:///{base}/comfyui.db"]
    log = open(os.path.join(base, "comfyui.log"), "w")
    server = subprocess.Popen(command, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ComfyUI exited with {server.returncode}; see {base}/comfyui.log")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/object_info/XDiTEngine", timeout=5)
            return server
        except OSError:
            time.sleep(2)
    server.kill()
    raise SystemExit(f"ComfyUI did not answer on port {port} within 300 s; see {base}/comfyui.log")


def open_browser(width, height):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    profile = tempfile.mkdtemp(prefix="thumbnails-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")),
                              options=options)
    driver.set_script_timeout(120)
    return driver, profile


SCREEN_AT = (400, 400)   # where the graph's top left is put on the page: clear of the frontends' bars and panels

DRAW = """
const [workflow, name, scale, margin, badgeRoom, at] = arguments; const done = arguments[arguments.length - 1];
(async () => {
  await app.loadGraphData(workflow, true, true, name);
  await new Promise(r => setTimeout(r, 3000));           // images and fonts
  const nodes = app.graph._nodes ?? app.graph.nodes;
  const title = LiteGraph.NODE_TITLE_HEIGHT;
  const left = Math.min(...nodes.map(n => n.pos[0])) - margin;
  const top = Math.min(...nodes.map(n => n.pos[1])) - title - margin - badgeRoom;
  const right = Math.max(...nodes.map(n => n.pos[0] + n.size[0])) + margin;
  const bottom = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) + margin;
  app.canvas.ds.scale = scale;
  app.canvas.ds.offset = [at[0] / scale - left, at[1] / scale - top];
  for (const n of nodes) n.selected = false;
  app.canvas.show_info = false;
  app.canvas.setDirty(true, true);
  await new Promise(r => setTimeout(r, 1500));           // the DOM widgets follow the canvas on its next frames
  const r = app.canvas.canvas.getBoundingClientRect();
  done([r.left + at[0], r.top + at[1], Math.ceil((right - left) * scale), Math.ceil((bottom - top) * scale)]);
})().catch(e => done('error: ' + e));
"""


def close_dialogs(driver):
    """A fresh profile opens on the template browser: Escape closes it (and any other dialog)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    for _ in range(3):
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        time.sleep(0.5)


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comfyui", help="a ComfyUI checkout (its main.py and input/example.png)")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs ComfyUI")
    parser.add_argument("--port", type=int, default=8189)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="redraw only these workflows (default: all)")
    args = parser.parse_args(argv)
    names = workflow_names()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"no workflows/NAME.json for {', '.join(unknown)}")
        names = [n for n in names if n in args.only]
    from PIL import Image
    base = tempfile.mkdtemp(prefix="thumbnails-comfyui-")
    prepare_base(base, os.path.abspath(args.comfyui))
    server = start_comfyui(os.path.abspath(args.comfyui), args.python, base, args.port)
    driver = profile = None
    try:
        driver, profile = open_browser(3600, 2200)
        driver.get(f"http://127.0.0.1:{args.port}")
        for _ in range(240):
            if driver.execute_script("return !!(window.app && window.app.graph && window.app.canvas)"):
                break
            time.sleep(0.5)
        time.sleep(3)
        close_dialogs(driver)
        for name in names:
            with open(os.path.join(WORKFLOW_DIR, f"{name}.json")) as f:
                workflow = json.load(f)
            area = driver.execute_async_script(DRAW, workflow, name, SCALE, MARGIN, BADGE_ROOM, SCREEN_AT)
            close_dialogs(driver)
            if isinstance(area, str):
                raise SystemExit(f"{name}: the page could not draw it: {area}")
            x, y, w, h = (round(v) for v in area)
            page = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
            picture = page.crop((x, y, x + w, y + h))
            picture = picture.resize((WIDTH, round(picture.height * WIDTH / picture.width)), Image.LANCZOS)
            picture.save(os.path.join(WORKFLOW_DIR, f"{name}.jpg"), "JPEG", quality=82, optimize=True)
            print(f"workflows/{name}.jpg {picture.width}x{picture.height}")
    finally:
        if driver is not None:
            driver.quit()
            shutil.rmtree(profile, ignore_errors=True)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
