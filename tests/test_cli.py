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
    assert out.stdout.count("check   ok") == 6 and "FAIL" not in out.stdout
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
