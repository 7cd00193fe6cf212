"""Every xDiT Engine input (and the xDiT LoRA, Model Sampling and CFGNorm settings) takes effect on the next job when
it changes between prompts: it travels with each job, sets that job's deadlines, or names a new rank group. Values are
shaped as ComfyUI passes them; tiny models on CPU ranks, one running engine reused as ComfyUI reuses it."""
import dataclasses
import importlib
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.tiny import write_tiny

import test_model_route
import test_nodes
from conftest import PACK_NAME
from test_nodes import empty_latent, flux_conditioning, sd3_conditioning, settings

core = test_nodes.core   # fixture: the pack's core module, loaded by path as ComfyUI loads it
ENGINE_INPUT = {   # EngineSettings field -> the xDiT Engine input it comes from (the others: the chained nodes)
    "model_path": "model_name", "gpus": "gpus", "device": "ComfyUI's --cpu", "family": "family",
    "weight_dtype": "weight_dtype", "plan": "plan", "ulysses": "ulysses", "ring": "ring",
    "cfg_parallel": "cfg_parallel", "dp": "dp", "timeout_s": "timeout_s", "loras": "xDiT LoRA",
    "cache_threshold": "cache_threshold", "compile": "compile", "attention": "attention",
    "pipefusion": "pipefusion", "patches": "patches", "warmup_steps": "warmup_steps",
    "sampling": "xDiT Model Sampling", "cfg_norm": "xDiT CFGNorm", "expert_placement": "expert_placement",
    "shard": "shard"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("settings")
    flux = write_tiny("flux", str(d))
    with safe_open(flux, "pt") as f:
        n_out, n_in = f.get_slice("double_blocks.0.img_attn.qkv.weight").get_shape()
    g = torch.Generator().manual_seed(5)
    lora = str(d / "style.safetensors")
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(2, n_in, generator=g) * 0.1,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(n_out, 2, generator=g) * 0.1}, lora)
    return {"flux": flux, "schnell": write_tiny("flux", str(d), variant="flux-schnell"),
            "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium"), "lora": lora}


@pytest.fixture(scope="module")
def registry(core):
    """The engines of this module's prompts, as ComfyUI's process keeps them between prompts."""
    r = core.EngineRegistry()
    yield r
    r.unload()


def run(core, registry, s, *, cfg=1.0, steps=2, seed=3, **kw):
    family = "sd3" if "sd3" in s.model_path else "flux"
    positive = sd3_conditioning(1) if family == "sd3" else flux_conditioning(1)
    negative = sd3_conditioning(2) if family == "sd3" else None
    return core.sample(s, positive, negative, empty_latent(width=64, height=64), seed=seed, steps=steps, cfg=cfg,
                       sampler_name="euler", scheduler="simple", denoise=1.0, registry=registry, **kw)["samples"]


def test_every_engine_setting_reaches_each_job_its_deadlines_or_a_new_rank_group(core, files):
    """What the running ranks keep between prompts is keyed by the device and GPU list only; every other setting is
    read again for each job: it is in the job's request, sets the job's deadlines, or is checked before it starts."""
    base = settings(core, files["flux"], gpus=(0, 1))
    changed = {"model_path": files["schnell"], "gpus": (0,), "device": "cuda", "family": "sd3",
               "weight_dtype": "fp8_e4m3fn", "plan": "explicit", "ulysses": 2, "ring": 2, "cfg_parallel": True,
               "dp": 2, "timeout_s": 10, "loras": ((files["lora"], 0.5),), "cache_threshold": 0.2, "compile": True,
               "attention": "math", "pipefusion": 2, "patches": 4, "warmup_steps": 3,
               "sampling": ("flux", 3.0, 1.0), "cfg_norm": 1.0, "expert_placement": "host", "shard": 2}
    assert set(changed) == {f.name for f in dataclasses.fields(core.EngineSettings)} == set(ENGINE_INPUT)

    def job(s):   # the request as the job carries it (plan: the degrees asked for, resolved per job)
        request = core.job_request(s, flux_conditioning(1), None, empty_latent()["samples"], cfg=1.0, steps=4)
        return {f.name: getattr(request, f.name) for f in dataclasses.fields(request)
                if not isinstance(getattr(request, f.name), torch.Tensor)}

    def checked(s):
        try:
            s.validate()
        except ValueError:
            return True
        return False

    reached = {}
    for name, value in changed.items():
        base_s = base
        if name in ("ulysses", "ring", "cfg_parallel", "dp", "pipefusion"):   # read with an explicit plan
            base_s = dataclasses.replace(base, plan="explicit")
        elif name == "shard":                                               # ... dividing its 2 ranks
            base_s = dataclasses.replace(base, plan="explicit", ulysses=2)
        elif name in ("patches", "warmup_steps"):                           # ... with PipeFusion stages
            base_s = dataclasses.replace(base, plan="explicit", pipefusion=2)
        s = dataclasses.replace(base_s, **{name: value})
        ways = [way for way, differs in (("new ranks", s.ranks_key != base_s.ranks_key),
                                         ("the job's request", job(s) != job(base_s)),
                                         ("the job's deadlines", s.deadlines != base_s.deadlines),
                                         ("checked before the job", checked(s) and not checked(base_s))) if differs]
        reached[ENGINE_INPUT[name]] = ways
    print("\n".join(f"{k}: {', '.join(v) or 'NOTHING'}" for k, v in reached.items()))
    assert all(reached.values()), [k for k, v in reached.items() if not v]
    assert {k for k, v in reached.items() if "new ranks" in v} == {"gpus", "ComfyUI's --cpu"}   # the only restarts
    assert reached["timeout_s"] == ["the job's deadlines"]


def test_a_run_on_the_engines_model_gets_the_timeout_set_for_it_not_the_first_runs(core, files):
    """A sampling run of ComfyUI's sampler on the engine's MODEL (KSampler, the xDiT Guider) opens its engine session
    with the xDiT Engine's timeout_s of its own prompt."""
    first = settings(core, files["flux"], timeout_s=3600)
    latent = empty_latent(width=64, height=64)["samples"]
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    seen = []
    for s in (first, dataclasses.replace(first, timeout_s=10)):
        model = test_model_route.engine_model(core, s, "flux")
        engine = core.REGISTRY.get(s).engine
        session = engine.session
        engine.session = lambda *a, **kw: seen.append(kw["deadlines"].compute_s) or session(*a, **kw)
        try:
            test_model_route.ksampler(model, "flux", flux_conditioning(1), None, 1.0, torch.randn_like(latent),
                                      latent, sigmas)
        finally:
            del engine.session
    assert seen == [3600.0, 10.0]


def _with_lora(s, files):
    return s.with_lora(files["lora"], 0.8)


CHANGES = {   # name -> (model, cfg, steps, the change as the node makes it)
    "weight_dtype bf16": ("flux", 1.0, 2, lambda s, files: dataclasses.replace(s, weight_dtype="bf16")),
    "weight_dtype fp8_e4m3fn": ("flux", 1.0, 2, lambda s, files: dataclasses.replace(s, weight_dtype="fp8_e4m3fn")),
    "model_name": ("flux", 1.0, 2, lambda s, files: dataclasses.replace(s, model_path=files["schnell"])),
    "xDiT LoRA": ("flux", 1.0, 2, _with_lora),
    "xDiT Model Sampling": ("flux", 1.0, 2, lambda s, files: s.with_sampling("flux", 3.0)),
    "xDiT CFGNorm": ("sd3", 4.0, 2, lambda s, files: s.with_cfg_norm(0.5)),
    "cache_threshold": ("flux", 1.0, 6, lambda s, files: dataclasses.replace(s, cache_threshold=0.9)),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_setting_changed_after_a_job_applies_to_the_next_and_changing_it_back_gives_the_first_latent(
        core, files, registry, change):
    model, cfg, steps, make = CHANGES[change]
    before = settings(core, files[model])
    after = make(before, files)
    first = run(core, registry, before, cfg=cfg, steps=steps)
    engine = registry.running(before).engine
    changed = run(core, registry, after, cfg=cfg, steps=steps)
    cache = registry.running(after).last_cache
    back = run(core, registry, before, cfg=cfg, steps=steps)
    print(f"{change}: max abs change {(changed - first).abs().max():.3g}; back to the first setting: "
          f"{(back - first).abs().max():.3g}")
    assert registry.running(after).engine is engine, "a per-job setting restarted the ranks"
    assert not torch.equal(changed, first), f"{change} did not reach the next job"
    assert torch.equal(back, first), f"{change} outlived the job it was set for"
    if change == "cache_threshold":
        assert cache["skipped_calls"] > 0 and not registry.running(before).last_cache


def test_plan_settings_changed_after_a_job_apply_to_the_next_job(core, files, registry):
    """plan, its degrees and PipeFusion's patches and warmup steps, changed prompt to prompt on one 2-GPU engine."""
    auto = settings(core, files["sd3"], gpus=(0, 1))
    steps = [
        (auto, "cfg2", None),
        (dataclasses.replace(auto, plan="explicit", ulysses=2), "ulysses2", None),
        (dataclasses.replace(auto, plan="explicit", ring=2), "ring2", None),
        (dataclasses.replace(auto, plan="explicit", pipefusion=2, patches=2, warmup_steps=1), "pipefusion2", (2, 1)),
        (dataclasses.replace(auto, plan="explicit", pipefusion=2, patches=4, warmup_steps=2), "pipefusion2", (4, 2)),
        (auto, "cfg2", None),
    ]
    engine = None
    for s, plan, stages in steps:
        run(core, registry, s, cfg=4.0, steps=2)
        record = registry.running(s)
        engine = engine or record.engine
        shown = [(st["patches"], st["warmup_steps"]) for st in record.last_stages]
        print(f"plan {s.plan} ulysses {s.ulysses} ring {s.ring} pipefusion {s.pipefusion} patches {s.patches} "
              f"warmup {s.warmup_steps}: ran {record.last_plan}, stages {shown}")
        assert record.engine is engine and record.last_plan == plan
        assert shown == ([stages] * 2 if stages else [])


def test_a_timeout_lowered_after_a_first_job_stops_the_next_job_at_the_new_limit(core, files, registry):
    """Last in this module: the job that runs past its limit takes its ranks down (the next job replaces them)."""
    engine_error = importlib.import_module(PACK_NAME + ".engine.errors").EngineError
    first = settings(core, files["flux"], timeout_s=3600)   # ComfyUI's INT widget: 10 .. 86400
    run(core, registry, first)
    lowered = dataclasses.replace(first, timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(engine_error) as info:
        run(core, registry, lowered, steps=10000,   # minutes of compute on a CPU rank
            should_cancel=lambda: time.monotonic() - t0 > 60)   # were the limit not applied: fail in a minute
    took = time.monotonic() - t0
    print(f"stopped after {took:.1f} s: {info.value}")
    assert 10 <= took < 20, "the job ran to the first job's limit, not its own"
    message = str(info.value)
    assert "(10 s, the xDiT Engine's timeout_s: raise it for longer jobs)" in message and "\n" not in message
