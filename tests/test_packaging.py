"""Packaging: registry-ready metadata that the registry's own validator accepts without warnings, and
dependencies that never touch the user's torch."""
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

from conftest import ROOT


def read_pyproject():
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        return tomllib.load(f)


def comfy_cli() -> list[str]:
    """comfy-cli of the Python running the tests (its environment's bin folder, else `python -m comfy_cli`), not
    whichever `comfy` PATH finds first: a virtualenv's Python runs the tests without the virtualenv activated."""
    script = os.path.join(os.path.dirname(sys.executable), "comfy")
    if os.access(script, os.X_OK):
        return [script]
    assert importlib.util.find_spec("comfy_cli"), "comfy-cli is a test requirement (requirements-test.txt)"
    return [sys.executable, "-m", "comfy_cli"]


def test_comfy_cli_is_found_from_the_running_interpreter_without_path():
    command = comfy_cli()
    out = subprocess.run(command + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": "/nonexistent"})
    print(command, out.returncode)
    assert out.returncode == 0 and "node" in out.stdout


def test_comfy_node_validate_passes_with_no_warnings():
    out = subprocess.run(comfy_cli() + ["--skip-prompt", "node", "validate"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    print(text)
    assert out.returncode == 0
    assert "All validation checks passed" in text
    assert "warning" not in text.lower()


def test_registry_metadata_is_complete():
    meta = read_pyproject()
    project, comfy = meta["project"], meta["tool"]["comfy"]
    assert project["name"] and project["description"] and project["license"] == {"file": "LICENSE"}
    assert project["version"].count(".") == 2 and all(p.isdigit() for p in project["version"].split("."))
    assert project["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"] and comfy["requires-comfyui"].startswith(">=")


def test_the_registry_description_names_every_model_family():
    from engine import families
    description = read_pyproject()["project"]["description"]
    assert [f.title for f in families.FAMILIES if f.title not in description] == []


def test_the_registry_display_name_names_every_model_family_short():
    """FLUX.1 and FLUX.2 as FLUX, SD3/SD3.5 as SD3: the registry's list shows one short line."""
    from engine import families
    display = read_pyproject()["tool"]["comfy"]["DisplayName"]
    short = {re.sub(r"\.\d$", "", f.title.split("/")[0]) for f in families.FAMILIES}
    assert [s for s in sorted(short) if s not in display] == [] and len(display) <= 70, display


def test_dependencies_pin_yunchang_never_list_torch_and_keep_flash_attn_optional():
    meta = read_pyproject()
    deps = meta["project"]["dependencies"]
    with open(f"{ROOT}/requirements.txt") as f:
        requirements = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    for listed in (deps, requirements):
        assert not any(d.split("=")[0].split(">")[0].split("<")[0].strip() == "torch" for d in listed)
        assert "yunchang==0.6.4" in listed and "diffusers==0.42.1" in listed
        assert not any(d.startswith("flash-attn") for d in listed)
    assert sorted(deps) == sorted(requirements)
    assert any(d.startswith("flash-attn") for d in meta["project"]["optional-dependencies"]["flash"])


def test_the_published_package_leaves_tests_and_ci_out_and_keeps_the_workflows():
    with open(f"{ROOT}/.comfyignore") as f:
        ignored = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    assert {"tests/", ".ci/"} <= ignored
    assert not any(i.startswith("workflows") for i in ignored)
