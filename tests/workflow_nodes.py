"""The nodes a workflow in workflows/ may use, in one shape: ours from xdit_nodes/specs.py, ComfyUI's stock ones and
the frontend's own from tests/comfyui_stock_nodes.py. Inputs come in the order ComfyUI's frontend builds a node's
sockets and widgets (getOrderedInputSpecs: the required inputs in declaration order, then the optional ones), which
is the order a UI workflow saves them in."""
import importlib

import comfyui_stock_nodes as stock
from conftest import PACK_NAME, load_pack

WIDGET_TYPES = ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN")
NEWEST_FRONTEND = "1.49.6"
SEED_CONTROL = {"name": "control_after_generate", "values": ("fixed", "increment", "decrement", "randomize")}
_KINDS = {"COMBO": "combo", "INT": "number", "FLOAT": "number", "STRING": "text", "BOOLEAN": "toggle"}


def specs_module():
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.specs")


def _frontend_order(inputs):
    return tuple(i for i in inputs if not i.get("optional")) + tuple(i for i in inputs if i.get("optional"))


def _from_spec(spec):
    inputs = []
    for f in spec.inputs:
        entry = {"name": f.name, "type": f.type, "optional": f.optional}
        if f.type in WIDGET_TYPES:
            entry.update(widget=_KINDS[f.type], options=tuple(f.options), min=f.min, max=f.max, step=f.step)
            if f.control_after_generate:
                entry["ui_extra"] = SEED_CONTROL
        inputs.append(entry)
    return {"display_name": spec.display_name, "inputs": _frontend_order(inputs),
            "outputs": tuple((t, n) for t, n in spec.outputs), "output_node": spec.output_node, "ours": True}


def definitions(model_names) -> dict:
    """Node type -> definition. The engine's model_name options are ComfyUI's model folders at run time: here they
    are `model_names`, the files the workflows name. The samplers offer ComfyUI's sampler and scheduler lists, as
    they do inside ComfyUI."""
    specs = specs_module()
    lists = (stock.SAMPLER_NAMES, stock.SCHEDULER_NAMES)
    ours = [specs.engine_spec(sorted(set(model_names))), specs.sampler_spec(*lists),
            specs.sampler_advanced_spec(*lists), specs.INFO_SPEC, specs.GUIDER_SPEC, specs.SAMPLING_SPEC,
            specs.CFG_NORM_SPEC]
    defs = {spec.node_id: _from_spec(spec) for spec in ours}
    assert not set(defs) & set(stock.STOCK_NODES) and not set(defs) & set(stock.FRONTEND_NODES)
    for node_type, d in list(stock.STOCK_NODES.items()) + list(stock.FRONTEND_NODES.items()):
        defs[node_type] = dict(d, inputs=_frontend_order(d["inputs"]), ours=False)
    return defs


def sockets(definition):
    return [i for i in definition["inputs"] if "widget" not in i]


def widgets(definition):
    return [i for i in definition["inputs"] if "widget" in i]


def titles(node_type, definition) -> set:
    """Every title a frontend shows for a node of this type that has no title of its own."""
    return {definition["display_name"]} | {t[node_type] for t in stock.FRONTEND_TITLES.values() if node_type in t}


def current_title(node_type, definition) -> str:
    """The title the newest frontend checked shows for a node of this type that has no title of its own (and puts in
    the API prompt's _meta)."""
    return stock.FRONTEND_TITLES[NEWEST_FRONTEND].get(node_type, definition["display_name"])


def drawn_outputs(node_type, definition):
    """The outputs a node shows on the newest ComfyUI checked (a later version may have added some)."""
    return tuple(definition["outputs"]) + stock.LATER_OUTPUTS.get(node_type, ())
