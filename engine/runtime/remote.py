"""Ranks on other machines: rendezvous, admission and control relay over torch.distributed's own TCPStore.

The client's engine listens on the HOST:PORT the user names: it binds that one address itself and hands the socket to
the TCPStore server (master_listen_fd), so the store listens nowhere else. A worker (`python -m engine worker`, see
worker.py) joins as node N: it proves it knows the shared secret by an HMAC challenge-response through store keys,
and the client proves it back. Both then derive a session key; every control message after that is JSON sealed with
an HMAC of its key name, so a message injected or replayed under another key is refused.

Control of a remote rank: the client still sees one Channel per rank. For a remote rank it is one end of a local
socketpair; two relay threads carry its messages through store keys ("down": client to rank, "up": rank to client,
one key per message, numbered), each polling with check() and a deadline. The worker relays the same keys to its ranks' own
socketpairs. A rank the worker reports dead, or a worker whose heartbeat stops, closes the socketpair: the client
sees the rank die, as it would a local one. Nothing here unpickles anything: store values are sealed JSON (storelink.py).

Key layout (store root): xdit/node{N}/attempts (counter), xdit/node{N}/a{i}/{hello,challenge,response,verdict};
after admission xdit/s{N}.{i}/{alive,cmd/{j},g{gen}/r{rank}/{down,up}/{j}}; the process group of generation g
lives under xdit/pg{g}/ (a PrefixStore).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import socket
import subprocess
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import EngineError
from .protocol import Channel, ChannelClosed
from .storelink import (CONNECT_TIMEOUT_S, AuthError, Pipe, connect, handshake_context, interface_of, mac,
                        parse_hostport, read_json, session_key, wait_get)

log = logging.getLogger("xdit.engine")

# ---- the client's side ---------------------------------------------------------------------------------------------
def rank_span(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


class RemoteRank:
    """What the client holds for a rank on another machine, in place of its subprocess.Popen: poll, kill, wait, pid
    (the rank's own, on its machine, once it said ready) and `reason` (how it ended, for error messages)."""

    def __init__(self, session: "Session", rank: int, generation: int):
        self.session, self.rank, self.generation = session, rank, generation
        self.pid: int | None = None
        self.returncode: int | None = None
        self.reason: str | None = None
        self.log_tail = ""            # the last lines of its log, as its worker sent them when it ended
        self._ended = threading.Event()
        parent, self._relay_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.chan = Channel(parent)
        self._relay = Channel(self._relay_sock)

    def start(self, host: str, port: int) -> None:
        base = f"{self.session.prefix}/g{self.generation}/r{self.rank}"
        threading.Thread(target=self._down, args=(Pipe(connect(host, port), base + "/down", self.session.key),),
                         name=f"xdit-relay-down-{self.rank}", daemon=True).start()
        threading.Thread(target=self._up, args=(Pipe(connect(host, port), base + "/up", self.session.key),),
                         name=f"xdit-relay-up-{self.rank}", daemon=True).start()

    def end(self, returncode: int, reason: str) -> None:
        """Mark the rank gone and close the relay's end: the client reads EOF, as from a dead local rank."""
        if self.returncode is None:
            self.returncode, self.reason = returncode, reason
        self._ended.set()
        try:
            self._relay_sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _down(self, pipe: Pipe) -> None:
        try:
            while True:
                pipe.put(self._relay.recv())
        except (ChannelClosed, OSError, ValueError, dist.DistError) as e:
            if not self._ended.is_set() and not isinstance(e, (ChannelClosed, OSError)):
                self.end(1, f"relay to node {self.session.node} failed: {e}")

    def _up(self, pipe: Pipe) -> None:
        try:
            while not self._ended.is_set():
                m = pipe.get()
                if m is None:
                    continue
                op = m.get("op")
                if op == "exit":  # the worker saw this rank end
                    if m.get("log"):
                        self.log_tail = f"\n--- rank {self.rank} log on node {self.session.node} (last lines) ---\n" \
                                        + str(m["log"]).split("---\n", 1)[-1]
                    self.end(int(m.get("code", 1)), f"{m.get('status', 'ended')} on node {self.session.node}")
                    return
                if op == "ready":
                    self.pid = m.get("pid")
                if op == "done" and m.get("outputs"):  # results return through rank 0's machine only
                    m = {"op": "error", "job_id": m.get("job_id"), "phase": "return",
                         "message": f"rank {self.rank} runs on node {self.session.node} and cannot return outputs: "
                                    f"results return through the bridge on the client's machine (rank 0's); "
                                    f"return them from a local rank"}
                self._relay.send(m)
        except (AuthError, ValueError) as e:
            self.end(1, f"refused a message from node {self.session.node}: {e}")
        except (ChannelClosed, OSError, dist.DistError) as e:
            self.end(1, f"relay from node {self.session.node} failed: {e}")

    # Popen's interface, as the client uses it
    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.session.stop(self.generation)
            self.end(-9, f"stopped by the engine on node {self.session.node}")


class Session:
    """One admitted worker: its key, command queue to it, heartbeat, and the ranks of the current generation."""

    def __init__(self, node: int, attempt: int, key: bytes, store):
        self.node, self.key = node, key
        self.prefix = f"xdit/s{node}.{attempt}"
        self._cmd = Pipe(store, self.prefix + "/cmd", key)
        self._cmd_lock = threading.Lock()
        self._stopped: set[int] = set()
        self.ranks: list[RemoteRank] = []
        self.alive_value = -1
        self.alive_at = time.monotonic()
        self.lost: str | None = None

    def command(self, message: dict) -> None:
        with self._cmd_lock:
            try:
                self._cmd.put(message)
            except dist.DistError:
                pass  # the store is going away: the worker sees that by itself

    def pending(self) -> bool:
        """Whether the worker has yet to read the last command."""
        with self._cmd_lock:
            try:
                return self._cmd.n > 0 and self._cmd.store.check([f"{self._cmd.prefix}/{self._cmd.n - 1}"])
            except dist.DistError:
                return False

    def stop(self, generation: int) -> None:
        if generation not in self._stopped:
            self._stopped.add(generation)
            self.command({"op": "stop", "generation": generation})

    def lose(self, reason: str) -> None:
        self.lost = reason
        for r in self.ranks:
            r.end(1, reason)


class Node:
    def __init__(self, node: int, ranks: list[int]):
        self.node, self.ranks = node, ranks
        self.session: Session | None = None
        self.attempts_seen = 0


class Cluster:
    """The client's side of a multi-machine engine: the listening store, admission of workers, relays to their ranks.

    listen: "HOST:PORT" (port 0: any free port; see `address`). remote_ranks: ranks per node, node 1 first; their rank
    numbers follow the `local_ranks` of this machine. secret: required unless HOST is a loopback address."""

    def __init__(self, listen: str, remote_ranks: list[int], local_ranks: int, secret: bytes, device: str,
                 heartbeat_s: float, interface: str | None = None):
        host, port = parse_hostport(listen)
        try:
            ip = socket.gethostbyname(host)
        except OSError as e:
            raise ValueError(f"listen={listen!r}: cannot resolve {host!r} ({e}); use this machine's IP address") from None
        if not secret and not ipaddress.ip_address(ip).is_loopback:
            raise ValueError(f"listen={listen!r} is not a loopback address and no shared secret is set: set "
                             f"XDIT_SECRET (or pass secret=) on this machine and on every worker")
        if interface is None:
            interface = "lo" if ipaddress.ip_address(ip).is_loopback else interface_of(ip)
            if interface is None:
                raise ValueError(f"listen={listen!r}: {ip} is not an address of this machine; use one of its own "
                                 f"addresses, or name the interface with interface=")
        self.host, self.interface, self.secret, self.device = ip, interface, secret, device
        # a silent worker is declared lost before its busy ranks' own heartbeat deadline would name them "silent":
        # the error then says which node went away
        self.node_silence_s = heartbeat_s * 2 / 3
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port))   # this address only: the store gets a socket that listens nowhere else
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise ValueError(f"listen={listen!r}: cannot listen there ({e.strerror}); use a free port of an address "
                             f"of this machine") from None
        self.port = sock.getsockname()[1]
        self.server = dist.TCPStore(ip, self.port, None, True, timedelta(seconds=CONNECT_TIMEOUT_S),
                                    wait_for_workers=False, master_listen_fd=sock.detach())
        first = local_ranks
        self.nodes: list[Node] = []
        for k, n in enumerate(remote_ranks, start=1):
            self.nodes.append(Node(k, list(range(first, first + n))))
            first += n
        self.world = first
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._watcher = threading.Thread(target=self._watch, args=(connect(ip, self.port),), name="xdit-admission",
                                         daemon=True)
        self._watcher.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def node_of(self, rank: int) -> Node | None:
        return next((n for n in self.nodes if rank in n.ranks), None)

    def rank_env(self) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface}

    def store_info(self, generation: int) -> dict:
        return {"host": self.host, "port": self.port, "prefix": f"xdit/pg{generation}/"}

    # ---- admission and heartbeats (one thread; each handshake on its own) -------------------------------------
    def _watch(self, store) -> None:
        try:
            while not self._stop.wait(0.1):
                for node in self.nodes:
                    attempts = store.add(f"xdit/node{node.node}/attempts", 0)
                    while node.attempts_seen < attempts:
                        node.attempts_seen += 1
                        t = threading.Thread(target=self._admit, args=(node, node.attempts_seen),
                                             name=f"xdit-admit-{node.node}", daemon=True)
                        self._threads.append(t)
                        t.start()
                    s = node.session
                    if s is not None and s.lost is None:
                        value = store.add(f"{s.prefix}/alive", 0)
                        now = time.monotonic()
                        if value != s.alive_value:
                            s.alive_value, s.alive_at = value, now
                        elif now - s.alive_at > self.node_silence_s:
                            reason = (f"node {node.node}'s worker stopped answering (no heartbeat for "
                                      f"{self.node_silence_s:.3g} s, 2/3 of deadline heartbeat_s)")
                            log.warning("%s; waiting for it to join again", reason)
                            s.command({"op": "bye", "reason": reason})
                            with self._lock:
                                s.lose(reason)
                                node.session = None
        except dist.DistError:
            if not self._stop.is_set():
                log.error("the engine's rendezvous store at %s failed; remote ranks are lost", self.address)
                for node in self.nodes:
                    if node.session:
                        node.session.lose("the rendezvous store failed")

    def _admit(self, node: Node, attempt: int) -> None:
        base = f"xdit/node{node.node}/a{attempt}"
        store = None
        try:
            store = connect(self.host, self.port)
            raw = wait_get(store, base + "/hello", CONNECT_TIMEOUT_S)
            if raw is None:
                log.warning("worker attempt %d for node %d said nothing; ignored", attempt, node.node)
                return
            hello = read_json(raw, {"nonce": str, "ranks": int, "device": str, "host": str})
            nonce_c = secrets.token_hex(16)
            store.set(base + "/challenge", json.dumps({"nonce": nonce_c}).encode())
            raw = wait_get(store, base + "/response", CONNECT_TIMEOUT_S)
            if raw is None:
                log.warning("worker attempt %d for node %d did not answer the challenge; ignored", attempt, node.node)
                return
            proof = read_json(raw, {"mac": str})["mac"]
            context = handshake_context(node.node, attempt, hello["nonce"], nonce_c)
            refusal = None
            if not hmac.compare_digest(proof, mac(self.secret, "worker", *context)):
                refusal = "wrong secret"
            elif hello["ranks"] != len(node.ranks):
                refusal = (f"node {node.node} runs {len(node.ranks)} rank(s) ({rank_span(node.ranks)}), the worker "
                           f"offers {hello['ranks']}: start it with --ranks {len(node.ranks)}")
            elif hello["device"] != self.device:
                refusal = f"the engine runs on {self.device}, the worker offers {hello['device']!r}: use --device " \
                          f"{self.device}"
            if refusal:
                log.warning("refused worker for node %d (attempt %d, says host %r): %s", node.node, attempt,
                            hello["host"][:64], refusal)
                store.set(base + "/verdict", json.dumps({"ok": False, "reason": refusal}).encode())
                return
            key = session_key(self.secret, context)
            store.set(base + "/verdict", json.dumps({"ok": True, "mac": mac(self.secret, "client", *context),
                                                     "session": f"s{node.node}.{attempt}"}).encode())
            session = Session(node.node, attempt, key, connect(self.host, self.port))
            with self._lock:
                old, node.session = node.session, session
            if old is not None:
                old.command({"op": "bye", "reason": "replaced by a new worker for the same node"})
                old.lose(f"node {node.node}'s worker was replaced by a new one")
            log.info("node %d joined from %r (%s)", node.node, hello["host"][:64], rank_span(node.ranks))
        except AuthError as e:
            log.warning("refused worker for node %d (attempt %d): %s", node.node, attempt, e)
        except dist.DistError as e:
            if not self._stop.is_set():
                log.warning("worker attempt %d for node %d failed: %s", attempt, node.node, str(e).splitlines()[0])

    # ---- generations -----------------------------------------------------------------------------------------
    def begin(self, generation: int, start_s: float) -> None:
        """Wait (up to start_s) until every node has an admitted worker, then ask each to start its ranks."""
        deadline = time.monotonic() + start_s
        for node in self.nodes:
            while node.session is None:
                if time.monotonic() > deadline:
                    raise EngineError(f"node {node.node} ({rank_span(node.ranks)}) did not join within {start_s:.0f} s "
                                      f"(deadline start_s); start it with: python -m engine worker --join "
                                      f"{self.address} --node-rank {node.node} --ranks {len(node.ranks)}",
                                      rank=node.ranks[0], phase="start")
                time.sleep(0.05)
        for node in self.nodes:
            node.session.ranks = []
            node.session.command({"op": "spawn", "generation": generation, "ranks": node.ranks, "world": self.world})

    def spawn(self, rank: int, generation: int) -> tuple[RemoteRank, Channel]:
        """The client's handle and channel for remote rank `rank` of `generation` (after begin)."""
        session = self.node_of(rank).session
        if session is None:
            raise EngineError(f"rank {rank}: its node's worker left during start-up", rank=rank, phase="start")
        r = RemoteRank(session, rank, generation)
        session.ranks.append(r)
        r.start(self.host, self.port)
        if session.lost:
            r.end(1, session.lost)
        return r, r.chan

    def close(self) -> None:
        """Let every worker go (each reads its goodbye before the store closes, up to 2 s), then stop listening."""
        sessions = [n.session for n in self.nodes if n.session is not None]
        for s in sessions:
            s.command({"op": "bye", "reason": "the engine closed"})
            s.lose("the engine closed")
        deadline = time.monotonic() + 2.0
        for s in sessions:
            while time.monotonic() < deadline and s.pending():
                time.sleep(0.02)
        self._stop.set()
        self._watcher.join(timeout=2)
        for t in self._threads:
            t.join(timeout=1)
        for node in self.nodes:
            node.session = None
        self.server = None
