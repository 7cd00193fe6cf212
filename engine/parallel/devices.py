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
    memory_gib: float        # the card's total as torch reports it on Linux (below), not its marketed size
    aliases: tuple = ()      # token sets of torch.cuda.get_device_name() that mean this GPU, most specific first
    arch: str = "ampere"     # ampere | ada | hopper | blackwell: what the efficiency table knows of it
    nvlink_gbs: float = 0    # datasheet NVLink bandwidth, GB/s both directions together (0: none)
    pcie_gen: int = 4        # the card's PCIe generation (x16)
    efficiency: float | None = None   # this GPU's own eager efficiency when it differs from its architecture's
    efficiency_source: str = ""


# Dense bf16 (fp32 accumulate) figures from NVIDIA's datasheets and architecture whitepapers (sparsity figures halved):
# H100 SXM 989 / PCIe 756 / NVL 835 (H100 datasheet), H200 989 / H200 NVL 835 (H200 datasheet), H20 148 (H20
# datasheet), A100 and A800 312 (A100 / A800 datasheets), L40S 362, L40 181, L20 119.5, L4 121, A40 149.7, A10 125
# (their datasheets), RTX 6000 Ada 364.2 (Ada whitepaper), RTX A6000 154.8 and RTX 3090 71 (Ampere GA102
# whitepaper), RTX 4090 165.2 and RTX 4080 97.5 (Ada whitepaper), RTX 5090 209.5 (Blackwell GB202 whitepaper: 838.4 sparse fp16
# accumulate, halved twice), RTX PRO 6000 Blackwell 503.8 (RTX Blackwell whitepaper). GeForce cards run bf16 with fp32
# accumulate at half their fp16-accumulate rate; the halved rate is the one listed, since torch's bf16 matmuls
# accumulate in fp32. NVLink: H100 SXM / H200 / H20 900 GB/s, H100 NVL and H100 PCIe bridges 600, H200 NVL bridge
# 900, A100 600, A800 400, A40 / RTX A6000 / RTX 3090 bridges 112.5; the others have none.
# Memory: what torch.cuda.get_device_properties(i).total_memory gives on Linux (detect_hardware reads the same), as
# torch's out-of-memory message prints it ("GPU 0 has a total capacity of X GiB"): the card less the driver's reserve,
# and less 1/16 where GDDR ECC is on by default. Reported in GitHub issues: RTX 4090 23.64 (ali-vilab/VGen#104,
# 3DTopia/Phidias-Diffusion#8), RTX 3090 23.70 (Lightning-AI/lit-llama#137), RTX 5090 31.36
# (TrajectoryCrafter/TrajectoryCrafter#20), H100 80GB 79.11 (vllm-project/vllm#27508), A100 80GB 79.25
# (levihsu/OOTDiffusion#235), A100 40GB 39.50 (TianheWu/CoSeR#10), H20 95.00 (modelscope/DiffSynth-Studio#1238), L40S
# 44.42 (stepfun-ai/Step-Video-T2V#8), L40 44.40 (QwenLM/Qwen3-VL#2097), L4 22.03 (ArcInstitute/evo2#190), A10 21.99
# (zai-org/CogVLM#236); RTX 6000 Ada with ECC on 44.43 (DINGYANB/MTVCrafter#21, nvidia-smi 46068 MiB). The others are
# derived: the marketed GiB x 0.985, the share the cards above without an ECC cost keep (0.980-0.991), x 15/16 more
# for the datacenter GDDR cards (L20, A40: ECC on, as the L40S's 0.925); the A800s as the A100s. A card with ECC
# switched on or off: --gpu-memory-gb.
GPUS = {g.name: g for g in (
    GPU("H100 PCIe", 756, 79.11, (("h100", "pcie"),), "hopper", 600, 5),
    GPU("H100 NVL", 835, 92.59, (("h100", "nvl"),), "hopper", 600, 5),
    GPU("H100 SXM", 989, 79.11, (("h100",),), "hopper", 900, 5),          # torch names it "NVIDIA H100 80GB HBM3"
    GPU("H200 NVL", 835, 138.9, (("h200", "nvl"),), "hopper", 900, 5),
    GPU("H200", 989, 138.9, (("h200",),), "hopper", 900, 5),
    GPU("H20", 148, 95.0, (("h20",),), "hopper", 900, 5, efficiency=0.62,
        efficiency_source="assumed: the H20 has an H100's memory system and 1/7 of its tensor throughput, so eager "
                          "elementwise work weighs as little as on an L40 (62.7%), not as on an H100"),
    GPU("A100 40GB", 312, 39.5, (("a100", "40gb"),), "ampere", 600, 4),
    GPU("A100 80GB", 312, 79.25, (("a100",),), "ampere", 600, 4),
    GPU("A800 40GB", 312, 39.5, (("a800", "40gb"),), "ampere", 400, 4),
    GPU("A800 80GB", 312, 79.25, (("a800",),), "ampere", 400, 4),
    GPU("L40S", 362, 44.42, (("l40s",),), "ada"),
    GPU("L40", 181, 44.4, (("l40",),), "ada"),
    GPU("L20", 119.5, 44.4, (("l20",),), "ada"),
    GPU("L4", 121, 22.03, (("l4",),), "ada"),
    GPU("A40", 149.7, 44.4, (("a40",),), "ampere", 112.5),
    GPU("A10", 125, 21.99, (("a10",),), "ampere"),
    GPU("RTX PRO 6000", 503.8, 94.56, (("pro", "6000"),), "blackwell", 0, 5),
    GPU("RTX 6000 Ada", 364.2, 47.28, (("6000", "ada"),), "ada"),
    GPU("RTX A6000", 154.8, 47.28, (("a6000",),), "ampere", 112.5),
    GPU("RTX 5090", 209.5, 31.36, (("5090",),), "blackwell", 0, 5),
    GPU("RTX 4090", 165.2, 23.64, (("4090",),), "ada"),
    GPU("RTX 4080", 97.5, 15.76, (("4080",),), "ada"),
    GPU("RTX 3090", 71, 23.7, (("3090",),), "ampere", 112.5),
)}
# Memory bandwidth, GB/s, from the same datasheets and whitepapers: what a ring's log-sum-exp merges stream at (cost.py).
MEMORY_GBS = {"H100 PCIe": 2000, "H100 NVL": 3900, "H100 SXM": 3350, "H200 NVL": 4800, "H200": 4800, "H20": 4000,
              "A100 40GB": 1555, "A100 80GB": 2039, "A800 40GB": 1555, "A800 80GB": 2039, "L40S": 864, "L40": 864,
              "L20": 864, "L4": 300, "A40": 696, "A10": 600, "RTX PRO 6000": 1792, "RTX 6000 Ada": 960,
              "RTX A6000": 768, "RTX 5090": 1792, "RTX 4090": 1008, "RTX 4080": 716.8, "RTX 3090": 936}
UNKNOWN_MEMORY_GBS = 2039   # an A100's, as UNKNOWN_GPU_TFLOPS


def memory_gbs(gpu: GPU | None) -> float:
    return MEMORY_GBS.get(gpu.name, UNKNOWN_MEMORY_GBS) if gpu else UNKNOWN_MEMORY_GBS


# When a GPU is not in the table: an A100-class rate, said so in the notes.
UNKNOWN_GPU_TFLOPS = 312

# The share of the rated rate a one-GPU FLUX.1-dev 1024^2 step reaches in eager PyTorch (74.4 TFLOP a step, 28 steps,
# whole-pipeline seconds as published), per architecture, and how much torch.compile speeds that step up. Eager
# elementwise work (norms, modulation, RoPE, activations) runs at memory speed: the faster the tensor cores against
# the memory, the lower the share.
EFFICIENCY = {   # arch: (eager share, compile speed-up, source)
    "hopper": (0.314, 1.56, "xDiT docs/performance/flux.md: 1xH100 6.71 s eager, 4.30 s compiled"),
    "ampere": (0.522, 1.22, "xDiT paper: 1xA100 12.77 s (FLUX.1-dev); compile from xDiT docs/performance/sd3.md: "
                            "1xA100 SD3-medium 3.09 s eager, 2.54 s compiled"),
    "ada": (0.627, 1.10, "xDiT paper: 1xL40 18.36 s (ParaAttention's 1xL20 26.36 s gives 66%); compile from xDiT "
                         "docs/performance/flux.md: 1xL40 FLUX.1-schnell 3.18 s eager, 2.89 s compiled"),
    "blackwell": (0.627, 1.10, "assumed: Ada's (no published one-GPU step; GDDR7 cards keep Ada's balance of "
                               "tensor rate to memory)"),
}


def efficiency(gpu: GPU | None, compiled: bool) -> tuple[float, str]:
    """The share of the rated dense bf16 rate a one-GPU step reaches, and where the figure comes from."""
    share, speedup, source = EFFICIENCY[gpu.arch if gpu else "ampere"]
    if gpu is not None and gpu.efficiency is not None:
        share, source = gpu.efficiency, gpu.efficiency_source
    if gpu is None:
        source = "unknown GPU: A100's " + source
    return (share * speedup, source) if compiled else (share, source)


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
    """The link between the ranks' devices, as the cost model sees it: one topology class (`LINKS`) for the whole set
    of GPUs, the worst path between any two of them (what `nvidia-smi topo -m` prints for the pair).

    `bandwidth_gbs` is what one GPU sends to one peer (a ring's hop, a pipeline's stage, a pair's exchange);
    `latency_us` the fixed cost of one collective call. `tree`: the path crosses the CPU (its root complex, the socket
    link or host memory). There an all-to-all of n GPUs, n - 1 flows in and out of every GPU at once, loses throughput
    to the concurrency: each GPU gets `bandwidth / (1 + contention x (n - 2))` (a pair is one flow each way, at link
    speed). NVIDIA describes the fall ("the A2A performance of most CPU interconnects fall drastically under load",
    NCCL issue 1163); its size is fitted to xDiT's FLUX.1-dev Ulysses rows on PCIe L40s (published.py). NVLink through
    NVSwitch and a PCIe switch carry every flow at link speed."""

    kind: str                # a LINKS class (or "cpu"): nvlink | pcie-switch | pcie-bridge | pcie-socket | ...
    bandwidth_gbs: float     # GB/s (1e9 bytes) one GPU sends to one peer
    latency_us: float        # fixed cost of one collective call
    tree: bool = False
    contention: float | None = None   # None: PCIE_A2A_CONTENTION (the fitted value) where `tree`

    def all_to_all_gbs(self, n: int) -> float:
        """GB/s each of n GPUs gets in an all-to-all among them."""
        if not self.tree:
            return self.bandwidth_gbs
        contention = PCIE_A2A_CONTENTION if self.contention is None else self.contention
        return self.bandwidth_gbs / (1 + contention * max(0, n - 2))

    def describe(self) -> str:
        return LINK_NAMES[self.kind]


# Fitted (see `tree` above): each extra concurrent flow of an all-to-all across the CPU costs this much of a flow's
# time. fitting.fit_constants() re-derives it with the others from the rows published.py marks "fit".
PCIE_A2A_CONTENTION = 3.51
# What a flow across the two sockets' link gets, GB/s: NCCL's topology model rates that link 10 GB/s (Skylake UPI) to
# 22 (Sapphire Rapids) and 16-24 (AMD Infinity Fabric) (nccl src/graph/topo.h: SKL_QPI_BW, SRP_QPI_BW, AMD_BW);
# fitted within that range to xDiT's FLUX.1-dev Ring-8 on 8 PCIe L40s, whose ring crosses the sockets.
PCIE_SOCKET_GBS = 22.3
# The topology classes, for PCIe 4.0 x16 GPUs (`link_for` scales them to a GPU's own NVLink and PCIe generation).
# Bandwidth: NVLink 4 moves ~300 GB/s per direction in NCCL all-to-all on an H100 (900 GB/s is both directions, all
# links; NVIDIA's p2p test reaches 380 GB/s one way, NCCL issue 1264). PCIe 4.0 x16 peaks at ~25 GB/s one way measured
# (cuda-samples p2pBandwidthLatencyTest; BaM issue 54): ~22 GB/s through a switch after NCCL's protocol overhead;
# through the CPU's root complex ~20, NCCL's Intel P2P overhead of 6/5 (INTEL_P2P_OVERHEAD in topo.h); across the
# sockets the socket link's rate above; without peer access every transfer crosses the GPU's link twice through host
# memory (NCCL issue 1309), ~10; a 100 Gb/s network ~12 (NCCL's NET_BW). gloo over loopback (CPU ranks) a few GB/s.
# Latency: NCCL's tuning model (src/graph/tuning.cc), a call's base 8.4 us + 3.4 per NVLink hop, 5.7 per PCIe hop,
# 6.6 per network hop: 12 us over NVLink, 14 under one switch, 15 through the root complex, 20 across the sockets
# (two PCIe hops and the socket link), 30 through host memory (NCCL's shared-memory transport, copied by a proxy
# thread), 20 over a network.
LINKS = {
    "nvlink": Interconnect("nvlink", 300, 12),
    "pcie-switch": Interconnect("pcie-switch", 22, 14),
    "pcie-bridge": Interconnect("pcie-bridge", 20, 15, tree=True),
    "pcie-socket": Interconnect("pcie-socket", PCIE_SOCKET_GBS, 20, tree=True),
    "pcie-no-peer": Interconnect("pcie-no-peer", 10, 30, tree=True),
    "network": Interconnect("network", 12, 20),
    "cpu": Interconnect("cpu", 2, 50),
}
# Names the planner took before the topology classes: "pcie" meant PCIe with peer access, which without a switch
# between the GPUs is the CPU's root complex.
LINK_ALIASES = {"pcie": "pcie-bridge"}
LINK_NAMES = {"nvlink": "NVLink", "pcie-switch": "PCIe, one switch", "pcie-bridge": "PCIe across host bridges",
              "pcie-socket": "PCIe across CPU sockets", "pcie-no-peer": "PCIe (no peer access)", "network": "network",
              "cpu": "gloo (CPU ranks)"}
NVLINK_SHARE = 300 / 450   # of the datasheet per-direction rate, as the H100's 300 of 450 GB/s
PCIE_GBS = {4: 20.0, 5: 40.0}  # per GPU with peer access, x16: about 62% of 32 / 64 GB/s per direction


def link_class(kind: str) -> str:
    """The topology class a link name means (an alias's class). Raises ValueError for a name it does not know."""
    kind = LINK_ALIASES.get(kind, kind)
    if kind not in LINKS:
        raise ValueError(f"interconnect {kind!r} is invalid: use one of {', '.join(list(LINKS) + list(LINK_ALIASES))}")
    return kind


def host_link_gbs(gpu: GPU | None) -> float:
    """GB/s of one GPU's copies to and from host memory: its PCIe generation's rate above (assumed: the engine moves a
    model with `module.to`, from and to pageable memory, which for large tensors runs near it; every rank over its own
    x16 link)."""
    return PCIE_GBS[gpu.pcie_gen if gpu else 4]


def link_for(kind: str, gpu: GPU | None) -> Interconnect:
    """The link `kind` (a class or an alias) between GPUs of this kind: NVLink at the GPU's own rate (a GPU without
    NVLink, stated over NVLink anyway, gets the reference rate), the PCIe classes at its generation's (the socket link
    is the CPU's: it does not scale with the GPU, and a GPU's own link may be slower)."""
    kind = link_class(kind)
    base = LINKS[kind]
    if kind == "pcie-socket":
        base = Interconnect(kind, PCIE_SOCKET_GBS, base.latency_us, tree=True)
    if gpu is None:
        return base
    if kind == "nvlink" and gpu.nvlink_gbs:
        return Interconnect(kind, round(gpu.nvlink_gbs / 2 * NVLINK_SHARE), base.latency_us)
    scale = PCIE_GBS[gpu.pcie_gen] / PCIE_GBS[4]
    if kind in ("pcie-switch", "pcie-bridge", "pcie-no-peer"):
        return Interconnect(kind, base.bandwidth_gbs * scale, base.latency_us, tree=base.tree)
    if kind == "pcie-socket":
        return Interconnect(kind, min(base.bandwidth_gbs, LINKS["pcie-bridge"].bandwidth_gbs * scale),
                            base.latency_us, tree=True)
    return base


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
    # measured.Measured: what calibration and finished jobs measured of these devices (None: every figure modelled);
    # the cost model reads it where present, and measured.apply puts its link and memory in the fields above
    measured: object = field(default=None, compare=False)

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
    return Hardware(device="cuda", gpus=gpus, gpu=gpu, gpu_name=gpu.name, link=link_for(link, gpu),
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


# nvidia-smi's path codes, best first, and the class each means: NV# NVLink; PIX one PCIe switch, PXB several switches
# (no CPU between them); PHB a host bridge, NODE host bridges within one NUMA node; SYS across the sockets' link
TOPO_CLASSES = (("NV", "nvlink"), ("PIX", "pcie-switch"), ("PXB", "pcie-switch"), ("PHB", "pcie-bridge"),
                ("NODE", "pcie-bridge"), ("SYS", "pcie-socket"))


def link_from_topo(links: dict[tuple[int, int], str], physical: list[int]) -> str | None:
    """The topology class of these GPUs from nvidia-smi's matrix: the worst path between any two of them ("nvlink"
    only when every pair has an NVLink); None when the matrix does not say."""
    pairs = [(a, b) for a in physical for b in physical if a != b]
    ranks = []
    for pair in pairs:
        cell = links.get(pair, "")
        rank = next((i for i, (code, _) in enumerate(TOPO_CLASSES) if cell.startswith(code)), None)
        if rank is None:
            return None
        ranks.append(rank)
    return TOPO_CLASSES[max(ranks)][1] if ranks else None


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
    link = LINK_ALIASES["pcie"] if peer else "pcie-no-peer"
    if len(gpus) > 1:
        physical = _physical(list(gpus))
        topo = _nvidia_smi_topo() if physical else None
        found = link_from_topo(parse_topo(topo), physical) if topo else None
        if found == "nvlink" or (found and peer):   # without peer access a PCIe path runs through host memory
            link = found
        how = ("nvidia-smi topo -m" + ("" if peer else " and torch's peer-access query") if found else
               "torch's peer-access query" + ("" if topo else ", no nvidia-smi") +
               (", the PCIe path assumed through the CPU's root complex" if peer else ""))
        notes.append(f"link {LINK_NAMES[link]} from {how}")
    return Hardware(device="cuda", gpus=len(gpus), gpu=gpu, gpu_name=gpu.name if gpu else name,
                    memory_gib=memory_gib, link=link_for(link, gpu), notes=tuple(notes))
