"""fp8_scaled and GGUF checkpoints: the engine keeps their weights quantized in memory, dequantizes per layer call,
and computes what the same weights dequantized into a plain fp32 safetensors file give.

The references are independent of engine/models: the plain files are written here from the gguf package's own
numpy dequantization (gguf.quants.dequantize) and from fp8 * scale_weight as ComfyUI's scaled_fp8 ops define it.
Real rank processes (gloo, CPU) run the generate jobs."""
import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.generate.request import GenerateRequest
from engine.models.gguf_file import find_gguf_files, read_gguf_header
from engine.models.load import inspect_model, load_model
from engine.models.quantize_files import quantize
from engine.models.quantized import BLOCKS, SUPPORTED, GGUFLinear, dequantize
from engine.models.safetensors_file import CheckpointError
from engine.models.tiny import make_state_dict, write_tiny
from engine.parallel.pipefusion.layout import make_layout, stage_keep
from engine.parallel.plan import ParallelPlan

from conftest import ROOT
from tolerance import fp32_bound, report, sampling_amplification

STEPS = 2
DEPTH = {"flux": 8, "sd3": 4}     # transformer blocks of the tiny models
FORMATS = [("fp8_scaled", None), ("gguf", "Q8_0"), ("gguf", "Q4_K")]
VARIANT = {"flux": "flux-dev", "sd3": "sd3.5-medium"}


# ---- independent references ------------------------------------------------------------------------------------

def gguf_dequantized(path):
    """{name: float32 tensor} through gguf's numpy reader and dequantizer, and the file's string metadata."""
    reader = gguf.GGUFReader(path)
    weights = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        weights[t.name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist())))
    field = reader.get_field("xdit.synthetic")
    return weights, {"xdit.synthetic": str(bytes(field.parts[field.data[-1]]), "utf-8")}


def scaled_dequantized(path):
    """weight = fp8 weight x scale_weight in float32 (ComfyUI's scaled_fp8 Linear); the marker and scales dropped."""
    with safe_open(path, "pt") as f:
        raw, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    weights = {}
    for name, t in raw.items():
        if name == "scaled_fp8" or name.endswith((".scale_weight", ".scale_input")):
            continue
        scale = raw.get(name[:-len("weight")] + "scale_weight") if name.endswith(".weight") else None
        weights[name] = t.float() * scale.float() if scale is not None else t.float()
    return weights, metadata


def plain_copy(path, out):
    weights, metadata = gguf_dequantized(path) if path.endswith(".gguf") else scaled_dequantized(path)
    save_file(weights, out, metadata=metadata)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{(kind, format, quant): (quantized file, its plain dequantized copy)}, written once."""
    d = tmp_path_factory.mktemp("quantized")
    out = {}
    for kind, variant in VARIANT.items():
        for fmt, quant in FORMATS:
            path = write_tiny(kind, str(d), variant=variant, format=fmt, quant=quant or "Q8_0")
            out[(kind, fmt, quant)] = (path, plain_copy(path, str(d / f"{os.path.basename(path)}.plain.safetensors")))
        out[(kind, "plain", None)] = (write_tiny(kind, str(d), variant=variant),) * 2
    return out


def request(path, kind, *, plan=ParallelPlan(), loras=(), **kw):
    g = torch.Generator().manual_seed(7)
    pooled, cfg = (768, 1.0) if kind == "flux" else (2048, 4.5)
    r = GenerateRequest(model=path, cond=torch.randn(1, 16, 4096, generator=g),
                        pooled=torch.randn(1, pooled, generator=g), neg_cond=torch.randn(1, 16, 4096, generator=g),
                        neg_pooled=torch.randn(1, pooled, generator=g),
                        latent_raw=torch.zeros(1, 16, 16, 16), seed=3, steps=STEPS, cfg=cfg, plan=plan,
                        loras=list(loras), **kw)
    r = r.validate()
    return r


def run(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], result.ranks


def bound(reference, kind, cfg):
    """The same fp32 weights through two code paths (a dequantizing layer vs a plain Linear): fp32 rounding only."""
    return fp32_bound(reference.abs().max(), reduction=4096, depth=DEPTH[kind],
                      amplification=sampling_amplification(STEPS, cfg))


def matrix_numel(path):
    """(elements of the model's Linear weight matrices, Linear layers) from a plain load."""
    linears = [m for m in load_model(path).model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(m.weight.numel() for m in linears), len(linears)


# ---- the latent equals the dequantized plain file's; memory stays quantized ------------------------------------

@pytest.mark.parametrize("kind", ["flux", "sd3"])
@pytest.mark.parametrize("fmt,quant", FORMATS, ids=lambda v: str(v))
def test_quantized_file_gives_the_latent_of_its_dequantized_plain_copy_and_holds_quantized_bytes(
        files, engines, kind, fmt, quant):
    path, plain = files[(kind, fmt, quant)]
    plan = ParallelPlan(ulysses=2) if quant == "Q4_K" else ParallelPlan()   # one K-quant case on 2 ranks
    want, plain_ranks = run(engines, request(plain, kind, plan=plan))
    got, ranks = run(engines, request(path, kind, plan=plan))
    r = request(path, kind)
    assert report(f"{kind} {fmt} {quant or ''} on {plan.world_size} rank(s) vs plain dequantized copy",
                  (got - want).abs().max(), bound(want, kind, r.cfg))
    held, plain_held = [rk["loaded"]["held_bytes"] for rk in ranks], [rk["loaded"]["held_bytes"] for rk in plain_ranks]
    fp32_held = load_model(files[(kind, "plain", None)][0]).stats["held_bytes"]
    matrices, layers = matrix_numel(plain)
    per_weight = 1 if fmt == "fp8_scaled" else 34 / 32   # fp8; Q8_0 (and Q4_K's Q8_0 fallback) blocks at most
    # everything but the matrices stays fp32 as in the plain load; fp8_scaled adds one fp32 scale a layer
    ceiling = fp32_held - matrices * 4 + matrices * per_weight + layers * 4
    loaded = ranks[0]["loaded"]
    print(f"{kind} {fmt} {quant or ''}: held bytes per rank {held} vs plain fp32 {plain_held} "
          f"({held[0] / plain_held[0]:.3f}x; ceiling {ceiling:.0f}); {loaded.get('quantization', '')} "
          f"scaled linears {loaded['scaled_linears']}, gguf linears {loaded['gguf_linears']}")
    assert plain_held == [fp32_held] * len(plain_held)
    assert all(h <= ceiling for h in held) and max(held) < plain_held[0] / 3
    assert loaded["scaled_linears" if fmt == "fp8_scaled" else "gguf_linears"] == layers


# ---- torch dequantization equals gguf's numpy dequantization ---------------------------------------------------

def quantized_sample(qtype):
    """(blocks, their float32 source): normal weights, an all-zero row (zero scales), a wide block, an all-negative
    block (K-quant mins)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((48, 512)) * 0.05).astype(np.float32)
    x[1] = 0.0
    x[2, :256] = rng.standard_normal(256).astype(np.float32) * 30
    x[3, :256] = -np.abs(x[3, :256])
    return quantize(x, qtype), x


def torch_dequantize(data, qtype, shape, dtype=torch.float32):
    return dequantize(torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)), qtype, shape, dtype)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_torch_dequantization_equals_gguf_numpy_dequantize(qtype):
    # Bitwise: both expand each block with the same float32 operations in the same order, each rounded by IEEE rules.
    data, x = quantized_sample(qtype)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    got = torch_dequantize(data, qtype, x.shape).numpy()
    print(f"{qtype}: torch vs gguf numpy max abs diff {np.abs(got - want).max():.3g}; "
          f"{data.nbytes / x.size:.4f} bytes a weight")
    assert np.array_equal(got, want)


# the bytes of a block that hold its quantized values, for the formats that add an offset (value = d * q + m): with
# them zeroed, gguf's dequantizer gives the offset m of every value
QUANT_BYTES = {"Q4_1": slice(4, 20), "Q5_1": slice(4, 24), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176)}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SUBNORMAL_HALF_SPACING = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_dequantization_straight_to_the_compute_dtype_is_within_three_roundings_of_gguf(qtype, dtype):
    """A layer call dequantizes into the compute dtype without a float32 copy: the block's scale d and offset m
    (exact in float32) are rounded once to the dtype, then the product and the sum once each. So with u the dtype's
    unit roundoff (bf16 2^-8, fp16 2^-11) |ours - gguf| <= 3u (|gguf| + 2|m|), plus three half-spacings of the
    dtype's subnormals for values that small (fp16); the float formats are a single rounding."""
    data, x = quantized_sample(qtype)
    kind = gguf.GGMLQuantizationType[qtype]
    want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
    offset = torch.zeros_like(want)
    if qtype in QUANT_BYTES:
        _, _, nbytes = BLOCKS[qtype]
        blocks = np.array(data).reshape(-1, nbytes)
        blocks[:, QUANT_BYTES[qtype]] = 0
        offset = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks.reshape(data.shape), kind),
                                                       dtype=np.float32))
    got = torch_dequantize(data, qtype, x.shape, dtype)
    assert got.dtype == dtype
    u, tiny = UNIT_ROUNDOFF[dtype], SUBNORMAL_HALF_SPACING[dtype]
    scale = u * (want.abs() + 2 * offset.abs()) + tiny
    ratio = float(((got.double() - want.double()).abs() / scale).max())
    print(f"{qtype} -> {dtype}: max |ours - gguf| = {ratio:.2f} x (u (|gguf| + 2|m|) + subnormal half-spacing), "
          f"bound 3; correct rounding alone gives up to 1")
    assert ratio <= 3


@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_a_layer_call_dequantizes_without_a_float32_copy_of_the_weight(qtype):
    """Into bf16 the per-value work runs in bf16: the largest float32 tensor made is the per-block scales (at most one
    per 16 values, Q6_K's), never one the weight's size (half the memory traffic of expanding in float32 first)."""
    from torch.overrides import TorchFunctionMode

    class LargestFloat32(TorchFunctionMode):
        largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                LargestFloat32.largest = max(LargestFloat32.largest, out.numel())
            return out
    data, x = quantized_sample(qtype)
    with LargestFloat32():
        got = torch_dequantize(data, qtype, x.shape, torch.bfloat16)
    print(f"{qtype}: largest float32 tensor {LargestFloat32.largest} elements for a weight of {x.size}")
    assert got.dtype == torch.bfloat16 and LargestFloat32.largest <= x.size // 16


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_our_k_quant_writer_makes_blocks_gguf_decodes_to_the_input_within_one_quantization_step(qtype):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((16, 1024)) * 0.05).astype(np.float32)
    decoded = gguf.quants.dequantize(quantize(x, qtype), gguf.GGMLQuantizationType[qtype])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[qtype]
    step = (x.max() - x.min()) / levels
    err = np.abs(decoded - x).max()
    print(f"{qtype}: max abs error {err:.3g}, one step of the whole range {step:.3g}")
    assert err <= step


# ---- LoRAs on top ------------------------------------------------------------------------------------------------

def write_lora(path, weights, layers, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        n_out, n_in = weights[layer + ".weight"].shape
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.1
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.1
        tensors[f"diffusion_model.{layer}.alpha"] = torch.tensor(8.0)
    save_file(tensors, path)
    return path


LORA_LAYERS = {"flux": ["double_blocks.0.img_attn.qkv", "double_blocks.1.img_mlp.2", "single_blocks.2.linear1",
                        "final_layer.adaLN_modulation.1", "txt_in"],
               "sd3": ["joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.context_block.mlp.fc1",
                       "final_layer.adaLN_modulation.1"]}


@pytest.mark.parametrize("kind,fmt,quant", [("flux", "gguf", "Q4_K"), ("sd3", "fp8_scaled", None)],
                         ids=lambda v: str(v))
def test_a_lora_on_a_quantized_model_equals_it_on_the_plain_copy_and_removing_it_restores_the_base(
        files, engines, tmp_path, kind, fmt, quant):
    path, plain = files[(kind, fmt, quant)]
    lora = write_lora(str(tmp_path / "lora.safetensors"), make_state_dict(VARIANT[kind]), LORA_LAYERS[kind])
    want, _ = run(engines, request(plain, kind, loras=[(lora, 0.7)]))
    base, _ = run(engines, request(path, kind))
    got, ranks = run(engines, request(path, kind, loras=[(lora, 0.7)]))
    restored, restored_ranks = run(engines, request(path, kind))
    r = request(path, kind)
    print(f"{kind} {fmt} {quant or ''}: LoRA layers kept on top {ranks[0].get('lora_layers_on_top')}; "
          f"LoRA moves the latent by {(got - base).abs().max():.3g}")
    assert ranks[0]["lora_layers_on_top"] == ranks[0]["lora_layers_touched"] > 0
    assert report(f"{kind} {fmt} {quant or ''} + LoRA vs plain copy + LoRA", (got - want).abs().max(),
                  bound(want, kind, r.cfg))
    assert (got - base).abs().max() > 100 * bound(want, kind, r.cfg)
    # the same computation as the base job (the factors dropped, the weights never written): bitwise equal
    print(f"LoRA removed: {restored_ranks[0].get('lora_restore_bytes')} bytes read; equal to the base latent: "
          f"{torch.equal(restored, base)}")
    assert restored_ranks[0]["lora_restore_bytes"] == 0 and torch.equal(restored, base)


# ---- PipeFusion stages hold only their blocks, quantized -------------------------------------------------------

def test_a_pipefusion_stage_loads_only_its_blocks_of_a_gguf_file_and_two_stages_give_the_single_rank_latent(
        files, engines):
    path, _ = files[("flux", "gguf", "Q4_K")]
    full = load_model(path)
    info = full.info
    layout = make_layout(info, ParallelPlan(pipefusion=2), 16, 16, None, 1, None)
    full_state = full.model.state_dict()
    held = []
    for stage in range(2):
        keep = stage_keep(info, layout, stage)
        part = load_model(path, keep=keep)
        names = {n for n, t in part.model.state_dict().items() if not t.is_meta}
        assert names == {n for n in full_state if keep(n)}
        assert all(torch.equal(part.model.state_dict()[n], full_state[n]) for n in names)
        quantized = [m for m in part.model.modules() if isinstance(m, GGUFLinear)]
        assert quantized and all(not m.weight.is_meta for m in quantized)
        held.append(part.stats["held_bytes"])
        assert part.stats["bytes_read"] < full.stats["bytes_read"]
    print(f"GGUF Q4_K stages hold {held} bytes of the whole model's {full.stats['held_bytes']}")
    reference, _ = run(engines, request(path, "flux"))
    r = request(path, "flux", plan=ParallelPlan(pipefusion=2), warmup_steps=STEPS)
    out, ranks = run(engines, r)
    assert report("flux GGUF Q4_K pipefusion=2 (warmup over every step) vs 1 rank", (out - reference).abs().max(),
                  min(1e-4, bound(reference, "flux", 1.0)))
    assert ranks[0]["pipefusion"]["held_bytes"] < full.stats["held_bytes"]


# ---- bad files ---------------------------------------------------------------------------------------------------

def damaged(src, out, edit):
    data = bytearray(open(src, "rb").read())
    data = edit(data) or data
    with open(out, "wb") as f:
        f.write(bytes(data))
    return str(out)


def set_u64(data, at, value):
    data[at:at + 8] = struct.pack("<Q", value)


QKV = "double_blocks.0.img_attn.qkv.weight"     # Q8_0 in the tiny Q8_0 FLUX file: rows of 128 = 4 blocks


def _dims_at(data):
    """Byte offset of the qkv tensor's first dimension in the header: after its name's length, name and rank."""
    return bytes(data).index(struct.pack("<Q", len(QKV)) + QKV.encode()) + 8 + len(QKV) + 4


BAD = {
    "truncated": (lambda d: d[:-4096], "is truncated: tensor"),
    "cut inside the header": (lambda d: d[:6000], "truncated or its header is damaged"),
    "wrong magic": (lambda d: d.__setitem__(slice(0, 4), b"GGUX"), "is not a GGUF file"),
    "bit-flipped tensor count": (lambda d: d.__setitem__(15, d[15] ^ 0x40), "the header lies"),
    "bit-flipped version": (lambda d: d.__setitem__(4, d[4] ^ 0x10), "GGUF version"),
    "row not whole blocks": (lambda d: set_u64(d, _dims_at(d), 120), "needs rows of whole 32-value blocks"),
    "more rows than stored": (lambda d: set_u64(d, _dims_at(d) + 8, 3 * 128 + 64), "the header lies"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_damaged_gguf_file_is_refused_with_one_line_naming_the_file(files, tmp_path, case):
    src, _ = files[("flux", "gguf", "Q8_0")]
    edit, words = BAD[case]
    path = damaged(src, tmp_path / "bad.gguf", edit)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    message = str(e.value)
    print(f"{case}: {message}")
    assert words in message and "bad.gguf" in message and "\n" not in message


def test_a_row_count_lie_the_header_cannot_see_is_caught_by_the_model_shape_check(files, tmp_path):
    src, _ = files[("flux", "gguf", "Q8_0")]
    path = damaged(src, tmp_path / "fewer.gguf", lambda d: set_u64(d, _dims_at(d) + 8, 3 * 128 - 96))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    print(e.value)
    assert "double_blocks.0.img_attn.qkv" in str(e.value) and "\n" not in str(e.value)


def write_gguf_with(tmp_path, name, kind, weights, extra=None, arch=None):
    path = str(tmp_path / name)
    w = gguf.GGUFWriter(path, arch=arch or kind)
    for key, t in weights.items():
        w.add_tensor(key, t.float().numpy())
    for key, (data, qtype) in (extra or {}).items():
        w.add_tensor(key, data, raw_shape=None, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_quant_type_is_refused_naming_the_tensor_the_type_and_what_is_supported(tmp_path):
    weights = make_state_dict("sd3-medium")
    weights.pop("joint_blocks.0.x_block.mlp.fc1.weight")
    q2k = np.zeros((1024, 256 // 256 * 84), dtype=np.uint8)      # Q2_K: 84 bytes a 256-value block
    path = write_gguf_with(tmp_path, "q2k.gguf", "sd3", weights,
                           {"joint_blocks.0.x_block.mlp.fc1.weight": (q2k, gguf.GGMLQuantizationType.Q2_K)})
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    print(e.value)
    assert "joint_blocks.0.x_block.mlp.fc1.weight" in str(e.value) and "Q2_K" in str(e.value)
    assert all(t in str(e.value) for t in ("Q8_0", "Q4_K", "F16"))


def test_a_gguf_of_another_architecture_or_family_is_refused(tmp_path):
    weights = make_state_dict("flux-schnell")
    other = write_gguf_with(tmp_path, "sdxl.gguf", "flux", weights, arch="sdxl")
    mislabelled = write_gguf_with(tmp_path, "label.gguf", "flux", weights, arch="sd3")
    for path, words in ((other, "architecture 'sdxl'"), (mislabelled, "mislabelled")):
        with pytest.raises(CheckpointError) as e:
            inspect_model(path)
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_fp8_scaled_file_is_refused(files, tmp_path):
    src, _ = files[("sd3", "fp8_scaled", None)]
    with safe_open(src, "pt") as f:
        raw, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    bad_shape = dict(raw, **{"joint_blocks.0.x_block.attn.qkv.scale_weight": torch.ones(3)})
    orphan = dict(raw, **{"joint_blocks.0.x_block.attn.nothing.scale_weight": torch.ones(())})
    for name, tensors, words in (("shape", bad_shape, "a scale_weight is one number or one per output row"),
                                 ("orphan", orphan, "belong to no weight")):
        path = str(tmp_path / f"{name}.safetensors")
        save_file(tensors, path, metadata=metadata)
        with pytest.raises(CheckpointError) as e:
            load_model(path)
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)


# ---- files: detection, make-tiny, the node's listing ------------------------------------------------------------

def test_a_gguf_header_is_read_by_us_and_by_the_gguf_package_alike(files):
    path, _ = files[("sd3", "gguf", "Q4_K")]
    ours, metadata = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    theirs = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset),
                       int(t.n_bytes)) for t in reader.tensors}
    assert {k: (v.dtype, v.shape, v.begin, v.end - v.begin) for k, v in ours.items()} == theirs
    info = inspect_model(path)
    print(f"{info.variant} {info.format}: {info.quantization}")
    assert (info.family, info.variant, info.format, metadata["gguf.architecture"]) == ("sd3", "sd3.5-medium", "gguf",
                                                                                       "sd3")


@pytest.mark.parametrize("fmt,quant", [("gguf", "Q5_K"), ("fp8_scaled", None)], ids=lambda v: str(v))
def test_make_tiny_writes_quantized_formats(tmp_path, fmt, quant):
    cmd = [sys.executable, "-m", "engine", "make-tiny", "--kind", "flux", "--out", str(tmp_path), "--format", fmt]
    out = subprocess.run(cmd + (["--quant", quant] if quant else []), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    path = out.stdout.splitlines()[0].split()[1]
    info = inspect_model(path)
    assert info.format == fmt and (quant is None or quant in info.quantization)


def test_make_tiny_refuses_a_quant_type_it_cannot_write_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "make-tiny", "--kind", "sd3", "--out", str(tmp_path),
                          "--format", "gguf", "--quant", "Q2_K"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(out.stderr)
    assert out.returncode == 2 and "Q2_K" in out.stderr and "Traceback" not in out.stderr


def test_gguf_files_are_found_in_the_model_folders(tmp_path):
    (tmp_path / "unet" / "flux").mkdir(parents=True)
    (tmp_path / "diffusion_models").mkdir()
    for name in ("unet/flux/a-Q4_K.gguf", "unet/b.safetensors", "diffusion_models/c-Q8_0.GGUF"):
        (tmp_path / name).write_bytes(b"GGUF")
    found = find_gguf_files([str(tmp_path / "unet"), str(tmp_path / "diffusion_models"), str(tmp_path / "missing")])
    assert found == {"flux/a-Q4_K.gguf": str(tmp_path / "unet/flux/a-Q4_K.gguf"),
                     "c-Q8_0.GGUF": str(tmp_path / "diffusion_models/c-Q8_0.GGUF")}
