"""Shared fixtures: real rank processes on CPU (gloo), reused across tests where a test leaves them sound; and the
hypothesis profile of the property-based tests (tests/fuzz.py says how to replay a failure)."""
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from engine.runtime.client import Deadlines, Engine

# Property-based tests: by default (CI included, whether or not it sets CI) the same cases every run of a commit,
# derandomized, and no example database, so a sound commit cannot fail by an unlucky draw; HYPOTHESIS_PROFILE=dev
# draws random cases (a failing one kept in .hypothesis/ and replayed first), deep ten times as many. Each profile has
# no per-case deadline (the machine is shared) and prints the failing case's reproduce_failure blob.
_QUIET = dict(deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, database=None, **_QUIET)
settings.register_profile("dev", derandomize=False, **_QUIET)
settings.register_profile("deep", derandomize=False, database=None, **_QUIET)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or "ci"
settings.load_profile(HYPOTHESIS_PROFILE)

# What the planner measures of this machine (engine/runtime/machine.py) goes to this test session's own cache folder
# (the ranks inherit it), so no calibration stored on the machine changes the plans the tests check.
_CACHE = tempfile.mkdtemp(prefix="xdit-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK_NAME = "ComfyUI-xDiT"
FAST = Deadlines(start_s=120, broadcast_s=60, compute_s=120, return_s=60, heartbeat_s=5, error_grace_s=2)


def load_pack(name=PACK_NAME):
    """As ComfyUI loads a custom node pack: by file path, as a package, its folder not on sys.path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def engine(request):
    with Engine(request.param, device="cpu", deadlines=FAST) as e:
        yield e


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny FLUX.1-dev and SD3.5-medium checkpoint, written once per module."""
    from engine.models.tiny import write_tiny
    d = tmp_path_factory.mktemp("tiny")
    return {"flux": write_tiny("flux", str(d)), "sd3": write_tiny("sd3", str(d), variant="sd3.5-medium")}


@pytest.fixture(scope="module")
def engines():
    """engines(world): a CPU engine of that many ranks, started once per module and closed after it."""
    started = {}

    def get(world):
        if world not in started:
            started[world] = Engine(world, device="cpu", deadlines=FAST)
        return started[world]
    yield get
    for e in started.values():
        e.close()


@pytest.fixture
def fresh_engine():
    """A 2-rank engine for tests that break it on purpose."""
    e = Engine(2, device="cpu", deadlines=FAST)
    yield e
    e.close()


class RecordingLink:
    """Stands for the EngineLink behind an EngineTransformer (xdit_nodes/model.py): records each call (x, timestep,
    context, transformer_options, the conditioning kwargs) and answers -x."""

    def __init__(self):
        self.calls = []

    def call(self, x, timestep, context, control, transformer_options, kwargs):
        self.calls.append((x, timestep, context, transformer_options, kwargs))
        return -x


@pytest.fixture(scope="module")
def model_parts():
    """The pack's xdit_nodes.model, loaded as ComfyUI loads the pack (no ComfyUI needed)."""
    load_pack()
    return importlib.import_module(PACK_NAME + ".xdit_nodes.model")
