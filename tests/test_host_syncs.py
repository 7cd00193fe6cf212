"""The step loop of every plan never makes the host wait for the device per layer, patch or model call: each rank's
instrument (engine/syncs.py, armed by XDIT_HOST_SYNCS=count in the ranks' environment) counts, per step, reads of
device tensors on the host, blocking uploads to the device and host waits on transfers, on real rank processes (gloo,
CPU) and the tiny FLUX.1-dev / SD3.5-medium checkpoints. After the first step (which builds what a job builds once)
a step makes none; over the whole job no place in the code makes one more often than once per pass group, so none
scales with layers, patches or calls. The step cache's decisions are read a call late (counted apart, not a sync)."""
import os

import pytest
import torch

from conftest import FAST
from engine import syncs
from engine.generate.request import GenerateRequest
from engine.parallel.plan import ParallelPlan
from engine.runtime.client import Engine

STEPS = 3


@pytest.fixture(scope="module")
def counting():
    """counting(world): a CPU engine of that many ranks whose ranks count their host synchronisations."""
    started = {}

    def get(world):
        if world not in started:
            before = os.environ.get(syncs.ENV)
            os.environ[syncs.ENV] = "count"   # the ranks inherit the environment when they start
            try:
                started[world] = Engine(world, device="cpu", deadlines=FAST)
            finally:
                if before is None:
                    del os.environ[syncs.ENV]
                else:
                    os.environ[syncs.ENV] = before
        return started[world]
    yield get
    for e in started.values():
        e.close()


def request(tiny_models, family, plan, *, cfg=1.0, batch=1, steps=STEPS, **kw):
    g = torch.Generator().manual_seed(11)
    pooled = 768 if family == "flux" else 2048
    return GenerateRequest(model=tiny_models[family], cond=torch.randn(batch, 24, 4096, generator=g),
                           pooled=torch.randn(batch, pooled, generator=g), latent_raw=torch.zeros(batch, 16, 16, 16),
                           seed=5, steps=steps, cfg=cfg, neg_cond=torch.randn(1, 24, 4096, generator=g),
                           neg_pooled=torch.randn(1, pooled, generator=g), plan=ParallelPlan(**plan), **kw).validate()


def counted(counting, r) -> list[dict]:
    """Each rank's count of the job: per_step (one bucket per step reported, bucket 0 the first step and the job's
    set-up) and where (each place in the code, how often in the job)."""
    result = counting(r.plan.world_size).submit("generate", *r.to_job())
    counts = [rank["host_syncs"] for rank in result.ranks if not rank.get("idle")]
    assert len(counts) == r.plan.world_size and all(c["mode"] == "count" for c in counts)
    return counts, result


SYNCS = ("read", "upload", "wait")


def check(name: str, counts: list[dict], steps: int, per_job: int = 2) -> None:
    for rank, c in enumerate(counts):
        per_step = [sum(bucket[k] for k in SYNCS) for bucket in c["per_step"]]
        deferred = sum(bucket["deferred"] for bucket in c["per_step"])
        print(f"{name} rank {rank}: syncs per step {per_step} (bucket 0: the first step and the job's set-up), "
              f"deferred reads {deferred}; where: {c['where']}")
        assert len(per_step) == steps + 1   # every step reported once (and the end of the job)
        assert per_step[1:] == [0] * steps, c["where"]
        for kind in SYNCS:
            for site, n in c["where"].get(kind, {}).items():
                assert n <= per_job, f"{kind} at {site}: {n} times in one job of {steps} steps"
        check_p2p(c)


def check_p2p(c: dict) -> None:
    """No communicator carries both unbatched sends and unbatched receives of one rank: on NCCL a rank's operations on
    a communicator run in the order posted, so receives posted ahead would hold back its own sends there."""
    for group, ops in c.get("p2p", {}).items():
        assert not ("send" in ops and "recv" in ops), f"{group} carries this rank's sends and receives: {ops}"


PLANS = [
    # family, plan, request settings
    ("flux", dict(ulysses=2), {}),
    ("flux", dict(ring=2), {}),
    ("flux", dict(ulysses=2, ring=2), {}),
    ("flux", dict(dp=2), dict(batch=2, sampler="euler_ancestral")),
    ("flux", dict(cfg=2), dict(cfg=3.0, sampler="heun")),
    ("flux", dict(cfg=2, ulysses=2), dict(cfg=3.0)),
    ("sd3", dict(cfg=2, ring=2), dict(cfg=4.5, sampler="dpmpp_2m_sde")),
    ("sd3", dict(dp=2, cfg=2), dict(cfg=4.5, batch=2, sampler="dpmpp_2m")),
    ("flux", dict(pipefusion=2), dict(patches=3, warmup_steps=1)),
    ("flux", dict(pipefusion=2), dict(patches=3, warmup_steps=1, sampler="dpmpp_2m_sde")),
    ("flux", dict(pipefusion=2, ulysses=2), dict(patches=3, warmup_steps=1)),
    ("flux", dict(pipefusion=2, ring=2), dict(patches=2, warmup_steps=1, sampler="heun")),
    ("sd3", dict(pipefusion=2, cfg=2), dict(cfg=4.5, patches=2, warmup_steps=1)),
    # the weights divided: every block gathered before it runs, the next one's gather posted ahead
    ("flux", dict(ulysses=2, shard=2), {}),
    ("flux", dict(cfg=2, shard=2), dict(cfg=3.0, sampler="heun")),
    ("sd3", dict(ring=2, shard=2), dict(cfg=4.5, cache_threshold=0.1)),
]


@pytest.mark.parametrize("family,plan,settings", PLANS,
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_no_plan_syncs_per_layer_patch_or_call(tiny_models, counting, family, plan, settings):
    r = request(tiny_models, family, plan, **settings)
    counts, _ = counted(counting, r)
    check(f"{family} {r.plan.describe()} {settings}", counts, STEPS)


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    """Tiny FLUX.1-dev files as GGUF (the K-quants on the matrices whose rows are whole blocks of 256, Q8_0 on the
    rest) and as fp8_scaled (fp8 matrices and their scale_weight)."""
    from engine.models.tiny import write_tiny
    d = str(tmp_path_factory.mktemp("quantized"))
    out = {q: write_tiny("flux", d, format="gguf", quant=q) for q in ("Q4_K", "Q6_K", "Q8_0")}
    out["fp8_scaled"] = write_tiny("flux", d, format="fp8_scaled")
    return out


@pytest.mark.parametrize("quant,plan,settings", [
    ("Q6_K", {}, dict(sampler="euler")),
    ("Q4_K", dict(ulysses=2), dict(sampler="dpmpp_2m_sde")),
    ("Q6_K", dict(ring=2), dict(sampler="euler_ancestral")),
    ("Q8_0", dict(pipefusion=2), dict(sampler="heun", patches=2, warmup_steps=1)),
    ("fp8_scaled", dict(ulysses=2), dict(sampler="dpmpp_2m")),
    ("Q4_K", dict(ulysses=2, shard=2), dict(sampler="euler")),
    ("fp8_scaled", dict(cfg=2, shard=2), dict(sampler="euler", cfg=3.0)),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_quantized_files_sync_no_more_than_safetensors(tiny_models, quantized_models, counting, quant, plan,
                                                       settings):
    """GGUF layers dequantize and fp8_scaled layers scale their weights per call, every layer: none of it waits for
    the device or uploads a constant, under each sampler of the engine's loop."""
    r = request({"flux": quantized_models[quant]}, "flux", plan, **settings)
    counts, _ = counted(counting, r)
    check(f"flux {quant} {r.plan.describe()} {settings}", counts, STEPS)


@pytest.mark.parametrize("family,plan,settings", [
    ("flux", {}, {}),
    ("flux", dict(ulysses=2), {}),
    ("sd3", dict(cfg=2), dict(cfg=4.5)),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_a_model_session_syncs_only_for_each_calls_upload_and_download(tiny_models, counting, family, plan, settings):
    """The per-call route (ComfyUI's sampler on the engine's MODEL) under the loops' rule, a call for a step: after
    the first call (which brings the conditioning the ranks hold), a call makes one upload on every rank (the call's
    tensors, in one copy from the segment each rank maps itself) and rank 0 one read (the output, copied once into
    the answer's segment), and nothing else: no broadcast through the device, no wait."""
    from engine.generate.model_call import ModelSession, request_conditioning
    r = request(tiny_models, family, plan, **settings)
    sides = ("pos", "neg") if r.cfg != 1.0 else ("pos",)
    x = torch.randn(len(sides), 16, 16, 16, generator=torch.Generator().manual_seed(2))
    calls = 4
    with ModelSession(counting(r.plan.world_size), r) as s:
        for k in range(calls):
            s.call(x, torch.full((len(sides),), 0.8 - 0.1 * k), request_conditioning(r, sides, 1))
    for rank in s.result.ranks:
        c = rank["host_syncs"]
        print(f"{family} {r.plan.describe()} rank {rank['rank']}: per call {c['per_step']}; where {c['where']}")
        assert len(c["per_step"]) == calls + 1   # every call, and the session's end
        download = int(rank["rank"] == 0)
        assert c["per_step"][1:calls] == [dict(read=download, upload=1, wait=0, deferred=0)] * (calls - 1), c["where"]
        assert c["per_step"][calls] == dict(read=0, upload=0, wait=0, deferred=0)


# a threshold at which the tiny FLUX model skips some calls (its first block's residual changes 0.5 to 0.93 per step)
SKIPS = 0.9


@pytest.mark.parametrize("plan,settings", [
    (dict(ulysses=2), {}),
    (dict(cfg=2, ulysses=2), dict(cfg=3.0)),
    (dict(dp=2), dict(batch=2)),
], ids=lambda v: ",".join(f"{k}={w}" for k, w in v.items()))
def test_the_step_cache_decides_without_a_sync(tiny_models, counting, plan, settings):
    steps = 6
    r = request(tiny_models, "flux", plan, steps=steps, cache_threshold=SKIPS, **settings)
    counts, result = counted(counting, r)
    check(f"flux {r.plan.describe()} step cache", counts, steps)
    for rank, c in zip(result.ranks, counts):
        cache = rank["step_cache"]
        deferred = sum(bucket["deferred"] for bucket in c["per_step"])
        print(f"rank {rank['rank']}: skipped calls {cache['skipped_at']} of {cache['model_calls']}; decisions read a "
              f"call late: {deferred}; changes {cache['changes']}")
        assert cache["skipped_calls"] > 0
        assert deferred == cache["model_calls"] - 1   # one stream per rank here: every call after its first


@pytest.mark.parametrize("plan,settings", [
    (dict(ulysses=2), dict(cache_threshold=SKIPS)),
    (dict(ring=2), {}),
    (dict(pipefusion=2), dict(patches=3, warmup_steps=1)),
], ids=lambda v: ",".join(f"{k}={w}" for k, w in v.items()))
def test_compiled_blocks_sync_no_more_than_eager(tiny_models, counting, plan, settings):
    r = request(tiny_models, "flux", plan, compile=True, **settings)
    counts, result = counted(counting, r)
    assert result.ranks[0]["compiled_graphs"] > 0
    check(f"flux {r.plan.describe()} compiled {settings}", counts, STEPS)


def test_the_instrument_sees_each_kind_of_sync(monkeypatch):
    """In process, a loop that does what the engine must not: a read of a device tensor per layer, an index from host
    memory per layer, a wait with a deadline per step. Each is counted in its step's bucket, where it happened; what
    the loop builds once before its first step counts in bucket 0."""
    from datetime import timedelta

    import torch.distributed as dist
    monkeypatch.setenv(syncs.ENV, "count")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = {}
        weights = [torch.randn(4, 4) for _ in range(3)]   # made before the loop: the model, on the device
        with syncs.loop(info, torch.device("cpu")):
            index = torch.arange(4)                         # made on the host
            syncs.start()
            table = index.to(torch.device("cpu"))           # put on the device once, in the first step
            for step in range(2):
                x = weights[0].sum(dim=0)[table]
                for w in weights:
                    x = (w @ x)[index]
                    if x.abs().max().item() > 1e6:
                        x = x / 1e6
                dist.all_reduce(x, async_op=True).wait(timedelta(seconds=5))
                syncs.step(step + 1)
    finally:
        dist.destroy_process_group()
    per_step = info["host_syncs"]["per_step"]
    print(per_step, info["host_syncs"]["where"])
    assert [b["read"] for b in per_step] == [3, 3, 0]
    assert [b["upload"] for b in per_step] == [4, 3, 0]
    assert [b["wait"] for b in per_step] == [1, 1, 0]


def test_a_counted_loop_leaves_torch_distributed_as_it_found_it(monkeypatch):
    """The instrument patches the wait, send and receive methods of torch's process groups for a counted loop; after
    it the methods are the very objects they were (a method put back as read through the class would no longer bind
    its group, and a later point-to-point call in the same process would fail)."""
    import torch.distributed as dist
    names = {dist.Work: ("wait", "is_completed"), dist.ProcessGroup: ("send", "recv")}
    before = {(cls, n): cls.__dict__[n] for cls, ns in names.items() for n in ns}
    before[(dist, "batch_isend_irecv")], before[(dist, "barrier")] = dist.batch_isend_irecv, dist.barrier
    monkeypatch.setenv(syncs.ENV, "count")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with syncs.loop({}, torch.device("cpu")):
            syncs.start()
            syncs.step(1)
        after = {(cls, n): (cls.__dict__[n] if isinstance(cls, type) else getattr(cls, n)) for cls, n in before}
        assert all(after[key] is value for key, value in before.items()), \
            [f"{key[1]} changed" for key, value in before.items() if after[key] is not value]
    finally:
        dist.destroy_process_group()
    # a send in torch's local stand-in group of two (every collective a local operation) binds its group again
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1),
                                           dist.P2POp(dist.irecv, torch.zeros(2), 1)])
        for request in requests:
            request.wait()
        print("a send and a receive posted after a counted loop:", len(requests))
    finally:
        dist.destroy_process_group()


def test_the_instrument_counts_library_made_host_tensors_copied_to_the_device(monkeypatch):
    """torchsde (dpmpp_2m_sde's Brownian tree) makes its tensors naming the CPU: host memory, where they live on a GPU
    rank too, however they were made. A plain .to(device) of a step's increment is a blocking upload from pageable
    memory, counted each step; the same increment sent through pinned memory without blocking is not."""
    import torchsde
    from engine.sampling.noise import to_device_async
    monkeypatch.setenv(syncs.ENV, "count")
    info, device = {}, torch.device("cpu")
    with syncs.loop(info, device):
        tree = torchsde.BrownianTree(torch.tensor(0.0), torch.zeros(4, 4), torch.tensor(1.0), entropy=3)
        syncs.start()
        copies = []
        for step in range(2):
            a, b = torch.tensor(0.25 * step), torch.tensor(0.25 * step + 0.2)
            copies.append((tree(a, b).to(device), to_device_async(tree(a, b), device)))   # blocking, staged
            syncs.step(step + 1)
    per_step, where = info["host_syncs"]["per_step"], info["host_syncs"]["where"]
    print(per_step, where)
    assert all(torch.equal(blocking, staged) for blocking, staged in copies)
    assert [b["upload"] for b in per_step] == [1, 1, 0]
    line = test_the_instrument_counts_library_made_host_tensors_copied_to_the_device.__code__.co_firstlineno + 14
    assert where["upload"] == {f".to(device) of a host tensor at tests/test_host_syncs.py:{line}": 2}
    assert sum(b["read"] + b["wait"] for b in per_step) == 0


@pytest.fixture(scope="module")
def newer_models(tmp_path_factory):
    """A tiny Qwen-Image and FLUX.2 [dev] checkpoint."""
    from engine.models.tiny import write_tiny
    d = str(tmp_path_factory.mktemp("newer"))
    return {"qwen-image": write_tiny("qwen-image", d), "flux2": write_tiny("flux2", d, variant="flux2-dev")}


def newer_request(models, family, plan, **kw):
    """Qwen-Image at cfg 2.5 with a negative of another length and one reference latent (its edit model), or FLUX.2
    [dev] with guidance and two reference latents; tiny widths 64 and 96."""
    g = torch.Generator().manual_seed(3)
    if family == "qwen-image":
        j = dict(cond=torch.randn(1, 9, 64, generator=g), neg_cond=torch.randn(1, 4, 64, generator=g), cfg=2.5,
                 latent_raw=torch.zeros(1, 16, 1, 16, 16))
        refs = [torch.randn(1, 16, 1, 8, 8, generator=g)]
    else:
        j = dict(cond=torch.randn(1, 20, 96, generator=g), guidance=4.0, latent_raw=torch.zeros(1, 128, 8, 8))
        refs = [torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 128, 3, 5, generator=g)]
    if "pipefusion" not in plan:   # PipeFusion takes no reference latents
        j["reference_latents"] = refs
        if family == "qwen-image":
            j["neg_reference_latents"] = refs
    return GenerateRequest(model=models[family], seed=5, steps=STEPS, plan=ParallelPlan(**plan), **j,
                           **kw).validate()


@pytest.mark.parametrize("family,plan,settings", [
    ("qwen-image", dict(ulysses=2), {}),
    ("qwen-image", dict(cfg=2, ring=2), {}),
    ("qwen-image", dict(pipefusion=2), dict(patches=2, warmup_steps=1)),
    ("flux2", dict(ulysses=2), {}),
    ("flux2", dict(ring=2), dict(cache_threshold=SKIPS)),
    ("flux2", dict(pipefusion=2), dict(patches=2, warmup_steps=1)),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_qwen_image_and_flux2_sync_no_more_than_flux1(newer_models, counting, family, plan, settings):
    r = newer_request(newer_models, family, plan, **settings)
    counts, _ = counted(counting, r)
    check(f"{family} {r.plan.describe()} {settings}", counts, STEPS)


@pytest.fixture(scope="module")
def wan_models(tmp_path_factory):
    """A tiny Wan 2.1 image-to-video and Wan 2.2 TI2V-5B checkpoint."""
    from engine.models.tiny import write_tiny
    d = str(tmp_path_factory.mktemp("wan"))
    return {v: write_tiny("wan", d, variant=v) for v in ("wan2.1-i2v-14b", "wan2.2-ti2v-5b")}


def wan_request(models, variant, plan, **kw):
    """Image-to-video at cfg 5 with WanImageToVideo's conditioning (CLIP tokens, mask + image latent), 3 frames of
    8x8; or TI2V-5B from Wan22ImageToVideoLatent's LATENT (the first frame kept by the noise mask, one timestep per
    latent frame), 3 frames of 6x10: 45 tokens, padded under sequence parallel."""
    g = torch.Generator().manual_seed(3)
    if variant == "wan2.1-i2v-14b":
        mask = torch.ones(1, 1, 3, 8, 8)
        mask[:, :, 0] = 0.0
        image, clip = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 257, 1280, generator=g)
        j = dict(latent_raw=torch.zeros(1, 16, 3, 8, 8), cfg=5.0, neg_cond=torch.randn(1, 7, 4096, generator=g),
                 clip_vision_output=clip, neg_clip_vision_output=clip, concat_latent_image=image,
                 neg_concat_latent_image=image, concat_mask=mask, neg_concat_mask=mask)
    else:
        mask = torch.ones(1, 1, 3, 6, 10)
        mask[:, :, 0] = 0.0
        j = dict(latent_raw=torch.cat([torch.randn(1, 48, 1, 6, 10, generator=g), torch.zeros(1, 48, 2, 6, 10)], 2),
                 noise_mask=mask)
    return GenerateRequest(model=models[variant], cond=torch.randn(1, 9, 4096, generator=g), seed=5, steps=STEPS,
                           plan=ParallelPlan(**plan), **j, **kw).validate()


@pytest.mark.parametrize("variant,plan,settings", [
    ("wan2.1-i2v-14b", dict(ulysses=2), dict(cache_threshold=SKIPS)),
    ("wan2.1-i2v-14b", dict(cfg=2, ring=2), {}),
    ("wan2.2-ti2v-5b", dict(ulysses=2, ring=2), {}),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items()))
def test_wan_video_syncs_no_more_than_flux1(wan_models, counting, variant, plan, settings):
    r = wan_request(wan_models, variant, plan, **settings)
    counts, _ = counted(counting, r)
    check(f"{variant} {r.plan.describe()} {settings}", counts, STEPS)


@pytest.fixture(scope="module")
def av_models(tmp_path_factory):
    """A tiny MiniMax-H3 and LTX-2.3 checkpoint."""
    from engine.models.tiny import write_tiny
    d = str(tmp_path_factory.mktemp("av"))
    return {kind: write_tiny(kind, d) for kind in ("minimax-h3", "ltx23")}


def av_calls(models, kind, calls):
    """A request and `calls` model calls at falling sigmas, as ComfyUI's model makes them: MiniMax-H3 with keyframes, a
    guide clip, two references and noise masks on both streams (the guided call of test_minimax_h3), LTX-2.3 with
    LTXVAddGuide's first and last frames at 0.7 (per-token timesteps, the guides' positions and attention weights), the
    last an IC-LoRA's dilated reference (tokens out of the sequence)."""
    plan = ParallelPlan(ulysses=2)
    if kind == "minimax-h3":
        from test_minimax_h3 import guided_call, request as h3_request
        x, t, c = guided_call()
        return h3_request(models[kind], c, plan), [(x, t * (1.0 - 0.2 * k), c) for k in range(calls)]
    from test_ltx23 import guided_call, request as ltx_request
    made = [guided_call(h=2, w=4, dilated=True, sigma=0.9 - 0.2 * k) for k in range(calls)]
    return ltx_request(models[kind], made[0][2], plan), made


@pytest.mark.parametrize("kind", ["minimax-h3", "ltx23"])
def test_audio_video_model_calls_sync_only_for_each_calls_upload_and_download(av_models, counting, kind):
    """The audio-video families under ulysses2 on the per-call route: what a call's layout is built from (the streams'
    shapes, blocks, masks, tags, the seed: Family.host_extras) is held in host memory on the ranks and read there; the
    index, position and tag tensors and the augmented condition rows built from it are placed on the device once per
    distinct content; the timesteps are computed on the device from the call's. After the first call a call makes
    one upload on every rank and rank 0 one read (its output), as the image families' calls do."""
    from engine.generate.model_call import ModelSession
    calls = 4
    r, made = av_calls(av_models, kind, calls)
    with ModelSession(counting(2), r) as s:
        for x, t, c in made:
            s.call(x, t, c)
    for rank in s.result.ranks:
        c = rank["host_syncs"]
        print(f"{kind} ulysses2 rank {rank['rank']}: per call {c['per_step']}; where {c['where']}")
        assert len(c["per_step"]) == calls + 1
        download = int(rank["rank"] == 0)
        assert c["per_step"][1:calls] == [dict(read=download, upload=1, wait=0, deferred=0)] * (calls - 1), c["where"]


@pytest.mark.parametrize("plan", [dict(ulysses=2)], ids=["ulysses2"])
def test_wan_animate2_model_calls_sync_only_for_each_calls_upload_and_download(tmp_path, counting, plan):
    """Wan-Animate 2 on the per-call route: its strengths (Family.host_extras) are read in host memory, the pose
    branch's layout from shapes alone; after the first call a call makes one upload on every rank and rank 0 one read,
    whatever the attention's blocks of frames."""
    from engine.generate.model_call import ModelSession
    from engine.models.tiny import write_tiny
    from test_wan_animate2 import case, conditioning, session_request
    path = write_tiny("wan", str(tmp_path), variant="wan-animate-2")
    c = case(frames=3, h=5, w=5, pose_text=5)
    r = session_request(path, c, ParallelPlan(**plan))
    calls = 4
    with ModelSession(counting(2), r) as s:
        for k in range(calls):
            s.call(c["x"], c["t"] - 100.0 * k, conditioning(c))
    for rank in s.result.ranks:
        counts = rank["host_syncs"]
        print(f"wan-animate-2 {r.plan.describe()} rank {rank['rank']}: per call {counts['per_step']}; "
              f"where {counts['where']}")
        download = int(rank["rank"] == 0)
        assert counts["per_step"][1:calls] == [dict(read=download, upload=1, wait=0, deferred=0)] * (calls - 1), \
            counts["where"]
