"""Loading the transformer out of the checkpoints ComfyUI users have: every layout gives the same model,
conversion agrees with diffusers' own single-file converters, fp8 stays fp8, bad files fail clearly, and
nothing touches the network."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.flow import Conditioning, FlowModel
from engine import families
from engine.models.convert import apply_op, key_map as convert_key_map
from engine.models.load import inspect_checkpoint, load_transformer
from engine.models.quantized import CastLinear
from engine.models.safetensors_file import CheckpointError
from engine.models.tiny import shapes_for, write_tiny
from dataclasses import replace

from conftest import ROOT


def tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def forward(loaded, seed=0):
    """One prediction on fixed inputs: the transformer output that every layout must reproduce."""
    g = torch.Generator().manual_seed(seed)
    cfg = loaded.info.config
    pooled = cfg["pooled_projection_dim"]
    x = torch.randn(1, 16, 8, 8, generator=g)
    side = Conditioning(torch.randn(1, 12, 4096, generator=g), torch.randn(1, pooled, generator=g), 3.5)
    flow = FlowModel(loaded)
    return flow.velocity(x, torch.tensor(0.6), flow.prepare([side], batch=1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    paths = {}
    for kind, variant in (("flux", "flux-dev"), ("flux", "flux-schnell"), ("sd3", "sd3-medium"),
                          ("sd3", "sd3.5-medium"), ("sd3", "sd3.5-large")):
        paths[variant] = write_tiny(kind, str(d), variant=variant)
        paths[variant + "/prefixed"] = write_tiny(kind, str(d), variant=variant, prefix=True)
        paths[variant + "/full"] = write_tiny(kind, str(d), variant=variant, full=True)
    return d, paths


def diffusers_layouts(loaded, out_dir):
    """The same weights as a diffusers-format single file and as a sharded diffusers folder."""
    state = {k: v.contiguous() for k, v in loaded.model.state_dict().items()}
    single = os.path.join(out_dir, "diffusers-single.safetensors")
    with safe_open(loaded.path, "pt") as f:
        metadata = f.metadata()  # tiny FLUX states its RoPE axes here; a real 128-wide FLUX needs nothing
    save_file(state, single, metadata=metadata)
    folder = os.path.join(out_dir, "diffusers-folder")
    loaded.model.save_pretrained(folder, max_shard_size="2MB")
    return single, folder


@pytest.mark.parametrize("variant", ["flux-dev", "flux-schnell", "sd3-medium", "sd3.5-medium", "sd3.5-large"])
def test_every_layout_of_the_same_weights_gives_identical_transformer_outputs(tiny_dir, tmp_path, variant):
    _, paths = tiny_dir
    reference = load_transformer(paths[variant])
    single, folder = diffusers_layouts(reference, str(tmp_path))
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1  # really sharded
    from tolerance import fp32_bound, report
    weights = reference.model.state_dict()
    want = forward(reference)
    # the weights sit at other alignments in each file, so BLAS may sum in another order: equal to fp32 rounding
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=blocks(reference))
    for path in (paths[variant + "/prefixed"], paths[variant + "/full"], single, folder):
        loaded = load_transformer(path)
        assert loaded.info.variant == variant and loaded.info.config == reference.info.config, path
        assert_same_weights(loaded.model.state_dict(), weights, path)  # exact by construction: the same values
        got = forward(loaded)
        assert report(f"{variant} {os.path.basename(path)} ({loaded.info.layout})", (got - want).abs().max(), bound)


def assert_same_weights(got, want, where):
    """Bitwise: every tensor has the same name, dtype, shape and values (how they are computed on is another matter)."""
    assert sorted(got) == sorted(want), where
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{where}: {k} differs"


def blocks(loaded):
    """Transformer blocks one prediction passes through in sequence (FLUX: double + single stream)."""
    return loaded.info.config["num_layers"] + loaded.info.config.get("num_single_layers", 0)


def test_a_full_checkpoint_loads_only_the_transformer(tiny_dir):
    _, paths = tiny_dir
    loaded = load_transformer(paths["sd3-medium/full"])
    assert loaded.stats["ignored_tensors"] == 4
    assert loaded.info.prefix == "model.diffusion_model."


def test_sd3_conversion_equals_diffusers_single_file_converter_value_for_value(tiny_dir):
    _, paths = tiny_dir
    for variant in ("sd3-medium", "sd3.5-medium", "sd3.5-large"):
        theirs = convert_sd3_transformer_checkpoint_to_diffusers(tensors(paths[variant + "/prefixed"]))
        ours = load_transformer(paths[variant]).model.state_dict()
        assert sorted(theirs) == sorted(ours)
        diffs = [(theirs[k] - ours[k]).abs().max().item() for k in ours]
        print(f"{variant}: {len(ours)} tensors, max abs diff {max(diffs)}")
        assert max(diffs) == 0


def test_flux_conversion_equals_diffusers_single_file_converter_at_full_width():
    # diffusers' FLUX converter hard-codes FLUX.1's 3072 width, so compare at full width with one block of each
    # kind. Each tensor is a random column broadcast across its rows' width: distinct rows (any mix-up of
    # q/k/v, mlp or shift/scale rows shows) for the memory of a vector.
    flux = families.get("flux")
    dims = replace(flux.variant_dims("flux-dev", "full"), depth=1, depth_single=1)
    g = torch.Generator().manual_seed(0)
    checkpoint = {}
    for k, shape in shapes_for("flux-dev", dims).items():
        checkpoint[k] = torch.randn(shape[0], generator=g) if len(shape) == 1 else \
            torch.randn(shape[0], 1, generator=g).expand(shape)
    info_config = {"num_attention_heads": dims.heads, "attention_head_dim": dims.head_dim, "guidance_embeds": True,
                   "num_layers": 1, "num_single_layers": 1}
    ours = {dst: apply_op(checkpoint[src], op) for dst, src, op in flux.key_map("bfl", info_config)}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(checkpoint))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].shape == theirs[k].shape and torch.equal(ours[k][:, :1] if ours[k].ndim == 2 else ours[k],
                                                                theirs[k][:, :1] if theirs[k].ndim == 2 else theirs[k]), k
    print(f"flux-dev at width 3072: {len(ours)} tensors identical to diffusers' converter")


def test_fp8_weights_stay_fp8_and_compute_in_the_requested_dtype(tmp_path):
    path = write_tiny("flux", str(tmp_path), dtype="fp8_e4m3fn")
    fp32 = load_transformer(path, dtype="fp32")
    linears = [m for m in fp32.model.modules() if isinstance(m, CastLinear)]
    assert len(linears) == fp32.stats["fp8_linears"] > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in fp32.model.modules())
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    fp8_bytes = sum(p.numel() * p.element_size() for p in fp32.model.parameters())
    full_bytes = sum(p.numel() * 4 for p in fp32.model.parameters())
    print(f"fp8 model holds {fp8_bytes / 2**20:.1f} MiB of weights; an fp32 copy would be {full_bytes / 2**20:.1f} MiB")
    assert fp8_bytes < 0.3 * full_bytes
    # reference: the same fp8 values upcast to fp32 once, up front
    from tolerance import fp32_bound, report
    upcast = load_transformer(write_upcast(path, tmp_path), dtype="fp32")
    # fp8 -> fp32 is exact: the same values, bitwise; computed on, a per-call cast and a stored fp32 copy sit at other
    # alignments, so BLAS may sum in another order
    as_fp32 = {k: v.float() for k, v in fp32.model.state_dict().items()}
    assert_same_weights(as_fp32, upcast.model.state_dict(), upcast.path)
    want = forward(upcast)
    got = forward(fp32)
    assert report("fp8 weights, fp32 compute vs pre-upcast fp32", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4096, depth=blocks(fp32)))
    bf16 = forward(load_transformer(path, dtype="bf16"))
    rel = ((bf16 - want).norm() / want.norm()).item()
    print(f"fp8 weights, bf16 compute vs fp32 compute: relative L2 {rel:.3g}")
    assert torch.isfinite(bf16).all() and rel < 0.05


def write_upcast(path, tmp_path):
    out = str(tmp_path / "upcast.safetensors")
    with safe_open(path, "pt") as f:
        save_file({k: f.get_tensor(k).float() for k in f.keys()}, out, metadata=f.metadata())
    return out


def test_bf16_compute_embeds_the_timestep_in_fp32(tiny_dir):
    _, paths = tiny_dir
    loaded = load_transformer(paths["flux-dev"], dtype="bf16")
    seen = []
    hook = loaded.model.time_text_embed.time_proj.register_forward_hook(lambda m, a, out: seen.append(a[0]))
    forward(loaded)
    hook.remove()
    assert seen[0].dtype == torch.float32
    assert seen[0][0].item() == pytest.approx(600.0, abs=1e-4)  # sigma 0.6 * 1000 in fp32 (bf16 would give 600 too,
    assert seen[1].dtype == torch.float32                       # but 0.6 itself is not a bf16 value)
    assert seen[1][0].item() == pytest.approx(3500.0)


# ---- bad files ---------------------------------------------------------------------------------------------
def test_a_file_that_is_not_safetensors_is_named_as_such(tmp_path):
    p = tmp_path / "model.ckpt"
    p.write_bytes(b"PK\x03\x04" + os.urandom(4000))
    with pytest.raises(CheckpointError, match=r"model.ckpt is a zip archive .*use the .safetensors release.*not a safetensors file"):
        inspect_checkpoint(str(p))


def test_a_truncated_file_says_so_with_the_numbers(tiny_dir, tmp_path):
    _, paths = tiny_dir
    data = open(paths["flux-dev"], "rb").read()
    p = tmp_path / "cut.safetensors"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut.safetensors is truncated: tensor .* ends at byte \d+ .* "
                                              r"holds only \d+ data bytes"):
        inspect_checkpoint(str(p))


def test_a_header_that_lies_about_sizes_is_caught(tiny_dir, tmp_path):
    _, paths = tiny_dir
    data = open(paths["flux-dev"], "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    key = "img_in.weight"
    header[key]["shape"] = [header[key]["shape"][0] * 2, header[key]["shape"][1]]
    raw = json.dumps(header).encode()
    p = tmp_path / "liar.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(CheckpointError, match=r"header lies about tensor 'img_in.weight': shape \[256, 64\] F32 needs "
                                              r"65536 bytes but its offsets .* span 32768"):
        inspect_checkpoint(str(p))


def test_an_sdxl_unet_is_recognised_and_refused_by_name(tmp_path):
    p = tmp_path / "sdxl.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4),
               "model.diffusion_model.label_emb.0.0.weight": torch.zeros(4, 4)}, str(p))
    with pytest.raises(CheckpointError, match="looks like an SDXL UNet, not a transformer the engine runs"):
        inspect_checkpoint(str(p))


def test_missing_and_unexpected_keys_are_named(tiny_dir, tmp_path):
    _, paths = tiny_dir
    weights = tensors(paths["sd3-medium"])
    del weights["joint_blocks.1.x_block.mlp.fc1.weight"]
    save_file(weights, str(tmp_path / "missing.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 keys: joint_blocks.1.x_block.mlp.fc1.weight"):
        load_transformer(str(tmp_path / "missing.safetensors"))
    weights = tensors(paths["flux-dev"])
    weights["double_blocks.0.img_attn.qkv.scale_weight"] = torch.ones(1)
    save_file(weights, str(tmp_path / "extra.safetensors"), metadata={"xdit.synthetic": json.dumps(
        {"dims": {"axes_dim": [4, 14, 14]}})})
    with pytest.raises(CheckpointError, match=r"1 unexpected keys: double_blocks.0.img_attn.qkv.scale_weight"):
        load_transformer(str(tmp_path / "extra.safetensors"))


def test_a_missing_path_and_an_empty_folder_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_checkpoint(str(tmp_path / "nope.safetensors"))
    with pytest.raises(CheckpointError, match="holds no .safetensors files"):
        inspect_checkpoint(str(tmp_path))


def test_loading_works_with_networking_disabled(tiny_dir):
    _, paths = tiny_dir
    code = (
        "import socket\n"
        "def refuse(*a, **k):\n    raise OSError('network disabled in this test')\n"
        "socket.socket.connect = refuse\nsocket.create_connection = refuse\nsocket.getaddrinfo = refuse\n"
        "import sys\nfrom engine.models.load import load_transformer\n"
        "for p in sys.argv[1:]:\n    m = load_transformer(p)\n    print(m.info.variant)\n")
    args = [paths["flux-dev/full"], paths["sd3.5-medium/prefixed"]]
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["flux-dev", "sd3.5-medium"]


def test_fp8_weight_dtype_stores_a_bf16_file_in_fp8_and_matches_the_fp8_file(tmp_path):
    bf16_path = write_tiny("flux", str(tmp_path), dtype="bf16")
    stored_fp8 = load_transformer(bf16_path, dtype="fp32", fp8_weights=True)
    assert stored_fp8.stats["fp8_linears"] > 0
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in stored_fp8.model.modules() if isinstance(m, CastLinear))
    # reference: the bf16 file's own values, cast to fp8 once and saved as an fp8 file
    with safe_open(bf16_path, "pt") as f:
        fp8_file = {k: (f.get_tensor(k).to(torch.float8_e4m3fn) if len(f.get_slice(k).get_shape()) == 2
                        else f.get_tensor(k)) for k in f.keys()}
        metadata = f.metadata()
    reference = str(tmp_path / "reference-fp8.safetensors")
    save_file(fp8_file, reference, metadata=metadata)
    from tolerance import fp32_bound, report
    saved_fp8 = load_transformer(reference, dtype="fp32")
    assert_same_weights(stored_fp8.model.state_dict(), saved_fp8.model.state_dict(), reference)  # the same fp8 values
    got, want = forward(stored_fp8), forward(saved_fp8)
    assert report("bf16 file stored as fp8 at load vs the same values saved in fp8", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4096, depth=blocks(saved_fp8)))


@pytest.mark.parametrize("kind", families.names())
def test_the_fp8_weight_option_holds_linear_weights_alone_in_fp8_never_a_float32_island_on_every_load_path(
        tmp_path, kind):
    """One rule for every loader (reader.Holding): with the fp8 weight option a bf16 model holds exactly its Linear
    layers' weights in fp8 (each then cast per call), never a 2-D tensor that no Linear casts (LTX-2.3's
    scale_shift_tables, which diffusers cannot promote from fp8) and never a family's float32 island (MiniMax-H3's patch
    projections, time embedding and output heads stay float32). The same dtypes from the file whole, from the plan
    the divided load stores by, and from random weights; and an fp8 file's non-Linear matrices are widened."""
    from engine.models.load import build_empty, inspect_model, load_model
    from engine.models.reader import FP8, Holding, checkpoint_files, read_headers
    from engine.models.sharded import _storage
    family = families.get(kind)
    path = write_tiny(kind, str(tmp_path), dtype="bf16")
    info = inspect_model(path)
    model = build_empty(info)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    islands = {n for n, _ in model.named_parameters() if family.fp32_params(n)}
    want = {n: (torch.float32 if n in islands else torch.float8_e4m3fn if n in linear else torch.bfloat16)
            for n, p in model.named_parameters() if p.is_floating_point()}
    loaded = load_model(path, dtype="bf16", fp8_weights=True)
    held = {n: p.dtype for n, p in loaded.model.named_parameters() if p.dtype.is_floating_point}
    assert held == want, {n: (held.get(n), w) for n, w in want.items() if held.get(n) != w}
    where, _ = read_headers(checkpoint_files(path))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = _storage(where, info, convert_key_map(info) or [(k, k, None) for k in expected], expected,
                    Holding.of(info, model, torch.bfloat16, True))
    assert {n: plan[n][0] for n in want} == want
    synthetic = load_model(f"synthetic:{family.variants[0]}:tiny", dtype="bf16", fp8_weights=True).model
    assert {n: p.dtype for n, p in synthetic.named_parameters() if p.dtype.is_floating_point} == want
    fp8_file = write_tiny(kind, str(tmp_path / "fp8"), dtype="fp8_e4m3fn")
    stored = {n: p.dtype for n, p in load_model(fp8_file, dtype="bf16").model.named_parameters()}
    assert not [n for n, d in stored.items() if d in FP8 and n not in linear]
    print(f"{kind}: {sum(d in FP8 for d in held.values())} Linear weights in fp8, {len(islands)} float32 island "
          f"tensors, {sum(1 for n, p in model.named_parameters() if p.ndim == 2 and n not in linear)} other matrices "
          f"in bf16")
