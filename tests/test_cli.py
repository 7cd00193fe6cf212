"""The command line. Every user error, in every subcommand, exits 2 with one line on stderr before any rank starts
(in process, through engine.cli.main); the demo, the benchmarks and Ctrl-C run as a user runs them (subprocesses)."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from engine.runtime.bridge import engine_dirs
from engine.runtime.launch import pid_gone
from conftest import ROOT
from safetensors.torch import save_file

from engine.cli import main
from engine.families import TITLES
from engine.models.tiny import write_tiny
from engine.runtime.client import Engine


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(3)
    save_file({"cond": torch.randn(1, 24, 4096, generator=g), "pooled": torch.randn(1, 768, generator=g)},
              str(d / "flux_cond.safetensors"))
    save_file({"cond": torch.randn(1, 30, 4096, generator=g), "pooled": torch.randn(1, 2048, generator=g),
               "neg_cond": torch.randn(1, 30, 4096, generator=g), "neg_pooled": torch.randn(1, 2048, generator=g)},
              str(d / "sd3_cond.safetensors"))
    save_file({"x": torch.zeros(2)}, str(d / "other.safetensors"))
    save_file({"samples": torch.zeros(1, 16, 8, 8)}, str(d / "latent.safetensors"))
    (d / "garbage.bin").write_bytes(b"not a safetensors file" * 8)
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))   # a PNG's signature, then its chunks
    os.mkfifo(d / "pipe.safetensors")
    save_file({"cond": torch.randn(2, 24, 4096, generator=g), "pooled": torch.randn(2, 768, generator=g)},
              str(d / "flux_cond_batch2.safetensors"))
    # a LoRA for the full-size FLUX.1 (hidden 3072, fused qkv of 9216 rows), not the tiny model's hidden 128
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(16, 3072),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(9216, 16)},
              str(d / "full_size_lora.safetensors"))
    flux = write_tiny("flux", str(d))
    non_utf8 = os.path.join(os.fsencode(d), b"tiny-\xff.safetensors")   # a name of bytes that are not UTF-8
    os.link(flux, non_utf8)
    os.makedirs(d / "blocked" / "tiny-flux-dev-cond.safetensors")   # a folder where make-tiny writes a file
    return {"dir": str(d), "flux": flux, "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium"),
            "non_utf8": os.fsdecode(non_utf8), "blocked": str(d / "blocked"),
            "flux_cond": str(d / "flux_cond.safetensors"), "sd3_cond": str(d / "sd3_cond.safetensors"),
            "other": str(d / "other.safetensors"), "latent": str(d / "latent.safetensors"),
            "garbage": str(d / "garbage.bin"), "out": str(d / "out.safetensors"), "png": str(d / "image.png"),
            "fifo": str(d / "pipe.safetensors"), "flux_cond_batch2": str(d / "flux_cond_batch2.safetensors"),
            "full_size_lora": str(d / "full_size_lora.safetensors")}


GEN = ["generate", "--model", "{flux}", "--cond", "{flux_cond}", "--out", "{out}", "--steps", "2", "--width", "128",
       "--height", "128"]
SD3 = ["generate", "--model", "{sd3}", "--cond", "{sd3_cond}", "--out", "{out}", "--steps", "2"]
TINY = ["make-tiny", "--kind", "flux", "--out", "{dir}"]
# id: (argv, what the one stderr line must say[, CUDA devices the test pretends to have]); a flag given twice: the
# last one counts (argparse), so GEN + ["--out", ...] replaces GEN's --out
CASES = {
    "top-no-command": ([], r"python -m engine: error: the following arguments are required"),
    "top-unknown-command": (["paint"], r"invalid choice: 'paint'"),
    # generate: the cases users reported
    "gen-gpus-without-cuda": (GEN + ["--gpus", "0"], r"argument --gpus: 0 needs CUDA.*leave out --gpus"),
    "gen-out-missing-folder": (GEN + ["--out", "{dir}/missing/x.safetensors"],
                               r"argument --out: .*/x.safetensors is invalid: its folder .*/missing does not exist"),
    "gen-seed-negative": (GEN + ["--seed", "-5"], r"argument --seed: -5 is invalid: use an integer in \[0, 2\*\*64\)"),
    "gen-seed-2**64": (GEN + ["--seed", str(2**64)], r"argument --seed: 18446744073709551616 is invalid: use an"),
    "gen-ranks-0": (GEN + ["--ranks", "0"], r"argument --ranks: 0 is invalid: use 1 to 8"),
    "gen-ranks-9": (GEN + ["--ranks", "9"], r"argument --ranks: 9 is invalid: use 1 to 8"),
    # generate: every other flag
    "gen-usage-one-line": (["generate"], r"the following arguments are required: --model, --cond, --out"),
    "gen-unknown-flag": (GEN + ["--bogus"], r"generate: error: unrecognized arguments: --bogus"),
    "gen-seed-not-int": (GEN + ["--seed", "abc"], r"argument --seed: 'abc' is not an integer"),
    "gen-steps-0": (GEN + ["--steps", "0"], r"argument --steps: 0 is invalid: use an integer from 1 to 10000"),
    "gen-steps-negative": (GEN + ["--steps", "-3"], r"argument --steps: -3 is invalid"),
    "gen-width-not-16": (GEN + ["--width", "120"], r"argument --width: 120 is invalid: use a positive multiple of 16 "
                                                   r"pixels up to 16384, e.g. 128$"),
    "gen-width-too-large": (GEN + ["--width", "99999"], r"argument --width: 99999 is invalid: use a positive multiple "
                                                        r"of 16 pixels up to 16384, e.g. 16384$"),
    "gen-width-0": (GEN + ["--width", "0"], r"argument --width: 0 is invalid"),
    "gen-height-negative": (GEN + ["--height", "-64"], r"argument --height: -64 is invalid"),
    "gen-batch-0": (GEN + ["--batch", "0"], r"argument --batch: 0 is invalid: use an integer >= 1"),
    "gen-cfg-nan": (GEN + ["--cfg", "nan"], r"argument --cfg: nan is invalid: use a finite number"),
    "gen-cfg-0": (GEN + ["--cfg", "0"], r"argument --cfg: 0 is invalid: use a value > 0"),
    "gen-cfg-not-number": (GEN + ["--cfg", "high"], r"argument --cfg: 'high' is not a number"),
    "gen-guidance-inf": (GEN + ["--guidance", "inf"], r"argument --guidance: inf is invalid: use a finite number"),
    "gen-denoise-0": (GEN + ["--denoise", "0"], r"argument --denoise: 0 is invalid: use a value in \(0, 1\]"),
    "gen-denoise-1.5": (GEN + ["--denoise", "1.5"], r"argument --denoise: 1.5 is invalid"),
    "gen-denoise-without-latent": (GEN + ["--denoise", "0.5"], r"argument --denoise: 0.5 needs an input --latent"),
    "gen-sampler": (GEN + ["--sampler", "lms"], r"argument --sampler: invalid choice: 'lms' \(choose from 'euler'"),
    "gen-scheduler": (GEN + ["--scheduler", "foo"], r"argument --scheduler: invalid choice: 'foo' \(choose from"),
    "gen-dtype": (GEN + ["--dtype", "fp64"], r"argument --dtype: invalid choice: 'fp64' \(choose from 'fp32'"),
    "gen-device": (GEN + ["--device", "gpu"], r"argument --device: invalid choice: 'gpu'"),
    "gen-out-is-a-folder": (GEN + ["--out", "{dir}"], r"argument --out: .* is a folder: give a file name"),
    "gen-out-device": (GEN + ["--out", "/dev/full"], r"argument --out: /dev/full is a character device, which is "
                                                     r"never replaced: give a regular file or a new name$"),
    "gen-out-null": (GEN + ["--out", "/dev/null"], r"argument --out: /dev/null is a character device, which is never"),
    "gen-out-fifo": (GEN + ["--out", "{fifo}"], r"argument --out: .*pipe.safetensors is a named pipe, which is never"),
    "gen-out-proc": (GEN + ["--out", "/proc/x.safetensors"], r"argument --out: /proc/x.safetensors is invalid: no file "
                                                             r"can be created in /proc \(.*\); write elsewhere$"),
    "gen-out-name-too-long": (GEN + ["--out", "{dir}/" + "a" * 300 + ".safetensors"],
                              r"argument --out: .*/a{300}.safetensors is invalid: File name too long; write elsewhere$"),
    "gen-out-not-safetensors": (GEN + ["--out", "{dir}/image.png"],
                                r"argument --out: .*/image.png is invalid: a LATENT is written as a .safetensors "
                                r"file; give a name ending in .safetensors, e.g. .*/image.safetensors$"),
    "gen-model-png": (GEN + ["--model", "{png}"],
                      r"argument --model: image.png is a PNG image, not a safetensors file; give a "
                      + re.escape(TITLES) + r" checkpoint: .safetensors, .gguf or a diffusers folder$"),
    "gen-cond-batch": (GEN + ["--cond", "{flux_cond_batch2}"], r"error: cond has batch 2 but the latent has 1: give "
                                                                r"cond a batch of 1$"),
    "gen-lora-full-size-on-tiny": (GEN + ["--lora", "{full_size_lora}"],
                                   r"LoRA full_size_lora.safetensors: layer lora_unet_double_blocks_0_img_attn_qkv has "
                                   r"down \[16, 3072\] and up \[9216, 16\], but this flux-dev model's layer takes "
                                   r"\[rank, 128\] and \[384, rank\]"),
    "gen-model-missing": (GEN + ["--model", "{dir}/nope.safetensors"], r"argument --model: .*nope.* does not exist"),
    "gen-model-not-utf8": (GEN + ["--model", "{non_utf8}"], r"argument --model: .*/tiny-\\xff.safetensors is not a "
                                                            r"UTF-8 path: .*rename"),
    "gen-cond-not-utf8": (GEN + ["--cond", "{non_utf8}"], r"argument --cond: .*/tiny-\\xff.safetensors is not a UTF-8 "
                                                          r"path"),
    "gen-lora-not-utf8": (GEN + ["--lora", "{non_utf8}:0.5"], r"argument --lora: .*/tiny-\\xff.safetensors:0.5: .* is "
                                                              r"not a UTF-8 path"),
    "gen-model-a-name": (GEN + ["--model", "ltx23"], r"argument --model: ltx23 is a model's name, not a file or folder "
                                                     r"here: give its checkpoint, or synthetic:ltx-2.3:tiny"),
    "gen-shard-not-dividing-the-ranks": (GEN + ["--ranks", "3", "--shard", "2"],
                                         r"argument --shard: 2 on 3 rank\(s\): no plan of 3 rank\(s\) runs this job "
                                         r"with the weights divided 2 ways .*: give --shard 3"),
    "gen-model-not-safetensors": (GEN + ["--model", "{garbage}"], r"--model: garbage.bin is not a safetensors file "
                                  r"\(or is truncated\): .*; checkpoints are read from .safetensors and .gguf files"),
    "gen-model-synthetic-unknown": (GEN + ["--model", "synthetic:flux-pro"], r"--model: .*flux-pro.*'flux-dev'"),
    "gen-cond-missing": (GEN + ["--cond", "{dir}/nope.safetensors"], r"argument --cond: .*nope.* does not exist"),
    "gen-cond-not-safetensors": (GEN + ["--cond", "{garbage}"], r"argument --cond: garbage.bin is not a safetensors"),
    "gen-cond-lacks-tensors": (GEN + ["--cond", "{other}"], r"argument --cond: .* has no 'cond' or 'pooled' tensor"),
    "gen-cond-wrong-model": (GEN + ["--cond", "{sd3_cond}"], r"pooled of shape \[1, 2048\] is invalid: flux-dev takes"),
    "gen-cfg-without-negative": (GEN + ["--cfg", "3.0"], r"cfg=3.0 needs a negative conditioning"),
    "gen-latent-missing": (GEN + ["--latent", "{dir}/nope.safetensors"], r"argument --latent: .* does not exist"),
    "gen-latent-lacks-samples": (GEN + ["--latent", "{other}"], r"argument --latent: .* has no 'samples' tensor"),
    "gen-latent-size": (GEN + ["--latent", "{latent}"], r"argument --latent: .* is 64x64 px but --width/--height say"),
    "gen-lora-missing": (GEN + ["--lora", "{dir}/nope.safetensors"], r"argument --lora: .*nope.* does not exist"),
    "gen-lora-strength": (GEN + ["--lora", "{other}:strong"], r"argument --lora: .*: 'strong' is not a number; give"),
    "gen-lora-strength-nan": (GEN + ["--lora", "{other}:nan"], r"argument --lora: .*: nan is invalid: use a finite"),
    "gen-lora-not-a-lora": (GEN + ["--lora", "{other}"], r"other.safetensors holds no LoRA layers"),
    "gen-plan-auto-with-degrees": (GEN + ["--plan", "auto", "--ulysses", "2"], r"--plan: auto cannot be combined with"),
    "gen-plan-unknown": (GEN + ["--plan", "fast"], r"argument --plan: invalid choice: 'fast'"),
    "gen-ulysses-0": (GEN + ["--ulysses", "0"], r"argument --ulysses: 0 is invalid: use an integer >= 1"),
    "gen-plan-vs-ranks": (GEN + ["--ulysses", "2", "--ranks", "3"], r"needs 2 ranks but the engine has 3"),
    "gen-plan-vs-model": (GEN + ["--ulysses", "3"], r"plan ulysses3 cannot run this job: the model has 4 heads"),
    "gen-pipefusion-patches": (SD3 + ["--pipefusion", "2", "--patches", "1", "--width", "256", "--height", "256"],
                               r"patches 1 is fewer than the 2 stages: use patches >= 2"),
    "gen-pipefusion-warmup": (SD3 + ["--pipefusion", "2", "--warmup-steps", "50", "--width", "256", "--height", "256"],
                              r"warmup steps 50 is outside 1..\d+"),
    "gen-patches-0": (GEN + ["--patches", "0"], r"argument --patches: 0 is invalid: use an integer >= 1"),
    "gen-stage-blocks": (GEN + ["--stage-blocks", "2,x"], r"argument --stage-blocks: '2,x'"),
    "gen-sd3-too-large": (SD3 + ["--width", "1024"], r"1024x1024 px is too large for sd3.5-medium: its position grid"),
    "gen-auto-no-plan": (GEN + ["--ranks", "7", "--width", "16"], r"no parallel plan runs this job on 7 ranks"),
    "gen-gpus-vs-plan": (GEN + ["--ulysses", "2", "--gpus", "0"], r"argument --gpus: 0 names 1 GPUs for 2 ranks", 2),
    "gen-gpus-not-visible": (GEN + ["--gpus", "0,3"], r"argument --gpus: 0,3 names GPU 3 but only 2 are visible", 2),
    "gen-gpus-repeated": (GEN + ["--gpus", "0,0"], r"argument --gpus: 0,0 is invalid: give distinct GPU indices", 2),
    "gen-gpus-and-device": (GEN + ["--gpus", "0", "--device", "cpu"], r"--device: not allowed with argument --gpus", 2),
    # demo
    "demo-model-missing": (["demo", "--model", "missing.safetensors"], r"demo: error: argument --model: missing\S+ does"),
    "demo-model-not-safetensors": (["demo", "--model", "{garbage}"], r"argument --model: garbage.bin is not a"),
    "demo-model-a-folder": (["demo", "--model", "{dir}"], r"argument --model: .* is not a file"),
    "demo-ranks-0": (["demo", "--ranks", "0"], r"demo: error: argument --ranks: 0 is invalid: use 1 to 8"),
    "demo-ranks-9": (["demo", "--ranks", "9"], r"demo: error: argument --ranks: 9 is invalid: use 1 to 8"),
    "demo-unknown-flag": (["demo", "--fast"], r"demo: error: unrecognized arguments: --fast"),
    # make-tiny
    "tiny-usage-one-line": (["make-tiny"], r"make-tiny: error: the following arguments are required: --kind, --out"),
    "tiny-kind": (["make-tiny", "--kind", "sdxl", "--out", "{dir}"],
                  r"argument --kind: 'sdxl' is not a model the engine knows: use a variant \(flux-dev, .*\) or a "
                  r"family \(flux, .*ltx23.*\)$"),
    "tiny-variant-of-another-kind": (TINY + ["--variant", "ltx23"], r"argument --variant: ltx23 is LTX-2.3/2.5, "
                                                                    r"not FLUX.1 as --kind says: give a flux variant"),
    "tiny-variant-contradicts-kind": (["make-tiny", "--kind", "flux-dev", "--variant", "flux-schnell", "--out",
                                       "{dir}"], r"argument --variant: flux-schnell contradicts --kind, which names "
                                                 r"flux-dev"),
    "tiny-out-proc": (TINY + ["--out", "/proc/xdir"], r"argument --out: /proc/xdir is invalid: no folder can be "
                                                      r"created in /proc \(.*\); write elsewhere$"),
    "tiny-out-existing-proc-folder": (TINY + ["--out", "/proc/self"], r"argument --out: /proc/self is invalid: no file "
                                                                      r"can be created in /proc/self"),
    "tiny-out-name-too-long": (TINY + ["--out", "{dir}/" + "a" * 300], r"argument --out: .*/a{300} is invalid: File "
                                                                       r"name too long; write elsewhere$"),
    "tiny-out-under-a-file": (TINY + ["--out", "{other}/x"], r"argument --out: .*/x is invalid: .*other.safetensors is "
                                                             r"a file, not a folder$"),
    "tiny-out-holds-a-folder-of-its-name": (TINY + ["--out", "{blocked}"],
                                            r"argument --out: .*/tiny-flux-dev-cond.safetensors is a folder, which "
                                            r"make-tiny never replaces: remove it or write elsewhere$"),
    "tiny-variant": (TINY + ["--variant", "flux-pro"], r"argument --variant: variant='flux-pro' is not a flux variant"),
    "tiny-out-is-a-file": (TINY + ["--out", "{other}"], r"argument --out: .* is a file, not a folder"),
    "tiny-dtype": (TINY + ["--dtype", "int8"], r"argument --dtype: invalid choice: 'int8'"),
    "tiny-seed": (TINY + ["--seed", "-1"], r"argument --seed: -1 is invalid"),
    "tiny-quant-without-gguf": (TINY + ["--quant", "Q4_K"],
                                r"argument --quant: Q4_K applies to GGUF files only and the format is safetensors: add "
                                r"--format gguf"),
    # bench
    "bench-json-dir": (["bench", "--json", "/"], r"argument --json: / is a folder"),
    "bench-json-device": (["bench", "--json", "/dev/full", "cache"], r"argument --json: /dev/full is a character"),
    "bench-json-suffix": (["bench", "--json", "{dir}/rows.txt", "cache"], r"argument --json: .*rows.txt is invalid: "
                                                                          r"the rows is written as a .json file"),
    "bench-cache-steps": (["bench", "cache", "--steps", "0"], r"argument --steps: 0 is invalid"),
    "bench-scaling-ranks": (["bench", "scaling", "--max-ranks", "9"], r"argument --max-ranks"),
    "bench-gpu-without-cuda": (["bench", "gpu"], r"bench gpu: error: bench gpu needs a CUDA GPU"),
    "gen-attention-on-cpu": (GEN + ["--attention", "flash"], r"argument --attention: flash needs --gpus"),
    "gen-fp8-matmul-alone": (GEN + ["--fp8-matmul"], r"fp8_matmul=True needs fp8 weights"),
    "gen-fp8-matmul-on-cpu": (GEN + ["--fp8-weights", "--fp8-matmul"], r"argument --fp8-matmul: needs --gpus"),
    "gen-cache-threshold": (GEN + ["--cache-threshold", "2"], r"argument --cache-threshold: 2 is invalid: use a number"),
    "bench-comm-models": (["bench", "comm", "--models", "FLUX.2-dev"], r"--models: 'FLUX.2-dev' is not one of"),
    "bench-generate-gpus-without-cuda": (["bench", "generate", "--gpus", "0"], r"bench (generate|overhead): error: .*needs CUDA"),
    "bench-generate-two-gpus": (["bench", "generate", "--gpus", "0,1"], r"--gpus: 0,1 names 2 GPUs: bench generate", 2),
    "bench-generate-model": (["bench", "generate", "--model", "flux-pro"], r"--model: 'flux-pro' is not a model the "
                                                                           r"engine knows"),
    "bench-generate-family-of-several": (["bench", "generate", "--model", "wan"],
                                         r"--model: 'wan' is the Wan family, which has several models: name one"),
    "bench-generate-steps": (["bench", "generate", "--steps", "0"], r"argument --steps: 0 is invalid"),
    "bench-generate-width": (["bench", "generate", "--width", "100"], r"argument --width: 100 is invalid"),
    "bench-generate-repeats": (["bench", "generate", "--repeats", "0"], r"argument --repeats: 0 is invalid"),
    "bench-generate-dtype": (["bench", "generate", "--dtype", "fp64"], r"argument --dtype: invalid choice"),
    "bench-bridge-sizes": (["bench", "bridge", "--sizes-mb", "1,abc"], r"--sizes-mb: '1,abc': 'abc' is not an integer"),
    "bench-bridge-size-0": (["bench", "bridge", "--sizes-mb", "16,0"], r"argument --sizes-mb: '16,0': 0 is invalid"),
    "bench-bridge-repeats": (["bench", "bridge", "--repeats", "0"], r"argument --repeats: 0 is invalid"),
    "bench-bridge-xdit-repeats": (["bench", "bridge", "--xdit-repeats", "-1"], r"--xdit-repeats: -1 is invalid"),
    "bench-soak-jobs-0": (["bench", "soak", "--jobs", "0"], r"argument --jobs: 0 is invalid: use an integer >= 1"),
    "bench-soak-jobs-not-int": (["bench", "soak", "--jobs", "many"], r"argument --jobs: 'many' is not an integer"),
    "bench-soak-ranks-odd": (["bench", "soak", "--ranks", "3"], r"argument --ranks: 3 gives 3 rank\(s\): .*even"),
    "bench-soak-ranks-9": (["bench", "soak", "--ranks", "9"], r"argument --ranks: 9 is invalid: use 1 to 8"),
    "bench-soak-gpus-without-cuda": (["bench", "soak", "--gpus", "0,1"], r"argument --gpus: 0,1 needs CUDA"),
    "bench-soak-one-gpu": (["bench", "soak", "--gpus", "0"], r"argument --gpus: 0 gives 1 rank\(s\): .*even", 1),
    "bench-soak-ranks-vs-gpus": (["bench", "soak", "--ranks", "4", "--gpus", "0,1"],
                                 r"argument --ranks: 4 does not match --gpus 0,1 \(2 GPUs\)", 2),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_every_user_error_exits_2_with_one_line_before_any_rank_starts(case, files, capsys, monkeypatch):
    argv, expected, cuda_devices = (case + (0,))[:3]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    monkeypatch.setattr(Engine, "start", lambda self: pytest.fail("a rank was started for a user error"))
    before = engine_dirs(owner=os.getpid())
    code = main([a.format(**files) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert err.startswith("python -m engine") and ": error: " in err, err
    assert re.search(expected, err), (expected, err)
    assert engine_dirs(owner=os.getpid()) == before


@pytest.mark.parametrize("command", [["demo"], ["generate"], ["make-tiny"], ["bench", "bridge"],
                                     ["bench", "overhead"], ["bench", "comm"], ["bench", "gpu"],
                                     ["bench", "cache"], ["bench", "scaling"], ["bench", "soak"]], ids=" ".join)
def test_help_shows_the_defaults(command, capsys):
    assert main(command + ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m engine {' '.join(command)}") and re.search(r"\(default:\s", out)


@pytest.mark.parametrize("kind,variant,lines", [
    ("flux", "flux-schnell", ["flux-schnell, BFL layout: hidden 128, 4 heads x 32, 4 double + 4 single blocks",
                              "cond [B, N, 4096] (T5-XXL), pooled [B, 768] (CLIP-L); no guidance input"]),
    ("sd3", "sd3.5-large", ["sd3.5-large, SAI MMDiT layout: hidden 256, 4 heads x 64, 4 joint blocks",
                            "cond [B, 77+N, 4096] (CLIP-L+G padded to 4096, then T5-XXL), pooled [B, 2048]"]),
])
def test_make_tiny_prints_the_dimensions_and_the_conditioning_it_takes(kind, variant, lines, tmp_path, capsys):
    assert main(["make-tiny", "--kind", kind, "--variant", variant, "--out", str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    print(out)
    assert os.path.isfile(tmp_path / "new" / f"tiny-{variant}.safetensors")
    assert all(line in out for line in lines) and "latent  [B, 16, H/8, W/8]" in out


def test_generate_ranks_2_plan_auto_says_which_plan_and_gives_the_one_rank_latent(files, capsys):
    """cfg > 1 on a tiny SD3.5: auto picks cfg2 for 2 ranks, says so in one line before running, and the latent is the
    1-rank one (in process: main() starts and stops the ranks itself)."""
    from safetensors.torch import load_file

    common = ["generate", "--model", files["sd3"], "--cond", files["sd3_cond"], "--seed", "4", "--steps", "3",
              "--cfg", "4.0", "--width", "128", "--height", "128"]
    one, two = os.path.join(files["dir"], "auto1.safetensors"), os.path.join(files["dir"], "auto2.safetensors")
    assert main(common + ["--out", one]) == 0
    assert capsys.readouterr().out.startswith("auto chose single rank for 1 rank(s): one rank runs the whole job\n")
    assert main(common + ["--ranks", "2", "--plan", "auto", "--out", two]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    diff = (load_file(two)["samples"] - load_file(one)["samples"]).abs().max().item()
    print(f"{lines[0]}\ngenerate --ranks 2 --plan auto vs 1 rank: max abs diff {diff:.3g}")
    assert lines[0] == "auto chose cfg2 for 2 rank(s): positive and negative passes on separate ranks"
    assert lines[1:4] == ["step 1/3", "step 2/3", "step 3/3"] and "\r" not in out  # stdout is not a terminal
    assert "plan cfg2 on 2 rank(s)" in out and not without_notes(err)
    assert diff <= 1e-4


def without_notes(err: str) -> str:
    """stderr less the note a machine with fewer cores than ranks gets (see the oversubscription test)."""
    return "".join(line for line in err.splitlines(keepends=True) if ": note: " not in line)


def test_ctrl_c_during_generate_exits_130_in_one_line_and_leaves_no_rank_or_shared_memory(files):
    args = [a.format(**files) for a in GEN] + ["--steps", "5000", "--width", "64", "--height", "64", "--ulysses", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        plan = proc.stdout.readline()
        first = proc.stdout.readline()
        ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == proc.pid]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(plan + first + out + err)
    assert first == "step 1/5000\n", plan + first  # whole lines when stdout is not a terminal
    assert len(ranks) == 2
    assert proc.returncode == 130, err
    err = without_notes(err)
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err, err
    assert all(pid_gone(pid) for pid in ranks)
    assert engine_dirs(owner=proc.pid) == set()


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def test_demo_runs_two_ranks_on_a_tiny_flux_model_and_all_checks_pass():
    out = run("demo")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert "2 CPU rank(s)" in out.stdout and "tiny synthetic checkpoint flux-dev, BFL layout" in out.stdout
    assert out.stdout.count("check   ok") == 7 and "FAIL" not in out.stdout
    assert "LATENT [1, 16, 32, 32]" in out.stdout
    assert "4 double_blocks, 4 single_blocks" in out.stdout
    assert out.stdout.splitlines()[-1] == "demo: all 7 checks passed"


def test_demo_describes_and_runs_an_sd3_file_with_sd3_conditioning(files):
    out = run("demo", "--model", files["sd3"], "--ranks", "1")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert "given file sd3.5-medium, SAI MMDiT layout: hidden 256, 4 heads x 64, 4 joint blocks" in out.stdout
    job = next(line for line in out.stdout.splitlines() if line.startswith("job "))
    assert "cond [1, 333, 4096], pooled [1, 2048])" in job and "guidance" not in job
    assert "4 joint_blocks" in out.stdout and "None" not in out.stdout
    assert out.stdout.splitlines()[-1] == "demo: all 7 checks passed"


def test_bench_bridge_prints_a_row_per_size_with_both_paths_and_the_ratio():
    out = run("bench", "bridge", "--sizes-mb", "1", "--repeats", "1", "--xdit-repeats", "1")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert "measuring: xDiT-style, 2 gloo processes, 1 MB ..." in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 1 MB"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 6 and all(c.endswith(" ms") for c in cells[1:4]) and cells[4].endswith("x")


def test_bench_cache_reports_skips_and_writes_json(tmp_path):
    out = run("bench", "--json", str(tmp_path / "cache.json"), "cache", "--steps", "6")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    rows = json.loads((tmp_path / "cache.json").read_text())["cache"]
    by_threshold = {r["threshold"]: r for r in rows}
    assert by_threshold[None]["skipped_calls"] == 0 and by_threshold[0.0]["rel_l2_vs_uncached"] == 0.0
    assert by_threshold[1.0]["skipped_calls"] > 0 and by_threshold[1.0]["rel_l2_vs_uncached"] > 0
    assert "| threshold | skipped calls |" in out.stdout


def test_bench_guider_runs_a_two_rank_plan_on_both_routes_with_the_same_latent(tmp_path):
    """The engine's own loop and ComfyUI's route (one round trip a step, the euler update in this process) run the
    same model calls on the same ranks; only where the euler update's arithmetic runs differs, so the latents agree to
    fp32 rounding of 2 steps on values of order 1 (bound 1e-5). The row says what a round trip moves each way (the
    latent in the compute dtype and the timestep in; the output back) and splits its time into the model's (rank 0's
    measure) and the rest."""
    out = run("bench", "--json", str(tmp_path / "guider.json"), "guider", "--ranks", "2", "--plan", "ulysses2",
              "--steps", "2", "--repeats", "1", "--width", "64", "--height", "64")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    (row,) = json.loads((tmp_path / "guider.json").read_text())["guider"]
    assert row["plan"] == "ulysses2" and row["max_abs_diff"] <= 1e-5 and row["trip_ms"] >= row["model_ms"] > 0
    latent_bytes = 16 * 8 * 8 * 4   # fp32 ranks: the 64x64 latent, 16 channels at 8x
    assert row["sent_mib_per_trip"] * 2**20 == latent_bytes + 4 and row["received_mib_per_trip"] * 2**20 == latent_bytes


def test_bench_guider_prices_a_wan_clips_bytes_at_its_real_token_count_with_the_forward_stubbed(tmp_path):
    """Wan image-to-video at 832x480, 17 frames (the tiny model's widths, the clip's real tokens): with the forward
    stubbed (what surrounds the model is what is timed) the image channels cross once, not every round trip, and two
    passes a trip (ComfyUI's two calls) come back as two outputs."""
    out = run("bench", "--json", str(tmp_path / "guider.json"), "guider", "--model", "synthetic:wan2.1-i2v-14b:tiny",
              "--width", "832", "--height", "480", "--frames", "17", "--steps", "2", "--repeats", "1",
              "--stub-forward")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    (row,) = json.loads((tmp_path / "guider.json").read_text())["guider"]
    latent = 16 * 5 * 60 * 104 * 4   # fp32 ranks: 5 latent frames of 60x104, 16 channels
    assert row["image_tokens"] == 5 * 30 * 52 and row["passes_per_trip"] == 2 and row["forward"] == "stub"
    assert row["sent_mib_per_trip"] * 2**20 == 2 * (latent + 4) and row["received_mib_per_trip"] * 2**20 == 2 * latent


def test_bench_guider_refuses_a_pipefusion_plan_in_one_line_before_any_rank_starts(capsys):
    assert main(["bench", "guider", "--ranks", "2", "--plan", "pipefusion2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "plan pipefusion2 uses pipefusion" in err and "xDiT Sampler" in err, err


def test_bench_av_times_both_audio_video_families_and_counts_only_each_calls_own_transfers(tmp_path):
    """bench av (on a GPU: full size, eager and compiled) on one CPU rank with the tiny MiniMax-H3 and LTX-2.3: each
    row's call goes through the engine's MODEL with the family's own call tensors, and the session that counts host
    synchronisations finds two a call after the first, the call's own (its upload, its output's download)."""
    out = run("bench", "--json", str(tmp_path / "av.json"), "av", "--models",
              "synthetic:minimax-h3:tiny,synthetic:ltx-2.3:tiny", "--rows", "eager", "--calls", "1", "--width", "64",
              "--height", "64")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    rows = json.loads((tmp_path / "av.json").read_text())["av"]
    assert [r["model"] for r in rows] == ["synthetic:minimax-h3:tiny", "synthetic:ltx-2.3:tiny"]
    assert all(r["syncs_per_call"] == 2 and r["call_s"] >= r["model_s"] > 0 for r in rows), rows
    # 39 frames of 64x64: MiniMax-H3 12 latent frames of 2x2 patches and 2 x 65 audio rows; LTX-2.3 7 of 2x2, 49
    assert [(r["video_tokens"], r["audio_tokens"]) for r in rows] == [(12 * 2 * 2, 130), (7 * 2 * 2, 49)]
    # LTX-2.3 with LTXVAddGuide's first and last frames (two more latent frames, the guides' attention weights): the
    # same two transfers a call
    out = run("bench", "--json", str(tmp_path / "guided.json"), "av", "--models", "synthetic:ltx-2.3:tiny", "--rows",
              "guided", "--calls", "1", "--width", "64", "--height", "64")
    assert out.returncode == 0 and not out.stderr, out.stderr
    (row,) = json.loads((tmp_path / "guided.json").read_text())["av"]
    assert (row["row"], row["video_tokens"], row["syncs_per_call"]) == ("guided", 9 * 2 * 2, 2), row


def test_bench_av_and_guider_refuse_bad_inputs_in_one_line_before_any_rank_starts(capsys):
    for argv, said in ((["av", "--models", "synthetic:flux-dev:tiny"], "not an audio-video family"),
                       (["av", "--models", "synthetic:ltx-2.3:tiny", "--frames", "10"], "use 9 or 17"),
                       (["av", "--models", "synthetic:minimax-h3:tiny", "--rows", "guided"], "not an LTX-2.3 source"),
                       (["guider", "--model", "synthetic:wan2.1-1.3b:tiny", "--frames", "10"], "use 9 or 13"),
                       (["guider", "--steps", "1"], "use 2 or more steps")):
        assert main(["bench"] + argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and said in err, (argv, err)


def test_bench_generate_compares_the_engine_with_a_plain_loop_on_the_same_synthetic_model():
    out = run("bench", "generate", "--model", "flux-schnell", "--steps", "2", "--repeats", "1", "--width", "64",
              "--height", "64")
    print(out.stdout)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert out.stdout.count("measuring: ") == 1 and "engine overhead: " in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| engine:", "| plain loop"))]
    assert len(rows) == 2 and all(line.rstrip(" |").endswith("x") for line in rows)
    diff = float(out.stdout.split("max abs diff ")[1].split()[0])
    assert diff < 1e-3  # same weights, same inputs: the two loops agree to float rounding


# ---- the result is never lost, nothing but a regular file is replaced ---------------------------------------------
def test_a_result_whose_folder_vanished_during_the_job_is_kept_and_said_where_in_one_line(files, tmp_path, capsys,
                                                                                          monkeypatch):
    """The --out folder exists when the job starts and is removed while it runs: the job's latent is written to the
    temporary directory, exit 1 with one line naming both paths, no traceback."""
    from safetensors.torch import load_file
    from engine.cli import generate

    folder, kept = tmp_path / "results", tmp_path / "kept"
    folder.mkdir()
    kept.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(kept))
    show = generate.Progress.__call__

    def progress(self, step, total):   # the user removes the folder while the job runs
        if folder.exists():
            folder.rmdir()
        show(self, step, total)
    monkeypatch.setattr(generate.Progress, "__call__", progress)
    argv = [a.format(**files) for a in GEN] + ["--steps", "1", "--width", "64", "--height", "64",
                                                "--out", str(folder / "out.safetensors")]
    code = main(argv)
    out, err = capsys.readouterr()
    print(err)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"python -m engine generate: error: could not write {folder}/out.safetensors (No such file "
                          f"or directory); the result is in {kept}/out-")
    latent = load_file(err.strip().split("the result is in ")[1])["samples"]
    assert latent.shape == (1, 16, 8, 8) and torch.isfinite(latent).all()


def test_a_model_file_given_as_cond_is_refused_in_one_short_line_without_loading_it(files, capsys, monkeypatch):
    from engine.cli import generate

    real, read = generate.safe_open, []

    class Recording:   # safe_open, noting each tensor read
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.opened.get_tensor(name)
    monkeypatch.setattr(generate, "safe_open", Recording)
    assert main([a.format(**files) for a in GEN] + ["--cond", files["flux"]]) == 2
    err = capsys.readouterr().err
    print(f"{len(err)} characters: {err}")
    assert "has no 'cond' or 'pooled' tensor (it has 148 tensor(s): " in err and "... (146 more)):" in err
    assert len(err) < 400 and err.count("\n") == 1 and read == []
    assert main([a.format(**files) for a in GEN] + ["--cond", files["sd3_cond"]]) == 2   # the wrong model's, read
    assert read == ["cond", "pooled", "neg_cond", "neg_pooled"]


# ---- one default compute dtype ---------------------------------------------------------------------------------
def test_the_default_compute_dtype_is_bf16_on_gpus_and_fp32_on_cpu_for_generate_bench_the_node_and_plan(
        files, monkeypatch):
    import importlib
    from engine.cli import bench, build_parser, generate
    from engine.generate.request import default_dtype
    from conftest import load_pack, PACK_NAME

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parser = build_parser()
    base = ["generate", "--model", files["flux"], "--cond", files["flux_cond"], "--out", files["out"]]
    assert generate.build_request(parser.parse_args(base)).dtype == "fp32"
    assert generate.build_request(parser.parse_args(base + ["--gpus", "0"])).dtype == "bf16"
    assert generate.build_request(parser.parse_args(base + ["--gpus", "0", "--dtype", "fp16"])).dtype == "fp16"
    measured = []   # bench overhead: the dtype it would measure in (the measurement itself is not run here)
    monkeypatch.setattr(bench, "bench_overhead", lambda *args, **kwargs: measured.append(args[6]) or [])
    for gpus in ([], ["--gpus", "0"]):
        a = parser.parse_args(["bench", "overhead", *gpus])
        assert a.run(a) == 0
    assert measured == ["fp32", "bf16"]
    load_pack()
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    assert [core.EngineSettings(model_path="m", gpus=(0,), device=d).compute_dtype for d in ("cpu", "cuda")] == \
        ["fp32", "bf16"]
    plan = parser.parse_args(["plan", "--model", "flux-dev", "--gpus", "2", "--interconnect", "nvlink"])
    assert plan.dtype == default_dtype("cuda") == "bf16" and default_dtype("cpu") == "fp32"   # plan: GPUs only


def test_more_cpu_ranks_than_cores_get_a_note_and_gpus_or_enough_cores_none(monkeypatch):
    from engine.cli.generate import oversubscribed

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    note = oversubscribed(8, None)
    print(note)
    assert note.startswith("note: 8 CPU ranks share 2 core(s)") and "\n" not in note
    assert oversubscribed(2, None) is None and oversubscribed(8, list(range(8))) is None


def test_make_tiny_takes_the_wan_names_the_video_issue_uses_and_bench_takes_video_frames(tmp_path):
    """make-tiny --kind wan --variant wan2.1-t2v | wan2.1-i2v (the names a user reads in ComfyUI's templates) write the
    1.3B text-to-video and the 14B image-to-video files; bench overhead refuses a frame count ComfyUI would not make."""
    from engine.models.load import inspect_model
    for alias, variant in (("wan2.1-t2v", "wan2.1-1.3b"), ("wan2.1-i2v", "wan2.1-i2v-14b")):
        out = run("make-tiny", "--kind", "wan", "--variant", alias, "--out", str(tmp_path / alias))
        assert out.returncode == 0, out.stderr
        assert inspect_model(str(tmp_path / alias / f"tiny-{variant}.safetensors")).variant == variant
    refused = run("bench", "overhead", "--model", "wan2.1-1.3b", "--frames", "8")
    print(refused.stderr)
    assert refused.returncode == 2 and "8 frames is not a count" in refused.stderr and "use 5 or 9" in refused.stderr


# ---- nothing the job reads is replaced by what it writes ---------------------------------------------------------
def _digest(path: str) -> str:
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("given,link", [("model", None), ("cond", "symlink"), ("lora", "hard link")])
def test_generate_refuses_an_out_that_is_or_links_to_an_input_and_the_input_stays_byte_identical(
        given, link, files, tmp_path, capsys, monkeypatch):
    """--out equal to --model, a symbolic link to --cond, a hard link to a --lora: one line, exit 2, no rank started,
    the input file as it was."""
    monkeypatch.setattr(Engine, "start", lambda self: pytest.fail("a rank was started for a user error"))
    source = {"model": files["flux"], "cond": files["flux_cond"], "lora": files["other"]}[given]
    out = source
    if link == "symlink":
        out = str(tmp_path / "link.safetensors")
        os.symlink(source, out)
    elif link == "hard link":
        out = str(tmp_path / "hard.safetensors")
        os.link(source, out)
    before = _digest(source)
    argv = [a.format(**files) for a in GEN] + ["--lora", files["other"], "--out", out]
    code = main(argv)
    err = capsys.readouterr().err
    print(err)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    how = "is" if link is None else "is the same file as"
    assert err.startswith(f"python -m engine generate: error: argument --out: {out} {how} the --{given} file {source}: "
                          f"writing there would replace it; give a new name, e.g. ")
    assert _digest(source) == before


def test_bench_refuses_a_json_path_that_is_the_model_it_reads_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """The same rule for every command that writes: bench --json naming bench guider's --model file."""
    monkeypatch.setattr(Engine, "start", lambda self: pytest.fail("a rank was started for a user error"))
    model = tmp_path / "model.json"
    model.write_text("{}")
    assert main(["bench", "--json", str(model), "guider", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert err.count("\n") == 1 and f"argument --json: {model} is the --model file {model}" in err
    assert model.read_text() == "{}"


# ---- one name per model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ltx23", "ltx-2.3"])
def test_make_tiny_takes_either_name_of_ltx23_and_prints_the_one_canonical_name(name, tmp_path, capsys):
    assert main(["make-tiny", "--kind", name, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert out.startswith(f"wrote   {tmp_path}/tiny-ltx-2.3.safetensors (")
    assert "\nmodel   ltx-2.3, " in out
    assert "\ncond    none: generate does not sample LTX-2.3/2.5's audio and video together" in out


def test_bench_calibrate_and_synthetic_sources_take_any_name_of_a_model_as_its_canonical_variant():
    from engine.cli import build_parser
    from engine.models.load import inspect_model

    parser = build_parser()
    assert parser.parse_args(["bench", "overhead", "--model", "ltx23"]).model == "ltx-2.3"
    assert parser.parse_args(["bench", "project", "--model", "H3"]).model == "minimax-h3"
    assert parser.parse_args(["bench", "shard", "--model", "qwen-image"]).model == "qwen-image"
    assert parser.parse_args(["bench", "av", "--models", "h3,ltx23"]).models == ["minimax-h3", "ltx-2.3"]
    assert parser.parse_args(["calibrate", "--model", "ltx2.3"]).model == "ltx-2.3"
    assert inspect_model("synthetic:ltx23:tiny").variant == "ltx-2.3"


# ---- --shard alone: auto chooses the other degrees ---------------------------------------------------------------
def test_generate_with_only_ranks_and_shard_lets_auto_choose_the_other_degrees_and_says_which(files, capsys):
    """--ranks 2 --shard 2 runs the plan auto ranks first among those dividing the weights 2 ways, says so before
    running, and gives the 1-rank latent."""
    from safetensors.torch import load_file

    common = [a.format(**files) for a in GEN] + ["--steps", "2", "--width", "64", "--height", "64"]
    one, two = os.path.join(files["dir"], "shard1.safetensors"), os.path.join(files["dir"], "shard2.safetensors")
    assert main(common + ["--out", one]) == 0
    capsys.readouterr()
    assert main(common + ["--ranks", "2", "--shard", "2", "--out", two]) == 0
    out = capsys.readouterr().out
    chosen = re.match(r"auto chose (\S+ x shard2) for 2 rank\(s\) with the weights divided 2 ways \(--shard 2\): ", out)
    diff = (load_file(two)["samples"] - load_file(one)["samples"]).abs().max().item()
    print(f"{out.splitlines()[0]}\n--ranks 2 --shard 2 vs 1 rank: max abs diff {diff:.3g}")
    assert chosen and f"plan {chosen.group(1)} on 2 rank(s)" in out
    assert diff <= 1e-4


# ---- make-tiny's conditioning file ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["flux-dev", "wan2.1-i2v-14b"])
def test_make_tiny_writes_a_conditioning_file_and_the_generate_command_it_prints_runs(variant, tmp_path, capsys):
    """No ComfyUI needed: make-tiny's cond file (with an image-to-video model's CLIP-vision features and image
    latent) is what generate --cond reads, and the command it prints runs as printed."""
    import shlex
    from safetensors.torch import load_file

    assert main(["make-tiny", "--kind", variant, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    print(out)
    cond = str(tmp_path / f"tiny-{variant}-cond.safetensors")
    assert f"\ncond    {cond} (random: cond [1, 32, " in out
    (command,) = [line[len("try     "):] for line in out.splitlines() if line.startswith("try     ")]
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "engine", "generate"] and words[words.index("--cond") + 1] == cond
    assert main(words[3:]) == 0
    latent = load_file(words[words.index("--out") + 1])["samples"]
    print(capsys.readouterr().out)
    assert latent.shape[-2:] == (16, 16) and torch.isfinite(latent).all()
