"""The generate request: declared once, validated on the client (plan resolved there), and rebuilt on the ranks
from the job document exactly as the client sent it, with no default declared a second time."""
import os
from dataclasses import fields

import pytest
import torch

from engine.generate.request import GenerateRequest
from engine.models import load
from engine.models.tiny import write_tiny
from engine.parallel.devices import cpu_hardware
from engine.parallel.plan import ParallelPlan


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return write_tiny("sd3", str(tmp_path_factory.mktemp("req")), variant="sd3.5-medium")


def request(model, **kw):
    g = torch.Generator().manual_seed(0)
    base = dict(model=model, cond=torch.randn(2, 9, 4096, generator=g), pooled=torch.randn(2, 2048, generator=g),
                latent_raw=torch.zeros(2, 16, 8, 8), neg_cond=torch.randn(1, 9, 4096, generator=g),
                neg_pooled=torch.randn(1, 2048, generator=g), cfg=4.5, seed=2**64 - 1, steps=3,
                sampler="dpmpp_2m", scheduler="beta", denoise=0.75, guidance=2.5, batch_index=[4, 1])
    base.update(kw)
    return GenerateRequest(**base)


def test_a_request_crosses_the_process_boundary_unchanged(sd3):
    sent = request(sd3).validate(ranks=4, hardware=cpu_hardware(4))   # CPU ranks: auto uses all four
    spec, inputs = sent.to_job()
    got = GenerateRequest.from_job(spec, inputs)
    print(sent.choice.reason)
    for f in fields(GenerateRequest):
        if f.metadata.get("local"):   # the client's own notes (why this plan) stay with the client
            assert got.choice is None
            continue
        a, b = getattr(sent, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f.name  # the same bytes: exact by construction
        else:
            assert (os.path.abspath(a) if f.name == "model" else a) == b, f.name
    assert got.plan == sent.plan == ParallelPlan(dp=2, cfg=2)


def test_the_job_document_carries_every_field_so_the_ranks_never_fall_back_to_a_default(sd3):
    r = request(sd3)
    r = r.validate(ranks=1)
    spec, inputs = r.to_job()
    absent = {f.name for f in fields(GenerateRequest) if f.metadata.get("tensor") and getattr(r, f.name) is None}
    assert set(spec) | set(inputs) == {f.name for f in fields(GenerateRequest) if not f.metadata.get("local")} - absent
    assert absent == {"clip_vision_output", "concat_latent_image", "concat_mask", "neg_clip_vision_output",
                      "neg_concat_latent_image", "neg_concat_mask", "noise_mask", "pose_latent", "pose_cond",
                      "pose_clip_vision_output", "byt5", "neg_byt5"}   # inputs SD3 takes none of
    for key in ("steps", "plan"):
        partial = {k: v for k, v in spec.items() if k != key}
        with pytest.raises(ValueError, match=f"missing \\['{key}'\\]"):
            GenerateRequest.from_job(partial, inputs)
    with pytest.raises(ValueError, match="unknown \\['shift'\\]"):
        GenerateRequest.from_job(dict(spec, shift=3.0), inputs)


def test_cfg_one_leaves_the_negative_tensors_at_home(sd3):
    r = request(sd3, cfg=1.0)
    r = r.validate(ranks=1)
    _, inputs = r.to_job()
    assert set(inputs) == {"cond", "pooled", "latent_raw"}


def test_an_unresolved_plan_cannot_be_sent(sd3):
    with pytest.raises(ValueError, match="call validate"):
        request(sd3).to_job()


@pytest.mark.parametrize("field,value,message", [
    ("seed", -5, r"seed=-5 is invalid: use an integer in \[0, 2\*\*64\)"),
    ("seed", 2**64, r"seed=18446744073709551616 is invalid"),
    ("steps", 0, "steps=0 is invalid"),
    ("cfg", float("nan"), "cfg=nan is invalid: use a finite number"),
    ("denoise", 0.0, r"denoise=0.0 is invalid: use a value in \(0, 1\]"),
    ("sampler", "lms", "sampler='lms' is not supported"),
    ("batch_index", [0, -1], r"batch_index=\[0, -1\] is invalid"),
])
def test_scalar_checks_run_before_the_file_is_read_and_on_the_ranks_too(sd3, field, value, message):
    with pytest.raises(ValueError, match=message):
        request(sd3, **{field: value}).validate(ranks=1)
    r = request(sd3)
    r = r.validate(ranks=1)
    spec, inputs = r.to_job()
    with pytest.raises(ValueError, match=message):
        GenerateRequest.from_job(dict(spec, **{field: value}), inputs)


def test_the_checkpoint_header_is_read_once_and_again_only_when_the_file_changes(sd3, monkeypatch):
    from engine.models import reader
    reads = []
    original = reader.read_header
    monkeypatch.setattr(reader, "read_header", lambda path: reads.append(path) or original(path))
    load._INFO_CACHE.clear()
    for ranks in (1, 2, 4):
        request(sd3).validate(ranks=ranks)
    assert len(reads) == 1
    st = os.stat(sd3)
    os.utime(sd3, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    request(sd3).validate(ranks=1)
    assert len(reads) == 2


def test_an_sd3_latent_larger_than_its_position_grid_is_refused_before_any_rank(sd3):
    with pytest.raises(ValueError, match="1024x1024 px is too large for sd3.5-medium: its position grid allows up to "
                                         "512x512 px"):
        request(sd3, latent_raw=torch.zeros(2, 16, 128, 128)).validate(ranks=1)
