"""Quantized weights kept quantized in memory: GGUF block formats dequantized in torch per layer call, and the
Linear layers that hold them (GGUF blocks; fp8, with or without a ComfyUI `scale_weight`, cast per call or multiplied
in fp8) with LoRAs added on top per call.

Dequantization goes straight to the compute dtype: each block's scales are computed in float32 with the operations,
in the order, that the GGUF format defines (ggml's dequantize_row_* and the gguf package's numpy reference), and the
per-value products in the compute dtype, so no float32 copy of a weight is made per call. In float32 the result is
the value the file stores, bitwise; in bf16/fp16 it is within the dtype's rounding of it (`dequantize`; the bound is
tests/test_quantized_checkpoints.py's). The quantizers that write blocks for test files are quantize_files.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# GGUF block formats: name -> (ggml type id, values per block, bytes per block)
BLOCKS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
          "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
FLOATS = {"F32": (0, torch.float32, 4), "F16": (1, torch.float16, 2), "BF16": (30, torch.bfloat16, 2)}
SUPPORTED = tuple(FLOATS) + tuple(BLOCKS)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of every block, as a float32 column."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


_CONSTANTS: dict = {}


def _shifts(step: int, device: torch.device) -> torch.Tensor:
    """0, step, 2 step, ... below 8 as uint8 on `device`: made there once per device (an arange, so no host data
    crosses) and reused by every layer's every call."""
    key = (step, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.arange(0, 8, step, device=device, dtype=torch.uint8)
    return t


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (n, k) -> 4-bit values (n, 2k): the low nibbles of all k bytes, then the high ones (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of each block's little-endian bit field qh (n, bytes) -> (n, count) of 0/1."""
    return ((qh.unsqueeze(-1) >> _shifts(1, qh.device)) & 1).reshape(qh.shape[0], -1)[:, :count]


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in a K-quant's 12 scale bytes (n, 12) -> two (n, 8) float32."""
    low_sc, low_m, high = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([low_sc & 63, (high & 0x0F) | ((low_sc >> 6) << 4)], dim=1)
    mn = torch.cat([low_m & 63, (high >> 4) | ((low_m >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


# Each block format: its integer values q (exact in any float dtype) times its scale d, plus its offset m where it has
# one. The per-block scales and offsets are small and computed in float32 exactly as ggml does; the per-value work
# (the conversion of q, the product, the sum) runs in the compute dtype `dt`, so no float32 copy of the weight is
# ever made. In float32 every operation is ggml's, in its order: bitwise gguf's values. In bf16/fp16 d and m are
# rounded once to dt, then the product and the sum once each.
def _scaled(q: torch.Tensor, d: torch.Tensor, dt: torch.dtype, m: torch.Tensor | None = None,
            subtract: bool = False) -> torch.Tensor:
    """d * q (+ m, or - m) per element, in dt; d and m broadcast against q."""
    out = q.to(dt).mul_(d.to(dt))
    if m is None:
        return out
    return out.sub_(m.to(dt)) if subtract else out.add_(m.to(dt))


def _q8_0(b, dt):
    return _scaled(b[:, 2:].contiguous().view(torch.int8), _f16(b, 0), dt)


def _q4_0(b, dt):
    return _scaled(_nibbles(b[:, 2:]).to(torch.int8) - 8, _f16(b, 0), dt)


def _q4_1(b, dt):
    return _scaled(_nibbles(b[:, 4:]), _f16(b, 0), dt, _f16(b, 2))


def _q5(b, at):
    return _nibbles(b[:, at + 4:]) | (_bits(b[:, at:at + 4], 32) << 4)


def _q5_0(b, dt):
    return _scaled(_q5(b, 2).to(torch.int8) - 16, _f16(b, 0), dt)


def _q5_1(b, dt):
    return _scaled(_q5(b, 4), _f16(b, 0), dt, _f16(b, 2))


def _k_subblocks(q: torch.Tensor, b: torch.Tensor, dt) -> torch.Tensor:
    """y = d * scale_j * q - dmin * min_j over the 8 sub-blocks of 32 of a Q4_K / Q5_K super-block."""
    sc, mn = _scale_min_k4(b[:, 4:16])
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return _scaled(q.reshape(-1, 8, 32), d.unsqueeze(-1), dt, dmin.unsqueeze(-1), subtract=True).reshape(-1, 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K 4-bit values: each 32-byte group holds sub-block 2g in its low and 2g+1 in its high nibbles."""
    groups = qs.reshape(-1, 4, 32)
    return torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(-1, 256)


def _q4_k(b, dt):
    return _k_subblocks(_k_nibbles(b[:, 16:144]), b, dt)


def _q5_k(b, dt):
    high = _bits(b[:, 16:48].contiguous(), 256).reshape(-1, 32, 8).transpose(1, 2)  # (n, bit j, element l)
    return _k_subblocks(_k_nibbles(b[:, 48:176]) | (high.reshape(-1, 256) << 4), b, dt)


def _q6_k(b, dt):
    ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)                          # (n, half, 4 quarters, 32)
    shifts = _shifts(2, b.device).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).to(torch.int8) - 32          # quarter k of a half: ql half k%2, bits 2k
    d = (_f16(b, 208) * scales).reshape(-1, 16, 1)                        # one scale per 16 values
    return _scaled(q.reshape(-1, 16, 16), d, dt).reshape(-1, 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
               "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF bytes (uint8, rows of whole blocks) -> a tensor of `shape` in `dtype`: in float32 bitwise the gguf
    package's values; in bf16/fp16 within three roundings of the dtype of them (see `_scaled`)."""
    if qtype in FLOATS:
        return data.contiguous().view(FLOATS[qtype][1]).reshape(shape).to(dtype)
    _, size, nbytes = BLOCKS[qtype]
    blocks = data.reshape(-1, nbytes)
    return _DEQUANTIZE[qtype](blocks, dtype).reshape(shape)


def quantized_bytes(qtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` takes in `qtype` (its innermost dimension a whole number of blocks)."""
    numel = 1
    for d in shape:
        numel *= d
    if qtype in FLOATS:
        return numel * FLOATS[qtype][2]
    _, size, nbytes = BLOCKS[qtype]
    return numel // size * nbytes


# ---- ComfyUI's int8_tensorwise layers (comfy/ops.py MixedPrecisionOps; the math is comfy_kitchen's) -------------
# A layer's weight is stored int8 (q) with a float32 `weight_scale` s (one number, or one per output row): the weight
# is q x s. ConvRot files (Comfy-Org's MiniMax-H3 int8 releases) quantized W rotated group-wise along its input
# dimension by the normalized regular Hadamard matrix H of the layer's `convrot_groupsize` (a power of 4, default 256),
# so the weight is rotate(q x s). The engine holds q and s as the file stores them (Int8Linear: the input rotated per
# call, as ComfyUI's layers rotate theirs); `dequantize_int8` gives W itself, exactly.
INT8_FORMAT = "int8_tensorwise"
CONVROT_GROUP = 256   # ComfyUI's default convrot_groupsize
_ROTATE_CHUNK = 1 << 22   # values rotated at a time: the float64 work stays small beside a large matrix


def convrot_group_ok(group) -> bool:
    """Whether `group` is a size the regular Hadamard matrix has: a power of 4, at least 4."""
    return isinstance(group, int) and not isinstance(group, bool) and group >= 4 \
        and group & (group - 1) == 0 and group.bit_length() % 2 == 1


_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))   # ConvRot's regular Hadamard matrix of 4


def _signs(size: int, device: torch.device) -> torch.Tensor:
    """H4 x H4 x ... (Kronecker) of `size` rows (a power of 4; 1: [[1]]), its +-1 entries in float64 on `device`:
    made there once and reused by every layer."""
    key = ("convrot", size, device)
    h = _CONSTANTS.get(key)
    if h is None:
        h4 = torch.tensor(_H4, dtype=torch.float64, device=device)
        h = torch.ones((1, 1), dtype=torch.float64, device=device)
        while h.shape[0] < size:
            h = torch.kron(h, h4)
        _CONSTANTS[key] = h
    return h


def convrot(w: torch.Tensor, group: int) -> torch.Tensor:
    """w (rows, n) rotated group-wise along dim 1 by ConvRot's H = (H4 x ... x H4) / sqrt(group), H4 = [[1,1,1,-1],
    [1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]: each group of `group` values x becomes x @ H^T, as float32. H is symmetric and
    orthogonal, so the rotation is its own inverse: it both makes a file's rotated weight and undoes it.

    Computed in float64 with H's +-1 entries (one matmul by the group x group matrix up to 64; above, H = A x B with A
    and B of about sqrt(group) rows, each group as a matrix X becoming A X B^T: two small matmuls instead of one large
    one), then the power-of-two normalization, then one rounding to float32. For a dequantized row (q x s: float32
    values whose exponents lie within 8 of each other) every product and partial sum is an integer multiple of the
    row's smallest unit, below 2^53 of them for any group up to 4^10, so exact in float64 whatever the order or the
    device's matmul: the result is the exact rotation rounded once, however the rows are divided (each row is rotated
    alone)."""
    rows, cols = w.shape
    if not convrot_group_ok(group) or cols % group:
        raise ValueError(f"ConvRot groups of {group} do not divide rows of {cols} values")
    digits = group.bit_length() // 2   # group = 4 ** digits = size_a * size_b, sqrt(group) = 2 ** digits
    size_a = 4 ** (digits // 2) if group > 64 else 1
    a, b = _signs(size_a, w.device), _signs(group // size_a, w.device)
    out = torch.empty((rows, cols), dtype=torch.float32, device=w.device)
    step = max(1, _ROTATE_CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        x = w[start:start + step].to(torch.float64).reshape(-1, size_a, group // size_a) @ b.T
        if size_a > 1:
            x = a @ x
        out[start:start + step] = (x * 2.0 ** -digits).reshape(-1, cols)
    return out


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An int8_tensorwise weight (rows, n) in `dtype`: q x scale in float32 (scale: one number, or a column of one per
    row), as comfy_kitchen's dequantize_int8_simple computes it, then for ConvRot (`group`: its size; None: not
    rotated) the rotation undone exactly (`convrot`), then rounded to `dtype` from the float32 value (as ComfyUI's
    dequantize_int8_*_dtype does). A few rows at a time, so no float32 copy of the whole weight is made."""
    rows, cols = q.shape
    scale = scale.to(device=q.device, dtype=torch.float32)
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    step = max(1, _ROTATE_CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        w = q[start:start + step].to(torch.float32) * (scale if scale.ndim == 0 else scale[start:start + step])
        out[start:start + step] = convrot(w, group) if group else w
    return out


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (rows, n) as an int8_tensorwise file stores it (for test files, make-tiny): rotated by ConvRot first
    when `group` is given, then per row q = round(W / s) with s = the row's largest magnitude / 127 (float32, a column
    of one per row)."""
    x = convrot(w.float(), group) if group else w.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=2.0 ** -126)
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def rotation(group: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ConvRot's normalized H (group x group: +-1 / sqrt(group), a power of two, so exact in any float dtype) on
    `device` in `dtype`, made once."""
    key = ("convrot-normalized", group, device, dtype)
    h = _CONSTANTS.get(key)
    if h is None:
        h = _CONSTANTS[key] = (_signs(group, device) * 2.0 ** -(group.bit_length() // 2)).to(dtype)
    return h


class LoraOnTop:
    """For layers whose weight stays quantized: LoRAs are kept as their low-rank factors and added to the
    dequantized float32 weight per call, so applying or removing one never touches (or re-reads) the weight."""
    lora_on_top = True

    def init_loras(self) -> None:
        self.loras: list[tuple[torch.Tensor, torch.Tensor, float, float]] = []

    def add_lora(self, up: torch.Tensor, down: torch.Tensor, scale: float, strength: float) -> None:
        self.loras.append((up.float(), down.float(), scale, strength))

    def clear_loras(self) -> None:
        self.loras = []

    def _apply(self, fn, recurse=True):
        """Module.to() and friends: the LoRA factors move with the layer (an expert moved to host memory takes them
        along; none stays on the GPU), and stay float32."""
        out = super()._apply(fn, recurse)
        self.loras = [(fn(up).float(), fn(down).float(), scale, strength) for up, down, scale, strength in self.loras]
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.loras:
            return self.dequantized(dtype).to(dtype)
        w = self.dequantized(torch.float32)   # the LoRAs' product is float32 anyway: add it to the exact weight
        for up, down, scale, strength in self.loras:   # as lora.apply_loras merges: W + s * (up @ down) * scale
            w = w + strength * ((up.to(w.device) @ down.to(w.device)) * scale)
        return w.to(dtype)


class Int8Linear(LoraOnTop, torch.nn.Module):
    """A Linear whose weight is held as ComfyUI's int8_tensorwise stores it: the int8 matrix q (one byte a value)
    and its float32 weight_scale s (one number, or one per output row), ConvRot-rotated or not (`group`). Its weight
    is W = rotate(q x s) along the input (H symmetric and orthogonal), so x W^T = (x H) (q x s)^T: the input is
    rotated group-wise (as ComfyUI's int8 layers rotate their activations), multiplied by q cast to the input's dtype
    (integers up to 127: exact in bf16 and fp16), and the product scaled per output row. Nothing the size of the
    weight is kept besides q. LoRAs stay factors, their low-rank product added to the output per call (int8 cannot
    hold a merged weight)."""

    def __init__(self, linear: torch.nn.Linear, scale: torch.Tensor, group: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_scale", scale)
        self.group = group
        self.init_loras()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W itself, exactly as ComfyUI's dequantization gives it (dequantize_int8)."""
        return dequantize_int8(self.weight, self.weight_scale, self.group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.group:
            h = (x.unflatten(-1, (-1, self.group)) @ rotation(self.group, x.device, x.dtype)).flatten(-2)
        scale = self.weight_scale.to(x.dtype)
        out = F.linear(h, self.weight.to(x.dtype)) * (scale if scale.ndim == 0 else scale.reshape(-1))
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        for up, down, factor, strength in self.loras:   # W + strength x factor x (up @ down), as merges give it
            out = out + (strength * factor) * F.linear(F.linear(x.float(), down.to(x.device)), up.to(x.device)) \
                .to(x.dtype)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


class GGUFLinear(LoraOnTop, torch.nn.Module):
    """A Linear whose weight is held as GGUF blocks (uint8, one row of blocks per output feature) and dequantized
    per call. The blocks are the `weight` parameter, so parameter names, stage predicates and held-byte counts see
    it as the layer's weight."""

    def __init__(self, linear: torch.nn.Linear, data: torch.Tensor, qtype: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qtype = qtype
        self.weight = torch.nn.Parameter(data, requires_grad=False)
        self.bias = linear.bias
        self.init_loras()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.qtype, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


FP8_MAX = 448.0  # largest float8_e4m3fn


class CastLinear(LoraOnTop, torch.nn.Module):
    """A Linear whose weight stays in its stored dtype (fp8) and is cast to the input's dtype per call; with
    `fp8_matmul` (set by engine/models/speed.py) the product itself runs in fp8 where the GPU has fp8 tensor cores.

    scale: an fp8_scaled file's scale_weight (a scalar, or one per output row): the weight is the stored fp8 times
    it, computed in float32 per call. Such a layer takes LoRAs on top (models/quantized.py): writing a LoRA into
    the scaled fp8 weight would round it to fp8."""

    def __init__(self, linear: torch.nn.Linear, scale: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("scale_weight", scale)
        self.fp8_matmul = False
        self.init_loras()

    @property
    def lora_on_top(self) -> bool:
        return self.scale_weight is not None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight.float()
        return w * self.scale_weight if self.scale_weight is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        scalar = self.scale_weight is None or self.scale_weight.numel() == 1
        if self.fp8_matmul and scalar and not self.loras:
            return fp8_linear(x, self.weight, bias, self.scale_weight)
        if self.scale_weight is None and not self.loras:
            return F.linear(x, self.weight.to(x.dtype), bias)
        return F.linear(x, self.dense_weight(x.dtype), bias)


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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
