"""Fuzzed control frames: a Channel fed arbitrary bytes, truncated frames, oversized length prefixes, non-JSON and
JSON that is not a message yields only whole messages, then ChannelClosed or its ProtocolError saying what was
wrong; never a hang, never another exception. End to end: garbage from the client takes a rank group down in one
log line (the next job replaces it), garbage from a rank fails the job naming the rank and the protocol (the next
job replaces the ranks)."""
import ast
import json
import re
import selectors
import socket
import struct
import threading
import time

import pytest
import torch
from hypothesis import given, strategies as st

from engine.errors import EngineError
from engine.runtime.client import Engine
from engine.runtime.protocol import MAX_MESSAGE_BYTES, Channel, ChannelClosed, ProtocolError

from engine.runtime.launch import pid_gone
from conftest import FAST
from fuzz import Tally, cases, one_line


def shows_bytes_it_was_sent(message: str, data: bytes) -> bool:
    """A ProtocolError shows the bytes it refused (a Python bytes literal): they must be bytes the peer sent."""
    literals = re.findall(r"b'(?:[^'\\]|\\.)*'" + r'|b"(?:[^"\\]|\\.)*"', message)
    return any(ast.literal_eval(lit) in data for lit in literals)


def frame(payload: bytes, size: int | None = None) -> bytes:
    return struct.pack("!I", len(payload) if size is None else size) + payload


MESSAGE = st.fixed_dictionaries({"op": st.sampled_from(["hb", "phase", "done", "progress"])},
                                optional={"job_id": st.integers(0, 2 ** 40), "step": st.integers(0, 99),
                                          "pad": st.text(max_size=40)})
FRAMES = st.one_of(
    MESSAGE.map(lambda m: ("ok", frame(json.dumps(m).encode()))),
    st.binary(max_size=64).map(lambda b: ("bytes", frame(b))),                                    # not JSON, mostly
    st.sampled_from([[1, 2], "op", 3, None, True, 1.5]).map(lambda v: ("json", frame(json.dumps(v).encode()))),
    st.sampled_from([{}, {"op": 3}, {"step": 1}]).map(lambda v: ("json", frame(json.dumps(v).encode()))),
    st.integers(MAX_MESSAGE_BYTES + 1, 2 ** 32 - 1).map(lambda n: ("oversized", frame(b"{", n))),
    st.binary(min_size=1, max_size=64).map(lambda b: ("raw", b)),                                 # unframed garbage
    st.sampled_from([b"\xff\xfe", b"\x00\x00\x00\x08{\"op\":", b"\x00"]).map(lambda b: ("truncated", b)),
)


def read_all(data: bytes, ready: bool) -> tuple[list[dict], BaseException]:
    """Feed `data` to a Channel from a writer thread, close, and read until the channel raises."""
    a, b = socket.socketpair()
    b.settimeout(20)   # a reader that waited for bytes that never come would fail with a timeout, not hang
    writer = threading.Thread(target=lambda: (a.sendall(data), a.close()), daemon=True)
    writer.start()
    chan, got = Channel(b), []
    try:
        if ready:
            sel = selectors.DefaultSelector()
            sel.register(b, selectors.EVENT_READ)
            while True:
                if sel.select(timeout=20):
                    got += chan.recv_ready()
                else:
                    raise AssertionError("channel never became readable")
        while True:
            got.append(chan.recv())
    except ChannelClosed as e:
        return got, e
    finally:
        writer.join(timeout=20)
        chan.close()


@pytest.mark.timeout(300)
def test_any_bytes_on_the_control_channel_give_messages_then_a_clear_close():
    tally = Tally("control frames")

    @cases(600)
    @given(frames=st.lists(FRAMES, max_size=6), ready=st.booleans())
    def prop(frames, ready):
        data = b"".join(f for _, f in frames)
        got, end = read_all(data, ready)
        assert all(isinstance(m, dict) and isinstance(m.get("op"), str) for m in got)
        message = str(end)
        assert one_line(message), message
        if isinstance(end, ProtocolError):   # says what it refused: the frame's bytes
            assert message.startswith("control ") and shows_bytes_it_was_sent(message, data), message
            tally("protocol error")
        else:
            assert "closed the control channel" in message, message
            tally("closed")
        kinds = [k for k, _ in frames]
        if all(k == "ok" for k in kinds):   # sound frames all arrive, in order, then a plain close
            assert len(got) == len(kinds) and not isinstance(end, ProtocolError)

    prop()
    tally.report()
    assert tally.counts.get("protocol error", 0) > 100 and tally.counts.get("closed", 0) > 20


@pytest.mark.parametrize("data, expected", [
    (frame(b"", MAX_MESSAGE_BYTES + 1), "control frame of 1048577 bytes exceeds 1 MiB"),
    (frame(b"\xff{not json"), "control frame is not JSON"),
    (frame(b"[1,2]"), "control message is not an object: a JSON list"),
    (frame(b'{"step":1}'), "control message has no op"),
    (frame(b'{"op":"hb"}')[:7], "in the middle of a frame (7 bytes of it received)"),
])
def test_each_kind_of_bad_frame_is_named(data, expected):
    got, end = read_all(data, ready=False)
    print(end)
    assert got == [] and expected in str(end)
    assert isinstance(end, ProtocolError) == ("middle" not in expected)


# ---- end to end, with real ranks -------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_garbage_from_the_client_takes_the_rank_group_down_in_one_line_and_the_next_job_succeeds(capfd):
    with Engine(2, device="cpu", deadlines=FAST, rank_stdio="inherit") as engine:
        x = torch.randn(8)
        assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
        old = engine.pids
        engine._chans[1].sock.sendall(frame(b"\x00garbage\xff"))
        deadline = time.monotonic() + 60
        while not all(pid_gone(p) for p in old) and time.monotonic() < deadline:
            time.sleep(0.1)
        err = capfd.readouterr().err
        print(err.strip())
        assert all(pid_gone(p) for p in old), "the ranks outlived a broken control channel"
        assert "rank 1: control channel from the client is broken (ProtocolError: control frame is not JSON" in err
        assert "Traceback" not in err
        assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
        # a killed rank shows as a zombie before its last thread is gone (and it can be reaped): the client may find
        # the group going by its removed directory first
        assert not set(old) & set(engine.pids) and ("exited while idle" in engine.restarts[-1] or
                                                    "engine directory was removed while idle" in engine.restarts[-1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("garbage, expected", [
    (frame(b"<html>"), "control frame is not JSON"),
    (frame(b"{", 2 ** 31), "control frame of 2147483648 bytes exceeds 1 MiB"),
])
def test_garbage_from_a_rank_fails_the_job_naming_it_and_the_protocol(garbage, expected):
    with Engine(2, device="cpu", deadlines=FAST) as engine:
        ours, theirs = socket.socketpair()
        real = engine._chans[1]
        engine._chans[1] = Channel(ours)   # rank 1's end of the channel, as the client sees it, is ours to write
        theirs.sendall(garbage)
        old = engine.pids
        try:
            with pytest.raises(EngineError) as info:
                engine.submit("echo", {}, {"x": torch.zeros(2)})
        finally:
            real.close()
            theirs.close()
        message = str(info.value)
        print(message)
        assert info.value.rank == 1 and "rank 1 broke the control protocol" in message and expected in message
        assert one_line(message) and "replaced" in message
        x = torch.randn(5)
        assert torch.equal(engine.submit("echo", {}, {"x": x}).outputs["x"], x)
        assert all(pid_gone(p) for p in old) and "rank 1 broke the control protocol" in engine.restarts[-1]
