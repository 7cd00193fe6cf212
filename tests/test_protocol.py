"""Control-channel framing: small JSON messages survive partial reads; tensors are refused."""
import socket
import threading

import pytest

from engine.runtime.protocol import Channel, ChannelClosed


def test_messages_split_across_reads_arrive_whole_and_in_order():
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    # ~370 kB in all: more than a socket buffer holds, so the receiver sees frames cut at arbitrary points
    writer = threading.Thread(target=lambda: [sender.send({"op": "progress", "step": i, "pad": "x" * (i * 300)})
                                              for i in range(50)])
    writer.start()
    got = [receiver.recv()["step"] for _ in range(50)]
    writer.join(timeout=10)
    assert got == list(range(50))


def test_a_closed_peer_raises_channel_closed():
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(ChannelClosed):
        Channel(b).recv()


def test_a_message_too_large_for_the_control_channel_is_refused():
    a, _ = socket.socketpair()
    with pytest.raises(ValueError, match="shared-memory bridge"):
        Channel(a).send({"blob": "x" * (2 << 20)})


def test_the_bridge_carries_views_of_broadcast_values(tmp_path):
    """A sampler may pass sigma as a one-element slice of an expanded tensor (stride 0), x as a transposed view:
    both cross with their values."""
    import torch

    from engine.runtime import bridge

    sigma = torch.tensor(0.25).expand(4)[:1]
    x = torch.arange(12.0).reshape(3, 4).t()
    manifest = bridge.write_segment(str(tmp_path / "seg"), {"sigma": sigma, "x": x})
    back = bridge.read_segment({**manifest, "path": str(tmp_path / "seg")})
    assert torch.equal(back["sigma"], sigma) and torch.equal(back["x"], x)
