"""LoRAs inside the ranks: every format users have gives the same model as the LoRA merged into the checkpoint
itself (the reference: W + s * up @ down * alpha / rank, written into the BFL/SAI file and loaded normally);
chained LoRAs add up; removing them restores the base weights exactly; a LoRA for another model is refused."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.runtime.client import Engine
from engine.generate.request import GenerateRequest
from engine.models.lora import WeightPatches
from engine.models.safetensors_file import CheckpointError
from engine.models.tiny import write_tiny

from conftest import FAST

FLUX_LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.2.linear1",
               "single_blocks.0.linear2", "final_layer.adaLN_modulation.1", "txt_in"]


def factors(weights, layers, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        n_out, n_in = weights[layer + ".weight"].shape
        out[layer] = (torch.randn(rank, n_in, generator=g) * 0.1, torch.randn(n_out, rank, generator=g) * 0.1, 8.0)
    return out


def kohya(f):
    t = {}
    for layer, (down, up, alpha) in f.items():
        name = "lora_unet_" + layer.replace(".", "_")
        t.update({name + ".lora_down.weight": down, name + ".lora_up.weight": up, name + ".alpha": torch.tensor(alpha)})
    return t


def comfy_peft(f):
    t = {}
    for layer, (down, up, alpha) in f.items():
        t.update({f"diffusion_model.{layer}.lora_A.weight": down, f"diffusion_model.{layer}.lora_B.weight": up,
                  f"diffusion_model.{layer}.alpha": torch.tensor(alpha)})
    return t


def diffusers_format(f, hidden):
    """The same LoRA as diffusers trains it: one (A, B) per diffusers linear; fused BFL layers split by rows of B."""
    t = {}

    def put(name, down, up, alpha):
        t.update({f"transformer.{name}.lora_A.weight": down.clone(), f"transformer.{name}.lora_B.weight": up.contiguous(),
                  f"transformer.{name}.alpha": torch.tensor(alpha)})
    for layer, (down, up, alpha) in f.items():
        if layer == "double_blocks.0.img_attn.qkv":
            for i, n in enumerate(("to_q", "to_k", "to_v")):
                put(f"transformer_blocks.0.attn.{n}", down, up[i * hidden:(i + 1) * hidden], alpha)
        elif layer == "double_blocks.1.txt_mlp.0":
            put("transformer_blocks.1.ff_context.net.0.proj", down, up, alpha)
        elif layer == "single_blocks.2.linear1":
            for i, n in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
                put(f"single_transformer_blocks.2.{n}", down, up[i * hidden:(i + 1) * hidden], alpha)
            put("single_transformer_blocks.2.proj_mlp", down, up[3 * hidden:], alpha)
        elif layer == "single_blocks.0.linear2":
            put("single_transformer_blocks.0.proj_out", down, up, alpha)
        elif layer == "final_layer.adaLN_modulation.1":  # diffusers keeps (scale, shift): B's halves swapped
            put("norm_out.linear", down, torch.cat([up[hidden:], up[:hidden]]), alpha)
        elif layer == "txt_in":
            put("context_embedder", down, up, alpha)
    return t


def merged_checkpoint(base_path, out_path, *loras):
    with safe_open(base_path, "pt") as f:
        weights, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    for strength, f in loras:
        for layer, (down, up, alpha) in f.items():
            weights[layer + ".weight"] = weights[layer + ".weight"] + strength * (up @ down) * (alpha / down.shape[0])
    save_file(weights, out_path, metadata=metadata)
    return out_path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = write_tiny("flux", str(d))
    with safe_open(base, "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    f1, f2 = factors(weights, FLUX_LAYERS, seed=1), factors(weights, FLUX_LAYERS[:3], seed=2)
    files = {}
    for name, tensors in (("kohya", kohya(f1)), ("comfy", comfy_peft(f1)), ("diffusers", diffusers_format(f1, 128)),
                          ("second", kohya(f2))):
        files[name] = str(d / f"{name}.safetensors")
        save_file(tensors, files[name])
    engine = Engine(1, device="cpu", deadlines=FAST)
    yield dict(dir=d, base=base, f1=f1, f2=f2, files=files, engine=engine)
    engine.close()


def run(s, model, loras=(), weight_patches=None):
    g = torch.Generator().manual_seed(4)
    r = GenerateRequest(model=model, cond=torch.randn(1, 16, 4096, generator=g), pooled=torch.randn(1, 768, generator=g),
                        latent_raw=torch.zeros(1, 16, 16, 16), seed=2, steps=3, loras=list(loras))
    r = r.validate()
    result = r.submit(s["engine"], weight_patches=weight_patches)
    return result.outputs["samples"], result.ranks[0]


def comfy_patches(f, strength, hidden=128, split_qkv=False, digest="p"):
    """The weight patches ComfyUI's LoRA loader puts on a MODEL for these factors, keyed by ComfyUI's parameter names
    (FLUX.1's BFL names); split_qkv: as a diffusers-format LoRA lands on the fused qkv (one patch per q, k, v rows)."""
    entries, tensors = [], {}
    for layer, (down, up, alpha) in f.items():
        parts = [(up, None)]
        if split_qkv and layer.endswith("qkv"):
            parts = [(up[i * hidden:(i + 1) * hidden], [0, i * hidden, hidden]) for i in range(3)]
        for rows, offset in parts:
            i = len(entries)
            entries.append({"key": layer + ".weight", "kind": "lora", "scale": strength * alpha / down.shape[0],
                            "offset": offset})
            tensors[f"{i}.up"], tensors[f"{i}.down"] = rows, down
    return WeightPatches(digest, tuple(entries), tensors)


@pytest.mark.parametrize("fmt", ["kohya", "comfy", "diffusers"])
def test_each_lora_format_equals_the_lora_merged_into_the_checkpoint(setup, fmt):
    want, _ = run(setup, merged_checkpoint(setup["base"], str(setup["dir"] / f"merged-{fmt}.safetensors"),
                                           (0.8, setup["f1"])))
    got, info = run(setup, setup["base"], [(setup["files"][fmt], 0.8)])
    diff = (got - want).abs().max().item()
    print(f"{fmt} LoRA at 0.8 vs merged checkpoint: max abs diff {diff:.3g}; layers touched "
          f"{info.get('lora_layers_touched')}")
    assert diff <= 1e-4


def test_chained_loras_add_up_and_removing_them_restores_the_base_exactly(setup):
    base, _ = run(setup, setup["base"])
    want, _ = run(setup, merged_checkpoint(setup["base"], str(setup["dir"] / "merged-both.safetensors"),
                                           (1.0, setup["f1"]), (-0.5, setup["f2"])))
    got, _ = run(setup, setup["base"], [(setup["files"]["kohya"], 1.0), (setup["files"]["second"], -0.5)])
    diff = (got - want).abs().max().item()
    print(f"two chained LoRAs vs both merged: max abs diff {diff:.3g}")
    assert diff <= 1e-4
    restored, info = run(setup, setup["base"])
    print(f"LoRAs removed: restored from the checkpoint ({info.get('lora_restore_bytes')} bytes read); equal to the base "
          f"latent: {torch.equal(restored, base)}")
    assert info["lora_changed"] and torch.equal(restored, base)
    _, again = run(setup, setup["base"])
    assert "lora_changed" not in again  # no LoRA before and after: nothing to do


@pytest.mark.parametrize("split_qkv", [False, True], ids=["whole-layers", "qkv-rows"])
def test_a_models_lora_patches_equal_the_lora_merged_into_the_checkpoint(setup, split_qkv):
    """ComfyUI's LoRA loaders on the engine's MODEL hand over patches keyed by ComfyUI's names: applied on the ranks
    they give the merged checkpoint's latent; the same patches again cost nothing; without them the base returns."""
    want, _ = run(setup, merged_checkpoint(setup["base"], str(setup["dir"] / "merged-patches.safetensors"),
                                           (0.8, setup["f1"])))
    patches = comfy_patches(setup["f1"], 0.8, split_qkv=split_qkv, digest=f"f1-{split_qkv}")
    got, info = run(setup, setup["base"], weight_patches=patches)
    diff = (got - want).abs().max().item()
    print(f"ComfyUI LoRA patches ({'qkv rows' if split_qkv else 'whole layers'}) vs merged: max abs diff {diff:.3g}; "
          f"layers touched {info.get('lora_layers_touched')}")
    assert diff <= 1e-4 and info["lora_changed"]
    _, again = run(setup, setup["base"], weight_patches=patches)
    assert again["lora_changed"] is False
    base, _ = run(setup, setup["base"])
    restored, info = run(setup, setup["base"])
    assert torch.equal(base, restored)


def test_the_same_lora_list_is_applied_once(setup):
    run(setup, setup["base"], [(setup["files"]["comfy"], 1.0)])
    _, info = run(setup, setup["base"], [(setup["files"]["comfy"], 1.0)])
    assert info["lora_changed"] is False


def test_a_lora_for_another_model_family_is_refused_before_launch(setup, tmp_path):
    sd3_lora = str(tmp_path / "sd3-lora.safetensors")
    save_file({"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.zeros(192, 4)}, sd3_lora)
    with pytest.raises(CheckpointError, match="1 of its 1 layers match no layer of this flux-dev model.*another model"):
        run(setup, setup["base"], [(sd3_lora, 1.0)])
    not_a_lora = str(tmp_path / "weights.safetensors")
    save_file({"x.weight": torch.zeros(2, 2)}, not_a_lora)
    with pytest.raises(CheckpointError, match="holds no LoRA layers"):
        run(setup, setup["base"], [(not_a_lora, 1.0)])


def test_sd3_kohya_lora_equals_the_merged_checkpoint(tmp_path):
    base = write_tiny("sd3", str(tmp_path), variant="sd3.5-medium")
    with safe_open(base, "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    f = factors(weights, ["joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.context_block.mlp.fc1",
                          "joint_blocks.0.x_block.attn2.proj", "joint_blocks.3.context_block.adaLN_modulation.1"])
    lora = str(tmp_path / "sd3-kohya.safetensors")
    save_file(kohya(f), lora)
    merged = merged_checkpoint(base, str(tmp_path / "merged.safetensors"), (1.0, f))
    g = torch.Generator().manual_seed(1)
    common = dict(cond=torch.randn(1, 20, 4096, generator=g), pooled=torch.randn(1, 2048, generator=g),
                  neg_cond=torch.randn(1, 20, 4096, generator=g), neg_pooled=torch.randn(1, 2048, generator=g),
                  latent_raw=torch.zeros(1, 16, 16, 16), seed=1, steps=2, cfg=3.0)
    with Engine(1, device="cpu", deadlines=FAST) as e:
        outs = []
        for model, loras in ((merged, []), (base, [(lora, 1.0)])):
            r = GenerateRequest(model=model, loras=loras, **common)
            r = r.validate()
            outs.append(e.submit("generate", *r.to_job()).outputs["samples"])
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"SD3.5 kohya LoRA (incl. the last block's swapped modulation) vs merged: max abs diff {diff:.3g}")
    assert diff <= 1e-4
