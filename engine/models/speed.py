"""Kernels and compile, as per-job options of a loaded transformer: which attention kernels torch's
scaled_dot_product_attention may use, `torch.compile` of the transformer blocks (regional: each block compiled once,
kept with the loaded model so later jobs of the same shapes reuse the graphs), and fp8 matrix products for fp8
weights on GPUs with fp8 tensor cores (compute capability 8.9 or newer)."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .quantized import CastLinear, fp8_supported

ATTENTION = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CUDA_ONLY = ("flash", "efficient", "cudnn")   # the kernels that exist only on CUDA devices


def attention_kernels(name: str, device: torch.device):
    """Context: scaled_dot_product_attention restricted to one kernel ('auto': torch chooses). The sequence-parallel
    Ring path and attention under a bias (LTX-2.3's guides) pick their own log-sum-exp kernels
    (engine/parallel/attention.py)."""
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


def set_fp8_matmul(model: torch.nn.Module, on: bool) -> int:
    """Turn fp8 products on or off for every fp8-stored Linear (CastLinear). Returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, CastLinear)]
    if on and not layers:
        raise ValueError("fp8_matmul needs fp8 weights: load the model with fp8_weights (weight dtype fp8_e4m3fn)")
    if on and not fp8_supported(layers[0].weight.device):
        raise ValueError(f"fp8_matmul needs a GPU with fp8 tensor cores (compute capability 8.9+); this rank has "
                         f"{layers[0].weight.device}: turn fp8_matmul off")
    for layer in layers:
        layer.fp8_matmul = on
    return len(layers)
