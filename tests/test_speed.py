"""Kernels and compile as job options, on a CPU rank: torch.compile of the blocks agrees with eager to fp32 rounding
and a second job of the same shapes reuses the compiled graphs; the compiled blocks keep working under the step cache;
the attention option is refused on a CPU rank where it names a CUDA kernel."""
import pytest
import torch

from engine.errors import EngineError
from engine.generate.request import GenerateRequest
from engine.models.tiny import write_tiny
from engine.runtime.client import Engine

from conftest import FAST


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return write_tiny("flux", str(tmp_path_factory.mktemp("speed")))


def job(model, **options):
    g = torch.Generator().manual_seed(11)
    r = GenerateRequest(model=model, cond=torch.randn(1, 24, 4096, generator=g), pooled=torch.randn(1, 768, generator=g),
                        latent_raw=torch.zeros(1, 16, 16, 16), seed=5, steps=3, **options)
    r = r.validate(1)
    return r.to_job()


def test_compiled_blocks_match_eager_and_reuse_their_graphs(flux):
    from tolerance import fp32_bound, sampling_amplification
    with Engine(1, device="cpu", deadlines=FAST) as engine:
        eager = engine.submit("generate", *job(flux)).outputs["samples"]
        first = engine.submit("generate", *job(flux, compile=True))     # compiles (tens of seconds on a CPU)
        second = engine.submit("generate", *job(flux, compile=True))
        cached = engine.submit("generate", *job(flux, compile=True, cache_threshold=0.0))
        back = engine.submit("generate", *job(flux)).outputs["samples"]
    diff = (first.outputs["samples"] - eager).abs().max().item()
    bound = fp32_bound(eager.abs().max(), reduction=4096, depth=8, amplification=sampling_amplification(3, 1.0))
    print(f"compiled vs eager max abs diff {diff:.3g} (bound {bound:.3g}); graphs after job 1: "
          f"{first.ranks[0]['compiled_graphs']}, after job 2: {second.ranks[0]['compiled_graphs']}")
    assert 0 < first.ranks[0]["compiled_graphs"] == second.ranks[0]["compiled_graphs"]
    assert diff <= bound
    assert torch.equal(second.outputs["samples"], first.outputs["samples"])
    assert torch.equal(cached.outputs["samples"], first.outputs["samples"])  # the cache around compiled blocks
    assert torch.equal(back, eager)  # compile off again: the eager blocks as they were


def test_cuda_kernel_refused_on_a_cpu_rank(flux):
    with Engine(1, device="cpu", deadlines=FAST) as engine:
        with pytest.raises(EngineError, match="attention='flash' needs a CUDA device"):
            engine.submit("generate", *job(flux, attention="flash"))
        math = engine.submit("generate", *job(flux, attention="math")).outputs["samples"]
        auto = engine.submit("generate", *job(flux)).outputs["samples"]
    rel = ((math - auto).norm() / auto.norm()).item()
    print(f"attention math vs auto on CPU, relative L2 {rel:.3g}")
    assert rel < 1e-5
