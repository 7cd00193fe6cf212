"""ComfyUI's page in headless Chromium, for tests/test_browser.py: Debian's chromium driven by its chromedriver through
selenium (nothing downloaded). Loads a workflow as a user does (a file dropped on the canvas), reads what the
frontend drew (node boxes, links, the missing-nodes report of either frontend generation) and queues from the Run
button. Works with ComfyUI's frontend 1.27 (missing nodes in a dialog) and 1.49 (in the errors panel)."""
from __future__ import annotations

import json
import os
import shutil
import time

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1920,1200")


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) from CHROMIUM / CHROMEDRIVER or PATH, or None."""
    browser = os.environ.get("CHROMIUM") or next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


# ---- scripts run in the page --------------------------------------------------------------------------------------
READY = """
const app = window.app;
return !!(app && app.graph && app.canvas && window.comfyAPI?.widgets?.ComfyWidgets &&
          document.querySelector('[data-testid="queue-button"]'));
"""

EXTENSIONS = "return (window.app.extensions ?? []).map(e => e.name);"

FRONTEND_VERSION = "return window.__COMFYUI_FRONTEND_VERSION__ ?? null;"

REGISTERED_TYPES = "return Object.keys(window.LiteGraph.registered_node_types);"

# Whether the frontend offers the Vue node display ("Nodes 2.0") as a user setting (1.27 has it hidden, experimental)
VUE_SETTING = """
const s = window.app.ui?.settings?.settingsParamLookup?.["Comfy.VueNodes.Enabled"];
return !!s && s.type !== "hidden";
"""

DROP = """
const [name, text] = arguments;
const file = new File([text], name, {type: "application/json"});
const transfer = new DataTransfer();
transfer.items.add(file);
const canvas = window.app.canvas.canvas;
const box = canvas.getBoundingClientRect();
canvas.dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true, cancelable: true,
                                            clientX: box.left + box.width / 2, clientY: box.top + box.height / 2}));
"""

NODE_IDS = "return (window.app.graph.nodes ?? window.app.graph._nodes).map(n => String(n.id));"

FIT_AND_DRAW = """
const done = arguments[arguments.length - 1];
const {app} = window, ds = app.canvas.ds;
const command = app.extensionManager?.command;
try { command ? command.execute("Comfy.Canvas.FitView") : app.canvas.fitViewToSelectionAnimated?.(); }
catch (e) { /* fitting is for the screenshot only */ }
app.canvas.setDirty(true, true);
// the view may animate to its fit: wait until it has stood still for 10 frames (the page's boxes follow it)
let last = "", still = 0, frames = 0;
const step = () => {
  const now = `${ds.scale} ${ds.offset[0]} ${ds.offset[1]}`;
  still = now === last ? still + 1 : 0;
  last = now;
  if (still >= 10 || ++frames > 600) setTimeout(() => done(true), 200); else requestAnimationFrame(step);
};
requestAnimationFrame(step);
"""

# Node boxes as the frontend has them (graph units, title bar included: LGraphNode.getBounding), the boxes the page
# draws for Vue nodes where that display is on, and every link checked against its two ends.
GRAPH = """
const app = window.app;
const graph = app.graph;
const nodes = graph.nodes ?? graph._nodes;
const byId = new Map(nodes.map(n => [String(n.id), n]));
const boxes = nodes.map(n => {
  const r = Array.from(n.getBounding(new Float32Array(4)));
  return {id: String(n.id), type: n.type, title: n.title, box: r, collapsed: !!n.flags?.collapsed};
});
const drawn = {};
const ds = app.canvas.ds, area = app.canvas.canvas.getBoundingClientRect();
for (const el of document.querySelectorAll("[data-node-id]")) {
  const r = el.getBoundingClientRect();
  if (!r.width || !r.height) continue;
  drawn[el.dataset.nodeId] = [(r.left - area.left) / ds.scale - ds.offset[0],
                              (r.top - area.top) / ds.scale - ds.offset[1], r.width / ds.scale, r.height / ds.scale];
}
const links = graph.links instanceof Map ? [...graph.links.values()] : Object.values(graph.links ?? {});
const valid = window.LiteGraph?.isValidConnection?.bind(window.LiteGraph) ?? ((a, b) => a === b);
const broken = [];
for (const l of links) {
  if (!l) continue;
  const src = byId.get(String(l.origin_id)), dst = byId.get(String(l.target_id));
  const what = `link ${l.id} (${l.origin_id}:${l.origin_slot} -> ${l.target_id}:${l.target_slot}, ${l.type})`;
  if (!src || !dst) { broken.push(`${what}: ${!src ? "source" : "target"} node does not exist`); continue; }
  const out = src.outputs?.[l.origin_slot], inp = dst.inputs?.[l.target_slot];
  if (!out || !inp) { broken.push(`${what}: ${!out ? "output" : "input"} slot does not exist`); continue; }
  if (String(inp.link) !== String(l.id) || !(out.links ?? []).map(String).includes(String(l.id)))
    broken.push(`${what}: its ends do not name it (input.link ${inp.link}, output.links ${JSON.stringify(out.links)})`);
  if (!valid(out.type, inp.type) || !valid(l.type, inp.type))
    broken.push(`${what}: ${src.type}.${out.name} gives ${out.type}, ${dst.type}.${inp.name} takes ${inp.type}`);
}
for (const n of nodes)
  for (const [slot, inp] of (n.inputs ?? []).entries())
    if (inp.link != null && !links.some(l => l && String(l.id) === String(inp.link)))
      broken.push(`${n.type} ${n.id} input ${inp.name} (slot ${slot}) names link ${inp.link}, which does not exist`);
return {nodes: boxes, drawn, links: links.filter(Boolean).length, broken,
        vue: !!document.querySelector("[data-node-id]")};
"""

DIALOG_TEXTS = """
return [...document.querySelectorAll('.p-dialog, [role="dialog"], [role="alertdialog"]')]
  .filter(e => e.offsetParent !== null).map(e => e.innerText);
"""

VIEW_DETAILS = """
const b = [...document.querySelectorAll("button")].find(b => b.innerText.trim() === "View details");
if (b) b.click();
return !!b;
"""

MISSING_CARD = """
return [...document.querySelectorAll('[data-testid="missing-node-card"]')].map(e => e.innerText);
"""

CLOSE_REPORTS = """
const closers = '.p-dialog [aria-label="Close"], .p-dialog-close-button, .p-toast-close-button';
for (const b of document.querySelectorAll(closers)) b.click();
for (const b of [...document.querySelectorAll("button")].filter(b => b.getAttribute("aria-label") === "Close" &&
                                                               b.closest('[role="alert"], .p-toast')))
  b.click();
const panel = document.querySelector('[data-testid="panel-tab-errors"]');
const toggle = [...document.querySelectorAll("button")].find(b =>
  b.getAttribute("aria-label") === "Toggle properties panel");
if (panel && panel.offsetParent !== null && toggle) toggle.click();
"""

SETTING = """
const [id, value, done] = arguments;
window.app.extensionManager.setting.set(id, value).then(() => done(true), e => done(String(e)));
"""

# The run: a graph built with the frontend's own node constructors (no saved widget layout to get wrong), queued from
# the Run button; its events come back over the page's WebSocket (the frontend's api object).
NEW_WORKFLOW = """
const done = arguments[arguments.length - 1];
Promise.resolve(window.app.extensionManager.command.execute("Comfy.NewBlankWorkflow"))
  .then(() => setTimeout(() => done(true), 300), e => done(String(e)));
"""

BUILD_RUN = """
const [model, seed] = arguments;
const {app} = window, L = window.LiteGraph;
app.graph.clear();
const add = (type, pos, values = {}) => {
  const n = L.createNode(type);
  if (!n) throw new Error(`no node type ${type}`);
  n.pos = pos;
  app.graph.add(n);
  for (const [name, value] of Object.entries(values)) {
    const w = n.widgets.find(w => w.name === name);
    if (w) w.value = value;
    else if (name !== "control_after_generate") throw new Error(`${type} has no widget ${name}`);
  }
  return n;
};
const slot = (n, list, name) => n[list].findIndex(s => s.name === name);
const link = (src, output, dst, input) => src.connect(slot(src, "outputs", output), dst, slot(dst, "inputs", input));
const engine = add("XDiTEngine", [20, 20], {model_name: model, gpus: "0", plan: "auto"});
const positive = add("XDiTTestRandomConditioning", [20, 560], {seed: 1});
const negative = add("XDiTTestRandomConditioning", [20, 720], {seed: 2});
const latent = add("EmptySD3LatentImage", [400, 560], {width: 64, height: 64, batch_size: 1});
const sampler = add("XDiTSampler", [440, 20], {seed, control_after_generate: "fixed", steps: 2,
                                                cfg: 1.0, sampler_name: "euler", scheduler: "simple"});
const info = add("XDiTEngineInfo", [860, 20], {unload: true});
link(engine, "engine", sampler, "engine");
link(positive, "CONDITIONING", sampler, "positive");
link(negative, "CONDITIONING", sampler, "negative");
link(latent, "LATENT", sampler, "latent_image");
link(engine, "engine", info, "engine");
link(sampler, "LATENT", info, "after");
app.canvas.setDirty(true, true);
window.__xdit_events = [];
const api = window.comfyAPI.api.api;
for (const type of ["execution_start", "executed", "execution_success", "execution_error", "execution_interrupted"])
  api.addEventListener(type, e => window.__xdit_events.push({type, detail: e.detail}));
return String(info.id);
"""

# 1.49's Run is the button itself; 1.27's is a split button whose first button queues (the second opens its menu)
RUN_BUTTON = """
const el = document.querySelector('[data-testid="queue-button"]');
return el.tagName === "BUTTON" ? el : el.querySelector("button");
"""

EVENTS = "return window.__xdit_events ?? [];"

INFO_WIDGET = """
const [id] = arguments;
const graph = window.app.graph;
const node = (graph.nodes ?? graph._nodes).find(n => String(n.id) === id);
const w = node?.widgets?.find(w => w.name === "report");
const el = w && (w.element ?? w.inputEl);
const shown = document.querySelector(`[data-node-id="${id}"] textarea`);
return {value: w ? String(w.value ?? "") : null, box_text: el ? el.value : null,
        unload: node?.widgets?.find(w => w.name === "unload")?.value ?? null,
        vue_read_only: shown ? shown.readOnly : null,
        box_visible: !!el && el.offsetParent !== null && el.getBoundingClientRect().height > 0,
        read_only: el ? el.readOnly : null, vue_text: shown ? shown.value : null,
        widgets: (node?.widgets ?? []).map(w => w.name), size: node ? Array.from(node.size) : null,
        serialized: node ? node.serialize() : null};
"""

FOCUS_NODE = """
const [id, done] = [arguments[0], arguments[arguments.length - 1]];
const {app} = window, graph = app.graph;
const node = (graph.nodes ?? graph._nodes).find(n => String(n.id) === id);
const [x, y, w, h] = Array.from(node.getBounding(new Float32Array(4)));
const ds = app.canvas.ds, area = app.canvas.canvas.getBoundingClientRect();
ds.scale = Math.min(area.width / (w + 80), area.height / (h + 80), 1.5);
ds.offset[0] = area.width / 2 / ds.scale - (x + w / 2);
ds.offset[1] = area.height / 2 / ds.scale - (y + h / 2);
app.canvas.setDirty(true, true);
requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(() => done(true), 400)));
"""

WORKFLOW_JSON = "return JSON.stringify(window.app.graph.serialize());"

LOAD_GRAPH = """
const [data, done] = arguments;
Promise.resolve(window.app.loadGraphData(JSON.parse(data))).then(() => done(true), e => done(String(e)));
"""


class Page:
    """One Chromium with ComfyUI's page open."""

    def __init__(self, url: str, profile: str, browser: tuple[str, str]):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = browser[0]
        for flag in CHROME_FLAGS + (f"--user-data-dir={profile}",):
            options.add_argument(flag)
        self.url = url
        self.driver = webdriver.Chrome(service=Service(browser[1]), options=options)
        self.driver.set_script_timeout(60)

    def close(self) -> None:
        self.driver.quit()

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def js_async(self, script: str, *args):
        return self.driver.execute_async_script(script, *args)

    def wait(self, what: str, check, timeout_s: float, every_s: float = 0.2):
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
            time.sleep(every_s)

    def open(self, timeout_s: float = 120) -> None:
        self.driver.get(self.url)
        self.wait("ComfyUI's page ready", lambda: self.js(READY), timeout_s)
        time.sleep(1.0)   # the startup workflow and first toasts settle
        self.js(CLOSE_REPORTS)

    def frontend_version(self) -> str:
        return self.js(FRONTEND_VERSION) or "?"

    def registered_types(self) -> set[str]:
        return set(self.js(REGISTERED_TYPES))

    def offers_vue_nodes(self) -> bool:
        return bool(self.js(VUE_SETTING))

    def extensions(self) -> list[str]:
        return self.js(EXTENSIONS)

    def set_setting(self, setting_id: str, value) -> None:
        result = self.js_async(SETTING, setting_id, value)
        assert result is True, f"setting {setting_id}={value!r}: {result}"

    def drop_workflow(self, path: str, timeout_s: float = 60) -> float:
        """Drops the file on the canvas, as dragging it from a file manager does; returns the seconds until every
        node of the file is in the graph and drawn."""
        with open(path) as f:
            text = f.read()
        expected = {str(n["id"]) for n in json.loads(text).get("nodes", [])}
        self.js(CLOSE_REPORTS)
        start = time.monotonic()
        self.js(DROP, os.path.basename(path), text)
        self.wait(f"{os.path.basename(path)} loaded", lambda: set(self.js(NODE_IDS)) == expected, timeout_s, 0.05)
        self.js_async(FIT_AND_DRAW)
        return time.monotonic() - start

    def graph(self) -> dict:
        return self.js(GRAPH)

    def missing_nodes_report(self, settle_s: float = 1.0) -> list[str]:
        """The text of what the frontend shows about missing nodes: 1.27's "Some Nodes Are Missing" dialog, or
        1.49's errors toast opened to its missing-node card. Empty when it shows nothing."""
        time.sleep(settle_s)
        shown = [t for t in self.js(DIALOG_TEXTS) if "missing" in t.lower()]
        if self.js(VIEW_DETAILS):
            time.sleep(1.0)
            shown += self.js(MISSING_CARD)
        return shown

    def close_reports(self) -> None:
        self.js(CLOSE_REPORTS)
        time.sleep(0.3)

    def screenshot(self, path: str) -> str:
        self.driver.save_screenshot(path)
        return path

    def focus_node(self, node_id: str) -> None:
        self.js_async(FOCUS_NODE, node_id)

    def build_run_graph(self, model_name: str, seed: int) -> str:
        """Opens a new blank workflow and builds the run's graph in it; returns the Info node's id."""
        result = self.js_async(NEW_WORKFLOW)
        assert result is True, f"a new blank workflow: {result}"
        return self.js(BUILD_RUN, model_name, seed)

    def click_run(self) -> None:
        self.js(RUN_BUTTON).click()

    def events(self) -> list[dict]:
        return self.js(EVENTS)

    def info_widget(self, node_id: str) -> dict:
        return self.js(INFO_WIDGET, node_id)

    def workflow(self) -> str:
        return self.js(WORKFLOW_JSON)

    def load_graph(self, data: str) -> None:
        result = self.js_async(LOAD_GRAPH, data)
        assert result is True, result
