"""A worker: the ranks of one node on another machine, joined to a client's engine through its TCPStore (remote.py).

`python -m engine worker --join HOST:PORT --node-rank 1 --ranks 2` connects, proves the shared secret, and then
follows the client's commands: start this generation's ranks (spawn_rank, as the client does locally, each with its
inherited socketpair) and relay their control messages through the store; stop them; leave. The worker exits when
the engine says goodbye (0), when it loses the engine (1: the store connection failed or the client stopped
hearing it; its ranks are killed first), or when it is refused (2). It does not rejoin by itself: run it under a
loop or a service manager to keep a node available.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import threading
import time

import torch.distributed as dist

from . import bridge
from .launch import kill_all, log_tail, rank_env, signal_name, spawn_rank
from .protocol import ChannelClosed
from .storelink import (CONNECT_TIMEOUT_S, WORKER_HEARTBEAT_S, AuthError, Pipe, connect, handshake_context, mac,
                        read_json, session_key, wait_get)


class Refused(Exception):
    """The engine refused this worker (exit 2)."""


class Lost(Exception):
    """The worker lost its engine (exit 1)."""


class Worker:
    def __init__(self, host: str, port: int, node: int, ranks: int, *, device: str = "cpu",
                 gpus: list[int] | None = None, interface: str = "lo", secret: bytes = b"",
                 join_timeout_s: float = 60.0, say=print):
        self.host, self.port, self.node, self.nranks = host, port, node, ranks
        self.device, self.gpus, self.interface, self.secret = device, gpus, interface, secret
        self.join_timeout_s, self.say = join_timeout_s, say
        self.where = f"{host}:{port}"
        self.key = b""
        self.prefix = ""
        self.generation: dict | None = None   # {"g", "procs", "chans", "dir", "stop"}
        self.lost: str | None = None
        self.closing = threading.Event()
        self.threads: list[threading.Thread] = []

    # ---- joining -----------------------------------------------------------------------------------------------
    def join(self):
        deadline = time.monotonic() + self.join_timeout_s
        store = None
        while store is None:
            try:
                store = connect(self.host, self.port, timeout_s=min(CONNECT_TIMEOUT_S, self.join_timeout_s))
            except dist.DistError:
                if time.monotonic() > deadline:
                    raise Lost(f"no engine answered at {self.where} within {self.join_timeout_s:g} s") from None
                time.sleep(1.0)
        attempt = store.add(f"xdit/node{self.node}/attempts", 1)
        base = f"xdit/node{self.node}/a{attempt}"
        nonce_w = secrets.token_hex(16)
        store.set(base + "/hello", json.dumps({"nonce": nonce_w, "ranks": self.nranks, "device": self.device,
                                                "host": socket.gethostname()}).encode())
        left = max(1.0, deadline - time.monotonic())
        raw = wait_get(store, base + "/challenge", left)
        if raw is None:
            raise Lost(f"the engine at {self.where} did not answer within {left:.0f} s; is it expecting node "
                       f"{self.node}?")
        nonce_c = read_json(raw, {"nonce": str})["nonce"]
        context = handshake_context(self.node, attempt, nonce_w, nonce_c)
        store.set(base + "/response", json.dumps({"mac": mac(self.secret, "worker", *context)}).encode())
        raw = wait_get(store, base + "/verdict", CONNECT_TIMEOUT_S)
        if raw is None:
            raise Lost(f"the engine at {self.where} gave no verdict within {CONNECT_TIMEOUT_S:g} s")
        verdict = read_json(raw, {"ok": bool})
        if not verdict["ok"]:
            raise Refused(f"refused by {self.where}: {verdict.get('reason', 'no reason given')}")
        if not isinstance(verdict.get("mac"), str) or not hmac.compare_digest(
                verdict["mac"], mac(self.secret, "client", *context)):
            raise Refused(f"refused {self.where}: it did not prove the shared secret (is it the engine you meant?)")
        self.key = session_key(self.secret, context)
        self.prefix = f"xdit/{verdict['session']}"
        return store

    # ---- serving -----------------------------------------------------------------------------------------------
    def serve(self) -> int:
        store = self.join()
        self.say(f"joined {self.where} as node {self.node} ({self.nranks} rank(s), {self.device}, interface "
                 f"{self.interface})")
        self._thread(self._heartbeat, connect(self.host, self.port))
        commands = Pipe(store, self.prefix + "/cmd", self.key)
        try:
            while True:
                if self.lost:
                    raise Lost(self.lost)
                try:
                    cmd = commands.get()
                except dist.DistError as e:
                    raise Lost(f"lost the engine at {self.where}: {str(e).splitlines()[0]}") from None
                except AuthError as e:
                    raise Lost(f"refused a command from {self.where}: {e}") from None
                if cmd is None:
                    continue
                op = cmd.get("op")
                if op == "spawn":
                    self._stop_generation()
                    self._spawn(cmd)
                elif op == "stop" and self.generation and self.generation["g"] == cmd.get("generation"):
                    self._stop_generation()
                elif op == "bye":
                    self.say(f"the engine at {self.where} let this node go: {cmd.get('reason', '')}")
                    return 0
        finally:
            self._stop_generation()
            self.closing.set()
            for t in self.threads:  # none may still be inside a store call when the interpreter exits
                t.join(timeout=2)

    def _thread(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self.threads = [t for t in self.threads if t.is_alive()] + [t]
        t.start()

    def _heartbeat(self, store) -> None:
        try:
            while not self.closing.is_set():
                store.add(f"{self.prefix}/alive", 1)
                self.closing.wait(WORKER_HEARTBEAT_S)
        except dist.DistError as e:
            self.lost = f"lost the engine at {self.where}: {str(e).splitlines()[0]}"

    def _spawn(self, cmd: dict) -> None:
        g, ranks = int(cmd["generation"]), [int(r) for r in cmd["ranks"]]
        env = rank_env(self.gpus if self.device == "cuda" else None)
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.interface
        gen = {"g": g, "procs": [], "chans": [], "dir": bridge.make_engine_dir(), "stop": threading.Event()}
        self.generation = gen
        pgid = 0
        for local, rank in enumerate(ranks):
            proc, chan = spawn_rank(env, pgid, os.path.join(gen["dir"], f"rank{rank}.log"))
            pgid = pgid or proc.pid
            gen["procs"].append(proc)
            gen["chans"].append(chan)
            base = f"{self.prefix}/g{g}/r{rank}"
            down = Pipe(connect(self.host, self.port), base + "/down", self.key)
            up = Pipe(connect(self.host, self.port), base + "/up", self.key)
            self._thread(self._down, gen, rank, local, chan, down)
            self._thread(self._up, gen, rank, proc, chan, up)
        self.say(f"generation {g}: started ranks {ranks[0]}-{ranks[-1]} (pids {[p.pid for p in gen['procs']]})")

    def _stop_generation(self) -> None:
        gen, self.generation = self.generation, None
        if gen is not None:
            gen["stop"].set()
            kill_all(gen["procs"], gen["chans"], gen["dir"])

    def _down(self, gen: dict, rank: int, local: int, chan, pipe: Pipe) -> None:
        """Client -> rank. The init message gets this machine's facts: engine dir, device index, threads, host."""
        try:
            while not gen["stop"].is_set():
                m = pipe.get()
                if m is None:
                    continue
                if m.get("op") == "init":
                    m.update(engine_dir=gen["dir"], local_device=local,
                             threads=max(1, (os.cpu_count() or 1) // len(gen["procs"])))
                    if m.get("tcp_store"):
                        m["tcp_store"]["host"] = self.host
                chan.send(m)
        except (ChannelClosed, OSError):
            pass  # the rank is gone: _up reports it
        except (AuthError, ValueError, dist.DistError) as e:
            self.lost = f"relay to rank {rank} failed: {e}"

    def _up(self, gen: dict, rank: int, proc, chan, pipe: Pipe) -> None:
        """Rank -> client; when the rank ends, say how (unless this generation was stopped on purpose)."""
        try:
            while True:
                try:
                    m = chan.recv()
                except (ChannelClosed, OSError, ValueError):
                    break
                if m.get("op") == "done" and m.get("outputs"):  # refused by the client; do not leave it in tmpfs
                    bridge.unlink_quietly(m["outputs"]["path"])
                pipe.put(m)
            if not gen["stop"].is_set():
                try:
                    proc.wait(timeout=2)
                except Exception:
                    pass
                status = signal_name(proc.poll())
                tail = log_tail(gen["dir"], rank, lines=8)
                pipe.put({"op": "exit", "code": proc.returncode if proc.returncode is not None else 1,
                          "status": status, "log": tail[-4000:]})
                self.say(f"rank {rank} ended ({status})")
        except dist.DistError as e:
            self.lost = f"lost the engine at {self.where}: {str(e).splitlines()[0]}"
