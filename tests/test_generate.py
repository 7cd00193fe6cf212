"""`python -m engine generate`: the engine's latent equals an independent reference, and bad requests fail
before any rank starts.

The reference is written here, separately from engine/sampling and engine/models: ComfyUI's noise
(seeded CPU randn), ComfyUI's own sigmas from the golden file, a plain Euler loop on denoised = x - sigma*v
with CFG on denoised, FLUX 2x2 packing done by hand, and the diffusers transformer called directly."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.load import load_transformer
from engine.models.tiny import write_tiny

from conftest import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden", "comfyui_sigmas.json")
LATENT_FORMAT = {"flux": (0.3611, 0.1159), "sd3": (1.5305, 0.0609)}  # (scale, shift), from ComfyUI
TINY_BLOCKS = {"flux": 8, "sd3": 4}  # transformer blocks of the tiny models written here (FLUX: 4 double + 4 single)


def golden_sigmas(family, scheduler, steps):
    with open(GOLDEN) as f:
        models = json.load(f)["models"]
    key = "flux_shift_1.15" if family == "flux" else "sd3_shift_3.0"
    return torch.tensor(models[key][f"{scheduler}/{steps}"], dtype=torch.float32)


def reference_velocity(model, family, x, sigma, cond, pooled, guidance):
    if family == "sd3":
        return model(hidden_states=x, encoder_hidden_states=cond, pooled_projections=pooled,
                     timestep=torch.full((x.shape[0],), float(sigma) * 1000.0), return_dict=False)[0]
    b, c, h, w = x.shape
    tokens = []
    for i in range(h // 2):          # row-major 2x2 patches, channels ordered (c, ph, pw)
        for j in range(w // 2):
            tokens.append(x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(b, c * 4))
    packed = torch.stack(tokens, dim=1)
    img_ids = torch.tensor([[0.0, i, j] for i in range(h // 2) for j in range(w // 2)])
    out = model(hidden_states=packed, encoder_hidden_states=cond, pooled_projections=pooled,
                timestep=torch.full((b,), float(sigma)), img_ids=img_ids, txt_ids=torch.zeros(cond.shape[1], 3),
                guidance=torch.full((b,), guidance), return_dict=False)[0]
    v = torch.empty_like(x)
    for n, (i, j) in enumerate((i, j) for i in range(h // 2) for j in range(w // 2)):
        v[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] = out[:, n].reshape(b, c, 2, 2)
    return v


@torch.no_grad()
def reference_euler(path, family, cond, seed, steps, cfg, shape, guidance=3.5):
    model = load_transformer(path).model
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    sigmas = golden_sigmas(family, "simple", steps)
    x = sigmas[0] * noise  # empty (all-zero) latent: ComfyUI skips process_in
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        den_pos = x - sigma * reference_velocity(model, family, x, sigma, cond["cond"], cond["pooled"], guidance)
        denoised = den_pos
        if cfg != 1.0:
            den_neg = x - sigma * reference_velocity(model, family, x, sigma, cond["neg_cond"], cond["neg_pooled"],
                                                     guidance)
            denoised = den_neg + cfg * (den_pos - den_neg)
        x = x + (x - denoised) / sigma * (nxt - sigma)
    scale, shift = LATENT_FORMAT[family]
    return x / scale + shift


def generate(*args):
    out = subprocess.run([sys.executable, "-m", "engine", "generate", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    g = torch.Generator().manual_seed(3)
    flux_cond = {"cond": torch.randn(1, 24, 4096, generator=g), "pooled": torch.randn(1, 768, generator=g)}
    sd3_cond = {"cond": torch.randn(1, 30, 4096, generator=g), "pooled": torch.randn(1, 2048, generator=g),
                "neg_cond": torch.randn(1, 30, 4096, generator=g), "neg_pooled": torch.randn(1, 2048, generator=g)}
    save_file(flux_cond, str(d / "flux_cond.safetensors"))
    save_file(sd3_cond, str(d / "sd3_cond.safetensors"))
    return {"dir": d, "flux": write_tiny("flux", str(d)), "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium"),
            "flux_cond": flux_cond, "sd3_cond": sd3_cond}


@pytest.mark.parametrize("family,cfg", [("flux", 1.0), ("sd3", 4.5)])
def test_generate_equals_an_independent_comfyui_style_euler_reference(files, family, cfg):
    out = files["dir"] / f"{family}.safetensors"
    res = generate("--model", files[family], "--cond", str(files["dir"] / f"{family}_cond.safetensors"),
                   "--seed", "42", "--steps", "4", "--cfg", str(cfg), "--sampler", "euler", "--scheduler", "simple",
                   "--width", "128", "--height", "96", "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    got = load_file(str(out))["samples"]
    want = reference_euler(files[family], family, files[f"{family}_cond"], 42, 4, cfg, (1, 16, 12, 16))
    from tolerance import fp32_bound, report, sampling_amplification
    # the same model through other code (packing, embedding hook, sigmas computed vs golden, another process)
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=TINY_BLOCKS[family],
                       amplification=sampling_amplification(4, cfg))
    assert got.shape == (1, 16, 12, 16)
    assert report(f"{family} cfg {cfg}: engine vs independent reference (|ref| max {want.abs().max():.3g})",
                  (got - want).abs().max(), bound)


def test_a_batch_gives_each_item_its_own_noise_and_conditioning(files):
    """Item i of a batch equals a one-item job with batch_index [i] and item i's prompt (ComfyUI's noise rule).

    A deterministic sampler: ComfyUI's ancestral/SDE step noise is drawn for the whole batch tensor, so there an
    item depends on the batch size, in ComfyUI as here."""
    from engine.runtime.client import Engine
    from engine.generate.request import GenerateRequest

    g = torch.Generator().manual_seed(9)
    cond, pooled = torch.randn(2, 16, 4096, generator=g), torch.randn(2, 2048, generator=g)
    neg, neg_pooled = torch.randn(1, 16, 4096, generator=g), torch.randn(1, 2048, generator=g)
    common = dict(model=files["sd3"], seed=5, steps=3, cfg=2.0, sampler="dpmpp_2m", scheduler="normal",
                  neg_cond=neg, neg_pooled=neg_pooled)
    batch = GenerateRequest(cond=cond, pooled=pooled, latent_raw=torch.zeros(2, 16, 8, 8), **common)
    batch = batch.validate()
    from tolerance import fp32_bound, report, sampling_amplification
    with Engine(1, device="cpu") as engine:
        together = engine.submit("generate", *batch.to_job()).outputs["samples"]
        # a batch of 2 and a batch of 1 go through other matmul blockings: equal to fp32 rounding, which 3 steps at
        # cfg 2.0 amplify (a wrong item's noise or prompt differs by 0.1 or more)
        bound = fp32_bound(together.abs().max(), reduction=4096, depth=TINY_BLOCKS["sd3"],
                           amplification=sampling_amplification(3, 2.0))
        for i in range(2):
            one = GenerateRequest(cond=cond[i:i + 1], pooled=pooled[i:i + 1], latent_raw=torch.zeros(1, 16, 8, 8),
                                  batch_index=[i], **common)
            one = one.validate()
            alone = engine.submit("generate", *one.to_job()).outputs["samples"]
            assert report(f"batch item {i} vs alone with batch_index [{i}]", (alone[0] - together[i]).abs().max(),
                          bound)
    assert (together[0] - together[1]).abs().max() > 0.1  # different prompts, different noise


def test_generate_plan_flags_give_the_single_rank_latent(files):
    common = ["--model", files["sd3"], "--cond", str(files["dir"] / "sd3_cond.safetensors"), "--seed", "4",
              "--steps", "3", "--cfg", "4.0", "--width", "128", "--height", "128"]
    one, two = files["dir"] / "one.safetensors", files["dir"] / "cfgpar.safetensors"
    assert generate(*common, "--out", str(one)).returncode == 0
    res = generate(*common, "--cfg-parallel", "--out", str(two))
    assert res.returncode == 0, res.stderr
    assert "plan cfg2 on 2 rank(s)" in res.stdout and "cfg_gather" in res.stdout
    from tolerance import fp32_bound, report, sampling_amplification
    want = load_file(str(one))["samples"]
    bound = fp32_bound(want.abs().max(), reduction=4096, depth=TINY_BLOCKS["sd3"],
                       amplification=sampling_amplification(3, 4.0))  # a rank split: another summation order
    assert report("generate --cfg-parallel vs one rank", (load_file(str(two))["samples"] - want).abs().max(), bound)


def test_a_benchmark_switch_left_in_the_callers_environment_never_reaches_the_ranks(monkeypatch, tmp_path):
    """`bench guider --stub-forward` hands its ranks XDIT_FORWARD_STUB (every forward returns zeros) through the
    engine's own environment argument. The same variable left in the environment ComfyUI or a shell runs in is not
    inherited: that engine's latent is the clean one (the same computation, bitwise), where the switch handed on
    purpose gives another."""
    from engine.generate.request import GenerateRequest
    from engine.runtime.client import Engine
    path = write_tiny("flux", str(tmp_path))
    job = GenerateRequest.random_conditioning(path, 64, 64, text_tokens=8, seed=1, steps=2).validate(1).to_job()

    def latent(**kw):
        with Engine(1, device="cpu", **kw) as engine:
            return engine.submit("generate", *job).outputs["samples"]
    want = latent()
    monkeypatch.setenv("XDIT_FORWARD_STUB", "zeros")
    assert torch.equal(latent(), want)
    assert not torch.equal(latent(env={"XDIT_FORWARD_STUB": "zeros"}), want)
