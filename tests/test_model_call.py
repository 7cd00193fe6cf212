"""The engine as ComfyUI's diffusion model (the xDiT Engine's MODEL), without ComfyUI: a model session answers each
call with what the diffusion model returns for the call's rows, under every plan equal to the model on one rank
(in-process, no engine); the conditioning crosses once; what the MODEL's patches ask that the ranks cannot run is
refused in one line; and the link between a MODEL and the engine opens one session per sampling run, closes it at
ComfyUI's cleanup and reports it to the Info node. ComfyUI's own samplers and nodes on the MODEL run in
tests/test_comfyui_live.py."""
import importlib
import time
import types

import pytest
import torch

from engine.generate.model_call import HeldConditioning, ModelSession
from engine.generate.request import GenerateRequest
from engine.models.flow import FlowModel, Prepared
from engine.models.load import inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan

from conftest import PACK_NAME, load_pack
from tolerance import fp32_bound, report


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("model_call")
    return {"flux": write_tiny("flux", str(d)), "qwen": write_tiny("qwen-image", str(d))}


@pytest.fixture(scope="module")
def local(files):
    """The model on one rank, in this process: the reference."""
    return {name: FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu"))) for name, path in files.items()}


def flux_call(rows=2, seed=0, tokens=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 16, 16, 16, generator=g), torch.full((rows,), 0.7),
            {"context": torch.randn(rows, tokens, 4096, generator=g), "y": torch.randn(rows, 768, generator=g),
             "guidance": torch.full((rows,), 3.5)})


def reference(flow, x, t, c):
    refs = tuple(c.get("ref_latents") or ())
    method = c.get("ref_latents_method") or (flow.family.reference_methods or ("",))[0]
    return flow.output(x, t, Prepared(c["context"], c.get("y"), c.get("guidance", torch.full((x.shape[0],), 3.5)),
                                      tuple(r[:, :, 0] if r.ndim == 5 else r for r in refs), method))


def request(path, x, c, plan, negative=False):
    b = x.shape[0] // 2 if negative else x.shape[0]
    latent = torch.zeros(()).expand(b, 16, *x.shape[2:])
    return GenerateRequest(model=path, cond=c["context"][:b], pooled=c["y"][:b] if "y" in c else None,
                           latent_raw=latent, cfg=2.0 if negative else 1.0,
                           neg_cond=c["context"][b:] if negative else None,
                           neg_pooled=c["y"][b:] if negative and "y" in c else None,
                           plan=plan).validate(plan.world_size)


def bound(want, steps=1):
    return fp32_bound(want.abs().max(), reduction=4096, depth=8, amplification=steps)


@pytest.mark.parametrize("world,plan,rows", [
    (1, ParallelPlan(), 2), (2, ParallelPlan(ulysses=2), 2), (2, ParallelPlan(ring=2), 2),
    (2, ParallelPlan(cfg=2), 2), (2, ParallelPlan(dp=2), 2), (2, ParallelPlan(cfg=2), 1)],
    ids=["single", "ulysses2", "ring2", "cfg2", "dp2", "cfg2-one-row"])
def test_a_model_session_returns_the_diffusion_models_output_under_every_plan(engines, files, local, world, plan, rows):
    """Rows are independent (ComfyUI batches the positive and negative passes): CFG and data parallel split them, a
    row count a group's degree does not divide (one row under cfg2) is computed by each member of the group."""
    x, t, c = flux_call(rows)
    want = reference(local["flux"], x, t, c)
    planned = flux_call(2)   # a session planned for batched passes may later get one pass a call
    with ModelSession(engines(world), request(files["flux"], planned[0], planned[2], plan,
                                              negative=plan.cfg == 2)) as s:
        got = s.call(x, t, c)
    assert got.shape == want.shape
    assert report(f"model call, {plan.describe()}, {rows} row(s)", (got - want).abs().max(), bound(want))


@pytest.mark.parametrize("world,plan", [
    (1, ParallelPlan()), (2, ParallelPlan(cfg=2)), (2, ParallelPlan(dp=2)), (4, ParallelPlan(cfg=2, ulysses=2)),
    (4, ParallelPlan(cfg=2, dp=2))], ids=["single", "cfg2", "dp2", "cfg2-ulysses2", "cfg2-dp2"])
def test_a_steps_passes_at_their_own_text_lengths_run_side_by_side_in_one_round_trip(engines, files, local, world,
                                                                                      plan):
    """A positive of 8 tokens and a negative of 12 (ComfyUI runs them as two calls): one round trip; CFG parallel
    gives each its CFG group, each at its own length, and only rank 0's answer crosses back."""
    x, t, pos = flux_call(2, seed=1, tokens=8)
    _, _, neg = flux_call(2, seed=2, tokens=12)
    want = [reference(local["flux"], x, t, c) for c in (pos, neg)]
    x0, _, planned = flux_call(2)
    planned = {k: torch.cat([pos[k][:1], pos[k][:1]]) if k != "context" else planned[k] for k in planned}
    r = GenerateRequest(model=files["flux"], cond=pos["context"][:1], pooled=pos["y"][:1],
                        latent_raw=torch.zeros(()).expand(2, 16, 16, 16), cfg=2.0, neg_cond=neg["context"][:1],
                        neg_pooled=neg["y"][:1], plan=plan).validate(world)
    with ModelSession(engines(world), r) as s:
        for step in range(2):
            got = s.call_group([(x, t, pos), (x, t, neg)])
        trips, calls = len(s.call_s), s.calls
    for name, g, w in zip(("positive (8 tokens)", "negative (12 tokens)"), got, want):
        assert report(f"{plan.describe()}: {name} of a grouped call", (g - w).abs().max(), bound(w))
    assert (trips, calls) == (2, 4)
    gathers = s.result.ranks[0]["bytes_sent_per_step"]
    print(f"{plan.describe()}: rank 0 sent per round trip {dict(gathers)}; rank 1 {s.result.ranks[1]['bytes_sent_per_step'] if world > 1 else {}}")
    if world > 1:
        assert "cfg_gather" not in gathers and "dp_gather" not in gathers, "rank 0 receives, it sends no output"


def test_a_call_crosses_in_the_compute_dtype_and_the_clips_image_channels_once(engines, tmp_path):
    """bf16 ranks take the input and the conditioning in bf16 (half the bytes of float32, the same values once the
    ranks cast them) and return bf16 outputs the client widens exactly; Wan image-to-video's concatenated image
    channels (ComfyUI's c_concat, attached to x) cross in the first call only."""
    path = write_tiny("wan", str(tmp_path), variant="wan2.1-i2v-14b")
    info = inspect_model(path)
    flow = FlowModel(load_model(path, dtype="bf16", device=torch.device("cpu")))
    g = torch.Generator().manual_seed(4)
    latent, image = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 20, 2, 4, 4, generator=g)
    c = {"context": torch.randn(1, 9, 4096, generator=g), "clip_fea": torch.randn(1, 257, 1280, generator=g)}
    t = torch.tensor([500.0])
    r = GenerateRequest(model=path, cond=c["context"], latent_raw=torch.zeros(()).expand(1, 16, 2, 4, 4),
                        dtype="bf16", clip_vision_output=c["clip_fea"],
                        concat_latent_image=torch.zeros(()).expand(1, 16, 2, 4, 4), plan=ParallelPlan()).validate(1)
    sent = []
    with ModelSession(engines(1), r) as s:
        for k in range(3):
            before = s.sent_bytes
            got = s.call(torch.cat([latent * (k + 1), image], dim=1), t, c)
            sent.append(s.sent_bytes - before)
    x = torch.cat([latent * 3, image], dim=1)
    want = flow.output(x, t, Prepared(c["context"].bfloat16(), None, torch.full((1,), 3.5), (), "",
                                      image_context=c["clip_fea"].bfloat16()))
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    # the same bf16 arithmetic in another process may sum in another order: a few bf16 roundings of the output
    print(f"Wan i2v bf16 through the session vs in process: max abs diff {diff:.3g} (scale {scale:.3g}); bytes sent "
          f"per call {sent}")
    assert got.dtype == torch.float32 and got.shape == latent.shape and diff <= 8 * 2 ** -8 * scale
    latent_bytes, time_bytes = latent.numel() * 2, 4
    assert sent[1:] == [latent_bytes + time_bytes] * 2, "later calls: the latent in bf16 and the timestep only"
    assert sent[0] > latent_bytes + image.numel() * 2 and info.latent.channels == 16


def test_the_conditioning_crosses_once_and_a_changed_one_again(engines, files, local):
    """A sampler passes the same conditioning every call: after the first call only the input and timestep cross.
    A positive and a negative run as separate calls (their text lengths differ) are both held."""
    x, t, c = flux_call(1)
    _, _, c2 = flux_call(1, seed=5, tokens=12)
    with ModelSession(engines(1), request(files["flux"], x, c, ParallelPlan())) as s:
        sent = []
        for k in range(3):
            for cond in (c, c2):
                before = s.sent_bytes
                got = s.call(x * (k + 1), t, cond)
                sent.append(s.sent_bytes - before)
                want = reference(local["flux"], x * (k + 1), t, cond)
                assert report(f"call {k} with conditioning of {cond['context'].shape[1]} tokens",
                              (got - want).abs().max(), bound(want))
    per_call = x.numel() * 4 + t.numel() * 4
    print("bytes sent per call:", sent, "; input and timestep:", per_call)
    assert sent[0] > per_call and sent[1] > per_call and sent[2:] == [per_call] * 4


def test_held_conditioning_keeps_a_few_tensors_per_name_and_resends_a_changed_one():
    held = HeldConditioning(slots=2)
    a, b, c = torch.zeros(1, 3), torch.ones(1, 3), torch.full((1, 3), 2.0)
    assert held.place("context", a)[1] is not None and held.place("context", a) == (0, None)
    assert held.place("context", b)[0] == 1 and held.place("context", a.clone()) == (0, None)
    slot, new = held.place("context", c)   # a third tensor takes the oldest slot
    assert slot == 0 and torch.equal(new, c) and held.place("context", b) == (1, None)
    assert held.place("context", a)[1] is not None   # evicted: sent again


def test_a_one_frame_latent_with_reference_latents_runs_through_the_session(engines, files, local):
    """Qwen-Image: ComfyUI's model hands its diffusion model a one-frame 5-D input and reference latents in model
    space (its extra_conds ran process_in); under ulysses2 the output equals one rank's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 1, 8, 8, generator=g)
    c = {"context": torch.randn(1, 6, 64, generator=g), "ref_latents": [torch.randn(1, 16, 1, 8, 8, generator=g)],
         "ref_latents_method": "index"}
    t = torch.tensor([0.4])
    want = reference(local["qwen"], x, t, c)
    latent = torch.zeros(()).expand(1, 16, 1, 8, 8)
    r = GenerateRequest(model=files["qwen"], cond=c["context"], latent_raw=latent, plan=ParallelPlan(ulysses=2),
                        reference_latents=c["ref_latents"], reference_latents_method="index").validate(2)
    with ModelSession(engines(2), r) as s:
        got = s.call(x, t, c)
    assert got.shape == x.shape
    assert report("Qwen-Image one-frame call with a reference, ulysses2", (got - want).abs().max(), bound(want))


def test_a_model_session_refuses_what_only_the_engines_own_loop_runs(engines, files):
    x, t, c = flux_call(1)
    for plan, words in ((ParallelPlan(pipefusion=2), "pipefusion"), (ParallelPlan(), "step cache")):
        r = request(files["flux"], x, c, plan)
        if words == "step cache":
            r = GenerateRequest(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "cache_threshold": 0.1})
        with pytest.raises(ValueError, match=words):
            ModelSession(engines(2), r)


# ---- the ComfyUI side, with stand-ins for ComfyUI's objects -----------------------------------------------------
def test_a_rank_out_of_memory_in_a_model_call_ends_the_session_on_the_same_ranks(files, tmp_path):
    """Rank 1 runs out of memory at a session's second call (injected) while rank 0 computes it: the call fails with
    one error naming rank 1, its device and the plan, the ranks end the session together and stay (the same
    processes), and the next session answers as the first did, the model still loaded."""
    from engine.errors import EngineError
    from engine.runtime.client import Engine
    from engine.runtime.faults import Fault
    from conftest import FAST

    fault = Fault(rank=1, point="step", action="oom", step=2, marker=str(tmp_path / "fired"))
    x, t, c = flux_call(2)
    with Engine(2, device="cpu", deadlines=FAST, env=fault.env()) as e:
        pids = e.pids
        with ModelSession(e, request(files["flux"], x, c, ParallelPlan(ulysses=2))) as s:
            first = s.call(x, t, c)
            with pytest.raises(EngineError) as info:
                s.call(x, t, c)
        message = str(info.value)
        print(message)
        assert info.value.oom and info.value.rank == 1 and "rank 1 (cpu) ran out of memory" in message
        assert "under ulysses2" in message and e.pids == pids and not e.restarts
        with ModelSession(e, request(files["flux"], x, c, ParallelPlan(ulysses=2))) as s:
            assert torch.equal(s.call(x, t, c), first)
        assert e.pids == pids and not e.restarts


@pytest.fixture(scope="module")
def pack():
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    yield types.SimpleNamespace(core=core, model=importlib.import_module(PACK_NAME + ".xdit_nodes.model"))
    core.REGISTRY.unload()


class Patcher:
    """What the link reads of ComfyUI's ModelPatcher: its weight patches, object patches, options and wrappers."""

    def __init__(self, **kw):
        self.patches, self.object_patches, self.hook_patches = {}, {}, {}
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}
        self.__dict__.update(kw)


class LoRAAdapter:
    """comfy.weight_adapter.LoRAAdapter's shape: name "lora", weights (up, down, alpha, mid, dora_scale, reshape)."""
    name = "lora"

    def __init__(self, up, down, alpha=None, mid=None, dora=None):
        self.weights = (up, down, alpha, mid, dora, None)


def test_the_models_state_dict_lists_comfyuis_parameter_names_as_meta_tensors(pack):
    keys = {"double_blocks.0.img_attn.qkv.weight": ((384, 128), torch.bfloat16), "img_in.bias": ((128,), torch.float32)}
    t = pack.model.EngineTransformer(link=None, keys=keys)
    holder = torch.nn.Module()
    holder.diffusion_model = t
    sd = holder.state_dict()
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in sd.items()} == {
        "diffusion_model." + k: (shape, dtype, "meta") for k, (shape, dtype) in keys.items()}
    assert list(t.parameters()) == []   # nothing for ComfyUI's loader to move or patch in its own process


def test_lora_patches_become_factors_with_comfyuis_scale_and_rows(pack):
    g = torch.Generator().manual_seed(0)
    up, down = torch.randn(384, 4, generator=g), torch.randn(4, 128, generator=g)
    patcher = Patcher(patches={
        "diffusion_model.double_blocks.0.img_attn.qkv.weight": [(0.8, LoRAAdapter(up, down, alpha=8.0), 1.0, None, None)],
        "diffusion_model.double_blocks.1.img_attn.qkv.weight": [
            (1.0, LoRAAdapter(up[:128], down), 1.0, (0, 128, 128), None)],
        "diffusion_model.img_in.bias": [(0.5, ("diff", (torch.ones(128),)), 1.0, None, None)]})
    p = pack.model.weight_patches(patcher)
    assert [(e["key"], e["kind"], e["scale"], e["offset"]) for e in p.entries] == [
        ("double_blocks.0.img_attn.qkv.weight", "lora", 0.8 * 8.0 / 4, None),
        ("double_blocks.1.img_attn.qkv.weight", "lora", 1.0, [0, 128, 128]),
        ("img_in.bias", "diff", 0.5, None)]
    assert torch.equal(p.tensors["0.up"], up) and torch.equal(p.tensors["2.diff"], torch.ones(128))
    again = pack.model.weight_patches(patcher)
    patcher.patches["diffusion_model.img_in.bias"] = [(0.6, ("diff", (torch.ones(128),)), 1.0, None, None)]
    changed = pack.model.weight_patches(patcher)
    assert again.digest == p.digest and changed.digest != p.digest   # the same patches are applied once


@pytest.mark.parametrize("entry,words", [
    ((1.0, LoRAAdapter(torch.ones(4, 2), torch.ones(2, 4), dora=torch.ones(4)), 1.0, None, None), "DoRA"),
    ((1.0, types.SimpleNamespace(name="loha", weights=()), 1.0, None, None), "'loha' weight patch"),
    ((1.0, ("set", (torch.ones(4),)), 1.0, None, None), "'set' weight patch"),
    ((1.0, LoRAAdapter(torch.ones(4, 2), torch.ones(2, 4)), 0.5, None, None), "base-weight strength"),
])
def test_weight_patches_the_ranks_cannot_apply_are_refused_naming_them(pack, entry, words):
    patcher = Patcher(patches={"diffusion_model.img_in.weight": [entry]})
    with pytest.raises(pack.model.ModelPatchError, match=words) as e:
        pack.model.weight_patches(patcher)
    assert "\n" not in str(e.value) and "img_in.weight" in str(e.value)


@pytest.mark.parametrize("patch,words", [
    (dict(object_patches={"diffusion_model": object()}), "replaced the MODEL's diffusion_model"),
    (dict(hook_patches={"hook": 1}), "hook weight patches"),
    (dict(model_options={"transformer_options": {"patches_replace": {"dit": {("double_block", 0): print}}}}),
     "patches_replace dit"),
    (dict(model_options={"transformer_options": {"wrappers": {"diffusion_model": {"other": [print]}}}}),
     "diffusion-model wrapper"),
])
def test_model_patches_that_act_inside_comfyuis_diffusion_model_are_refused(pack, patch, words):
    with pytest.raises(pack.model.ModelPatchError, match=words) as e:
        pack.model.check_chain(Patcher(**patch))
    assert "\n" not in str(e.value) and ("remove that node" in str(e.value) or "LoraLoaderModelOnly" in str(e.value))
    pack.model.check_chain(Patcher(object_patches={"model_sampling": object()}))   # a sampling node: fine


class Const:
    pass


class FluxSampling(Const):
    def __init__(self, shift):
        self.shift = shift


class DiscreteFlow(Const):
    def __init__(self, shift, multiplier):
        self.shift, self.multiplier = shift, multiplier


class CFGNorm:
    """Shaped as ComfyUI's comfy_extras/nodes_cfg.py CFGNorm: its post-CFG function closes over `strength`."""

    @classmethod
    def execute(cls, strength):
        def cfg_norm(args):
            return args["denoised"] * strength
        return cfg_norm


def test_the_engines_own_loop_takes_a_chains_sampling_and_cfgnorm_and_names_what_it_cannot(pack):
    from engine.sampling.schedules import FlowSampling
    classes = pack.model.SamplingClasses(FluxSampling, DiscreteFlow, Const)

    def chain(sampling, post=(), **options):
        p = Patcher(model_options={"transformer_options": {}, "sampler_post_cfg_function": list(post), **options})
        p.get_model_object = lambda name: sampling
        return p
    flux = FlowSampling.flux(1.15)
    assert pack.model.loop_settings(chain(FluxSampling(1.3), [CFGNorm.execute(0.9)]), classes, flux) == (
        {"kind": "flux", "shift": 1.3, "multiplier": 1.0}, 0.9, [])
    sd3 = FlowSampling.discrete_flow(3.0)
    assert pack.model.loop_settings(chain(DiscreteFlow(8.0, 1000.0)), classes, sd3)[2] == []
    reasons = pack.model.loop_settings(chain(DiscreteFlow(3.0, 1.0)), classes, sd3)[2]
    assert reasons == ["its model sampling gives timesteps of sigma x 1"]
    reasons = pack.model.loop_settings(chain(FluxSampling(1.0), [lambda args: args["denoised"]],
                                             sampler_cfg_function=print), classes, flux)[2]
    assert len(reasons) == 2 and "post-CFG function" in reasons[0] and reasons[1] == "it sets sampler_cfg_function"
    assert "not a flow" in pack.model.loop_settings(chain(object()), classes, flux)[2][0]


class ComfyModel:
    """What ComfyUI's BaseModel is to the link: the holder of the diffusion model and of the sampling patcher."""
    current_patcher = None


def test_a_sampling_run_opens_one_session_closes_it_at_cleanup_and_reports_it(pack, files, local):
    """The diffusion model called as ComfyUI's _apply_model calls it, positive and negative batched (cond_or_uncond
    [0, 1]) on 2 ranks: cfg2 splits the rows; after ComfyUI's cleanup the Info node shows the run, and the machine
    keeps its calls' step for the plan."""
    core, model = pack.core, pack.model
    settings = core.EngineSettings(model_path=files["flux"], gpus=(0, 1), device="cpu")
    link = core.model_link(settings)
    transformer = model.EngineTransformer(link, {})
    owner = ComfyModel()
    owner.current_patcher = Patcher()
    link.owner = lambda: owner
    x, t, c = flux_call(2)
    options = {"cond_or_uncond": [0, 1], "sigmas": t[:1]}
    for step in range(3):
        got = transformer(x * (step + 1), t, context=c["context"], y=c["y"], guidance=c["guidance"],
                          transformer_options=options)
        want = reference(local["flux"], x * (step + 1), t, c)
        assert report(f"step {step} through the MODEL's diffusion model", (got - want).abs().max(), bound(want))
    record = core.REGISTRY.running(settings)
    assert record.open_session is link and link.session.calls == 3
    link.on_cleanup(owner.current_patcher)
    shown = core.describe(settings)
    print(shown)
    assert record.open_session is None and link.session is None
    assert "last job ran: ComfyUI's sampler on the engine's MODEL" in shown and "last job: plan cfg2;" in shown \
        and "model_calls 3" in shown
    work = link._request.workload(inspect_model(files["flux"]))   # a call is a step: kept for auto's next choice
    assert core.REGISTRY.machine(settings).measured().step(work, ParallelPlan(cfg=2))["step_ms"] > 0


@pytest.mark.parametrize("kwargs,words", [
    (dict(control={"output": []}), "ControlNet"),
    (dict(attention_mask=torch.tensor([[1, 0]])), "attention mask"),
    (dict(c_concat=torch.zeros(1)), "'c_concat'"),
    (dict(transformer_options={"patches": {"attn2_patch": [print]}}), "patches attn2_patch"),
])
def test_a_call_the_ranks_cannot_run_is_refused_before_any_job(pack, files, kwargs, words):
    core, model = pack.core, pack.model
    link = core.model_link(core.EngineSettings(model_path=files["flux"], gpus=(0,), device="cpu"))
    x, t, c = flux_call(1)
    with pytest.raises(model.ModelPatchError, match=words) as e:
        model.EngineTransformer(link, {})(x, t, context=c["context"], **kwargs)
    assert "\n" not in str(e.value) and link.session is None


def test_comfyuis_interrupt_during_a_long_first_load_ends_the_call_at_the_next_tensor(pack, files, monkeypatch):
    """The first call of a sampling run loads the model (minutes for a large file): ComfyUI's interrupt, polled while
    the call waits, stops the load on every rank at its next tensor (each tensor read is slowed by LOAD_DELAY_MS
    here, the cause this test controls) and raises ComfyUI's interrupt; the ranks stay up and the next run loads."""
    from engine.models.load import LOAD_DELAY_ENV
    delay_ms, tensors = 150, 148   # the tiny FLUX file's tensors: a whole load takes at least 22 s here (a busy
    #                                machine still interrupts within a few seconds: the margin is the point)
    monkeypatch.setenv(LOAD_DELAY_ENV, str(delay_ms))   # the ranks read it from their environment
    core, model = pack.core, pack.model
    registry = core.EngineRegistry()
    settings = core.EngineSettings(model_path=files["flux"], gpus=(0, 1), device="cpu")

    class Interrupted(Exception):   # ComfyUI's InterruptProcessingException
        pass

    def interrupted():
        raise Interrupted("processing interrupted")
    link = core.model_link(settings, should_cancel=lambda: True, on_cancelled=interrupted, registry=registry)
    try:
        engine = registry.get(settings).engine   # started before the clock: the load is what is timed
        x, t, c = flux_call(1)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            model.EngineTransformer(link, {})(x, t, context=c["context"], y=c["y"], guidance=c["guidance"],
                                              transformer_options={"cond_or_uncond": [0]})
        elapsed = time.monotonic() - t0
        whole = delay_ms * tensors / 1e3
        print(f"interrupted after {elapsed:.2f} s; the whole load takes at least {whole:.1f} s")
        assert elapsed < whole / 2 and link.session is None and not engine.restarts
        monkeypatch.delenv(LOAD_DELAY_ENV)
        assert torch.equal(engine.submit("echo", {}, {"x": torch.ones(2)}).outputs["x"], torch.ones(2))
    finally:
        registry.unload()


def test_a_session_the_ranks_ended_on_their_own_is_opened_again_and_fails_no_prompt(pack, files, local):
    """The ranks wait for a session's next call at most their collective timeout (2 s here), then end it. The run's
    next call opens a new session (the model still loaded) and is answered; a session left open when the next prompt
    starts is closed without raising what ended it."""
    from conftest import FAST
    core, model = pack.core, pack.model
    Engine = importlib.import_module(PACK_NAME + ".engine.runtime.client").Engine   # the pack's, as its nodes use
    registry = core.EngineRegistry()
    settings = core.EngineSettings(model_path=files["flux"], gpus=(0, 1), device="cpu")
    registry._records[settings.ranks_key] = core.EngineRecord(
        Engine(2, device="cpu", deadlines=FAST, collective_timeout_s=2), settings)
    link = core.model_link(settings, registry=registry)
    transformer = model.EngineTransformer(link, {})
    x, t, c = flux_call(1)
    want = reference(local["flux"], x, t, c)
    try:
        for k in range(2):
            got = transformer(x, t, context=c["context"], y=c["y"], guidance=c["guidance"],
                              transformer_options={"cond_or_uncond": [0]})
            assert report(f"call {k}", (got - want).abs().max(), bound(want))
            time.sleep(3.5)   # past the ranks' wait for a call: they end the session
        engine = registry.running(settings).engine
        assert registry.get(settings).open_session is None and not engine.restarts   # the stale one closed quietly
        assert torch.equal(engine.submit("echo", {}, {"x": torch.ones(2)}).outputs["x"], torch.ones(2))
    finally:
        registry.unload()


def test_a_weight_patch_set_the_ranks_keep_crosses_as_its_digest_the_next_time(engines, files):
    """A LoRA on the MODEL (a Wan 2.2 distillation LoRA on both experts: one set per expert) is sent whole once; the
    next session with the same set sends its digest alone and the ranks use the copy they kept, with the same output;
    the ranks keep two sets (one per resident model), so a third sends the least recently used whole again."""
    from engine.models.lora import WeightPatches
    g = torch.Generator().manual_seed(6)

    def patch_set(digest, scale):
        entry = {"key": "double_blocks.0.img_attn.qkv.weight", "kind": "lora", "scale": scale, "offset": None}
        return WeightPatches(digest, (entry,), {"0.up": torch.randn(384, 2, generator=g),
                                                 "0.down": torch.randn(2, 128, generator=g)})
    sets = {"a": patch_set("a", 0.5), "b": patch_set("b", 0.25), "c": patch_set("c", 0.125)}
    x, t, c = flux_call(1)
    r = request(files["flux"], x, c, ParallelPlan(ulysses=2))
    engine, outs, carried = engines(2), {}, []
    for name in ("a", "b", "a", "c", "b"):
        with ModelSession(engine, r, sets[name]) as s:
            outs.setdefault(name, []).append(s.call(x, t, c))
            carried.append(any(k.startswith("patch.") for k in s._session.inputs))
    print("patch tensors sent per session:", carried)
    assert carried == [True, True, False, True, True]   # a kept; c evicts b (least recently used), which is resent
    assert all(torch.equal(o[0], o[-1]) for o in outs.values())
    assert not torch.equal(outs["a"][0], outs["b"][0])
