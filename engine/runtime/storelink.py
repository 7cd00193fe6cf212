"""Sealed messages through torch.distributed's TCPStore, the only channel between a client's engine and its workers on
other machines: the shared-secret handshake's pieces (HMACs, the session key), JSON sealed with an HMAC of its key
name, polling reads with deadlines, and a numbered one-way pipe of messages. Also the address helpers both sides use."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

CONNECT_TIMEOUT_S = 10.0   # one store connection, and each handshake step
POLL_S = 0.25              # how long one relay wait lasts before it looks at its stop flag
WORKER_HEARTBEAT_S = 0.2   # how often a worker bumps its alive counter
MIN_POLL_S, MAX_POLL_S = 0.001, 0.05  # a waiting reader checks its next key this often (backing off when idle)


class AuthError(Exception):
    """A sealed message or a handshake proof did not verify."""


# ---- addresses and secrets -------------------------------------------------------------------------------------
def parse_hostport(text: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv4 address or name, port 0..65535) -> (host, port); ValueError naming what works."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is invalid: use HOST:PORT, e.g. 192.168.1.10:29600")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def secret_from(value: str | bytes | None) -> bytes:
    """The shared secret: `value`, else $XDIT_SECRET; b"" when there is none."""
    if value is None:
        value = os.environ.get("XDIT_SECRET", "")
    return value.encode() if isinstance(value, str) else bytes(value)


def interface_of(ip: str) -> str | None:
    """The network interface holding the local address `ip` (Linux), or None."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
        except OSError:
            continue
        finally:
            s.close()
    return None


def interface_towards(host: str) -> str | None:
    """The interface this machine would use to reach `host` (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((socket.gethostbyname(host), 9))
        return interface_of(s.getsockname()[0])
    except OSError:
        return None
    finally:
        s.close()


# ---- sealed JSON over store keys ---------------------------------------------------------------------------------
def mac(key: bytes, *parts) -> str:
    return hmac.new(key, "\n".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def seal(session_key: bytes, name: str, message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":"))
    return json.dumps({"m": body, "t": mac(session_key, name, body)}).encode()


def unseal(session_key: bytes, name: str, raw: bytes) -> dict:
    try:
        outer = json.loads(raw)
        body, tag = outer["m"], outer["t"]
    except (ValueError, KeyError, TypeError):
        raise AuthError(f"malformed message under {name}") from None
    if not (isinstance(body, str) and isinstance(tag, str) and hmac.compare_digest(tag, mac(session_key, name, body))):
        raise AuthError(f"message under {name} failed authentication")
    return json.loads(body)


def read_json(raw: bytes, fields: dict) -> dict:
    """An unauthenticated handshake value: a JSON object whose `fields` have the given types, else AuthError."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise AuthError("malformed handshake message") from None
    if not isinstance(doc, dict) or any(not isinstance(doc.get(k), t) for k, t in fields.items()):
        raise AuthError("malformed handshake message")
    return doc


def handshake_context(node: int, attempt: int, nonce_w: str, nonce_c: str) -> tuple:
    return ("xdit-join-v1", node, attempt, nonce_w, nonce_c)


def session_key(secret: bytes, context: tuple) -> bytes:
    return bytes.fromhex(mac(secret, "session", *context))


def connect(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dist.TCPStore:
    """One client connection to the store (each thread has its own: a blocking wait holds its connection)."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def wait_get(store, key: str, timeout_s: float, pipe: "Pipe | None" = None) -> bytes | None:
    """The value under `key` once it is set (then deleted), or None after `timeout_s`. Polls with check() (a store's
    own wait() logs a C++ warning at every timeout), 1 ms apart after traffic, backing off to MAX_POLL_S when idle."""
    deadline = time.monotonic() + timeout_s
    delay = pipe.delay if pipe is not None else MIN_POLL_S
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            if pipe is not None:
                pipe.delay = delay
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 2, MAX_POLL_S)
    if pipe is not None:
        pipe.delay = MIN_POLL_S
    value = store.get(key)
    store.delete_key(key)
    return value


class Pipe:
    """One direction of sealed JSON messages under numbered keys `prefix/0`, `prefix/1`, ...; one user thread."""

    def __init__(self, store, prefix: str, key: bytes):
        self.store, self.prefix, self.key, self.n = store, prefix, key, 0
        self.delay = MIN_POLL_S

    def put(self, message: dict) -> None:
        name = f"{self.prefix}/{self.n}"
        self.store.set(name, seal(self.key, name, message))
        self.n += 1

    def get(self, timeout_s: float = POLL_S) -> dict | None:
        name = f"{self.prefix}/{self.n}"
        raw = wait_get(self.store, name, timeout_s, self)
        if raw is None:
            return None
        self.n += 1
        return unseal(self.key, name, raw)


# ---- the client's side ---------------------------------------------------------------------------------------------
