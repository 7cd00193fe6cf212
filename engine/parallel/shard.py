"""Weights divided among a group of ranks (the plan's `shard` degree), with torch's own FSDP2 (`fully_shard`):
each transformer block is one unit whose parameters every member holds a 1/shard row slice of, each module the family
names (`Family.shard_units`: text connectors, a token refiner) one more, and the model's other parameters (embedders,
final layer) one more unit at the root. A block's whole weights are gathered just before it
runs and freed after (inference: nothing is kept for a backward pass); the next block's gather is posted while this
one computes (explicit forward prefetch), on the communicator's own stream on GPUs. The root's are gathered once for
the whole call (models/sharded.py `gathered`; not resharded after each forward), since a family's forward reaches the
embedders outside the model's own forward too, and a family may run several forwards a call.

Everything is sharded as it is stored: FSDP2 gathers each parameter in its own dtype, so fp8 and fp8_scaled matrices
travel as fp8 and GGUF blocks as their bytes, dequantized after the gather by the layer that holds them (a row of a
GGUF matrix is one output feature's blocks: a row slice never cuts a block). Buffers (an fp8_scaled file's scales, a
RoPE table) and LoRA factors kept beside a quantized layer stay whole on every rank.

The models/ layer loads into the shards (models/sharded.py: each rank reads only its rows of each tensor); this
module only says how a family's model is cut (`ShardSpec`), over which ranks (the mesh's "shard" group)."""
from __future__ import annotations

import torch

from ..models.sharded import ShardSpec


def shard_spec(mesh, family) -> ShardSpec | None:
    """How this rank holds a model of `family` under the mesh's plan: None when the plan keeps whole weights."""
    group = mesh.groups.get("shard")
    if group is None or group.size == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard   # (imported before the load: its modules are not the weights')
    device_mesh = DeviceMesh.from_group(group.pg, mesh.device_type)
    blocks = family.tokens.blocks

    def wrap(model: torch.nn.Module) -> None:
        units = [block for name in blocks for block in model.get_submodule(name)]
        for unit in units:
            fully_shard(unit, mesh=device_mesh, reshard_after_forward=True)
        for name in family.shard_units:   # a family's own units (text connectors): whole only while they run
            fully_shard(model.get_submodule(name), mesh=device_mesh, reshard_after_forward=True)
        # the root stays whole after a forward until `gathered` lets it go at the end of the call: a family that runs
        # several forwards a call (MiniMax-H3, one a row) gathers it once, not once a forward
        fully_shard(model, mesh=device_mesh, reshard_after_forward=False)
        for unit, following in zip(units, units[1:]):   # the next block's gather posted while this one computes
            unit.set_modules_to_forward_prefetch([following])

    return ShardSpec(size=group.size, rank=group.rank, ranks=tuple(group.ranks), wrap=wrap)


def forget_divisions() -> None:
    """Empty torch's DTensor caches of sharding decisions: each keeps every DeviceMesh it has seen, and with it the
    mesh's process group, after the weights divided over it are gone. A mesh torn down after a failed job (runtime/
    jobs.py drop_mesh) frees a peer waiting in one of its gloo collectives only when nothing holds its communicators.
    (torch's own helpers, for debugging; the caches fill again on the next sharded job.)"""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()
    for cached in (getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    getattr(_redistribute, "_planner_cache", {}).clear()
