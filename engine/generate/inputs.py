"""A generate job's tensors and files checked against the model's family before any rank starts: the latent, each
side's conditioning, reference latents, LoRAs, and no NaN or inf anywhere. Every refusal is one ValueError naming the
input, the value and what the model takes."""
from __future__ import annotations

import math
import os

import torch

from .. import families, wording
from ..models.detect import CheckpointInfo
from ..models.load import build_empty
from ..models.lora import check_lora
from ..models.load import COMPUTE_DTYPES
from ..models.speed import ATTENTION
from ..parallel.plan import EXPERT_PLACEMENTS
from ..sampling.ksampler import reshape_mask
from ..sampling.samplers import SAMPLERS
from ..sampling.schedules import SCHEDULERS, FlowSampling

FINITE_CHUNK = 1 << 22      # elements checked for NaN/inf at a time (the check's own memory stays small)


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or inf, naming it and the first such value; read a block of at most
    FINITE_CHUNK elements at a time, so the check's own memory stays small whatever the tensor's size."""
    t = t.reshape(1) if t.ndim == 0 else t
    where = _first_nonfinite(t)
    if where is not None:
        raise ValueError(f"{name} holds {t[tuple(where)].item()} at index {where} (shape {list(t.shape)}): give "
                         f"finite values (check the node or encoder that made it)")


def _first_nonfinite(t: torch.Tensor) -> list[int] | None:
    if t.numel() == 0:
        return None
    per_row = t.numel() // t.shape[0]
    if per_row > FINITE_CHUNK:   # rows too large to check whole: one row at a time, recursively
        for i in range(t.shape[0]):
            inner = _first_nonfinite(t[i])
            if inner is not None:
                return [i] + inner
        return None
    step = max(1, FINITE_CHUNK // per_row)
    for start in range(0, t.shape[0], step):
        bad = ~torch.isfinite(t[start:start + step])
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            return [where[0] + start] + where[1:]
    return None


def _px(info: CheckpointInfo, latent_h: int, latent_w: int) -> str:
    d = info.latent.downscale
    return f"{latent_w * d}x{latent_h * d} px"


def fix_empty_latent(info: CheckpointInfo, samples, downscale_ratio: int | None = None):
    """A LATENT's samples as ComfyUI's KSampler hands them to this family's model (comfy.sample.fix_empty_latent_channels):
    an all-zero latent of another channel count (EmptyLatentImage's 4) widened to the family's channels, and resized
    to the family's pixels per latent pixel when the LATENT says it was made for another (`downscale_ratio_spacial`,
    which EmptyLatentImage / EmptySD3LatentImage set to 8: a FLUX.2 latent is 1/16); an image latent [B, C, H, W]
    made one frame [B, C, 1, H, W] for a video latent format. Anything else is left for check_latent to judge."""
    if not isinstance(samples, torch.Tensor) or samples.ndim not in (4, 5):
        return samples
    fmt = info.latent
    if not torch.count_nonzero(samples):   # zeros tiled to the channels and resized (nearest-exact): zeros
        shape = list(samples.shape)
        shape[1] = fmt.channels
        if downscale_ratio and downscale_ratio != fmt.downscale:
            shape[-2:] = [round(n * downscale_ratio / fmt.downscale) for n in shape[-2:]]
        if shape != list(samples.shape):
            samples = samples.new_zeros(shape)
    if fmt.spatial_dims == 3 and samples.ndim == 4:
        samples = samples.unsqueeze(2)
    return samples


def check_latent(info: CheckpointInfo, lat) -> tuple[int, int]:
    """The LATENT's samples as the family takes them ([B, C, H, W], or [B, C, 1, H, W] for a video format, [B, C, F,
    H, W] for a family that takes frames); returns the latent's (height, width)."""
    fmt, frames = info.latent, info.spec.frames
    if not isinstance(lat, torch.Tensor) or lat.ndim != fmt.ndim or lat.shape[1] != fmt.channels \
            or not lat.is_floating_point() or (fmt.spatial_dims == 3 and not frames and lat.shape[2] != 1) \
            or (frames and lat.shape[2] < 1):
        shape = list(lat.shape) if isinstance(lat, torch.Tensor) else type(lat).__name__
        one = "one frame: " if fmt.spatial_dims == 3 and not frames else ""
        raise ValueError(f"latent of shape {shape} is invalid: {info.variant} takes {fmt.shape_rule(frames)} floats "
                         f"({one}the empty-latent node of its workflows)")
    if lat.shape[0] < 1:
        raise ValueError("latent has an empty batch: give at least one image")
    h, w = lat.shape[-2], lat.shape[-1]
    p = info.latent_patch
    step = p * fmt.downscale
    if h < 1 or w < 1 or (not info.spec.pads_to_patches and (h % p or w % p or h < p or w < p)):
        raise ValueError(f"latent {_px(info, h, w)} is invalid: {info.variant} needs width and height that are "
                         f"positive multiples of {step} px")
    side = info.spec.max_latent_side(info.config)
    if side and max(h, w) > side:
        limit = side * fmt.downscale
        raise ValueError(f"latent {_px(info, h, w)} is too large for {info.variant}: its position grid allows up to "
                         f"{limit}x{limit} px")
    return h, w


def check_side(name: str, cond, pooled, info: CheckpointInfo, batch: int) -> None:
    """One side's conditioning: cond [B|1, N, width] and, where the family has one, pooled [B|1, D]. Conditioning
    of another width is another model's text encoder's: the refusal names the one this model takes."""
    family, v = info.spec, info.variant
    width, pooled_dim = family.cond_width(info.config), family.pooled_width(info.config)
    pooled_name = name.replace("cond", "pooled")
    shown, shown_pooled = wording.say(name), wording.say(pooled_name)   # "cond", or the node's input
    rows = "1" if batch == 1 else f"1 or {batch}"
    encoder = f"{v}'s text encoder, {family.text_encoder(v)}"
    for t, what in ((cond, name), (pooled, pooled_name)):
        if (t is not None or what == name) and (not isinstance(t, torch.Tensor) or not t.is_floating_point()):
            raise ValueError(f"{wording.say(what)} is "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}: give a "
                             f"floating-point tensor")
    if cond.ndim == 3 and cond.shape[2] != width:
        given = f" and a pooled output {list(pooled.shape)}" if pooled is not None else ""
        wanted = f"a pooled output [batch, {pooled_dim}]" if pooled_dim else "no pooled output"
        raise ValueError(f"{shown} of shape {list(cond.shape)}{given} is another model's conditioning: {v} takes "
                         f"[batch, tokens, {width}] and {wanted}; encode the prompt with {encoder}")
    if pooled_dim is None and pooled is not None:
        raise ValueError(f"{shown_pooled} is given but {v} takes no pooled conditioning: leave it out")
    if pooled_dim is not None and pooled is None:
        raise ValueError(f"{shown_pooled} is missing: {v} takes a pooled conditioning [batch, {pooled_dim}] "
                         f"(the pooled output of {encoder})")
    if cond.ndim != 3 or cond.shape[1] < 1:
        raise ValueError(f"{shown} of shape {list(cond.shape)} is invalid: {v} takes [batch, tokens, {width}]")
    if pooled is not None and (pooled.ndim != 2 or pooled.shape[1] != pooled_dim):
        other = "; it is another model's: encode the prompt with " + encoder if pooled.ndim == 2 else ""
        raise ValueError(f"{shown_pooled} of shape {list(pooled.shape)} is invalid: {v} takes [batch, {pooled_dim}]"
                         f"{other}")
    for t, what in ((cond, name), (pooled, pooled_name)):
        if t is not None and t.shape[0] not in (1, batch):
            raise ValueError(f"{wording.say(what)} has batch {t.shape[0]} but the latent has {batch}: give "
                             f"{wording.say(what)} a batch of {rows}")


def check_references(name: str, refs, method: str, info: CheckpointInfo, batch: int) -> None:
    """Reference latents (ReferenceLatent) of one side, where the family takes them."""
    if refs is None:
        return
    family, fmt = info.spec, info.latent
    rows = "1" if batch == 1 else f"1 or {batch}"
    rule = fmt.shape_rule().replace("[B,", f"[{rows},").replace("H/", "h/").replace("W/", "w/")
    if not isinstance(refs, (list, tuple)):
        raise ValueError(f"{name} is a {type(refs).__name__}: give a list of latents {rule} (what ReferenceLatent puts "
                         f"in the conditioning)")
    if refs and not family.reference_methods:
        raise ValueError(f"{name} holds {len(refs)} reference latent(s) but {info.variant} takes none: remove the "
                         f"ReferenceLatent node or use a model that takes reference images")
    if refs and method and method not in family.reference_methods:
        raise ValueError(f"{name}_method={method!r} is invalid for {info.variant}: use one of "
                         f"{', '.join(family.reference_methods)}")
    p = info.latent_patch
    for i, r in enumerate(refs):
        what = f"{name}[{i}]"
        if not isinstance(r, torch.Tensor) or not r.is_floating_point():
            kind = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"{what} is {kind}: give a floating-point latent {rule} (VAEEncode)")
        small = 1 if family.pads_to_patches else p
        if r.ndim != fmt.ndim or r.shape[1] != fmt.channels or r.shape[0] not in (1, batch) \
                or (fmt.spatial_dims == 3 and r.shape[2] != 1) or r.shape[-2] < small or r.shape[-1] < small:
            raise ValueError(f"{what} of shape {list(r.shape)} is invalid: {info.variant} takes {rule} (VAEEncode's "
                             f"latent: one image, or one per image of the batch)")
        if not family.pads_to_patches and (r.shape[-2] % p or r.shape[-1] % p):
            raise ValueError(f"{what} of shape {list(r.shape)} is invalid: its image is {_px(info, *r.shape[-2:])}; "
                             f"{info.variant} takes references whose sides are multiples of "
                             f"{p * fmt.downscale} px (FluxKontextImageScale gives such sizes)")


def check_loras(model: str, loras, info: CheckpointInfo) -> None:
    """Every LoRA file exists and lands on this model's layers, its factors fitting them (names and shapes, from its
    header): refused before any rank starts."""
    if model.startswith("synthetic:"):
        raise ValueError(f"LoRAs need a model file; {model} has random weights")
    shapes = {k: tuple(v.shape) for k, v in build_empty(info).state_dict().items()}   # meta: no memory
    for path, strength in loras:
        if not os.path.isfile(path):
            raise ValueError(f"LoRA file {path!r} does not exist")
        check_lora(path, info, set(shapes), shapes)


def check_frames(info: CheckpointInfo, frames: int) -> None:
    """A video's frame count (as ComfyUI's video nodes count them: length) for this model: 1 for a model of still
    images; for a family that takes frames, one its latent format makes whole latent frames of (4k + 1 for Wan)."""
    fmt = info.latent
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"{frames!r} frames is invalid: give a count >= 1")
    if not info.spec.frames:
        if frames != 1:
            raise ValueError(f"{frames} frames: {info.variant} makes still images; leave out the frame count (1)")
        return
    near = fmt.nearest_frames(frames)
    if near:
        below, above = near
        use = f"{below} or {above}" if below >= 1 else f"{above}"
        raise ValueError(f"{frames} frames is not a count ComfyUI's video nodes make for {info.variant}: its "
                         f"{fmt.name} latent holds {fmt.frames_rule()}: use {use}")


def check_dtype(info: CheckpointInfo, dtype: str) -> None:
    """A compute dtype ComfyUI runs this model in: fp16 is refused for the families ComfyUI never runs in it (where
    activations pass float16's range a job gives NaNs, not an error)."""
    spec = info.spec
    if dtype not in spec.compute_dtypes:
        raise ValueError(f"dtype {dtype}: ComfyUI never runs {info.variant} in {dtype} (its dtypes are "
                         f"{' and '.join(spec.compute_dtypes)}, {spec.compute_dtypes_cite}): use bf16 on GPUs or fp32")


def check_image_inputs(prefix: str, clip, image, mask, info: CheckpointInfo, latent: torch.Tensor) -> None:
    """One side's image-to-video conditioning (ComfyUI's CONDITIONING keys clip_vision_output's features,
    concat_latent_image, concat_mask), where the model takes it: what it needs is required and shaped as it takes it.
    A model that takes none ignores them, as ComfyUI's does."""
    family, config = info.spec, info.config
    batch, rows = latent.shape[0], "1" if latent.shape[0] == 1 else f"1 or {latent.shape[0]}"
    width = family.image_context_width(config)
    if width:
        name = prefix + "clip_vision_output"
        limit = config.get("pos_embed_seq_len")
        if clip is None and not family.image_inputs_optional:
            raise ValueError(f"{name} is missing: {info.variant} is an image-to-video model and takes CLIP-vision "
                             f"features [{rows}, 257, {width}] (CLIPVisionEncode into WanImageToVideo)")
        if clip is not None and (not isinstance(clip, torch.Tensor) or not clip.is_floating_point() or clip.ndim != 3
                                 or clip.shape[2] != width or clip.shape[0] not in (1, batch)
                                 or not 1 <= clip.shape[1] <= (limit or 4096)):
            tokens = "257 or 514" if limit else "257" if family.clip_vision_state.startswith("penultimate") else "T"
            raise ValueError(f"{name} of shape {_shape(clip)} is invalid: {info.variant} takes [{rows}, {tokens}, "
                             f"{width}] floats (CLIPVisionEncode's {family.clip_vision_state.replace('_', ' ')})")
    extra = family.concat_channels(config)
    if not extra:
        return
    fmt = info.latent
    grid = tuple(latent.shape[2:])
    name = prefix + "concat_latent_image"
    if image is None and family.image_inputs_optional:   # its text-to-video: ComfyUI's zeros (a mask alone counts)
        image = torch.zeros(()).expand(latent.shape[0], fmt.channels, *grid)
    if image is None:
        raise ValueError(f"{name} is missing: {info.variant} is an image-to-video model and takes the image's latent "
                         f"[{rows}, {fmt.channels}, {', '.join(map(str, grid))}] (WanImageToVideo's or "
                         f"WanFirstLastFrameToVideo's conditioning)")
    if not isinstance(image, torch.Tensor) or not image.is_floating_point() or image.ndim != latent.ndim \
            or image.shape[1] != fmt.channels or tuple(image.shape[2:]) != grid or image.shape[0] not in (1, batch):
        raise ValueError(f"{name} of shape {_shape(image)} is invalid: for this latent {info.variant} takes "
                         f"[{rows}, {fmt.channels}, {', '.join(map(str, grid))}] floats (the VAE latent of the "
                         f"video's frames, as WanImageToVideo encodes them at the latent's size)")
    name = prefix + "concat_mask"
    if mask is not None and (not isinstance(mask, torch.Tensor) or not mask.is_floating_point()
                             or mask.ndim != latent.ndim or mask.shape[1] not in (1, extra - fmt.channels)
                             or not 1 <= mask.shape[2] <= grid[0] or tuple(mask.shape[3:]) != grid[1:]
                             or mask.shape[0] not in (1, batch)):
        raise ValueError(f"{name} of shape {_shape(mask)} is invalid: for this latent {info.variant} takes "
                         f"[{rows}, 1 or {extra - fmt.channels}, at most {grid[0]}, {grid[1]}, {grid[2]}] floats "
                         f"(0 where the image is known)")


def check_pose_inputs(request, info: CheckpointInfo) -> None:
    """Wan-Animate 2's pose branch (WanAnimate2ToVideo's keys, as the request's pose_* fields): only a file that is
    Animate 2 by its header takes them, each shaped as its model takes it (comfy/model_base.py WAN_Animate2)."""
    given = [n for n in ("pose_latent", "pose_cond", "pose_clip_vision_output") if getattr(request, n) is not None] \
        + [n for n in ("pose_strength", "reference_strength") if getattr(request, n) != 1.0]
    if not given:
        return
    if not info.spec.extra_frames(info.variant, 2):   # the families' one model with a pose branch
        raise ValueError(f"{', '.join(given)}: Wan-Animate 2's pose inputs (WanAnimate2ToVideo), which {info.variant} "
                         f"does not take: load a Wan-Animate 2 file (its header's model_type animate2)")
    batch = request.latent_raw.shape[0]
    rows = "1" if batch == 1 else f"1 or {batch}"
    fmt, grid = info.latent, tuple(request.latent_raw.shape[2:])
    want = (fmt.channels, grid[0] - 1) + grid[1:]
    pose = request.pose_latent
    if pose is not None and (not isinstance(pose, torch.Tensor) or not pose.is_floating_point() or pose.ndim != 5
                             or tuple(pose.shape[1:]) != want or pose.shape[0] not in (1, batch)):
        raise ValueError(f"pose_latent of shape {_shape(pose)} is invalid: for this latent (the reference image's "
                         f"frame and {grid[0] - 1} more) {info.variant} takes [{rows}, {', '.join(map(str, want))}] "
                         f"floats (WanAnimate2ToVideo's pose video latent, one frame fewer than the latent)")
    if pose is not None and request.cache_threshold:
        raise ValueError(f"cache_threshold={request.cache_threshold}: the step cache does not combine with Wan-Animate "
                         f"2's pose branch (the engine keeps the pose branch's keys and values across the steps "
                         f"instead): set cache_threshold 0")
    if pose is None and (request.pose_cond is not None or request.pose_clip_vision_output is not None
                         or request.pose_strength != 1.0):
        raise ValueError("pose_cond, pose_clip_vision_output and pose_strength need pose_latent (the pose video's "
                         "latent): connect a pose video to WanAnimate2ToVideo")
    width = info.spec.cond_width(info.config)
    cond = request.pose_cond
    if cond is not None and (not isinstance(cond, torch.Tensor) or not cond.is_floating_point() or cond.ndim != 3
                             or cond.shape[2] != width or cond.shape[0] not in (1, batch)):
        raise ValueError(f"pose_cond of shape {_shape(cond)} is invalid: {info.variant} takes [{rows}, N, {width}] "
                         f"floats (the pose prompt's CONDITIONING)")
    clip, width = request.pose_clip_vision_output, info.spec.image_context_width(info.config)
    if clip is not None and (not isinstance(clip, torch.Tensor) or not clip.is_floating_point() or clip.ndim != 3
                             or clip.shape[2] != width or clip.shape[0] not in (1, batch)):
        raise ValueError(f"pose_clip_vision_output of shape {_shape(clip)} is invalid: {info.variant} takes "
                         f"[{rows}, 257, {width}] floats (CLIPVisionEncode of the pose video's frame)")


def check_byt5(name: str, rows_in, info: CheckpointInfo, batch: int) -> None:
    """One side's byT5 rows (HunyuanVideo 1.5's conditioning_byt5small): only a model that takes them, shaped as it
    takes them."""
    if rows_in is None:
        return
    if "txt_byt5" not in info.spec.extras:
        raise ValueError(f"{name}: byT5 rows (a HunyuanVideo 1.5 prompt's quoted text), which {info.variant} does not "
                         f"take: encode the prompt with this model's text encoder")
    width = info.config["text_embed_2_dim"]
    if not isinstance(rows_in, torch.Tensor) or not rows_in.is_floating_point() or rows_in.ndim != 3 \
            or rows_in.shape[2] != width or rows_in.shape[0] not in (1, batch):
        rows = "1" if batch == 1 else f"1 or {batch}"
        raise ValueError(f"{name} of shape {_shape(rows_in)} is invalid: {info.variant} takes [{rows}, N, {width}] "
                         f"floats (the byT5 encoder's rows of the prompt's quoted text)")


def check_noise_mask(mask, latent: torch.Tensor) -> None:
    """The LATENT's noise_mask: floats that ComfyUI's reshape_mask fits to the latent (any size, interpolated)."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or not 2 <= mask.ndim <= latent.ndim \
            or mask.numel() == 0:
        raise ValueError(f"noise_mask of shape {_shape(mask)} is invalid: give floats [B|1, 1, ...] over the "
                         f"latent's frames, rows and columns (SetLatentNoiseMask, Wan22ImageToVideoLatent)")
    try:
        reshape_mask(mask, tuple(latent.shape))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"noise_mask of shape {list(mask.shape)} does not fit the latent {list(latent.shape)} "
                         f"({' '.join(str(e).split())[:120]}): give one channel, or the latent's") from None


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


SEED_LIMIT = 2 ** 64        # ComfyUI's seed widget: 0 .. 2**64 - 1
REFERENCE_METHODS = tuple(dict.fromkeys(m for f in families.FAMILIES for m in f.reference_methods))


def check_scalars(request) -> None:
    """A GenerateRequest's checks that need neither a file nor a tensor (the ranks run them too), each naming the
    field, the value and what works."""
    if isinstance(request.seed, bool) or not isinstance(request.seed, int) or not 0 <= request.seed < SEED_LIMIT:
        raise ValueError(f"seed={request.seed!r} is invalid: use an integer in [0, 2**64)")
    if isinstance(request.steps, bool) or not isinstance(request.steps, int) or not 1 <= request.steps <= 10000:
        raise ValueError(f"steps={request.steps!r} is invalid: use an integer from 1 to 10000")
    for name, low in (("cfg", 0.0), ("guidance", None), ("denoise", 0.0), ("pose_strength", None),
                      ("reference_strength", None)):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} is invalid: use a finite number")
    if not request.cfg > 0:
        raise ValueError(f"cfg={request.cfg} is invalid: use a value > 0 (1.0 for FLUX.1-dev/schnell)")
    if not 0 < request.denoise <= 1:
        raise ValueError(f"denoise={request.denoise} is invalid: use a value in (0, 1]")
    for name, valid in (("dtype", COMPUTE_DTYPES), ("sampler", SAMPLERS), ("scheduler", SCHEDULERS),
                        ("attention", ATTENTION), ("reference_latents_method", REFERENCE_METHODS),
                        ("neg_reference_latents_method", REFERENCE_METHODS)):
        if not isinstance(getattr(request, name), str):
            raise ValueError(f"{name}={getattr(request, name)!r} is invalid: use one of {', '.join(valid)}")
    if request.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={request.dtype!r} is invalid: use one of {sorted(COMPUTE_DTYPES)}")
    if request.sampler not in SAMPLERS:
        raise ValueError(f"sampler={request.sampler!r} is not supported: use one of {list(SAMPLERS)}")
    if request.scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={request.scheduler!r} is not supported: use one of {list(SCHEDULERS)}")
    if isinstance(request.cache_threshold, bool) or not isinstance(request.cache_threshold, (int, float)) \
            or not 0 <= request.cache_threshold <= 1:
        raise ValueError(f"cache_threshold={request.cache_threshold!r} is invalid: use a number in [0, 1] (0 is off; "
                         f"0.05 to 0.2 skip useful numbers of steps)")
    for name in ("compile", "fp8_matmul", "fp8_weights"):
        if not isinstance(getattr(request, name), bool):
            raise ValueError(f"{name}={getattr(request, name)!r} is invalid: use true or false")
    if request.fp8_matmul and not request.fp8_weights:
        raise ValueError("fp8_matmul=True needs fp8 weights: set fp8_weights (weight dtype fp8_e4m3fn)")
    for name in ("patches", "warmup_steps"):
        value = getattr(request, name)
        if (value is not None or name == "warmup_steps") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1")
    if request.stage_blocks is not None and (
            not isinstance(request.stage_blocks, (list, tuple)) or not request.stage_blocks
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in request.stage_blocks)):
        raise ValueError(f"stage_blocks={request.stage_blocks!r} is invalid: use one block count >= 1 per stage")
    for name in ("reference_latents_method", "neg_reference_latents_method"):
        if getattr(request, name) not in REFERENCE_METHODS + ("",):
            raise ValueError(f"{name}={getattr(request, name)!r} is invalid: use one of "
                             f"{', '.join(REFERENCE_METHODS)}")
    if request.attention not in ATTENTION:
        raise ValueError(f"attention={request.attention!r} is invalid: use one of {', '.join(ATTENTION)}")
    if request.experts is not None and (isinstance(request.experts, bool) or not isinstance(request.experts, int)
                                     or not 1 <= request.experts <= 4):
        raise ValueError(f"experts={request.experts!r} is invalid: use the clip's transformer count, 1 to 4, or none "
                         f"(the variant's)")
    if request.expert_placement not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert_placement={request.expert_placement!r} is invalid: use one of "
                         f"{', '.join(EXPERT_PLACEMENTS)}")
    if not isinstance(request.loras, (list, tuple)) or any(
            not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[0], str) or not e[0]
            or isinstance(e[1], bool) or not isinstance(e[1], (int, float)) or not math.isfinite(e[1])
            for e in request.loras):
        raise ValueError(f"loras={request.loras!r} is invalid: use a list of (path, strength) pairs with finite "
                         f"strengths")
    if request.batch_index is not None and (
            not isinstance(request.batch_index, (list, tuple))
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < SEED_LIMIT
                   for i in request.batch_index)):
        raise ValueError(f"batch_index={request.batch_index!r} is invalid: use a list of non-negative integers")
    if request.model_sampling is not None:
        FlowSampling.from_dict(request.model_sampling)   # ValueError naming what is wrong
    for name in ("start_step", "last_step"):
        value = getattr(request, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10000):
            raise ValueError(f"{name}={value!r} is invalid: use a step from 0 to 10000, or none")
    for name in ("force_full_denoise", "add_noise"):
        if not isinstance(getattr(request, name), bool):
            raise ValueError(f"{name}={getattr(request, name)!r} is invalid: use true or false")
    if isinstance(request.cfg_norm, bool) or not isinstance(request.cfg_norm, (int, float)) \
            or not math.isfinite(request.cfg_norm) or not 0 <= request.cfg_norm <= 100:
        raise ValueError(f"cfg_norm={request.cfg_norm!r} is invalid: use a CFGNorm strength from 0 (off) to 100")
