"""LoRA files users have for the engine's families, applied inside the ranks as weight deltas.

Formats: kohya (`lora_unet_double_blocks_0_img_attn_qkv.lora_down/lora_up/alpha`), BFL/ComfyUI
(`diffusion_model.double_blocks.0.img_attn.qkv.lora_A/lora_B`), and diffusers/PEFT
(`transformer.transformer_blocks.0.attn.to_q.lora_A/lora_B`). A delta named in the checkpoint's own layout goes
through the same key map as the weights, so a fused qkv delta splits into to_q/to_k/to_v exactly as the weight
did. Removing a LoRA reads the touched weights back from the checkpoint: no second copy of the model is kept.
Layers held quantized (GGUF blocks, fp8_scaled) are never written: they keep the LoRA's factors and add
s * up @ down * alpha / rank to their dequantized weight per call, and removing it drops the factors.

ComfyUI's own LoRA loaders on the engine's MODEL hand over their weight patches instead of a file (`WeightPatches`):
LoRA factors or full differences keyed by ComfyUI's parameter names, which are the family's native layout (ComfyUI's
model definition), routed through that layout's key map like a LoRA file named in it.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from safetensors import safe_open

from .convert import apply_op, key_map
from .detect import CheckpointInfo
from .load import lora_owner, restore_weights
from .sharded import held_rows, local
from .safetensors_file import CheckpointError, read_header

PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "lora_unet_",
            "lora_transformer_", "unet.")
PAIRS = ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight"))


def _strip(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


class LoraTargets:
    """Where a LoRA layer name lands in the diffusers model: directly (diffusers names) or through the key map."""

    def __init__(self, info: CheckpointInfo, diffusers_keys: set[str]):
        mapping = key_map(info) or []
        self.routes: dict[str, list] = {}  # source weight key -> [(diffusers key, op)]
        for dst, src, op in mapping:
            if src.endswith(".weight"):
                self.routes.setdefault(src, []).append((dst, op))
        for key in diffusers_keys:
            if key.endswith(".weight"):
                self.routes.setdefault(key, [(key, None)])
        # kohya flattens module paths with underscores
        self.underscored = {k[:-len(".weight")].replace(".", "_"): k for k in self.routes}

    def resolve(self, layer: str) -> str | None:
        name = _strip(layer)
        if name + ".weight" in self.routes:
            return name + ".weight"
        return self.underscored.get(name)


def lora_layers(path: str) -> dict[str, tuple[str, str, str | None]]:
    """{layer name: (down key, up key, alpha key or None)} from a LoRA file's header."""
    tensors, _ = read_header(path)
    layers = {}
    for key in tensors:
        for down_suffix, up_suffix in PAIRS:
            if key.endswith(down_suffix):
                layer = key[:-len(down_suffix)]
                up = layer + up_suffix
                if up not in tensors:
                    raise CheckpointError(f"LoRA {os.path.basename(path)}: {key} has no matching {up}")
                alpha = layer + ".alpha" if layer + ".alpha" in tensors else None
                layers[layer] = (key, up, alpha)
    if not layers:
        raise CheckpointError(f"{os.path.basename(path)} holds no LoRA layers (no lora_down/lora_up or lora_A/lora_B "
                              f"pairs): is it a LoRA file?")
    return layers


def check_lora(path: str, info: CheckpointInfo, diffusers_keys: set[str], shapes: dict | None = None) -> int:
    """Header-only check that every layer of the LoRA lands on this model (and, given the model's parameter `shapes`,
    that its factors fit that layer: [rank, in] and [out, rank]); returns the layer count."""
    targets = LoraTargets(info, diffusers_keys)
    layers = lora_layers(path)
    unknown = [layer for layer in layers if targets.resolve(layer) is None]
    if unknown:
        raise CheckpointError(f"LoRA {os.path.basename(path)}: {len(unknown)} of its {len(layers)} layers match no "
                              f"layer of this {info.variant} model (e.g. {', '.join(sorted(unknown)[:3])}); is it a "
                              f"LoRA for another model family?")
    tensors = read_header(path)[0] if shapes else {}
    for layer, (down_key, up_key, _) in layers.items() if shapes else ():
        dst, op = targets.routes[targets.resolve(layer)][0]
        weight = shapes.get(dst, ())
        if len(weight) != 2:
            continue   # not a linear layer's weight: lora_factors names it when the ranks read the factors
        rows = sum(op[2]) if isinstance(op, tuple) else weight[0]   # a fused layer's rows (qkv) before the split
        down, up = tensors[down_key].shape, tensors[up_key].shape
        if len(down) != 2 or len(up) != 2 or up[1] != down[0] or (up[0], down[1]) != (rows, weight[1]):
            raise CheckpointError(f"LoRA {os.path.basename(path)}: layer {layer} has down {list(down)} and up "
                                  f"{list(up)}, but this {info.variant} model's layer takes [rank, {weight[1]}] and "
                                  f"[{rows}, rank]; is it a LoRA for another size of model?")
    return len(layers)


@torch.no_grad()
def lora_factors(path: str, info: CheckpointInfo, diffusers_keys: set[str]) -> dict[str, list[tuple]]:
    """{diffusers parameter: [(up, down, alpha / rank, op)]}: the factors of the source layer and the op (key map)
    that takes the diffusers parameter's rows out of up @ down."""
    targets = LoraTargets(info, diffusers_keys)
    factors: dict[str, list[tuple]] = {}
    name = os.path.basename(path)
    layers = lora_layers(path)   # the header checked first: safetensors' reader then opens a sound file
    try:
        f = safe_open(path, "pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"LoRA {name}: safetensors cannot open it ({type(e).__name__}: {e})") from None
    with f:
        for layer, (down_key, up_key, alpha_key) in layers.items():
            source = targets.resolve(layer)
            if source is None:
                raise CheckpointError(f"LoRA {name}: layer {layer} matches no layer of this model")
            down, up = f.get_tensor(down_key).float(), f.get_tensor(up_key).float()
            if down.ndim != 2 or up.ndim != 2 or down.shape[0] < 1 or up.shape[1] != down.shape[0]:
                raise CheckpointError(f"LoRA {name}: layer {layer} is not a linear LoRA: down {list(down.shape)} "
                                      f"and up {list(up.shape)} must be [rank, in] and [out, rank], rank >= 1")
            rank = down.shape[0]
            scale = 1.0
            if alpha_key:
                alpha = f.get_tensor(alpha_key).float()
                if alpha.numel() != 1 or not torch.isfinite(alpha).all():
                    raise CheckpointError(f"LoRA {name}: {alpha_key} must be one finite number, it has shape "
                                          f"{list(alpha.shape)}" + (f" and value {alpha.item()}" if alpha.numel() == 1
                                                                    else ""))
                scale = float(alpha.item()) / rank
            for dst, op in targets.routes[source]:
                try:
                    apply_op(up, op)
                except ValueError as e:   # a fused layer whose rows do not split as the model's do
                    raise CheckpointError(f"LoRA {name}: layer {layer} has up {list(up.shape)}, which does not give "
                                          f"{dst}: {e}") from None
                factors.setdefault(dst, []).append((up, down, scale, op))
    return factors


@dataclasses.dataclass(frozen=True)
class WeightPatches:
    """Weight patches of a ComfyUI MODEL, as the ranks take them: `entries` [{"key": ComfyUI parameter name (no
    "diffusion_model." prefix), "kind": "lora" | "diff", "scale": strength x alpha / rank (lora) or strength (diff),
    "offset": None or [dim, start, length] (the rows of a fused parameter the patch covers)}], each with its tensors
    in `tensors` ("<i>.up", "<i>.down" or "<i>.diff"); `digest` identifies the set (the same patches cost nothing
    the second time)."""
    digest: str
    entries: tuple
    tensors: dict

    @classmethod
    def none(cls) -> "WeightPatches":
        return cls("", (), {})

    def to_job(self, held: "HeldPatches | None" = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """(document, tensors) for a job. held: the client's record of the sets the ranks keep (HeldPatches): a set
        they keep already crosses as its digest alone (a Wan 2.2 distillation LoRA is sent once, not at every expert
        switch)."""
        spec = {"digest": self.digest, "entries": list(self.entries)}
        if held is not None and self.entries and held.holds(self.digest):
            return dict(spec, held=True), {}
        return spec, {f"patch.{k}": v for k, v in self.tensors.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @classmethod
    def from_job(cls, spec: dict, inputs: dict[str, torch.Tensor], cache: dict | None = None) -> "WeightPatches":
        """The patches of a job; cache: the rank's own (its jobs' `cache`), where it keeps the sets it received, as
        HeldPatches on the client records them, and finds a set that came as its digest alone."""
        if not isinstance(spec, dict) or not isinstance(spec.get("entries"), list):
            raise ValueError(f"weight patches {spec!r} are malformed: give {{'digest': ..., 'entries': [...]}}")
        kept = HeldPatches.on_rank(cache) if cache is not None else None
        if spec.get("held"):
            found = kept.take(str(spec.get("digest", ""))) if kept is not None else None
            if found is None:
                raise ValueError(f"weight patches {spec.get('digest')!r} were sent as held, but this rank does not "
                                 f"keep them (the client's record and the ranks' differ: restart the engine)")
            return found
        tensors = {k[len("patch."):]: v for k, v in inputs.items() if k.startswith("patch.")}
        for i, e in enumerate(spec["entries"]):
            if not isinstance(e, dict) or e.get("kind") not in ("lora", "diff") or not isinstance(e.get("key"), str):
                raise ValueError(f"weight patch {i} {e!r} is malformed: give key, kind lora|diff, scale, offset")
            needed = ("up", "down") if e["kind"] == "lora" else ("diff",)
            missing = [n for n in needed if f"{i}.{n}" not in tensors]
            if missing:
                raise ValueError(f"weight patch {i} ({e['key']}) lacks its tensors {missing}")
        patches = cls(str(spec.get("digest", "")), tuple(spec["entries"]), tensors)
        if kept is not None and patches.entries:   # copies: the job's buffer is not kept alive by what the rank keeps
            kept.keep(patches.digest, cls(patches.digest, patches.entries,
                                          {k: v.clone() for k, v in tensors.items()}))
        return patches


class HeldPatches:
    """The weight-patch sets the ranks keep between jobs, least recently used first, at most SETS (one per resident
    model: a two-expert clip's two sets). The client keeps the same record (`on_client`, per engine generation, `sent`
    once a job reached the ranks) as every rank (`on_rank`, `keep` and `take`), both updated in the same order by the
    same jobs, so a set the record holds is one every rank holds."""
    SETS = 2

    def __init__(self):
        self._order: dict[str, object] = {}

    @classmethod
    def on_rank(cls, cache: dict) -> "HeldPatches":
        return cache.setdefault("weight_patches", cls())

    @classmethod
    def on_client(cls, engine) -> "HeldPatches | None":
        """The client's record for `engine`'s current rank group (a new group keeps nothing); None for an engine that
        keeps no record (a stand-in)."""
        held = getattr(engine, "held", None)
        if held is None:
            return None
        record = held.get("weight_patches")
        if record is None or record[0] != engine.generation:
            record = held["weight_patches"] = (engine.generation, cls())
        return record[1]

    def holds(self, digest: str) -> bool:
        """Client: do the ranks keep the set `digest` (send the digest alone)?"""
        return digest in self._order

    def sent(self, patches: "WeightPatches") -> None:
        """Client: a job carrying `patches` (whole or as its digest) reached the ranks, which now keep it."""
        if patches.entries:
            self.keep(patches.digest, patches.nbytes)

    def keep(self, digest: str, patches) -> None:
        """Keep a set (a rank: the patches received whole; the client: their size), the most recently used."""
        self._order.pop(digest, None)
        self._order[digest] = patches
        while len(self._order) > self.SETS:
            del self._order[next(iter(self._order))]

    def take(self, digest: str):
        """Rank: the set sent as its digest (now the most recently used), or None."""
        patches = self._order.pop(digest, None)
        if patches is not None:
            self._order[digest] = patches
        return patches


def _rows(t: torch.Tensor, offset, rows: int) -> torch.Tensor:
    """A patch covering rows [start, start + length) of a fused parameter of `rows` rows, as a tensor over all its rows
    (zero elsewhere), so the key map's row split takes each routed parameter's share of it."""
    if offset is None:
        return t
    dim, start, length = offset
    if dim != 0 or t.shape[0] != length or start < 0 or start + length > rows:
        raise CheckpointError(f"a weight patch covers rows {start}..{start + length} (dim {dim}) of a parameter of "
                              f"{rows} rows; the engine applies row ranges of dim 0 only")
    full = t.new_zeros((rows,) + tuple(t.shape[1:]))
    full[start:start + length] = t
    return full


@torch.no_grad()
def patch_factors(patches: WeightPatches, info: CheckpointInfo, diffusers_keys: set[str],
                  shapes: dict[str, tuple]) -> dict[str, list[tuple]]:
    """{diffusers parameter: [(up, down, scale, op)]} of ComfyUI weight patches, as lora_factors gives a file's (a full
    difference is up = diff, down = identity: it is kept as the difference itself, see _delta). `shapes`: the
    diffusers parameters' shapes (a fused source's rows are the sum of its routes' rows)."""
    native = dataclasses.replace(info, layout=info.spec.native_layout)   # ComfyUI's names: the native layout
    routes_of: dict[str, list] = {}
    for dst, src, op in key_map(native) or []:
        routes_of.setdefault(src, []).append((dst, op))
    for key in diffusers_keys:
        routes_of.setdefault(key, [(key, None)])
    factors: dict[str, list[tuple]] = {}
    for i, e in enumerate(patches.entries):
        key = e["key"]
        routes = routes_of.get(key)
        if routes is None:
            raise CheckpointError(f"a LoRA patch on the MODEL targets {key}, which is not a layer of this "
                                  f"{info.variant} model (a LoRA for another model?)")
        first_op = routes[0][1]
        rows = sum(first_op[2]) if isinstance(first_op, tuple) else shapes[routes[0][0]][0]
        scale = float(e["scale"])
        if e["kind"] == "lora":
            up = _rows(patches.tensors[f"{i}.up"].float(), e.get("offset"), rows)
            down = patches.tensors[f"{i}.down"].float()
            if up.ndim != 2 or down.ndim != 2 or up.shape[1] != down.shape[0]:
                raise CheckpointError(f"the LoRA patch on {key} has up {list(up.shape)} and down "
                                      f"{list(down.shape)}: not a linear LoRA ([out, rank] and [rank, in])")
            parts = [(up, down, scale)]
        else:
            parts = [(_rows(patches.tensors[f"{i}.diff"].float(), e.get("offset"), rows), None, scale)]
        for dst, op in routes:
            for up, down, s in parts:
                factors.setdefault(dst, []).append((up, down, s, op))
    return factors


def _delta(parts) -> torch.Tensor:
    delta = None
    for up, down, scale, op in parts:
        part = apply_op((up if down is None else up @ down) * scale, op)   # down None: a full difference
        delta = part if delta is None else delta + part
    return delta


@torch.no_grad()
def lora_deltas(path: str, info: CheckpointInfo, diffusers_keys: set[str]) -> dict[str, torch.Tensor]:
    """{diffusers parameter: float32 delta at strength 1} = up @ down * alpha / rank, routed like the weights."""
    return {dst: _delta(parts) for dst, parts in lora_factors(path, info, diffusers_keys).items()}


@torch.no_grad()
def apply_loras(loaded, loras: list[tuple[str, float]], state: dict, patches: WeightPatches | None = None) -> dict:
    """Make the model's weights base + the given LoRA files + a MODEL's weight patches. `state` remembers what is
    applied (per rank), so the same list costs nothing, and a changed list restores the touched weights from the
    checkpoint first."""
    patches = patches or WeightPatches.none()
    wanted = tuple((os.path.abspath(p), os.stat(p).st_mtime_ns, float(s)) for p, s in loras) + (
        (("patches", patches.digest),) if patches.entries else ())
    if state.get("applied", ()) == wanted:
        return {"lora_changed": False}
    params = dict(loaded.model.named_parameters())
    touched = state.get("touched", set())
    restored = restore_weights(loaded, touched) if touched else 0
    touched = set()
    on_top = 0
    sources = [(lambda path=path: lora_factors(path, loaded.info, set(params)), float(strength),
                f"LoRA {os.path.basename(path)}") for path, strength in loras]
    if patches.entries:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        sources.append((lambda: patch_factors(patches, loaded.info, set(params), shapes), 1.0, "the MODEL's LoRA"))
    for factors_of, strength, label in sources:
        for name, parts in factors_of().items():
            weight = params[name]
            if weight.is_meta:   # a PipeFusion stage holds only its own blocks
                continue
            owner = lora_owner(loaded.model, name)
            if getattr(owner, "lora_on_top", False):
                for up, down, scale, op in parts:
                    if down is None:
                        raise CheckpointError(f"{label}: a full weight difference for {name}, which is held "
                                              f"quantized (fp8 or GGUF blocks) and takes LoRA factors only; load "
                                              f"the model unquantized or leave that patch out")
                    up = apply_op(up, op)
                    if (up.shape[0], down.shape[1]) != (owner.out_features, owner.in_features):
                        raise CheckpointError(f"{label}: delta for {name} has shape "
                                              f"{[up.shape[0], down.shape[1]]}, the weight "
                                              f"{[owner.out_features, owner.in_features]}")
                    owner.add_lora(up.to(weight.device), down.to(weight.device), scale, strength)
                on_top += 1
                touched.add(name)
                continue
            delta = _delta(parts)
            if weight.shape != delta.shape:
                raise CheckpointError(f"{label}: delta for {name} has shape {list(delta.shape)}, "
                                      f"the weight {list(weight.shape)}")
            start, stop = held_rows(weight, loaded.shard)   # weights divided among ranks: this rank's rows
            held = local(weight)
            held.copy_((held.float() + strength * delta[start:stop].to(held.device)).to(held.dtype))
            touched.add(name)
    state.update(applied=wanted, touched=touched)
    return {"lora_changed": True, "lora_layers_touched": len(touched), "lora_layers_on_top": on_top,
            "lora_restore_bytes": restored}
