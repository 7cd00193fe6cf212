"""Compatibility as a promise: a prompt or workflow saved with any released version of the pack validates and runs
unchanged. tests/released_inputs.json keeps each released version's inputs for every node (from the history of
xdit_nodes/specs.py); the current specs must offer every released input with its type and options, in the same widget
order, and every input added after a node's first release must be optional with the default that keeps the earlier
behaviour. Prompts made of only a release's inputs go through a mirror of ComfyUI 0.3.64's prompt validation
(execution.py, validate_inputs) over our specs and the stock nodes the tests already describe. Pure data: no engine
starts here (the run with a first-release prompt is in tests/test_nodes.py and, in a real ComfyUI, in
tests/test_comfyui_live.py)."""
import importlib

import pytest

import comfyui_stock_nodes as stock
from conftest import PACK_NAME, load_pack

from released_prompts import RELEASED, WIDGETS, release_prompt

FIRST = RELEASED[0]
MODEL, LORA = "flux1-dev.safetensors", "style.safetensors"


@pytest.fixture(scope="module")
def node_specs():
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.specs")


def current_specs(node_specs) -> dict:
    """node id -> the current spec, as ComfyUI lists it with these files in the model and LoRA folders."""
    specs = (node_specs.engine_spec([MODEL]), node_specs.SAMPLER_SPEC, node_specs.lora_spec([LORA]), node_specs.GUIDER_SPEC,
             node_specs.INFO_SPEC, node_specs.SAMPLING_SPEC, node_specs.CFG_NORM_SPEC, node_specs.SAVE_CONDITIONING_SPEC,
             node_specs.SAMPLER_ADVANCED_SPEC)
    return {s.node_id: s for s in specs}


def first_release_of(node_id: str) -> dict:
    return next(r for r in RELEASED if node_id in r["nodes"])


def release_id(release: dict) -> str:
    return f"{release['commit'][:7]} {release['change']}"


# ---- the released inputs in the current specs --------------------------------------------------------------------
def test_the_table_holds_every_node_the_pack_has_and_the_first_release_is_first(node_specs):
    assert FIRST["change"].startswith("first release") and FIRST["commit"] == \
        "5f82299293f8396be2bf52ba020bf45d82cae241"
    assert set(RELEASED[-1]["nodes"]) == set(current_specs(node_specs))
    dates = [r["date"] for r in RELEASED]
    assert dates == sorted(dates)


@pytest.mark.parametrize("node_id", ["XDiTEngine", "XDiTSampler", "XDiTLoRA", "XDiTGuider", "XDiTEngineInfo",
                                     "XDiTModelSampling", "XDiTCFGNorm"])
def test_every_input_added_after_a_nodes_first_release_is_optional_with_a_default(node_specs, node_id):
    spec = current_specs(node_specs)[node_id]
    released = first_release_of(node_id)["nodes"][node_id]["inputs"]
    added = [f for f in spec.inputs if f.name not in released]
    print(f"{node_id}: first released with {list(released)}; added since: {[f.name for f in added]}")
    for f in added:
        assert f.optional, f"{node_id}.{f.name} was added after the node's first release and is required"
        if f.type in WIDGETS:
            assert f.default is not None, f"{node_id}.{f.name} is optional with no default"


@pytest.mark.parametrize("release", RELEASED, ids=release_id)
def test_every_released_input_is_still_there_with_its_type_options_and_default(node_specs, release):
    specs = current_specs(node_specs)
    for node_id, node in release["nodes"].items():
        fields = {f.name: f for f in specs[node_id].inputs}
        released_outputs = [tuple(o) for o in node["outputs"]]   # links keep their slots; new outputs come after
        assert list(specs[node_id].outputs)[:len(released_outputs)] == released_outputs, node_id
        for name, was in node["inputs"].items():
            where = f"{node_id}.{name} ({release_id(release)})"
            assert name in fields, f"{where} is gone"
            f = fields[name]
            assert f.type == was["type"], where
            if was.get("optional"):
                assert f.optional, f"{where} was optional and is now required"
            if "options" in was:   # a saved value must stay one of the options
                assert set(was["options"]) <= set(f.options), (where, set(was["options"]) - set(f.options))
            if "default" in was and f.type in ("INT", "FLOAT"):   # a saved default stays within range
                assert (f.min is None or was["default"] >= f.min) and (f.max is None or was["default"] <= f.max), where


@pytest.mark.parametrize("release", RELEASED, ids=release_id)
def test_released_widgets_keep_their_order_so_a_saved_ui_workflow_maps_its_values(node_specs, release):
    """A UI workflow saves widgets_values by position: the released widgets must come first, in their order, and new
    widgets after them (the frontend gives a value it did not save the widget's default)."""
    for node_id, node in release["nodes"].items():
        released = [n for n, e in node["inputs"].items() if e["type"] in WIDGETS]
        now = [f.name for f in current_specs(node_specs)[node_id].inputs if f.type in WIDGETS]
        assert now[:len(released)] == released, (node_id, release_id(release), now)


# ---- ComfyUI's prompt validation, mirrored -----------------------------------------------------------------------
def definitions(node_specs, engine_all_required: bool = False) -> dict:
    """node type -> {"inputs": {name: input}, "outputs": [type, ...]}: ours from the specs, the stock ones from
    tests/comfyui_stock_nodes.py. engine_all_required: the xDiT Engine's inputs all required, as they were before."""
    defs = {}
    for spec in current_specs(node_specs).values():
        all_required = engine_all_required and spec.node_id == "XDiTEngine"
        defs[spec.node_id] = {
            "inputs": {f.name: {"type": f.type, "optional": f.optional and not all_required, "min": f.min,
                                "max": f.max, "options": f.options if f.name not in ("model_name", "lora_name") else ()}
                       for f in spec.inputs},
            "outputs": [t for t, _ in spec.outputs], "files": {"model_name": [MODEL], "lora_name": [LORA]}}
    for node_type, d in stock.STOCK_NODES.items():
        defs[node_type] = {"inputs": {i["name"]: {"type": i["type"], "optional": i.get("optional", False),
                                                  "min": i.get("min"), "max": i.get("max"),
                                                  "options": i.get("options", ())} for i in d["inputs"]},
                           "outputs": [t for t, _ in d["outputs"]], "files": {}}
    return defs


def validate(prompt: dict, defs: dict) -> dict:
    """{node id: [error, ...]} as ComfyUI 0.3.64's validate_inputs finds them: a required input missing ("Required
    input is missing"), a link of another type, a value that does not convert to its type or lies outside min/max,
    and a file name not in its folder (our validate_inputs). Stricter than ComfyUI in one way: fixed COMBO options are
    checked for V3 nodes too (ComfyUI 0.3.64 checks them only for V1 nodes)."""
    errors = {}
    for node_id, node in prompt.items():
        d, found = defs[node["class_type"]], []
        for name, spec in d["inputs"].items():
            if name not in node["inputs"]:
                if not spec["optional"]:
                    found.append(f"Required input is missing: {name}")
                continue
            value = node["inputs"][name]
            if isinstance(value, list):
                source = defs[prompt[value[0]]["class_type"]]["outputs"][value[1]]
                if source != spec["type"]:
                    found.append(f"Return type mismatch between linked nodes: {name}, {source} != {spec['type']}")
                continue
            try:
                value = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}.get(spec["type"], lambda v: v)(
                    value)
            except (TypeError, ValueError):
                found.append(f"Failed to convert an input value to a {spec['type']} value: {name}")
                continue
            if spec["min"] is not None and value < spec["min"] or spec["max"] is not None and value > spec["max"]:
                found.append(f"Value out of range: {name}={value}")
            if spec["options"] and value not in spec["options"]:
                found.append(f"Value not in list: {name}: {value!r}")
            if name in d["files"] and value not in d["files"][name]:
                found.append(f"Custom validation failed for node: {name}")
        if found:
            errors[node_id] = found
    return errors


@pytest.mark.parametrize("release", RELEASED, ids=release_id)
def test_a_prompt_with_only_a_released_input_set_passes_validation(node_specs, release):
    prompt = release_prompt(release, MODEL, LORA)
    assert set(prompt["10"]["inputs"]) == set(release["nodes"]["XDiTEngine"]["inputs"])  # no later input in it
    errors = validate(prompt, definitions(node_specs))
    print(f"{release_id(release)}: {len(prompt)} nodes, errors {errors}")
    assert errors == {}


def test_the_first_release_prompt_fails_the_same_validation_when_later_inputs_are_required(node_specs):
    """The check above would catch the regression: with every input required (as before this rule), ComfyUI answers
    "Required input is missing" for each input added since the first release."""
    errors = validate(release_prompt(FIRST, MODEL, LORA), definitions(node_specs, engine_all_required=True))
    print(errors)
    added = [f.name for f in node_specs.engine_spec([MODEL]).inputs if f.name not in FIRST["nodes"]["XDiTEngine"]["inputs"]]
    assert errors == {"10": [f"Required input is missing: {name}" for name in added]}
    assert added == ["cache_threshold", "compile", "attention", "pipefusion", "patches", "warmup_steps",
                     "expert_placement", "shard"]


def test_the_validation_mirror_refuses_what_comfyui_refuses(node_specs):
    defs = definitions(node_specs)
    prompt = release_prompt(RELEASED[-1], MODEL, LORA)
    prompt["12"]["inputs"]["positive"] = ["5", 0]        # a LATENT into a CONDITIONING input
    prompt["12"]["inputs"]["steps"] = 0                  # below min
    prompt["12"]["inputs"]["sampler_name"] = "no_such"   # not an option
    prompt["10"]["inputs"]["model_name"] = "other.safetensors"
    del prompt["12"]["inputs"]["seed"]
    errors = validate(prompt, defs)
    print(errors)
    assert len(errors["12"]) == 4 and any("Required input is missing: seed" in e for e in errors["12"])
    assert errors["10"] == ["Custom validation failed for node: model_name"]
