"""Jobs through real rank groups (world 1, 2, 4): bit-exact tensor round trips through the shared-memory
bridge, one identical job on every rank, progress, agreed cancel, and errors that leave the group sound."""
import os
import threading

import pytest
import torch

from engine.runtime import bridge
from engine.runtime.client import Engine
from engine.errors import EngineError, JobCancelled

from conftest import FAST


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(3, 5, 7, generator=g),
        "f16": torch.randn(2, 16, 9, 9, generator=g).half(),
        "bf16": torch.randn(1, 77, 64, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(),
        "fp8": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-2**62, 2**62, (11,), generator=g),
        "u8": torch.randint(0, 256, (3, 3), generator=g, dtype=torch.uint8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 8, generator=g)[:, ::2],  # not contiguous
        "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }


def assert_bit_exact(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(bits(got[name]), bits(t)), f"{name} differs"


@pytest.mark.parametrize("return_from", ["first", "last"])
def test_tensors_of_every_dtype_and_shape_round_trip_bit_exactly(engine, return_from):
    inputs = sample_tensors()
    rank = 0 if return_from == "first" else engine.world - 1
    result = engine.submit("echo", {"return_rank": rank}, inputs)
    assert_bit_exact(result.outputs, inputs)


def test_a_64_mb_tensor_round_trips_bit_exactly(engine):
    big = torch.randn(64 * 2**20 // 4, generator=torch.Generator().manual_seed(1))
    result = engine.submit("echo", {"return_rank": engine.world - 1}, {"big": big})
    assert result.outputs["big"].numel() * 4 == 64 * 2**20
    assert torch.equal(bits(result.outputs["big"]), bits(big))


def test_every_rank_verified_the_same_job_id_and_checksum(engine):
    result = engine.submit("echo", {"note": "same everywhere"}, sample_tensors())
    assert [r["rank"] for r in result.ranks] == list(range(engine.world))
    assert {(r["job_id"], r["crc32"]) for r in result.ranks} == {(result.job_id, result.crc32)}


def test_results_carry_per_stage_timings(engine):
    result = engine.submit("echo", {}, {"x": torch.ones(4)})
    assert set(result.timings) == {"queue_s", "write_s", "broadcast_s", "compute_s", "return_s", "total_s"}
    assert all(v >= 0 for v in result.timings.values())
    assert result.timings["total_s"] >= result.timings["compute_s"]


def test_a_job_without_tensors_runs(engine):
    assert engine.submit("echo", {}).outputs == {}


def test_progress_arrives_once_per_step_in_order(engine):
    seen = []
    engine.submit("echo", {"steps": 5}, {"x": torch.zeros(2)}, on_progress=lambda s, t: seen.append((s, t)))
    assert seen == [(s, 5) for s in range(1, 6)]


def test_cancel_stops_all_ranks_within_a_step_and_the_next_job_succeeds(engine):
    seen = []
    with pytest.raises(JobCancelled) as info:
        engine.submit("echo", {"steps": 200, "step_sleep_s": 0.05}, {"x": torch.zeros(2)},
                      on_progress=lambda s, t: seen.append(s), should_cancel=lambda: len(seen) >= 3)
    stopped_at = info.value.step
    print(f"cancel requested after step 3 was reported; ranks stopped together at step {stopped_at}")
    assert 3 <= stopped_at <= len(seen) + 1
    assert len(seen) < 10
    x = torch.arange(5.0)
    assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)


def test_a_cancel_check_that_raises_cancels_the_job_and_reraises(engine):
    seen = []

    def should_cancel():
        if len(seen) >= 2:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        engine.submit("echo", {"steps": 100, "step_sleep_s": 0.05}, {"x": torch.zeros(1)},
                      on_progress=lambda s, t: seen.append(s), should_cancel=should_cancel)
    assert len(seen) < 10
    assert engine.submit("echo", {}, {"x": torch.ones(1)}).outputs["x"].item() == 1.0


def test_jobs_from_two_threads_run_one_at_a_time_and_both_succeed(engine):
    results, errors = {}, []

    def worker(i):
        try:
            x = torch.full((1000,), float(i))
            results[i] = torch.equal(engine.submit("echo", {"steps": 3}, {"x": x}).outputs["x"], x)
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert errors == [] and results == {0: True, 1: True}


def test_a_progress_callback_that_raises_cancels_the_job_and_reraises(engine):
    class Interrupted(Exception):
        pass

    def on_progress(step, total):
        if step == 2:
            raise Interrupted()

    with pytest.raises(Interrupted):
        engine.submit("echo", {"steps": 100, "step_sleep_s": 0.05}, {"x": torch.zeros(1)}, on_progress=on_progress)
    generation = engine.generation
    assert engine.submit("echo", {}, {"x": torch.ones(1)}).outputs["x"].item() == 1.0
    assert engine.generation == generation  # no restart was needed


def test_an_exception_on_every_rank_is_reported_and_the_group_stays_up(engine):
    generation = engine.generation
    with pytest.raises(EngineError, match="unknown to the ranks") as info:
        engine.submit("no-such-kind", {})
    assert info.value.rank == 0 and info.value.phase == "broadcast"
    assert engine.generation == generation
    assert engine.submit("echo", {}, {"x": torch.ones(3)}).outputs["x"].sum().item() == 3.0


def test_an_exception_on_one_rank_names_it_and_the_next_job_succeeds(engine):
    bad = engine.world - 1
    with pytest.raises(EngineError, match=f"rank {bad} failed in phase compute.*told to fail") as info:
        engine.submit("echo", {"steps": 3, "raise_on_rank": bad, "raise_at_step": 1}, {"x": torch.zeros(1)})
    assert info.value.rank == bad
    assert engine.submit("echo", {}, {"x": torch.ones(2)}).outputs["x"].sum().item() == 2.0


def test_shared_memory_altered_after_the_client_wrote_it_is_caught_by_every_rank(engine, monkeypatch):
    real_write = bridge.write_segment

    def write_then_corrupt(path, tensors, **kw):
        manifest = real_write(path, tensors, **kw)
        with open(path, "r+b") as f:
            f.write(b"\xff\xfe")
        return manifest

    monkeypatch.setattr(bridge, "write_segment", write_then_corrupt)
    with pytest.raises(EngineError, match="crc32") as info:
        engine.submit("echo", {}, {"x": torch.zeros(16)})
    assert info.value.phase == "broadcast"
    monkeypatch.setattr(bridge, "write_segment", real_write)
    assert engine.submit("echo", {}, {"x": torch.ones(1)}).outputs["x"].item() == 1.0


def test_the_client_process_is_never_a_rank(engine):
    import torch.distributed as dist
    engine.submit("echo", {}, {"x": torch.ones(1)})
    assert not dist.is_initialized()
    assert all(info["pid"] != __import__("os").getpid() for info in engine.rank_info)


def test_world_one_uses_no_process_group():
    with Engine(1, device="cpu", deadlines=FAST) as e:
        assert e.rank_info[0]["backend"] == "none"
        assert torch.equal(e.submit("echo", {}, {"x": torch.ones(2)}).outputs["x"], torch.ones(2))


def test_invalid_engine_arguments_are_rejected_before_any_rank_starts():
    for kwargs, message in [({"ranks": 0}, "ranks=0"), ({"ranks": 9}, "ranks=9"),
                            ({"ranks": 2, "device": "tpu"}, "device='tpu'"),
                            ({"ranks": 2, "gpus": [0, 1]}, "gpus=\\[0, 1\\] given with device='cpu'")]:
        with pytest.raises(ValueError, match=message):
            Engine(**kwargs)


def test_two_models_alternate_on_the_ranks_without_reading_their_files_again(tmp_path):
    """Two experts of one clip (two files) take turns on one engine: after each is loaded once, switching reads no
    file (the ranks keep RESIDENT_MODELS models); a third model drops the least recently used; results are the same
    as from a fresh load."""
    from engine.generate.request import GenerateRequest
    from engine.generate.residency import RESIDENT_MODELS
    from engine.models.tiny import write_tiny
    files = [write_tiny("flux", str(tmp_path / name), seed=seed) for name, seed in (("a", 0), ("b", 1), ("c", 2))]
    for f in files:
        assert os.path.exists(f)
    g = torch.Generator().manual_seed(3)
    cond, pooled = torch.randn(1, 8, 4096, generator=g), torch.randn(1, 768, generator=g)

    def run(engine, path):
        r = GenerateRequest(model=path, cond=cond, pooled=pooled, latent_raw=torch.zeros(1, 16, 8, 8), steps=2)
        result = r.validate(1).submit(engine)
        return result.outputs["samples"], result.ranks[0]

    with Engine(1, device="cpu", deadlines=FAST) as e:
        sources = []
        outs = {}
        for path in (files[0], files[1], files[0], files[1], files[2], files[0]):
            out, info = run(e, path)
            sources.append(info["model_source"])
            outs.setdefault(path, []).append(out)
    print("model sources:", sources)
    assert RESIDENT_MODELS == 2
    assert sources == ["file", "file", "resident", "resident", "file", "file"]   # c dropped a; b dropped by a
    for path, runs in outs.items():
        assert all(torch.equal(runs[0], o) for o in runs[1:]), path
