"""Run inside a real ComfyUI's Python: ComfyUI's own loader (comfy.sd.load_diffusion_model, MixedPrecisionOps'
int8_tensorwise layers, comfy_kitchen's dequantization) against the engine's loader on the same ComfyUI int8 files
(tiny ones from make-tiny --format int8_convrot / int8). For every int8 layer, ComfyUI's QuantizedTensor.dequantize()
is taken through the engine's key map (the fused q/k/v chunks, the swapped halves) to the engine's diffusers
parameters (an int8 layer, which the engine holds as stored, as the weight it stands for: Int8Linear.dequantized)
and compared, in float32 and in bf16 (the dtype ComfyUI is told and the engine computes in; on a CPU
ComfyUI dequantizes to float32 either way, which is then rounded to bf16 here as its *_dtype kernels do).

The two are the same math in different orders: ComfyUI rotates back with a float32 matmul (its rounding inside the
sum), the engine with exact float64 butterflies rounded once; so they may differ by a float32 rounding or two of the
weights' size, and agree exactly wherever the float32 matmul happened to round as the exact value does.
Prints one line: REPORT {json}.
Usage: python comfyui_int8_check.py COMFYUI_PATH PACK_ROOT_OR_ITS_PARENT FOLDER
(FOLDER, or its int8/ or diffusion_models/ subfolder: the files whose names contain "int8")."""
import glob
import json
import os
import sys

comfyui, _pack, folder = sys.argv[1:4]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the pack (its engine/ package)
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
sys.path.insert(1, ROOT)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.sd  # noqa: E402
import comfyui_version  # noqa: E402

try:   # ComfyUI's int8_tensorwise layers (0.33): its QuantizedTensor and comfy_kitchen's rotation
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight
    assert "int8_tensorwise" in QUANT_ALGOS
except (ImportError, AssertionError) as e:
    print("REPORT " + json.dumps({"comfyui": comfyui_version.__version__, "files": {},
                                  "older": f"this ComfyUI has no int8_tensorwise layers ({type(e).__name__}: {e})"}),
          flush=True)
    sys.exit(0)

from engine.models.convert import apply_op  # noqa: E402
from engine.models.load import load_model  # noqa: E402


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each value of t (at the smallest normal for zeros): 2^(e-1) x eps for values in
    [2^(e-1), 2^e)."""
    info = torch.finfo(t.dtype)
    _, exponent = torch.frexp(t.float().abs().clamp(min=info.tiny))
    return torch.ldexp(torch.full_like(t, info.eps, dtype=torch.float64), (exponent - 1).to(torch.int64))


files = sorted({p for sub in ("", "int8", "diffusion_models")
                for p in glob.glob(os.path.join(folder, sub, "*int8*.safetensors")) if "dequantized" not in p})
report = {"comfyui": comfyui_version.__version__, "files": {}}
for path in files:
    entry = report["files"][os.path.basename(path)] = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        patcher = comfy.sd.load_diffusion_model(path, model_options={"dtype": dtype})
        comfy_model = patcher.model.diffusion_model
        native = {}
        for name, module in comfy_model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, QuantizedTensor):
                params = weight._params
                convrot, group = bool(getattr(params, "convrot", False)), int(getattr(params, "convrot_groupsize", 0))
                # the exact value: comfy_kitchen's own rotation of ComfyUI's float32 q x scale, run in float64 (its
                # sums exact there: the H entries are powers of two, the row's terms span few binades)
                product = weight._qdata.float() * params.scale.float()
                exact = _rotate_weight(product.double(), _build_hadamard(group, dtype=torch.float64), group) \
                    if convrot else product.double()
                native[name + ".weight"] = (weight.dequantize(), convrot, group, exact)
        loaded = load_model(path, dtype=dtype_name)
        ours = dict(loaded.model.named_parameters())
        for name, module in loaded.model.named_modules():   # an int8 layer held as stored: the weight it stands for
            if hasattr(module, "dequantized") and module.weight.dtype == torch.int8:
                ours[name + ".weight"] = module.dequantized(dtype)
        prefix = loaded.info.prefix
        layers, worst, worst_rel, equal, largest, comfy_dtype = 0, 0.0, 0.0, 0, 0.0, None
        elements = same = 0
        ours_ulps = theirs_ulps = apart_ulps = 0.0
        groups, rotated = set(), 0
        for dst, src, op in loaded.mapping:
            key = src[len(prefix):] if prefix and src.startswith(prefix) else src
            if key not in native:
                continue
            theirs, convrot, group, exact = native[key]
            exact = apply_op(exact, op)
            comfy_dtype = str(theirs.dtype)
            # on a CPU ComfyUI computes a quantized model in float32 whatever dtype it is told (unet_manual_cast):
            # its float32 dequantization is then rounded to the engine's dtype, as its dequantize_int8_*_dtype does
            theirs = apply_op(theirs, op).to(dtype)
            mine = ours[dst].detach()
            assert mine.dtype == dtype and mine.shape == theirs.shape, (dst, mine.dtype, mine.shape, theirs.shape)
            diff = float((mine.double() - theirs.double()).abs().max())
            size = float(theirs.double().abs().max())
            layers += 1
            rotated += convrot
            if convrot:
                groups.add(group)
            equal += bool(torch.equal(mine, theirs))
            elements += mine.numel()
            same += int((mine == theirs).sum())
            # distances from the exact value in units of the dtype's spacing at the row's largest weight (a rotated
            # value near 0 is a cancellation: its own spacing says nothing of a float32 sum's error)
            spacing = ulp(exact.abs().amax(dim=1, keepdim=True).to(dtype)).double()
            ours_ulps = max(ours_ulps, float(((mine.double() - exact).abs() / spacing).max()))
            theirs_ulps = max(theirs_ulps, float(((theirs.double() - exact).abs() / spacing).max()))
            apart_ulps = max(apart_ulps, float(((mine.double() - theirs.double()).abs() / spacing).max()))
            worst, largest = max(worst, diff), max(largest, size)
            worst_rel = max(worst_rel, diff / size if size else 0.0)
        entry[dtype_name] = {"int8_layers_in_comfyui": len(native), "comfyui_dequantized_dtype": comfy_dtype,
                             "compared": layers, "rotated": rotated,
                             "convrot_groups": sorted(groups), "layers_bitwise_equal": equal,
                             "elements": elements, "elements_equal": same, "max_abs_diff": worst,
                             "max_rel_diff": worst_rel, "largest_weight": largest,
                             # in units of the dtype's spacing at each row's largest weight
                             "max_row_ulps_apart": apart_ulps, "engine_max_row_ulps_from_exact": ours_ulps,
                             "comfyui_max_row_ulps_from_exact": theirs_ulps,
                             "engine_format": loaded.info.format, "engine_quantization": loaded.info.quantization}
print("REPORT " + json.dumps(report), flush=True)
