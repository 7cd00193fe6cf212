"""The example workflows in workflows/: each UI (drag-and-drop) file is a well-formed ComfyUI graph of known nodes
(the pack's, from xdit_nodes/specs.py; the stock and the frontend's own ones, from tests/comfyui_stock_nodes.py and
the MiniMax-H3 workflows' stock nodes in tests/workflow_nodes.py), its
links join outputs to inputs of the same type, its widget values fit their widgets, its nodes are drawn without
overlapping or cutting a text short, and its api/ twin is exactly its translation to the API prompt format. The files
are what tests/make_workflows.py writes from tests/workflow_graphs.py. Pure JSON checks: no engine starts."""
import glob
import json
import math
import os
import re

import pytest

import comfyui_stock_nodes as stock
import make_workflows
import node_layout
from conftest import ROOT
from workflow_nodes import current_title, definitions as node_definitions, sockets, widgets

WORKFLOW_DIR = os.path.join(ROOT, "workflows")
WORKFLOWS = ("flux1-dev", "flux1-schnell", "sd3.5-large", "flux1-dev-img2img", "flux1-kontext-dev", "qwen-image",
             "qwen-image-edit", "flux2-dev", "flux2-dev-multi-reference", "flux2-klein-4b", "krea-2", "wan2.1-t2v-1.3b",
             "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "wan-animate-2", "hunyuanvideo-1.5-t2v",
             "hunyuanvideo-1.5-i2v", "minimax-h3-t2v", "minimax-h3-i2v", "ltx-2.3-t2v", "ltx-2.3-i2v", "ltx-2.3-flf",
             "ltx-2.5-t2v", "ltx-2.5-i2v", "ltx-2.5-flf")
VIDEO_WORKFLOWS = ("wan2.1-t2v-1.3b", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "wan-animate-2",
                   "hunyuanvideo-1.5-t2v", "hunyuanvideo-1.5-i2v", "minimax-h3-t2v", "minimax-h3-i2v", "ltx-2.3-t2v",
                   "ltx-2.3-i2v", "ltx-2.3-flf", "ltx-2.5-t2v", "ltx-2.5-i2v", "ltx-2.5-flf")
# Two passes on one model (LTX-2.3, LTX-2.5: the second after the latent upsampler), each its own sampler
TWO_PASSES = ("ltx-2.3-t2v", "ltx-2.3-i2v", "ltx-2.5-t2v", "ltx-2.5-i2v")
MODEL_FILES = {"flux1-dev": "flux1-dev.safetensors", "flux1-schnell": "flux1-schnell.safetensors",
               "sd3.5-large": "sd3.5_large.safetensors", "flux1-dev-img2img": "flux1-dev.safetensors",
               "flux1-kontext-dev": "flux1-kontext-dev.safetensors", "qwen-image": "qwen_image_fp8_e4m3fn.safetensors",
               "qwen-image-edit": "qwen_image_edit_fp8_e4m3fn.safetensors",
               # Comfy-Org's repackaged FLUX.2 files (split_files/diffusion_models)
               "flux2-dev": "flux2_dev_fp8mixed.safetensors",
               "flux2-dev-multi-reference": "flux2_dev_fp8mixed.safetensors",
               "flux2-klein-4b": "flux-2-klein-4b.safetensors",
               # Comfy-Org's Krea 2 Turbo in mixed-precision fp8, as its template loads it
               "krea-2": "krea2_turbo_fp8_scaled.safetensors",
               # Comfy-Org's repackaged Wan files (split_files/diffusion_models)
               "wan2.1-t2v-1.3b": "wan2.1_t2v_1.3B_fp16.safetensors", "wan2.2-ti2v-5b": "wan2.2_ti2v_5B_fp16.safetensors",
               # Comfy-Org's distilled Wan-Animate 2 in int8 ConvRot, as its Motion Transfer template loads it
               "wan-animate-2": "wan_animate_2_distill_int8_convrot.safetensors",
               # Comfy-Org's repackaged HunyuanVideo 1.5 files, as its 720p templates load them
               "hunyuanvideo-1.5-t2v": "hunyuanvideo1.5_720p_t2v_fp16.safetensors",
               "hunyuanvideo-1.5-i2v": "hunyuanvideo1.5_720p_i2v_fp16.safetensors",
               # Comfy-Org's MiniMax-H3 bf16 file (the templates' int8_convrot file is not one the engine reads)
               "minimax-h3-t2v": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
               "minimax-h3-i2v": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
               # the LTX-2.3 templates' one file (model, text projection, VAE): the xDiT Checkpoint Loader's
               "ltx-2.3-t2v": "ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-i2v": "ltx-2.3-22b-dev-fp8.safetensors",
               "ltx-2.3-flf": "ltx-2.3-22b-distilled-fp8.safetensors",
               # the LTX-2.5 templates' distilled file in int8 ConvRot (UNETLoader's)
               **{f"ltx-2.5-{k}": "ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors"
                  for k in ("t2v", "i2v", "flf")}}
# Two-expert models: an engine per expert, (high noise, low noise), each with its own sampler
EXPERT_FILES = {f"wan2.2-{kind}-a14b": tuple(f"wan2.2_{kind}_{noise}_noise_14B_fp8_scaled.safetensors"
                                             for noise in ("high", "low")) for kind in ("t2v", "i2v")}
# The ComfyUI each workflow needs: FLUX.2 [dev] arrived in 0.3.72, [klein]'s Qwen3 text encoder in 0.9.2, MiniMax-H3
# (its nodes, text encoder type and VAEs) in 0.33.0, Wan-Animate 2 (its model and WanAnimate2ToVideo) in 0.31.0.
NEEDS_COMFYUI = {"flux2-dev": "0.3.72", "flux2-dev-multi-reference": "0.3.72", "flux2-klein-4b": "0.9.2",
                 "krea-2": "0.26.0", "wan-animate-2": "0.31.0", "hunyuanvideo-1.5-t2v": "0.3.71",
                 "hunyuanvideo-1.5-i2v": "0.3.71",
                 "minimax-h3-t2v": "0.33.0", "minimax-h3-i2v": "0.33.0", "ltx-2.3-t2v": "0.33.0", "ltx-2.3-i2v": "0.33.0",
                 "ltx-2.3-flf": "0.33.0", "ltx-2.5-t2v": "0.33.0", "ltx-2.5-i2v": "0.33.0", "ltx-2.5-flf": "0.33.0"}
# stock MODEL -> MODEL nodes the templates use
MODEL_PATCHES = ("ModelSamplingAuraFlow", "ModelSamplingSD3", "CFGNorm", "LoraLoaderModelOnly")
SAMPLERS = ("XDiTSampler", "XDiTSamplerAdvanced", "SamplerCustomAdvanced", "SamplerCustom")
# the loaders that stand in for the template's: (node, its model file input, its MODEL slot, its engine slot)
ENGINES = {"XDiTEngine": ("model_name", 1, 0), "XDiTCheckpointLoader": ("ckpt_name", 0, 3)}
# model-file widgets and the models/ folders their files belong in
MODEL_WIDGETS = {("XDiTEngine", "model_name"): ("diffusion_models", "checkpoints"),
                 ("XDiTCheckpointLoader", "ckpt_name"): ("checkpoints",),
                 ("LTXAVTextEncoderLoader", "text_encoder"): ("text_encoders",),
                 ("LTXAVTextEncoderLoader", "ckpt_name"): ("checkpoints",), ("LTXVAudioVAELoader", "ckpt_name"): ("checkpoints",),
                 ("LatentUpscaleModelLoader", "model_name"): ("latent_upscale_models",),
                 ("VAELoader", "vae_name"): ("vae",), ("XDiTVAELoader", "vae_name"): ("vae",),
                 ("CLIPLoader", "clip_name"): ("text_encoders",), ("CLIPVisionLoader", "clip_name"): ("clip_vision",),
                 ("LoraLoaderModelOnly", "lora_name"): ("loras",),
                 **{(t, f"clip_name{i}"): ("text_encoders",)
                    for t, n in (("DualCLIPLoader", 2), ("TripleCLIPLoader", 3)) for i in range(1, n + 1)}}
FOLDER_EXTENSIONS = {"text_encoders": (".safetensors",), "vae": (".safetensors",), "loras": (".safetensors",),
                     "checkpoints": (".safetensors",), "latent_upscale_models": (".safetensors",),
                     "clip_vision": (".safetensors",),
                     "input": (".png", ".jpg", ".jpeg", ".webp", ".mp4")}


@pytest.fixture(scope="module")
def definitions():
    return node_definitions(list(MODEL_FILES.values()) + [f for pair in EXPERT_FILES.values() for f in pair])


def load(name):
    with open(os.path.join(WORKFLOW_DIR, f"{name}.json")) as f:
        ui = json.load(f)
    with open(os.path.join(WORKFLOW_DIR, "api", f"{name}.api.json")) as f:
        api = json.load(f)
    return ui, api


def widget_values(node, definition):
    """{widget name: value} from a UI node's widgets_values, skipping the UI-only values (control_after_generate's
    mode, LoadImage's upload button); (name, extra value) pairs of those come second."""
    wv = node["widgets_values"]
    expected = sum(2 if "ui_extra" in w else 1 for w in widgets(definition))
    assert len(wv) == expected, f"node {node['id']} ({node['type']}): {len(wv)} widgets_values, its widgets take " \
                                f"{expected}"
    values, extras, i = {}, [], 0
    for w in widgets(definition):
        values[w["name"]] = wv[i]
        i += 1
        if "ui_extra" in w:
            extras.append((w, wv[i]))
            i += 1
    return values, extras


def ui_to_api(ui, definitions):
    """What ComfyUI's frontend queues (File > Export (API)) for a UI workflow with no muted, bypassed or
    primitive-fed widgets: every node but the frontend's own (virtual) ones by its id, widget values by name (and
    by the other name the newest frontend also sends one under), links as [source id, source slot] (a widget's link
    in place of its value), the title the newest frontend shows."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        assert node["mode"] == 0, f"node {node['id']} is muted or bypassed"
        definition = definitions[node["type"]]
        if definition.get("virtual"):
            continue
        inputs, _ = widget_values(node, definition)
        inputs.update({w["api_alias"]: inputs[w["name"]] for w in widgets(definition) if "api_alias" in w})
        for socket in node["inputs"]:
            if socket["link"] is not None:
                _, src, src_slot, _, _, _ = links[socket["link"]]
                inputs[socket["name"]] = [str(src), src_slot]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                "_meta": {"title": node.get("title") or current_title(node["type"], definition)}}
    return api


def source(api, node_id, input_name):
    """The API node feeding node_id's input_name: (id, node)."""
    src, _ = api[node_id]["inputs"][input_name]
    return src, api[src]


def only(api, class_type):
    ids = [i for i, n in api.items() if n["class_type"] == class_type]
    assert len(ids) == 1, f"{len(ids)} {class_type} nodes"
    return ids[0], api[ids[0]]


def all_of(api, class_types):
    """[(id, node), ...] of these types, in id order."""
    return sorted(((i, n) for i, n in api.items() if n["class_type"] in class_types), key=lambda item: int(item[0]))


def model_files(name):
    return EXPERT_FILES.get(name) or (MODEL_FILES[name],)


def model_chain(api, node_id, input_name="model"):
    """The MODEL nodes from node_id's input back to the xDiT Engine: [(id, node), ...], the engine last."""
    chain, (src_id, src) = [], source(api, node_id, input_name)
    while src["class_type"] in MODEL_PATCHES:
        chain.append((src_id, src))
        src_id, src = source(api, src_id, "model")
    return chain + [(src_id, src)]


def box(node):
    """The node as drawn: its body and the title bar above it (x, y, w, h)."""
    x, y = node["pos"]
    w, h = node["size"]
    return x, y - node_layout.TITLE_HEIGHT, w, h + node_layout.TITLE_HEIGHT


def overlaps(ui):
    """Pairs of node ids whose drawn boxes intersect."""
    found, nodes = [], ui["nodes"]
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = box(a)
        for b in nodes[i + 1:]:
            bx, by, bw, bh = box(b)
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((a["id"], b["id"]))
    return found


def undersized(ui, definitions):
    """Nodes saved smaller than a frontend draws them (so drawn larger than saved) or cutting a text short."""
    found = []
    for n in ui["nodes"]:
        need = node_layout.min_size(n["type"], definitions[n["type"]], n["widgets_values"], n.get("title"))
        if n["size"][0] < need[0] or n["size"][1] < need[1]:
            found.append((n["id"], n["type"], n["size"], need))
    return found


# ---- the files ----------------------------------------------------------------------------------------------------
def test_the_workflow_files_are_what_make_workflows_writes():
    """Regenerate with `python tests/make_workflows.py` after changing a graph or a node's inputs: the sizes follow
    the widgets."""
    wanted = make_workflows.files()
    assert sorted(wanted) == sorted([f"workflows/{n}.json" for n in WORKFLOWS] +
                                    [f"workflows/api/{n}.api.json" for n in WORKFLOWS])
    for path, text in wanted.items():
        with open(os.path.join(ROOT, path)) as f:
            assert f.read() == text, f"{path} is not what tests/make_workflows.py writes: run it"


def test_the_template_list_holds_the_ui_workflows_only_each_with_a_thumbnail():
    """ComfyUI lists a pack's templates as custom_node_manager.py does (glob <pack>/workflows/*.json, no subfolder,
    in 0.3.64 and 0.33.0 alike) and both frontends fetch each card's picture as <name>.jpg beside it."""
    listed = sorted(os.path.basename(p)[:-len(".json")] for p in glob.glob(os.path.join(WORKFLOW_DIR, "*.json")))
    assert listed == sorted(WORKFLOWS)
    for name in WORKFLOWS:
        with open(os.path.join(WORKFLOW_DIR, f"{name}.jpg"), "rb") as f:
            picture = f.read()
        assert picture[:3] == b"\xff\xd8\xff" and 2_000 < len(picture) < 200_000, name
    assert sorted(glob.glob(os.path.join(WORKFLOW_DIR, "*.jpg"))) == \
        sorted(os.path.join(WORKFLOW_DIR, f"{n}.jpg") for n in WORKFLOWS)


# ---- every workflow ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_node_is_ours_or_stock_and_none_is_replaced_by_the_pack(name, definitions):
    ui, api = load(name)
    types = [n["type"] for n in ui["nodes"]]
    assert set(types) <= set(definitions), set(types) - set(definitions)
    assert not set(types) & set(stock.REPLACED_BY_XDIT)
    assert not {n["class_type"] for n in api.values()} & set(stock.REPLACED_BY_XDIT)
    # the engine's own sampling nodes stay for saved workflows; shipped ones patch the MODEL with ComfyUI's nodes
    assert not set(types) & {"XDiTModelSampling", "XDiTCFGNorm", "XDiTGuider"}
    saves = ("CreateVideo", "SaveVideo") if name in VIDEO_WORKFLOWS else ("SaveImage",)
    for t in ("XDiTEngineInfo",) + saves:
        assert types.count(t) == 1, (t, types.count(t))
    assert types.count("VAEDecode") + types.count("VAEDecodeTiled") == 1
    assert not {"SaveImage", "CreateVideo", "SaveVideo"} - set(saves) & set(types)
    # one engine per model file (two for a two-expert model) and a sampler per engine and pass
    passes = 2 if name in TWO_PASSES else 1
    engines = sum(types.count(t) for t in ENGINES)
    assert engines == len(model_files(name)) and sum(types.count(t) for t in SAMPLERS) == engines * passes
    for node in ui["nodes"]:
        assert node["properties"]["Node name for S&R"] == node["type"]
    assert ui["version"] == 0.4 and ui["groups"] == [] and isinstance(ui["config"], dict)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_ui_links_join_outputs_to_inputs_of_the_same_type_and_agree_with_the_nodes(name, definitions):
    ui, _ = load(name)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "duplicate node ids"
    link_ids = [link[0] for link in ui["links"]]
    assert len(set(link_ids)) == len(link_ids), "duplicate link ids"
    assert ui["last_node_id"] >= max(nodes) and ui["last_link_id"] >= max(link_ids)

    # each node's sockets are its type's, in the frontend's order, then the widgets a link feeds (in widget order, as
    # the frontend saves a widget input: {"widget": {"name"}}, its link), and every required input is connected
    for node in ui["nodes"]:
        definition = definitions[node["type"]]
        plain = [s for s in node["inputs"] if "widget" not in s]
        fed = node["inputs"][len(plain):]
        assert [(s["name"], s["type"]) for s in plain] == \
            [(s["name"], s["type"]) for s in sockets(definition)], node["type"]
        assert [(s["name"], s["type"], s["widget"]) for s in fed] == \
            [(w["name"], w["type"], {"name": w["name"]}) for w in widgets(definition)
             if w["name"] in {s["name"] for s in fed}], node["type"]
        assert all(s["link"] is not None for s in fed), node["type"]
        assert [(o["name"], o["type"], o.get("slot_index", i)) for i, o in enumerate(node["outputs"])] == \
            [(n, t, i) for i, (t, n) in enumerate(definition["outputs"])], node["type"]
        for s, spec in zip(plain, sockets(definition)):
            assert s["link"] is not None or spec.get("optional"), f"{node['type']}.{s['name']} is not connected"

    # the links table against the nodes
    for link_id, src, src_slot, dst, dst_slot, link_type in ui["links"]:
        assert src in nodes and dst in nodes, (link_id, src, dst)
        out_sockets, in_sockets = nodes[src]["outputs"], nodes[dst]["inputs"]
        assert 0 <= src_slot < len(out_sockets) and 0 <= dst_slot < len(in_sockets), link_id
        # an input of several types ("IMAGE,MASK": a match-type input) takes a link of any one of them
        assert out_sockets[src_slot]["type"] == link_type in in_sockets[dst_slot]["type"].split(","), link_id
        assert link_id in (out_sockets[src_slot]["links"] or []), link_id
        assert in_sockets[dst_slot]["link"] == link_id, link_id
    # ... and the nodes against the links table: no link id a node names is missing or misplaced
    table = {link[0]: link for link in ui["links"]}
    for node in ui["nodes"]:
        for slot, s in enumerate(node["inputs"]):
            if s["link"] is not None:
                assert table[s["link"]][3:5] == [node["id"], slot], (node["id"], s["name"])
        for slot, o in enumerate(node["outputs"]):
            for link_id in o["links"] or []:
                assert table[link_id][1:3] == [node["id"], slot], (node["id"], o["name"])
    named = [s["link"] for n in ui["nodes"] for s in n["inputs"] if s["link"] is not None]
    assert sorted(named) == sorted(link_ids), "a link no input names, or an input naming no link"

    # "order" is an execution order: every link runs forward
    orders = [n["order"] for n in ui["nodes"]]
    assert sorted(orders) == list(range(len(orders)))
    for _, src, _, dst, _, _ in ui["links"]:
        assert nodes[src]["order"] < nodes[dst]["order"]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_widget_values_fit_their_widgets(name, definitions):
    ui, _ = load(name)
    for node in ui["nodes"]:
        definition = definitions[node["type"]]
        values, extras = widget_values(node, definition)
        for w in widgets(definition):
            value, where = values[w["name"]], f"{node['type']}.{w['name']}={values[w['name']]!r}"
            if w["type"] == "COMBO":
                assert isinstance(value, str) and value, where
                if w.get("options"):
                    assert value in w["options"], where
                else:  # listed from a ComfyUI folder at run time
                    assert value.endswith(FOLDER_EXTENSIONS[w["folder"]]), where
            elif w["type"] in ("INT", "FLOAT"):
                assert isinstance(value, (int, float)) and not isinstance(value, bool), where
                assert w["type"] == "FLOAT" or isinstance(value, int), where
                assert math.isfinite(value), where
                if w.get("min") is not None:
                    assert value >= w["min"], where
                if w.get("max") is not None:
                    assert value <= w["max"], where
                if w["type"] == "INT" and w.get("step") and w.get("min") is not None:
                    assert (value - w["min"]) % w["step"] == 0, where
            elif w["type"] == "BOOLEAN":
                assert isinstance(value, bool), where
            else:
                assert w["type"] == "STRING" and isinstance(value, str), where
        for w, extra in extras:
            if "values" in w["ui_extra"]:
                assert extra in w["ui_extra"]["values"], (node["type"], w["name"], extra)
            else:
                assert extra == w["ui_extra"]["value"], (node["type"], w["name"], extra)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_the_api_file_is_the_translation_of_the_ui_file(name, definitions):
    ui, api = load(name)
    assert ui_to_api(ui, definitions) == api
    # and it is a prompt ComfyUI accepts: every input of every node given, links to existing outputs
    for node_id, node in api.items():
        definition = definitions[node["class_type"]]
        required = {i["name"] for i in definition["inputs"] if not i.get("optional")}
        known = {n for i in definition["inputs"] for n in (i["name"], i.get("api_alias")) if n}
        assert required <= set(node["inputs"]) <= known, node_id
        for value in node["inputs"].values():
            if isinstance(value, list):
                src, slot = value
                assert src in api and 0 <= slot < len(definitions[api[src]["class_type"]]["outputs"])


@pytest.mark.parametrize("name", WORKFLOWS)
def test_the_engine_stands_in_for_the_model_loader_and_its_model_reaches_the_sampler(name):
    """The template's graph with its loader swapped: each engine's MODEL (the xDiT Engine's slot 1, the xDiT Checkpoint
    Loader's slot 0, where CheckpointLoaderSimple has it), through the template's own MODEL nodes, into its xDiT
    Sampler's model input (its engine input unconnected), SamplerCustom's or the stock guider (a two-expert model: an
    engine and a sampler per expert, on the same GPUs; a two-pass graph: both passes' guiders on the one engine); Info
    on the last engine's engine output, run after the last sampler's LATENT (Wan-Animate 2's TrimVideoLatent between
    them and VAE Decode); text encoders, VAE decode and save stock."""
    _, api = load(name)
    engines, samplers = all_of(api, tuple(ENGINES)), all_of(api, SAMPLERS)
    assert [e["inputs"][ENGINES[e["class_type"]][0]] for _, e in engines] == list(model_files(name))
    passes = 2 if name in TWO_PASSES else 1
    assert len(samplers) == len(engines) * passes
    for i, (sampler_id, sampler) in enumerate(samplers):
        engine_id, engine = engines[i // passes]
        if sampler["class_type"] in ("XDiTSampler", "XDiTSamplerAdvanced", "SamplerCustom"):
            assert "engine" not in sampler["inputs"]
            consumer = (sampler_id, sampler)
        else:
            consumer = source(api, sampler_id, "guider")
        chain = [consumer] + model_chain(api, consumer[0])
        model_slot = ENGINES[engine["class_type"]][1]
        assert chain[-1][0] == engine_id and chain[-2][1]["inputs"]["model"] == [engine_id, model_slot]
        assert engine["inputs"]["gpus"] == "all" and engine["inputs"]["plan"] == "auto"
    (last_engine_id, last_engine), last_id = engines[-1], samplers[-1][0]
    _, info = only(api, "XDiTEngineInfo")
    assert info["inputs"]["engine"] == [last_engine_id, ENGINES[last_engine["class_type"]][2]]
    assert info["inputs"]["after"] == [last_id, 0]   # Info runs after the sampler (workflows/README.md)
    assert info["inputs"]["unload"] is False
    decode_id, decode = all_of(api, ("VAEDecode", "VAEDecodeTiled"))[0]
    taker = decode
    separate_id, separate = source(api, decode_id, "samples")
    if separate["class_type"] in ("LTXVCropGuides", "LTXVSeparateAVLatent"):   # LTX: the video stream's latent
        if separate["class_type"] == "LTXVCropGuides":   # the guide frames taken off first
            assert decode["inputs"]["samples"] == [separate_id, 2]
            taker = separate
            separate_id, separate = source(api, separate_id, "latent")
        assert separate["class_type"] == "LTXVSeparateAVLatent" and separate["inputs"]["av_latent"] == [last_id, 0]
        assert taker["inputs"][{"LTXVCropGuides": "latent"}.get(taker["class_type"], "samples")] == [separate_id, 0]
    elif separate["class_type"] == "TrimVideoLatent":   # Wan-Animate 2: the reference image's latent frame off first
        assert decode["inputs"]["samples"] == [separate_id, 0] and separate["inputs"]["samples"] == [last_id, 0]
    else:
        assert decode["inputs"]["samples"] == [last_id, 0] and last_engine["class_type"] != "XDiTCheckpointLoader"
    if last_engine["class_type"] == "XDiTCheckpointLoader":   # the file's VAE
        assert decode["inputs"]["vae"] == [last_engine_id, 2]
    else:
        assert source(api, decode_id, "vae")[1]["class_type"] in ("VAELoader", "XDiTVAELoader")
    if name in VIDEO_WORKFLOWS:
        video_id, video = only(api, "CreateVideo")
        assert video["inputs"]["images"] == [decode_id, 0]
        _, save = only(api, "SaveVideo")
        assert save["inputs"]["video"] == [video_id, 0] and save["inputs"]["filename_prefix"] == f"xDiT/{name}"
        assert (save["inputs"]["format"], save["inputs"]["codec"]) == ("auto", "auto")
    else:
        _, save = only(api, "SaveImage")
        assert save["inputs"]["images"] == [decode_id, 0] and save["inputs"]["filename_prefix"] == f"xDiT/{name}"


@pytest.mark.parametrize("name", WORKFLOWS)
def test_no_two_nodes_overlap_and_every_link_runs_rightwards_or_down(name):
    ui, _ = load(name)
    assert overlaps(ui) == []
    nodes = {n["id"]: n for n in ui["nodes"]}
    for link_id, src, _, dst, _, _ in ui["links"]:
        (sx, sy), (dx, dy) = nodes[src]["pos"], nodes[dst]["pos"]
        assert dx > sx or (dx == sx and dy > sy), (name, link_id, nodes[src]["type"], nodes[dst]["type"])


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_node_is_saved_as_large_as_both_frontends_draw_it(name, definitions):
    """Saved at least at computeSize, a node is drawn at its saved size (no larger, so no overlap), with its title
    and every widget's label and value whole ("model_name", not "mod...")."""
    ui, _ = load(name)
    assert undersized(ui, definitions) == []


@pytest.mark.parametrize("name", WORKFLOWS)
def test_no_two_nodes_overlap_as_nodes_2_0_draws_them(name, definitions):
    """The Vue node display (frontend 1.49.6's "Nodes 2.0" setting) draws most nodes wider and taller than the classic
    one (tests/node_layout.py, vue_size): the layout leaves room for that too."""
    ui, _ = load(name)
    drawn = json.loads(json.dumps(ui))
    for n in drawn["nodes"]:
        w, h = node_layout.vue_size(n["type"], definitions[n["type"]], n["size"])
        n["size"] = [w, h - node_layout.TITLE_HEIGHT]
    assert overlaps(drawn) == []


def grown_info_size():
    """The largest (w, h) the Info node takes after a run, from the pack's frontend extension
    (xdit_nodes/web/engine_info.js): WIDTH wide, and computeSize with the report's box at MAX_LINES lines: two
    socket rows, the unload toggle, the box (lines x LINE_PX + 12), each widget 4 apart, 8 + 6 below."""
    with open(os.path.join(ROOT, "xdit_nodes", "web", "engine_info.js")) as f:
        script = f.read()
    number = {k: int(re.search(rf"\b{k} = (\d+)", script).group(1)) for k in ("WIDTH", "LINE_PX", "MAX_LINES")}
    box = number["MAX_LINES"] * number["LINE_PX"] + 12
    rows = 2 * node_layout.SLOT_HEIGHT
    return number["WIDTH"], rows + (node_layout.WIDGET_HEIGHT + 4) + (box + 4) + 8 + 6


@pytest.mark.parametrize("name", WORKFLOWS)
def test_the_info_node_can_grow_to_its_report_without_covering_a_node(name):
    """After a run the Info node draws its report and grows (never shrinks) to grown_info_size(): the layout keeps
    that room free below and beside it."""
    ui, _ = load(name)
    width, height = grown_info_size()
    grown = json.loads(json.dumps(ui))
    info = next(n for n in grown["nodes"] if n["type"] == "XDiTEngineInfo")
    info["size"] = [max(info["size"][0], width), max(info["size"][1], height)]
    assert [pair for pair in overlaps(grown) if info["id"] in pair] == [], (width, height)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_model_file_names_its_download_and_its_folder(name):
    """properties.models as ComfyUI's own templates carry it: the frontend's missing-models panel names the folder
    and offers the download from it."""
    ui, _ = load(name)
    for node in ui["nodes"]:
        files = {k[1]: v for k, v in MODEL_WIDGETS.items() if k[0] == node["type"]}
        if not files:
            assert "models" not in node["properties"], node["type"]
            continue
        values = [v for v in node["widgets_values"] if isinstance(v, str) and v.endswith(".safetensors")]
        models = node["properties"]["models"]
        assert [m["name"] for m in models] == values, node["type"]
        for m in models:
            assert set(m) == {"name", "url", "directory"}
            assert m["url"].startswith("https://huggingface.co/") and "/resolve/main/" in m["url"], m
            assert m["directory"] in {f for folders in files.values() for f in folders}, m
            assert m["url"].endswith("/" + m["name"]) or m["name"] == "sd3.5_vae.safetensors", m


def model_files_table() -> dict[str, str]:
    """workflows/README.md's "Model files" table: {file name: its models/ folder}."""
    with open(os.path.join(WORKFLOW_DIR, "README.md")) as f:
        section = f.read().split("\n## Model files\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            names, folder = line.split(" | ")[:2]
            table |= {name: folder.strip("`") for name in re.findall(r"`([^`]+)`", names)}
    return table


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_model_file_a_workflow_loads_is_in_the_readmes_model_files_table_with_its_folder(name):
    ui, _ = load(name)
    table = model_files_table()
    loaded = {(m["name"], m["directory"]) for node in ui["nodes"] for m in node["properties"].get("models", [])}
    missing = [(file, folder, table.get(file)) for file, folder in sorted(loaded) if table.get(file) != folder]
    assert loaded and not missing, missing


@pytest.mark.parametrize("name", WORKFLOWS)
def test_a_workflow_that_needs_a_newer_comfyui_says_which_in_a_note_and_the_readme(name, definitions):
    ui, _ = load(name)
    needs = NEEDS_COMFYUI.get(name)
    notes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "MarkdownNote"]
    newest = max((definitions[n["type"]].get("since", "0.3.64") for n in ui["nodes"]),
                 key=lambda v: tuple(map(int, v.split("."))))
    if needs is None:
        assert notes == [] and newest == "0.3.64"
        return
    assert len(notes) == 1 and f"Needs ComfyUI {needs} or later" in notes[0]
    assert tuple(map(int, needs.split("."))) >= tuple(map(int, newest.split(".")))
    with open(os.path.join(WORKFLOW_DIR, "README.md")) as f:
        rows = [line for line in f if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1 and f"ComfyUI {needs}" in rows[0]


# ---- what each workflow is for ------------------------------------------------------------------------------------
def test_flux1_dev_uses_flux_guidance_at_cfg_1():
    _, api = load("flux1-dev")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert s["cfg"] == 1.0 and s["steps"] == 28 and s["denoise"] == 1.0 and s["seed"] == 42
    assert (s["sampler_name"], s["scheduler"]) == ("euler", "simple")
    assert s["model"] == [only(api, "XDiTEngine")[0], 1]   # the template has no MODEL node for FLUX.1
    guidance_id, guidance = source(api, sampler_id, "positive")
    assert guidance["class_type"] == "FluxGuidance" and guidance["inputs"]["guidance"] == 3.5
    assert source(api, guidance_id, "conditioning")[1]["inputs"]["text"].strip()
    assert source(api, sampler_id, "negative")[1]["inputs"]["text"] == ""  # unused at cfg 1.0
    _, clip = only(api, "DualCLIPLoader")
    assert clip["inputs"] == {"clip_name1": "t5xxl_fp16.safetensors", "clip_name2": "clip_l.safetensors",
                              "type": "flux", "device": "default"}
    _, latent = only(api, "EmptySD3LatentImage")
    assert latent["inputs"] == {"width": 1024, "height": 1024, "batch_size": 1}
    assert s["latent_image"] == [only(api, "EmptySD3LatentImage")[0], 0]
    assert only(api, "VAELoader")[1]["inputs"]["vae_name"] == "ae.safetensors"


def test_flux1_schnell_runs_4_steps_without_guidance():
    _, api = load("flux1-schnell")
    sampler_id, sampler = only(api, "XDiTSampler")
    assert sampler["inputs"]["steps"] == 4 and sampler["inputs"]["cfg"] == 1.0
    assert "FluxGuidance" not in {n["class_type"] for n in api.values()}
    assert source(api, sampler_id, "positive")[1]["class_type"] == "CLIPTextEncode"
    assert only(api, "DualCLIPLoader")[1]["inputs"]["type"] == "flux"
    assert only(api, "VAELoader")[1]["inputs"]["vae_name"] == "ae.safetensors"


def test_sd35_large_uses_real_cfg_and_a_negative_prompt():
    _, api = load("sd3.5-large")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert s["cfg"] > 1.0 and s["cfg"] == 4.5 and s["steps"] == 28
    assert (s["sampler_name"], s["scheduler"]) == ("euler", "simple")
    negative = source(api, sampler_id, "negative")[1]
    positive = source(api, sampler_id, "positive")[1]
    assert negative["class_type"] == positive["class_type"] == "CLIPTextEncode"
    assert negative["inputs"]["text"].strip() and positive["inputs"]["text"].strip()
    assert negative["inputs"]["text"] != positive["inputs"]["text"]
    _, clip = only(api, "TripleCLIPLoader")
    assert sorted(clip["inputs"].values()) == ["clip_g.safetensors", "clip_l.safetensors", "t5xxl_fp16.safetensors"]
    assert "FluxGuidance" not in {n["class_type"] for n in api.values()}
    assert "DualCLIPLoader" not in {n["class_type"] for n in api.values()}
    assert s["latent_image"] == [only(api, "EmptySD3LatentImage")[0], 0]


def test_flux1_dev_img2img_denoises_an_encoded_image_partly():
    _, api = load("flux1-dev-img2img")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert 0.0 < s["denoise"] < 1.0 and s["denoise"] == 0.75 and s["cfg"] == 1.0
    encode_id, encode = source(api, sampler_id, "latent_image")
    assert encode["class_type"] == "VAEEncode"
    assert source(api, encode_id, "pixels")[1]["class_type"] == "LoadImage"
    decode_id, _ = only(api, "VAEDecode")
    assert api[encode_id]["inputs"]["vae"] == api[decode_id]["inputs"]["vae"]  # one VAE encodes and decodes
    assert "EmptySD3LatentImage" not in {n["class_type"] for n in api.values()}
    assert source(api, sampler_id, "positive")[1]["class_type"] == "FluxGuidance"


def test_flux1_kontext_dev_edits_a_reference_image_as_comfyuis_kontext_example():
    """LoadImage -> FluxKontextImageScale -> VAEEncode -> ReferenceLatent on the prompt -> FluxGuidance 2.5 ->
    positive; the image to sample is an empty 1024x1024 latent, 20 euler/simple steps at cfg 1.0."""
    _, api = load("flux1-kontext-dev")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert (s["cfg"], s["steps"], s["denoise"], s["sampler_name"], s["scheduler"]) == (1.0, 20, 1.0, "euler", "simple")
    guidance_id, guidance = source(api, sampler_id, "positive")
    assert guidance["class_type"] == "FluxGuidance" and guidance["inputs"]["guidance"] == 2.5
    reference_id, reference = source(api, guidance_id, "conditioning")
    assert reference["class_type"] == "ReferenceLatent"
    assert source(api, reference_id, "conditioning")[1]["inputs"]["text"].strip()
    encode_id, encode = source(api, reference_id, "latent")
    assert encode["class_type"] == "VAEEncode"
    scale_id, scale = source(api, encode_id, "pixels")
    assert scale["class_type"] == "FluxKontextImageScale"
    assert source(api, scale_id, "image")[1]["class_type"] == "LoadImage"
    assert api[encode_id]["inputs"]["vae"] == api[only(api, "VAEDecode")[0]]["inputs"]["vae"]
    assert source(api, sampler_id, "latent_image")[1]["inputs"] == {"width": 1024, "height": 1024, "batch_size": 1}
    assert source(api, sampler_id, "negative")[1]["inputs"]["text"] == ""  # unused at cfg 1.0


def test_qwen_image_is_comfyuis_template_with_the_engine_for_the_model():
    """ComfyUI's Qwen-Image template (comfyui-workflow-templates 0.1.94, image_qwen_image.json): the Qwen2.5-VL text
    encoder (CLIPLoader type qwen_image), an empty prompt as the negative, ModelSamplingAuraFlow 3.1 on the model,
    EmptySD3LatentImage 1328x1328, 20 euler/simple steps at cfg 2.5."""
    _, api = load("qwen-image")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert (s["cfg"], s["steps"], s["denoise"], s["sampler_name"], s["scheduler"]) == (2.5, 20, 1.0, "euler", "simple")
    (_, sampling), (_, engine) = model_chain(api, sampler_id)
    assert sampling["class_type"] == "ModelSamplingAuraFlow" and sampling["inputs"]["shift"] == 3.1
    assert engine["class_type"] == "XDiTEngine"
    assert source(api, sampler_id, "latent_image")[1]["inputs"] == {"width": 1328, "height": 1328, "batch_size": 1}
    assert source(api, sampler_id, "negative")[1]["inputs"]["text"] == ""
    clip_id = source(api, source(api, sampler_id, "positive")[0], "clip")[0]
    assert api[clip_id]["inputs"]["type"] == "qwen_image"


def test_qwen_image_edit_is_comfyuis_edit_template_with_the_engine_for_the_model():
    """ComfyUI's Qwen-Image-Edit template (image_qwen_image_edit.json): the image scaled to 1 megapixel (lanczos), its
    latent both the latent to sample and, through TextEncodeQwenImageEdit on both sides, the reference latents;
    ModelSamplingAuraFlow 3.0 then CFGNorm 1 on the model, 20 euler/simple steps at cfg 2.5."""
    _, api = load("qwen-image-edit")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert (s["cfg"], s["steps"], s["sampler_name"], s["scheduler"]) == (2.5, 20, "euler", "simple")
    (_, norm), (_, sampling), (_, engine) = model_chain(api, sampler_id)
    assert norm["class_type"] == "CFGNorm" and norm["inputs"]["strength"] == 1.0
    assert (sampling["class_type"], sampling["inputs"]["shift"]) == ("ModelSamplingAuraFlow", 3.0)
    assert engine["class_type"] == "XDiTEngine"
    encode_id, encode = source(api, sampler_id, "latent_image")
    scale_id, scale = source(api, encode_id, "pixels")
    assert (scale["class_type"], scale["inputs"]["upscale_method"], scale["inputs"]["megapixels"]) == \
        ("ImageScaleToTotalPixels", "lanczos", 1.0)
    assert scale["inputs"]["resolution_steps"] == 1   # required by ComfyUI 0.33.0, ignored by 0.3.64
    for side in ("positive", "negative"):
        side_id, node = source(api, sampler_id, side)
        assert node["class_type"] == "TextEncodeQwenImageEdit"
        assert node["inputs"]["image"] == [scale_id, 0] and node["inputs"]["vae"] == encode["inputs"]["vae"]
    assert source(api, sampler_id, "negative")[1]["inputs"]["prompt"] == ""


def _flux2_sampling(api, steps):
    """The FLUX.2 templates' SamplerCustomAdvanced: seed 42, euler, Flux2Scheduler for 1024x1024, an empty FLUX.2
    latent of that size."""
    sampler_id, sampler = only(api, "SamplerCustomAdvanced")
    assert source(api, sampler_id, "noise")[1]["inputs"]["noise_seed"] == 42
    assert source(api, sampler_id, "sampler")[1]["inputs"] == {"sampler_name": "euler"}
    sigmas = source(api, sampler_id, "sigmas")[1]
    assert sigmas["class_type"] == "Flux2Scheduler"
    assert sigmas["inputs"] == {"steps": steps, "width": 1024, "height": 1024}
    latent = source(api, sampler_id, "latent_image")[1]
    assert latent["class_type"] == "EmptyFlux2LatentImage"
    assert latent["inputs"] == {"width": 1024, "height": 1024, "batch_size": 1}
    return sampler_id, source(api, sampler_id, "guider")


def test_flux2_dev_is_comfyuis_template_with_basic_guider_on_the_engines_model():
    """ComfyUI's FLUX.2 [dev] template: the Mistral-3 text encoder through CLIPLoader type flux2, FluxGuidance 4,
    BasicGuider on the model, RandomNoise, KSamplerSelect euler, Flux2Scheduler 20 steps, SamplerCustomAdvanced;
    the VAE is FLUX.2's."""
    _, api = load("flux2-dev")
    _, (guider_id, guider) = _flux2_sampling(api, 20)
    assert guider["class_type"] == "BasicGuider"
    assert guider["inputs"]["model"] == [only(api, "XDiTEngine")[0], 1]
    guidance_id, guidance = source(api, guider_id, "conditioning")
    assert guidance["class_type"] == "FluxGuidance" and guidance["inputs"]["guidance"] == 4.0
    assert source(api, guidance_id, "conditioning")[1]["inputs"]["text"].strip()
    assert only(api, "CLIPLoader")[1]["inputs"] == {"clip_name": "mistral_3_small_flux2_bf16.safetensors",
                                                    "type": "flux2", "device": "default"}
    assert only(api, "VAELoader")[1]["inputs"]["vae_name"] == "flux2-vae.safetensors"


def test_flux2_dev_multi_reference_chains_two_reference_latents_on_the_prompt():
    """Two images, each LoadImage -> FluxKontextImageScale -> VAEEncode (the FLUX.2 VAE), chained ReferenceLatent
    nodes on the prompt (FLUX.2 places them at index 10 and 20), FluxGuidance 4 -> BasicGuider, an empty 1024x1024
    FLUX.2 latent."""
    _, api = load("flux2-dev-multi-reference")
    _, (guider_id, guider) = _flux2_sampling(api, 20)
    assert guider["class_type"] == "BasicGuider"
    guidance_id, guidance = source(api, guider_id, "conditioning")
    assert guidance["class_type"] == "FluxGuidance" and guidance["inputs"]["guidance"] == 4.0
    node_id, node = source(api, guidance_id, "conditioning")
    images = []
    while node["class_type"] == "ReferenceLatent":
        encode_id, encode = source(api, node_id, "latent")
        assert encode["class_type"] == "VAEEncode"
        assert api[encode_id]["inputs"]["vae"] == api[only(api, "VAEDecode")[0]]["inputs"]["vae"]
        scale_id, scale = source(api, encode_id, "pixels")
        assert scale["class_type"] == "FluxKontextImageScale"
        images.append(source(api, scale_id, "image")[1]["inputs"]["image"])
        node_id, node = source(api, node_id, "conditioning")
    assert node["class_type"] == "CLIPTextEncode" and node["inputs"]["text"].strip()
    assert images == ["jacket.png", "person.png"]   # the chain read from the sampler back: reference 2 last


def test_flux2_klein_4b_is_comfyuis_distilled_template_at_cfg_1():
    """ComfyUI's FLUX.2 [klein] 4B distilled template: the Qwen3 4B text encoder through CLIPLoader type flux2,
    CFGGuider at cfg 1 with the prompt zeroed out as the negative, no FluxGuidance (klein has no guidance
    embedding), Flux2Scheduler 4 steps."""
    _, api = load("flux2-klein-4b")
    _, (guider_id, guider) = _flux2_sampling(api, 4)
    assert guider["class_type"] == "CFGGuider" and guider["inputs"]["cfg"] == 1.0
    assert guider["inputs"]["model"] == [only(api, "XDiTEngine")[0], 1]
    positive_id, positive = source(api, guider_id, "positive")
    assert positive["class_type"] == "CLIPTextEncode" and positive["inputs"]["text"].strip()
    zero = source(api, guider_id, "negative")[1]
    assert zero["class_type"] == "ConditioningZeroOut" and zero["inputs"]["conditioning"] == [positive_id, 0]
    assert "FluxGuidance" not in {n["class_type"] for n in api.values()}
    assert only(api, "CLIPLoader")[1]["inputs"]["clip_name"] == "qwen_3_4b.safetensors"
    assert only(api, "CLIPLoader")[1]["inputs"]["type"] == "flux2"


NEGATIVE_WAN_START = "色调艳丽，过曝，静态"   # the Wan templates' negative prompt begins so


def _wan_common(api, sampler_id, vae_file):
    """What every Wan template shares: umT5 through CLIPLoader type wan for the positive and the templates' Chinese
    negative prompt, the VAE that decodes: the xDiT VAE Loader in Load VAE's place, on the sampler's engine (the
    decode and the start image's encode on its ranks)."""
    positive_id, positive = source(api, sampler_id, "positive")
    negative_id, negative = source(api, sampler_id, "negative")
    if positive["class_type"] in ("WanImageToVideo", "WanAnimate2ToVideo"):    # both come through it
        positive_id, positive = source(api, positive_id, "positive")
        negative_id, negative = source(api, negative_id, "negative")
    assert positive["class_type"] == negative["class_type"] == "CLIPTextEncode"
    assert positive["inputs"]["text"].strip() and negative["inputs"]["text"].startswith(NEGATIVE_WAN_START)
    clip = source(api, positive_id, "clip")[1]
    assert clip["inputs"] == {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                              "device": "default"}
    assert positive["inputs"]["clip"] == negative["inputs"]["clip"]
    assert not all_of(api, ("VAELoader",))
    vae_id, vae = only(api, "XDiTVAELoader")
    assert vae["inputs"]["vae_name"] == vae_file and only(api, "VAEDecode")[1]["inputs"]["vae"] == [vae_id, 0]
    engine_id = vae["inputs"]["engine"][0]
    assert api[engine_id]["class_type"] == "XDiTEngine" and engine_id == model_chain(api, sampler_id)[-1][0]


def _shift(api, sampler_id):
    (_, sampling), (_, engine) = model_chain(api, sampler_id)
    assert sampling["class_type"] == "ModelSamplingSD3" and engine["class_type"] == "XDiTEngine"
    return sampling["inputs"]["shift"]


def test_wan21_t2v_is_comfyuis_template_with_the_engine_for_the_model():
    """ComfyUI's Wan 2.1 text-to-video template (text_to_video_wan.json, 1.3B): ModelSamplingSD3 8 on the model,
    EmptyHunyuanLatentVideo 832x480 with 33 frames, 30 uni_pc/simple steps at cfg 6, Create Video at 16 fps."""
    _, api = load("wan2.1-t2v-1.3b")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert (s["steps"], s["cfg"], s["sampler_name"], s["scheduler"], s["denoise"]) == (30, 6.0, "uni_pc", "simple", 1.0)
    assert _shift(api, sampler_id) == 8.0
    latent = source(api, sampler_id, "latent_image")[1]
    assert latent["class_type"] == "EmptyHunyuanLatentVideo"
    assert latent["inputs"] == {"width": 832, "height": 480, "length": 33, "batch_size": 1}
    _wan_common(api, sampler_id, "wan_2.1_vae.safetensors")
    assert only(api, "CreateVideo")[1]["inputs"]["fps"] == 16.0


def test_hunyuanvideo15_t2v_is_comfyuis_720p_template_with_the_engine_for_the_model():
    """ComfyUI's HunyuanVideo 1.5 720p text-to-video template's first pass (video_hunyuan_video_1.5_720p_t2v.json):
    DualCLIPLoader type hunyuan_video_15, EmptyHunyuanVideo15Latent 1280x720 with 121 frames, ModelSamplingSD3 7 on the
    engine's MODEL, CFGGuider 6 with an empty negative, BasicScheduler simple 20 steps, KSamplerSelect euler,
    SamplerCustomAdvanced; ComfyUI's own VAE and Create Video at 24 fps."""
    _, api = load("hunyuanvideo-1.5-t2v")
    sampler_id, _ = only(api, "SamplerCustomAdvanced")
    guider_id, guider = source(api, sampler_id, "guider")
    assert guider["class_type"] == "CFGGuider" and guider["inputs"]["cfg"] == 6.0
    shifted_id, shifted = source(api, guider_id, "model")
    assert shifted["class_type"] == "ModelSamplingSD3" and shifted["inputs"]["shift"] == 7.0
    assert source(api, shifted_id, "model")[1]["class_type"] == "XDiTEngine"
    sigmas = source(api, sampler_id, "sigmas")[1]
    assert sigmas["class_type"] == "BasicScheduler" and sigmas["inputs"]["model"] == [shifted_id, 0]
    assert (sigmas["inputs"]["scheduler"], sigmas["inputs"]["steps"], sigmas["inputs"]["denoise"]) == \
        ("simple", 20, 1.0)
    assert source(api, sampler_id, "sampler")[1]["inputs"]["sampler_name"] == "euler"
    latent = source(api, sampler_id, "latent_image")[1]
    assert latent["class_type"] == "EmptyHunyuanVideo15Latent"
    assert latent["inputs"] == {"width": 1280, "height": 720, "length": 121, "batch_size": 1}
    clip = only(api, "DualCLIPLoader")[1]["inputs"]
    assert (clip["clip_name1"], clip["clip_name2"], clip["type"]) == (
        "qwen_2.5_vl_7b_fp8_scaled.safetensors", "byt5_small_glyphxl_fp16.safetensors", "hunyuan_video_15")
    assert source(api, guider_id, "negative")[1]["inputs"]["text"] == ""
    assert only(api, "VAELoader")[1]["inputs"]["vae_name"] == "hunyuanvideo15_vae_fp16.safetensors"
    assert only(api, "CreateVideo")[1]["inputs"]["fps"] == 24.0


def test_hunyuanvideo15_i2v_conditions_both_prompts_on_the_start_image_and_its_siglip_output():
    """The 720p image-to-video template: Load Image into CLIP Vision Encode (SigLIP, center) and, as the start image,
    into HunyuanVideo15ImageToVideo 1280x720 with 121 frames, whose positive, negative and latent the sampler takes;
    the rest as the text-to-video template."""
    _, api = load("hunyuanvideo-1.5-i2v")
    sampler_id, _ = only(api, "SamplerCustomAdvanced")
    conditioned_id, conditioned = only(api, "HunyuanVideo15ImageToVideo")
    assert source(api, sampler_id, "latent_image") == (conditioned_id, conditioned)
    guider_id, guider = source(api, sampler_id, "guider")
    assert guider["inputs"]["positive"] == [conditioned_id, 0] and guider["inputs"]["negative"] == [conditioned_id, 1]
    assert {k: conditioned["inputs"][k] for k in ("width", "height", "length", "batch_size")} == \
        {"width": 1280, "height": 720, "length": 121, "batch_size": 1}
    encode_id, encode = source(api, conditioned_id, "clip_vision_output")
    assert encode["class_type"] == "CLIPVisionEncode" and encode["inputs"]["crop"] == "center"
    assert source(api, encode_id, "clip_vision")[1]["inputs"]["clip_name"] == "sigclip_vision_patch14_384.safetensors"
    assert source(api, encode_id, "image")[0] == source(api, conditioned_id, "start_image")[0]
    assert source(api, source(api, guider_id, "model")[0], "model")[1]["inputs"]["model_name"] == \
        "hunyuanvideo1.5_720p_i2v_fp16.safetensors"


def test_wan_animate2_is_comfyuis_distilled_motion_transfer_template_with_the_engine_for_the_model():
    """ComfyUI's "Wan Animate 2 Distilled: Motion Transfer" template, its first segment flattened: the driving video's
    frames resized to 482x854 (Resize Image/Mask, center crop, area) as pose_video, their size (Get Image Size) as
    WanAnimate2ToVideo's width and height and the reference image's resize; CLIP Vision Encode (clip_vision_h, crop
    none) of the resized reference image and of the first driving frame; the character, negative and pose prompts;
    81 frames, strengths 1 / 0 / 1 / 1; the engine's MODEL (no WanAnimate2Cache) -> ModelSamplingSD3 5 ->
    SamplerCustom (noise on, seed 42, cfg 1), KSamplerSelect lcm, BasicScheduler simple 10 steps on the engine's
    MODEL; TrimVideoLatent by trim_latent before the xDiT VAE Loader's decode; Create Video at the driving video's
    fps with its audio."""
    _, api = load("wan-animate-2")
    sampler_id, sampler = only(api, "SamplerCustom")
    s = sampler["inputs"]
    assert (s["add_noise"], s["noise_seed"], s["cfg"]) == (True, 42, 1.0)
    assert _shift(api, sampler_id) == 5.0
    engine_id, engine = only(api, "XDiTEngine")
    assert engine["inputs"]["model_name"] == "wan_animate_2_distill_int8_convrot.safetensors"
    assert source(api, sampler_id, "sampler")[1]["inputs"] == {"sampler_name": "lcm"}
    sigmas = source(api, sampler_id, "sigmas")[1]
    assert sigmas["class_type"] == "BasicScheduler" and sigmas["inputs"] == {
        "scheduler": "simple", "steps": 10, "denoise": 1.0, "model": [engine_id, 1]}   # the template's: unshifted
    assert "WanAnimate2Cache" not in {n["class_type"] for n in api.values()}
    animate_id, animate = only(api, "WanAnimate2ToVideo")
    assert (s["positive"], s["negative"], s["latent_image"]) == ([animate_id, 0], [animate_id, 1], [animate_id, 2])
    a = animate["inputs"]
    assert {k: a[k] for k in ("length", "batch_size", "video_frame_offset", "pose_strength", "pose_start_percent",
                              "pose_end_percent", "reference_image_strength")} == {
        "length": 81, "batch_size": 1, "video_frame_offset": 0, "pose_strength": 1.0, "pose_start_percent": 0.0,
        "pose_end_percent": 1.0, "reference_image_strength": 1.0}
    assert "continue_motion" not in a   # the first segment
    # the driving video: Load Video -> Get Video Components -> resized to 482x854 -> pose_video, its size the output's
    pose_id, pose = source(api, animate_id, "pose_video")
    assert pose["class_type"] == "ResizeImageMaskNode" and {k: v for k, v in pose["inputs"].items() if k != "input"} \
        == {"resize_type": "scale dimensions", "resize_type.width": 482, "resize_type.height": 854,
            "resize_type.crop": "center", "scale_method": "area"}
    components_id, components = source(api, pose_id, "input")
    assert components["class_type"] == "GetVideoComponents" and pose["inputs"]["input"] == [components_id, 0]
    assert source(api, components_id, "video")[1]["inputs"] == {"file": "drive_doll_street_dance.mp4"}
    size_id, size = source(api, animate_id, "width")
    assert size["class_type"] == "GetImageSize" and size["inputs"]["image"] == [pose_id, 0]
    assert (a["width"], a["height"]) == ([size_id, 0], [size_id, 1])
    # the reference image resized to the same size; CLIP vision of it and of the first driving frame
    reference_id, reference = source(api, animate_id, "reference_image")
    r = reference["inputs"]
    assert reference["class_type"] == "ResizeImageMaskNode" and (r["resize_type.width"], r["resize_type.height"]) \
        == ([size_id, 0], [size_id, 1]) and (r["resize_type"], r["resize_type.crop"], r["scale_method"]) == \
        ("scale dimensions", "center", "area")
    assert source(api, reference_id, "input")[1]["inputs"]["image"] == "ref_doll_realistic.png"
    seen_id, seen = source(api, animate_id, "clip_vision_output")
    assert seen["inputs"]["crop"] == "none" and seen["inputs"]["image"] == [reference_id, 0]
    pose_seen_id, pose_seen = source(api, animate_id, "clip_vision_output_pose")
    first_id, first = source(api, pose_seen_id, "image")
    assert pose_seen["inputs"]["crop"] == "none" and first["class_type"] == "ImageFromBatch"
    assert first["inputs"] == {"image": [pose_id, 0], "batch_index": 0, "length": 1}
    assert seen["inputs"]["clip_vision"] == pose_seen["inputs"]["clip_vision"]
    assert source(api, seen_id, "clip_vision")[1]["inputs"] == {"clip_name": "clip_vision_h.safetensors"}
    # the prompts: the character and background, the Wan negative, the motion for the pose branch
    _wan_common(api, sampler_id, "Wan2_1_VAE_bf16.safetensors")
    assert source(api, animate_id, "positive")[1]["inputs"]["text"].startswith("Character appearance description:")
    pose_prompt = source(api, animate_id, "positive_pose")[1]["inputs"]
    assert pose_prompt["text"].startswith("A man doing energetic street dance")
    assert pose_prompt["clip"] == source(api, animate_id, "positive")[1]["inputs"]["clip"]
    assert a["vae"] == only(api, "VAEDecode")[1]["inputs"]["vae"]
    # the reference frame trimmed off before the decode; the video at the driving video's fps, with its sound
    trim_id, trim = only(api, "TrimVideoLatent")
    assert trim["inputs"] == {"samples": [sampler_id, 0], "trim_amount": [animate_id, 3]}
    assert only(api, "VAEDecode")[1]["inputs"]["samples"] == [trim_id, 0]
    _, video = only(api, "CreateVideo")
    assert (video["inputs"]["fps"], video["inputs"]["audio"]) == ([components_id, 2], [components_id, 1])


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_wan22_a14b_runs_the_high_noise_expert_then_the_low_noise_expert_on_its_leftover_noise(kind):
    """ComfyUI's Wan 2.2 A14B templates (their fp8_scaled group): two KSamplerAdvanced over one 20-step euler/simple
    schedule at cfg 3.5, each on its expert's model through ModelSamplingSD3 8: the high-noise expert adds the noise
    and runs steps 0 to 10, returning the leftover noise; the low-noise expert continues its latent from step 10 to
    the end without adding noise. Both xDiT Engines on the same GPUs; 640x640, 81 frames, 16 fps."""
    name = f"wan2.2-{kind}-a14b"
    _, api = load(name)
    (high_id, high), (low_id, low) = all_of(api, ("XDiTSamplerAdvanced",))
    h, l = high["inputs"], low["inputs"]
    assert (h["add_noise"], h["noise_seed"], h["start_at_step"], h["end_at_step"], h["return_with_leftover_noise"]) \
        == ("enable", 42, 0, 10, "enable")
    assert (l["add_noise"], l["start_at_step"], l["end_at_step"], l["return_with_leftover_noise"]) == \
        ("disable", 10, 10000, "disable")
    for s in (h, l):
        assert (s["steps"], s["cfg"], s["sampler_name"], s["scheduler"]) == (20, 3.5, "euler", "simple")
    assert l["latent_image"] == [high_id, 0]
    assert (l["positive"], l["negative"]) == (h["positive"], h["negative"])
    assert _shift(api, high_id) == _shift(api, low_id) == 8.0
    experts = [model_chain(api, i)[-1][1]["inputs"] for i in (high_id, low_id)]
    assert [e["model_name"] for e in experts] == list(EXPERT_FILES[name])
    assert experts[0]["gpus"] == experts[1]["gpus"]   # one rank group keeps both experts loaded
    _wan_common(api, high_id, "wan_2.1_vae.safetensors")
    start_id, start = source(api, high_id, "latent_image")
    if kind == "t2v":
        assert start["class_type"] == "EmptyHunyuanLatentVideo"
        assert source(api, high_id, "positive")[1]["class_type"] == "CLIPTextEncode"
        assert source(api, high_id, "negative")[1]["inputs"]["text"].endswith("，裸露，NSFW")
    else:   # WanImageToVideo's three outputs; Wan 2.2 takes no CLIP vision
        assert start["class_type"] == "WanImageToVideo" and "clip_vision_output" not in start["inputs"]
        assert (h["positive"], h["negative"], h["latent_image"]) == ([start_id, 0], [start_id, 1], [start_id, 2])
        assert source(api, start_id, "start_image")[1]["class_type"] == "LoadImage"
        assert start["inputs"]["vae"] == only(api, "VAEDecode")[1]["inputs"]["vae"]
    assert {k: start["inputs"][k] for k in ("width", "height", "length", "batch_size")} == \
        {"width": 640, "height": 640, "length": 81, "batch_size": 1}
    assert only(api, "CreateVideo")[1]["inputs"]["fps"] == 16.0


def test_wan22_ti2v_5b_starts_from_the_image_latent_with_its_noise_mask():
    """ComfyUI's Wan 2.2 TI2V-5B template with its start image: Wan22ImageToVideoLatent 1280x704, 121 frames, on the
    Wan 2.2 VAE (the one that decodes), ModelSamplingSD3 8, 20 uni_pc/simple steps at cfg 5, Create Video at 24 fps."""
    _, api = load("wan2.2-ti2v-5b")
    sampler_id, sampler = only(api, "XDiTSampler")
    s = sampler["inputs"]
    assert (s["steps"], s["cfg"], s["sampler_name"], s["scheduler"], s["denoise"]) == (20, 5.0, "uni_pc", "simple", 1.0)
    assert _shift(api, sampler_id) == 8.0
    latent_id, latent = source(api, sampler_id, "latent_image")
    assert latent["class_type"] == "Wan22ImageToVideoLatent"
    assert {k: latent["inputs"][k] for k in ("width", "height", "length", "batch_size")} == \
        {"width": 1280, "height": 704, "length": 121, "batch_size": 1}
    assert source(api, latent_id, "start_image")[1]["class_type"] == "LoadImage"
    assert latent["inputs"]["vae"] == only(api, "VAEDecode")[1]["inputs"]["vae"]
    _wan_common(api, sampler_id, "wan2.2_vae.safetensors")
    assert only(api, "CreateVideo")[1]["inputs"]["fps"] == 24.0


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_minimax_h3_is_comfyuis_template_with_the_turbo_lora_on_the_engines_model(kind):
    """ComfyUI's MiniMax-H3 templates (video_minimax_h3_t2v.json, video_minimax_h3_i2v.json), their subgraph flattened:
    the Qwen3-VL text encoder through CLIPLoader type minimax into MiniMaxH3ImageToVideo (864x480 for text to video,
    640x640 with Load Image on first_frame for image to video; 124 frames, 5 s on the 17k + 5 grid), whose
    conditioning feeds BasicGuider and whose audio + video latent is sampled; the engine's MODEL through the 8-step
    turbo LoRA (strength 1) into BasicGuider and BasicScheduler (simple, 8 steps), RandomNoise 42, KSamplerSelect
    res_multistep; the video VAE decodes the frames, the audio VAE the sound, both into Create Video at 24 fps."""
    _, api = load(f"minimax-h3-{kind}")
    sampler_id, _ = only(api, "SamplerCustomAdvanced")
    assert source(api, sampler_id, "noise")[1]["inputs"]["noise_seed"] == 42
    assert source(api, sampler_id, "sampler")[1]["inputs"] == {"sampler_name": "res_multistep"}
    guider_id, guider = source(api, sampler_id, "guider")
    assert guider["class_type"] == "BasicGuider"
    sigmas = source(api, sampler_id, "sigmas")[1]
    assert sigmas["class_type"] == "BasicScheduler"
    assert {k: v for k, v in sigmas["inputs"].items() if k != "model"} == \
        {"scheduler": "simple", "steps": 8, "denoise": 1.0}
    (lora_id, lora), (_, engine) = model_chain(api, guider_id)
    assert lora["class_type"] == "LoraLoaderModelOnly" and engine["class_type"] == "XDiTEngine"
    assert lora["inputs"]["lora_name"] == "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
    assert lora["inputs"]["strength_model"] == 1.0
    assert sigmas["inputs"]["model"] == guider["inputs"]["model"] == [lora_id, 0]   # the schedule of the same model

    av_id, av = source(api, sampler_id, "latent_image")
    assert av["class_type"] == "MiniMaxH3ImageToVideo" and api[sampler_id]["inputs"]["latent_image"] == [av_id, 1]
    assert guider["inputs"]["conditioning"] == [av_id, 0]
    size = (640, 640) if kind == "i2v" else (864, 480)
    assert (av["inputs"]["width"], av["inputs"]["height"], av["inputs"]["length"]) == size + (124,)
    assert av["inputs"]["prompt"].strip() and "last_frame" not in av["inputs"]
    if kind == "i2v":
        assert source(api, av_id, "first_frame")[1]["class_type"] == "LoadImage"
    else:
        assert "first_frame" not in av["inputs"] and "LoadImage" not in {n["class_type"] for n in api.values()}
    assert source(api, av_id, "clip")[1]["inputs"] == {"clip_name": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
                                                       "type": "minimax", "device": "default"}

    decode_id, decode = only(api, "VAEDecode")
    audio_id, audio = only(api, "VAEDecodeAudio")
    assert decode["inputs"]["samples"] == audio["inputs"]["samples"] == [sampler_id, 0]
    assert av["inputs"]["vae"] == decode["inputs"]["vae"]
    assert engine_vae(api, decode["inputs"]["vae"][0]) == "minimax_h3_video_vae_fp16.safetensors"   # its tiles: the ranks
    assert source(api, audio_id, "vae")[1]["inputs"]["vae_name"] == "minimax_h3_audio_vae_fp32.safetensors"
    _, video = only(api, "CreateVideo")
    assert video["inputs"] == {"images": [decode_id, 0], "audio": [audio_id, 0], "fps": 24.0, "bit_depth": 8}


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_ltx23_is_comfyuis_two_pass_template_with_the_checkpoint_loader_swapped(kind):
    """ComfyUI 0.33.0's LTX-2.3 templates, flattened: the xDiT Checkpoint Loader in Load Checkpoint's place; the
    distilled LoRA (0.5) on its MODEL into both passes' CFGGuider at cfg 1; pass 1 (euler_ancestral_cfg_pp, the
    template's 8 ManualSigmas) on the empty video (640x352, half the 1280x720 target) and audio (126 frames at 25 fps)
    latents; pass 2 (euler_cfg_pp, 0.85 ... 0) on pass 1's video upsampled x2 and its audio, under LTXVCropGuides;
    the loader's VAE decodes the frames (tiled), the audio VAE the sound, into Create Video at 25 fps. Image to video:
    the preprocessed image in each pass's first frame, at 0.7 then 1.0."""
    _, api = load(f"ltx-2.3-{kind}")
    loader_id, loader = only(api, "XDiTCheckpointLoader")
    first, second = (i for i, _ in all_of(api, ("SamplerCustomAdvanced",)))
    for sampler_id, name, sigmas in ((first, "euler_ancestral_cfg_pp",
                                      "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"),
                                     (second, "euler_cfg_pp", "0.85, 0.7250, 0.4219, 0.0")):
        assert source(api, sampler_id, "sampler")[1]["inputs"] == {"sampler_name": name}
        assert source(api, sampler_id, "sigmas")[1]["inputs"] == {"sigmas": sigmas}
        assert source(api, sampler_id, "noise")[1]["inputs"]["noise_seed"] == 42
        guider_id, guider = source(api, sampler_id, "guider")
        assert guider["class_type"] == "CFGGuider" and guider["inputs"]["cfg"] == 1.0
        (_, lora), (engine_id, _) = model_chain(api, guider_id)
        assert engine_id == loader_id and lora["inputs"] == {
            "lora_name": "ltx-2.3-22b-distilled-lora-384.safetensors", "strength_model": 0.5, "model": [loader_id, 0]}
    conditioning_id, conditioning = only(api, "LTXVConditioning")
    assert conditioning["inputs"]["frame_rate"] == 25.0
    crop_id, crop = only(api, "LTXVCropGuides")
    assert source(api, first, "guider")[1]["inputs"]["positive"] == [conditioning_id, 0]
    assert source(api, second, "guider")[1]["inputs"]["negative"] == [crop_id, 1]
    assert source(api, only(api, "LTXVConditioning")[0], "negative")[1]["inputs"]["text"] == \
        "pc game, console game, video game, cartoon, childish, ugly"
    # pass 1's latent: the empty video (the image in its first frame) and the empty audio
    first_pass_latents(api, first, kind, frames_number=126, frame_rate=25.0)
    # pass 2's: pass 1's video upsampled (the image again in its first frame) with pass 1's audio
    split1_id, _ = only_after(api, first)
    av2_id, av2 = source(api, second, "latent_image")
    assert av2["inputs"]["audio_latent"] == [split1_id, 1] and crop["inputs"]["latent"] == [split1_id, 0]
    upsampled = api[av2["inputs"]["video_latent"][0]]
    if kind == "i2v":
        assert upsampled["class_type"] == "LTXVImgToVideoInplace" and upsampled["inputs"]["strength"] == 1.0
        upsampled = api[upsampled["inputs"]["latent"][0]]
        frame = source(api, only(api, "LTXVPreprocess")[0], "image")[1]
        assert frame["inputs"]["width"] == 1280 and frame["inputs"]["height"] == 720
    else:
        assert "LoadImage" not in {n["class_type"] for n in api.values()}
    assert upsampled["class_type"] == "LTXVLatentUpsampler" and upsampled["inputs"]["samples"] == [split1_id, 0]
    assert upsampled["inputs"]["vae"] == [loader_id, 2]
    # the end: the loader's VAE decodes pass 2's video, the checkpoint's audio VAE its sound
    split2_id, _ = only_after(api, second)
    decode_id, decode = only(api, "VAEDecodeTiled")
    sound_id, sound = only(api, "LTXVAudioVAEDecode")
    assert decode["inputs"]["samples"] == [split2_id, 0] and sound["inputs"]["samples"] == [split2_id, 1]
    assert source(api, sound_id, "audio_vae")[1]["inputs"] == {"ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors"}
    _, video = only(api, "CreateVideo")
    assert video["inputs"] == {"images": [decode_id, 0], "audio": [sound_id, 0], "fps": 25.0, "bit_depth": 8}


def test_ltx23_flf_is_comfyuis_first_last_frame_template_with_the_checkpoint_loader_swapped():
    """ComfyUI 0.33.0's LTX-2.3 First-Last-Frame template, flattened: the xDiT Checkpoint Loader (the distilled fp8
    file) in Load Checkpoint's place, its MODEL straight into CFGGuider at cfg 1; the first image at frame 0 then the
    last at frame -1 through LTXVAddGuide at 0.7 (each after LTXV Preprocess 25), on the empty 1280x704 video; the
    audio (126 frames at 25 fps) beside it; SamplerEulerAncestral eta 0, the template's 8 ManualSigmas; the guide
    frames cropped off (LTXVCropGuides on the guided conditioning) before the loader's VAE decodes."""
    _, api = load("ltx-2.3-flf")
    loader_id, loader = only(api, "XDiTCheckpointLoader")
    sampler_id, _ = only(api, "SamplerCustomAdvanced")
    guider_id, guider = source(api, sampler_id, "guider")
    assert guider["inputs"]["model"] == [loader_id, 0] and guider["inputs"]["cfg"] == 1.0
    assert source(api, sampler_id, "sampler")[1] == {"class_type": "SamplerEulerAncestral",
                                                     "inputs": {"eta": 0.0, "s_noise": 1.0},
                                                     "_meta": {"title": "SamplerEulerAncestral"}}
    assert source(api, sampler_id, "sigmas")[1]["inputs"]["sigmas"] == \
        "1., 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"
    av_id, av = source(api, sampler_id, "latent_image")
    last_id, last = source(api, av_id, "video_latent")
    first_id, first = source(api, last_id, "latent")
    assert (first["class_type"], last["class_type"]) == ("LTXVAddGuide", "LTXVAddGuide")
    assert (first["inputs"]["frame_idx"], first["inputs"]["strength"]) == (0, 0.7)
    assert (last["inputs"]["frame_idx"], last["inputs"]["strength"]) == (-1, 0.7)
    assert last["inputs"]["positive"] == [first_id, 0] and last["inputs"]["negative"] == [first_id, 1]
    assert guider["inputs"]["positive"] == [last_id, 0] and guider["inputs"]["negative"] == [last_id, 1]
    assert first["inputs"]["vae"] == last["inputs"]["vae"] == [loader_id, 2]
    for guide in (first, last):
        frame = api[guide["inputs"]["image"][0]]
        assert frame["class_type"] == "LTXVPreprocess" and frame["inputs"]["img_compression"] == 25
        scaled = api[frame["inputs"]["image"][0]]["inputs"]
        assert (scaled["width"], scaled["height"], scaled["crop"]) == (1280, 720, "center")
    assert source(api, first_id, "latent")[1]["inputs"] == {"width": 1280, "height": 704, "length": 121,
                                                            "batch_size": 1}
    conditioning = source(api, first_id, "positive")[1]
    assert conditioning["class_type"] == "LTXVConditioning" and conditioning["inputs"]["frame_rate"] == 25.0
    assert source(api, first_id, "negative")[0] == first["inputs"]["positive"][0]
    _, audio = source(api, av_id, "audio_latent")
    assert {k: audio["inputs"][k] for k in ("frames_number", "frame_rate")} == {"frames_number": 126, "frame_rate": 25.0}
    split_id, _ = only_after(api, sampler_id)
    crop_id, crop = only(api, "LTXVCropGuides")
    assert crop["inputs"] == {"positive": [last_id, 0], "negative": [last_id, 1], "latent": [split_id, 0]}
    decode_id, decode = only(api, "VAEDecodeTiled")
    assert decode["inputs"]["samples"] == [crop_id, 2] and decode["inputs"]["vae"] == [loader_id, 2]
    sound_id, sound = only(api, "LTXVAudioVAEDecode")
    assert sound["inputs"]["samples"] == [split_id, 1]
    assert source(api, sound_id, "audio_vae")[1]["inputs"] == {"ckpt_name": "ltx-2.3-22b-distilled-fp8.safetensors"}
    assert loader["inputs"]["ckpt_name"] == "ltx-2.3-22b-distilled-fp8.safetensors"


LTX25_VIDEO_VAE, LTX25_AUDIO_VAE = "ltx-2.5-video-vae-bf16.safetensors", "ltx-2.5-audio-vae-bf16.safetensors"


def engine_vae(api: dict, node_id: str) -> str:
    """The file of an xDiT VAE Loader on an xDiT Engine's engine output (the video VAE's decode and encode on the
    ranks)."""
    node = api[node_id]
    assert node["class_type"] == "XDiTVAELoader" and api[node["inputs"]["engine"][0]]["class_type"] == "XDiTEngine"
    return node["inputs"]["vae_name"]


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_ltx25_is_comfyuis_two_pass_template_with_the_engine_in_unetloaders_place(kind):
    """ComfyUI's LTX-2.5 templates, flattened: the engine's MODEL straight into both passes' LTXVDualCFGGuider at video
    1 and audio 1; Gemma 4 12B through CLIPLoader type ltxv; both passes euler_ancestral; pass 1 (the templates' 8
    ManualSigmas) on the empty video (640x352) and audio (121 frames at 24 fps) latents; pass 2 (0.85 ... 0) on pass 1's
    video upsampled x2 with the video VAE and its audio, with no LTXVCropGuides (the templates have none); the video
    VAE decodes the frames (tiled 512 / 64 / 64 / 16), the audio VAE the sound, into Create Video at 24 fps. Image to
    video: the preprocessed image (18) in each pass's first frame, at 0.7 then 1.0."""
    _, api = load(f"ltx-2.5-{kind}")
    engine_id, engine = only(api, "XDiTEngine")
    assert engine["inputs"]["model_name"] == "ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors"
    first, second = (i for i, _ in all_of(api, ("SamplerCustomAdvanced",)))
    conditioning_id, conditioning = only(api, "LTXVConditioning")
    assert conditioning["inputs"]["frame_rate"] == 24.0 and "LTXVCropGuides" not in {n["class_type"] for n in
                                                                                      api.values()}
    clip = source(api, source(api, conditioning_id, "positive")[0], "clip")[1]["inputs"]
    assert clip == {"clip_name": "gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot.safetensors", "type": "ltxv",
                    "device": "default"}
    for sampler_id, sigmas in ((first, "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"),
                               (second, "0.85, 0.7250, 0.4219, 0.0")):
        assert source(api, sampler_id, "sampler")[1]["inputs"] == {"sampler_name": "euler_ancestral"}
        assert source(api, sampler_id, "sigmas")[1]["inputs"] == {"sigmas": sigmas}
        guider = source(api, sampler_id, "guider")[1]
        assert guider["class_type"] == "LTXVDualCFGGuider" and guider["inputs"] == {
            "model": [engine_id, 1], "positive": [conditioning_id, 0], "negative": [conditioning_id, 1],
            "video_cfg": 1.0, "audio_cfg": 1.0}
    first_pass_latents(api, first, kind, frames_number=121, frame_rate=24.0)
    assert source(api, source(api, first, "latent_image")[0], "audio_latent")[1]["inputs"]["audio_vae"][0] == \
        next(i for i, n in api.items() if n["inputs"].get("vae_name") == LTX25_AUDIO_VAE)
    split1_id, _ = only_after(api, first)
    av2 = source(api, second, "latent_image")[1]
    assert av2["inputs"]["audio_latent"] == [split1_id, 1]
    upsampled = api[av2["inputs"]["video_latent"][0]]
    if kind == "i2v":
        assert upsampled["class_type"] == "LTXVImgToVideoInplace" and upsampled["inputs"]["strength"] == 1.0
        upsampled = api[upsampled["inputs"]["latent"][0]]
    assert upsampled["class_type"] == "LTXVLatentUpsampler" and upsampled["inputs"]["samples"] == [split1_id, 0]
    assert engine_vae(api, upsampled["inputs"]["vae"][0]) == LTX25_VIDEO_VAE
    split2_id, _ = only_after(api, second)
    decode_id, decode = only(api, "VAEDecodeTiled")
    assert decode["inputs"]["samples"] == [split2_id, 0] and (decode["inputs"]["tile_size"], decode["inputs"][
        "overlap"], decode["inputs"]["temporal_size"], decode["inputs"]["temporal_overlap"]) == (512, 64, 64, 16)
    assert engine_vae(api, decode["inputs"]["vae"][0]) == LTX25_VIDEO_VAE
    sound_id, sound = only(api, "LTXVAudioVAEDecode")
    assert sound["inputs"]["samples"] == [split2_id, 1]
    assert api[sound["inputs"]["audio_vae"][0]]["inputs"] == {"vae_name": LTX25_AUDIO_VAE}
    _, video = only(api, "CreateVideo")
    assert video["inputs"] == {"images": [decode_id, 0], "audio": [sound_id, 0], "fps": 24.0, "bit_depth": 8}


def test_ltx25_flf_is_comfyuis_first_last_frame_template_with_the_engine_in_unetloaders_place():
    """ComfyUI's LTX-2.5 First-Last-Frame template, flattened: one pass at 640x352 (its images' 640x360), the first
    image at frame 0 then the last at frame -1 through LTXVAddGuide at 0.7 (each after LTXV Preprocess 18) with the
    video VAE, LTXVDualCFGGuider at 1 / 1 on the engine's MODEL, SamplerEulerAncestral eta 0, the 8 ManualSigmas, the
    audio (121 frames at 24 fps); the guide frames cropped off before the video VAE decodes."""
    _, api = load("ltx-2.5-flf")
    engine_id, _ = only(api, "XDiTEngine")
    sampler_id, _ = only(api, "SamplerCustomAdvanced")
    guider = source(api, sampler_id, "guider")[1]
    assert guider["class_type"] == "LTXVDualCFGGuider" and guider["inputs"]["model"] == [engine_id, 1]
    assert (guider["inputs"]["video_cfg"], guider["inputs"]["audio_cfg"]) == (1.0, 1.0)
    assert source(api, sampler_id, "sampler")[1]["inputs"] == {"eta": 0.0, "s_noise": 1.0}
    av_id, _ = source(api, sampler_id, "latent_image")
    last_id, last = source(api, av_id, "video_latent")
    first_id, first = source(api, last_id, "latent")
    assert (first["inputs"]["frame_idx"], first["inputs"]["strength"]) == (0, 0.7)
    assert (last["inputs"]["frame_idx"], last["inputs"]["strength"]) == (-1, 0.7)
    assert guider["inputs"]["positive"] == [last_id, 0] and guider["inputs"]["negative"] == [last_id, 1]
    for guide in (first, last):
        assert engine_vae(api, guide["inputs"]["vae"][0]) == LTX25_VIDEO_VAE
        frame = api[guide["inputs"]["image"][0]]
        assert frame["class_type"] == "LTXVPreprocess" and frame["inputs"]["img_compression"] == 18
        scaled = api[frame["inputs"]["image"][0]]["inputs"]
        assert (scaled["width"], scaled["height"], scaled["crop"]) == (640, 360, "center")
    assert source(api, first_id, "latent")[1]["inputs"] == {"width": 640, "height": 352, "length": 121,
                                                            "batch_size": 1}
    assert source(api, first_id, "positive")[1]["inputs"]["frame_rate"] == 24.0
    _, audio = source(api, av_id, "audio_latent")
    assert {k: audio["inputs"][k] for k in ("frames_number", "frame_rate")} == {"frames_number": 121, "frame_rate": 24.0}
    split_id, _ = only_after(api, sampler_id)
    crop_id, crop = only(api, "LTXVCropGuides")
    assert crop["inputs"] == {"positive": [last_id, 0], "negative": [last_id, 1], "latent": [split_id, 0]}
    decode = only(api, "VAEDecodeTiled")[1]
    assert decode["inputs"]["samples"] == [crop_id, 2]
    assert engine_vae(api, decode["inputs"]["vae"][0]) == LTX25_VIDEO_VAE


def only_after(api, node_id):
    """The one LTXVSeparateAVLatent that takes node_id's first output."""
    takers = [(i, n) for i, n in api.items()
              if n["class_type"] == "LTXVSeparateAVLatent" and [node_id, 0] in n["inputs"].values()]
    assert len(takers) == 1, takers
    return takers[0]


# ---- the checks themselves -----------------------------------------------------------------------------------------
def test_the_test_catches_a_broken_workflow(definitions):
    """The translation and the checks reject what they should: a dropped link, a swapped widget, a stray input."""
    ui, api = load("flux1-dev")
    broken = json.loads(json.dumps(api))
    sampler_id, _ = only(broken, "XDiTSampler")
    broken[sampler_id]["inputs"]["cfg"] = 3.0
    assert ui_to_api(ui, definitions) != broken
    broken = json.loads(json.dumps(api))
    broken[sampler_id]["inputs"]["control_after_generate"] = "fixed"
    assert ui_to_api(ui, definitions) != broken
    bad = json.loads(json.dumps(ui))
    next(n for n in bad["nodes"] if n["type"] == "XDiTSampler")["widgets_values"].pop(1)  # the "fixed" mode
    with pytest.raises(AssertionError):
        ui_to_api(bad, definitions)


def test_the_layout_checks_catch_an_overlap_and_a_node_too_small_for_its_texts(definitions):
    ui, _ = load("qwen-image")
    moved = json.loads(json.dumps(ui))
    engine = next(n for n in moved["nodes"] if n["type"] == "XDiTEngine")
    clip = next(n for n in moved["nodes"] if n["type"] == "CLIPLoader")
    engine["pos"] = [clip["pos"][0] + 10, clip["pos"][1] + clip["size"][1] + 10]   # its title bar on the loader
    assert (clip["id"], engine["id"]) in overlaps(moved)
    narrow = json.loads(json.dumps(ui))
    engine = next(n for n in narrow["nodes"] if n["type"] == "XDiTEngine")
    engine["size"][0] = 270   # the frontend's default width: "qwen_image_fp8_e4m3fn.safetensors" would be cut
    assert [n[0] for n in undersized(narrow, definitions)] == [engine["id"]]


def first_pass_latents(api, first, kind, frames_number, frame_rate):
    """An LTX template's pass-1 latent: the empty 640x352x121 video (image-to-video: the image in its first frame at
    strength 0.7) and the empty audio of the template's frame count and rate, joined by LTXVConcatAVLatent."""
    _, video = source(api, source(api, first, "latent_image")[0], "video_latent")
    if kind == "i2v":
        assert video["class_type"] == "LTXVImgToVideoInplace" and video["inputs"]["strength"] == 0.7
        video = api[video["inputs"]["latent"][0]]
    assert video["inputs"] == {"width": 640, "height": 352, "length": 121, "batch_size": 1}
    _, audio = source(api, source(api, first, "latent_image")[0], "audio_latent")
    assert {k: audio["inputs"][k] for k in ("frames_number", "frame_rate")} == \
        {"frames_number": frames_number, "frame_rate": frame_rate}
