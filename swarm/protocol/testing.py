"""In-memory wiring for protocol tests and benchmarks: many ``NodeCore``s, one virtual clock.

The third driver of the core (beside ``node.driver`` and ``simulations``), and
a deliberately simple one (the real simulator lives in ``simulations/``):
frames arrive ``latency`` later, FIFO per direction; a chunk takes
``size / rate`` seconds to leave its sender (every upload at full rate, no
sharing) and arrives ``latency`` after that. Chunk verdicts come from a
per-node ``corrupt`` predicate, so tests can make a node lie. Manifests are
real Ed25519-signed ones from ``swarm.trust``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.protocol import events as ev
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.trust.keys import TrustStore, key_id
from swarm.trust.manifest import Manifest, sign_manifest, verify_manifest

MODEL = "test/model"
SECRET = b"test-secret"


class Signer:
    """A trainer key and the manifests it signs (chunk hashes stand in for payloads)."""

    def __init__(self, seed: int = 1) -> None:
        self.key = Ed25519PrivateKey.from_private_bytes(random.Random(seed).randbytes(32))
        self.kid = key_id(self.key)
        self.trust = TrustStore([self.key.public_key()])

    def verify(self, raw: bytes) -> Manifest:
        return verify_manifest(raw, self.trust)

    @staticmethod
    def digest(version: int) -> bytes:
        """The target digest ``manifest`` gives version ``version`` (unless told another)."""
        return random.Random(f"digest {version}").randbytes(32)

    def manifest(self, version: int, chunks: int, *, kind: str = "patch", chunk_size: int = 1000,
                 key: Ed25519PrivateKey | None = None, model: str = MODEL,
                 target_digest: bytes | None = None, last_chunk: int | None = None) -> bytes:
        """A signed manifest; a patch's parent is ``version - 1`` with that version's
        digest; an anchor of version v's weights is ``kind="full",
        target_digest=Signer.digest(v)``. ``last_chunk``: the last chunk's length (default
        a full chunk)."""
        r = random.Random(version)
        parent = version - 1 if kind == "patch" else None
        m = Manifest(
            model=model, version=version, kind=kind, parent_version=parent,
            parent_digest=self.digest(parent) if parent else None,
            target_digest=target_digest or self.digest(version),
            payload_length=(chunks - 1) * chunk_size + (chunk_size if last_chunk is None
                                                        else last_chunk),
            chunk_size=chunk_size,
            chunk_hashes=tuple(r.randbytes(32) for _ in range(chunks)), created_at=float(version),
            key_id=self.kid if key is None else key_id(key),
        )
        return sign_manifest(m, key or self.key)


@dataclass
class MemHost:
    core: NodeCore
    addr: str
    region: str
    alive: bool = True
    conns: dict[int, tuple[MemHost, int]] = field(default_factory=dict)  # my conn -> (peer host, its conn)
    applied: list[int] = field(default_factory=list)
    corrupt: Callable[[int, int], bool] = lambda v, i: False  # chunks this host sends corrupt
    tick_at: float = float("inf")
    apply_ok: bool = True
    # chunks on their way out (conn, version, index) -> the SendChunk; stopped ones
    sending: dict[tuple[int, int, int], ev.SendChunk] = field(default_factory=dict)
    stopped: list[ev.SendChunk] = field(default_factory=list)


class Net:
    """MemHosts by address, an event heap and a virtual clock."""

    def __init__(self, signer: Signer, *, latency: float = 0.005, rate: float = 1e6, seed: int = 0) -> None:
        self.signer = signer
        self.latency = latency
        self.rate = rate
        self.now = 0.0
        self.rng = random.Random(seed)
        self.hosts: dict[str, MemHost] = {}
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cid = itertools.count(1)
        self.events = 0
        self.logs: list[tuple[str, ev.Log]] = []
        self.sent_chunks: list[tuple[str, str, int, int]] = []  # (from id, to id, v, i)

    # ---- building
    def add(self, node_id: str, region: str, *, role: str = "node", bootstrap: tuple[str, ...] = (),
            secret: bytes = SECRET, **knobs: Any) -> MemHost:
        addr = f"{node_id}:1"
        cfg = CoreConfig(node_id=node_id, region=region, model=MODEL, listen_addr=addr, role=role,
                         bootstrap=bootstrap, swarm_secret=secret, **knobs)
        core = NodeCore(cfg, verify_manifest=self.signer.verify, rng=random.Random(f"{node_id}"),
                        now=self.now)
        core.raise_internal_errors = True
        h = MemHost(core, addr, region)
        self.hosts[addr] = h
        return h

    def start(self, h: MemHost) -> None:
        h.alive = True
        self._run(h, h.core.start(self.now))

    def host(self, node_id: str) -> MemHost:
        return self.hosts[f"{node_id}:1"]

    # ---- scheduling
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def deliver(self, h: MemHost, event: ev.Event) -> None:
        if h.alive:
            self._run(h, h.core.handle(event))

    def _run(self, h: MemHost, actions: list[ev.Action]) -> None:
        for a in actions:
            self._do(h, a)
        w = h.core.next_wakeup()
        if w is not None and w < h.tick_at:
            h.tick_at = max(w, self.now)
            t = h.tick_at

            def fire(h: MemHost = h, t: float = t) -> None:
                if h.tick_at == t:
                    h.tick_at = float("inf")
                    self.deliver(h, ev.Tick(self.now))

            self.at(t, fire)

    def _do(self, h: MemHost, a: ev.Action) -> None:
        now, lat = self.now, self.latency
        if isinstance(a, ev.Log):
            self.logs.append((h.core.cfg.node_id, a))
        elif isinstance(a, ev.SendFrame):
            link = h.conns.get(a.conn)
            if link is not None:
                peer, pc = link
                self.at(now + lat, lambda: peer.conns.get(pc) and self.deliver(peer, ev.FrameReceived(self.now, pc, a.frame)))
        elif isinstance(a, ev.SendChunk):
            link = h.conns.get(a.conn)
            if link is None:
                return
            peer, pc = link
            done = now + a.size / self.rate
            self.sent_chunks.append((h.core.cfg.node_id, peer.core.cfg.node_id, a.version, a.index))
            h.sending[(a.conn, a.version, a.index)] = a
            # the receiver hears of the first block one latency on (cut-through relays)
            self.at(now + lat, lambda: peer.conns.get(pc) and self.deliver(
                peer, ev.ChunkArriving(self.now, pc, a.version, a.index)))
            self.at(done, lambda: self._chunk_left(h, a, peer, pc))
        elif isinstance(a, ev.StopChunk):
            # stopped at once: the sender hears ChunkSent(withdrawn), the receiver the
            # withdrawal one latency on; the chunk's own end is then ignored
            sent = h.sending.pop((a.conn, a.version, a.index), None)
            link = h.conns.get(a.conn)
            if sent is None or link is None:
                return
            h.stopped.append(sent)
            peer, pc = link
            self.at(now, lambda: self.deliver(
                h, ev.ChunkSent(self.now, a.conn, a.version, a.index, withdrawn=True)))
            self.at(now + lat, lambda: peer.conns.get(pc) and self.deliver(
                peer, ev.ChunkWithdrawn(self.now, pc, a.version, a.index)))
        elif isinstance(a, ev.Connect):
            target = self.hosts.get(a.addr)
            if target is None or not target.alive:
                self.at(now + 2 * lat, lambda: self.deliver(h, ev.ConnectFailed(self.now, a.addr, "refused")))
                return
            c1, c2 = next(self._cid), next(self._cid)
            h.conns[c1] = (target, c2)
            target.conns[c2] = (h, c1)
            # both ends learn of the connection before any frame can arrive on it
            self.at(now + lat, lambda: self.deliver(h, ev.PeerConnected(self.now, c1, True, a.addr)))
            self.at(now + lat, lambda: self.deliver(target, ev.PeerConnected(self.now, c2, False, h.addr)))
        elif isinstance(a, ev.Close):
            link = h.conns.pop(a.conn, None)
            if link is not None:
                peer, pc = link

                def gone() -> None:
                    if peer.conns.pop(pc, None) is not None:
                        self.deliver(peer, ev.PeerDisconnected(self.now, pc, "closed by peer"))

                self.at(now + lat, gone)
        elif isinstance(a, ev.ApplyVersion):
            ok = h.apply_ok
            self.at(now + 0.01, lambda: (h.applied.append(a.version) if ok else None,
                                         self.deliver(h, ev.Applied(self.now, a.version, ok)))[-1])

    def _chunk_left(self, h: MemHost, a: ev.SendChunk, peer: MemHost, pc: int) -> None:
        """``a``'s bytes are out; a chunk sent while it arrived (``a.arriving``) goes out
        whole once ``h`` holds it, and is withdrawn if it stopped arriving without that."""
        if any(s is a for s in h.stopped):
            h.stopped.remove(a)
            return
        if h.sending.get((a.conn, a.version, a.index)) is a:
            del h.sending[(a.conn, a.version, a.index)]
        if not h.alive or a.conn not in h.conns:
            return
        v, i = a.version, a.index
        if a.arriving and i not in h.core.have(v):
            if h.core.is_arriving(v, i):
                h.sending[(a.conn, v, i)] = a  # still on its way out
                self.at(self.now + 0.01, lambda: self._chunk_left(h, a, peer, pc))
            else:
                self.deliver(h, ev.ChunkSent(self.now, a.conn, v, i, withdrawn=True))
                self.at(self.now + self.latency, lambda: peer.conns.get(pc) and self.deliver(
                    peer, ev.ChunkWithdrawn(self.now, pc, v, i)))
            return
        bad = h.corrupt(v, i)
        self.deliver(h, ev.ChunkSent(self.now, a.conn, v, i))
        self.at(self.now + self.latency, lambda: peer.conns.get(pc) and self.deliver(
            peer, ev.ChunkReceived(self.now, pc, v, i, not bad)))

    def kill(self, h: MemHost) -> None:
        """The host vanishes: its peers see their connections drop."""
        h.alive = False
        for _c, (peer, pc) in list(h.conns.items()):
            if peer.conns.pop(pc, None) is not None:
                self.at(self.now + self.latency,
                        lambda peer=peer, pc=pc: self.deliver(peer, ev.PeerDisconnected(self.now, pc, "reset")))
        h.conns.clear()

    def run(self, until: float, stop: Callable[[], bool] | None = None, max_events: int = 5_000_000) -> None:
        while self._heap and self.events < max_events:
            t, _s, fn = self._heap[0]
            if t > until:
                break
            heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn()
            if stop is not None and self.events % 64 == 0 and stop():
                return
        self.now = max(self.now, min(until, self.now if self._heap else until))

    def nodes(self) -> list[MemHost]:
        return [h for h in self.hosts.values() if h.core.cfg.role == "node"]


def region_of(node_id: str, net: Net) -> str:
    return net.host(node_id).region


class Script:
    """One connection to one core, driven by hand (as wsproto's connection tests do).

    The test plays the peer: ``handshake`` sends its HELLO and AUTH, ``send``
    feeds one typed frame; both return the frames the core sent back on this
    connection, decoded. ``actions`` keeps every action of the last call.
    """

    def __init__(self, core: NodeCore, conn: int, *, node_id: str, region: str, role: str = "node",
                 secret: bytes = SECRET, outbound: bool = False) -> None:
        self.core = core
        self.conn = conn
        self.node_id, self.region, self.role = node_id, region, role
        self.secret = secret
        self.outbound = outbound
        self.actions: list[ev.Action] = []
        self._core_hello = b""

    @property
    def now(self) -> float:
        return self.core.now

    def _feed(self, event: ev.Event) -> list[wire.Frame]:
        self.actions = self.core.handle(event)
        return self.frames(self.actions)

    def frames(self, actions: list[ev.Action]) -> list[wire.Frame]:
        return [wire.decode(a.frame) for a in actions
                if isinstance(a, ev.SendFrame) and a.conn == self.conn]

    def closed(self, actions: list[ev.Action] | None = None) -> bool:
        """Whether the core closed this connection (in ``actions``, default the last call's)."""
        acts = self.actions if actions is None else actions
        return any(isinstance(a, ev.Close) and a.conn == self.conn for a in acts)

    def handshake(self, proto: int = wire.PROTOCOL_VERSION) -> list[wire.Frame]:
        """Connect, trade HELLO (ours naming protocol version ``proto``) and AUTH; the
        frames the core sent once the link is ready."""
        self.actions = self.core.handle(
            ev.PeerConnected(self.now, self.conn, self.outbound, f"{self.node_id}:1"))
        hello = next(a.frame for a in self.actions if isinstance(a, ev.SendFrame))
        self._core_hello = hello
        mine = hs.hello_frame(model=MODEL, node_id=self.node_id, region=self.region,
                              addr=f"{self.node_id}:1", role=self.role, nonce=bytes(wire.NONCE_LEN),
                              proto=proto)
        got = self._feed(ev.FrameReceived(self.now, self.conn, mine))
        assert [type(f) for f in got] == [wire.Auth], got
        mac = hs.mac(self.secret, mine, hello)
        return self._feed(ev.FrameReceived(self.now, self.conn, wire.Auth(mac).encode()))

    def send(self, frame: wire.Frame | bytes, *, now: float | None = None) -> list[wire.Frame]:
        raw = frame if isinstance(frame, bytes) else frame.encode()
        t = self.now if now is None else now
        return self._feed(ev.FrameReceived(t, self.conn, raw))
