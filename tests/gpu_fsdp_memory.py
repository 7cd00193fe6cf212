"""What FSDP2 holds whole while a block runs, measured on a GPU (the planner budgets memory.IN_FLIGHT_BLOCKS = 3 from
torch's source: the running block's parameters, its all-gather output kept until the next block's wait, the next
block's gather posted ahead). Two ranks of a shard group on the ONE GPU a lease has (gloo carries the CUDA tensors,
staged through the host; NCCL refuses two ranks on one device), the engine's own wrapping (engine/parallel/shard.py:
a unit per block, explicit forward prefetch, the root kept whole): a stack of equal blocks, each peak of the device
memory while its forward runs above the sharded baseline, in blocks. Prints one line a rank; exit 0.

    python tests/gpu_fsdp_memory.py [BLOCK_MIB] [BLOCKS]
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 4 * width, bias=False), torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.embed = torch.nn.Linear(width, width, bias=False)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def run(rank: int, world: int, port: int, block_mib: int, blocks: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    width = int((block_mib * 2**20 / 2 / 8) ** 0.5)   # bf16: 8 width^2 parameters a block
    with torch.device("meta"):
        model = Stack(width, blocks)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for unit, following in zip(model.blocks, list(model.blocks)[1:]):
        unit.set_modules_to_forward_prefetch([following])
    model.to_empty(device="cuda")
    model.to(torch.bfloat16)
    block_bytes = sum(p.numel() * 2 for p in Block(width).parameters())
    peaks = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, a, o: peaks.append(torch.cuda.max_memory_allocated()))
        block.register_forward_pre_hook(lambda m, a: torch.cuda.reset_peak_memory_stats())
    x = torch.randn(1, 64, width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model.unshard()
        model(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()   # the shards, the root whole, the input
        peaks.clear()
        model(x)
        torch.cuda.synchronize()
        model.reshard()
    held = [(p - base) / block_bytes for p in peaks[1:-1]]   # the middle blocks (the first has no prefetch before it)
    print(f"rank {rank}: world {world}, blocks of {block_bytes / 2**20:.0f} MiB: while a block runs FSDP2 holds "
          f"{max(held):.2f} blocks whole beyond the shards (median {sorted(held)[len(held) // 2]:.2f}); "
          f"memory.IN_FLIGHT_BLOCKS budgets 3", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    block_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port, block_mib, blocks), nprocs=2)
