"""`python -m engine worker`: run ranks of a client's engine on this machine (a second node), joined through the
engine's TCPStore rendezvous with a shared secret (engine/runtime/remote.py, worker.py)."""
from __future__ import annotations

import os
import socket
import stat
import sys
from argparse import ArgumentTypeError

from ..runtime.storelink import interface_towards, parse_hostport
from ..runtime.worker import Lost, Refused, Worker
from . import args as types
from .args import UsageError


def hostport(text: str) -> tuple[str, int]:
    try:
        host, port = parse_hostport(text)
    except ValueError as e:
        raise ArgumentTypeError(str(e)) from None
    if port == 0:
        raise ArgumentTypeError(f"{text!r} is invalid: port 0 names no port; use the port the engine listens on, "
                                f"e.g. {host}:29600")
    return host, port


def node_rank(text: str) -> int:
    value = types.integer(text)
    if value < 1:
        raise ArgumentTypeError(f"{text} is invalid: node 0 is the client's machine; workers are nodes 1, 2, ...")
    return value


def interface(text: str) -> str:
    try:
        socket.if_nametoindex(text)
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise ArgumentTypeError(f"{text!r} is not a network interface of this machine; it has: {names}") from None
    return text


def register(sub) -> None:
    p = sub.add_parser("worker", help="run ranks of an engine on another machine (a second node)",
                       description="Join the engine listening at --join as node --node-rank and run --ranks ranks "
                                   "here. The shared secret comes from $XDIT_SECRET or --secret-file, never the "
                                   "command line. Exits 0 when the engine lets the node go, 1 when it loses the "
                                   "engine, 2 when refused.")
    p.add_argument("--join", type=hostport, required=True, metavar="HOST:PORT",
                   help="the address the client's engine listens on (its listen=)")
    p.add_argument("--node-rank", type=node_rank, required=True, help="this machine's node number, 1, 2, ...")
    p.add_argument("--ranks", type=types.ranks, required=True, help="ranks on this machine, 1 to 8")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="gloo on CPU or NCCL on CUDA")
    p.add_argument("--gpus", type=types.gpu_list, help="CUDA GPU indices, one rank each (default 0..ranks-1)")
    p.add_argument("--interface", type=interface,
                   help="network interface gloo/NCCL use here (default: the one that reaches HOST)")
    p.add_argument("--secret-file", type=types.existing_file, help="file holding the shared secret (mode 600)")
    p.add_argument("--join-timeout", type=types.positive_float, default=60.0,
                   help="seconds to keep trying to reach the engine")
    p.set_defaults(run=run, parser=p)


def read_secret(path: str | None) -> bytes:
    if path is None:
        return os.environ.get("XDIT_SECRET", "").encode()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise UsageError(f"argument --secret-file: {path} is readable by others (mode {mode:o}): chmod 600 {path}")
    with open(path, "rb") as f:
        return f.read().strip()


def run(a) -> int:
    host, port = a.join
    if a.device == "cpu" and a.gpus:
        raise UsageError("argument --gpus: given with --device cpu: drop --gpus or use --device cuda")
    gpus = a.gpus or (list(range(a.ranks)) if a.device == "cuda" else None)
    if gpus is not None and len(gpus) != a.ranks:
        raise UsageError(f"argument --gpus: {','.join(map(str, gpus))} names {len(gpus)} GPUs for {a.ranks} ranks: "
                         f"give {a.ranks}")
    secret = read_secret(a.secret_file)
    iface = a.interface or interface_towards(host)
    if iface is None:
        raise UsageError(f"argument --join: this machine has no route to {host}; name the interface with --interface")

    def say(line: str) -> None:
        print(f"worker node {a.node_rank}: {line}", flush=True)

    worker = Worker(host, port, a.node_rank, a.ranks, device=a.device, gpus=gpus, interface=iface, secret=secret,
                    join_timeout_s=a.join_timeout, say=say)
    try:
        return worker.serve()
    except Refused as e:
        print(str(e), file=sys.stderr, flush=True)
        return 2
    except Lost as e:
        print(f"worker node {a.node_rank}: {e}", file=sys.stderr, flush=True)
        return 1
