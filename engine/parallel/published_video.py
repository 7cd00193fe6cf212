"""Published multi-GPU video runs the cost model is checked against, with residuals and speed-up ratios.

The engine has no family for the models these runs used, so each is priced through a Workload built from the model's
published dimensions (`Dims`, with its source), not a family. As for the image runs (published.py), every prediction
takes its scenario's published one-GPU time as its base, so the rows check how the time scales with GPUs, not the
absolute rate. Two facts of these runs the model is told:
- `outside`: published times are whole-pipeline seconds; the text encoders and the VAE decode run once per video and
  do not shrink with more GPUs in xDiT's HunyuanVideo runs (without them its 6- and 8-GPU speed-ups come out 7-35%
  too high).
  One row sets F (role "fit: HUNYUANVIDEO_OUTSIDE_S"); it is the same F for xDiT's H100, H20 and L20 runs.
- `computed_share`: ParaAttention's runs use its first-block cache, which skips whole steps; the share of steps
  computed is its own published pair (one L20: 2271.06 s cached against 3675.71 s uncached), the same on every GPU
  count (the cache decides on the same first-block residuals; the skipped steps send nothing).

Rows, sources (each row's `source` names its table):
- xDiT docs/performance/hunyuanvideo.md: HunyuanVideo, 1280x720 and 960x960, 129 frames, 50 steps, Ulysses, on H100,
  H20 (the official HunyuanVideo code; 8-GPU NVLink machines) and L20 (diffusers' implementation, xDiT's example
  script, flash-attn 2.7.2; PCIe). Its 960x960 grid has the 720p video's tokens (33 x 60 x 60 = 33 x 45 x 80).
- diffusers docs/source/en/optimization/para_attn.md (ParaAttention): HunyuanVideo 1280x720, 129 frames, 30 steps on
  L20 (PCIe), first-block cache with context parallel (ParaAttention's default mesh: Ulysses over every GPU).
  (ParaAttention's own doc/fastest_hunyuan_video.md prints 6043.88 s for the uncached one-GPU run, which is xDiT's
  50-step figure; the diffusers page's 3675.71 s for 30 steps is used.)
- xDiT docs/performance/consisid.md: ConsisID (CogVideoX-5B's transformer and a face cross-attention every second
  block), 720x480, 49 frames, 50 steps, CFG, on 1-6 H100 (the page names no link: NVLink assumed).
The CogVideoX, Latte and Step-Video pages give figures only as plots or without their video size, and no public source
found gives multi-GPU times for Wan as text; none of those is used.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import cost
from .devices import stated_hardware
from .plan import DTYPE_BYTES, ParallelPlan, Workload
from .published import Row

HELD = "held out"


@dataclass(frozen=True)
class Dims:
    """A published model's transformer as the cost model sees it."""
    name: str
    heads: int
    head_dim: int
    layers: int              # attention layers (dual-stream + single-stream blocks)
    text_tokens: int         # joint text tokens (attended with the video tokens)
    linear_width: float      # weights each token meets per block, in hidden^2
    parameters: float
    source: str
    latent_channels: int = 16
    down: int = 8            # pixels per latent pixel
    frames_down: int = 4     # video frames per latent frame (after the first)
    patch: int = 2

    def workload(self, width: int, height: int, frames: int, steps: int, negative_pass: bool) -> Workload:
        latent_frames = (frames - 1) // self.frames_down + 1
        rows, cols = height // self.down // self.patch, width // self.down // self.patch
        weights = round(self.parameters * DTYPE_BYTES["bf16"])
        return Workload(variant=self.name, heads=self.heads, layers=self.layers,
                        image_tokens=latent_frames * rows * cols, batch=1, negative_pass=negative_pass,
                        head_dim=self.head_dim, text_tokens=self.text_tokens,
                        weight_bytes=weights, block_weight_bytes=weights, linear_width=self.linear_width,
                        out_features=self.latent_channels * self.patch ** 2, token_rows=rows, steps=steps)


HUNYUANVIDEO = Dims("HunyuanVideo", heads=24, head_dim=128, layers=20 + 40, text_tokens=256, linear_width=12,
                    parameters=12.8e9,
                    source="HunyuanVideo's HYVideo-T/2 config (hyvideo/modules/models.py): hidden 3072, 24 heads, 20 "
                           "dual-stream + 40 single-stream blocks, MLP ratio 4 (FLUX's layout: 12 hidden^2 a token "
                           "a block), 256 text tokens, patch 1x2x2 on a 16-channel latent at 4x/8x")
CONSISID = Dims("ConsisID", heads=48, head_dim=64, layers=42, text_tokens=226, linear_width=12 + 2 * 2048 / 3072 / 2,
                parameters=5.7e9,
                source="diffusers' ConsisIDTransformer3DModel (CogVideoX-5B's): 42 blocks, 48 heads x 64, FFN 4x, "
                       "226 joint text tokens, patch 2; a face cross-attention (q and out 3072 <-> 2048) every "
                       "second block")

# seconds of a published whole-pipeline time outside the transformer loop (text encoders, VAE decode), which more
# GPUs do not shorten in xDiT's HunyuanVideo runs. Set by xDiT's H20 1280x720 Ulysses-8 row (940.97 s).
HUNYUANVIDEO_OUTSIDE_S = 88.2


@dataclass(frozen=True)
class VideoScenario:
    name: str
    dims: Dims
    width: int
    height: int
    frames: int
    steps: int
    negative_pass: bool
    gpu: str
    link: str
    one_gpu_s: float
    rows: tuple              # (plan text, GPUs, published s, role)
    source: str
    code: cost.Code = cost.XDIT
    outside: str = ""        # the module constant holding the seconds outside the transformer loop ("": none)
    computed_share: float = 1.0

    def workload(self) -> Workload:
        return self.dims.workload(self.width, self.height, self.frames, self.steps, self.negative_pass)

    @property
    def outside_s(self) -> float:
        return globals()[self.outside] if self.outside else 0.0

    @property
    def one_gpu_ms(self) -> float:
        """The published one-GPU time's transformer step (outside seconds and skipped steps taken off)."""
        return (self.one_gpu_s - self.outside_s) * 1e3 / (self.steps * self.computed_share)


# ParaAttention's context parallel: yunchang-style Ulysses (q, k, v and the output exchanged: 4 all-to-alls a layer)
PARAATTENTION = cost.Code("ParaAttention (Ulysses: 4 all-to-alls a layer)", 1.0, 1.0, 4)
XDIT_HV = "xDiT docs/performance/hunyuanvideo.md"
PARA = "diffusers docs optimization/para_attn.md (ParaAttention)"


def _hv(gpu, link, size, one, rows, fit_row=None):
    w, h = size
    return VideoScenario(f"HunyuanVideo {w}x{h} 129 frames 50 steps, {gpu} {'PCIe' if link == 'pcie' else 'NVLink'}, "
                         f"Ulysses (xDiT)", HUNYUANVIDEO, w, h, 129, 50, False, gpu, link, one,
                         tuple((f"ulysses{n}", n, t, "fit: HUNYUANVIDEO_OUTSIDE_S" if n == fit_row else HELD)
                               for n, t in rows), XDIT_HV, outside="HUNYUANVIDEO_OUTSIDE_S")


VIDEO_SCENARIOS = (
    _hv("H100 SXM", "nvlink", (1280, 720), 1904.08, ((2, 925.04), (4, 514.08), (8, 337.58))),
    _hv("H20", "nvlink", (1280, 720), 6639.17, ((2, 3400.55), (4, 1762.86), (8, 940.97)), fit_row=8),
    _hv("L20", "pcie", (1280, 720), 6043.88, ((2, 3271.44), (4, 2080.05))),
    _hv("H100 SXM", "nvlink", (960, 960), 1735.01, ((2, 934.09), (3, 645.45), (6, 367.02))),
    _hv("H20", "nvlink", (960, 960), 6621.46, ((2, 3400.55), (3, 2310.48), (6, 1214.67))),
    _hv("L20", "pcie", (960, 960), 6039.08, ((2, 3260.62), (3, 2284.74))),
    VideoScenario("HunyuanVideo 1280x720 129 frames 30 steps, L20 PCIe, first-block cache + Ulysses (ParaAttention)",
                  HUNYUANVIDEO, 1280, 720, 129, 30, False, "L20", "pcie", 2271.06,
                  (("ulysses2", 2, 1132.90, HELD), ("ulysses4", 4, 718.15, HELD), ("ulysses8", 8, 649.23, HELD)),
                  PARA, code=PARAATTENTION, computed_share=2271.06 / 3675.71),
    VideoScenario("ConsisID 720x480 49 frames 50 steps cfg, H100 (NVLink assumed) (xDiT)", CONSISID, 720, 480, 49,
                  50, True, "H100 SXM", "nvlink", 114.87,
                  (("ring2", 2, 70.19, HELD), ("ulysses2", 2, 76.56, HELD), ("cfg2", 2, 59.72, HELD),
                   ("ulysses3", 3, 53.57, HELD), ("ring3", 3, 55.51, HELD),
                   ("cfg2,ulysses2", 4, 41.37, HELD), ("cfg2,ring2", 4, 40.68, HELD),
                   ("ulysses2,ring3", 6, 44.89, HELD), ("ulysses3,ring2", 6, 44.24, HELD),
                   ("cfg2,ring3", 6, 35.78, HELD), ("cfg2,ulysses3", 6, 38.35, HELD)),
                  "xDiT docs/performance/consisid.md"),
)


def hardware(s: VideoScenario, gpus: int):
    return stated_hardware(gpus, s.gpu, s.link)


def predict(s: VideoScenario, plan: str, gpus: int) -> cost.Estimate:
    """The transformer loop's estimate (every step computed)."""
    return cost.estimate(ParallelPlan.parse(plan), s.workload(), hardware(s, gpus), code=s.code,
                         one_gpu_ms=s.one_gpu_ms)


def predicted_s(s: VideoScenario, plan: str, gpus: int) -> float:
    """The published quantity as the model predicts it: the outside seconds + the computed share of the loop."""
    return s.outside_s + s.computed_share * predict(s, plan, gpus).job_ms / 1e3


def validation_rows(scenarios=VIDEO_SCENARIOS) -> list[Row]:
    return [Row(s.name, ParallelPlan.parse(plan).describe(), gpus, seconds, predicted_s(s, plan, gpus), s.one_gpu_s,
                role) for s in scenarios for plan, gpus, seconds, role in s.rows]


@dataclass(frozen=True)
class Ratio:
    """A speed-up from one GPU count to another (the best published plan on each), published against predicted."""
    scenario: str
    from_gpus: int
    to_gpus: int
    published: float
    predicted: float
    held_out: bool           # neither end is a row that set a constant

    @property
    def residual(self) -> float:
        return self.predicted / self.published - 1


def ratios(scenarios=VIDEO_SCENARIOS) -> list[Ratio]:
    """Each scenario's speed-ups between consecutive GPU counts (1 GPU first), each count's fastest published row."""
    out = []
    for s in scenarios:
        best = {1: (s.one_gpu_s, s.one_gpu_s, True)}
        for plan, gpus, seconds, role in s.rows:
            if gpus not in best or seconds < best[gpus][0]:
                best[gpus] = (seconds, predicted_s(s, plan, gpus), role == HELD)
        counts = sorted(best)
        for a, b in zip(counts, counts[1:]):
            (pa, qa, ha), (pb, qb, hb) = best[a], best[b]
            out.append(Ratio(s.name, a, b, pa / pb, qa / qb, ha and hb))
    return out


def fit_outside() -> float:
    """Re-derive HUNYUANVIDEO_OUTSIDE_S: the value (bisection) at which its row's prediction equals the published
    time. The module's value is restored."""
    global HUNYUANVIDEO_OUTSIDE_S
    s, plan, gpus, target = next((s, p, g, t) for s in VIDEO_SCENARIOS for p, g, t, role in s.rows
                                 if role == "fit: HUNYUANVIDEO_OUTSIDE_S")
    saved, lo, hi = HUNYUANVIDEO_OUTSIDE_S, 0.0, target
    try:
        for _ in range(60):
            HUNYUANVIDEO_OUTSIDE_S = (lo + hi) / 2
            if predicted_s(s, plan, gpus) < target:
                lo = HUNYUANVIDEO_OUTSIDE_S
            else:
                hi = HUNYUANVIDEO_OUTSIDE_S
        return (lo + hi) / 2
    finally:
        HUNYUANVIDEO_OUTSIDE_S = saved


def validation_table() -> list[str]:
    """Markdown: every published video row against the model, then the speed-ups from one GPU count to the next."""
    lines = ["Published video runs against predicted (each scenario's published one-GPU time as base; xDiT's "
             "HunyuanVideo rows add the fitted seconds outside the transformer loop, ParaAttention's the computed "
             "share of its cached steps). Residual = predicted / published - 1.", "",
             "| scenario | base: 1 GPU s | GPUs | plan | published s | predicted s | residual | role | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in VIDEO_SCENARIOS:
        for plan, gpus, seconds, role in s.rows:
            p = predicted_s(s, plan, gpus)
            lines.append(f"| {s.name} | {s.one_gpu_s:.2f} | {gpus} | {ParallelPlan.parse(plan).describe()} | "
                         f"{seconds:.2f} | {p:.2f} | {p / seconds - 1:+.1%} | {role} | {s.source} |")
    lines += ["", "Speed-up from one GPU count to the next (the fastest published plan on each), published against "
                  "predicted.", "",
              "| scenario | GPUs | published speed-up | predicted | residual | held out |", "|---|---|---|---|---|---|"]
    for r in ratios():
        lines.append(f"| {r.scenario} | {r.from_gpus} -> {r.to_gpus} | {r.published:.2f} | {r.predicted:.2f} | "
                     f"{r.residual:+.1%} | {'yes' if r.held_out else 'no'} |")
    return lines
