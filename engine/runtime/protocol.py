"""Control-channel framing: small JSON messages, length-prefixed, over an inherited Unix socketpair.

Only small control messages travel here; tensor payloads go through the shared-memory bridge.
"""
from __future__ import annotations

import json
import socket
import struct
import threading

MAX_MESSAGE_BYTES = 1 << 20  # control messages are small; anything larger is a protocol bug
_HEADER = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The peer closed its end (it exited or was killed)."""


class ProtocolError(ChannelClosed):
    """The peer sent what is not a control message (an oversized frame, bytes that are not JSON, JSON that is not a
    message): its end is as good as closed, and handlers of ChannelClosed treat the peer as broken."""


class Channel:
    """One end of a socketpair carrying JSON messages. send() is thread-safe; recv() is for one reader."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}: "
                             f"tensors must go through the shared-memory bridge")
        with self._send_lock:
            try:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ChannelClosed(str(e)) from e

    def _pop_message(self) -> dict | None:
        if len(self._buf) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buf)
        if size > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"control frame of {size} bytes exceeds {MAX_MESSAGE_BYTES >> 20} MiB (its first "
                                f"bytes: {bytes(self._buf[:16])!r})")
        if len(self._buf) < _HEADER.size + size:
            return None
        payload = bytes(self._buf[_HEADER.size:_HEADER.size + size])
        del self._buf[:_HEADER.size + size]
        try:
            message = json.loads(payload)
        except ValueError as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ProtocolError(f"control frame is not JSON: {e} (its first bytes: {payload[:32]!r})") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"control message is not an object: a JSON {type(message).__name__} "
                                f"({payload[:32]!r})")
        if not isinstance(message.get("op"), str):
            raise ProtocolError(f"control message has no op: {payload[:64]!r}")
        return message

    def recv(self) -> dict:
        """Blocking read of one message; raises ChannelClosed on EOF."""
        while True:
            message = self._pop_message()
            if message is not None:
                return message
            self._fill_blocking()

    def _fill_blocking(self) -> None:
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from e
        if not chunk:
            if self._buf:   # a peer killed mid-send, or one that sent a partial frame: closed either way
                raise ChannelClosed(f"peer closed the control channel in the middle of a frame ({len(self._buf)} "
                                    f"bytes of it received)")
            raise ChannelClosed("peer closed the control channel")
        self._buf += chunk

    def recv_ready(self) -> list[dict]:
        """Read what is available now (call after select() said readable) and return complete messages.

        Raises ChannelClosed on EOF, after returning nothing: messages that arrived before the EOF are
        returned by earlier calls, so call again until it raises.
        """
        self._fill_blocking()
        out = []
        while (message := self._pop_message()) is not None:
            out.append(message)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
