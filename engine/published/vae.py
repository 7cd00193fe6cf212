"""Published VAE decode times the decode's cost model (engine/vae/cost.py) is judged on: one row fitted (its one
constant, cost.CONV_SHARE), every other row held out, each residual printed (`python -m engine plan --validate`).

Each N-GPU prediction takes its run's published one-GPU time as base (as the transformer rows do) times the model's
N-GPU / one-GPU ratio, so it judges the scaling; each one-GPU row judges the absolute price. The runs (sizes, GPUs as
their authors state them):
- sglang pull request #16510: Wan 2.2 T2V A14B (its VAE is Wan 2.1's), 1280x720, one H20: decode 26.28 s. The frame
  count is not stated: sglang's default for the model, 81, is assumed.
- sglang pull request #27875: Wan 2.1 T2V 1.3B, 832x480x81, H200: decode 2.63 s replicated, 1.81 s split over the two
  ranks of the CFG group (its row split: halo exchange, then an all-gather of the output). The fitted row: the
  one-GPU decode on a Hopper GPU at its own efficiency (the H20's is an assumption, devices.py).
- sglang pull request #27037: Cosmos3 Nano T2V 1280x720x189 over 4 H200: decode ~8.93 s replicated, 5.20 s split. Its
  VAE is named WanVAE; Wan 2.1's (16 channels) is assumed.
- LightX2V (issue 42's figures): MiniMax-H3 768x1344, 362 frames, RTX 5090: the video VAE 10.65 s on one GPU, 1.66 s
  on eight (tiles spread over the ranks).
- vllm-omni issue #5948: MiniMax-H3 1536x2688, 111 frames (latent 33 tokens), RTX 5090: 56.96 s on one GPU, 28.99 s on
  two, 15.00 s on four (tile parallel).
The engine has no MiniMax-H3 VAE network yet, so its rows are priced from the FLOPs of ComfyUI's decoder
(comfy/ldm/minimax/vae.py:261-319: a 36-block ViT of 32 heads x 64 on each 256 px tile's 7 x 16 x 16 latent tokens
plus 5 register and zero tokens, a gated-SiLU FFN of 4x, proj_out to 3 x 4 x 16 x 16 pixels a token) and ComfyUI's
tile and clip plan (split_tiles, vae.py:424-446; _decode_temporal_chunks, vae.py:597-609), at the DiT's efficiency
(a transformer's matmuls, not a convolution's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..parallel.devices import stated_hardware
from ..vae import cost
from ..vae.load import kind

H3_LAYERS, H3_HEADS, H3_HEAD_DIM, H3_FFN = 36, 32, 64, 4
H3_TILE_PX, H3_OVERLAP_PX, H3_RATIO, H3_RATIO_T = 256, 64, 16, 4
H3_CLIP_TOKENS, H3_TOKEN_DROP = 5, 3   # ceil(clip_length 17 / 4) tokens a clip step, 3 dropped: 7 tokens a clip


def h3_tiles(width: int, height: int, latent_frames: int) -> int:
    """Tile decodes of a MiniMax-H3 decode, as ComfyUI plans them: spatial tiles (the fewest 256 px tiles that cover
    the side with >= 64 px overlaps) times temporal clips."""
    def side(n_px: int) -> int:
        if H3_TILE_PX >= n_px:
            return 1
        n = math.ceil(n_px / H3_TILE_PX)
        while H3_TILE_PX * n - H3_OVERLAP_PX * (n - 1) < n_px:
            n += 1
        return n
    total = latent_frames + H3_TOKEN_DROP
    total += (-total) % H3_CLIP_TOKENS
    clips = max(1, total // H3_CLIP_TOKENS - 1)
    return side(width) * side(height) * clips


def h3_tile_flops() -> float:
    """FLOPs of one MiniMax-H3 tile decode (2 per multiply-add)."""
    d = H3_HEADS * H3_HEAD_DIM
    tokens = (H3_CLIP_TOKENS + 2) * (H3_TILE_PX // H3_RATIO) ** 2
    seq = tokens + 5
    block = 2 * seq * (4 * d * d + 3 * H3_FFN * d * d) + 4 * seq * seq * d   # qkv + out, FFN (w1 2x, w2), attention
    return H3_LAYERS * block + 2 * tokens * d * 3 * H3_RATIO_T * H3_RATIO ** 2 + 2 * tokens * 24 * d


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    source: str
    gpu: str
    link: str
    gpus: int
    published_s: float
    base_s: float            # the run's published one-GPU time
    fit: bool = False
    note: str = ""

    def estimate(self, ranks: int) -> cost.Estimate:
        hw = stated_hardware(max(ranks, 1), self.gpu, self.link)
        if self.key.startswith("h3"):
            w, h, t = H3_RUNS[self.key.split(":")[0]]
            tile = cost.Counted(h3_tile_flops(), 0, 0, 0, 0, 0, 0, 0, 0, 0)
            return cost.price(tile, ranks, hw, tiles=h3_tiles(w, h, t), transformer=True)
        name, shape = WAN_RUNS[self.key.split(":")[0]]
        return cost.price(cost.count(kind(name), {}, shape, "decode", "bf16"), ranks, hw)

    @property
    def predicted_s(self) -> float:
        if self.gpus == 1:
            return self.estimate(1).seconds
        return self.base_s * self.estimate(self.gpus).seconds / self.estimate(1).seconds

    @property
    def residual(self) -> float:
        return self.predicted_s / self.published_s - 1


WAN_RUNS = {   # key: (VAE kind, latent [B, C, T, H, W])
    "sglang-wan-720p": ("wan2.1", (1, 16, 21, 90, 160)),
    "sglang-wan-480p": ("wan2.1", (1, 16, 21, 60, 104)),
    "sglang-cosmos3": ("wan2.1", (1, 16, 48, 90, 160)),
}
H3_RUNS = {"h3-lightx2v": (1344, 768, 107), "h3-vllm-omni": (2688, 1536, 33)}   # width, height, latent tokens
SGLANG = "sgl-project/sglang pull request"


def rows() -> list[Row]:
    wan720 = "Wan 2.1 VAE 1280x720x81 (Wan 2.2 A14B), H20"
    return [
        Row("sglang-wan-480p", "Wan 2.1 VAE 832x480x81, H200, one GPU", f"{SGLANG} #27875", "H200", "nvlink", 1,
            2.63, 2.63, fit=True),
        Row("sglang-wan-480p:2", "the same, split over 2 H200", f"{SGLANG} #27875", "H200", "nvlink", 2, 1.81, 2.63,
            note="its split all-gathers the output"),
        Row("sglang-wan-720p", wan720, f"{SGLANG} #16510", "H20", "nvlink", 1, 26.28, 26.28,
            note="81 frames assumed"),
        Row("sglang-cosmos3", "Cosmos3 Nano's WanVAE 1280x720x189, H200, one GPU (replicated)", f"{SGLANG} #27037",
            "H200", "nvlink", 1, 8.93, 8.93, note="Wan 2.1's VAE assumed"),
        Row("sglang-cosmos3:4", "the same, split over 4 H200", f"{SGLANG} #27037", "H200", "nvlink", 4, 5.20, 8.93,
            note="Wan 2.1's VAE assumed"),
        Row("h3-lightx2v", "MiniMax-H3 768x1344x362, RTX 5090, one GPU", "LightX2V (issue 42)", "RTX 5090",
            "pcie-no-peer", 1, 10.65, 10.65, note="4x vllm-omni's time a tile on the same GPU"),
        Row("h3-lightx2v:8", "the same, tiles over 8 RTX 5090", "LightX2V (issue 42)", "RTX 5090", "pcie-no-peer", 8,
            1.66, 10.65),
        Row("h3-vllm-omni", "MiniMax-H3 1536x2688x111, RTX 5090, one GPU", "vllm-project/vllm-omni issue #5948",
            "RTX 5090", "pcie-no-peer", 1, 56.96, 56.96),
        Row("h3-vllm-omni:2", "the same, tiles over 2 RTX 5090", "vllm-project/vllm-omni issue #5948", "RTX 5090",
            "pcie-no-peer", 2, 28.99, 56.96),
        Row("h3-vllm-omni:4", "the same, tiles over 4 RTX 5090", "vllm-project/vllm-omni issue #5948", "RTX 5090",
            "pcie-no-peer", 4, 15.00, 56.96),
    ]


def fitted_conv_share() -> float:
    """CONV_SHARE as the fitted row gives it: the share that prices that row at its published time."""
    row = next(r for r in rows() if r.fit)
    return cost.CONV_SHARE * row.estimate(1).compute_s / (row.published_s - (row.estimate(1).seconds -
                                                                              row.estimate(1).compute_s))


def table() -> list[str]:
    """Markdown: each published decode, the model's, the residual, fitted or held out."""
    lines = ["| published decode | GPUs | published | model | residual | role | note | source |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows():
        lines.append(f"| {r.what} | {r.gpus} | {r.published_s:g} s | {r.predicted_s:.3g} s | {r.residual:+.0%} | "
                     f"{'fit (CONV_SHARE)' if r.fit else 'held out'} | {r.note} | {r.source} |")
    held = [r for r in rows() if not r.fit]
    scaling = [r for r in held if r.gpus > 1]
    worst = max(held, key=lambda r: abs(r.residual))
    lines += ["", f"decode rows: {len(held) + 1} (1 fit, {len(held)} held out); held-out N-GPU rows (scaling from "
                  f"the published one-GPU time) within 25%: {sum(abs(r.residual) <= 0.25 for r in scaling)} of "
                  f"{len(scaling)}; worst held out: {worst.key} {worst.residual:+.0%}"]
    return lines
