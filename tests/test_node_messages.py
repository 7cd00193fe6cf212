"""What a ComfyUI page user reads when the xDiT nodes refuse a graph: the error's type as the pack's own name, and a
message that names the node and the input to change and a value that works, never a command-line flag. The same
refusals keep the engine's own words outside the nodes (the engine's API, `python -m engine`)."""
import importlib
import pickle
import sys
import types

import pytest
import torch

from engine.errors import PlanError
from engine.models.tiny import write_tiny

import test_nodes
from conftest import PACK_NAME, load_pack
from test_nodes import empty_latent, flux_conditioning, sd3_conditioning, settings

# fixtures: the pack's core module (loaded by path as ComfyUI loads it), nodes.py against stand-ins for ComfyUI
core, nodes_module = test_nodes.core, test_nodes.nodes_module


def comfyui_type_name(cls) -> str:
    """execution.full_type_name of ComfyUI 0.3.64 and 0.33.0: what its history and page show as exception_type."""
    return cls.__qualname__ if cls.__module__ == "builtins" else cls.__module__ + "." + cls.__qualname__


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("messages")
    return {"flux": write_tiny("flux", str(d)), "klein": write_tiny("flux2", str(d), variant="flux2-klein-4b"),
            "dev": write_tiny("flux2", str(d), variant="flux2-dev")}


def refusal(core, s, positive=None, negative=None, cfg=1.0, latent=None):
    with pytest.raises(ValueError) as info:
        core.sample(s, positive or flux_conditioning(), negative, latent or empty_latent(), seed=0, steps=1,
                    cfg=cfg, sampler_name="euler", scheduler="simple", denoise=1.0)
    message = str(info.value)
    print(f"{comfyui_type_name(type(info.value))}: {message}")
    assert "\n" not in message and "--" not in message   # one line, no command-line flag
    return info.value


# ---- the error's type ------------------------------------------------------------------------------------------
def test_the_engines_errors_show_as_xdit_names_where_comfyui_shows_a_type_and_pickle_by_their_module():
    # ComfyUI (nodes.load_custom_node) imports a pack folder as a module named by its path, dots made "_x_"
    path_named = load_pack("/home/user/ComfyUI/custom_nodes/ComfyUI-xDiT")
    errors = importlib.import_module(path_named.__name__ + ".engine.errors")
    stall = importlib.import_module(path_named.__name__ + ".engine.parallel.pipefusion.transport").StageStall
    shown = {cls.__name__: comfyui_type_name(cls) for cls in (errors.PlanError, errors.CheckpointError,
                                                              errors.EngineError, errors.JobCancelled, stall)}
    print(shown)
    assert shown == {name: f"xDiT.{name}" for name in shown}
    for error in (errors.PlanError("plan ulysses3 cannot run this job"), stall("stage 1 waited", rank=1),
                  errors.EngineError("rank 1 ran out of memory", rank=1, phase="compute", oom=True, memory={"a": 1})):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and back.args == error.args and vars(back) == vars(error)
    assert isinstance(errors.PlanError("x"), ValueError) and isinstance(errors.JobCancelled("x"), errors.EngineError)
    # the engine outside ComfyUI: the same names, its own classes
    assert comfyui_type_name(PlanError) == "xDiT.PlanError" and isinstance(pickle.loads(pickle.dumps(PlanError("x"))),
                                                                          PlanError)


# ---- plans and GPUs ----------------------------------------------------------------------------------------------
def test_an_explicit_plan_for_more_gpus_than_listed_names_the_engines_plan_and_gpus(core, tiny):
    error = refusal(core, settings(core, tiny["flux"], gpus=(0,), plan="explicit", ulysses=2, cfg_parallel=True))
    assert comfyui_type_name(type(error)) == "xDiT.PlanError"
    assert str(error) == ("xDiT Engine: plan explicit with ulysses 2, cfg_parallel true needs 4 GPUs but gpus lists "
                          "1: list 4 GPUs in gpus, or degrees whose product is 1")


def test_a_plan_the_model_cannot_run_names_the_engines_plan_and_one_that_runs(core, tiny):
    error = refusal(core, settings(core, tiny["flux"], gpus=(0, 1, 2), plan="explicit", ulysses=3))
    assert str(error) == ("xDiT Engine: plan explicit with ulysses 3 cannot run this job: the model has 4 heads: "
                          "ulysses 3 does not divide them; try plan explicit with ring 3")
    tried = settings(core, tiny["flux"], gpus=(0, 1, 2), plan="explicit", ring=3)
    tried.validate()   # the plan it names is one the xDiT Engine takes


def test_a_job_too_large_for_the_machine_names_the_engine_inputs_that_make_it_fit(core, monkeypatch):
    """FLUX.1-dev's 12 B weights in fp32 on CPU ranks of a 32 GiB machine."""
    admission = importlib.import_module(PACK_NAME + ".engine.generate.admission")
    monkeypatch.setattr(admission, "host_memory_gib", lambda: 32.0)
    error = refusal(core, settings(core, "synthetic:flux-dev", gpus=(0, 1)))
    assert str(error).endswith(": set the xDiT Engine's weight_dtype to fp8_e4m3fn or bf16, list fewer gpus, or use "
                               "a machine with more memory")


def test_too_many_gpus_for_any_plan_names_the_engines_gpus(core, tiny):
    error = refusal(core, settings(core, tiny["flux"], gpus=tuple(range(7))), latent=empty_latent(width=16, height=16))
    assert str(error).endswith(": change the xDiT Engine's gpus or the latent's size")


# ---- conditioning from another model's text encoder ------------------------------------------------------------
def test_sd3_conditioning_into_flux2_klein_names_the_text_encoder_the_graph_needs(core, tiny):
    """SD3's CLIP-L+G and T5 conditioning (what TripleCLIPLoader gives) on a FLUX.2 [klein] 4B engine."""
    latent = {"samples": torch.zeros(1, 128, 4, 4)}   # EmptyFlux2LatentImage
    error = refusal(core, settings(core, tiny["klein"]), positive=sd3_conditioning(), latent=latent)
    assert str(error) == ("positive of shape [1, 30, 4096] and a pooled output [1, 2048] is another model's "
                          "conditioning: flux2-klein-4b takes [batch, tokens, 48] and no pooled output; encode the "
                          "prompt with flux2-klein-4b's text encoder, Qwen3 4B (CLIPLoader type flux2 with "
                          "qwen_3_4b.safetensors)")
    dev = refusal(core, settings(core, tiny["dev"]), positive=sd3_conditioning(), latent=latent)
    assert str(dev).endswith("encode the prompt with flux2-dev's text encoder, Mistral-3 24B (CLIPLoader type flux2 "
                             "with mistral_3_small_flux2_bf16.safetensors)")


def test_a_negative_from_another_text_encoder_is_named_as_the_negative(core, tiny):
    s = settings(core, tiny["flux"])
    error = refusal(core, s, negative=[[torch.zeros(1, 8, 3584), {}]], cfg=2.0)   # Qwen-Image's conditioning
    assert str(error).startswith("negative of shape [1, 8, 3584] is another model's conditioning: flux-dev takes "
                                 "[batch, tokens, 4096] and a pooled output [batch, 768]; encode the prompt with "
                                 "flux-dev's text encoder, T5-XXL and CLIP-L (DualCLIPLoader type flux")


def test_the_same_refusals_keep_the_engines_words_outside_the_nodes(tiny):
    from engine.generate.request import GenerateRequest
    from engine.parallel.plan import ParallelPlan
    with pytest.raises(PlanError, match=r"^plan dp=1 x cfg=1 x pipefusion=1 x ulysses=2 x ring=1 needs 2 ranks but "
                       r"the engine has 1: make the product"):
        ParallelPlan(ulysses=2).check_world(1)
    request = GenerateRequest(model=tiny["klein"], cond=torch.zeros(1, 8, 4096), pooled=torch.zeros(1, 2048),
                              latent_raw=torch.zeros(1, 128, 4, 4))
    with pytest.raises(ValueError, match=r"^cond of shape \[1, 8, 4096\] and a pooled output \[1, 2048\] is another"):
        request.validate(1)


# ---- an older ComfyUI --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,version", [("flux2-dev", "0.3.72"), ("flux2-klein-4b", "0.9.2")])
def test_a_comfyui_without_the_familys_model_names_the_release_that_has_it(nodes_module, tiny, monkeypatch, variant,
                                                                          version):
    """The xDiT Engine's MODEL is ComfyUI's own model class for the family: on a ComfyUI older than that class (its
    model detection knows no such file) any use of the MODEL says which release to update to, and that the engine
    output with xDiT Sampler works meanwhile."""
    detection = types.ModuleType("comfy.model_detection")   # a ComfyUI whose detection knows no FLUX.2
    detection.unet_prefix_from_state_dict = lambda sd: ""
    detection.model_config_from_unet = lambda sd, prefix: None
    detection.convert_diffusers_mmdit = lambda sd, prefix: None
    patcher_module = types.ModuleType("comfy.model_patcher")
    patcher_module.ModelPatcher = lambda model, **kw: types.SimpleNamespace(model=model)
    extension = types.ModuleType("comfy.patcher_extension")
    extension.CallbacksMP = types.SimpleNamespace(ON_CLEANUP="on_cleanup")
    extension.WrappersMP = types.SimpleNamespace(CALC_COND_BATCH="calc_cond_batch")
    for name, module in (("comfy.model_detection", detection), ("comfy.model_patcher", patcher_module),
                         ("comfy.patcher_extension", extension)):
        monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(sys.modules["comfy"], name.split(".")[1], module, raising=False)
    monkeypatch.setitem(sys.modules, "comfyui_version", types.SimpleNamespace(__version__="0.3.64"))
    path = tiny["dev" if variant == "flux2-dev" else "klein"]
    s = nodes_module.core.EngineSettings(model_path=path, gpus=(0,), device="cpu")
    model = nodes_module.engine_model(s)
    with pytest.raises(AttributeError) as info:
        model.model.latent_format   # what KSampler reads first
    print(info.value)
    assert str(info.value) == (f"this ComfyUI (0.3.64) does not know {variant} (FLUX.2) models, so the xDiT Engine's "
                               f"MODEL output cannot describe it: update ComfyUI to {version} or newer, or use the xDiT "
                               f"Engine's engine output with xDiT Sampler")
