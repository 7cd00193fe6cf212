"""Writes workflows/NAME.json (UI format) and workflows/api/NAME.api.json (API format) for every graph in
tests/workflow_graphs.py. Each node is given the size both frontends draw it at (tests/node_layout.py, rounded up to
GRID) and a place in its graph's columns, left to right in column order and top to bottom within a column, with
gaps between the boxes (title bars included), so no two nodes overlap and every link runs rightwards (or down to a
node below in the same column).

    python tests/make_workflows.py            # write the files
    python tests/make_workflows.py --check    # exit 1 and name the files that differ from what it would write
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import node_layout  # noqa: E402
import workflow_graphs  # noqa: E402
from workflow_nodes import current_title, definitions, sockets, widgets  # noqa: E402

WORKFLOW_DIR = os.path.join(ROOT, "workflows")
API_DIR = os.path.join(WORKFLOW_DIR, "api")   # ComfyUI's template list reads workflows/*.json only
GRID = 10          # sizes and places are whole multiples of it
GAP_X = 70         # between columns
GAP_Y = 50         # between a node's bottom and the next one's title bar: room for the badges drawn above a title
VUE_CLEARANCE = 10  # Nodes 2.0 draws nodes larger and no badge above a title: it may fill a gap but this much
ORIGIN = (0, 0)    # the first column's left edge, the top of its first title bar
VIEW = (1920, 960)  # the page (a full-HD browser window) extra.ds fits the graph into on opening ...
VIEW_MARGINS = (80, 110, 40, 40)  # ... clear of the frontends' side bar and top bars (left, top, right, bottom)


def _up(value: float) -> int:
    return int(math.ceil(value / GRID) * GRID)


def model_names() -> list[str]:
    return sorted({n.values[0] for g in workflow_graphs.graphs() for n in g.nodes
                   if n.type in ("XDiTEngine", "XDiTCheckpointLoader")})


def sizes(graph, defs) -> dict:
    out = {}
    for node in graph.nodes:
        w, h = node_layout.min_size(node.type, defs[node.type], node.values, node.title)
        out[node.key] = [_up(max(w, node.size[0])), _up(max(h, node.size[1]))]
    return out


def footprint(node, size, defs) -> tuple[int, int]:
    """The (w, h) the layout keeps for a node's body: its size, the room it may grow to later (the Info node after a
    run), and the box Nodes 2.0 draws it in (node_layout.vue_size), less the gaps after it but VUE_CLEARANCE."""
    w, h = size[node.key]
    vue_w, vue_h = node_layout.vue_size(node.type, defs[node.type], (w, h))
    return (max(w, _up(node.room[0]), _up(vue_w - GAP_X + VUE_CLEARANCE)),
            max(h, _up(node.room[1]), _up(vue_h - node_layout.TITLE_HEIGHT - GAP_Y + VUE_CLEARANCE)))


def places(graph, size, defs) -> dict:
    """Columns left to right, each as wide as its widest node; nodes top to bottom in the order they were added, each
    keeping its footprint free."""
    columns = sorted({n.column for n in graph.nodes})
    x, pos = ORIGIN[0], {}
    for c in columns:
        y = ORIGIN[1]
        members = [n for n in graph.nodes if n.column == c]
        for n in members:
            pos[n.key] = [x, y + node_layout.TITLE_HEIGHT]
            y += node_layout.TITLE_HEIGHT + footprint(n, size, defs)[1] + GAP_Y
        x += max(footprint(n, size, defs)[0] for n in members) + GAP_X
    return pos


def execution_order(graph) -> dict:
    """node key -> its place in an order where every link runs forward (sources first, then by id)."""
    order, done = {}, set()
    while len(done) < len(graph.nodes):
        ready = [n for n in graph.nodes if n.key not in done
                 and all(src.key in done for src, _ in n.links.values())]
        first = min(ready, key=lambda n: n.key)
        order[first.key] = len(order)
        done.add(first.key)
    return order


def models_of(node) -> list:
    entries = []
    for value in node.values:
        if isinstance(value, str) and value in workflow_graphs.MODEL_SOURCES:
            url, folder = workflow_graphs.MODEL_SOURCES[value]
            entries.append({"name": value, "url": url, "directory": folder})
    return entries


def input_slots(node, definition) -> list:
    """A node's input slots as the UI file saves them: its sockets, then each widget a link feeds (in widget order),
    as the frontend saves a widget input with a link: {"name", "type", "widget": {"name"}, "link"} (its value stays in
    widgets_values; the API prompt gives the link in its place)."""
    return sockets(definition) + [w for w in widgets(definition) if w["name"] in node.links]


def ui_workflow(graph, defs) -> dict:
    size = sizes(graph, defs)
    pos, order = places(graph, size, defs), execution_order(graph)
    links, feeds = [], {}
    for node in graph.nodes:
        names = [s["name"] for s in input_slots(node, defs[node.type])]
        unknown = set(node.links) - set(names)
        assert not unknown, f"{graph.name}: {node.type} has no input {sorted(unknown)}"
        for name, (src, slot) in sorted(node.links.items(), key=lambda kv: names.index(kv[0])):
            link_type = defs[src.type]["outputs"][slot][0]
            links.append([len(links) + 1, src.key, slot, node.key, names.index(name), link_type])
            feeds[(node.key, name)] = len(links)
    nodes = []
    for node in graph.nodes:
        d = defs[node.type]
        entry = {"id": node.key, "type": node.type, "pos": pos[node.key], "size": size[node.key], "flags": {},
                 "order": order[node.key], "mode": 0,
                 "inputs": [dict({"name": s["name"], "type": s["type"]},
                                 **({"widget": {"name": s["name"]}} if "widget" in s else {}),
                                 link=feeds.get((node.key, s["name"])))
                            for s in input_slots(node, d)],
                 "outputs": [{"name": n, "type": t, "slot_index": i,
                              "links": [l[0] for l in links if l[1] == node.key and l[2] == i]}
                             for i, (t, n) in enumerate(d["outputs"])],
                 "properties": {"Node name for S&R": node.type},
                 "widgets_values": node.values}
        if node.title:
            entry["title"] = node.title
        if models_of(node):
            entry["properties"]["models"] = models_of(node)
        nodes.append(entry)
    return {"last_node_id": len(nodes), "last_link_id": len(links), "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {"ds": view(nodes)}, "version": 0.4}


def view(nodes) -> dict:
    """extra.ds: the canvas scale and offset that show the whole graph in a VIEW-sized page area."""
    left = min(n["pos"][0] for n in nodes)
    top = min(n["pos"][1] for n in nodes) - node_layout.TITLE_HEIGHT
    right = max(n["pos"][0] + n["size"][0] for n in nodes)
    bottom = max(n["pos"][1] + n["size"][1] for n in nodes)
    ml, mt, mr, mb = VIEW_MARGINS
    scale = min(1.0, (VIEW[0] - ml - mr) / (right - left), (VIEW[1] - mt - mb) / (bottom - top))
    scale = math.floor(scale * 100) / 100
    return {"scale": scale, "offset": [round(ml / scale - left, 1), round(mt / scale - top, 1)]}


def api_workflow(ui, defs) -> dict:
    """What the frontend queues for the UI workflow (File > Export (API)): every node but the frontend's own
    (virtual) ones by its id, widget values by name (and by their api_alias), links as [source id, source slot]."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        d = defs[node["type"]]
        if d.get("virtual"):
            continue
        inputs, values = {}, iter(node["widgets_values"])
        for w in widgets(d):
            inputs[w["name"]] = next(values)
            if "api_alias" in w:
                inputs[w["api_alias"]] = inputs[w["name"]]
            if "ui_extra" in w:
                next(values)
        for socket in node["inputs"]:
            if socket["link"] is not None:
                _, src, slot, _, _, _ = links[socket["link"]]
                inputs[socket["name"]] = [str(src), slot]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                "_meta": {"title": node.get("title") or current_title(node["type"], d)}}
    return api


def dump(data) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def files() -> dict:
    """path relative to the repository -> text, for every file this writes."""
    defs = definitions(model_names())
    out = {}
    for graph in workflow_graphs.graphs():
        ui = ui_workflow(graph, defs)
        out[f"workflows/{graph.name}.json"] = dump(ui)
        out[f"workflows/api/{graph.name}.api.json"] = dump(api_workflow(ui, defs))
    return out


def main(argv) -> int:
    wanted = files()
    if "--check" in argv:
        stale = [p for p, text in wanted.items()
                 if not os.path.exists(os.path.join(ROOT, p)) or open(os.path.join(ROOT, p)).read() != text]
        for p in stale:
            print(f"{p} differs from what tests/make_workflows.py writes: run python tests/make_workflows.py")
        return 1 if stale else 0
    os.makedirs(API_DIR, exist_ok=True)
    for p, text in wanted.items():
        with open(os.path.join(ROOT, p), "w") as f:
            f.write(text)
    print(f"wrote {len(wanted)} files under workflows/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
