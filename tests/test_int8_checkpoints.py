"""ComfyUI's int8_tensorwise checkpoints (comfy/ops.py MixedPrecisionOps; Comfy-Org's MiniMax-H3
`*_int8_convrot` releases): each listed layer's weight int8 with a float32 `weight_scale`, ConvRot layers rotated
group-wise along their input dimension by the normalized regular Hadamard matrix. The tiny files make-tiny writes
hold the format as ComfyUI's do; the engine holds each int8 layer as the file stores it (Int8Linear: q, its scale and
ConvRot group), whose weight equals a dequantization written here from the math (q x scale in float32, then the
rotation undone, computed exactly), bit for bit; models from them run (and equal their dequantized plain copies to
float32 rounding: the engine rotates the input, not the weight); each rank of a divided model reads its rows; the
planner prices the weights as held; damaged files are refused in one line naming the file and what is wrong."""
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.cli import describe, main
from engine.families import minimax_h3
from engine.families.minimax_h3 import DIMS
from engine.models.convert import apply_op
from engine.models.flow import Conditioning, FlowModel, Prepared
from engine.models.load import inspect_model, load_model, restore_weights
from engine.models.quantized import CastLinear, Int8Linear
from engine.models.safetensors_file import CheckpointError
from engine.models.tiny import make_state_dict, mixed_int8, write_tiny
from engine.parallel.plan import Workload

from tolerance import fp32_bound, report

H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hadamard(group):
    """ConvRot's matrix of `group` rows (a power of 4): H4 x H4 x ... / sqrt(group), in float64 (entries +-2^-k)."""
    h = H4
    while h.shape[0] < group:
        h = torch.kron(h, H4)
    return h / math.sqrt(group)


def reference(q, scale, group):
    """The weight an int8_tensorwise layer stores: q x scale in float32 (comfy_kitchen's dequantize_int8_simple), then
    for ConvRot W @ H^T over each group of inputs (its _rotate_weight). The rotation runs here as one float64 matmul:
    H's entries are +-2^-k and a row's float32 products q x s lie within 8 binades of each other, so every product
    and partial sum is exact in float64 whatever the order, and the float32 rounding after is the only one."""
    w = q.to(torch.float32) * scale.to(torch.float32)
    if group:
        rows, cols = w.shape
        w = (w.double().reshape(rows, cols // group, group) @ hadamard(group).T).reshape(rows, cols).float()
    return w


def stored(path):
    """(tensors, metadata, {layer: config}) of a file, the configs from its header or its comfy_quant tensors."""
    with safe_open(path, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    layers = json.loads(metadata.get("_quantization_metadata", '{"layers": {}}'))["layers"]
    for k, t in tensors.items():
        if k.endswith(".comfy_quant"):
            layers.setdefault(k[:-len(".comfy_quant")], json.loads(bytes(t.tolist())))
    return tensors, metadata, layers


def group_of(conf):
    params = conf.get("params", {})
    if not conf.get("convrot", params.get("convrot", False)):
        return None
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))


def dequantized_file(path):
    """{file key: float32 value}: every int8 layer by `reference`, every other tensor as stored."""
    tensors, _, layers = stored(path)
    out = {}
    for k, t in tensors.items():
        if k.endswith((".weight_scale", ".comfy_quant")):
            continue
        layer = k[:-len(".weight")]
        out[k] = reference(t, tensors[layer + ".weight_scale"], group_of(layers[layer])) if t.dtype == torch.int8 \
            else t.float()
    return out


def expected_params(loaded, path):
    """{diffusers name: the value the engine's weight should be in float32}, through the family's key map."""
    values = dequantized_file(path)
    return {dst: apply_op(values[loaded.info.prefix + src], op) for dst, src, op in loaded.mapping}


def weights(model, dtype=torch.float32):
    """{parameter name: its value}, an Int8Linear's weight as the weight it stands for (dequantized, in `dtype`)."""
    out = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            out[name + ".weight"] = m.dequantized(dtype)
            out.pop(name + ".weight_scale")
    return out


def int8_sources(path):
    tensors, _, _ = stored(path)
    return {k for k, t in tensors.items() if t.dtype == torch.int8}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("int8")
    out = {}
    for kind in ("minimax-h3", "flux"):   # MiniMax-H3: the model whose released files are int8_convrot
        for fmt in ("int8_convrot", "int8"):
            out[f"{kind}-{fmt}"] = write_tiny(kind, str(d / fmt), format=fmt)
        out[f"{kind}-fp32"] = write_tiny(kind, str(d / "fp32"))
    out["minimax-h3-pruned-int8_convrot"] = write_tiny("minimax-h3", str(d / "int8_convrot"),
                                                       variant="minimax-h3-pruned", format="int8_convrot")
    out["minimax-h3-pruned-fp32"] = write_tiny("minimax-h3", str(d / "fp32"), variant="minimax-h3-pruned")
    return out


def rewrite(src, out, edit_tensors=None, edit_layers=None):
    """A copy of `src` with its tensors and/or its header's layer configs edited."""
    tensors, metadata, _ = stored(src)
    quant = json.loads(metadata["_quantization_metadata"])
    if edit_tensors:
        edit_tensors(tensors)
    if edit_layers:
        edit_layers(quant["layers"])
    save_file(tensors, out, metadata=dict(metadata, _quantization_metadata=json.dumps(quant)))
    return out


# ---- the format make-tiny writes --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,fmt", [("minimax-h3", "int8_convrot"), ("flux", "int8_convrot"), ("flux", "int8")])
def test_make_tiny_writes_int8_layers_as_comfyuis_files_hold_them(files, kind, fmt, tmp_path, capsys):
    """The blocks' matrices int8 with a float32 [rows, 1] weight_scale (the row's largest magnitude / 127), each listed
    in `_quantization_metadata` as {"format": "int8_tensorwise"} (+ "convrot": true and its group: the largest power of
    4 up to 256 dividing the layer's width); the rest bf16. Quantized in the rotated basis: within half a step of
    rotate(W) per value, the row's largest at +-127."""
    assert main(["make-tiny", "--kind", kind, "--out", str(tmp_path), "--format", fmt]) == 0
    printed = capsys.readouterr().out
    path = printed.split()[1]
    assert os.path.basename(path) == os.path.basename(files[f"{kind}-{fmt}"]) and "int8_tensorwise x" in printed
    tensors, metadata, _ = stored(path)
    layers = json.loads(metadata["_quantization_metadata"])["layers"]
    original = make_state_dict(inspect_model(path).variant)
    quantized = {k[:-len(".weight")] for k, v in original.items()
                 if v.ndim == 2 and k.endswith(".weight") and "blocks." in k}
    assert set(layers) == quantized and len(quantized) > 20
    assert {k for k in tensors if k.endswith(".weight_scale")} == {layer + ".weight_scale" for layer in quantized}
    for name, t in tensors.items():
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight_scale"):
            assert t.dtype == torch.float32 and t.shape == (original[layer + ".weight"].shape[0], 1)
            continue
        if layer not in quantized or not name.endswith(".weight"):
            assert t.dtype == torch.bfloat16 and torch.equal(t, original[name].to(torch.bfloat16)), name
            continue
        width = t.shape[1]
        group = max(g for g in (4, 16, 64, 256) if width % g == 0)
        want = {"format": "int8_tensorwise", **({"convrot": True, "convrot_groupsize": group}
                                                if fmt == "int8_convrot" else {})}
        assert layers[layer] == want, layer
        scale = tensors[layer + ".weight_scale"]
        w = original[name].double()
        if fmt == "int8_convrot":
            w = (w.reshape(w.shape[0], -1, group) @ hadamard(group).T).reshape(w.shape)
        assert t.dtype == torch.int8 and (t.abs().amax(dim=1) == 127).all()
        assert ((t.double() * scale.double() - w).abs() <= scale.double() * (0.5 + 1e-4)).all(), name
    info = inspect_model(path)
    values = sum(t.numel() for t in tensors.values() if t.dtype == torch.int8)
    assert (info.format, info.stored_fp8, info.quantized_parameters, info.quantized_bytes) == (
        "int8_mixed", False, values, values)   # held as stored: one byte a value


# ---- loading: the reference dequantization, bit for bit ---------------------------------------------------------
@pytest.mark.parametrize("name", ["minimax-h3-int8_convrot", "minimax-h3-int8", "minimax-h3-pruned-int8_convrot",
                                  "flux-int8_convrot", "flux-int8"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_weight_loads_as_the_reference_dequantization(files, name, dtype):
    """Exact by construction on both sides (the rotation's float64 sums are exact), so equal bit for bit: in float32,
    and in bf16 as the float32 value rounded to bf16 (ComfyUI's dequantize_int8_*_dtype path); a plain tensor of the
    family's float32 islands (MiniMax-H3's patch projections, time embedding, heads, RoPE; a pruned file's modulation
    projections: the loader's one rule, Holding) stays float32."""
    path = files[name]
    loaded = load_model(path, dtype=dtype)
    want = expected_params(loaded, path)
    params = weights(loaded.model, DTYPES[dtype])
    assert set(want) == set(params)
    int8 = int8_sources(path)
    tensors, _, _ = stored(path)
    source = {dst: (src, op) for dst, src, op in loaded.mapping}
    modules = dict(loaded.model.named_modules())
    for k, v in want.items():
        held = torch.float32 if (DTYPES[dtype] == torch.bfloat16 and loaded.holding.fp32(k)
                                 and source[k][0] not in int8) else DTYPES[dtype]
        assert params[k].dtype == held and torch.equal(params[k], v.to(held)), k
        if source[k][0] in int8:   # held as stored: the file's int8 rows and their scales
            layer = modules[k[:-len(".weight")]]
            src, op = source[k]
            scale = tensors[src[:-len("weight")] + "weight_scale"]
            assert isinstance(layer, Int8Linear) and torch.equal(layer.weight, apply_op(tensors[src], op)), k
            assert torch.equal(layer.weight_scale, apply_op(scale.reshape(-1), op).reshape(-1, 1)), k
    rotated = "convrot" in name
    print(f"{name} {dtype}: {loaded.info.quantization}; {loaded.stats['int8_linears']} int8 matrices")
    assert loaded.stats["int8_linears"] == sum(src in int8 for _, src, _ in loaded.mapping) > 20
    assert loaded.stats["scaled_linears"] == loaded.stats["fp8_linears"] == 0   # nothing left to dequantize per call
    assert loaded.info.format == "int8_mixed" and ("ConvRot groups of" in loaded.info.quantization) == rotated


@pytest.mark.parametrize("group", [None, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("tensorwise", [False, True], ids=["per-row scale", "one scale"])
def test_the_engines_dequantization_is_the_reference_for_every_group_and_scale(group, tensorwise):
    """engine.models.quantized.dequantize_int8 against `reference` on random int8 rows: equal bit for bit in float32,
    one scale (ComfyUI's tensorwise quantizer's) or one per row; rows of 2048 inputs, a few hundred rows."""
    from engine.models.quantized import dequantize_int8
    g = torch.Generator().manual_seed(group or 1)
    q = torch.randint(-127, 128, (300, 2048), generator=g, dtype=torch.int8)
    scale = torch.rand((), generator=g) * 1e-3 if tensorwise else torch.rand(300, 1, generator=g) * 1e-3
    assert torch.equal(dequantize_int8(q, scale, group), reference(q, scale, group))
    assert torch.equal(dequantize_int8(q, scale, group, torch.bfloat16), reference(q, scale, group).bfloat16())


def test_a_tensorwise_scale_loads_as_one_number(files, tmp_path):
    """ComfyUI's int8_tensorwise layer may hold one scale for the whole matrix (its tensorwise quantizer's): the
    weight is q x that number, rotated back as any."""
    src = files["minimax-h3-int8_convrot"]
    layer = "blocks.2.mlp.fc2"

    def one_scale(t):
        t[layer + ".weight_scale"] = torch.tensor(3e-4)
    path = rewrite(src, str(tmp_path / "tensorwise.safetensors"), edit_tensors=one_scale)
    tensors, _, layers = stored(path)
    loaded = load_model(path)
    want = reference(tensors[layer + ".weight"], torch.tensor(3e-4), group_of(layers[layer]))
    held = loaded.model.get_submodule("transformer_blocks.2.ff.net.2")
    assert held.weight_scale.ndim == 0 and torch.equal(held.dequantized(), want)


def test_the_layer_config_read_from_comfy_quant_tensors_under_params_or_with_the_prefix_gives_the_same_weights(
        files, tmp_path):
    """ComfyUI reads convrot / convrot_groupsize at a layer config's top level or under "params", from the header or
    a per-layer comfy_quant tensor (as newer ComfyUI saves files), layer names with a full checkpoint's prefix."""
    src = files["minimax-h3-int8_convrot"]
    want = weights(load_model(src).model)   # the weights the groups give, not only the stored values
    tensors, metadata, _ = stored(src)
    layers = json.loads(metadata["_quantization_metadata"])["layers"]
    per_layer = dict(tensors)
    for layer, conf in layers.items():
        per_layer[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    variants = {"comfy_quant": (per_layer, {"xdit.synthetic": metadata["xdit.synthetic"]}),
                "params": (tensors, dict(metadata, _quantization_metadata=json.dumps({"layers": {
                    k: {"format": c["format"], "params": {"convrot": True, "convrot_groupsize": c["convrot_groupsize"]}}
                    for k, c in layers.items()}}))),
                "prefixed": ({"model.diffusion_model." + k: v for k, v in tensors.items()},
                             dict(metadata, _quantization_metadata=json.dumps({"layers": {
                                 "model.diffusion_model." + k: c for k, c in layers.items()}})))}
    written = write_tiny("minimax-h3", str(tmp_path / "written"), format="int8_convrot", prefix=True)
    for name, (t, m) in variants.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(t, path, metadata=m)
        for p in (path, written) if name == "prefixed" else (path,):
            got = weights(load_model(p).model)
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), (name, p)


def test_fp8_weights_leave_the_int8_matrices_int8_and_hold_the_others_in_fp8(files):
    """With the engine's fp8 weight option a plain matrix is held in float8_e4m3fn and cast per call; an int8 layer
    already holds one byte a value, exactly: it stays an Int8Linear of the file's values."""
    path = files["flux-int8_convrot"]
    loaded = load_model(path, dtype="bf16", fp8_weights=True)
    int8 = int8_sources(path)
    modules = dict(loaded.model.named_modules())
    kinds = {type(modules[dst[:-len(".weight")]]) for dst, src, _ in loaded.mapping if src in int8}
    others = {type(m) for dst, src, _ in loaded.mapping if src not in int8 and dst.endswith(".weight")
              and isinstance(m := modules[dst[:-len(".weight")]], (torch.nn.Linear, CastLinear))}
    assert kinds == {Int8Linear} and others == {CastLinear}


def test_a_lora_on_an_int8_layer_stays_factors_and_removing_it_reads_nothing(files):
    """A LoRA on an int8 layer is added to its output per call (its weight is never written: int8 cannot hold the
    merged value), as W + strength x scale x (up @ down); removing it (load.restore_weights) drops the factors and
    reads no byte of the file."""
    path = files["minimax-h3-int8_convrot"]
    loaded = load_model(path)
    name = "transformer_blocks.2.ff.net.0.proj"
    layer = loaded.model.get_submodule(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, layer.in_features, generator=g)
    before = layer(x)
    up, down = torch.randn(layer.out_features, 2, generator=g), torch.randn(2, layer.in_features, generator=g)
    layer.add_lora(up, down, 0.5, 0.8)
    merged = torch.nn.functional.linear(x, layer.dequantized() + 0.8 * (up @ down) * 0.5, layer.bias)
    assert report("int8 layer with a LoRA vs its merged weight", (layer(x) - merged).abs().max(),
                  fp32_bound(merged.abs().max(), reduction=layer.in_features, depth=2))
    assert restore_weights(loaded, {name + ".weight"}) == 0 and not layer.loras
    assert torch.equal(layer(x), before)


# ---- models from them run ---------------------------------------------------------------------------------------
def flux_velocity(path):
    loaded = load_model(path)
    g = torch.Generator().manual_seed(0)
    cond, pooled = describe.cond_tensors(loaded.info, 12, g)
    x = torch.randn(1, 16, 8, 8, generator=g)
    flow = FlowModel(loaded)
    return flow.velocity(x, torch.tensor(0.6), flow.prepare([Conditioning(cond, pooled, 3.5)], batch=1))


def h3_output(path):
    """One MiniMax-H3 call (video and audio packed as ComfyUI's sampler packs them), as tests/test_minimax_h3.py."""
    g = torch.Generator().manual_seed(0)
    frames, h, w, audio = 3, 4, 6, 7
    video, sound = torch.randn(1, 24, frames, h, w, generator=g), torch.randn(1, 32, 2, audio, generator=g)
    x = torch.cat([video.reshape(1, 1, -1), sound.reshape(1, 1, -1)], dim=-1)
    c = {"context": torch.randn(1, 9, DIMS["tiny"]["minimax-h3"].text_dim, generator=g),
         "av_shape": torch.tensor([[24, frames, h, w, 32, 2, audio]], dtype=torch.float32),
         "audio_scale": torch.tensor([4.0]), "sigma_shift": torch.tensor([[12.0, 3.0]])}
    flow = FlowModel(load_model(path))
    extras = {k: v for k, v in c.items() if k in minimax_h3.EXTRAS}
    return flow.output(x, torch.tensor([700.0]), Prepared(c["context"], None, torch.ones(1), extras=extras))


@pytest.mark.parametrize("kind,run", [("flux", flux_velocity), ("minimax-h3", h3_output),
                                      ("minimax-h3-pruned", h3_output)], ids=["flux", "minimax-h3", "minimax-h3-pruned"])
def test_a_model_from_an_int8_file_runs_as_its_dequantized_plain_copy(files, tmp_path, kind, run):
    """The same weights as a float32 file of the reference values give the same output to float32 rounding (the
    engine multiplies the rotated input by q, where the plain file multiplies the input by the rotated weight: each
    layer's sums in another order, the rotation's own sums of `group` terms added); and the output is near the
    unquantized model's (int8 per row: the quantization moves it by a few percent at most). The pruned MiniMax-H3
    (the templates' file) runs its modulations' int8 layers off the time table in the compute dtype."""
    path = files[f"{kind}-int8_convrot"]
    with safe_open(path, "pt") as f:
        metadata = {"xdit.synthetic": f.metadata()["xdit.synthetic"]}
    plain = str(tmp_path / "plain.safetensors")
    save_file(dequantized_file(path), plain, metadata=metadata)
    with torch.no_grad():
        got, want, unquantized = run(path), run(plain), run(files[f"{kind}-fp32"])
    assert got.shape == want.shape and torch.isfinite(got).all()
    depth = {"flux": 2 * 2 + 2 * 2, "minimax-h3": 2 * 4, "minimax-h3-pruned": 2 * 4}[kind]   # sequential Linears
    assert report(f"{kind} int8_convrot model vs its dequantized plain copy", (got - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4 * 256, depth=depth))
    drift = float((got - unquantized).abs().max() / unquantized.abs().max())
    print(f"{kind}: int8_convrot vs unquantized fp32 model: {drift:.2e} of the output's largest magnitude")
    assert 0 < drift < 0.1


# ---- weights divided among ranks --------------------------------------------------------------------------------
@pytest.fixture
def fake_group():
    """A 2-rank process group in this process (torch's fake backend: no messages, the ranks' layout exact), made
    for one rank at a time, so each rank's sharded load runs here as it would on its own process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name,dtype,fp8", [("minimax-h3-int8_convrot", "fp32", False),
                                            ("flux-int8_convrot", "bf16", True)], ids=["h3-fp32", "flux-bf16-fp8"])
def test_each_rank_of_a_divided_model_holds_and_reads_only_its_rows_of_each_int8_weight(
        files, fake_group, name, dtype, fp8):
    """FSDP2 over 2 ranks (parallel/shard.py's cut: each block a unit, the rest the root): each rank's rows of every
    parameter equal the whole model's rows, an int8 matrix's its rows of the stored int8 values (with the fp8 option
    too), its weight_scale and ConvRot group whole on every rank; each reads under 2/3 of the bytes one whole load
    reads."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from engine import families
    from engine.models.sharded import ShardSpec, local, share
    path = files[name]
    whole = load_model(path, dtype=dtype, fp8_weights=fp8)
    want = dict(whole.model.named_parameters())
    blocks = families.get(whole.info.family).tokens.blocks
    for rank in (0, 1):
        fake_group(rank)
        mesh = DeviceMesh("cpu", [0, 1])

        def wrap(model, mesh=mesh):
            for unit in [b for n in blocks for b in model.get_submodule(n)]:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
        part = load_model(path, dtype=dtype, fp8_weights=fp8, shard=ShardSpec(2, rank, (0, 1), wrap))
        got = dict(part.model.named_parameters())
        assert set(got) == set(want)
        for k, p in got.items():
            start, stop = share(want[k].shape[0], 2, rank)
            mine = local(p)
            assert mine.dtype == want[k].dtype and torch.equal(mine, want[k][start:stop]), (rank, k)
        assert not [n for n, _ in part.model.named_buffers() if n.endswith("scale_weight")]
        scales = {n: b for n, b in whole.model.named_buffers() if n.endswith("weight_scale")}
        assert scales and all(torch.equal(b, scales[n]) for n, b in part.model.named_buffers() if n in scales)
        groups = {n: m.group for n, m in whole.model.named_modules() if isinstance(m, Int8Linear)}
        assert groups == {n: m.group for n, m in part.model.named_modules() if isinstance(m, Int8Linear)}
        assert {g for g in groups.values()} != {None}
        print(f"{name} rank {rank}: read {part.stats['bytes_read']} of {whole.stats['bytes_read']} bytes")
        assert part.stats["bytes_read"] < 2 / 3 * whole.stats["bytes_read"]


# ---- the planner's pricing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_planner_prices_an_int8_file_as_its_weights_are_held(files, dtype):
    """Held as stored, an int8 file's matrices take one byte a value where the plain file's take the compute dtype's:
    the loaded model holds exactly the plain model's bytes, less (dtype bytes - 1) per int8 value, plus 4 per output
    row (the float32 weight_scale); the planner prices the file at its stored matrices' one byte a weight, as an fp8
    file."""
    info, plain = inspect_model(files["flux-int8_convrot"]), inspect_model(files["flux-fp32"])
    values = sum(t.numel() for t in stored(files["flux-int8_convrot"])[0].values() if t.dtype == torch.int8)
    assert (info.stored_fp8, info.quantized_parameters, info.quantized_bytes) == (False, values, values)
    assert info.parameters == plain.parameters and info.block_parameters == plain.block_parameters

    def workload(i):
        return Workload.from_info(i, 8, 8, batch=1, negative_pass=False, text_tokens=16, dtype=dtype)
    assert workload(info).weight_bytes == info.parameters   # one byte a weight
    loaded = load_model(files["flux-int8_convrot"], dtype=dtype)
    rows = sum(m.out_features for m in loaded.model.modules() if isinstance(m, Int8Linear))
    size = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    held = load_model(files["flux-fp32"], dtype=dtype).stats["held_bytes"]
    assert loaded.stats["held_bytes"] == held - (size - 1) * values + 4 * rows


# ---- damaged files ----------------------------------------------------------------------------------------------
LAYER = "blocks.1.attn.out_proj"   # 128 inputs, ConvRot groups of 64 in the tiny file


def _drop_scale(t):
    del t[LAYER + ".weight_scale"]


def _config(**conf):
    def edit(layers):
        layers[LAYER] = dict(layers[LAYER], **conf)
    return edit


def _unlisted(layers):
    del layers[LAYER]


def _bf16_weight(t):
    t[LAYER + ".weight"] = t[LAYER + ".weight"].to(torch.bfloat16)


def _scale_shape(t):   # qkv_proj: 384 rows
    t["blocks.1.attn.qkv_proj.weight_scale"] = torch.ones(385, 1)


def _per_layer_group(t):   # the config in the layer's comfy_quant tensor, read at load
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    t[LAYER + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


DAMAGED = {
    "no weight_scale": (dict(edit_tensors=_drop_scale), f"layer {LAYER} is int8_tensorwise but has no weight_scale"),
    "group not dividing": (dict(edit_layers=_config(convrot_groupsize=256)),
                           f"layer {LAYER} is ConvRot-rotated in groups of 256, which do not divide its 128 inputs"),
    "group not a power of 4": (dict(edit_layers=_config(convrot_groupsize=32)),
                               (f"layer {LAYER} is ConvRot-rotated in groups of 32; the rotation's regular Hadamard "
                                f"matrix has a power of 4 rows")),
    "int8 weight unlisted": (dict(edit_layers=_unlisted),
                             (f"layer {LAYER} stores its weight as int8 but neither the header's "
                              f"_quantization_metadata nor a comfy_quant tensor gives its format")),
    "listed weight not int8": (dict(edit_tensors=_bf16_weight),
                               f"layer {LAYER} is int8_tensorwise but its weight is stored as BF16"),
    "scale of the wrong shape": (dict(edit_tensors=_scale_shape),
                                 ("blocks.1.attn.qkv_proj.weight_scale has shape [385, 1]; a weight_scale is one "
                                  "number or one per output row of blocks.1.attn.qkv_proj.weight (384)")),
    "comfy_quant group not dividing": (dict(edit_tensors=_per_layer_group, edit_layers=_unlisted),
                                       f"layer {LAYER} is ConvRot-rotated in groups of 256, which do not divide its"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_int8_file_is_refused_in_one_line_naming_the_file_and_the_fault(files, tmp_path, case):
    edits, words = DAMAGED[case]
    path = rewrite(files["minimax-h3-int8_convrot"], str(tmp_path / "damaged-int8.safetensors"), **edits)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    message = str(e.value)
    print(f"{case}: {message}")
    assert message.startswith(path) and words in message and "\n" not in message


def test_the_quantizer_refuses_a_group_that_does_not_divide_a_layer():
    with pytest.raises(ValueError, match="no ConvRot group of 256 divides its width 64"):
        mixed_int8(make_state_dict("minimax-h3"), group=256)
