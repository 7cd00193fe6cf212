"""Fuzzed job specs: whatever a caller puts in a GenerateRequest (shapes, dtypes, NaN/inf, empty batches, absurd
sizes, out-of-range scalars, bad names, plans, LoRA lists), validate() either accepts it or raises a ValueError
whose one line names the input; absurd sizes are refused from the cost model's memory estimate before anything is
allocated; a rank-side job document that is malformed is refused as clearly; the CLI maps these to exit 2."""
import math
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import save_file

from engine.cli import main
from engine.generate.request import GenerateRequest
from engine.parallel.devices import cpu_hardware
from engine.parallel.plan import ParallelPlan

from fuzz import Tally, cases, names_any, one_line

MODELS = {"flux": ("synthetic:flux-dev:tiny", 768), "sd3": ("synthetic:sd3.5-medium:tiny", 2048)}
CONTEXT = 4096


def base(family: str, batch: int = 1, tokens: int = 4) -> GenerateRequest:
    model, pooled = MODELS[family]
    g = torch.Generator().manual_seed(0)
    return GenerateRequest(model=model, cond=torch.randn(1, tokens, CONTEXT, generator=g),
                           pooled=torch.randn(1, pooled, generator=g), latent_raw=torch.zeros(batch, 16, 8, 8),
                           neg_cond=torch.randn(1, tokens, CONTEXT, generator=g),
                           neg_pooled=torch.randn(1, pooled, generator=g), steps=4)


def huge(*shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor of any size that allocates one element (a broadcast view)."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def poisoned(shape, value, index: int) -> torch.Tensor:
    t = torch.randn(*shape)
    t.view(-1)[index % t.numel()] = value
    return t


NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
ANY_VALUE = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                      st.text(max_size=6), st.none(), st.lists(st.integers(-3, 3), max_size=3),
                      st.sampled_from([{"a": 1}, (1, 2), b"x", object()]))


@st.composite
def latent_fault(draw, family):
    kind = draw(st.sampled_from(["shape", "dtype", "nonfinite", "absurd", "not a tensor"]))
    if kind == "shape":
        shape = draw(st.sampled_from([(0, 16, 8, 8), (1, 16, 7, 8), (1, 16, 8, 0), (1, 15, 8, 8), (1, 17, 8, 8),
                                      (16, 8, 8), (1, 1, 16, 8, 8), (1, 16, 1, 1), (1, 16, 2, 3), ()]))
        return torch.zeros(shape), ("latent",)
    if kind == "dtype":
        return torch.zeros(1, 16, 8, 8, dtype=draw(st.sampled_from([torch.int64, torch.uint8, torch.bool]))), \
            ("latent",)
    if kind == "nonfinite":
        return poisoned((1, 16, 8, 8), draw(NONFINITE), draw(st.integers(0, 1023))), ("latent",)
    if kind == "absurd":
        shape = draw(st.sampled_from([(1, 16, 8192, 8192), (10 ** 6, 16, 8, 8), (2 ** 20, 16, 64, 64),
                                      (1, 16, 2 ** 20, 2), (64, 16, 4096, 4096)]))
        return huge(*shape), ("latent",)
    return draw(st.sampled_from([None, [[0.0]], 3.0, "latent"])), ("latent",)


@st.composite
def side_fault(draw, family, name):
    """A bad cond (or pooled, or their negative twins): shape, dtype, NaN/inf, absurd length, not a tensor."""
    pooled_dim = MODELS[family][1]
    is_pooled = "pooled" in name
    good = (1, pooled_dim) if is_pooled else (1, 4, CONTEXT)
    kind = draw(st.sampled_from(["shape", "dtype", "nonfinite", "absurd", "not a tensor"]))
    if kind == "shape":
        shapes = [(1, 7), (1, pooled_dim, 1), (pooled_dim,), (3, pooled_dim), (0, pooled_dim)] if is_pooled else \
            [(1, 4, 77), (1, 0, CONTEXT), (4, CONTEXT), (1, 1, 4, CONTEXT), (3, 4, CONTEXT), (0, 4, CONTEXT)]
        return torch.zeros(draw(st.sampled_from(shapes))), (name,)
    if kind == "dtype":
        return torch.zeros(good, dtype=draw(st.sampled_from([torch.int32, torch.int8, torch.bool]))), (name,)
    if kind == "nonfinite":
        return poisoned(good, draw(NONFINITE), draw(st.integers(0, 10 ** 6))), (name,)
    if kind == "absurd" and not is_pooled:
        return huge(1, draw(st.sampled_from([10 ** 7, 2 ** 24])), CONTEXT), (name,)
    return draw(st.sampled_from([None, [1.0], 1.0, "x"])), (name,)


SCALARS = ["seed", "steps", "cfg", "denoise", "guidance", "sampler", "scheduler", "dtype", "attention",
           "cache_threshold", "patches", "warmup_steps", "stage_blocks", "batch_index", "compile", "fp8_weights",
           "fp8_matmul", "reference_latents_method", "neg_reference_latents_method"]


@st.composite
def fault(draw, family):
    """(mutate(request) -> (the request with the fault, extra validate kwargs), (the inputs it changed, the values it
    gave them)): a refusal names one of the inputs or shows one of the values. Requests are frozen: a fault is a
    request with one field replaced."""
    target = draw(st.sampled_from(["latent", "cond", "pooled", "neg_cond", "neg_pooled", "scalar", "references",
                                   "plan", "ranks", "loras", "model"]))
    if target == "latent":
        value, names = draw(latent_fault(family))
        return (lambda r: (replace(r, latent_raw=value), {})), (names, ())
    if target in ("cond", "pooled", "neg_cond", "neg_pooled"):
        value, names = draw(side_fault(family, target))

        def set_side(r):   # the negative side is read only with a negative pass
            return replace(r, **{target: value}, **({"cfg": 3.0} if target.startswith("neg") else {})), {}
        return set_side, (names, (value,))
    if target == "scalar":
        name = draw(st.sampled_from(SCALARS))
        value = draw(st.one_of(ANY_VALUE, st.sampled_from([0, -1, 10001, 2 ** 64, "euler", "fp32", "nope"])))
        return (lambda r: (replace(r, **{name: value}), {})), ((name,), ())
    if target == "references":
        refs = draw(st.one_of(
            st.sampled_from(["x", 3, torch.zeros(1, 16, 8, 8)]),
            st.lists(st.one_of(st.builds(torch.zeros, st.sampled_from([(1, 16, 8, 8), (1, 16, 3, 8), (1, 15, 8, 8),
                                                                       (2, 16, 8, 8), (16, 8, 8), (1, 16, 0, 8)])),
                               st.builds(poisoned, st.just((1, 16, 8, 8)), NONFINITE, st.integers(0, 2000)),
                               st.just("not a tensor"), st.just(torch.zeros(1, 16, 8, 8, dtype=torch.int64))),
                     min_size=1, max_size=3)))
        name = draw(st.sampled_from(["reference_latents", "neg_reference_latents"]))

        def set_refs(r):
            return replace(r, **{name: refs}, **({"cfg": 2.0} if name.startswith("neg") else {})), {}
        return set_refs, ((name,), ())
    if target == "plan":
        plan = draw(st.sampled_from(["bogus", 3, None, ParallelPlan(ulysses=2), ParallelPlan(cfg=2),
                                     ParallelPlan(dp=2), ParallelPlan(ring=8), ParallelPlan(pipefusion=3)]))
        return (lambda r: (replace(r, plan=plan), {})), (("plan",), ())
    if target == "ranks":
        ranks = draw(st.sampled_from([0, -1, 9, 2.5, True, "2", 10 ** 9, None, 3, 8]))
        return (lambda r: (r, {"ranks": ranks})), (("ranks",), ())
    if target == "loras":
        loras = draw(st.sampled_from(["style.safetensors", [("missing.safetensors", 1.0)], [("a",)], [(1, 1.0)],
                                      [(__file__, math.nan)], ["abc"], [(__file__, 1.0)], [("", 0.5)],
                                      [(__file__, True)], 7]))
        paths = [e[0] for e in loras if isinstance(e, tuple) and e] if isinstance(loras, list) else []
        return (lambda r: (replace(r, loras=loras), {})), (("loras",), (loras, *paths))
    model = draw(st.sampled_from(["", None, 3, "/nonexistent/model.safetensors", "synthetic:bogus", __file__,
                                  "synthetic:", os.path.dirname(__file__)]))
    return (lambda r: (replace(r, model=model), {})), (("model",), (model,))


def attempt(request, ranks=None, hardware="cpu"):
    """validate() on CPU ranks (or assumed hardware); returns None or the refusal, failing on anything else."""
    if hardware == "cpu":
        ok = isinstance(ranks, int) and not isinstance(ranks, bool) and 1 <= ranks <= 8
        hardware = cpu_hardware(ranks if ok else 1)
    try:
        request = request.validate(ranks, hardware)
    except ValueError as e:
        assert one_line(str(e)), f"{type(e).__name__} not in one line: {e!r}"
        return str(e)
    return None


@pytest.mark.timeout(300)
def test_one_bad_input_is_accepted_or_refused_naming_it():
    tally = Tally("job specs, one fault each")

    @cases(400)
    @given(family=st.sampled_from(sorted(MODELS)), data=st.data(), assumed=st.booleans())
    def prop(family, data, assumed):
        request = base(family)
        mutate, (names, values) = data.draw(fault(family))
        request, extra = mutate(request)
        message = attempt(request, hardware=None if assumed else "cpu", **extra)
        if message is None:
            tally("accepted")
            return
        assert names_any(message, names, values), f"refusal names none of {names} nor their values: {message}"
        tally("refused")

    assert attempt(base("flux")) is None and attempt(base("sd3")) is None   # the base requests are sound
    prop()
    tally.report()
    assert tally.counts.get("refused", 0) > tally.total // 2 and tally.counts.get("accepted", 0) > 0


@pytest.mark.timeout(300)
def test_many_bad_inputs_at_once_give_one_clear_refusal():
    tally = Tally("job specs, several faults each")

    @cases(300)
    @given(family=st.sampled_from(sorted(MODELS)), data=st.data(), n=st.integers(2, 5))
    def prop(family, data, n):
        request, extra, names, values = base(family), {}, [], []
        for _ in range(n):
            mutate, (changed, given) = data.draw(fault(family))
            request, more = mutate(request)
            extra.update(more)
            names += changed
            values += given
        message = attempt(request, **extra)
        if message is None:
            tally("accepted")
            return
        assert names_any(message, names, values), f"refusal names none of {names} nor their values: {message}"
        tally("refused")

    prop()
    tally.report()
    assert tally.counts.get("refused", 0) > 0


def test_absurd_sizes_are_refused_with_a_memory_estimate_before_allocating():
    """65536x65536 px and a batch of a million: refused naming the size, the GiB needed and the machine's GiB;
    the latents are broadcast views, so a refusal that read them would show as this test's own memory."""
    messages = []
    for lat in (huge(1, 16, 8192, 8192), huge(10 ** 6, 16, 8, 8)):
        for hardware in (cpu_hardware(1), None):
            r = replace(base("flux"), latent_raw=lat)
            with pytest.raises(ValueError) as info:
                r = r.validate(1, hardware)
            messages.append(str(info.value))
    print("\n".join(messages))
    assert messages[0].startswith("flux-dev with latent 65536x65536 px, batch 1, 4 text tokens needs about ")
    assert "GiB of RAM for 1 CPU rank" in messages[0] and "smaller image" in messages[0]
    assert "the GPUs have 79.11 GiB each" in messages[1]   # an H100 80GB as torch reports it
    assert "batch 1000000" in messages[2]
    assert all(one_line(m) and "GiB" in m for m in messages)


def test_nan_and_inf_are_refused_naming_the_tensor_and_where():
    r = replace(base("flux"), pooled=poisoned((1, 768), math.nan, 5))
    with pytest.raises(ValueError, match=r"^pooled holds nan at index \[0, 5\] \(shape \[1, 768\]\)"):
        r = r.validate(1, cpu_hardware(1))
    r = replace(base("flux"), cfg=2.0, neg_cond=poisoned((1, 4, CONTEXT), -math.inf, CONTEXT + 2))
    with pytest.raises(ValueError, match=r"^neg_cond holds -inf at index \[0, 1, 2\]"):
        r = r.validate(1, cpu_hardware(1))
    r = replace(base("flux"), neg_cond=poisoned((1, 4, CONTEXT), math.nan, 0))   # cfg 1.0: the negative is never read
    assert attempt(r, 1) is None


# ---- the rank side: a job document -----------------------------------------------------------------------------
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
                    lambda children: st.one_of(st.lists(children, max_size=3),
                                               st.dictionaries(st.text(max_size=6), children, max_size=3)),
                    max_leaves=8)


@pytest.mark.timeout(300)
def test_a_malformed_job_document_is_refused_in_one_line():
    request = base("flux")
    request = request.validate(1, cpu_hardware(1))
    spec, inputs = request.to_job()
    back = GenerateRequest.from_job(dict(spec), dict(inputs))   # the sound document crosses
    assert back.steps == request.steps and torch.equal(back.cond, request.cond)
    tally = Tally("job documents")

    @cases(400)
    @given(data=st.data())
    def prop(data):
        s, i = dict(spec), dict(inputs)
        touched = set()   # the fields and tensors changed, or "document" when the whole spec was replaced
        for _ in range(data.draw(st.integers(1, 3))):
            how = data.draw(st.sampled_from(["drop", "retype", "add", "drop tensor", "retype tensor", "whole"]))
            if not isinstance(s, dict) and how in ("drop", "retype", "add"):
                continue
            if how == "drop" and s:
                key = data.draw(st.sampled_from(sorted(s)))
                s.pop(key)
            elif how == "retype" and s:
                key = data.draw(st.sampled_from(sorted(s)))
                s[key] = data.draw(JSON)
            elif how == "add":
                key = data.draw(st.text(max_size=8))
                s[key] = data.draw(JSON)
            elif how == "drop tensor" and i:
                key = data.draw(st.sampled_from(sorted(i)))
                i.pop(key)
            elif how == "retype tensor":
                key = data.draw(st.sampled_from(sorted(i) + ["extra"]))
                i[key] = data.draw(JSON)
            elif how == "whole":
                s, key = data.draw(JSON), "document"
            else:
                continue
            touched.add(key)
        try:
            GenerateRequest.from_job(s, i)
        except ValueError as e:
            message = str(e)
            assert one_line(message), repr(e)
            # names a field or tensor it was given changed (a list field by its name or a tensor's "<name>.<i>"),
            # or, for a document that is no object, the document
            names = {k.split(".")[0] for k in touched} | ({"job document", "spec"} if "document" in touched else set())
            assert names_any(message, names, touched), f"{sorted(touched)}: {message}"
            tally("refused")
            return
        tally("accepted")

    prop()
    tally.report()
    assert tally.counts.get("refused", 0) > tally.total // 2


# ---- the command line ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cond_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cond")
    good, bad = str(d / "cond.safetensors"), str(d / "nan.safetensors")
    save_file({"cond": torch.randn(1, 4, CONTEXT), "pooled": torch.randn(1, 768)}, good)
    save_file({"cond": torch.randn(1, 4, CONTEXT), "pooled": poisoned((1, 768), math.inf, 3)}, bad)
    latent = str(d / "latent.safetensors")
    save_file({"samples": torch.zeros(1, 16, 8, 9)}, latent)
    return d, good, bad, latent


@pytest.mark.parametrize("flags, expected", [
    (["--steps", "0"], "argument --steps: 0 is invalid"),
    (["--width", "16384", "--height", "16384", "--batch", "64"], "latent 16384x16384 px, batch 64"),  # 784 GiB
    (["--batch", "1000000", "--width", "64", "--height", "64"], "batch 1000000"),
    (["--cond", "{bad}"], "pooled holds inf"),
    (["--latent", "{latent}"], "latent 72x64 px is invalid"),
    (["--ulysses", "0"], "argument --ulysses: 0 is invalid"),
    (["--ulysses", "3"], "plan ulysses3 cannot run this job"),
    (["--cfg", "nan"], "argument --cfg: nan is invalid"),
    (["--seed", "-1"], "argument --seed: -1 is invalid"),
    (["--lora", "{good}:inf"], "is invalid: use a finite number"),
    (["--lora", "{good}"], "LoRAs need a model file"),
])
def test_the_cli_refuses_bad_job_specs_with_exit_2_and_one_line(cond_files, capsys, flags, expected):
    d, good, bad, latent = cond_files
    flags = [f.format(bad=bad, good=good, latent=latent) for f in flags]
    argv = ["generate", "--model", "synthetic:flux-dev:tiny", "--cond", good, "--out", str(d / "out.safetensors")] \
        + flags
    code = main(argv)
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert expected in err
