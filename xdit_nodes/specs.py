"""The xDiT nodes' specs, without ComfyUI: each node's inputs (the widgets KSampler users know) and outputs as plain
records that nodes.py turns into ComfyUI V3 schemas, and the check of a file-name widget's value."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import families
from ..engine.models.speed import ATTENTION
from ..engine.parallel.plan import EXPERT_PLACEMENTS
from ..engine.sampling.samplers import SAMPLERS
from ..engine.sampling.schedules import SAMPLING_NODES, SCHEDULERS

ENGINE_TYPE = "XDIT_ENGINE"
ALL_GPUS = "all"   # the gpus widget's value for every GPU this machine has
WEIGHT_DTYPES = ("default", "bf16", "fp16", "fp8_e4m3fn")
FAMILIES = ("auto",) + families.names()

PLANS = ("auto", "explicit", "fastest")   # fastest: auto that may pick PipeFusion (approximate after its warmup)
ATTENTION_KERNELS = tuple(ATTENTION)

# ---- node specs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    name: str
    type: str                       # COMBO, INT, FLOAT, BOOLEAN, STRING, or a socket type (CONDITIONING, ...)
    default: object = None
    options: tuple = ()
    min: float | None = None
    max: float | None = None
    step: float | None = None
    round: float | None = None
    control_after_generate: bool = False
    advanced: bool = False
    optional: bool = False
    tooltip: str = ""


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    display_name: str
    category: str
    description: str
    inputs: tuple[Field, ...]
    outputs: tuple[tuple[str, str], ...]   # (type, name)
    output_node: bool = False


CATEGORY = "sampling/xDiT"


def engine_spec(model_names: list[str]) -> NodeSpec:
    return NodeSpec(
        "XDiTEngine", "xDiT Engine", CATEGORY,
        f"A persistent multi-GPU engine for {families.TITLES}. The same settings reuse the running ranks and the "
        "loaded weights.",
        (Field("model_name", "COMBO", options=tuple(model_names), default=model_names[0] if model_names else None,
               tooltip="diffusion_models or checkpoints file, as ComfyUI's loaders take it (plain, fp8 or GGUF)"),
         Field("family", "COMBO", "auto", FAMILIES, tooltip="auto detects it from the file"),
         Field("weight_dtype", "COMBO", "default", WEIGHT_DTYPES,
               tooltip="default: bf16 on GPUs, fp32 on CPU; fp8_e4m3fn stores weights in fp8, computes in bf16"),
         Field("gpus", "STRING", ALL_GPUS,
               tooltip="all: every GPU this machine has; or GPU indices, e.g. 0,1 (one rank each; when ComfyUI runs "
                       "on the CPU, CPU ranks: all is one per two cores)"),
         Field("plan", "COMBO", "auto", PLANS,
               tooltip="auto picks the fastest exact plan per job (on fewer of the GPUs when that is faster); "
                       "fastest may also pick PipeFusion (approximate after its warmup steps); explicit takes the "
                       "degrees below"),
         Field("ulysses", "INT", 1, min=1, max=8, advanced=True),
         Field("ring", "INT", 1, min=1, max=8, advanced=True),
         Field("cfg_parallel", "BOOLEAN", False, advanced=True),
         Field("dp", "INT", 1, min=1, max=8, advanced=True),
         Field("timeout_s", "INT", 3600, min=10, max=86400, advanced=True,
               tooltip="longest a job may compute before its ranks are replaced"),
         # Inputs added after the first release are optional, with the default that keeps the earlier behaviour, so
         # a prompt or workflow saved before they existed validates and runs unchanged (tests/released_inputs.json).
         Field("cache_threshold", "FLOAT", 0.0, min=0.0, max=1.0, step=0.01, round=0.001, optional=True,
               tooltip="step cache: skip the remaining blocks when the first block's output changed less than this "
                       "since the last full step (0.05 to 0.2 are useful; 0 is off). Info shows the skipped steps"),
         Field("compile", "BOOLEAN", False, advanced=True, optional=True,
               tooltip="torch.compile the transformer blocks: the first job of a size compiles (minutes), later "
                       "jobs reuse the graphs"),
         Field("attention", "COMBO", "auto", ATTENTION_KERNELS, advanced=True, optional=True,
               tooltip="attention kernel on the GPUs; auto lets torch choose"),
         Field("pipefusion", "INT", 1, min=1, max=8, advanced=True, optional=True,
               tooltip="explicit plan: PipeFusion stages; each GPU holds only its stage's blocks (for cards the "
                       "whole model does not fit)"),
         Field("patches", "INT", 0, min=0, max=64, advanced=True, optional=True,
               tooltip="PipeFusion: latent row bands, at least the stages (0: one per stage)"),
         Field("warmup_steps", "INT", 1, min=1, max=10000, advanced=True, optional=True,
               tooltip="PipeFusion: steps on the whole latent before patches use the previous step's K/V; the "
                       "job's steps (or more) gives exactly the one-GPU result"),
         Field("expert_placement", "COMBO", "auto", EXPERT_PLACEMENTS, advanced=True, optional=True,
               tooltip="a clip of two experts (Wan 2.2 A14B): where the idle one waits. auto: on the GPUs beside the "
                       "other where both fit, else in host memory (re-checked each job); resident; host"),
         Field("shard", "INT", 1, min=1, max=8, advanced=True, optional=True,
               tooltip="explicit plan: divide the weights among groups of this many GPUs (a divisor of the other "
                       "degrees' product, e.g. ulysses 4 with shard 4): each GPU holds and reads 1/shard of them and "
                       "gathers a block's whole weights as it runs, for models bigger than one card; auto divides "
                       "them itself where they do not fit otherwise")),
        ((ENGINE_TYPE, "engine"), ("MODEL", "MODEL")))


def checkpoint_spec(ckpt_names: list[str]) -> NodeSpec:
    """ComfyUI's CheckpointLoaderSimple with its outputs in its order (MODEL, CLIP, VAE), the MODEL the xDiT Engine's:
    a stock graph that loads model, text encoder and VAE from one file (LTX-2.3's templates) becomes multi-GPU by
    swapping this loader alone. The engine's settings as the xDiT Engine node takes them; its engine last."""
    engine = engine_spec(ckpt_names)
    name = Field("ckpt_name", "COMBO", options=tuple(ckpt_names), default=ckpt_names[0] if ckpt_names else None,
                 tooltip="checkpoints file, as CheckpointLoaderSimple takes it: the engine runs its diffusion model on "
                         "the GPUs; ComfyUI loads its text encoder and VAE as CheckpointLoaderSimple does")
    return NodeSpec(
        "XDiTCheckpointLoader", "xDiT Checkpoint Loader", CATEGORY,
        "CheckpointLoaderSimple with the diffusion model on the xDiT Engine's GPUs: the same MODEL, CLIP and VAE "
        "outputs in the same order, so a stock graph needs no rewiring; the engine's own output last.",
        (name,) + engine.inputs[1:],
        (("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE"), (ENGINE_TYPE, "engine")))


def vae_loader_spec(vae_names: list[str]) -> NodeSpec:
    """ComfyUI's Load VAE with its decode and encode on the engine's ranks: the same vae_name list and VAE output, so a
    stock graph needs only this loader swapped."""
    return NodeSpec(
        "XDiTVAELoader", "xDiT VAE Loader", CATEGORY,
        "Load VAE with its decode and encode on the xDiT Engine's GPUs: the same VAE as ComfyUI's Load VAE, for VAE "
        "Decode, VAE Encode, their tiled forms and the nodes that encode images themselves (WanImageToVideo, "
        "Wan22ImageToVideoLatent, ...). Each GPU decodes a band of rows of every frame, equal to ComfyUI's own decode "
        "to rounding. Wan 2.1 (and Qwen-Image's) and Wan 2.2 VAEs run on the engine; any other VAE is ComfyUI's own.",
        (Field("vae_name", "COMBO", options=tuple(vae_names), default=vae_names[0] if vae_names else None,
               tooltip="vae file, as Load VAE lists it"),
         Field("engine", ENGINE_TYPE, optional=True,
               tooltip="the xDiT Engine's engine output: its GPUs decode and encode")),
        (("VAE", "VAE"),))


ENGINE_MODEL_TIP = ("the xDiT Engine's MODEL, directly or through ComfyUI's nodes that patch a MODEL (ModelSamplingAuraFlow "
                    "/ SD3 / Flux, CFGNorm, LoRA loaders): the job follows their sampling, post-CFG functions and LoRAs")


def parse_gpus(text: str, device: str, visible: int, cores: int) -> tuple[int, ...]:
    """The gpus widget: "all" is every GPU this machine has (`visible`), or on the CPU one rank per two cores (at
    most 8); else GPU indices separated by commas. One line naming the value and what works otherwise."""
    from ..engine.parallel.plan import MAX_RANKS
    if text.strip().lower() == ALL_GPUS:
        count = visible if device == "cuda" else max(1, cores // 2)
        if count < 1:
            raise ValueError("gpus=all found no GPU: this torch sees none; list GPU indices, or run ComfyUI with --cpu")
        return tuple(range(min(count, MAX_RANKS)))
    try:
        return tuple(int(g) for g in text.replace(" ", "").split(",") if g != "")
    except ValueError:
        raise ValueError(f"gpus={text!r} is invalid: use all, or GPU indices separated by commas, e.g. "
                         f"0,1,2,3") from None


def sampler_spec(sampler_names=SAMPLERS, scheduler_names=SCHEDULERS) -> NodeSpec:
    """The xDiT Sampler's spec; inside ComfyUI with ComfyUI's own sampler and scheduler lists (every name KSampler
    offers: those the engine has run in its own loop, the others are driven by ComfyUI's sampler through the
    guider path)."""
    return NodeSpec(
        "XDiTSampler", "xDiT Sampler", CATEGORY,
        "KSampler on the xDiT engine: the same inputs and the same latent as ComfyUI's KSampler, across several GPUs. "
        "Connect the xDiT Engine's MODEL (through any ModelSampling, CFGNorm or LoRA nodes) to model, or its engine "
        "output to engine.",
        (Field("engine", ENGINE_TYPE, optional=True,
               tooltip="the xDiT Engine's engine output (or connect its MODEL to model instead)"),
         Field("seed", "INT", 0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
         Field("steps", "INT", 20, min=1, max=10000),
         Field("cfg", "FLOAT", 8.0, min=0.0, max=100.0, step=0.1, round=0.01),
         Field("sampler_name", "COMBO", sampler_names[0], tuple(sampler_names)),
         Field("scheduler", "COMBO", scheduler_names[0], tuple(scheduler_names)),
         Field("positive", "CONDITIONING"),
         Field("negative", "CONDITIONING"),
         Field("latent_image", "LATENT"),
         Field("denoise", "FLOAT", 1.0, min=0.0, max=1.0, step=0.01),
         Field("model", "MODEL", optional=True, tooltip=ENGINE_MODEL_TIP)),
        (("LATENT", "LATENT"),))


SAMPLER_SPEC = sampler_spec()


def sampler_advanced_spec(sampler_names=SAMPLERS, scheduler_names=SCHEDULERS) -> NodeSpec:
    """The xDiT Sampler (Advanced)'s spec: KSamplerAdvanced's widgets, in its order, on the engine's MODEL chain."""
    return NodeSpec(
        "XDiTSamplerAdvanced", "xDiT Sampler (Advanced)", CATEGORY,
        "KSamplerAdvanced on the xDiT engine: the same inputs and the same latent, e.g. Wan 2.2's two experts (steps 0 "
        "to k with leftover noise, then k to the end without adding noise). Connect the xDiT Engine's MODEL chain to "
        "model, or its engine output to engine.",
        (Field("add_noise", "COMBO", "enable", ("enable", "disable")),
         Field("noise_seed", "INT", 0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
         Field("steps", "INT", 20, min=1, max=10000),
         Field("cfg", "FLOAT", 8.0, min=0.0, max=100.0, step=0.1, round=0.01),
         Field("sampler_name", "COMBO", sampler_names[0], tuple(sampler_names)),
         Field("scheduler", "COMBO", scheduler_names[0], tuple(scheduler_names)),
         Field("positive", "CONDITIONING"),
         Field("negative", "CONDITIONING"),
         Field("latent_image", "LATENT"),
         Field("start_at_step", "INT", 0, min=0, max=10000),
         Field("end_at_step", "INT", 10000, min=0, max=10000),
         Field("return_with_leftover_noise", "COMBO", "disable", ("disable", "enable")),
         Field("model", "MODEL", optional=True, tooltip=ENGINE_MODEL_TIP),
         Field("engine", ENGINE_TYPE, optional=True,
               tooltip="the xDiT Engine's engine output (or connect its MODEL to model instead)")),
        (("LATENT", "LATENT"),))


SAMPLER_ADVANCED_SPEC = sampler_advanced_spec()


def engine_loop_runs(sampler_name: str, scheduler: str) -> bool:
    """Whether the engine's own loop has this sampler and scheduler (then it runs there, in one job)."""
    return sampler_name in SAMPLERS and scheduler in SCHEDULERS


GUIDER_SPEC = NodeSpec(
    "XDiTGuider", "xDiT Guider", CATEGORY,
    "BasicGuider / CFGGuider on the xDiT engine, for SamplerCustomAdvanced: ComfyUI's own noise, sampler (every "
    "KSamplerSelect name) and sigmas drive the engine one model evaluation at a time. Leave negative unconnected "
    "for FLUX (cfg 1).",
    (Field("engine", ENGINE_TYPE, optional=True,
           tooltip="the xDiT Engine's engine output (or connect its MODEL to model instead)"),
     Field("positive", "CONDITIONING"),
     Field("cfg", "FLOAT", 1.0, min=0.0, max=100.0, step=0.1, round=0.01,
           tooltip="1.0 runs the positive only (FLUX.1, FLUX.2 [dev], distilled FLUX.2 [klein]); above 1 needs the "
                   "negative (SD3/SD3.5, Qwen-Image, FLUX.2 [klein] base)"),
     Field("negative", "CONDITIONING", optional=True),
     Field("model", "MODEL", optional=True,
           tooltip=ENGINE_MODEL_TIP + "; or any MODEL whose sampling settings and post-CFG functions should be used "
                   "with the engine input's weights")),
    (("GUIDER", "GUIDER"),))


def lora_spec(lora_names: list[str]) -> NodeSpec:
    return NodeSpec(
        "XDiTLoRA", "xDiT LoRA", CATEGORY,
        "Applies a LoRA (kohya, ComfyUI/ai-toolkit or diffusers format) inside the engine's ranks. Chain several; "
        "removing one restores the base weights.",
        (Field("engine", ENGINE_TYPE),
         Field("lora_name", "COMBO", options=tuple(lora_names), default=lora_names[0] if lora_names else None),
         Field("strength_model", "FLOAT", 1.0, min=-100.0, max=100.0, step=0.01)),
        ((ENGINE_TYPE, "engine"),))


def check_file_name(input_name: str, value, names, where: str, shown: int = 12) -> bool | str:
    """A node's validate_inputs for a file-name widget (ComfyUI checks no V3 combo value itself): True for a name in
    `names` (the list the widget offers), else one line naming the input, the value, `where` it was looked for and
    what is there. None is what ComfyUI passes at validation for an input linked from another node: its value is not
    known before that node runs, so it passes here and the node checks it when it runs."""
    if value is None:
        return True
    names = sorted(set(names))
    if isinstance(value, str) and value in names:
        return True
    found = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    return f"{input_name} {value!r} is not in {where}; found: {found or 'nothing'}"


SAMPLING_SPEC = NodeSpec(
    "XDiTModelSampling", "xDiT Model Sampling", CATEGORY,
    "ModelSamplingAuraFlow / ModelSamplingSD3 / ModelSamplingFlux for the xDiT engine: the sigma schedule and shift "
    "the engine's sampler (and the xDiT Guider's ComfyUI sampler) use, e.g. aura_flow 3.1 for Qwen-Image's "
    "text-to-image template, 3.0 for its edit template.",
    (Field("engine", ENGINE_TYPE),
     Field("method", "COMBO", "aura_flow", tuple(SAMPLING_NODES),
           tooltip="aura_flow: ModelSamplingAuraFlow; sd3: ModelSamplingSD3; flux: ModelSamplingFlux"),
     Field("shift", "FLOAT", 3.1, min=0.0, max=100.0, step=0.01, round=0.001,
           tooltip="the sampling node's shift (for flux: the shift ModelSamplingFlux computes, e.g. 1.15)")),
    ((ENGINE_TYPE, "engine"),))

CFG_NORM_SPEC = NodeSpec(
    "XDiTCFGNorm", "xDiT CFGNorm", CATEGORY,
    "ComfyUI's CFGNorm for the xDiT engine (Qwen-Image-Edit's templates use strength 1): after CFG, each position's "
    "prediction is scaled so its norm does not exceed the positive prediction's.",
    (Field("engine", ENGINE_TYPE), Field("strength", "FLOAT", 1.0, min=0.0, max=100.0, step=0.01)),
    ((ENGINE_TYPE, "engine"),))

INFO_SPEC = NodeSpec(
    "XDiTEngineInfo", "xDiT Engine Info", CATEGORY,
    "Shows the engine's plan, GPUs, per-rank memory and the last job's timings; unload frees its GPUs.",
    (Field("engine", ENGINE_TYPE), Field("unload", "BOOLEAN", False),
     Field("after", "LATENT", optional=True,
           tooltip="connect the sampler's LATENT so this node runs after the job it reports on")),
    (("STRING", "info"),), output_node=True)

SAVE_CONDITIONING_SPEC = NodeSpec(
    "XDiTSaveConditioning", "xDiT Save Conditioning", CATEGORY,
    "Saves a CONDITIONING (and an optional negative) as the COND.safetensors file `python -m engine generate --cond` "
    "reads: cond, pooled, neg_cond, neg_pooled and reference latents ref_0, ... (neg_ref_0, ...), in ComfyUI's output "
    "folder. Wire your text encoders into it once to run a prompt from the command line.",
    (Field("positive", "CONDITIONING"), Field("negative", "CONDITIONING", optional=True),
     Field("filename_prefix", "STRING", "xdit/cond",
           tooltip="under ComfyUI's output folder; a counter is added, e.g. xdit/cond_00001.safetensors")),
    (("STRING", "path"),), output_node=True)
