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
            raise ConnectionError(f"control frame of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        if len(self._buf) < _HEADER.size + size:
            return None
        payload = bytes(self._buf[_HEADER.size:_HEADER.size + size])
        del self._buf[:_HEADER.size + size]
        return json.loads(payload)

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
