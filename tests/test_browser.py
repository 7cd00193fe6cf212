"""ComfyUI's page in a real browser. For one or two ComfyUI checkouts, on the CPU: every UI workflow in workflows/
dropped on the canvas as a user drops a file, in each node display the frontend offers (classic, and "Nodes 2.0"
where it is a setting), checked for a missing-nodes report, overlapping nodes, broken links and saved values that
moved to another widget; then a tiny FLUX graph queued from the Run button, whose xDiT Engine Info node must draw
its report, keep it through saving and reloading, and keep `unload` in its own widget.

Skipped without COMFYUI_PATH, selenium, or Chromium and its chromedriver (CI has none); nothing is downloaded.
  COMFYUI_PATH, COMFYUI_PYTHON (the Python with its requirements), COMFYUI_PYTHONPATH (put in front, e.g. an older
  comfyui-frontend-package); COMFYUI_PATH_2, COMFYUI_PYTHON_2, COMFYUI_PYTHONPATH_2 for a second ComfyUI;
  XDIT_BROWSER_SHOTS: the folder for the screenshots and figures.txt (default: a pytest temporary folder, printed);
  CHROMIUM, CHROMEDRIVER: the browser and its driver (default: found on PATH).
The node types a workflow may lack are read from the running page, so the test takes whatever workflows are there."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field

import pytest

from browser_comfyui import Server, get_json, make_base_directory, ui_workflows
from browser_page import Page, find_browser

SUFFIXES = ("", "_2")   # COMFYUI_PATH, COMFYUI_PATH_2
TINY_MODEL = "tiny-flux-dev.safetensors"
PROBE_TYPE = "XDiTTestNoSuchNode"    # a node type no ComfyUI has
OVERLAP_TOLERANCE = 1.0              # graph units: boxes that share only an edge do not overlap
RUN_END = ("execution_success", "execution_error", "execution_interrupted")

pytestmark = [
    pytest.mark.timeout(900),   # the first test of each ComfyUI waits for its start, every load and both runs
    pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="COMFYUI_PATH is not set: no ComfyUI to serve"),
    pytest.mark.skipif(importlib.util.find_spec("selenium") is None, reason="selenium is not installed"),
    pytest.mark.skipif(find_browser() is None, reason="no chromium and chromedriver found (CHROMIUM, CHROMEDRIVER)"),
]


@dataclass
class Load:
    """One workflow file dropped on the canvas in one node display."""
    name: str
    seconds: float
    nodes: int
    links: int
    overlaps: list[str]
    broken: list[str]
    moved: list[str]
    missing_expected: set[str]
    missing_reported: set[str]
    report_shown: bool
    screenshot: str


@dataclass
class Run:
    """The run queued from the page in one node display."""
    sent: str              # the report the server sent for the Info node (its ui text)
    drawn: str | None      # the text the node's box shows
    read_only: bool | None
    prompt_inputs: list[str]
    seconds: float
    widget: dict
    screenshot: str
    error: str = ""


@dataclass
class Site:
    label: str
    frontend: str
    displays: list[str]
    loads: dict[str, list[Load]] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    probe: set[str] = field(default_factory=set)
    reload: dict = field(default_factory=dict)


# ---- what the page shows ---------------------------------------------------------------------------------------------
def overlapping(boxes: dict[str, tuple[str, list[float]]]) -> list[str]:
    """Pairs of node boxes ({id: (title, [x, y, w, h])}) that share more than an edge."""
    found = []
    for (a, (ta, ra)), (b, (tb, rb)) in itertools.combinations(sorted(boxes.items()), 2):
        w = min(ra[0] + ra[2], rb[0] + rb[2]) - max(ra[0], rb[0])
        h = min(ra[1] + ra[3], rb[1] + rb[3]) - max(ra[1], rb[1])
        if w > OVERLAP_TOLERANCE and h > OVERLAP_TOLERANCE:
            found.append(f"{ta} ({a}) / {tb} ({b}): {w:.0f} x {h:.0f}")
    return found


def moved_values(saved: dict, loaded: dict) -> list[str]:
    """Nodes whose saved widgets_values do not read back in the same places after loading (a newer node may add
    widgets after them, with their defaults; an older node may lack widgets a newer one added last, whose saved values
    it drops)."""
    now = {str(n["id"]): n.get("widgets_values") or [] for n in loaded["nodes"]}
    moved = []
    for node in saved["nodes"]:
        want, got = node.get("widgets_values") or [], now.get(str(node["id"]), [])
        common = min(len(want), len(got))
        if isinstance(want, dict) or isinstance(got, dict) or got[:common] != want[:common]:
            moved.append(f"{node['type']} ({node['id']}): saved {want}, loaded {got}")
    return moved


def reported_types(texts: list[str], types: set[str]) -> set[str]:
    lines = {line.strip() for text in texts for line in text.splitlines()}
    return {t for t in types if t in lines}


def load_workflow(page: Page, path: str, known: set[str], shots: str, prefix: str) -> Load:
    name = os.path.basename(path)[:-len(".json")]
    with open(path) as f:
        saved = json.load(f)
    seconds = page.drop_workflow(path)
    graph = page.graph()
    boxes = {n["id"]: (n["title"], n["box"]) for n in graph["nodes"]}
    overlaps = overlapping(boxes)
    if graph["vue"]:   # the boxes the page drew, where they differ from the frontend's own
        drawn = {i: (boxes[i][0], r) for i, r in graph["drawn"].items() if i in boxes}
        overlaps += [o for o in overlapping(drawn) if o not in overlaps]
    types = {n["type"] for n in saved["nodes"]}
    texts = page.missing_nodes_report()
    if texts:
        page.screenshot(os.path.join(shots, f"{prefix}-{name}-missing-nodes.png"))
    loaded = json.loads(page.workflow())
    page.close_reports()
    shot = page.screenshot(os.path.join(shots, f"{prefix}-{name}.png"))
    return Load(name, seconds, len(graph["nodes"]), graph["links"], overlaps, graph["broken"],
                moved_values(saved, loaded), types - known, reported_types(texts, types), bool(texts), shot)


def probe_missing_report(page: Page, path: str, folder: str) -> set[str]:
    """Drops a copy of a workflow with one node's type renamed to one no ComfyUI has: what the page reports."""
    with open(path) as f:
        workflow = json.load(f)
    workflow["nodes"][0]["type"] = PROBE_TYPE
    probe = os.path.join(folder, "missing-node-probe.json")
    with open(probe, "w") as f:
        json.dump(workflow, f)
    page.drop_workflow(probe)
    found = reported_types(page.missing_nodes_report(), {PROBE_TYPE})
    page.close_reports()
    return found


def run_from_page(page: Page, server: Server, seed: int, shot: str) -> Run:
    info_id = page.build_run_graph(TINY_MODEL, seed)
    start = time.monotonic()
    page.click_run()
    page.wait("the run's end over the page's WebSocket",
              lambda: any(e["type"] in RUN_END for e in page.events()), 300, 0.5)
    seconds = time.monotonic() - start
    events = page.events()
    end = next(e for e in events if e["type"] in RUN_END)
    outputs = [e["detail"] for e in events if e["type"] == "executed"
               and str(e["detail"].get("display_node", e["detail"].get("node"))) == info_id]
    sent = "\n".join(outputs[-1]["output"]["text"]) if outputs else ""
    vue = page.graph()["vue"]
    page.focus_node(info_id)   # in view: the classic display hides the box of a node outside it

    def drawn():
        w = page.info_widget(info_id)
        text = w["vue_text"] if vue else (w["box_text"] if w["box_visible"] else None)
        return (w, text) if text and sent and text == sent else None
    try:
        widget, text = page.wait("the Info node's drawn report", drawn, 20)
    except TimeoutError:
        widget, text = page.info_widget(info_id), None
    prompt_id = next((e["detail"]["prompt_id"] for e in events if e["type"] == "execution_start"), None)
    prompt = get_json(f"{server.url}/history/{prompt_id}")[prompt_id]["prompt"][2] if prompt_id else {}
    return Run(sent, text, widget["vue_read_only"] if vue else widget["read_only"],
               sorted(prompt.get(info_id, {}).get("inputs", {})), seconds, widget, page.screenshot(shot),
               "" if end["type"] == "execution_success" else json.dumps(end["detail"])[:2000])


def reload_saved(page: Page, shot: str) -> dict:
    """Saves the graph the run left (as File > Save writes it) and loads it again."""
    saved = json.loads(page.workflow())
    info = next(n for n in saved["nodes"] if n["type"] == "XDiTEngineInfo")
    page.load_graph(json.dumps(saved))
    try:
        widget = page.wait("the reloaded Info node's report", lambda: (w := page.info_widget(str(info["id"])))["value"]
                           and w, 20)
    except TimeoutError:
        widget = page.info_widget(str(info["id"]))
    page.focus_node(str(info["id"]))
    return {"saved_widgets_values": info.get("widgets_values"), "saved_properties": info.get("properties", {}),
            "widget": widget, "screenshot": page.screenshot(shot)}


# ---- one ComfyUI, loaded and run once for every test below --------------------------------------------------------
def figures(site: Site) -> str:
    rows = [f"{site.label}, frontend {site.frontend}",
            (f"{'display':8} {'workflow':28} {'nodes':>5} {'links':>5} {'overlaps':>8} {'broken':>6} {'moved':>5} "
             f"{'missing-nodes report':32} {'load s':>6}")]
    for display, loads in site.loads.items():
        for x in loads:
            report = ("yes: " + ", ".join(sorted(x.missing_reported)) if x.missing_reported
                      else "yes (names none)" if x.report_shown else "no")
            rows.append(f"{display:8} {x.name:28} {x.nodes:5d} {x.links:5d} {len(x.overlaps):8d} {len(x.broken):6d} "
                        f"{len(x.moved):5d} {report:32} {x.seconds:6.2f}")
    for display, run in site.runs.items():
        rows.append(f"{display:8} run: {run.seconds:.1f} s to the end of the run; Info node drawn "
                    f"{'yes' if run.drawn else 'NO'}, {len(run.drawn or '')} characters")
    for display, loads in site.loads.items():
        for x in loads:
            rows += [f"  overlap {display} {x.name}: {o}" for o in x.overlaps]
    return "\n".join(rows)


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from engine.models.tiny import write_tiny
    return write_tiny("flux", str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = os.environ.get("XDIT_BROWSER_SHOTS") or str(tmp_path_factory.mktemp("browser-shots"))
    os.makedirs(folder, exist_ok=True)
    print(f"\nscreenshots and figures: {folder}")
    return folder


@pytest.fixture(scope="module", params=SUFFIXES, ids=lambda s: "COMFYUI_PATH" + s)
def site(request, tmp_path_factory, tiny_flux, shots):
    comfyui = os.environ.get("COMFYUI_PATH" + request.param)
    if not comfyui:
        pytest.skip(f"COMFYUI_PATH{request.param} is not set")
    python = os.environ.get("COMFYUI_PYTHON" + request.param) or os.environ.get("COMFYUI_PYTHON", sys.executable)
    base = str(tmp_path_factory.mktemp("comfyui"))
    make_base_directory(base, tiny_flux)
    server = Server(comfyui, python, os.environ.get("COMFYUI_PYTHONPATH" + request.param), base)
    page = None
    try:
        object_info = server.start()
        assert {"XDiTEngine", "XDiTSampler", "XDiTEngineInfo", "XDiTTestRandomConditioning"} <= set(object_info), \
            "the pack or the test's node pack did not load:\n" + server.log_tail()
        page = Page(server.url, os.path.join(base, "chromium-profile"), find_browser())
        page.open()
        assert "xDiT.EngineInfo" in page.extensions(), "the pack's frontend extension was not loaded"
        label = server.version()
        site = Site(label, page.frontend_version(), ["classic"] + (["vue"] if page.offers_vue_nodes() else []))
        prefix = label.replace("ComfyUI ", "comfyui-")
        for display in site.displays:
            if display == "vue":
                page.set_setting("Comfy.VueNodes.Enabled", True)
                page.open()
            known = page.registered_types()
            site.loads[display] = [load_workflow(page, path, known, shots, f"{prefix}-{display}")
                                   for path in ui_workflows()]
            if display == "classic":
                site.probe = probe_missing_report(page, ui_workflows()[0], base)
            site.runs[display] = run_from_page(page, server, int(time.time()) % 1_000_000 + len(site.runs),
                                               os.path.join(shots, f"{prefix}-{display}-info-after-run.png"))
            if display == "classic":
                site.reload = reload_saved(page, os.path.join(shots, f"{prefix}-{display}-info-after-reload.png"))
        if len(site.runs) < 2:   # one node display: a second run, so that each run is seen to draw its own report
            page.open()
            site.runs["classic, second run"] = run_from_page(
                page, server, int(time.time()) % 1_000_000 + len(site.runs),
                os.path.join(shots, f"{prefix}-classic-second-run.png"))
        table = figures(site)
        print("\n" + table)
        with open(os.path.join(shots, f"{prefix}-figures.txt"), "w") as f:
            f.write(table + "\n")
        yield site
    finally:
        if page:
            page.close()
        server.stop()


# ---- the checks ------------------------------------------------------------------------------------------------------
def test_the_missing_nodes_check_sees_a_node_type_the_running_comfyui_lacks(site):
    assert site.probe == {PROBE_TYPE}, f"{site.label}: the page did not report {PROBE_TYPE} as missing"


def test_a_workflow_reports_missing_nodes_exactly_where_the_running_comfyui_lacks_them(site):
    wrong = {f"{d} {x.name}": {"lacks": sorted(x.missing_expected), "reported": sorted(x.missing_reported),
                               "report shown": x.report_shown}
             for d, loads in site.loads.items() for x in loads
             if x.missing_reported != x.missing_expected or x.report_shown != bool(x.missing_expected)}
    assert not wrong, f"{site.label}: {json.dumps(wrong, indent=1)}"


def test_no_two_nodes_of_a_workflow_overlap(site):
    found = {f"{d} {x.name}": x.overlaps for d, loads in site.loads.items() for x in loads if x.overlaps}
    assert not found, f"{site.label}: {json.dumps(found, indent=1)}"


def test_every_link_joins_existing_slots_of_matching_types(site):
    found = {f"{d} {x.name}": x.broken for d, loads in site.loads.items() for x in loads if x.broken}
    assert not found, f"{site.label}: {json.dumps(found, indent=1)}"


def test_saved_widget_values_load_into_the_widgets_they_were_saved_from(site):
    found = {f"{d} {x.name}": x.moved for d, loads in site.loads.items() for x in loads if x.moved}
    assert not found, f"{site.label}: {json.dumps(found, indent=1)}"


def test_the_info_node_draws_the_report_of_a_run_queued_from_the_page_in_every_node_display(site):
    assert "classic" in site.runs and ("vue" in site.runs) == ("vue" in site.displays)
    for display, run in site.runs.items():
        assert not run.error, f"{site.label} {display}: the run failed: {run.error}"
        print(f"{site.label} {display}: drawn report:\n{run.drawn}")
        assert "last job:" in run.sent, run.sent
        assert run.drawn == run.sent, f"{site.label} {display}: the node shows {run.drawn!r}, not the report"
        assert run.read_only is True
        assert "report" not in run.prompt_inputs and {"engine", "unload", "after"} <= set(run.prompt_inputs)


def test_every_run_draws_its_own_report(site):
    drawn = [run.drawn for run in site.runs.values()]
    assert len(drawn) >= 2 and all(drawn) and len(set(drawn)) == len(drawn)   # each names its own job's timings


def test_the_report_survives_saving_and_reloading_with_unload_in_its_own_widget(site):
    reload, report = site.reload, site.runs["classic"].sent
    assert reload["saved_widgets_values"] == [True], "the Info node saves [unload] only, as every release did"
    assert reload["saved_properties"].get("xdit_report") == report
    assert reload["widget"]["unload"] is True and reload["widget"]["widgets"][0] == "unload"
    assert reload["widget"]["box_text"] == report and reload["widget"]["box_visible"]
