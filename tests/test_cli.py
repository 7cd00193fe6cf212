"""The command line: the demo on the embedded default and the bridge benchmark, run as a user would."""
import subprocess
import sys

from conftest import ROOT


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_runs_two_ranks_on_a_tiny_flux_model_and_all_checks_pass():
    out = run("demo")
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    assert "2 CPU ranks" in out.stdout
    assert out.stdout.count("check   ok") == 7 and "FAIL" not in out.stdout
    assert "LATENT [1, 16, 32, 32]" in out.stdout
    assert "4 double / 4 single blocks" in out.stdout


def test_bench_bridge_prints_a_row_per_size_with_both_paths_and_the_ratio():
    out = run("bench", "bridge", "--sizes-mb", "1", "--repeats", "1", "--xdit-repeats", "1")
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.strip().startswith("1 MB"))
    cells = [c.strip() for c in row.split("|")]
    assert len(cells) == 6 and all(c.endswith(" ms") for c in cells[1:4]) and cells[4].endswith("x")


def test_make_tiny_rejects_an_unknown_variant_naming_the_valid_ones(tmp_path):
    out = run("make-tiny", "--kind", "flux", "--variant", "flux-pro", "--out", str(tmp_path))
    assert out.returncode == 2
    assert "variant='flux-pro'" in out.stderr and "flux-dev" in out.stderr


def test_bench_generate_compares_the_engine_with_a_plain_loop_on_the_same_synthetic_model():
    out = run("bench", "generate", "--model", "flux-schnell", "--steps", "2", "--repeats", "1", "--width", "64",
              "--height", "64")
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("engine:", "plain diffusers loop"))]
    assert len(rows) == 2 and all(line.rstrip().endswith("x") for line in rows)
    diff = float(out.stdout.split("max abs diff ")[1].split()[0])
    assert diff < 1e-3  # same weights, same inputs: the two loops agree to float rounding
