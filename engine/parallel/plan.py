"""The parallel plan and what it is weighed against: the degrees (`ParallelPlan`), the job as the planner sees it
(`Workload`: the model's dimensions from its family, the job's shape), and the rules a plan must meet to run it
(`plan_problems`, `candidates`, `feasible`). Choosing a plan is planner.py's; its cost, cost.py's and memory.py's."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

from .. import wording
from ..errors import PlanError
from ..models.synthetic import synthetic_info
from .pipefusion.layout import pipefusion_problems

DEGREES = ("dp", "cfg", "pipefusion", "ulysses", "ring")   # their product is the plan's ranks
ALL_DEGREES = DEGREES + ("shard",)   # shard divides the ranks' weights among them: it adds no rank
MAX_RANKS = 8
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2 ** 30
# variants whose clip runs two experts (ComfyUI's stock Wan 2.2 A14B graphs: one KSamplerAdvanced per expert file)
TWO_EXPERTS = ("wan2.2-a14b", "wan2.2-i2v-a14b")
RESIDENT, HOST = "resident", "host"
EXPERT_PLACEMENTS = ("auto", RESIDENT, HOST)   # auto: both resident where they fit, else the idle one in host memory
AUTO = "auto"          # the fastest exact plan on up to the engine's ranks
FASTEST = "fastest"    # the fastest plan, approximate ones (PipeFusion) included
PLAN_MODES = (AUTO, FASTEST)


@dataclass(frozen=True)
class ParallelPlan:
    """world = dp x cfg x pipefusion x ulysses x ring (the xDiT rule). cfg is 1 or 2.

    shard: the weights divided among groups of `shard` consecutive ranks (the fastest degrees first: a Ulysses group,
    then what follows it), each rank holding 1/shard of every block's weights and gathering a block's whole weights
    just before it runs. It overlaps the other degrees' groups (Ulysses 4 with each of the 4 GPUs holding a quarter
    of the weights is ulysses4 x shard4) and adds no rank: it divides the world."""

    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ulysses: int = 1
    ring: int = 1
    shard: int = 1

    def __post_init__(self):
        for name in ALL_DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan degree {name}={value!r} is invalid: every degree is an integer >= 1")
        if self.cfg not in (1, 2):
            raise PlanError(f"plan degree cfg={self.cfg} is invalid: CFG parallel splits the positive and "
                            f"negative passes, so cfg is 1 (off) or 2")
        if self.world_size % self.shard:
            divisors = [d for d in range(2, self.world_size + 1) if self.world_size % d == 0]
            raise PlanError(f"plan degree shard={self.shard} does not divide the plan's {self.world_size} rank(s) "
                            f"(dp x cfg x pipefusion x ulysses x ring): the weights are divided among groups of "
                            f"consecutive ranks; use " + (f"one of {', '.join(map(str, divisors))}" if divisors else
                                                          "shard 1, or more ranks"))

    @classmethod
    def from_dict(cls, degrees: dict) -> "ParallelPlan":
        unknown = sorted(set(degrees) - set(ALL_DEGREES))
        if unknown:
            raise PlanError(f"plan has unknown degrees {unknown}: use {', '.join(ALL_DEGREES)}")
        return cls(**degrees)

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ulysses * self.ring

    def check_world(self, ranks: int) -> None:
        if self.world_size != ranks:
            factors = " x ".join(f"{n}={getattr(self, n)}" for n in DEGREES)
            raise PlanError(wording.say("plan needs ranks", factors=factors, plan=wording.plan(self),
                                        need=self.world_size, ranks=ranks))

    def check_engine(self, ranks: int) -> None:
        """A plan runs on the first world_size ranks of an engine with at least that many (the others idle)."""
        if self.world_size > ranks:
            factors = " x ".join(f"{n}={getattr(self, n)}" for n in DEGREES)
            raise PlanError(f"plan {factors} needs {self.world_size} ranks but the engine has {ranks}: "
                            f"make the product of the degrees at most the number of ranks")

    @classmethod
    def parse(cls, text: str) -> "ParallelPlan":
        """Degrees as `describe` writes them or comma-separated: "ulysses4,ring2", "cfg2 x pipefusion2", "single
        rank" / "1". Raises PlanError naming the text and what works."""
        if text.strip().lower() in ("single rank", "single", "1"):
            return cls()
        words = [w for w in re.split(r"\s*,\s*|\s+x\s+|\s+", text.strip().lower()) if w]
        degrees = {}
        for word in words:
            m = re.fullmatch(r"(dp|cfg|pipefusion|ulysses|ring|shard)=?(\d+)", word.strip())
            if m is None or m.group(1) in degrees:
                raise PlanError(f"plan {text!r} is invalid at {word.strip()!r}: give degrees such as ulysses4,ring2, "
                                f"cfg2,pipefusion2 or ulysses4,shard4 (each of {', '.join(ALL_DEGREES)} at most once)")
            degrees[m.group(1)] = int(m.group(2))
        if not degrees:
            raise PlanError(f"plan {text!r} is invalid: give degrees such as ulysses4,ring2")
        return cls(**degrees)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in ALL_DEGREES if getattr(self, n) > 1]
        return " x ".join(parts) if parts else "single rank"

    def without_shard(self) -> "ParallelPlan":
        """The same plan with every rank holding whole weights."""
        return replace(self, shard=1)


@dataclass(frozen=True)
class Workload:
    """What a plan has to fit, and what it costs: the model's dimensions and the job's shape. `from_info` builds one
    from a checkpoint's header, `for_variant` from a known variant; the defaults after `negative_pass` are FLUX.1's
    head width and T5 length, with weights unknown (0)."""

    variant: str
    heads: int
    layers: int              # attention layers: FLUX double + single blocks, SD3 joint blocks
    image_tokens: int        # per image (a video: all its latent frames), after patching (FLUX 2x2, SD3 patch_size)
    batch: int
    negative_pass: bool      # cfg != 1: the sampler evaluates a negative prompt too
    head_dim: int = 128
    text_tokens: int = 512   # FLUX: T5 tokens; SD3: 77 CLIP + T5 tokens
    dual_layers: int = 0     # SD3.5-medium blocks with a second, image-only attention
    weight_bytes: int = 0    # the transformer's weights as each rank holds them (fp8 matrices: a byte a parameter,
    #                          GGUF blocks: their bytes a parameter)
    block_weight_bytes: int = 0   # of which in the transformer blocks (what PipeFusion stages would divide)
    unit_weight_bytes: tuple = ()  # of which in each of the family's shard_units (divided: gathered alone, not kept
    #                                whole with the root: LTX-2.3's text connectors, MiniMax-H3's refiner)
    dtype: str = "bf16"      # compute dtype (activations)
    fp8_weights: bool = False     # weight_bytes counts quantized matrices (an fp8 or GGUF file's, the fp8 option)
    compiled: bool = False   # torch.compile: the planner uses the GPU's compiled calibration when it has one
    # model facts the cost model needs (from_info fills them from the model's family)
    text_splits: bool = False     # the text tokens split with the image tokens under sequence parallel (else joint)
    linear_width: int = 12   # weights each token meets per block, in hidden^2 (qkv 3 + out 1 + mlp 8)
    out_features: int = 64   # velocity values per image token (latent channels x patch^2)
    token_rows: int = 0      # image token rows (PipeFusion splits them into patches); 0: a square latent
    # the job's steps and PipeFusion settings (its warmup steps run whole; its pipeline fills once per job)
    steps: int = 28
    warmup_steps: int = 1
    patches: int | None = None    # PipeFusion patches per model call (None: one per stage)
    pipefusion_conflict: str = ""  # why PipeFusion cannot run the job, e.g. its step cache ("": it can)
    # the text enters each block by cross-attention (Wan): no text queries, no text through the blocks' layers, only
    # its K/V, which every rank computes for its own queries; nothing about the text is exchanged
    text_cross: bool = False
    # a clip runs `experts` transformers of these dims one after the other (Wan 2.2 A14B: high-noise, then
    # low-noise), each of weight_bytes; `placement` says where the idle one waits (EXPERT_PLACEMENTS)
    experts: int = 1
    placement: str = "auto"
    # a clip (a family that takes frames: seconds a clip, not an image), its latent frames, and the tokens of its
    # audio stream, which image_tokens counts with the video's (they split alike)
    video: bool = False
    latent_frames: int = 1
    audio_tokens: int = 0          # tokens besides the video's, split with them (audio; Wan-Animate 2's pose branch)
    extra_kind: str = "audio"      # what those tokens are, in the planner's words
    # queries every rank holds whole that attend, once a block, to the split image tokens (TokenTable.local_keys:
    # LTX-2.3's audio over the video), and their heads and head width: under sequence parallel their partial results
    # are exchanged and merged (traffic.sp_merge_bytes); 0: none
    merge_queries: int = 0
    merge_heads: int = 0
    merge_head_dim: int = 0

    @property
    def per(self) -> str:
        """What a job makes, as the estimates' units say it: "clip" or "image"."""
        return "clip" if self.video else "image"

    @property
    def rows(self) -> int:
        """Image token rows (a square latent's when not given)."""
        return self.token_rows or max(1, math.isqrt(self.image_tokens))

    @classmethod
    def from_info(cls, info, latent_h: int, latent_w: int, *, batch: int, negative_pass: bool, text_tokens: int,
                  dtype: str = "bf16", fp8_weights: bool = False, compiled: bool = False, steps: int = 28,
                  warmup_steps: int = 1, patches: int | None = None, pipefusion_conflict: str = "",
                  bytes_per_weight: float | None = None, frames: int = 1, experts: int = 1,
                  placement: str = "auto") -> "Workload":
        """From a checkpoint's header info (models.detect.CheckpointInfo) and a latent of latent_h x latent_w (and
        `frames` latent frames, for a family that takes video). bytes_per_weight: the weights are held quantized at
        this many bytes each (e.g. a GGUF block type's, for a known variant priced as such a file); None: as the file
        holds them. experts, placement: a clip of `experts` transformers of this file's dims (Workload.experts)."""
        patch, family = info.latent_patch, info.spec
        if family.stage is None:
            pipefusion_conflict = pipefusion_conflict or f"{family.title} has no PipeFusion stage model yet:"
        width = family.linear_width(info.config) if callable(family.linear_width) else family.linear_width
        fp8 = fp8_weights or info.stored_fp8 or bytes_per_weight is not None   # fp8/GGUF matrices stay so (load.py)
        if bytes_per_weight is None and info.quantized_parameters and not fp8_weights:
            bytes_per_weight = info.quantized_bytes / info.quantized_parameters   # the file's: 1 for fp8, ~0.56 Q4_K
        per_parameter = bytes_per_weight if bytes_per_weight is not None else 1 if fp8 else DTYPE_BYTES[dtype]
        if family.pads_to_patches:   # ComfyUI's model pads the latent to whole patches: the tokens it runs
            rows, cols = -(-latent_h // patch), -(-latent_w // patch)
        else:
            rows, cols = latent_h // patch, latent_w // patch
        audio = family.extra_tokens(info.config, frames) + family.extra_frames(info.variant, frames) * rows * cols
        return cls(variant=info.variant, heads=info.heads, layers=info.layers, batch=batch,
                   image_tokens=frames * rows * cols + audio, negative_pass=negative_pass,
                   head_dim=info.config["attention_head_dim"], text_tokens=text_tokens,
                   dual_layers=len(info.config.get("dual_attention_layers") or ()),
                   weight_bytes=round(info.parameters * per_parameter),
                   block_weight_bytes=round(info.block_parameters * per_parameter),
                   unit_weight_bytes=tuple(round(n * per_parameter) for n in info.unit_parameters),
                   dtype=dtype, fp8_weights=fp8, compiled=compiled, token_rows=rows, steps=steps,
                   warmup_steps=warmup_steps, patches=patches, pipefusion_conflict=pipefusion_conflict,
                   text_splits=family.text_splits, linear_width=width,
                   out_features=info.latent.channels * patch * patch,
                   # diffusers names a joint-attention transformer's text width `joint_attention_dim`; one without it
                   # (Wan: `text_dim`) attends to the text by cross-attention
                   text_cross=("joint_attention_dim" not in info.config) if family.text_cross is None
                   else family.text_cross, experts=experts, placement=placement, video=family.frames,
                   latent_frames=frames, audio_tokens=audio, extra_kind=family.extra_token_kind,
                   **dict(zip(("merge_queries", "merge_heads", "merge_head_dim"),
                              family.local_key_queries(info.config, frames))))

    @classmethod
    def for_variant(cls, variant: str, width: int = 1024, height: int = 1024, *, batch: int = 1,
                    negative_pass: bool = False, text_tokens: int | None = None, dtype: str = "bf16",
                    fp8_weights: bool = False, compiled: bool = False, steps: int = 28,
                    warmup_steps: int = 1, bytes_per_weight: float | None = None, frames: int = 1,
                    experts: int | None = None, placement: str = "auto") -> "Workload":
        """A known variant at full size (its family's dims) and width x height pixels (a video family: `frames`
        frames, as ComfyUI counts them); text tokens default to what ComfyUI's encoders give (the family's usual
        count, e.g. 512 T5 tokens for FLUX, 77 CLIP + 256 T5 for SD3); experts default to the variant's (TWO_EXPERTS:
        2)."""
        info = synthetic_info(f"synthetic:{variant}")
        fmt = info.latent
        down = fmt.downscale
        return cls.from_info(info, height // down, width // down, batch=batch, negative_pass=negative_pass,
                             text_tokens=text_tokens or info.spec.text_tokens, dtype=dtype, fp8_weights=fp8_weights,
                             compiled=compiled, steps=steps, warmup_steps=warmup_steps,
                             bytes_per_weight=bytes_per_weight,
                             frames=fmt.latent_frames(frames) + info.spec.reference_frames(info.variant)
                             if info.spec.frames else 1,
                             experts=experts or (2 if variant in TWO_EXPERTS else 1), placement=placement)




@dataclass(frozen=True)
class PlanChoice:
    plan: ParallelPlan
    reason: str              # one line: why this plan (auto) or that the caller chose it (explicit)


def plan_problems(plan: ParallelPlan, work: Workload) -> list[str]:
    """Why `plan` cannot run this workload, each naming the numbers (empty when it can)."""
    problems = []
    if work.heads % plan.ulysses:
        problems.append(f"the model has {work.heads} heads: ulysses {plan.ulysses} does not divide them")
    sp = plan.ulysses * plan.ring
    if plan.pipefusion > 1 and work.image_tokens % sp:   # PipeFusion's patches split their tokens unpadded
        problems.append(f"the latent has {work.image_tokens} image tokens: ulysses x ring = {sp} does not divide them "
                        f"under pipefusion (pick a size whose tokens divide, or ulysses/ring without pipefusion)")
    elif work.image_tokens - (sp - 1) * shard_tokens(work.image_tokens, sp) < 1:
        problems.append(f"the latent has {work.image_tokens} image tokens: too few for ulysses x ring = {sp} (padded "
                        f"to {shard_tokens(work.image_tokens, sp)} a rank, the last rank would hold none); use a "
                        f"smaller degree")
    if plan.cfg == 2 and not work.negative_pass:
        problems.append("cfg parallel needs a negative pass, and this job has none (cfg 1.0)")
    if work.batch % plan.dp:
        problems.append(f"the batch has {work.batch} images: dp {plan.dp} does not divide it")
    if plan.pipefusion > work.layers:
        problems.append(f"pipefusion {plan.pipefusion} exceeds the model's {work.layers} layers")
    elif plan.pipefusion > 1 and work.pipefusion_conflict:
        problems.append(f"{work.pipefusion_conflict} use ulysses, ring, cfg or dp")
    elif plan.pipefusion > 1:
        problems += pipefusion_problems(plan.pipefusion, work.patches or plan.pipefusion, work.warmup_steps,
                                        work.steps, work.layers, work.rows, work.image_tokens // work.rows, sp, None)
    if plan.shard > 1 and plan.pipefusion > 1:
        problems.append(f"shard {plan.shard} with pipefusion {plan.pipefusion}: PipeFusion's stages divide the blocks "
                        f"among the GPUs already; use shard 1 with pipefusion, or ulysses, ring, cfg or dp with shard")
    return problems


def shard_tokens(image_tokens: int, sp: int) -> int:
    """Image tokens each sequence-parallel rank holds: an equal share, the count padded up to a multiple of the
    degree (parallelize.py pads the last rank's shard; the attention ignores the pad rows)."""
    return -(-image_tokens // sp)


def candidates(world: int, pipefusion: bool = False) -> list[ParallelPlan]:
    """Every plan for `world` ranks, simplest first (the order ties are broken in): whole weights on every rank before
    divided ones (a shard gathers each block every model call), then CFG parallel (one velocity per step), data
    parallel (one velocity per step), then Ulysses (all-to-all of Q/K/V/O), then Ring (K/V passed around); with
    `pipefusion`, the PipeFusion plans and hybrids after them (approximate: stale activations)."""
    out = []
    for dp in range(1, world + 1):
        for cfg in (1, 2):
            for stages in range(1, (world if pipefusion else 1) + 1):
                for ulysses in range(1, world + 1):
                    for ring in range(1, world + 1):
                        if dp * cfg * stages * ulysses * ring == world:
                            for shard in (d for d in range(1, world + 1) if world % d == 0 and
                                          (d == 1 or stages == 1)):
                                out.append(ParallelPlan(dp=dp, cfg=cfg, pipefusion=stages, ulysses=ulysses, ring=ring,
                                                        shard=shard))
    return sorted(out, key=lambda p: (p.pipefusion, p.shard, -p.cfg, -p.dp, -p.ulysses, p.ring))


def feasible(world: int, work: Workload, pipefusion: bool = False) -> list[ParallelPlan]:
    """The plans for `world` ranks that can run this workload, in `candidates` order."""
    return [p for p in candidates(world, pipefusion) if not plan_problems(p, work)]


def is_exact(plan: ParallelPlan, work: Workload) -> bool:
    """The plan's result equals one GPU's (within rounding): every plan but PipeFusion after its warmup steps."""
    return plan.pipefusion == 1 or work.warmup_steps >= work.steps


def items_per_rank(plan: ParallelPlan, work: Workload) -> int:
    """Images x passes one rank's model call carries: its dp share, both passes unless cfg parallel splits them."""
    return work.batch // plan.dp * (2 if work.negative_pass and plan.cfg == 1 else 1)


def text_split(plan: ParallelPlan, work: Workload) -> bool:
    """The text splits with the image when the model does so (Workload.text_splits) and the degree divides it;
    PipeFusion keeps it joint (it travels with patch 0)."""
    return work.text_splits and plan.pipefusion == 1 and work.text_tokens % (plan.ulysses * plan.ring) == 0


def joint_text(work: Workload) -> int:
    """Text tokens that run through the blocks beside the image tokens (0 when the text enters by cross-attention)."""
    return 0 if work.text_cross else work.text_tokens
