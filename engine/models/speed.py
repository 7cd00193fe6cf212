"""Kernels and compile, as per-job options of a loaded transformer: which attention kernels torch's
scaled_dot_product_attention may use, `torch.compile` of the transformer blocks (regional: each block compiled once,
kept with the loaded model so later jobs of the same shapes reuse the graphs), and fp8 matrix products for fp8
weights on GPUs with fp8 tensor cores (compute capability 8.9 or newer)."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CUDA_ONLY = ("flash", "efficient", "cudnn")   # the kernels that exist only on CUDA devices
FP8_MAX = 448.0  # largest float8_e4m3fn


def attention_kernels(name: str, device: torch.device):
    """Context: scaled_dot_product_attention restricted to one kernel ('auto': torch chooses). The sequence-parallel
    Ring path picks its own log-sum-exp kernel (engine/parallel/attention.py)."""
    if name not in ATTENTION:
        raise ValueError(f"attention={name!r} is invalid: use one of {list(ATTENTION)}")
    if ATTENTION[name] is None:
        return contextlib.nullcontext()
    if device.type != "cuda" and name in CUDA_ONLY:
        raise ValueError(f"attention={name!r} needs a CUDA device; this rank runs on {device.type}: use auto or math")
    return sdpa_kernel([ATTENTION[name]])


def set_compiled(model: torch.nn.Module, block_lists: tuple[str, ...], on: bool) -> int:
    """Compile (or return to eager) every block of `block_lists` in place: module identity, hooks and weight names
    are unchanged, so the step cache and the sequence-parallel processors keep working. Returns blocks changed."""
    changed = 0
    for name in block_lists:
        for block in model.get_submodule(name)._modules.values():
            compiled = getattr(block, "_compiled_call_impl", None) is not None
            if on and not compiled:
                block.compile(fullgraph=False, dynamic=False)
                changed += 1
            elif not on and compiled:
                block._compiled_call_impl = None
                changed += 1
    return changed


def release_model_memory(device: torch.device) -> None:
    """After a model is dropped: forget graphs compiled around its blocks (they keep its weights alive) and give the
    freed GPU memory back to the device."""
    import gc
    if compiled_graphs():
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (unchanged across jobs: the graphs were reused)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def set_fp8_matmul(model: torch.nn.Module, on: bool) -> int:
    """Turn fp8 products on or off for every fp8-stored Linear (CastLinear). Returns how many there are."""
    from .load import CastLinear
    layers = [m for m in model.modules() if isinstance(m, CastLinear)]
    if on and not layers:
        raise ValueError("fp8_matmul needs fp8 weights: load the model with fp8_weights (weight dtype fp8_e4m3fn)")
    if on and not fp8_supported(layers[0].weight.device):
        raise ValueError(f"fp8_matmul needs a GPU with fp8 tensor cores (compute capability 8.9+); this rank has "
                         f"{layers[0].weight.device}: turn fp8_matmul off")
    for layer in layers:
        layer.fp8_matmul = on
    return len(layers)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (weight * weight_scale).T + bias with both operands in float8_e4m3fn: the activations scaled per tensor to
    fp8's range, the weight as stored with its per-tensor scale (1 for plain fp8 files, an fp8_scaled file's
    scale_weight), accumulated in fp32, returned in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    w_scale = (weight_scale.float().reshape(()) if weight_scale is not None
               else torch.ones((), dtype=torch.float32, device=x.device))
    if rows.shape[1] % 16 or weight.shape[0] % 16:  # the fp8 kernels' alignment: fall back to a cast
        dense = weight.to(x.dtype) if weight_scale is None else (weight.float() * w_scale).to(x.dtype)
        return torch.nn.functional.linear(x, dense, bias)
    scale = (rows.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    quantized = (rows / scale).to(torch.float8_e4m3fn)
    pad = -rows.shape[0] % 16
    if pad:
        quantized = torch.nn.functional.pad(quantized.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    out = torch._scaled_mm(quantized, weight.t(), scale_a=scale, scale_b=w_scale, bias=bias, out_dtype=x.dtype)
    return out[:rows.shape[0]].reshape(*x.shape[:-1], weight.shape[0])
