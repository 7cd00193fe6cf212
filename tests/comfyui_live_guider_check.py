"""Run inside a real ComfyUI's Python (by tests/test_comfyui_live.py): SamplerCustomAdvanced with the xDiT Guider
against the same graph with ComfyUI's own BasicGuider (FLUX) / CFGGuider (SD3) on the model ComfyUI loads from the
same file (UNETLoader), with RandomNoise, KSamplerSelect, BasicScheduler and a SplitSigmas edit; then every sampler
name KSamplerSelect offers through both guiders. The native model is built as UNETLoader builds it, with the tiny
file's widths (ComfyUI's FLUX detection assumes FLUX.1's full widths). Prints one JSON report.
Usage: python comfyui_live_guider_check.py COMFYUI_PATH PACK_LINK_PARENT MODELS_DIR"""
import asyncio
import json
import os
import sys
import time

comfyui, pack_parent, models = sys.argv[1:4]
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, comfyui)
os.chdir(comfyui)
import torch  # noqa: E402
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.samplers  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402

folder_paths.add_model_folder_path("diffusion_models", os.path.join(models, "diffusion_models"))
folder_paths.add_model_folder_path("custom_nodes", pack_parent)
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True))
from comfyui_live_common import call, native_model, rel  # noqa: E402 (tests/, this file's folder)


g = torch.Generator().manual_seed(0)
flux_cond = [[torch.randn(1, 24, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                      "guidance": 3.5}]]
sd3_pos = [[torch.randn(1, 30, 4096, generator=g), {"pooled_output": torch.randn(1, 2048, generator=g)}]]
sd3_neg = [[torch.randn(1, 30, 4096, generator=g), {"pooled_output": torch.randn(1, 2048, generator=g)}]]
latent = {"samples": torch.zeros(1, 16, 8, 8)}
report = {"registered": "XDiTGuider" in nodes.NODE_CLASS_MAPPINGS, "graphs": [], "samplers": {}}


def engine(file, gpus):
    return call("XDiTEngine", model_name=file, family="auto", weight_dtype="default", gpus=gpus, plan="auto",
                ulysses=1, ring=1, cfg_parallel=False, dp=1, timeout_s=600)[0]   # its engine output


def last_job(eng):
    """(plan, model calls) of the engine's last job, as the Info node reports them."""
    text = call("XDiTEngineInfo", engine=eng, unload=False)[0]
    line = next(x for x in text.splitlines() if x.startswith("last job: plan "))
    calls = line.split("model_calls ")[1].split(",")[0] if "model_calls " in line else None
    return line[len("last job: plan "):].split(";")[0], int(calls) if calls else None


def guiders(family, file, gpus, cfg=4.0):
    model = native_model(file)
    eng = engine(file, gpus)
    if family == "flux":
        native = call("BasicGuider", model=model, conditioning=flux_cond)[0]
        ours = call("XDiTGuider", engine=eng, positive=flux_cond, cfg=1.0)[0]
    else:
        native = call("CFGGuider", model=model, positive=sd3_pos, negative=sd3_neg, cfg=cfg)[0]
        ours = call("XDiTGuider", engine=eng, positive=sd3_pos, negative=sd3_neg, cfg=cfg)[0]
    ours.engine = eng
    return model, native, ours


def run(guider, sampler_name, sigmas, seed=5, lat=latent, add_noise=True):
    noise = call("RandomNoise", noise_seed=seed)[0] if add_noise else call("DisableNoise")[0]
    sampler = call("KSamplerSelect", sampler_name=sampler_name)[0]
    return call("SamplerCustomAdvanced", noise=noise, guider=guider, sampler=sampler, sigmas=sigmas,
                latent_image=lat)[0]


for family, file in (("flux", "tiny-flux-dev.safetensors"), ("sd3", "tiny-sd3.5-medium.safetensors")):
    for gpus in ("0", "0,1"):
        model, native, ours = guiders(family, file, gpus)
        sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=4, denoise=1.0)[0]
        high, low = call("SplitSigmas", sigmas=sigmas, step=2)
        entry = {"family": family, "gpus": gpus}
        for name, guider in (("native", native), ("xdit", ours)):
            first = run(guider, "euler", high)
            entry[name] = run(guider, "euler", low, lat=first, add_noise=False)["samples"]
        entry["whole_xdit"] = run(ours, "euler", sigmas)["samples"]
        plan, calls = last_job(ours.engine)
        report["graphs"].append({"family": family, "gpus": gpus, "split_rel_l2": rel(entry["xdit"], entry["native"]),
                                 "split_vs_whole_rel_l2": rel(entry["xdit"], entry["whole_xdit"]),
                                 "plan": plan, "calls": calls})

for family, file in (("flux", "tiny-flux-dev.safetensors"), ("sd3", "tiny-sd3.5-medium.safetensors")):
    model, native, ours = guiders(family, file, "0", cfg=2.0)
    sigmas = call("BasicScheduler", model=model, scheduler="simple", steps=3, denoise=1.0)[0]
    for name in comfy.samplers.SAMPLER_NAMES:
        t0 = time.perf_counter()
        try:
            want = run(native, name, sigmas)["samples"]
            got = run(ours, name, sigmas)["samples"]
            report["samplers"][f"{family}/{name}"] = {"rel_l2": rel(got, want), "calls": last_job(ours.engine)[1],
                                                      "finite": bool(torch.isfinite(got).all()),
                                                      "s": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # reported, not hidden: the test fails on any entry that is not a number
            report["samplers"][f"{family}/{name}"] = {"error": f"{type(e).__name__}: {e}"}
report["ksampler"] = {}
for family, file, pos, neg, cfg in (("flux", "tiny-flux-dev.safetensors", flux_cond, flux_cond, 1.0),
                                    ("sd3", "tiny-sd3.5-medium.safetensors", sd3_pos, sd3_neg, 3.0)):
    model, eng = native_model(file), engine(file, "0,1")
    for sampler_name, scheduler, denoise in (("uni_pc", "simple", 1.0), ("lcm", "beta", 1.0),
                                             ("res_multistep", "karras", 0.7), ("euler", "simple", 1.0)):
        job = dict(seed=3, steps=3, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler, positive=pos,
                   negative=neg, latent_image=latent, denoise=denoise)
        want = call("KSampler", model=model, **job)[0]["samples"]
        got = call("XDiTSampler", engine=eng, **job)[0]["samples"]
        report["ksampler"][f"{family}/{sampler_name}/{scheduler}/{denoise}"] = rel(got, want)
print("REPORT " + json.dumps(report))
