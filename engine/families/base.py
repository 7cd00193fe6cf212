"""The contract of a model family: everything family-specific about a diffusion transformer, declared by one module per
family (engine/families/<name>.py). The engine's generic code (detection, loading, sampling, the parallel methods, the
planner, the nodes) reads a Family and names none.

Also the few helpers families share: key-map builders for single-file layouts, 2x2 latent packing, and a forward
pre-hook that lives for one forward.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..sampling.latent_formats import LatentFormat
from ..sampling.schedules import FlowSampling

Op = tuple | str | None   # a key map entry's op: None, ("chunk", i, sizes), "swap" or "rows:N" (models/convert.py)


@dataclass(frozen=True)
class Marker:
    """A key only this family's `layout` has (after the file's prefix), unless one of `absent` is there too."""
    key: str
    layout: str
    absent: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenTable:
    """Where a family's tokens are split across the sequence-parallel ranks and gathered again (the idea of diffusers'
    `_cp_plan`): names are the model's forward arguments or module paths; engine/parallel/parallelize.py applies it."""

    processor: type                                 # attention processor: (attention entry point) -> processor
    gather_after: str                               # module whose output (tokens on dim 1) is gathered
    split_inputs: tuple[tuple[str, int], ...] = ()  # forward arguments holding image tokens: (name, token dim); one
    #                                                 with no such dim this forward (e.g. a per-item, not per-token,
    #                                                 timestep) or absent is left whole
    text_inputs: tuple[tuple[str, int], ...] = ()   # text arguments: split with the image tokens when their count
    #                                                 divides the degree, else held by every rank (joint); the
    #                                                 processor is told which through `joint_text_tokens`
    split_after: tuple[tuple[str, int | None, int], ...] = ()  # (module, output item or None, token dim): image-token
    #                                                 outputs split right after the module (positions of the whole
    #                                                 grid), joint reference tokens kept whole
    text_after: tuple[tuple[str, int | None, int], ...] = ()   # the same for text-token outputs (e.g. text RoPE),
    #                                                 split exactly when the forward's text is split
    split_grid_after: tuple[tuple[str, int], ...] = ()  # (module, first grid dim): a module whose output holds the
    #                                                 image tokens as a grid on its trailing dims (a patch embedding's
    #                                                 [n, C, F, h, w]): flattened from that dim and split, for a model
    #                                                 that flattens them itself (a flatten of one dim is a no-op)
    blocks: tuple[str, ...] = ()                    # the block lists, in order (stages and step caches split here)
    split_args: tuple[tuple[str, int, int], ...] = ()  # (module, positional argument, token dim): an input of a
    #                                                 module split as it enters (a sequence the model builds inside
    #                                                 its forward, e.g. one packed from several streams); a module
    #                                                 path ending in ".*" names every module of a list
    reference_tokens: bool = False                  # split_inputs may end in reference tokens (FlowModel says how
    #                                                 many per forward): split with them or joint
    kwargs_name: str = "joint_attention_kwargs"     # the model's forward argument that reaches the processors
    local_keys: tuple[str, ...] = ()                # modules whose queries every rank holds whole but whose keys and
    #                                                 values are the image tokens, split (e.g. audio queries over the
    #                                                 video): each rank attends to its own keys and the partial results
    #                                                 merge exactly through their log-sum-exp (parallel/attention.py
    #                                                 local_keys); marked `xdit_local_keys` for the processor, which
    #                                                 says it takes them (`takes_local_keys`); a path with ".*" names
    #                                                 every module of a list

    def __post_init__(self):
        if self.local_keys and self.reference_tokens:   # joint reference keys would enter every rank's softmax
            raise ValueError("a token table with local_keys cannot take reference tokens held whole on every rank")


@dataclass(frozen=True)
class StageParams:
    """Parameter-name prefixes a PipeFusion stage holds besides its blocks."""
    every: tuple[str, ...]    # every stage (the timestep embedding every block modulates with)
    first: tuple[str, ...]    # the first stage: the embedders
    last: tuple[str, ...]     # the last stage: the final layer


@dataclass(frozen=True)
class StockJob:
    """A variant's job as the pack's workflow for it, ComfyUI's stock template (workflows/README.md), runs it: what
    `python -m engine plan` prices unless told otherwise."""
    workflow: str            # workflows/<workflow>.json; `note` says when the values are another variant's
    width: int
    height: int
    steps: int
    cfg: float               # 1.0: no negative pass (FLUX's guidance is embedded, not CFG)
    frames: int = 1          # as ComfyUI's video nodes count them
    shift: float | None = None   # the model sampling's shift (None: a scheduler that sets its own, e.g. Flux2Scheduler)
    note: str = ""


# The extras entry in which a family whose latent packs several streams (Family.packed_streams) puts their shapes, each
# row (video C, F, H, W, then the other streams' dims): what code outside the family reads of them (the video stream
# is the latent a plan is checked against).
PACKED_SHAPE = "av_shape"


@dataclass(frozen=True)
class Family:
    """One model family. Callables take the diffusers config a checkpoint's shapes gave (`config`)."""

    name: str                                   # "flux", "sd3", ...: what CheckpointInfo.family holds
    title: str                                  # e.g. "FLUX.1"
    variants: tuple[str, ...]                   # variant names, the first the default of make-tiny

    # ---- checkpoints: recognising a file, its diffusers config, its keys in diffusers' names
    markers: tuple[Marker, ...]
    infer: Callable[[str, dict, dict], tuple[dict, str]]    # (layout, shapes, metadata) -> (config, variant)
    key_map: Callable[[str, dict], list | None]             # (layout, config) -> [(diffusers, source, op)] | None
    model_class: Callable[[], type]                         # the unmodified diffusers transformer class
    gguf_arches: tuple[str, ...]                            # general.architecture of the family's GGUF files
    layers: Callable[[dict], int]                           # transformer blocks (attention layers)

    # ---- ComfyUI's conventions: latent format, model sampling, conditioning, the one forward
    latent: LatentFormat
    latent_patch: Callable[[dict], int]                     # latent pixels per token side
    sampling: Callable[[str], FlowSampling]                 # variant -> ComfyUI's default model sampling
    comfy_model: Callable[[dict], tuple[str, dict]]         # config -> (comfy.supported_models class, unet config)
    cond_width: Callable[[dict], int]                       # CONDITIONING tensor [B, N, width]
    pooled_width: Callable[[dict], int | None]              # pooled_output [B, width], None: the family has none
    takes_guidance: Callable[[dict], bool]                  # an embedded guidance scale (FluxGuidance)
    forward: Callable                                       # (flow, x_model, timestep32, prepared) -> velocity;
    #                                                         timestep32: what ComfyUI's model gets (its model
    #                                                         sampling's timestep(sigma), float32)
    text_tokens: int                                        # the encoders' usual token count (planner, stage split)
    cfg: float                                              # the cfg its stock workflows use (1.0: no negative pass)
    reference_methods: tuple[str, ...] = ()                 # how reference latents are placed, ComfyUI's default
    #                                                         first (() = the family takes none)
    max_latent_side: Callable[[dict], int | None] = lambda config: None   # latent pixels a side (position grid)
    pads_to_patches: bool = False                           # ComfyUI pads a latent to whole patches (else refused)
    pad_text_to: int = 0                                    # ComfyUI's model prepends zero tokens to a shorter text
    #                                                         up to this count (0: the text as the encoder gave it)
    latent_for: Callable[[dict], LatentFormat] | None = None   # a latent format that depends on the file (else
    #                                                         `latent`); read it through latent_format(config)
    frames: bool = False                                    # the forward takes video latents [N, C, F, h, w] of any F
    #                                                         (else a one-frame video latent is handed as an image)
    image_context_width: Callable[[dict], int | None] = lambda config: None   # CLIP-vision features the model takes
    #                                                         (ComfyUI's clip_fea [B, T, width]); None: none
    concat_channels: Callable[[dict], int] = lambda config: 0   # input channels ComfyUI concatenates to the latent
    #                                                         (its c_concat) before the model
    concat_cond: Callable | None = None                     # (flow, side Conditioning, denoise mask or None) ->
    #                                                         ComfyUI's c_concat [B|1, extra, ...] in model space
    process_timestep: Callable | None = None                # (config, timestep [n], denoise mask) -> the model's
    #                                                         timestep under a noise mask (ComfyUI's process_timestep)
    masked_latent_clean: Callable[[dict], bool] = lambda config: False   # under a noise mask the masked-out latent
    #                                                         enters the model as it is, not noised to sigma (ComfyUI's
    #                                                         scale_latent_inpaint)
    image_inputs_optional: bool = False                     # ComfyUI's model runs without the image-to-video inputs
    #                                                         too (HunyuanVideo 1.5: text-to-video on the same file):
    #                                                         a missing clip_vision_output or concat_latent_image is
    #                                                         not refused, and concat_cond may give None
    clip_vision_state: str = "penultimate_hidden_states"    # the CLIP-vision output's field ComfyUI's model takes as
    #                                                         clip_fea (HunyuanVideo 1.5: last_hidden_state)

    # the compute dtypes ComfyUI runs the model in (its supported_inference_dtypes): fp16 only where ComfyUI allows it,
    # since a model whose activations overflow float16 gives NaNs there, not an error
    compute_dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    compute_dtypes_cite: str = ""                           # where ComfyUI says so (file:line), for the refusal

    # ---- parallel methods and the planner
    tokens: TokenTable | None = None
    stage: type | None = None                               # PipeFusion's stage model (engine/parallel/stage.py)
    stage_params: StageParams | None = None
    text_splits: bool = False                               # text tokens may split with the image tokens
    stock_jobs: dict[str, StockJob] = field(default_factory=dict)   # variant -> its stock workflow's job (planner)
    linear_width: float | Callable[[dict], float] = 12      # block weights each token meets, in hidden^2 (planner;
    #                                                         a callable: from the config)
    text_stream: tuple[str, ...] = ("context", "add_", "to_add_out")  # block parameter names of the text stream
    modulation: tuple[str, ...] = ("norm",)                 # block matrices that act once per image, not per token

    # ---- synthetic and tiny models (make-tiny writes the layout ComfyUI users' files have)
    native_layout: str = ""
    dims: dict[str, dict[str, Any]] = field(default_factory=dict)   # "full" | "small" | "tiny" -> variant -> dims
    shapes: Callable[[Any], dict[str, tuple]] | None = None # dims -> {key in native layout: shape}
    full_extras: tuple[str, ...] = ()                       # keys a full checkpoint has besides the transformer

    # modules that hold tensors outside the state dict (e.g. a RoPE table), which building on the meta device left
    # empty: built again, on the CPU, once the weights are loaded
    rebuild_off_meta: Callable[[torch.nn.Module], None] = lambda model: None
    # the model's float32 islands: parameter names (diffusers') held in float32 whatever the compute dtype, as ComfyUI's
    # model holds them (MiniMax-H3: its patch projections, time embedding, output heads and RoPE frequencies)
    fp32_params: Callable[[str], bool] = lambda name: False

    variant_aliases: dict = field(default_factory=dict)   # other names every command takes for a variant
    # dims -> entries of the safetensors header the family's files carry (make-tiny writes them; e.g. LTX-2.3's config)
    tiny_metadata: Callable[[Any], dict[str, str]] = lambda dims: {}

    # ---- several latent streams in one LATENT (audio + video): ComfyUI's sampler carries them packed into one
    # [B, 1, N] tensor (comfy.utils.pack_latents) and its model receives them unpacked; the engine's calls take the
    # packed tensor, the streams' shapes and what else the family's forward reads per call among `extras` (names of
    # float32 tensors [n, ...] a model call's conditioning carries, Prepared.extras)
    packed_streams: bool = False
    extras: tuple[str, ...] = ()
    # the extras the forward reads on the host (shapes, masks, seeds: what the call's layout is built from): the ranks
    # hold them in host memory, so reading them makes the device wait for nothing (the rest arrive on the device)
    host_extras: tuple[str, ...] = ()
    # (stream shapes, the call's keyword inputs (a dict: the family removes what it reads; what is left meets the
    # engine's usual checks), transformer_options, the timestep as ComfyUI's model passes it (a tensor, or a tuple of
    # the streams'), ComfyUI's own diffusion model built on the meta device (its attributes) or None) -> (the call's
    # `extras` tensors, the timestep the engine's call takes: [rows], or [rows, tokens]); run on the ComfyUI side, on
    # what ComfyUI's model would read; a ValueError refuses the call in one line
    call_extras: Callable | None = None
    # tokens of the sequence besides the image's and the text's, split with the image's (the planner): (config, latent
    # frames) -> count (MiniMax-H3: both audio channels' frames)
    extra_tokens: Callable[[dict, int], int] = lambda config, latent_frames: 0
    # (variant, latent frames of the latent the model gets) -> frames of tokens (at the latent's rows and columns) the
    # forward runs besides the latent's, split with them (the planner; Wan-Animate 2: its pose branch, one frame fewer)
    extra_frames: Callable[[str, int], int] = lambda variant, latent_frames: 0
    extra_token_kind: str = "audio"   # what the planner calls the tokens extra_tokens / extra_frames count
    # variant -> latent frames the model's latent holds before the video's (the planner: WanAnimate2ToVideo puts the
    # reference image's latent frame first)
    reference_frames: Callable[[str], int] = lambda variant: 0
    # (flow, conditioning name, the tensor [rows, ...] as the ranks hold it for the session) -> {name: tensor [rows,
    # ...]} the family derives from it once (LTX-2.3: its text connectors' output from the context), or None: carried
    # with the calls that hold it (Prepared.held, sliced with its rows); a forward given none computes them itself.
    # Every rank of the job runs it for the same tensors at the same point (when a tensor is first held), so the
    # gathers of divided weights it makes stay matched
    hold: Callable | None = None
    # modules besides the blocks whose divided weights are units of their own (parallel/shard.py): gathered only while
    # they run, not with the root for the whole call (LTX-2.3's text connectors, MiniMax-H3's token refiner)
    shard_units: tuple[str, ...] = ()
    # the clips the fit tables price for an audio-video family (plan --av-table): (title, width, height, frames, steps,
    # negative pass) each
    fit_jobs: tuple = ()
    # the model forwards a call of `rows` rows makes (its `forward` runs them in one, or one a row: MiniMax-H3, whose
    # model takes a batch of one): ranks that gather divided weights in every forward must make as many
    forwards: Callable[[int], int] = lambda rows: 1
    # (config, latent frames) -> (queries, heads, head width) of the attention each block runs with queries every rank
    # holds whole over the split image tokens (TokenTable.local_keys; LTX-2.3's v2a: the audio over the video): the
    # planner prices the merge of its partial results; (0, 0, 0): none
    local_key_queries: Callable[[dict, int], tuple[int, int, int]] = lambda config, latent_frames: (0, 0, 0)
    text_cross: bool | None = None   # the text reached by cross-attention (None: as the diffusers config says, no
    #                                  joint_attention_dim); False: the text in the sequence

    # ---- words for `demo`, `make-tiny` and the nodes
    describe_blocks: Callable[[dict], str] = lambda config: ""
    describe_conditioning: Callable[[dict], str] = lambda config: ""
    # variant -> the text encoder its conditioning comes from, as a ComfyUI graph loads it (loader, type, file)
    text_encoder: Callable[[str], str] = lambda variant: "its text encoder"
    # variant -> the first ComfyUI release whose graphs sample it (its model class and text encoder); "": older than
    # any ComfyUI the pack runs in
    comfyui_since: Callable[[str], str] = lambda variant: ""
    # variant -> the comfy.supported_models class ComfyUI must detect the file as ("": any of the family's): an older
    # ComfyUI that takes the file for another model (Wan-Animate 2's as Wan 2.1 image-to-video, whose pose inputs it
    # has no node for) is told to update (comfyui_since)
    comfy_class: Callable[[str], str] = lambda variant: ""

    def variant_dims(self, variant: str, size: str = "tiny"):
        return self.dims[size][variant]

    def latent_format(self, config: dict) -> LatentFormat:
        """The latent format of a file with this config."""
        return self.latent_for(config) if self.latent_for is not None else self.latent


# ---- key maps from single-file layouts ---------------------------------------------------------------------------
def pad_text(cond: torch.Tensor, tokens: int) -> torch.Tensor:
    """cond [B, N, width] with zero tokens prepended up to `tokens` (never truncated), as a family's pad_text_to
    asks."""
    n = cond.shape[1]
    return torch.nn.functional.pad(cond, (0, 0, tokens - n, 0)) if n < tokens else cond


def linear(m: list, dst: str, src: str, op: Op = None, bias: bool = True) -> None:
    """A Linear's weight (and bias) from `src` to `dst`."""
    m.append((f"{dst}.weight", f"{src}.weight", op))
    if bias:
        m.append((f"{dst}.bias", f"{src}.bias", op))


def fused(m: list, dsts: tuple[str, ...], src: str, sizes: tuple[int, ...], bias: bool = True) -> None:
    """Linears whose rows are consecutive chunks of one fused Linear (e.g. q, k, v out of qkv)."""
    for i, dst in enumerate(dsts):
        linear(m, dst, src, ("chunk", i, sizes), bias)


def count(keys, pattern: str) -> int:
    """How many distinct indices the regex's group 1 takes over `keys` (blocks of a kind)."""
    rx = re.compile(pattern)
    return len({m.group(1) for k in keys if (m := rx.match(k))})


def linear_shapes(out: dict, name: str, n_out: int, n_in: int, bias: bool = True) -> None:
    """A Linear's tensors and shapes, for a family's `shapes` table."""
    out[f"{name}.weight"] = (n_out, n_in)
    if bias:
        out[f"{name}.bias"] = (n_out,)


# ---- latent packing: one definition ---------------------------------------------------------------------------------
def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """Latent [b, c, h, w] -> tokens [b, h/2 * w/2, c*4]: 2x2 patches, rows first, channels in (c, ph, pw) order (FLUX's
    and Qwen-Image's packing, the same in ComfyUI and diffusers)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """pack_2x2 undone: tokens [b, h/2 * w/2, c*4] -> latent [b, c, h, w]."""
    b = tokens.shape[0]
    return tokens.reshape(b, h // 2, w // 2, -1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, h, w)


def grid_ids(rows: int, cols: int, index: float, row0: float, col0: float, device) -> torch.Tensor:
    """Position ids (index, row0 + row, col0 + col) of a rows x cols token grid, rows first, float32 [rows*cols, 3]."""
    r = torch.arange(rows, device=device).repeat_interleave(cols) + row0
    c = torch.arange(cols, device=device).repeat(rows) + col0
    return torch.stack([torch.full_like(r, index), r, c], dim=1).to(torch.float32)


def tile_offsets(shapes) -> list[tuple[int, int]]:
    """(row, column) offsets in latent pixels of references tiled side by side as ComfyUI's "offset" method places
    them (FLUX.1 Kontext, Qwen-Image): each next to the ones before it, along the side that keeps the covered area
    squarer."""
    places, h, w = [], 0, 0
    for ref_h, ref_w in shapes:
        row, col = (0, w) if ref_h + h > ref_w + w else (h, 0)
        h, w = max(h, ref_h + row), max(w, ref_w + col)
        places.append((row, col))
    return places


@contextlib.contextmanager
def forward_hook(module: torch.nn.Module, hook, prepend: bool = False):
    """A forward hook on `module` for the duration of a with-block (prepend: before the hooks already there, e.g. so a
    family's own positions are in place before a parallel plan's hooks split them)."""
    handle = module.register_forward_hook(hook, prepend=prepend)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def pre_hook(module: torch.nn.Module, hook):
    """A forward pre-hook on `module` for the duration of a with-block (e.g. fp32 inputs for an embedding)."""
    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def rope_axes(head_dim: int, metadata: dict, known: dict[int, tuple], title: str) -> tuple:
    """The RoPE axes of a FLUX-style transformer with `head_dim`-wide heads: as the file states them, as the family
    knows them for that width (`known`), or as a tiny synthetic model records them; otherwise a CheckpointError."""
    stated = metadata.get("stated", {}).get("axes_dims_rope")
    if stated and sum(stated) == head_dim:
        return tuple(stated)
    if head_dim in known:
        return known[head_dim]
    synthetic = metadata.get("xdit.synthetic")
    if synthetic:  # the tiny test models carry their RoPE split; the released models have 128-wide heads
        return tuple(json.loads(synthetic)["dims"]["axes_dim"])
    raise CheckpointError(f"{title} transformer with {head_dim}-wide heads: its RoPE axes cannot be inferred "
                          f"({title} has 128-wide heads)")


JOB_STATE = "_xdit_job_state"   # what a family's forward keeps on the model for one job (Wan-Animate 2's pose cache)


def job_state(model: torch.nn.Module) -> dict:
    """The family's state for the current job, kept with the model (its tensors let go by end_of_job)."""
    return model.__dict__.setdefault(JOB_STATE, {})


def end_of_job(model: torch.nn.Module) -> None:
    """Let go what a family's forward kept for the job that ended (the device memory it holds)."""
    model.__dict__.pop(JOB_STATE, None)


PLACED_ENTRIES, PLACED_BYTES = 64, 256 * 2 ** 20   # what a model keeps placed: at most this many tensors, bytes


def placed(model: torch.nn.Module, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor a forward built on the host (from the call's host-side extras: indexes, positions, tags, condition
    rows) on `device`: copied there the first time these values are seen, then the copy kept with `model` is reused,
    so calls of one layout make no upload (the oldest copies are let go past PLACED_ENTRIES or PLACED_BYTES)."""
    cache = model.__dict__.setdefault("_xdit_placed", OrderedDict())
    data = t.detach().contiguous()
    digest = hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy(), digest_size=16).digest()
    key = (str(device), data.dtype, tuple(data.shape), digest)
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    on_device = cache[key] = data.to(device)
    total = sum(v.numel() * v.element_size() for v in cache.values())
    while len(cache) > PLACED_ENTRIES or (total > PLACED_BYTES and len(cache) > 1):
        _, old = cache.popitem(last=False)
        total -= old.numel() * old.element_size()
    return on_device
