"""Weights divided among ranks (the plan's `shard` degree, torch's FSDP2) on real rank processes (gloo, CPU): every
family's latent under a sharded plan equals the single-rank latent of the same file (fp32, max abs diff printed,
against the same derived bound as every other plan), with each rank holding and reading about 1/shard of the
weights; quantized files (GGUF, fp8_scaled) divide their stored bytes; LoRAs apply to each rank's rows; the MODEL
route's calls keep every shard group in step; a mesh dropped takes its division with it; a rank that dies while
the others wait in a gather ends the job with an error, never a hang; bad shard degrees are refused before launch."""
import os

import pytest
import torch

from engine.cli import describe
from engine.generate.request import GenerateRequest, empty_latent
from engine import families
from engine.models.load import build_empty, inspect_model, load_model
from engine.models.tiny import write_tiny
from engine.parallel.plan import ParallelPlan
from tolerance import fp32_bound, report, sampling_amplification

STEPS = 2
VARIANTS = {"flux": None, "sd3": "sd3.5-medium", "qwen-image": None, "flux2": None, "wan": "wan2.1-1.3b"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    out = {kind: write_tiny(kind, str(d), variant=variant) for kind, variant in VARIANTS.items()}
    out["flux-gguf"] = write_tiny("flux", str(d), format="gguf", quant="Q8_0")
    out["flux-fp8_scaled"] = write_tiny("flux", str(d), format="fp8_scaled")
    out["flux-fp8_mixed"] = write_tiny("flux", str(d), format="fp8_mixed")   # ComfyUI's mixed-precision layers
    out["flux-fp8"] = write_tiny("flux", str(d), dtype="fp8_e4m3fn")
    out["flux-gguf-q4k"] = write_tiny("flux", str(d), format="gguf", quant="Q4_K")
    return out


def request(path, plan=ParallelPlan(), *, cfg=1.0, batch=1, text=(16, 16), hw=(16, 16), frames=5, **kw):
    info = inspect_model(path)
    g = torch.Generator().manual_seed(3)
    cond, pooled = describe.cond_tensors(info, text[0], g)
    neg_cond, neg_pooled = describe.cond_tensors(info, text[1], g)
    fields = dict(model=path, cond=cond.expand(batch, -1, -1).clone(),
                  pooled=None if pooled is None else pooled.expand(batch, -1).clone(),
                  latent_raw=empty_latent(info, hw[1] * 8, hw[0] * 8, batch, frames if info.spec.frames else 1),
                  seed=5, steps=STEPS, cfg=cfg, plan=plan, **kw)
    if cfg != 1.0:
        fields.update(neg_cond=neg_cond, neg_pooled=neg_pooled)
    if info.family in ("flux", "flux2"):
        fields.setdefault("guidance", 3.5)
    return GenerateRequest(**fields).validate()


def run(engines, r):
    result = engines(r.plan.world_size).submit("generate", *r.to_job())
    return result.outputs["samples"], result.ranks


def bound(reference, path, cfg):
    """A rank split sums in another order (and a gathered block computes as the whole one did: the same weights):
    fp32 rounding through the tiny model's blocks over the job's steps."""
    info = inspect_model(path)
    model = build_empty(info)
    depth = sum(len(model.get_submodule(name)) for name in families.get(info.family).tokens.blocks)
    return fp32_bound(reference.abs().max(), reduction=4096, depth=depth,
                      amplification=sampling_amplification(STEPS, cfg))


CASES = [
    # model, plan, cfg, batch
    ("flux", dict(ulysses=2, shard=2), 1.0, 1),
    ("flux", dict(cfg=2, shard=2), 3.0, 1),
    ("flux", dict(dp=2, shard=2), 1.0, 2),
    ("sd3", dict(ring=2, shard=2), 4.5, 1),
    ("qwen-image", dict(ulysses=2, shard=2), 2.5, 1),
    ("flux2", dict(ulysses=2, shard=2), 1.0, 1),
    ("wan", dict(cfg=2, shard=2), 5.0, 1),
    ("flux-gguf", dict(ulysses=2, shard=2), 1.0, 1),
    ("flux-fp8_scaled", dict(ulysses=2, shard=2), 1.0, 1),
    ("flux-fp8_mixed", dict(ulysses=2, shard=2), 1.0, 1),
    ("flux-fp8", dict(ulysses=2, shard=2), 1.0, 1),
    ("flux-gguf-q4k", dict(cfg=2, shard=2), 3.0, 1),
    # four ranks: two shard groups (sub-meshes of the Ulysses x Ring plan), and one group across both CFG groups
    ("flux-gguf-q4k", dict(ulysses=2, ring=2, shard=2), 1.0, 1),
    ("wan", dict(cfg=2, ulysses=2, shard=4), 5.0, 1),
]


@pytest.mark.parametrize("model,plan,cfg,batch", CASES,
                         ids=[f"{m}-{ParallelPlan(**p).describe().replace(' ', '')}" for m, p, _, _ in CASES])
def test_a_sharded_plan_gives_the_single_rank_latent_and_each_rank_holds_its_share(files, engines, model, plan,
                                                                                    cfg, batch):
    path = files[model]
    want, whole = run(engines, request(path, cfg=cfg, batch=batch))
    got, ranks = run(engines, request(path, ParallelPlan(**plan), cfg=cfg, batch=batch))
    assert got.shape == want.shape
    assert report(f"{model} {ParallelPlan(**plan).describe()} cfg {cfg} batch {batch}", (got - want).abs().max(),
                  bound(want, path, cfg))
    one = load_model(path).stats   # what one rank holds and reads of the whole model
    for i, rk in enumerate(ranks):
        loaded = rk["loaded"]   # this plan's division is loaded by this job (from the file)
        print(f"rank {i}: holds {loaded['held_bytes']} of {one['held_bytes']} bytes, read {loaded['bytes_read']} of "
              f"{one['bytes_read']}")
        n = ParallelPlan(**plan).shard
        assert loaded["shard"]["size"] == n
        # 1/n of every divided tensor, plus what stays whole (buffers, a block's rows rounded up): under 1.2/n
        assert loaded["held_bytes"] < 1.2 / n * one["held_bytes"]
        assert loaded["bytes_read"] < 1.2 / n * one["bytes_read"]


def test_a_lora_on_divided_weights_equals_the_merged_checkpoint_and_removing_it_restores_each_ranks_rows(
        files, engines, tmp_path):
    """A merged LoRA adds each rank's rows of its difference; a changed list reads back only the rows a rank holds.
    GGUF matrices take the LoRA beside the gathered blocks (their factors whole on every rank)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from test_lora import FLUX_LAYERS, factors, kohya, merged_checkpoint
    with safe_open(files["flux"], "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    lora = str(tmp_path / "lora.safetensors")
    f1 = factors(weights, FLUX_LAYERS, seed=1)
    save_file(kohya(f1), lora)
    merged = merged_checkpoint(files["flux"], str(tmp_path / "merged.safetensors"), (0.8, f1))
    plan = ParallelPlan(ulysses=2, shard=2)
    base, _ = run(engines, request(files["flux"], plan))
    want, _ = run(engines, request(merged))
    got, ranks = run(engines, request(files["flux"], plan, loras=[(lora, 0.8)]))
    assert report("flux ulysses2 x shard2 LoRA 0.8 vs merged checkpoint on one rank", (got - want).abs().max(),
                  bound(want, files["flux"], 1.0))
    restored, ranks = run(engines, request(files["flux"], plan))
    read = [rk["lora_restore_bytes"] for rk in ranks]
    print(f"LoRA removed: each rank read back {read} bytes; the latent equals the base's: {torch.equal(restored, base)}")
    assert torch.equal(restored, base)   # the file's own rows back in place: the same computation
    touched = sum(weights[layer + ".weight"].numel() * 4 for layer in FLUX_LAYERS)
    assert all(0 < r < 0.6 * touched for r in read)
    # GGUF: the LoRA rides on top of the quantized layers
    gguf_want, _ = run(engines, request(files["flux-gguf"], loras=[(lora, 0.8)]))
    gguf_got, ranks = run(engines, request(files["flux-gguf"], plan, loras=[(lora, 0.8)]))
    assert ranks[0]["lora_layers_on_top"] > 0
    assert report("flux GGUF ulysses2 x shard2 LoRA on top vs one rank", (gguf_got - gguf_want).abs().max(),
                  bound(gguf_want, files["flux-gguf"], 1.0))


def flux_call(rows, seed, tokens):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 16, 16, 16, generator=g), torch.full((rows,), 0.7),
            {"context": torch.randn(rows, tokens, 4096, generator=g), "y": torch.randn(rows, 768, generator=g),
             "guidance": torch.full((rows,), 3.5)})


def test_model_calls_that_the_cfg_groups_share_unevenly_keep_every_shard_group_in_step(files, engines):
    """The MODEL route's grouped calls: three calls on cfg2 x shard2 give CFG group 0 two forwards and group 1 one;
    the weights' gathers span both groups, so group 1 runs one more forward (its output dropped) and nobody waits
    for a gather that never comes. Each output equals the one-rank model's."""
    from engine.generate.model_call import ModelSession
    from engine.models.flow import FlowModel, Prepared
    flow = FlowModel(load_model(files["flux"], dtype="fp32"))
    calls = [flux_call(1, seed, tokens) for seed, tokens in ((1, 8), (2, 12), (3, 10))]
    want = [flow.output(x, t, Prepared(c["context"], c["y"], c["guidance"])) for x, t, c in calls]
    x, t, c = calls[0]
    r = GenerateRequest(model=files["flux"], cond=c["context"], pooled=c["y"], latent_raw=torch.zeros(()).expand(
        1, 16, 16, 16), cfg=2.0, neg_cond=calls[1][2]["context"], neg_pooled=calls[1][2]["y"],
        plan=ParallelPlan(cfg=2, shard=2)).validate(2)
    with ModelSession(engines(2), r) as s:
        for _ in range(2):
            got = s.call_group(calls)
        two = s.call_group(calls[:2])
    for i, (g, w) in enumerate(zip(got + two, want + want[:2])):
        assert report(f"cfg2 x shard2 grouped call {i % 3} of {3 if i < 3 else 2}", (g - w).abs().max(),
                      fp32_bound(w.abs().max(), reduction=4096, depth=8))


def test_a_rank_killed_while_the_other_waits_in_a_gather_is_named_and_the_next_sharded_job_runs(files, fresh_engine):
    """Every block's weights are gathered from both ranks: killing one mid-job leaves the other inside a gather. The
    client names the dead rank within seconds (no deadline needed), replaces the group, and the next job loads its
    division again and gives the latent a whole run gives."""
    import signal
    import time
    from engine.errors import EngineError
    import dataclasses
    r = dataclasses.replace(request(files["flux"], ParallelPlan(ulysses=2, shard=2), hw=(32, 32)), steps=40)
    victim, killed = fresh_engine.pids[1], []

    def on_progress(step, total):
        if step == 3 and not killed:
            killed.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)
    with pytest.raises(EngineError) as err:
        fresh_engine.submit("generate", *r.to_job(), on_progress=on_progress)
    detected = time.monotonic() - killed[0]
    print(f"rank 1 killed at step 3 of a sharded job: named after {detected:.2f} s: {str(err.value).splitlines()[0]}")
    assert err.value.rank == 1 and "rank 1 died" in str(err.value) and detected < 10
    r = dataclasses.replace(r, steps=STEPS)
    after = fresh_engine.submit("generate", *r.to_job())
    assert after.ranks[1]["model_source"] == "file"
    want, _ = run(lambda world: fresh_engine, request(files["flux"], hw=(32, 32)))
    assert report("the sharded job after the group was replaced vs one rank", (after.outputs["samples"] - want).abs().max(),
                  bound(want, files["flux"], 1.0))


def test_a_dropped_mesh_takes_its_division_and_the_plan_loads_it_again(files, engines):
    """A rank keeps the last few plans' meshes; a sharded model belongs to its mesh's shard group, so when the mesh is
    destroyed the model goes with it (no weights left bound to a destroyed communicator) and the plan's next job
    reads its rows again, giving the same latent."""
    from engine.runtime.jobs import MESHES_KEPT
    sharded = request(files["flux"], ParallelPlan(ulysses=2, shard=2))
    first = engines(2).submit("generate", *sharded.to_job())
    again = engines(2).submit("generate", *sharded.to_job())
    assert again.ranks[0]["model_source"] == "resident"
    for plan in [ParallelPlan(ring=2), ParallelPlan(dp=2), ParallelPlan(ulysses=2), ParallelPlan(ring=2, shard=2)][
            :MESHES_KEPT + 1]:
        engines(2).submit("generate", *request(files["flux"], plan, batch=2 if plan.dp > 1 else 1).to_job())
    last = engines(2).submit("generate", *sharded.to_job())
    print(f"after {MESHES_KEPT + 1} other plans: {last.ranks[0]['model_source']}, meshes {last.ranks[0]['meshes']}, "
          f"models kept {last.ranks[0]['models_resident']}")
    assert last.ranks[0]["model_source"] == "file" and last.ranks[0]["models_resident"] <= 2
    assert torch.equal(last.outputs["samples"], first.outputs["samples"])


@pytest.mark.parametrize("args,words", [
    (["--ulysses", "2", "--shard", "3"], "shard=3 does not divide the plan's 2 rank"),
    (["--pipefusion", "2", "--shard", "2"], "shard 2 with pipefusion 2"),
    (["--shard", "0"], "--shard"),
])
def test_a_shard_degree_that_cannot_run_is_refused_in_one_line_before_any_rank_starts(files, tmp_path, args, words,
                                                                                      capsys, monkeypatch):
    """(In the test's process: `python -m engine` is this main; a rank started would fail the test.)"""
    from safetensors.torch import save_file
    from engine.cli import main
    from engine.runtime import client
    monkeypatch.setattr(client.Engine, "__init__", lambda *a, **k: pytest.fail("a rank group was started"))
    cond = str(tmp_path / "cond.safetensors")
    save_file({"cond": torch.zeros(1, 8, 4096), "pooled": torch.zeros(1, 768)}, cond)
    code = main(["generate", "--model", files["flux"], "--cond", cond, "--out", str(tmp_path / "out.safetensors"),
                 "--width", "128", "--height", "128", "--steps", "1", *args])
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err
    assert "Traceback" not in err


def test_compiled_blocks_under_divided_weights_give_the_eager_single_rank_latent(files, engines):
    """torch.compile takes each block (FSDP2's hooks stay outside its graph, on the block module): the sharded plan's
    compiled latent equals the one-rank eager latent within the same bound (a compiled block may fuse and reorder
    its sums)."""
    want, _ = run(engines, request(files["flux"]))
    got, ranks = run(engines, request(files["flux"], ParallelPlan(ulysses=2, shard=2), compile=True))
    print(f"compiled graphs on rank 0: {ranks[0].get('compiled_graphs')}")
    assert ranks[0].get("compiled_graphs")
    assert report("flux ulysses2 x shard2 compiled vs one rank eager", (got - want).abs().max(),
                  bound(want, files["flux"], 1.0))


def test_both_wan_experts_divided_over_the_same_ranks_stay_resident_between_switches(tmp_path, engines):
    """Wan 2.2 A14B's two experts on one sharded plan: each rank keeps 1/2 of each; switching back reads no file."""
    high = write_tiny("wan", str(tmp_path / "high"), variant="wan2.2-a14b", seed=1)
    low = write_tiny("wan", str(tmp_path / "low"), variant="wan2.2-a14b", seed=2)
    plan = ParallelPlan(cfg=2, shard=2)
    seen = []
    for path in (high, low, high, low):
        result = engines(2).submit("generate", *request(path, plan, cfg=5.0).to_job())
        rk = result.ranks[0]
        seen.append((os.path.basename(os.path.dirname(path)), rk["model_source"], rk["models_resident"]))
        if "loaded" in rk:
            assert rk["loaded"]["held_bytes"] < 0.6 * load_model(path).stats["held_bytes"]
    print(seen)
    assert [s[1] for s in seen] == ["file", "file", "resident", "resident"] and seen[-1][2] == 2
    want, _ = run(engines, request(low, cfg=5.0))
    assert report("the low-noise expert after the switches vs one rank", (result.outputs["samples"] - want).abs().max(),
                  bound(want, low, 5.0))


def test_the_fp8_weight_option_divides_the_fp8_matrices(files, engines):
    """weight_dtype fp8_e4m3fn (`--fp8-weights`) on a bf16/fp32 file: every matrix stored in fp8, and divided as fp8."""
    want, whole = run(engines, request(files["flux"], fp8_weights=True))
    got, ranks = run(engines, request(files["flux"], ParallelPlan(ulysses=2, shard=2), fp8_weights=True))
    one = load_model(files["flux"], fp8_weights=True).stats
    print(f"fp8 weights: rank 0 holds {ranks[0]['loaded']['held_bytes']} of {one['held_bytes']} bytes")
    assert ranks[0]["loaded"]["fp8_linears"] == one["fp8_linears"] > 0
    assert ranks[0]["loaded"]["held_bytes"] < 0.6 * one["held_bytes"]
    assert report("flux fp8 weights ulysses2 x shard2 vs one rank", (got - want).abs().max(),
                  bound(want, files["flux"], 1.0))


@pytest.mark.parametrize("degrees,words", [("3", "3: plan ulysses3 cannot run this job"), ("9", "9: ranks=9 is invalid")])
def test_bench_shard_refuses_a_degree_it_cannot_run_in_one_line_before_any_rank_starts(degrees, words, capsys,
                                                                                       monkeypatch):
    from engine.cli import main
    from engine.runtime import client
    monkeypatch.setattr(client.Engine, "__init__", lambda *a, **k: pytest.fail("a rank group was started"))
    code = main(["bench", "shard", "--degrees", degrees])
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err


UNIT_GATHERS_PROBE = r'''
import collections, json, sys, torch, torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as groups
from torch.distributed.fsdp import FSDPModule
from engine import families
from engine.families import ltx23
from engine.models.flow import FlowModel, Prepared
from engine.models.load import load_model
from engine.models.sharded import gathered
from engine.parallel.shard import shard_spec

class Group:   # the mesh's "shard" group as shard_spec reads it (a size above one, or it divides nothing)
    size, rank, ranks = 2, 0, (0,)
    pg = None

class Mesh:
    device_type = "cpu"
    groups = {"shard": Group()}

family, path, port = sys.argv[1:4]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=0, world_size=1)
Group.pg = dist.group.WORLD
spec = shard_spec(Mesh(), families.get(family))
spec = type(spec)(size=1, rank=0, ranks=(0,), wrap=spec.wrap)   # the process group's one rank holds every row
loaded = load_model(path, dtype="fp32", shard=spec)
model, flow = loaded.model, FlowModel(loaded)
gathers = collections.Counter()
unshard = groups.FSDPParamGroup.unshard
def counting(self, *args, **kwargs):
    if not self.is_unsharded and self._all_gather_result is None:
        gathers[self._module_fqn or "root"] += 1
    return unshard(self, *args, **kwargs)
groups.FSDPParamGroup.unshard = counting
g = torch.Generator().manual_seed(0)
if family == "minimax-h3":   # one call of two rows: a forward each
    x = torch.randn(2, 1, 24 * 3 * 4 * 6 + 32 * 2 * 7, generator=g)
    extras = {"av_shape": torch.tensor([[24, 3, 4, 6, 32, 2, 7]] * 2, dtype=torch.float64),
              "audio_scale": torch.full((2,), 4.0, dtype=torch.float64),
              "sigma_shift": torch.tensor([[12.0, 3.0]] * 2, dtype=torch.float64)}
    text = torch.randn(2, 9, loaded.info.config["text_dim"], generator=g)
    flow.output(x, torch.tensor([700.0, 700.0]), Prepared(text, None, torch.ones(2), extras=extras))
else:   # the context held once (the connectors run), then two calls that use it, all in one request's gather
    x = torch.randn(1, 1, 128 * 2 * 2 * 3 + 8 * 5 * 16, generator=g)
    extras, t = ltx23.comfy_call([(1, 128, 2, 2, 3), (1, 8, 5, 16)], {"frame_rate": 24.0}, {}, torch.tensor([0.7]))
    text = torch.randn(1, 7, loaded.info.config["cross_attention_dim"] + loaded.info.config["audio_cross_attention_dim"],
                       generator=g)
    with gathered(model):
        held = flow.family.hold(flow, "context", text)
        for _ in range(2):
            flow.output(x, t, Prepared(text, None, torch.ones(1), extras=extras, held=held))
units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
print(json.dumps({"gathers": dict(gathers), "units": units}))
'''


def unit_gathers(tmp_path, family):
    import json
    import socket
    import subprocess
    import sys
    from conftest import ROOT
    path = write_tiny(family, str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", UNIT_GATHERS_PROBE, family, path, str(port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_root_unit_is_gathered_once_a_call_however_many_forwards_the_family_makes(tmp_path):
    """MiniMax-H3 runs one forward a row: a call of two rows on divided weights gathers each block once a forward
    (twice), its token refiner (a unit of its own) once a forward, and the root unit (embedders, output heads) once for
    the call, not once a forward. (FSDP2 on a group of one, in a process of its own: the same units, gathers and
    reshards as on a shard group.)"""
    got = unit_gathers(tmp_path, "minimax-h3")
    print(f"MiniMax-H3, two rows: gathers {got['gathers']}")
    blocks = [u for u in got["units"] if u.startswith("transformer_blocks.")]
    assert "token_refiner" in got["units"] and "" in got["units"]
    assert got["gathers"] == {"root": 1, "token_refiner": 2, **{b: 2 for b in blocks}}


def test_ltx_text_connectors_are_units_of_their_own_gathered_only_when_a_context_is_first_held(tmp_path):
    """LTX-2.3's two text connectors are FSDP units of their own (not the root's): holding a context runs and
    gathers each once; two calls that use the held output gather the blocks each call and the connectors never, the
    root once for the request."""
    got = unit_gathers(tmp_path, "ltx23")
    print(f"LTX-2.3, a context held then two calls: gathers {got['gathers']}")
    blocks = [u for u in got["units"] if u.startswith("transformer_blocks.")]
    assert {"video_connector", "audio_connector", ""} <= set(got["units"]) and blocks
    assert got["gathers"] == {"root": 1, "video_connector": 1, "audio_connector": 1, **{b: 2 for b in blocks}}
