"""Two separately launched groups of ranks on loopback, as two machines would run them: the client's engine (rank 0
here) listens on 127.0.0.1 and a `python -m engine worker` process joins it through the TCPStore rendezvous with the
shared secret, bringing rank 1. Real processes, real TCPStore, real gloo."""
import ast
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.cli import main as cli_main
from engine.errors import EngineError
from engine.parallel.plan import ParallelPlan
from engine.runtime.client import Deadlines, Engine

from engine.runtime.launch import pid_gone
from conftest import ROOT
from test_engine_resources import _listening, _socket_inodes

SECRET = "correct horse battery staple"
# heartbeat_s also bounds how long a silent worker may go unnoticed; error_grace_s is longer so that a remote rank's
# death, not rank 0's broken collective, is what a killed worker is reported as
TWO = Deadlines(start_s=60, broadcast_s=30, compute_s=120, return_s=30, heartbeat_s=3, error_grace_s=6)


def launch_worker(address: str, secret: str | None, ranks: int = 1) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XDIT_SECRET"}
    env["PYTHONPATH"] = ROOT
    if secret is not None:
        env["XDIT_SECRET"] = secret
    return subprocess.Popen([sys.executable, "-m", "engine", "worker", "--join", address, "--node-rank", "1",
                             "--ranks", str(ranks), "--join-timeout", "30"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(worker: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
    out, err = worker.communicate(timeout=timeout)
    return worker.returncode, out, err


def listeners(pid: int) -> list[str]:
    return _listening(_socket_inodes(pid))


def test_a_worker_with_a_wrong_or_no_secret_is_refused_and_logged_then_a_right_one_joins(caplog):
    caplog.set_level(logging.INFO, logger="xdit.engine")
    t0 = time.monotonic()
    e = Engine(1, device="cpu", deadlines=TWO, listen="127.0.0.1:0", remote_ranks=[1], secret=SECRET, start=False)
    try:
        address = e.listen_address
        wrong, missing = launch_worker(address, "not the secret"), launch_worker(address, None)
        for name, w in (("wrong", wrong), ("missing", missing)):
            rc, out, err = finish(w)
            print(f"{name} secret: worker exit {rc}, stderr {err.strip()!r}")
            assert rc == 2
            assert err.strip().splitlines() == [f"refused by {address}: wrong secret"]
        refusals = [r.getMessage() for r in caplog.records if r.name == "xdit.engine" and "refused" in r.getMessage()]
        print("client log:", refusals)
        assert len(refusals) == 2 and all("node 1" in m and "wrong secret" in m for m in refusals)
        assert e.pids == []  # nothing started for a refused worker

        right = launch_worker(address, SECRET)
        e.start()
        print(f"refusals, then join and start: {time.monotonic() - t0:.1f} s; ranks {e.rank_info}")
        assert [i["backend"] for i in e.rank_info] == ["gloo", "gloo"]
        x = {"x": torch.randn(3, 1000), "y": torch.arange(10, dtype=torch.int64)}
        result = e.submit("echo", {"steps": 2}, x)
        print(f"echo across the two groups: timings {result.timings}")
        assert all(torch.equal(result.outputs[k], v) for k, v in x.items())
        assert [r["crc32"] for r in result.ranks] == [result.crc32] * 2  # both groups verified the same job

        with pytest.raises(EngineError, match="rank 1 runs on node 1 and cannot return outputs"):
            e.submit("echo", {"return_rank": 1}, x)
        assert torch.equal(e.submit("echo", {}, x).outputs["y"], x["y"])  # a refused output leaves the group sound

        # the rendezvous listens on 127.0.0.1 only, and nothing else of either group listens off loopback
        port_hex = f"{int(address.rsplit(':', 1)[1]):04X}"
        mine = listeners(os.getpid())
        print("client listening:", mine, "ranks + worker:", {p: listeners(p) for p in e.pids + [right.pid]})
        assert f"tcp 0100007F:{port_hex}" in mine
        assert not [m for m in mine if m.endswith(port_hex) and m != f"tcp 0100007F:{port_hex}"]
        for pid in [os.getpid(), right.pid] + e.pids:
            for entry in listeners(pid):
                table, local = entry.split()
                assert local.split(":")[0] in ("0100007F", "0000000000000000FFFF00000100007F",
                                               "00000000000000000000000001000000"), (pid, entry)
    finally:
        e.close()
    rc, out, err = finish(right)
    print(f"after close: worker exit {rc}; its output {out.strip().splitlines()}")
    assert rc == 0 and "let this node go" in out


@pytest.fixture(scope="module")
def pair():
    e = Engine(1, device="cpu", deadlines=TWO, listen="127.0.0.1:0", remote_ranks=[1], secret=SECRET, start=False)
    workers = [launch_worker(e.listen_address, SECRET)]
    e.start()
    yield e, workers
    e.close()
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.communicate(timeout=10)


def test_generate_on_two_ranks_across_the_two_groups_equals_the_single_rank_latent(pair, tiny_models):
    from test_parallel import bound, request
    from tolerance import report

    e, _ = pair
    with Engine(1, device="cpu", deadlines=TWO) as single:
        reference = single.submit("generate", *request(tiny_models, "flux").to_job()).outputs["samples"]
    t0 = time.monotonic()
    result = e.submit("generate", *request(tiny_models, "flux", plan=ParallelPlan(ulysses=2)).to_job())
    print(f"ulysses 2 across the two groups: {time.monotonic() - t0:.2f} s, timings {result.timings}")
    latent = result.outputs["samples"]
    assert latent.shape == reference.shape
    assert report("flux ulysses 2 across two groups", (latent - reference).abs().max(), bound(reference, "flux", 1.0))


def test_a_sessions_calls_reach_a_rank_on_another_machine_through_rank_0s_broadcast(pair):
    """Ranks on the client's machine map a call's segment themselves; a rank on another machine cannot, so there rank
    0 takes each call and broadcasts it. Each call's answer counts the calls every rank served."""
    e, _ = pair
    assert not e.calls_by_shared_memory
    with e.session("echo_calls", {}, {}) as s:
        for k in range(3):
            out = s.call({"v": torch.arange(4.0) + k}, scale=2.0)
            assert torch.equal(out["v"], (torch.arange(4.0) + k) * 2.0)
            assert out["served"].item() == 2 * (k + 1)
    assert [r["calls"] for r in s.result.ranks] == [3, 3]


def test_killing_the_worker_mid_job_names_the_remote_rank_then_a_new_worker_replaces_it(pair):
    e, workers = pair
    worker = workers[0]
    remote_pid = e.rank_info[1]["pid"]
    t_kill = []

    def on_progress(step, total):
        if step == 3 and not t_kill:
            t_kill.append(time.monotonic())
            worker.send_signal(signal.SIGKILL)

    with pytest.raises(EngineError) as info:
        e.submit("echo", {"steps": 400, "step_sleep_s": 0.05}, {"x": torch.zeros(4)}, on_progress=on_progress)
    detected = time.monotonic() - t_kill[0]
    print(f"worker killed: detected after {detected:.2f} s (heartbeat_s {TWO.heartbeat_s}): "
          f"{str(info.value).splitlines()[0]}")
    assert info.value.rank == 1 and "rank 1" in str(info.value) and "node 1" in str(info.value)
    assert "worker stopped answering" in str(info.value) and detected < TWO.heartbeat_s + 3
    deadline = time.monotonic() + 10
    while not pid_gone(remote_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_gone(remote_pid)  # the worker's rank died with it

    e.deadlines = Deadlines(start_s=2, heartbeat_s=3, error_grace_s=6, backoff_s=1)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"node 1 \(rank 1\) did not join within 2 s") as info:
        e.submit("echo", {}, {"x": torch.ones(2)})
    print(f"no worker: {time.monotonic() - t0:.2f} s: {str(info.value)}")

    e.deadlines = TWO
    workers.append(launch_worker(e.listen_address, SECRET))
    time.sleep(1.1)   # the worker's loss and the failed start were two failures in a row: the engine backs off 1 s
    out = e.submit("echo", {}, {"x": torch.ones(5)}).outputs["x"]
    assert out.sum().item() == 5.0
    print(f"a new worker joined; restarts: {e.restarts}")
    assert e.generation >= 2


def test_listening_off_loopback_needs_a_secret_and_bad_input_is_refused_before_listening():
    with pytest.raises(ValueError, match="not a loopback address and no shared secret"):
        Engine(1, listen="10.255.255.1:0", remote_ranks=[1], secret="", start=False)
    with pytest.raises(ValueError, match="give both"):
        Engine(1, remote_ranks=[1], start=False)
    with pytest.raises(ValueError, match="HOST:PORT"):
        Engine(1, listen="127.0.0.1", remote_ranks=[1], secret=SECRET, start=False)


@pytest.mark.parametrize("argv,message", [
    (["--join", "127.0.0.1", "--node-rank", "1", "--ranks", "1"], "argument --join: '127.0.0.1' is invalid"),
    (["--join", "127.0.0.1:0", "--node-rank", "1", "--ranks", "1"], "port 0 names no port"),
    (["--join", "127.0.0.1:29600", "--node-rank", "0", "--ranks", "1"], "node 0 is the client's machine"),
    (["--join", "127.0.0.1:29600", "--node-rank", "1", "--ranks", "9"], "use 1 to 8 ranks"),
    (["--join", "127.0.0.1:29600", "--node-rank", "1", "--ranks", "1", "--interface", "nope0"],
     "'nope0' is not a network interface"),
])
def test_worker_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert cli_main(["worker"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and message in err[0]


def test_a_secret_file_readable_by_others_is_refused(tmp_path, capsys):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o644)
    assert cli_main(["worker", "--join", "127.0.0.1:29600", "--node-rank", "1", "--ranks", "1",
                     "--secret-file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "readable by others" in err[0] and "chmod 600" in err[0]


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}


def test_nothing_in_the_engine_can_unpickle():
    """No pickle-family import, no object collective (they pickle), no torch.load without weights_only=True, no
    numpy load with allow_pickle=True, anywhere in engine/."""
    found, scanned = [], 0
    for folder, _, files in os.walk(os.path.join(ROOT, "engine")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            scanned += 1
            tree = ast.parse(open(path).read(), path)
            where = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.split(".")[0] in UNPICKLERS]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLERS:
                    found.append(f"{where}:{node.lineno} from {node.module} import")
                elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
                    found.append(f"{where}:{node.lineno} {node.attr}")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    kw = {k.arg: k.value for k in node.keywords}
                    target = ast.unparse(node.func)
                    if target == "torch.load" and not (isinstance(kw.get("weights_only"), ast.Constant)
                                                       and kw["weights_only"].value is True):
                        found.append(f"{where}:{node.lineno} torch.load without weights_only=True")
                    if node.func.attr == "load" and isinstance(kw.get("allow_pickle"), ast.Constant) \
                            and kw["allow_pickle"].value is True:
                        found.append(f"{where}:{node.lineno} {target}(allow_pickle=True)")
    print(f"scanned {scanned} files under engine/: {found or 'nothing that unpickles'}")
    assert scanned > 30 and not found, found
