"""CUDA checks, skipped cleanly where torch sees no CUDA device (CI has none; run them on a GPU machine):
CUDA vs CPU fp32 parity of the tiny models, bf16 within its expected distance, the attention kernels' log-sum-exp and
the Ring merge built on it, fp8 products, the engine on one CUDA rank (NCCL) with a clean shutdown, and its step loop
under CUDA's sync debug mode "error"."""
import math

import pytest
import torch

from engine.generate.request import GenerateRequest
from engine.models.flow import Conditioning, FlowModel
from engine.models.load import load_model
from engine.models.tiny import write_tiny
from engine.parallel.attention import _merge, attention_with_lse
from engine.runtime.client import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda")
    return {"flux": write_tiny("flux", str(d)), "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium")}


def _velocity(path, dtype, device):
    flow = FlowModel(load_model(path, dtype=dtype, device=device))
    g = torch.Generator().manual_seed(3)
    pooled = 768 if flow.family == "flux" else 2048
    prepared = flow.prepare([Conditioning(torch.randn(1, 24, 4096, generator=g), torch.randn(1, pooled, generator=g))], 1)
    x = torch.randn(1, 16, 32, 32, generator=g)
    return flow.velocity(x, torch.tensor(0.6), prepared).cpu()


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_cuda_matches_cpu_fp32_and_bf16(models, family):
    from tolerance import fp32_bound
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (TF32 is a separate, lower precision)
    torch.backends.cudnn.allow_tf32 = False
    cpu = _velocity(models[family], "fp32", "cpu")
    gpu = _velocity(models[family], "fp32", "cuda")
    diff = (gpu - cpu).abs().max().item()
    bound = fp32_bound(cpu.abs().max(), reduction=4096, depth=8 if family == "flux" else 4)
    bf16 = _velocity(models[family], "bf16", "cuda")
    rel = ((bf16 - cpu).norm() / cpu.norm()).item()
    # bf16 keeps 8 mantissa bits (2**-8 relative per rounding); errors grow ~sqrt with the roundings through the
    # blocks (a few per block and layer): a few percent relative L2 for 4-8 blocks
    bf16_bound = 2 ** -8 * math.sqrt(8 * 16)
    print(f"{family}: CUDA vs CPU fp32 max abs diff {diff:.3g} (bound {bound:.3g}); bf16 vs fp32 relative L2 "
          f"{rel:.3g} (bound {bf16_bound:.3g})")
    assert diff <= bound
    assert rel <= bf16_bound


def _reference_attention(q, k, v):
    """Plain fp32 softmax attention and its log-sum-exp, (batch, tokens, heads, dim) in, lse (batch, heads, tokens)."""
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_lse_and_ring_merge_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", generator=g).to(dtype) for _ in range(3))
    ref_out, ref_lse = _reference_attention(q, k, v)
    out, lse = attention_with_lse(q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out_diff = (out.float() - ref_out).abs().max().item()
    lse_diff = (lse - ref_lse).abs().max().item()
    # the Ring merge: keys in two blocks, partial results combined through their log-sum-exp
    a = attention_with_lse(q, k[:, :120], v[:, :120])
    b = attention_with_lse(q, k[:, 120:], v[:, 120:])
    merged, merged_lse = _merge(*_merge(None, None, *a), *b)
    merge_diff = (merged - ref_out).abs().max().item()
    print(f"{dtype}: out max abs diff {out_diff:.3g}, lse {lse_diff:.3g}, ring merge {merge_diff:.3g} (tol {tol})")
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert out_diff <= tol and lse_diff <= tol and merge_diff <= tol
    assert (merged_lse - ref_lse).abs().max().item() <= tol


def test_fp8_products_on_cuda():
    from engine.models.quantized import fp8_linear, fp8_supported
    if not fp8_supported(torch.device("cuda")):
        pytest.skip("this GPU has no fp8 tensor cores (compute capability < 8.9)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 77, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(512, 256, device="cuda", generator=g) / 16).to(torch.float8_e4m3fn)
    bias = torch.randn(512, device="cuda", generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    out = fp8_linear(x, w, bias)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"fp8 product vs fp32 with the same fp8 weights: relative L2 {rel:.3g}")
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel < 0.05  # e4m3 keeps 3 mantissa bits on the activations: ~2**-4 per element, averaged over 256 terms


def _job(models, family, **options):
    g = torch.Generator().manual_seed(11)
    pooled = 768 if family == "flux" else 2048
    r = GenerateRequest(model=models[family], cond=torch.randn(1, 24, 4096, generator=g),
                        pooled=torch.randn(1, pooled, generator=g), latent_raw=torch.zeros(1, 16, 16, 16), seed=5,
                        steps=4, **options)
    r = r.validate(1)
    return r.to_job()


def test_engine_on_one_cuda_rank(models):
    """generate through the engine and the bridge on a CUDA rank (NCCL group of one, set_device first), against the
    same job on a CPU rank; the step cache at 0 and compile on CUDA; then every rank gone and its memory freed."""
    from tolerance import fp32_bound
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    with Engine(1, device="cpu") as engine:
        cpu = engine.submit("generate", *_job(models, "flux")).outputs["samples"]
    with Engine(1, device="cuda", gpus=[0]) as engine:
        pids = engine.pids
        result = engine.submit("generate", *_job(models, "flux"))
        gpu = result.outputs["samples"]
        cached = engine.submit("generate", *_job(models, "flux", cache_threshold=0.0)).outputs["samples"]
        compiled = engine.submit("generate", *_job(models, "flux", compile=True))
        again = engine.submit("generate", *_job(models, "flux", compile=True))
        memory = result.ranks[0]["memory"]
    free_after, _ = torch.cuda.mem_get_info()
    diff = (gpu - cpu).abs().max().item()
    bound = fp32_bound(cpu.abs().max(), reduction=4096, depth=8, amplification=4)
    comp = (compiled.outputs["samples"] - gpu).abs().max().item()
    print(f"CUDA rank vs CPU rank max abs diff {diff:.3g} (bound {bound:.3g}); compiled vs "
          f"eager {comp:.3g}; rank peak {memory.get('peak_gib', 0):.3f} GiB; device free before {free_before / 2**20:.0f} "
          f"MiB, after close {free_after / 2**20:.0f} MiB")
    assert diff <= bound  # torch keeps fp32 matmuls in fp32 on CUDA by default (no TF32)
    assert torch.equal(cached, gpu)
    assert comp <= bound
    assert again.ranks[0]["compiled_graphs"] == compiled.ranks[0]["compiled_graphs"]  # graphs reused
    assert "peak_gib" in memory
    assert free_after >= free_before - 64 * 2**20, "the closed engine left CUDA memory allocated"
    from engine.runtime.launch import pid_gone
    assert all(pid_gone(pid) for pid in pids)


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pipefusion_stage_code_and_stale_kv_buffers_on_cuda(models, family, dtype):
    """PipeFusion's stage forward, its K/V buffers (index_copy_ into CUDA tensors) and the patch path on one CUDA
    device: the same checks as on CPU (tests/test_pipefusion.py). The send/receive between stages needs two GPUs."""
    from test_pipefusion import fresh_kv_check
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fresh_kv_check(models[family], family, device="cuda", dtype=dtype)


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(dtype="bf16", cache_threshold=0.9),
                                     dict(dtype="bf16", compile=True, cache_threshold=0.9),
                                     dict(dtype="fp32", sampler="dpmpp_2m_sde")],
                         ids=["eager", "step-cache", "compiled-step-cache", "fp32-dpmpp_2m_sde"])
def test_the_step_loop_makes_no_synchronising_cuda_call(models, monkeypatch, options):
    """The loop's steps after the first run under torch.cuda.set_sync_debug_mode("error") (XDIT_HOST_SYNCS=error in
    the rank's environment): a synchronising CUDA call there fails the job. One CUDA rank (NCCL runs one rank per
    device); the plans of several ranks are counted on CPU ranks (tests/test_host_syncs.py)."""
    from engine import syncs
    monkeypatch.setenv(syncs.ENV, "error")
    with Engine(1, device="cuda", gpus=[0]) as engine:
        result = engine.submit("generate", *_job(models, "flux", **options))
    info = result.ranks[0]
    print(options, info["host_syncs"], info.get("step_cache", {}).get("skipped_at"))
    assert info["host_syncs"] == {"mode": "error"}
    assert torch.isfinite(result.outputs["samples"]).all()


def test_a_model_session_synchronises_only_for_each_calls_upload_and_download(models, monkeypatch):
    """The per-call route under the sync debug mode "error" after the first call: each call's one upload (its
    segment, in one copy) and one download (its output, into the answer's segment) run outside it, as ComfyUI's
    sampler waits for them anyway; anything else synchronising fails the session."""
    from engine import syncs
    from engine.generate.model_call import ModelSession, request_conditioning
    monkeypatch.setenv(syncs.ENV, "error")
    g = torch.Generator().manual_seed(11)
    r = GenerateRequest(model=models["flux"], cond=torch.randn(1, 24, 4096, generator=g),
                        pooled=torch.randn(1, 768, generator=g), latent_raw=torch.zeros(1, 16, 16, 16),
                        dtype="bf16").validate(1)
    x = torch.randn(1, 16, 16, 16, generator=g)
    with Engine(1, device="cuda", gpus=[0]) as engine:
        with ModelSession(engine, r) as s:
            outs = [s.call(x, torch.full((1,), 0.9 - 0.2 * k), request_conditioning(r, ("pos",), 1)) for k in range(3)]
    assert s.result.ranks[0]["host_syncs"] == {"mode": "error"}
    assert all(torch.isfinite(o).all() for o in outs)


def test_the_step_caches_agreement_never_makes_the_compute_stream_wait(monkeypatch):
    """The step cache posts its all-reduce behind the first block and reads it a call later (Deferred): the wait on
    the collective orders a side stream, which copies the value to pinned memory, never the compute stream (that wait
    would hold every rank at the first block until the slowest had posted, every call); the value read is the sum."""
    import torch.distributed as dist
    from engine.parallel.cache import Deferred
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        waited_on = []
        original = dist.Work.wait

        def recording(self, *args, **kwargs):
            waited_on.append(torch.cuda.current_stream())
            return original(self, *args, **kwargs)
        monkeypatch.setattr(dist.Work, "wait", recording)
        compute = torch.cuda.current_stream()
        sums = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device="cuda")
        deferred = Deferred(sums, dist.all_reduce(sums, async_op=True))
        assert waited_on and all(stream != compute for stream in waited_on)
        assert torch.cuda.current_stream() == compute
        assert deferred.result() == [1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


def test_a_step_cache_value_dropped_unread_keeps_its_block_until_the_side_stream_has_read_it():
    """A Deferred dropped before its value is read (a job ended mid-cache): the side stream still copies the tensor
    after the all-reduce; the caching allocator must not give its block to the compute stream before that copy runs
    (record_stream), or a new tensor there would be overwritten by the collective. With the side stream held busy, an
    allocation of the same size on the compute stream gets another block."""
    from engine.parallel.cache import Deferred, _copy_stream
    device = torch.device("cuda", 0)
    side = _copy_stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)   # the side stream busy for a while: the copy waits behind it
    sums = torch.zeros(4096, dtype=torch.float64, device=device)
    block = sums.data_ptr()
    deferred = Deferred(sums)
    del deferred, sums
    fresh = torch.empty(4096, dtype=torch.float64, device=device)
    print(f"dropped block {block:#x}, new allocation {fresh.data_ptr():#x}")
    assert fresh.data_ptr() != block
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_guides_bias_on_the_cuda_kernels_with_the_ring_merge_a_removed_block_included(dtype):
    """LTX-2.3's guides' bias (families/ltx23_guides.py) through the CUDA kernels: the generated queries' unbiased
    pieces on the fast kernels, the guide keys through the efficient kernel with their weights, split into ring blocks
    one of which holds only guide tokens of weight 0 (the efficient kernel scales the bias by log2(e): the removing
    bias must stay finite there), merged by the log-sum-exp; against the dense-mask attention in float64 on the CPU.
    Bound: fp32 a few ulps of the kernels' reductions (1e-5 relative); bf16 its 8 mantissa bits over two reductions
    (2^-8 x 4 relative)."""
    import itertools
    from engine.families.ltx23_guides import GuideBias, log_weights
    from engine.kernels import merge
    g = torch.Generator().manual_seed(3)
    total, start, count, heads, dim = 640, 384, 192, 4, 64
    q, k, v = (torch.randn(1, total, heads, dim, generator=g) for _ in range(3))
    weights = torch.rand(count, generator=g, dtype=torch.float64) * 2
    weights[:64] = 0.0   # the first guide frame not seen: the ring block [384, 448) holds only these
    log_w = log_weights(weights, dtype)
    mask = torch.zeros(total, total, dtype=torch.float64)
    mask[:start, start:start + count] = log_w.double()   # the bias the kernels see, the removing value included
    mask[start:start + count, :start] = log_w.double()[:, None]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(dim) + mask
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.double())
    bias = GuideBias(start, count, log_w.cuda())
    cq, ck, cv = (t.to("cuda", dtype) for t in (q, k, v))
    shards = (0, 192, 384, 448, 640)
    rows = []
    for a, b in itertools.pairwise(shards):
        out = lse = None
        for c, d in itertools.pairwise(shards):
            out, lse = merge(out, lse, *bias.attend(cq[:, a:b], ck[:, c:d], cv[:, c:d], a, c))
        rows.append(out)
    got = torch.cat(rows, dim=1).double().cpu()
    rel = float((got - want).norm() / want.norm())
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8 * 4
    print(f"guides' bias on CUDA {dtype}, ring blocks with one removed whole: relative L2 {rel:.3g} (bound {bound})")
    assert torch.isfinite(got).all() and rel <= bound


@pytest.mark.parametrize("kind", ["flux", "sd3", "qwen-image", "flux2", "wan", "minimax-h3", "ltx23"])
def test_the_fp8_weight_option_on_cuda_holds_linear_weights_alone_in_fp8(tmp_path, kind):
    """The fp8 weight option on a CUDA rank (bf16 compute): every Linear weight fp8 but a family's float32 islands,
    nothing else fp8; LTX-2.3's and MiniMax-H3's calls run and stay within fp8's rounding of the fp32 CPU result."""
    from engine import families
    loaded = load_model(write_tiny(kind, str(tmp_path), dtype="bf16"), dtype="bf16", device="cuda", fp8_weights=True)
    model, family = loaded.model, families.get(kind)
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8 and all(n.endswith(".weight") and not family.fp32_params(n) for n in fp8)
    assert not [n for n, p in model.named_parameters() if family.fp32_params(n) and p.dtype != torch.float32]
    if kind not in ("minimax-h3", "ltx23"):
        return
    import importlib
    helpers = importlib.import_module("test_minimax_h3" if kind == "minimax-h3" else "test_ltx23")
    x, t, c = helpers.h3_call() if kind == "minimax-h3" else helpers.guided_call()
    want = helpers.reference(FlowModel(load_model(loaded.path, dtype="fp32")), x, t, c)
    got = helpers.reference(FlowModel(loaded), x, t, c).float().cpu()
    rel = float((got - want).norm() / want.norm())
    print(f"{kind} fp8 weights on CUDA, bf16 compute vs fp32 CPU: relative L2 {rel:.3g} (bound 0.15)")
    assert torch.isfinite(got).all() and rel < 0.15


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wan_animate2_on_the_cuda_kernels_and_its_pose_cache(tmp_path, dtype):
    """Wan-Animate 2's attention blocks (generation over generation, the frame-local pose part as one batched call,
    the merge) on CUDA's kernels equal the CPU fp32 model (bf16 within its rounding), and a second call with the same
    inputs, read from the pose cache kept on the GPU, equals a fresh forward; the job's end lets the cache go."""
    from engine.families.base import JOB_STATE, end_of_job
    from engine.models.flow import Prepared
    from test_wan_animate2 import case
    path = write_tiny("wan", str(tmp_path), variant="wan-animate-2")
    c = case(pose_text=5)
    n = c["x"].shape[0]

    def prepared(flow, fresh=False):
        dev, dt = flow.device, flow.dtype
        copy = (lambda t: t.clone()) if fresh else (lambda t: t)
        return Prepared(copy(c["cond"]).to(dev, dt), None, torch.full((n,), 3.5, device=dev),
                        image_context=copy(c["clip"]).to(dev, dt),
                        extras={"pose_latents": copy(c["pose"]).to(dev, dt), "context_pose": copy(c["context_pose"])
                                .to(dev, dt), "pose_strength": torch.full((n,), 0.8, dtype=torch.float64)})
    cpu = FlowModel(load_model(path, dtype="fp32", device=torch.device("cpu")))
    want = cpu.output(c["x"], c["t"], prepared(cpu)).float()
    gpu = FlowModel(load_model(path, dtype=dtype, device=torch.device("cuda")))
    held = prepared(gpu)
    first = gpu.output(c["x"], c["t"], held).float().cpu()
    second = gpu.output(c["x"], c["t"], held).float().cpu()   # the pose branch from the cache
    from engine.families.wan_animate2 import POSE_CACHE
    assert gpu.model.__dict__[JOB_STATE][POSE_CACHE].filled   # made: room for it on the GPU
    fresh = gpu.output(c["x"], c["t"], prepared(gpu, fresh=True)).float().cpu()
    end_of_job(gpu.model)
    tol = 1e-4 if dtype == "fp32" else 5e-2
    for name, got in (("first call", first), ("from the pose cache", second)):
        rel = float((got - want).norm() / want.norm())
        print(f"Wan-Animate 2 CUDA {dtype} {name} vs CPU fp32: relative L2 {rel:.3g}")
        assert rel < tol
    cached = float((second - fresh).norm() / fresh.norm())
    print(f"Wan-Animate 2 CUDA {dtype}: cached call vs the pose branch run again: relative L2 {cached:.3g}")
    assert cached < tol / 5
