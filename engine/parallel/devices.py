"""What the planner knows about the machine: each GPU's rated throughput and memory, the link between the GPUs
(`Interconnect`), and `Hardware`, the two together, detected from CUDA and `nvidia-smi topo -m` or stated.

Detection never fails: what it cannot find it assumes, and `Hardware.notes` says what was assumed.
Memory is in GiB (2**30 bytes), as torch and nvidia-smi (MiB / 1024) report it.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float            # rated dense bf16 tensor TFLOP/s with fp32 accumulate (no sparsity)
    memory_gib: float
    aliases: tuple = ()      # token sets of torch.cuda.get_device_name() that mean this GPU, most specific first


# Dense bf16 (fp32 accumulate) figures from NVIDIA's datasheets and architecture whitepapers: H100/H200 datasheets
# (SXM 989, PCIe 756, NVL 835), A100 datasheet (312), L40S / L40 / L4 / A10 / A40 datasheets, the Ampere GA102
# whitepaper (RTX 3090: 71 with fp32 accumulate, 142 with fp16 accumulate; RTX A6000 154.8) and the Ada whitepaper
# (RTX 4090: 165.2 with fp32 accumulate, 330.3 with fp16 accumulate; RTX 6000 Ada 364.2). GeForce cards run bf16
# with fp32 accumulate at half their fp16-accumulate rate; the halved rate is the one listed, since torch's bf16
# matmuls accumulate in fp32.
GPUS = {g.name: g for g in (
    GPU("H100 PCIe", 756, 80, (("h100", "pcie"),)),
    GPU("H100 NVL", 835, 94, (("h100", "nvl"),)),
    GPU("H100 SXM", 989, 80, (("h100",),)),          # torch names it "NVIDIA H100 80GB HBM3"
    GPU("H200", 989, 141, (("h200",),)),
    GPU("H20", 148, 96, (("h20",),)),
    GPU("A100 40GB", 312, 40, (("a100", "40gb"),)),
    GPU("A100 80GB", 312, 80, (("a100",),)),
    GPU("L40S", 362, 48, (("l40s",),)),
    GPU("L40", 181, 48, (("l40",),)),
    GPU("L4", 121, 24, (("l4",),)),
    GPU("A40", 150, 48, (("a40",),)),
    GPU("A10", 125, 24, (("a10",),)),
    GPU("RTX 6000 Ada", 364, 48, (("6000", "ada"),)),
    GPU("RTX A6000", 155, 48, (("a6000",),)),
    GPU("RTX 4090", 165.2, 24, (("4090",),)),
    GPU("RTX 3090", 71, 24, (("3090",),)),
)}
# When a GPU is not in the table: an A100-class rate, said so in the notes.
UNKNOWN_GPU_TFLOPS = 312


def find_gpu(name: str) -> GPU | None:
    """The table entry for a GPU name as torch or a user writes it ("NVIDIA GeForce RTX 4090", "rtx 4090", "L40S")."""
    tokens = set(re.split(r"[^a-z0-9]+", name.lower()))
    squeezed = re.sub(r"[^a-z0-9]", "", name.lower())
    for gpu in GPUS.values():
        if squeezed == re.sub(r"[^a-z0-9]", "", gpu.name.lower()):
            return gpu
    return next((g for g in GPUS.values() if any(set(alias) <= tokens for alias in g.aliases)), None)


@dataclass(frozen=True)
class Interconnect:
    """The link between the ranks' devices, as the cost model sees it.

    `tree`: the GPUs hang off a PCIe tree with no switch fabric between them. An all-to-all's flows between every
    pair then share the tree's bridges: n GPUs exchanging all at once get about 2/n of a link each (a pair is one
    exchange, at link speed). A ring sends to one neighbour, and consecutive GPUs sit under the same switch or root
    port in common 4- and 8-GPU boxes, so a ring's flows run at link speed; NCCL's ring algorithms rely on the same.
    Measured in the field (FIELD_NOTES.md section 4): Ulysses-8 alone on 8 PCIe L40s was slower than one GPU, and
    on 4 L40s Ulysses-2 x Ring-2 beat Ulysses-4 although it sends more bytes."""

    kind: str                # nvlink | pcie | pcie-no-peer | network | cpu
    bandwidth_gbs: float     # GB/s (1e9 bytes) one GPU sends to one peer
    latency_us: float        # fixed cost of one collective call
    tree: bool = False

    def all_to_all_gbs(self, n: int) -> float:
        """GB/s each of n GPUs gets in an all-to-all among them."""
        return self.bandwidth_gbs * (min(1.0, 2 / n) if self.tree else 1.0)

    def describe(self) -> str:
        return LINK_NAMES[self.kind]


# Effective rates, not link maxima: NVLink 4 moves ~300 GB/s per direction in NCCL all-to-all on H100 (900 GB/s
# is both directions, all links); PCIe 4.0 x16 ~20 GB/s with peer access, about half when every transfer bounces
# through host memory; a 100 Gb/s network ~10 GB/s; gloo over loopback (CPU ranks) a few GB/s.
LINKS = {
    "nvlink": Interconnect("nvlink", 300, 10),
    "pcie": Interconnect("pcie", 20, 20, tree=True),
    "pcie-no-peer": Interconnect("pcie-no-peer", 10, 30, tree=True),
    "network": Interconnect("network", 10, 30),
    "cpu": Interconnect("cpu", 2, 50),
}
LINK_NAMES = {"nvlink": "NVLink", "pcie": "PCIe (peer access)", "pcie-no-peer": "PCIe (no peer access)",
              "network": "network", "cpu": "gloo (CPU ranks)"}


@dataclass(frozen=True)
class Hardware:
    """The ranks' devices: "cpu" (gloo ranks sharing the host's cores) or "cuda" with one GPU kind and a link."""

    device: str
    gpus: int = 1
    gpu: GPU | None = None
    gpu_name: str = ""          # as detected or given (the table's name when known)
    memory_gib: float | None = None
    link: Interconnect = LINKS["nvlink"]
    notes: tuple = field(default=(), compare=False)   # what was assumed, and how the rest was found

    @property
    def rated_tflops(self) -> float:
        return self.gpu.tflops if self.gpu else UNKNOWN_GPU_TFLOPS

    def describe(self) -> str:
        if self.device == "cpu":
            return f"{self.gpus} CPU rank(s) over gloo"
        assumed = " (assumed)" if any(n.startswith("assumed") for n in self.notes) else ""
        over = f" over {self.link.describe()}" if self.gpus > 1 else ""
        return f"{self.gpus}x {self.gpu_name}{over}{assumed}"


def cpu_hardware(ranks: int) -> Hardware:
    return Hardware(device="cpu", gpus=ranks, link=LINKS["cpu"])


def stated_hardware(gpus: int, gpu_name: str, link: str, memory_gib: float | None = None,
                    notes: tuple = ()) -> Hardware:
    """Hardware as a user states it (`python -m engine plan`). Raises ValueError for a GPU or link it does not know."""
    gpu = find_gpu(gpu_name)
    if gpu is None:
        raise ValueError(f"GPU {gpu_name!r} is not in the planner's table: use one of {', '.join(GPUS)}")
    if link not in LINKS:
        raise ValueError(f"interconnect {link!r} is invalid: use one of {', '.join(LINKS)}")
    return Hardware(device="cuda", gpus=gpus, gpu=gpu, gpu_name=gpu.name, link=LINKS[link],
                    memory_gib=gpu.memory_gib if memory_gib is None else memory_gib, notes=notes)


def assumed_hardware(gpus: int, why: str = "no hardware given") -> Hardware:
    """The field notes' reference machine, H100 SXM GPUs over NVLink, for when nothing better is known."""
    return stated_hardware(gpus, "H100 SXM", "nvlink", notes=(f"assumed: {why}, so H100 SXM over NVLink",))


# ---- detection ------------------------------------------------------------------------------------------------
TOPO_TIMEOUT_S = 5.0


def parse_topo(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m`'s GPU matrix: {(i, j): "NV12" | "PIX" | "PXB" | "PHB" | "NODE" | "SYS" ...}, by the
    physical indices nvidia-smi prints."""
    links = {}
    header = None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():  # some versions underline the header
        cells = line.split()
        if header is None and cells and re.fullmatch(r"GPU\d+", cells[0]) and "X" not in cells:
            header = [int(c[3:]) for c in cells if re.fullmatch(r"GPU\d+", c)]
            continue
        if header and cells and re.fullmatch(r"GPU\d+", cells[0]):
            row = int(cells[0][3:])
            for col, cell in zip(header, cells[1:1 + len(header)]):
                if col != row:
                    links[(row, col)] = cell
    return links


def link_from_topo(links: dict[tuple[int, int], str], physical: list[int]) -> str | None:
    """"nvlink" when every pair of these GPUs has an NVLink, None when the matrix does not say (another link)."""
    pairs = [(a, b) for a in physical for b in physical if a != b]
    if pairs and all(links.get(p, "").startswith("NV") for p in pairs):
        return "nvlink"
    return None


def _nvidia_smi_topo() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=TOPO_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _physical(gpus: list[int]) -> list[int] | None:
    """nvidia-smi's indices of torch's visible devices (None when CUDA_VISIBLE_DEVICES names them by UUID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(gpus)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in ids) or max(gpus) >= len(ids):
        return None
    return [int(ids[g]) for g in gpus]


def hardware_for(device: str, ranks: int, gpus=None) -> Hardware:
    """What the engine's callers pass to the planner: CPU ranks, or the CUDA GPUs `gpus` as detected."""
    return cpu_hardware(ranks) if device == "cpu" else detect_hardware(tuple(gpus))


@functools.lru_cache(maxsize=16)  # the machine does not change under a running process; nvidia-smi is slow
def detect_hardware(gpus: tuple[int, ...]) -> Hardware:
    """The CUDA GPUs `gpus` (torch indices) and the link between them. Never raises: what it cannot find, it
    assumes (A100-class rates for a GPU not in the table; PCIe when nvidia-smi shows no NVLink between every pair),
    and the notes say so. Several kinds of GPU are planned as the slowest."""
    try:
        import torch
        if not torch.cuda.is_available() or max(gpus) >= torch.cuda.device_count():
            return assumed_hardware(len(gpus), f"CUDA does not show GPUs {','.join(map(str, gpus))}")
        names = [torch.cuda.get_device_name(g) for g in gpus]
        memory_gib = min(torch.cuda.get_device_properties(g).total_memory for g in gpus) / 2**30
        peer = all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)
    except Exception as e:  # a driver that answers one question and not the next: assume, and say so
        return assumed_hardware(len(gpus), f"CUDA could not be queried ({type(e).__name__})")
    notes = []
    name = min(names, key=lambda n: find_gpu(n).tflops if find_gpu(n) else UNKNOWN_GPU_TFLOPS)
    gpu = find_gpu(name)
    if gpu is None:
        notes.append(f"assumed: {name} is not in the GPU table, rated {UNKNOWN_GPU_TFLOPS} TFLOP/s")
    if len(set(names)) > 1:
        notes.append(f"mixed GPUs ({', '.join(sorted(set(names)))}): planned as the slowest, {name}")
    link = "pcie" if peer else "pcie-no-peer"
    if len(gpus) > 1:
        physical = _physical(list(gpus))
        topo = _nvidia_smi_topo() if physical else None
        nvlink = link_from_topo(parse_topo(topo), physical) if topo else None
        link = nvlink or link
        how = "nvidia-smi topo -m" if nvlink else "torch's peer-access query" + ("" if topo else ", no nvidia-smi")
        notes.append(f"link {LINK_NAMES[link]} from {how}")
    return Hardware(device="cuda", gpus=len(gpus), gpu=gpu, gpu_name=gpu.name if gpu else name,
                    memory_gib=memory_gib, link=LINKS[link], notes=tuple(notes))
