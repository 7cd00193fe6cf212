"""The xDiT Engine's MODEL: a ComfyUI model that holds no weights in ComfyUI's process and whose diffusion model runs
on the engine's ranks. ComfyUI's own model class for the family (built by nodes.py from the file's header, as
ComfyUI's loader would detect it) prepares the conditioning, and ComfyUI's nodes patch and sample it as any MODEL;
only the diffusion model's call crosses to the engine (link.py, engine/generate/model_call.py), one session per
sampling run.

What a MODEL chain carries is honoured where it runs: model sampling (ModelSamplingAuraFlow / SD3 / Flux), CFG
functions (CFGNorm) and wrappers around the model call run in ComfyUI's process as with any model; LoRA weight patches
(ComfyUI's LoRA loaders) are handed to the ranks. A patch the ranks cannot run (attention or block patches, a
replaced diffusion model, LoRA kinds other than plain LoRA and weight differences, ControlNet) stops the job with one
line naming it, never a silent difference.

Also what the xDiT Sampler needs to run a MODEL chain in the engine's own loop (`loop_settings`), and the reasons it
cannot (then ComfyUI's sampler drives the MODEL instead, with the same result). Nothing here imports ComfyUI: its
classes come in as arguments.
"""
from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass

import torch

from ..engine.models.lora import WeightPatches

OWN_CALLBACK = "xdit_model"   # the key of the pack's own callbacks and wrappers on a MODEL
MODEL_SAMPLING = "model_sampling"   # the one object patch the engine's MODEL takes (ComfyUI's sampling nodes)
PER_CALL_OPTIONS = ("sampler_cfg_function", "sampler_pre_cfg_function", "model_function_wrapper",
                    "disable_cfg1_optimization", "sampler_calc_cond_batch_function", "denoise_mask_function")
DIFFUSION_MODEL_WRAPPERS = "diffusion_model"   # comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL


class ModelPatchError(ValueError):
    """A MODEL patch the engine's ranks cannot run: one line naming it and what to do."""


# ---- the stand-in for ComfyUI's diffusion model -------------------------------------------------------------------
class EngineTransformer(torch.nn.Module):
    """Stands where ComfyUI's model holds its diffusion model: no parameters, its forward a call on the engine. Its
    state dict lists ComfyUI's own parameter names and shapes as meta tensors (no memory), so ComfyUI's LoRA loaders
    map a LoRA's layers onto it exactly as onto the real model. What ComfyUI's model code reads of its diffusion model
    besides (e.g. Wan's patch_embedding.weight.shape, FLUX's patch_size) comes from `meta`, ComfyUI's own diffusion
    model built on the meta device, which is kept out of the module tree (nothing to load or patch)."""

    dtype = torch.float32   # ComfyUI hands the inputs over in float32; the ranks cast to their compute dtype

    def __init__(self, link, keys: dict[str, tuple[tuple, torch.dtype]], meta=None,
                 family=None):   # link: link.EngineLink; family: the file's engine Family
        super().__init__()
        self.link = link
        self._keys = dict(keys)
        self.__dict__["_meta"] = meta   # not a submodule: not in named_modules, parameters or state_dict
        self.__dict__["_family"] = family

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta")
            if meta is None or name.startswith("__"):
                raise
            return getattr(meta, name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, (shape, dtype) in self._keys.items():
            destination[prefix + key] = torch.empty(shape, dtype=dtype, device="meta")

    def forward(self, x, timestep, context=None, control=None, transformer_options=None, **kwargs):
        if isinstance(x, (list, tuple)):   # several latent streams (audio + video), unpacked by ComfyUI's model
            return self._packed_streams(list(x), timestep, context, control, transformer_options or {}, kwargs)
        return self.link.call(x, timestep, context, control, transformer_options or {}, kwargs)

    def preprocess_text_embeds(self, text_states, unprocessed=None):
        """MiniMax-H3's model refines the text once per sampling run through this, LTX-2.3's runs its two text
        connectors on it (unprocessed=True); the engine's model does so in each forward (the same arithmetic), so the
        text crosses as the encoder gave it. A text LTX-2.3's model takes as already connected (unprocessed=False:
        ComfyUI would not run the connectors) is refused: the ranks would run them again."""
        if unprocessed is False:
            raise ModelPatchError("the conditioning is not marked unprocessed_ltxav_embeds (its text connectors "
                                  "already ran): the xDiT engine runs LTX-2.3's connectors on its ranks; encode the "
                                  "prompt with the CLIP of LTXAVTextEncoderLoader")
        return text_states

    def _packed_streams(self, streams, timestep, context, control, transformer_options: dict, kwargs: dict):
        """An audio-video model's call (MiniMax-H3, LTX-2.3): the streams packed as ComfyUI's sampler packs them
        (comfy.utils.pack_latents), what its model reads of ComfyUI's inputs, options and timestep as the family's
        float64 tensors and the engine's timestep (Family.call_extras), and the engine's packed output unpacked into
        the streams again."""
        family = self.__dict__.get("_family")
        if family is None or family.call_extras is None:
            raise ModelPatchError("the MODEL got several latent streams, which this model's family does not take")
        meta = self.__dict__.get("_meta")
        shapes = [tuple(t.shape) for t in streams]
        kwargs = dict(kwargs)
        try:
            extras, timestep = family.call_extras(shapes, kwargs, transformer_options, timestep, meta)
        except ValueError as e:
            raise ModelPatchError(str(e)) from None
        packed = torch.cat([t.reshape(t.shape[0], 1, -1) for t in streams], dim=-1)
        out = self.link.call(packed, timestep, context, control, transformer_options, {**kwargs, **extras})
        parts, start = [], 0
        for shape in shapes:
            size = math.prod(shape[1:])
            parts.append(out[:, :, start:start + size].reshape(shape).to(streams[0].dtype))
            start += size
        return parts


# ---- a MODEL chain's patches ------------------------------------------------------------------------------------------
def check_chain(patcher) -> None:
    """Refuse what a MODEL chain carries that no route can run on the engine's ranks (ModelPatchError)."""
    extra = sorted(k for k in getattr(patcher, "object_patches", {}) if k != MODEL_SAMPLING)
    if extra:
        raise ModelPatchError(
            f"a node replaced the MODEL's {', '.join(extra)} (e.g. TorchCompileModel or a model-merge node): the xDiT "
            f"engine runs its own diffusion model on its ranks; remove that node (the xDiT Engine's compile input "
            f"compiles on the ranks)")
    if getattr(patcher, "hook_patches", None):
        raise ModelPatchError("the MODEL carries hook weight patches (CreateHookLora / SetModelHooksOnCond nodes), "
                              "which the xDiT engine does not apply: use LoraLoaderModelOnly instead")
    options = getattr(patcher, "model_options", {}) or {}
    if options.get("multigpu_clones"):
        raise ModelPatchError("the MODEL went through ComfyUI's MultiGPU CFG Split, which copies ComfyUI's diffusion "
                              "model to other GPUs; the xDiT engine already runs the positive and negative passes on "
                              "its own GPUs (plan auto, or cfg_parallel): remove that node")
    transformer = options.get("transformer_options", {}) or {}
    check_transformer_options(transformer)


def check_transformer_options(transformer: dict) -> None:
    """Attention and block patches and wrappers of the diffusion model act inside ComfyUI's diffusion model, which
    does not run here: refused, naming them."""
    for name in ("patches", "patches_replace"):
        kinds = sorted(k for k, v in (transformer.get(name) or {}).items() if v)
        if kinds:
            raise ModelPatchError(
                f"the MODEL carries {name} {', '.join(kinds)} (from a node that patches attention or transformer "
                f"blocks, e.g. IPAdapter, PuLID, a block-skip or attention node): those run inside ComfyUI's diffusion "
                f"model, which the xDiT engine replaces; remove that node")
    wrappers = {k for k, fns in ((transformer.get("wrappers") or {}).get(DIFFUSION_MODEL_WRAPPERS) or {}).items()
                if fns and k != OWN_CALLBACK}
    if wrappers:
        raise ModelPatchError(
            f"the MODEL carries a diffusion-model wrapper ({', '.join(sorted(wrappers))}) from a node that wraps "
            f"ComfyUI's diffusion model, which the xDiT engine replaces; remove that node")
    cache = transformer.get("animate2_cache")   # WanAnimate2Cache (comfy_extras/nodes_wan.py): its PoseBranchCache
    dtype = getattr(cache, "dtype", "default")
    if cache is not None and dtype != "default":
        raise ModelPatchError(
            f"the MODEL went through WanAnimate2Cache with dtype {dtype}, whose rounded pose activations the xDiT engine "
            f"does not reproduce (its ranks keep the pose branch exactly, with the same numbers as dtype default): set "
            f"the node's dtype to default, or remove the node")


_DIGESTS: dict[int, tuple[weakref.ref, str]] = {}


def _digest(t: torch.Tensor) -> str:
    """A content digest of a tensor, computed once while the tensor lives (a LoRA loader keeps its tensors)."""
    held = _DIGESTS.get(id(t))
    if held is not None and held[0]() is t:
        return held[1]
    if len(_DIGESTS) > 4096:
        for key in [k for k, (ref, _) in _DIGESTS.items() if ref() is None]:
            del _DIGESTS[key]
    data = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(f"{data.dtype}{list(data.shape)}".encode(), digest_size=16)
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    _DIGESTS[id(t)] = (weakref.ref(t), digest)
    return digest


def weight_patches(patcher) -> WeightPatches:
    """The MODEL's weight patches (ComfyUI's LoRA loaders) as the ranks take them; a patch of another kind is refused
    in one line naming it."""
    entries, tensors = [], {}
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(getattr(patcher, "patches", {}) or {}):
        for strength_patch, adapter, strength_model, offset, function in patcher.patches[key]:
            name = key[len("diffusion_model."):] if key.startswith("diffusion_model.") else key
            if function is not None or strength_model != 1.0:
                raise ModelPatchError(f"the MODEL patches {name} with a weight function or a base-weight strength "
                                      f"({strength_model:g}), which the xDiT engine does not apply (a model-merge "
                                      f"node?); remove that node")
            i = len(entries)
            entry = {"key": name, "offset": list(offset) if offset is not None else None}
            if getattr(adapter, "name", None) == "lora" and hasattr(adapter, "weights"):
                up, down, alpha, mid, dora, reshape = (tuple(adapter.weights) + (None,) * 6)[:6]
                if mid is not None or dora is not None or reshape is not None:
                    which = "LoCon mid weights" if mid is not None else "DoRA" if dora is not None else "a reshape"
                    raise ModelPatchError(f"the LoRA on {name} uses {which}, which the xDiT engine does not apply; use "
                                          f"a plain LoRA (lora_up/lora_down or lora_A/lora_B)")
                if up.ndim != 2 or down.ndim != 2:
                    raise ModelPatchError(f"the LoRA on {name} is not a linear LoRA (up {list(up.shape)}, down "
                                          f"{list(down.shape)}): the xDiT engine applies linear LoRAs")
                scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
                entry.update(kind="lora", scale=float(strength_patch) * scale)
                tensors[f"{i}.up"], tensors[f"{i}.down"] = up, down
                parts = (up, down)
            elif isinstance(adapter, tuple) and len(adapter) == 2 and adapter[0] == "diff":
                entry.update(kind="diff", scale=float(strength_patch))
                tensors[f"{i}.diff"] = adapter[1][0]
                parts = (adapter[1][0],)
            else:
                kind = getattr(adapter, "name", None) or (adapter[0] if isinstance(adapter, tuple) else
                                                          type(adapter).__name__)
                raise ModelPatchError(f"the MODEL patches {name} with a {kind!r} weight patch (LoHa, LoKr, OFT, GLoRA, "
                                      f"BOFT or a set/merge patch), which the xDiT engine does not apply; use a plain "
                                      f"LoRA")
            entries.append(entry)
            h.update(repr(sorted(entry.items())).encode())
            for t in parts:
                h.update(_digest(t).encode())
    return WeightPatches(h.hexdigest() if entries else "", tuple(entries), tensors)


@dataclass(frozen=True)
class SamplingClasses:
    """ComfyUI's model sampling classes (comfy.model_sampling), passed in by nodes.py."""
    flux: type
    discrete_flow: type
    const: type


def cfg_norm_strength(fn) -> float | None:
    """The strength of a post-CFG function that is ComfyUI's CFGNorm (post-CFG form) or the pack's own, else None."""
    ours = getattr(fn, "xdit_cfg_norm", None)
    if ours is not None:
        return float(ours)
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__qualname__", "").endswith("CFGNorm.execute.<locals>.cfg_norm") \
            or "strength" not in code.co_freevars:
        return None
    value = fn.__closure__[code.co_freevars.index("strength")].cell_contents
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def loop_settings(patcher, classes: SamplingClasses, family_sampling) -> tuple[dict | None, float, list[str]]:
    """What the engine's own loop needs from a MODEL chain: (model sampling as FlowSampling.as_dict(), CFGNorm strength,
    reasons it cannot run the chain exactly). `family_sampling` is the family's default FlowSampling (its timestep
    scale is the only one the loop runs). A reason means ComfyUI's sampler must drive the MODEL instead."""
    reasons = []
    sampling = None
    ms = patcher.get_model_object(MODEL_SAMPLING)
    if not isinstance(ms, classes.const):
        reasons.append(f"its model sampling {type(ms).__name__} is not a flow (CONST) sampling")
    elif isinstance(ms, classes.flux):
        sampling = {"kind": "flux", "shift": float(ms.shift), "multiplier": 1.0}
    elif isinstance(ms, classes.discrete_flow):
        sampling = {"kind": "discrete_flow", "shift": float(ms.shift), "multiplier": float(ms.multiplier)}
        if float(ms.multiplier) != family_sampling.timesteps_per_sigma:
            reasons.append(f"its model sampling gives timesteps of sigma x {float(ms.multiplier):g}")
    else:
        reasons.append(f"its model sampling {type(ms).__name__} is not one the engine's loop has")
    options = patcher.model_options or {}
    cfg_norm = 0.0
    for fn in options.get("sampler_post_cfg_function", []) or []:
        strength = cfg_norm_strength(fn)
        if strength is None or cfg_norm:
            reasons.append(f"it has a post-CFG function {getattr(fn, '__qualname__', fn)!r}")
        else:
            cfg_norm = strength
    reasons += [f"it sets {name}" for name in PER_CALL_OPTIONS if options.get(name)]
    wrappers = {t for t, keyed in (getattr(patcher, "wrappers", {}) or {}).items()
                for k, fns in keyed.items() if fns and k != OWN_CALLBACK}
    wrappers |= {t for t, keyed in ((options.get("transformer_options") or {}).get("wrappers") or {}).items()
                 for k, fns in keyed.items() if fns and k != OWN_CALLBACK}
    if wrappers:
        reasons.append(f"it has {', '.join(sorted(wrappers))} wrappers")
    return sampling, cfg_norm, reasons
