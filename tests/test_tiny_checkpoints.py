"""The synthetic checkpoints use the real BFL (FLUX.1) and SAI (SD3/SD3.5) key layouts.

The reference is diffusers' own single-file converters, which turn a ComfyUI-style checkpoint into a
diffusers state dict: the full-size layout (on the meta device, no memory) must convert without
leftovers into exactly the state dict of the diffusers transformer with the real config.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from safetensors import safe_open

from engine import families
from engine.families.flux import FluxDims
from engine.models.tiny import COMFY_PREFIX, shapes_for, write_tiny

# FLUX.1 and SD3/SD3.5, the families diffusers has single-file converters for
CONVERTED = [families.get("flux"), families.get("sd3")]
REAL = {v: d for f in CONVERTED for v, d in f.dims["full"].items()}
TINY = {v: d for f in CONVERTED for v, d in f.dims["tiny"].items()}
VARIANTS = {f.name: f.variants for f in CONVERTED}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def diffusers_model(dims):
    with torch.device("meta"):
        if isinstance(dims, FluxDims):
            return FluxTransformer2DModel(
                patch_size=1, in_channels=dims.in_channels, num_layers=dims.depth, num_single_layers=dims.depth_single,
                attention_head_dim=dims.head_dim, num_attention_heads=dims.heads, joint_attention_dim=dims.context_in,
                pooled_projection_dim=dims.vec_in, guidance_embeds=dims.guidance_embed, axes_dims_rope=dims.axes_dim)
        return SD3Transformer2DModel(
            sample_size=128, patch_size=dims.patch, in_channels=dims.in_channels, num_layers=dims.depth,
            attention_head_dim=dims.head_dim, num_attention_heads=dims.heads, joint_attention_dim=dims.context_in,
            caption_projection_dim=dims.hidden, pooled_projection_dim=dims.pooled_in, out_channels=dims.in_channels,
            pos_embed_max_size=dims.pos_embed_max_size, dual_attention_layers=dims.dual_attention_layers,
            qk_norm="rms_norm" if dims.qk_norm else None)


def convert(dims, checkpoint):
    if isinstance(dims, FluxDims):
        return convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    return convert_sd3_transformer_checkpoint_to_diffusers(checkpoint)


@pytest.mark.parametrize("variant", sorted(REAL))
def test_full_size_layout_converts_exactly_into_the_diffusers_transformer(variant):
    dims = REAL[variant]
    checkpoint = {COMFY_PREFIX + k: torch.empty(s, device="meta") for k, s in shapes_for(variant, dims).items()}
    converted = convert(dims, checkpoint)
    assert checkpoint == {}, f"keys the converter did not consume: {sorted(checkpoint)[:5]}"
    expected = {k: tuple(v.shape) for k, v in diffusers_model(dims).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in converted.items()}
    assert sorted(set(expected) - set(got)) == []
    assert sorted(set(got) - set(expected)) == []
    assert got == expected


@pytest.mark.parametrize("variant", sorted(set(VARIANTS["sd3"])))
def test_tiny_sd3_file_converts_exactly_into_a_tiny_diffusers_transformer(tmp_path, variant):
    # diffusers' FLUX converter hard-codes the 3072 width, so only SD3 converts at tiny size.
    path = write_tiny("sd3", str(tmp_path), variant=variant)
    with safe_open(path, "pt") as f:
        checkpoint = {k: f.get_tensor(k) for k in f.keys()}
    converted = convert(TINY[variant], checkpoint)
    model = diffusers_model(TINY[variant]).to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert (missing, unexpected, checkpoint) == ([], [], {})


@pytest.mark.parametrize("kind,variant", [(k, v) for k, vs in VARIANTS.items() for v in vs])
def test_tiny_file_holds_the_layout_at_tiny_dims_with_4_heads_and_4_blocks(tmp_path, kind, variant):
    path = write_tiny(kind, str(tmp_path), variant=variant)
    dims = TINY[variant]
    with safe_open(path, "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        meta = json.loads(f.metadata()["xdit.synthetic"])
    assert got == shapes_for(variant)
    assert dims.heads >= 4
    blocks = [dims.depth, dims.depth_single] if kind == "flux" else [dims.depth]
    assert min(blocks) >= 4
    assert meta["variant"] == variant


def test_flux_dev_has_guidance_embedding_and_schnell_does_not():
    assert "guidance_in.in_layer.weight" in shapes_for("flux-dev")
    assert not any(k.startswith("guidance_in") for k in shapes_for("flux-schnell"))


def test_same_seed_gives_identical_weights_and_another_seed_differs(tmp_path):
    # (file bytes may differ: safetensors orders its JSON header by hash)
    def load(path):
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    a = load(write_tiny("flux", str(tmp_path / "a")))
    b = load(write_tiny("flux", str(tmp_path / "b")))
    c = load(write_tiny("flux", str(tmp_path / "c"), seed=1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1)


def test_fp8_file_stores_matrices_in_fp8_and_vectors_in_bf16(tmp_path):
    path = write_tiny("flux", str(tmp_path), dtype="fp8_e4m3fn")
    with safe_open(path, "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes["double_blocks.0.img_attn.qkv.weight"] == torch.float8_e4m3fn
    assert dtypes["double_blocks.0.img_attn.qkv.bias"] == torch.bfloat16
    assert dtypes["double_blocks.0.img_attn.norm.query_norm.scale"] == torch.bfloat16


def test_full_checkpoint_prefixes_the_transformer_and_carries_encoder_and_vae_keys(tmp_path):
    path = write_tiny("sd3", str(tmp_path), full=True)
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    transformer = {k for k in keys if k.startswith(COMFY_PREFIX)}
    assert {k[len(COMFY_PREFIX):] for k in transformer} == set(shapes_for("sd3-medium"))
    assert any(k.startswith("text_encoders.t5xxl.") for k in keys)
    assert any(k.startswith("first_stage_model.") for k in keys)


def test_make_tiny_cli_writes_the_file_it_names(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "make-tiny", "--kind", "sd3", "--variant", "sd3.5-medium",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[0].split()[1]  # "wrote   PATH (size, dtype weights)"
    assert os.path.isfile(path) and path.startswith(str(tmp_path))
    with safe_open(path, "pt") as f:
        assert any(".attn2." in k for k in f.keys())
