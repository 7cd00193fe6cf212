"""The node pack without ComfyUI: it loads by path from a folder of any name, its sampler takes KSampler's
widgets, and its behaviour (engine reuse, CONDITIONING/LATENT in, LATENT out, progress, cancel, automatic plans,
errors) runs the real engine on CPU ranks with values shaped exactly as ComfyUI passes them."""
import importlib
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.tiny import write_tiny

from conftest import PACK_NAME, ROOT, load_pack



@pytest.fixture(scope="module")
def core():
    load_pack()
    module = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    module.REGISTRY.unload()   # engines another module's tests left running: each module starts from none
    yield module
    module.REGISTRY.unload()


@pytest.fixture(scope="module")
def node_specs():
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.specs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes")
    return {"flux": write_tiny("flux", str(d)), "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium"), "dir": d}


def flux_conditioning(seed=0, tokens=24, guidance=3.5):
    """What CLIPTextEncode + FluxGuidance put out: [[t5 [1,N,4096], {"pooled_output": [1,768], "guidance": g}]]."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                         "guidance": guidance}]]


def sd3_conditioning(seed=0, tokens=30):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, 4096, generator=g), {"pooled_output": torch.randn(1, 2048, generator=g)}]]


def empty_latent(batch=1, width=128, height=128):
    """EmptySD3LatentImage's output."""
    return {"samples": torch.zeros(batch, 16, height // 8, width // 8)}


def settings(core, path, gpus=(0,), **kw):
    return core.EngineSettings(model_path=path, gpus=tuple(gpus), device="cpu", **kw)


def test_the_pack_loads_by_path_from_a_folder_of_any_name_and_its_ranks_find_the_engine(tmp_path, models):
    link = tmp_path / "My Custom xDiT Pack-main"
    os.symlink(ROOT, link)
    script = textwrap.dedent(f"""
        import importlib, importlib.util, sys, torch
        assert not any(p and __import__('os').path.samefile(p, {ROOT!r}) for p in sys.path if __import__('os').path.isdir(p))
        spec = importlib.util.spec_from_file_location("pack-under-test", {str(link / '__init__.py')!r},
                                                      submodule_search_locations=[{str(link)!r}])
        pack = importlib.util.module_from_spec(spec); sys.modules["pack-under-test"] = pack; spec.loader.exec_module(pack)
        core = importlib.import_module("pack-under-test.xdit_nodes.core")
        s = core.EngineSettings(model_path={models['flux']!r}, gpus=(0,), device="cpu")
        cond = [[torch.randn(1, 8, 4096), {{"pooled_output": torch.randn(1, 768)}}]]
        out = core.sample(s, cond, cond, {{"samples": torch.zeros(1, 16, 8, 8)}}, seed=1, steps=2, cfg=1.0,
                          sampler_name="euler", scheduler="simple", denoise=1.0)
        core.REGISTRY.unload()
        print("latent", list(out["samples"].shape), "engine module", core.Engine.__module__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "latent [1, 16, 8, 8] engine module pack-under-test.engine.runtime.client" in out.stdout


def test_the_entry_point_is_comfyuis_v3_coroutine_and_needs_comfyui_only_when_called():
    pack = load_pack()
    assert inspect.iscoroutinefunction(pack.comfy_entrypoint)
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS")  # one registration style: V3
    assert "comfy_api" not in sys.modules


RANK_SIDE = ("yunchang", "diffusers", "engine.parallel.attention", "engine.parallel.parallelize",
             "engine.parallel.pipefusion.pipeline", "engine.parallel.cache", "engine.generate.run")


def test_loading_the_pack_in_comfyuis_process_imports_no_rank_side_stack_and_prints_nothing(tmp_path):
    """What ComfyUI does at start-up (with stand-ins for its modules): import the pack by path, await its entry point,
    list its nodes and build their schemas. The parallel stack (yunchang and its torch.jit.script warning,
    diffusers, attention, PipeFusion) is the ranks' and is not imported; with every warning shown, nothing is
    printed."""
    script = textwrap.dedent(f"""
        import asyncio, importlib.util, sys, types

        class Anything:
            def __getattr__(self, name):
                return Anything()

            def __call__(self, *args, **kwargs):
                return Anything()

        def anything(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Anything()

        def module(name, **attrs):
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            m.__getattr__ = anything
            sys.modules[name] = m
            return m

        module("folder_paths", get_filename_list=lambda folder: [], get_folder_paths=lambda folder: [])
        comfy = module("comfy")
        comfy.model_management, comfy.utils, comfy.samplers, comfy.sd = (
            module("comfy.model_management"), module("comfy.utils"), module("comfy.samplers"), module("comfy.sd"))
        comfy.sd.VAE = type("VAE", (), {{}})
        module("nodes", VAELoader=types.SimpleNamespace(vae_list=lambda cls: ["pixel_space"]))
        comfy.samplers.KSampler = types.SimpleNamespace(SAMPLERS=["euler"], SCHEDULERS=["simple"])
        module("comfy_api")
        class IO(Anything):
            ComfyNode = type("ComfyNode", (), {{}})

        module("comfy_api.v0_0_2", ComfyExtension=type("ComfyExtension", (), {{}}), io=IO(), ui=Anything())
        spec = importlib.util.spec_from_file_location("ComfyUI-xDiT", {os.path.join(ROOT, '__init__.py')!r},
                                                      submodule_search_locations=[{ROOT!r}])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pack
        spec.loader.exec_module(pack)

        async def load():
            extension = await pack.comfy_entrypoint()
            return [node.define_schema() and node.__name__ for node in await extension.get_node_list()]

        nodes = asyncio.run(load())
        loaded = sorted(k.removeprefix("ComfyUI-xDiT.") for k in sys.modules)
        rank_side = [m for m in {RANK_SIDE!r} if any(k == m or k.startswith(m + ".") for k in loaded)]
        sys.stderr.write(f"REPORT {{nodes}} {{rank_side}}\\n" if rank_side or len(nodes) != 11 else "")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    out = subprocess.run([sys.executable, "-W", "default", "-c", script], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=120, env=env)
    print(f"stdout {out.stdout!r}\nstderr {out.stderr[-3000:]!r}")
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""


def test_the_sampler_has_ksamplers_widgets_names_defaults_and_order(node_specs):
    ksampler = [("seed", 0), ("steps", 20), ("cfg", 8.0), ("sampler_name", None), ("scheduler", None),
                ("positive", None), ("negative", None), ("latent_image", None), ("denoise", 1.0)]
    fields = [f for f in node_specs.SAMPLER_SPEC.inputs if f.name not in ("engine", "model")]
    assert [f.name for f in fields] == [name for name, _ in ksampler]
    # what stands for KSampler's model: the engine's MODEL chain or its engine output, either one
    assert {f.name: (f.type, f.optional) for f in node_specs.SAMPLER_SPEC.inputs if f.name in ("engine", "model")} \
        == {"engine": ("XDIT_ENGINE", True), "model": ("MODEL", True)}
    for f, (name, default) in zip(fields, ksampler):
        if default is not None:
            assert f.default == default, name
    seed = fields[0]
    assert seed.control_after_generate and seed.max == 0xFFFFFFFFFFFFFFFF
    assert node_specs.SAMPLER_SPEC.outputs == (("LATENT", "LATENT"),)
    assert {"euler", "dpmpp_2m"} <= set(fields[3].options) and {"simple", "normal", "karras"} <= set(fields[4].options)


def test_the_advanced_sampler_has_ksampler_advanceds_widgets_in_its_order(node_specs):
    """nodes.py KSamplerAdvanced (ComfyUI 0.3.64): add_noise, noise_seed, steps, cfg, sampler_name, scheduler,
    positive, negative, latent_image, start_at_step, end_at_step, return_with_leftover_noise; then the MODEL chain or
    the engine, as xDiT Sampler takes them."""
    spec = node_specs.SAMPLER_ADVANCED_SPEC
    assert [(f.name, f.default) for f in spec.inputs] == [
        ("add_noise", "enable"), ("noise_seed", 0), ("steps", 20), ("cfg", 8.0), ("sampler_name", "euler"),
        ("scheduler", "simple"), ("positive", None), ("negative", None), ("latent_image", None), ("start_at_step", 0),
        ("end_at_step", 10000), ("return_with_leftover_noise", "disable"), ("model", None), ("engine", None)]
    assert [f.options for f in spec.inputs if f.name in ("add_noise", "return_with_leftover_noise")] == [
        ("enable", "disable"), ("disable", "enable")]
    assert spec.inputs[1].control_after_generate and all(f.optional for f in spec.inputs[-2:])


def test_two_advanced_windows_on_the_engine_equal_one_run(core, models):
    """KSamplerAdvanced's two-sampler form in the engine's own loop (steps 0-2 with leftover noise, then 2-end without
    adding noise, on 2 ranks under cfg2) gives the one-run latent."""
    from engine.sampling.ksampler import StepWindow
    s = settings(core, models["sd3"], gpus=(0, 1))
    common = dict(seed=4, steps=4, cfg=3.0, sampler_name="euler", scheduler="simple", denoise=1.0)
    pos, neg = sd3_conditioning(1), sd3_conditioning(2)
    whole = core.sample(s, pos, neg, empty_latent(width=64, height=64), **common)["samples"]
    seen = {"first": [], "second": []}
    first = core.sample(s, pos, neg, empty_latent(width=64, height=64), **common, window=StepWindow(0, 2),
                        on_progress=lambda step, total: seen["first"].append((step, total)))
    second = core.sample(s, pos, neg, first, **common,
                         window=StepWindow(2, 10000, force_full_denoise=True, add_noise=False),
                         on_progress=lambda step, total: seen["second"].append((step, total)))["samples"]
    print("progress per window:", seen)
    assert seen == {"first": [(1, 2), (2, 2)], "second": [(1, 2), (2, 2)]}   # each window's steps, as KSamplerAdvanced
    # the same model calls; the hand-over between the windows rounds (x / (1 - sigma), process_out, process_in, the
    # noise scaling), and the later steps carry that rounding like a model call's: the sampling bound covers it
    from tolerance import fp32_bound, report, sampling_amplification
    bound = fp32_bound(whole.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(2, 3.0))
    assert report("two windows on the engine vs one run", (second - whole).abs().max(), bound)
    assert "cfg2" in core.describe(s)
    assert first["xdit_model"] == "sd3.5-medium"
    with pytest.raises(ValueError, match="latent_image was sampled by a sd3.5-medium model and this one is flux-dev"):
        core.sample(settings(core, models["flux"], gpus=(0, 1)), flux_conditioning(), None, first, **common,
                    window=StepWindow(2, 10000, add_noise=False))
    core.REGISTRY.unload(s)


def test_the_sampler_latent_equals_engine_generate_for_the_same_inputs(core, models, tmp_path):
    """xDiT Save Conditioning's file (core.conditioning_file) fed to the command line gives the node's latent."""
    positive, negative = sd3_conditioning(1), sd3_conditioning(2)
    out = core.sample(settings(core, models["sd3"]), positive, negative, empty_latent(), seed=9, steps=3, cfg=4.0,
                      sampler_name="dpmpp_2m", scheduler="karras", denoise=1.0)
    cond_file = tmp_path / "cond.safetensors"
    tensors, metadata = core.conditioning_file(positive, negative)
    assert sorted(tensors) == ["cond", "neg_cond", "neg_pooled", "pooled"] and metadata == {}
    save_file(tensors, str(cond_file), metadata=metadata)
    res = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", models["sd3"], "--cond", str(cond_file),
                          "--seed", "9", "--steps", "3", "--cfg", "4.0", "--sampler", "dpmpp_2m", "--scheduler",
                          "karras", "--width", "128", "--height", "128", "--out", str(tmp_path / "o.safetensors")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    want = load_file(str(tmp_path / "o.safetensors"))["samples"]
    diff = (out["samples"] - want).abs().max().item()
    print(f"xDiT Sampler LATENT vs python -m engine generate: max abs diff {diff}")
    assert torch.equal(out["samples"], want)


def test_a_conditioning_file_keeps_references_and_guidance_for_the_command_line(core):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 16, 8, 8, generator=g)
    positive = [[torch.randn(1, 5, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                        "guidance": 2.5, "reference_latents": [ref, ref * 2],
                                                        "reference_latents_method": "index"}]]
    tensors, metadata = core.conditioning_file(positive)
    assert sorted(tensors) == ["cond", "pooled", "ref_0", "ref_1"] and torch.equal(tensors["ref_1"], ref * 2)
    assert metadata == {"guidance": "2.5", "reference_latents_method": "index"}
    with pytest.raises(ValueError, match="positive holds 2 conditioning entries"):
        core.conditioning_file(positive * 2)


def test_the_engine_is_reused_across_prompts_and_restarts_only_for_new_ranks(core, models):
    s = settings(core, models["flux"])
    core.sample(s, flux_conditioning(), None, empty_latent(), seed=1, steps=1, cfg=1.0, sampler_name="euler",
                scheduler="simple", denoise=1.0)
    first = core.REGISTRY.running(s).engine
    pids = first.pids
    other_model = settings(core, models["sd3"])  # another model, same GPUs: same ranks, new weights
    core.sample(other_model, sd3_conditioning(), sd3_conditioning(3), empty_latent(), seed=1, steps=1, cfg=2.0,
                sampler_name="euler", scheduler="simple", denoise=1.0)
    assert core.REGISTRY.running(other_model).engine is first and first.pids == pids
    two = settings(core, models["flux"], gpus=(0, 1))
    assert core.REGISTRY.running(two) is None
    core.sample(two, flux_conditioning(), None, empty_latent(), seed=1, steps=1, cfg=1.0, sampler_name="euler",
                scheduler="simple", denoise=1.0)
    assert core.REGISTRY.running(two).engine is not first and len(core.REGISTRY.running(two).engine.pids) == 2
    assert core.REGISTRY.unload(two) == 1 and core.REGISTRY.running(two) is None
    assert "not running" in core.describe(two)


def test_progress_arrives_per_step_and_a_cancel_stops_within_one_step_then_the_next_job_runs(core, models):
    s = settings(core, models["flux"])
    seen = []
    core.sample(s, flux_conditioning(), None, empty_latent(), seed=2, steps=4, cfg=1.0, sampler_name="euler",
                scheduler="simple", denoise=1.0, on_progress=lambda step, total: seen.append((step, total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    seen.clear()
    cancelled = importlib.import_module(PACK_NAME + ".engine.errors").JobCancelled  # the pack's own engine
    with pytest.raises(cancelled) as info:
        core.sample(s, flux_conditioning(), None, empty_latent(), seed=2, steps=200, cfg=1.0, sampler_name="euler",
                    scheduler="simple", denoise=1.0, on_progress=lambda step, total: seen.append(step),
                    should_cancel=lambda: len(seen) >= 2)
    print(f"cancel requested after step 2; stopped at step {info.value.step}")
    assert info.value.step <= len(seen) + 1 < 10
    out = core.sample(s, flux_conditioning(), None, empty_latent(), seed=2, steps=2, cfg=1.0, sampler_name="euler",
                      scheduler="simple", denoise=1.0)
    assert torch.isfinite(out["samples"]).all()


@pytest.mark.parametrize("family,cfg,expected", [("sd3", 4.0, "cfg2"), ("flux", 1.0, "ulysses2")])
def test_auto_plan_picks_a_plan_that_fits_the_job_and_gives_the_one_rank_latent(core, models, family, cfg, expected):
    conditioning = sd3_conditioning if family == "sd3" else flux_conditioning
    kw = dict(seed=3, steps=2, cfg=cfg, sampler_name="euler", scheduler="simple", denoise=1.0)
    one = core.sample(settings(core, models[family]), conditioning(1), conditioning(2), empty_latent(), **kw)
    s2 = settings(core, models[family], gpus=(0, 1))
    two = core.sample(s2, conditioning(1), conditioning(2), empty_latent(), **kw)
    assert core.REGISTRY.running(s2).last_plan == expected
    from tolerance import fp32_bound, report, sampling_amplification
    # a rank split sums in another order; the tiny SD3.5 has 4 blocks, the tiny FLUX 4 double + 4 single
    bound = fp32_bound(one["samples"].abs().max(), reduction=4096, depth=4 if family == "sd3" else 8,
                       amplification=sampling_amplification(2, cfg))
    assert report(f"{family} auto plan {expected} on 2 ranks vs 1 rank", (two["samples"] - one["samples"]).abs().max(),
                  bound)
    assert f"last job: plan {expected}" in core.describe(s2)
    assert "rank 1 (cpu): rss" in core.describe(s2)  # each rank reports its own memory
    core.REGISTRY.unload(s2)


def test_the_engine_nodes_pipefusion_settings_run_stages_that_match_one_rank_with_full_warmup(core, models):
    kw = dict(seed=3, steps=2, sampler_name="euler", scheduler="simple", denoise=1.0)
    one = core.sample(settings(core, models["sd3"]), sd3_conditioning(1), sd3_conditioning(2), empty_latent(), cfg=4.0,
                      **kw)
    s2 = settings(core, models["sd3"], gpus=(0, 1), plan="explicit", pipefusion=2, patches=4, warmup_steps=99)
    two = core.sample(s2, sd3_conditioning(1), sd3_conditioning(2), empty_latent(), cfg=4.0, **kw)
    assert core.REGISTRY.running(s2).last_plan == "pipefusion2"
    from tolerance import report
    # warmup beyond the steps: every step on the whole latent, the one-rank latent to fp32 rounding
    assert report("node pipefusion2, warmup >= steps, vs 1 rank", (two["samples"] - one["samples"]).abs().max(), 1e-4)
    shown = core.describe(s2)
    print(shown)
    assert "rank 0: PipeFusion stage 0, blocks 0-1" in shown and "rank 1: PipeFusion stage 1, blocks 2-3" in shown
    with pytest.raises(ValueError, match="patches 3 is fewer than"):
        core.sample(settings(core, models["sd3"], gpus=(0, 1, 2, 3), plan="explicit", pipefusion=4, patches=3),
                    sd3_conditioning(1), sd3_conditioning(2), empty_latent(), cfg=4.0, **kw)
    core.REGISTRY.unload(s2)


def test_latent_keys_other_than_samples_pass_through_as_ksampler_keeps_them(core, models):
    latent = dict(empty_latent(batch=2), batch_index=[4, 7])
    out = core.sample(settings(core, models["flux"]), flux_conditioning(), None, latent, seed=1, steps=1, cfg=1.0,
                      sampler_name="euler", scheduler="simple", denoise=1.0)
    assert out["batch_index"] == [4, 7] and out["samples"].shape == (2, 16, 16, 16)


@pytest.mark.parametrize("change,message", [
    (dict(positive=flux_conditioning() + flux_conditioning()), "holds 2 conditioning entries"),
    (dict(positive=[[torch.zeros(1, 8, 4096), {}]]), "positive's pooled_output is missing: flux-dev takes a pooled conditioning"),
    (dict(positive=[[torch.zeros(1, 8, 4096), {"pooled_output": torch.zeros(1, 768), "area": (8, 8, 0, 0)}]]),
     "carries area"),
    (dict(latent=dict(empty_latent(), noise_mask=torch.ones(1, 1, 16, 16, dtype=torch.int64))),
     "noise_mask of shape \\[1, 1, 16, 16\\] is invalid"),
    (dict(latent={"not": "a latent"}), "latent_image is not a LATENT"),
    (dict(settings=dict(family="sd3")), "family='sd3' but .* holds a flux-dev"),
    (dict(settings=dict(gpus=(0, 0))), "gpus='0,0' is invalid"),
    (dict(settings=dict(plan="explicit", ulysses=2)), "plan explicit with ulysses 2 needs 2 GPUs but gpus lists 1"),
    (dict(cfg=3.0, negative=None), "negative is not a CONDITIONING"),
])
def test_bad_inputs_fail_before_any_rank_starts_naming_the_input(core, models, change, message):
    s = settings(core, models["flux"], **change.pop("settings", {}))
    args = dict(positive=flux_conditioning(), negative=flux_conditioning(1), latent=empty_latent(), cfg=1.0)
    args.update(change)
    before = core.REGISTRY.running(s)
    with pytest.raises(ValueError, match=message):
        core.sample(s, args["positive"], args["negative"], args["latent"], seed=0, steps=1, cfg=args["cfg"],
                    sampler_name="euler", scheduler="simple", denoise=1.0)
    assert core.REGISTRY.running(s) is before  # nothing was started for a bad input


def test_lora_node_chains_without_changing_upstream_settings_and_equals_generate_with_lora(core, node_specs, models, tmp_path):
    spec = node_specs.lora_spec(["a.safetensors"])
    assert [f.name for f in spec.inputs] == ["engine", "lora_name", "strength_model"] and spec.outputs[0][0] == "XDIT_ENGINE"
    from safetensors import safe_open
    with safe_open(models["flux"], "pt") as f:
        n_out, n_in = f.get_slice("double_blocks.0.img_attn.qkv.weight").get_shape()
    g = torch.Generator().manual_seed(5)
    lora = str(tmp_path / "l.safetensors")
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(2, n_in, generator=g) * 0.1,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(n_out, 2, generator=g) * 0.1}, lora)
    base = settings(core, models["flux"])
    chained = base.with_lora(lora, 0.7).with_lora(lora, 0.3)
    assert base.loras == () and chained.loras == ((lora, 0.7), (lora, 0.3))
    assert base.with_lora(lora, 0.0) is base
    positive = flux_conditioning(7)
    out = core.sample(chained, positive, None, empty_latent(), seed=3, steps=2, cfg=1.0, sampler_name="euler",
                      scheduler="simple", denoise=1.0)
    cond_file = tmp_path / "c.safetensors"
    save_file({"cond": positive[0][0], "pooled": positive[0][1]["pooled_output"]}, str(cond_file))
    res = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", models["flux"], "--cond", str(cond_file),
                          "--seed", "3", "--steps", "2", "--width", "128", "--height", "128", "--lora", f"{lora}:1.0",
                          "--out", str(tmp_path / "o.safetensors")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    from tolerance import fp32_bound, report, sampling_amplification
    # W + 0.7 d + 0.3 d and W + 1.0 d round differently: weights equal to fp32 rounding, through 8 blocks and 2 steps
    want = load_file(str(tmp_path / "o.safetensors"))["samples"]
    assert report("LoRA chained 0.7 + 0.3 through the nodes vs generate --lora at 1.0",
                  (out["samples"] - want).abs().max(),
                  fp32_bound(want.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(2)))
    assert "LoRA: " in core.describe(chained)


# ---- validation: a file name not in ComfyUI's folders is refused before anything runs --------------------------
def test_a_file_name_check_accepts_listed_names_refuses_others_naming_what_exists_and_passes_linked_inputs(node_specs):
    names = ["b.gguf", "a.safetensors", "sub/c.safetensors"]
    where = "models/diffusion_models or models/checkpoints"
    assert node_specs.check_file_name("model_name", "a.safetensors", names, where) is True
    assert node_specs.check_file_name("model_name", "sub/c.safetensors", names, where) is True
    message = node_specs.check_file_name("model_name", "flux1-dev.safetensors", names, where)
    print(message)
    assert message == ("model_name 'flux1-dev.safetensors' is not in models/diffusion_models or models/checkpoints; "
                       "found: a.safetensors, b.gguf, sub/c.safetensors")
    # linked from another node: ComfyUI passes None at validation; the node checks the value when it runs
    assert node_specs.check_file_name("model_name", None, names, where) is True
    assert node_specs.check_file_name("lora_name", "x.safetensors", [], "models/loras") == \
        "lora_name 'x.safetensors' is not in models/loras; found: nothing"
    assert node_specs.check_file_name("lora_name", 3, ["3"], "models/loras").startswith("lora_name 3 is not in")
    many = node_specs.check_file_name("lora_name", "z", [f"l{i:02}.safetensors" for i in range(30)], "models/loras")
    assert many.endswith("l11.safetensors and 18 more") and "\n" not in many


@pytest.fixture
def nodes_module(monkeypatch, tmp_path):
    """xdit_nodes/nodes.py imported against stand-ins for ComfyUI's modules: folder_paths over real folders (a
    diffusion_models folder with a .safetensors and a .gguf, a checkpoints folder, a loras folder); comfy_api only as
    far as the module's import needs it. Removed from sys.modules afterwards."""
    import types
    folders = {name: tmp_path / name for name in ("diffusion_models", "checkpoints", "loras")}
    for path in folders.values():
        path.mkdir()
    (folders["diffusion_models"] / "flux-a.safetensors").write_bytes(b"")
    (folders["diffusion_models"] / "flux-q8.gguf").write_bytes(b"")
    (folders["checkpoints"] / "sd35.safetensors").write_bytes(b"")
    (folders["loras"] / "style.safetensors").write_bytes(b"")

    class Anything:
        def __getattr__(self, name):
            return Anything()

        def __call__(self, *args, **kwargs):
            return Anything()

    def anything(attr):
        if attr.startswith("__"):   # __file__, __path__ ...: absent, as inspect and importlib expect
            raise AttributeError(attr)
        return Anything()

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__getattr__ = anything
        monkeypatch.setitem(sys.modules, name, m)
        return m

    def listed(folder):  # ComfyUI's list: its own extensions only (no .gguf)
        return sorted(p.name for p in folders[folder].iterdir() if p.suffix == ".safetensors")

    module("folder_paths", get_filename_list=listed,
           get_folder_paths=lambda folder: [str(folders.get(folder, tmp_path))],
           get_full_path=lambda folder, name: str(folders[folder] / name) if name in listed(folder) else None)
    comfy = module("comfy")
    comfy.model_management, comfy.utils = module("comfy.model_management"), module("comfy.utils")
    io = types.SimpleNamespace(ComfyNode=type("ComfyNode", (), {}), Custom=Anything(), Conditioning=Anything(),
                               Latent=Anything(), String=Anything(), Model=Anything(), Guider=Anything(),
                               Clip=Anything(), Vae=Anything(), NodeOutput=lambda *values, **kwargs: values)
    module("comfy_api")
    module("comfy_api.v0_0_2", ComfyExtension=type("ComfyExtension", (), {}), io=io, ui=Anything())
    load_pack()
    name = PACK_NAME + ".xdit_nodes.nodes"
    sys.modules.pop(name, None)
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


def test_the_engine_and_lora_nodes_validate_their_file_names_at_validation_as_comfyui_calls_them(nodes_module):
    n = nodes_module
    # ComfyUI passes the inputs its validate_inputs names (by keyword); a linked input arrives as None
    for node, name in ((n.XDiTEngine, "model_name"), (n.XDiTLoRA, "lora_name")):
        params = list(inspect.signature(node.validate_inputs).parameters)
        assert params == [name], params   # only this input: ComfyUI skips its own checks for the inputs named
        assert node.validate_inputs(**{name: None}) is True
    for known in ("flux-a.safetensors", "flux-q8.gguf", "sd35.safetensors"):  # the combo's list, .gguf included
        assert n.XDiTEngine.validate_inputs(model_name=known) is True
    refused = n.XDiTEngine.validate_inputs(model_name="flux1-dev.safetensors")
    lora = n.XDiTLoRA.validate_inputs(lora_name="other.safetensors")
    print(refused, lora, sep="\n")
    assert refused == ("model_name 'flux1-dev.safetensors' is not in models/diffusion_models or models/checkpoints; "
                       "found: flux-a.safetensors, flux-q8.gguf, sd35.safetensors")
    assert n.XDiTLoRA.validate_inputs(lora_name="style.safetensors") is True
    assert lora == "lora_name 'other.safetensors' is not in models/loras; found: style.safetensors"


def test_the_checkpoint_loader_gives_checkpointloadersimples_outputs_in_its_order_with_the_engines_model(
        nodes_module, node_specs, models, tmp_path, monkeypatch):
    """xDiT Checkpoint Loader: CheckpointLoaderSimple's outputs at its slots (MODEL, CLIP, VAE; the engine last), so a
    stock graph's links stay where they are; ckpt_name from models/checkpoints, then the xDiT Engine's settings with
    its defaults. The MODEL is the engine's of the checkpoint's diffusion model; CLIP and VAE are what ComfyUI's own
    loader gives with its diffusion model left unread (tests/comfyui_ltx_check.py runs it in ComfyUI against
    CheckpointLoaderSimple)."""
    import types
    n = nodes_module
    spec = node_specs.checkpoint_spec(["sd35.safetensors"])
    engine = node_specs.engine_spec(["sd35.safetensors"])
    assert spec.outputs == (("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE"), ("XDIT_ENGINE", "engine"))
    assert spec.inputs[0].name == "ckpt_name" and spec.inputs[1:] == engine.inputs[1:]
    signature = inspect.signature(n.XDiTCheckpointLoader.execute).parameters
    assert list(signature) == [f.name for f in spec.inputs]
    for f in spec.inputs[1:]:
        assert (signature[f.name].default if f.optional else inspect.Parameter.empty) == \
            (f.default if f.optional else signature[f.name].default), f.name
    assert n.XDiTCheckpointLoader.validate_inputs(ckpt_name="sd35.safetensors") is True
    assert n.XDiTCheckpointLoader.validate_inputs(ckpt_name="flux-a.safetensors") == \
        "ckpt_name 'flux-a.safetensors' is not in models/checkpoints; found: sd35.safetensors"
    (tmp_path / "checkpoints" / "sd35.safetensors").write_bytes(open(models["sd3"], "rb").read())
    loaded = []
    sd = types.SimpleNamespace(
        load_checkpoint_guess_config=lambda *a, **kw: loaded.append((a, kw)) or (None, "CLIP", "VAE", None))
    monkeypatch.setitem(sys.modules, "comfy.sd", sd)
    monkeypatch.setattr(sys.modules["comfy"], "sd", sd, raising=False)
    folder_paths = sys.modules["folder_paths"]
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise", folder_paths.get_full_path, raising=False)
    monkeypatch.setattr(n, "engine_model", lambda settings: ("MODEL", settings))
    inputs = {f.name: f.default for f in spec.inputs if not f.optional}
    out = n.XDiTCheckpointLoader.execute(**{**inputs, "ckpt_name": "sd35.safetensors", "gpus": "0"})
    (path,), kw = loaded[0]
    assert out[0][0] == "MODEL" and out[1:3] == ("CLIP", "VAE") and out[3] is out[0][1]
    assert out[3].model_path == path and path.endswith("checkpoints/sd35.safetensors")
    assert kw["output_model"] is False and kw["output_vae"] and kw["output_clip"]


# ---- a prompt saved with the first release ---------------------------------------------------------------------
def test_the_nodes_take_a_first_release_prompt_and_run_it_as_that_release_did(nodes_module, core, node_specs, models, tmp_path):
    """The xDiT Engine given only its first release's inputs (as ComfyUI passes a saved prompt: absent optional inputs
    are not passed) makes the same settings as with every later input at its default, and those defaults are the
    earlier behaviour: no step cache, no compile, torch's attention choice, no PipeFusion. Its job runs."""
    import json
    n = nodes_module
    (tmp_path / "diffusion_models" / "flux-a.safetensors").write_bytes(open(models["flux"], "rb").read())
    first = json.load(open(os.path.join(ROOT, "tests", "released_inputs.json")))["releases"][0]["nodes"]
    released = {name: e.get("default") for name, e in first["XDiTEngine"]["inputs"].items()}
    released.update(model_name="flux-a.safetensors", gpus="0")
    spec = node_specs.engine_spec(["flux-a.safetensors"])
    later = {f.name: f.default for f in spec.inputs if f.name not in released}
    assert set(later) == {"cache_threshold", "compile", "attention", "pipefusion", "patches", "warmup_steps",
                          "expert_placement", "shard"}
    signature = inspect.signature(n.XDiTEngine.execute).parameters
    for f in spec.inputs:   # what ComfyUI leaves out, the node's own default fills in: the spec's
        assert (signature[f.name].default if f.optional else inspect.Parameter.empty) == \
            (f.default if f.optional else signature[f.name].default), f.name
    built = []   # the MODEL output is ComfyUI's own model class (tests/test_comfyui_live.py builds it in ComfyUI)
    n.engine_model = lambda settings: built.append(settings) or ("MODEL", settings)
    (old, old_model) = n.XDiTEngine.execute(**released)
    (now, now_model) = n.XDiTEngine.execute(**released, **later)
    assert old == now and old_model == ("MODEL", old) and built == [old, now]
    request = core.job_request(old, flux_conditioning(), None, empty_latent()["samples"], cfg=1.0, steps=2)
    assert (request.cache_threshold, request.compile, request.attention, request.plan, request.patches,
            request.expert_placement) == (0.0, False, "auto", "auto", None, "auto")
    out = core.sample(old, flux_conditioning(), flux_conditioning(1), empty_latent(), seed=1, steps=2, cfg=1.0,
                      sampler_name="euler", scheduler="simple", denoise=1.0)
    assert out["samples"].shape == (1, 16, 16, 16) and torch.isfinite(out["samples"]).all()
    shown = core.describe(old)
    assert "last job: plan single rank;" in shown and "step cache" not in shown and "PipeFusion" not in shown
