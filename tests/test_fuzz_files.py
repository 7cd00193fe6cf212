"""Fuzzed model and LoRA files: real tiny checkpoints (FLUX and SD3 safetensors, GGUF, fp8_scaled) and LoRA files
(kohya, diffusers) with bits flipped anywhere, cut at any length, headers that lie (length prefix, dtypes, shapes,
offsets, metadata, names) and tensors of the other family. Reading the header (inspect_checkpoint), loading the
transformer and checking/applying a LoRA either succeed (a flip inside tensor data only changes values) or raise
CheckpointError in one line naming the file; never another exception, never a hang."""
import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import given, strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.gguf_file import read_gguf_header
from engine.models.load import diffusers_keys, inspect_checkpoint, load_transformer
from engine.models.lora import apply_loras, check_lora, lora_factors
from engine.models.safetensors_file import CheckpointError
from engine.models.tiny import write_tiny

from fuzz import Tally, cases, one_line

FORMATS = {"flux": dict(kind="flux"), "sd3": dict(kind="sd3", variant="sd3-medium"),
           "gguf": dict(kind="flux", format="gguf"), "gguf-q4k": dict(kind="sd3", format="gguf", quant="Q4_K"),
           "fp8_scaled": dict(kind="flux", format="fp8_scaled")}
LORA_LAYERS = ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear1", "txt_in"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzfiles")
    out = {name: write_tiny(out_dir=str(d / name), **kw) for name, kw in FORMATS.items()}
    with safe_open(out["flux"], "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(3)
    kohya, diffusers = {}, {}
    for layer in LORA_LAYERS:
        n_out, n_in = weights[layer + ".weight"].shape
        down, up = torch.randn(4, n_in, generator=g) * 0.01, torch.randn(n_out, 4, generator=g) * 0.01
        name = "lora_unet_" + layer.replace(".", "_")
        kohya.update({name + ".lora_down.weight": down, name + ".lora_up.weight": up, name + ".alpha": torch.tensor(4.0)})
    for target in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp", "context_embedder"):
        n_in = 128 if target != "context_embedder" else weights["txt_in.weight"].shape[1]
        n_out = 128 if target != "single_transformer_blocks.0.proj_mlp" else 512
        diffusers.update({f"transformer.{target}.lora_A.weight": torch.randn(4, n_in, generator=g) * 0.01,
                          f"transformer.{target}.lora_B.weight": torch.randn(n_out, 4, generator=g) * 0.01})
    for name, tensors in (("kohya", kohya), ("diffusers", diffusers)):
        out[f"lora-{name}"] = str(d / f"lora-{name}.safetensors")
        save_file(tensors, out[f"lora-{name}"])
    info = inspect_checkpoint(out["flux"])
    loaded = load_transformer(out["flux"])
    for name in ("kohya", "diffusers"):   # the sound LoRAs apply
        assert apply_loras(loaded, [(out[f"lora-{name}"], 1.0)], {})["lora_changed"]
    out.update(dir=d, info=info, keys=diffusers_keys(info), loaded=loaded)
    yield out
    shutil.rmtree(d, ignore_errors=True)


def outcome(path: str, *, load: bool = True, lora_of: dict | None = None) -> str:
    """Check (and load) a model file, or check and apply a LoRA file: 'loaded'/'applied', 'inspected', or the
    refusal's kind. Any exception but a one-line CheckpointError naming the file fails the test."""
    name = os.path.basename(path)
    try:
        if lora_of is not None:
            check_lora(path, lora_of["info"], lora_of["keys"])
            lora_factors(path, lora_of["info"], lora_of["keys"])
            apply_loras(lora_of["loaded"], [(path, 0.5)], {})
            return "applied"
        inspect_checkpoint(path)
        if not load:
            return "inspected"
        load_transformer(path)
        return "loaded"
    except CheckpointError as e:
        message = str(e)
        assert one_line(message), repr(message)
        assert name in message, f"refusal does not name {name}: {message}"
        return "refused"


def header_size(path: str) -> int:
    """Bytes before the first tensor's data (the part a flip there hits the header)."""
    if path.endswith(".gguf"):
        return min(t.begin for t in read_gguf_header(path)[0].values())
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.timeout(600)
def test_bit_flips_anywhere_in_model_and_lora_files(files, tmp_path):
    tally = Tally("bit flips")
    work = {}
    for name in list(FORMATS) + ["lora-kohya", "lora-diffusers"]:
        work[name] = str(tmp_path / os.path.basename(files[name]))
        shutil.copyfile(files[name], work[name])
    sizes = {n: (os.path.getsize(p), header_size(p)) for n, p in work.items()}

    @cases(250)
    @given(name=st.sampled_from(sorted(work)), in_header=st.booleans(), where=st.floats(0, 1, exclude_max=True),
           bit=st.integers(0, 7))
    def prop(name, in_header, where, bit):
        size, head = sizes[name]
        offset = int(where * (head if in_header else size))
        flip(work[name], offset, bit)
        try:
            result = outcome(work[name], lora_of=files if name.startswith("lora") else None,
                             load=not in_header or name in ("flux", "gguf"))
        finally:
            flip(work[name], offset, bit)   # restored for the next case
        tally(f"{'header' if in_header else 'anywhere'} {result}")

    prop()
    tally.report()
    assert sum(v for k, v in tally.counts.items() if "refused" in k) > 10
    assert sum(v for k, v in tally.counts.items() if k.endswith(("loaded", "applied"))) > 10


@pytest.mark.timeout(600)
def test_files_cut_at_any_length(files, tmp_path):
    tally = Tally("truncations")
    data = {n: open(files[n], "rb").read() for n in ["flux", "gguf", "fp8_scaled", "gguf-q4k", "lora-kohya"]}

    @cases(100)
    @given(name=st.sampled_from(sorted(data)), cut=st.one_of(st.integers(0, 64), st.floats(0, 1, exclude_max=True)))
    def prop(name, cut):
        raw = data[name]
        n = cut if isinstance(cut, int) else int(cut * len(raw))
        path = str(tmp_path / os.path.basename(files[name]))
        with open(path, "wb") as f:
            f.write(raw[:n])
        result = outcome(path, lora_of=files if name.startswith("lora") else None)
        assert result == "refused", f"{name} cut to {n} of {len(raw)} bytes was {result}"
        tally(result)

    prop()
    tally.report()
    assert tally.counts == {"refused": tally.total}


# ---- headers that lie ------------------------------------------------------------------------------------------
def split_safetensors(path: str) -> tuple[dict, bytes]:
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 65, 2 ** 65), st.floats(allow_nan=False),
                 st.text(max_size=6), st.lists(st.integers(-5, 5), max_size=3), st.just({"a": [1]}))
SIZES = st.one_of(st.integers(-3, 70000), st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64 - 1]))


@st.composite
def header_lie(draw, header: dict):
    """(new header dict or raw JSON bytes, length prefix or None) for a safetensors header."""
    header = json.loads(json.dumps(header))
    keys = sorted(k for k in header if k != "__metadata__")
    key = draw(st.sampled_from(keys))
    entry = header[key]
    lie = draw(st.sampled_from(["prefix", "dtype", "shape", "reshape", "offsets", "overlap", "entry", "metadata",
                                "drop", "rename", "json"]))
    prefix = None
    if lie == "prefix":
        prefix = draw(st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(0, 4096)))
    elif lie == "dtype":
        entry["dtype"] = draw(st.one_of(st.sampled_from(["F16", "BF16", "F64", "I8", "U16", "BOOL", "F8_E5M2",
                                                         "F4", "f32", "", "Q4_K"]), JUNK))
    elif lie == "shape":
        entry["shape"] = draw(st.one_of(st.lists(SIZES, max_size=5), JUNK))
    elif lie == "reshape":   # byte count unchanged, rank and sides changed
        numel = 1
        for d in entry["shape"]:
            numel *= d
        entry["shape"] = draw(st.sampled_from([[numel], [1, numel], [numel, 1, 1], [] if numel == 1 else [numel, 0]]))
    elif lie == "offsets":
        entry["data_offsets"] = draw(st.one_of(st.lists(SIZES, min_size=2, max_size=2),
                                               st.lists(SIZES, max_size=4), JUNK))
    elif lie == "overlap":
        other = header[draw(st.sampled_from(keys))]
        entry["data_offsets"] = list(other["data_offsets"])
        entry["shape"], entry["dtype"] = other["shape"], other["dtype"]
    elif lie == "entry":
        header[key] = draw(JUNK)
    elif lie == "metadata":
        header["__metadata__"] = draw(st.one_of(JUNK, st.dictionaries(st.text(max_size=3), JUNK, max_size=2)))
    elif lie == "drop":
        del header[key]
    elif lie == "rename":
        header[draw(st.one_of(st.text(max_size=12), st.sampled_from(
            ["joint_blocks.0.x_block.attn.qkv.weight", "double_blocks.0.img_attn.qkv.weight",
             "model.diffusion_model.img_in.weight", "pos_embed.proj.weight", "scaled_fp8",
             "lora_unet_txt_in.lora_down.weight"])))] = header.pop(key)
    elif lie == "json":
        text = json.dumps(header).encode()
        cut = draw(st.integers(0, len(text) - 1))
        return text[:cut] + draw(st.binary(min_size=0, max_size=4)), None, lie
    return json.dumps(header).encode(), prefix, lie


@pytest.mark.timeout(600)
def test_safetensors_headers_that_lie(files, tmp_path):
    tally = Tally("safetensors header lies")
    parts = {n: split_safetensors(files[n]) for n in ["flux", "sd3", "fp8_scaled", "lora-kohya", "lora-diffusers"]}

    @cases(300)
    @given(name=st.sampled_from(sorted(parts)), data=st.data())
    def prop(name, data):
        header, body = parts[name]
        text, prefix, lie = data.draw(header_lie(header))
        path = str(tmp_path / os.path.basename(files[name]))
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text) if prefix is None else prefix) + text + body)
        tally(f"{lie} {outcome(path, lora_of=files if name.startswith('lora') else None)}")

    prop()
    tally.report()
    assert sum(v for k, v in tally.counts.items() if "refused" in k) > tally.total // 2


@pytest.mark.timeout(600)
def test_gguf_headers_that_lie(files, tmp_path):
    """Counts, lengths, dims, types and offsets overwritten with numbers a damaged or hostile file could hold."""
    tally = Tally("gguf header lies")
    data = {n: open(files[n], "rb").read() for n in ("gguf", "gguf-q4k")}
    heads = {n: header_size(files[n]) for n in data}

    @cases(200)
    @given(name=st.sampled_from(sorted(data)), where=st.floats(0, 1, exclude_max=True),
           width=st.sampled_from([1, 4, 8]),
           value=st.one_of(st.sampled_from([0, 1, 2, 3, 31, 32, 255, 2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1]),
                           st.integers(0, 2 ** 64 - 1)))
    def prop(name, where, width, value):
        raw = bytearray(data[name])
        offset = int(where * (heads[name] - width))
        raw[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
        path = str(tmp_path / os.path.basename(files[name]))
        with open(path, "wb") as f:
            f.write(raw)
        tally(outcome(path))

    prop()
    tally.report()
    assert tally.counts.get("refused", 0) > tally.total // 3


def test_tensors_of_the_other_family_are_refused_naming_the_file(files, tmp_path):
    results = []
    with safe_open(files["sd3"], "pt") as f:
        sd3 = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(files["flux"], "pt") as f:
        flux = {k: f.get_tensor(k) for k in f.keys()}
    cases_ = {
        "sd3-as-flux": {**{k.replace("joint_blocks", "double_blocks"): v for k, v in sd3.items()},
                        "double_blocks.0.img_attn.qkv.weight": sd3["joint_blocks.0.x_block.attn.qkv.weight"]},
        "flux-with-sd3-blocks": {**flux, **{k: v for k, v in sd3.items() if k.startswith("joint_blocks.0.")}},
        "sd3-named-flux-layers": {"img_in.weight": sd3["x_embedder.proj.weight"].flatten(1), **{
            k: v for k, v in flux.items() if k != "img_in.weight"}},
        "half-of-each": {**dict(list(flux.items())[::2]), **dict(list(sd3.items())[::2])},
    }
    for name, tensors in cases_.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, path)
        results.append((name, outcome(path)))
    sd3_lora = str(tmp_path / "sd3-lora.safetensors")
    save_file({"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.zeros(192, 4)}, sd3_lora)
    results.append(("sd3 LoRA on FLUX", outcome(sd3_lora, lora_of=files)))
    print(results)
    assert all(r == "refused" for _, r in results), results
