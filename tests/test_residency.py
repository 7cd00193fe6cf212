"""Where a rank keeps the models it is not running (generate/residency.py), decided before every job from what is
measured then: on stated figures here (device free memory, host available memory, the plan's placement), and on a
CUDA device by the rank itself (skipped without one): the idle expert moved to host memory and back with its LoRA
factors, its compiled graphs kept."""
import pytest
import torch

from engine.generate.residency import GiB, HOST_MARGIN_BYTES, Held, decide

A, B, C = "high-noise", "low-noise", "third"


def moves(*args, **kwargs):
    return [(m.key, m.action) for m in decide(*args, **kwargs)]


def test_a_quantized_layers_lora_factors_move_with_it_and_stay_float32():
    """An fp8_scaled (or GGUF) layer keeps a LoRA as its factors: Module.to() takes them along (here to the meta
    device, which any host can show), so an expert moved to host memory leaves none on the GPU."""
    from engine.models.quantized import CastLinear
    layer = CastLinear(torch.nn.Linear(8, 4), scale=torch.ones(()))
    layer.add_lora(torch.randn(4, 2), torch.randn(2, 8), 0.5, 1.0)
    layer.to(torch.device("meta"))
    up, down, scale, strength = layer.loras[0]
    assert up.is_meta and down.is_meta and layer.weight.is_meta and (scale, strength) == (0.5, 1.0)
    layer.to(torch.bfloat16)
    assert layer.loras[0][0].dtype == torch.float32


def test_on_the_cpu_only_the_least_recently_used_beyond_two_models_goes():
    others = [Held(A, 26 * GiB), Held(B, 26 * GiB)]
    assert moves(others, device="cpu", need_bytes=60 * GiB, free_bytes=None, host_free_bytes=None,
                 local_ranks=2) == [(A, "drop")]


def test_an_idle_expert_stays_on_the_gpu_while_the_job_fits_beside_it_and_leaves_when_a_longer_clip_does_not():
    """The Wan 2.2 A14B pair in fp8 (13.3 GiB each) on 48 GB cards: a short clip's activations fit beside the idle
    expert, an 81-frame 720p clip's (re-checked at that job, not only at the first load) do not."""
    idle = [Held(A, int(13.3 * GiB))]
    short = moves(idle, device="cuda", need_bytes=6 * GiB, free_bytes=int(20 * GiB), host_free_bytes=200 * GiB,
                  local_ranks=2)
    long = moves(idle, device="cuda", need_bytes=24 * GiB, free_bytes=int(20 * GiB), host_free_bytes=200 * GiB,
                 local_ranks=2)
    assert short == [] and long == [(A, "offload")]


def test_the_plans_host_placement_moves_the_idle_expert_out_even_where_it_would_fit():
    assert moves([Held(A, 13 * GiB)], device="cuda", need_bytes=GiB, free_bytes=60 * GiB, host_free_bytes=200 * GiB,
                 local_ranks=4, placement="host") == [(A, "offload")]


def test_a_host_without_room_for_every_ranks_copy_drops_the_expert_instead_and_says_why():
    """4 ranks each moving a 26.6 GiB bf16 expert out need 106 GiB of host memory (+ the margin): a 96 GiB host
    cannot take them, so the expert is dropped (read from its file when next used) rather than swapping the host."""
    held = Held(A, int(26.6 * GiB))
    [move] = decide([held], device="cuda", need_bytes=30 * GiB, free_bytes=10 * GiB, host_free_bytes=96 * GiB,
                    local_ranks=4)
    print(move.why)
    assert move.action == "drop" and "96.0 GiB available for 4 rank(s)' copies of 26.6 GiB" in move.why
    room = int(26.6 * GiB) * 4 + HOST_MARGIN_BYTES
    assert moves([held], device="cuda", need_bytes=30 * GiB, free_bytes=10 * GiB, host_free_bytes=room,
                 local_ranks=4) == [(A, "offload")]


def test_what_moves_out_first_is_the_least_recently_used_and_only_as_much_as_the_job_needs():
    others = [Held(C, 5 * GiB, "host"), Held(A, 10 * GiB)]
    assert moves(others, device="cuda", need_bytes=12 * GiB, free_bytes=8 * GiB, host_free_bytes=None,
                 local_ranks=1) == [(C, "drop"), (A, "offload")]
    assert moves([Held(A, 10 * GiB)], device="cuda", need_bytes=7 * GiB, free_bytes=8 * GiB, host_free_bytes=None,
                 local_ranks=1) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_idle_expert_goes_to_host_memory_with_its_lora_factors_and_comes_back_compiled(tmp_path):
    """Two tiny experts (fp8_scaled files) on one CUDA rank with the plan's host placement: switching moves the idle
    one to host memory, brings it back by a copy (no file read), and the graphs compiled around its blocks are
    reused."""
    from engine.generate.request import GenerateRequest
    from engine.models.speed import compiled_graphs
    from engine.models.tiny import write_tiny
    from engine.runtime.client import Engine
    from conftest import FAST
    files = [write_tiny("flux", str(tmp_path / n), seed=s, format="fp8_scaled") for n, s in (("a", 0), ("b", 1))]
    g = torch.Generator().manual_seed(3)
    cond, pooled = torch.randn(1, 8, 4096, generator=g), torch.randn(1, 768, generator=g)
    with Engine(1, device="cuda", deadlines=FAST) as e:
        infos = []
        for path in files + files:
            r = GenerateRequest(model=path, cond=cond, pooled=pooled, latent_raw=torch.zeros(1, 16, 8, 8), steps=2,
                                dtype="bf16", compile=True, experts=2, expert_placement="host")
            infos.append(r.validate(1).submit(e).ranks[0])
    print([(i["model_source"], i.get("residency_moves"), i.get("compiled_graphs")) for i in infos])
    assert [i["model_source"] for i in infos] == ["file", "file", "host memory", "host memory"]
    assert all("moved to host memory" in i["residency_moves"][0] for i in infos[1:])
    assert infos[3]["compiled_graphs"] == infos[1]["compiled_graphs"], "the switch compiled nothing again"


# ---- ComfyUI's own GPU, shared with a rank (xdit_nodes/core.py) ---------------------------------------------------
def _core():
    import importlib
    from conftest import PACK_NAME, load_pack
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.core")


def test_comfyuis_text_encoder_stays_on_its_gpu_where_the_job_fits_beside_it_and_is_freed_where_not():
    """ComfyUI keeps umt5-xxl (6.3 GiB) on cuda:0, which is the engine's first GPU too: a job that needs 9 GiB more
    there with 20 GiB free keeps it (the next prompt encodes without loading it again); one that needs 22 GiB has
    ComfyUI free that much (its own free_memory), and the Info line says which, with the figures."""
    core = _core()
    models = [("UMT5XXL", int(6.3 * GiB)), ("WanVAE", int(0.5 * GiB))]
    keep, line = core.room_beside_comfyui("cuda:0", 9 * GiB, 20 * GiB, models)
    print(line)
    assert keep == 0 and "kept ComfyUI's models there (UMT5XXL 6.3 GiB, WanVAE 0.5 GiB)" in line
    free, line = core.room_beside_comfyui("cuda:0", 22 * GiB, 20 * GiB, models)
    print(line)
    assert free == 22 * GiB + core.COMFY_DEVICE_MARGIN and "ComfyUI freed what the job needs" in line
    assert "even without them" not in line
    free, line = core.room_beside_comfyui("cuda:0", 40 * GiB, 20 * GiB, models)
    assert free > 0 and "even without them the device has 26.8 GiB" in line


def test_a_jobs_need_on_a_gpu_leaves_out_what_the_running_ranks_hold_there():
    """The first job on a GPU needs its model's weights, its activations and the CUDA runtime; once the ranks run and
    keep the model on the GPU, only the activations."""
    from types import SimpleNamespace
    from engine.generate.request import GenerateRequest
    core = _core()
    request = GenerateRequest.random_conditioning("synthetic:wan2.1-14b", 832, 480, frames=33, dtype="bf16",
                                                  text_tokens=512).validate(1)
    first = core.job_device_need(None, request)
    record = SimpleNamespace(engine=SimpleNamespace(running=True),
                             last_residency=[{"file": "synthetic:wan2.1-14b", "where": "cuda:0"}])
    request = GenerateRequest(**{**{f: getattr(request, f) for f in request.__dataclass_fields__},
                                 "model": "synthetic:wan2.1-14b"})
    again = core.job_device_need(record, request)
    print(f"first job {first / GiB:.1f} GiB, with the model resident {again / GiB:.1f} GiB")
    assert first > again + 26 * GiB and again > 0
