"""The contract between the sans-I/O protocol core and its drivers.

The core (``swarm.protocol.core``) is a plain object. A driver feeds it
*events* through ``core.handle(event)`` and carries out the *actions* it
returns, in order. Two drivers exist:

- ``node.driver``: peer links (``node.link``), real timers, the on-disk store;
- ``simulations``: a discrete-event loop with a virtual clock and a modelled
  network (chunk payloads are sizes, not bytes).

Rules that keep both drivers honest:

- The core never reads a clock: every event carries ``now`` (seconds, float,
  monotonic; virtual in the simulator).
- The core never touches chunk *payloads*. It decides who sends which chunk
  to whom; the driver reads the bytes from its store (real) or just their size
  (simulated), hashes what arrives against the manifest and reports the result
  with ``ChunkReceived(valid=...)``. A chunk is never shared before that.
- Control messages are real bytes (``swarm.protocol.wire``) in both drivers,
  so the simulator exercises the same encoder and decoder as the network.
- ``core.next_wakeup()`` tells the driver when to send the next ``Tick``.

Connection ids are opaque ints chosen by the driver, unique per core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------- events (driver -> core)


@dataclass(frozen=True, slots=True)
class Event:
    now: float


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Time has advanced to ``now``; run timers (heartbeats, timeouts, retries)."""


@dataclass(frozen=True, slots=True)
class PeerConnected(Event):
    """A transport to a peer is up. ``outbound`` is True when we dialled it.

    For an outbound connection ``addr`` is what ``Connect`` named; for an
    inbound one it is informational. The core sends its handshake next.
    ``identity`` is ``(node_id, region, role)`` when the transport proved it
    (mutual TLS with the swarm CA): the peer's HELLO must then name exactly
    that identity, or the connection is closed.
    """

    conn: int
    outbound: bool
    addr: str = ""
    identity: tuple[str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class ConnectFailed(Event):
    """A ``Connect`` action could not reach ``addr``."""

    addr: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PeerDisconnected(Event):
    """The transport closed (by the peer, the network, or our own ``Close``)."""

    conn: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FrameReceived(Event):
    """One control frame (msgpack bytes, see ``wire``) arrived on ``conn``."""

    conn: int
    frame: bytes


@dataclass(frozen=True, slots=True)
class ChunkReceived(Event):
    """The payload of a chunk arrived on ``conn`` and the driver checked it.

    ``valid`` is the driver's verdict: length and hash match the manifest and
    the chunk is durably stored. ``valid=False`` means corrupt: the core drops
    it, re-requests it elsewhere and penalises the sender.
    """

    conn: int
    version: int
    index: int
    valid: bool


@dataclass(frozen=True, slots=True)
class ChunkNotStored(Event):
    """A chunk from ``conn`` could not be kept for a *local* reason (disk full,
    quota, too many open files): never the sender's fault. The core forgets the
    request without blame and holds new requests back for a while (exponential
    back-off), so a full disk does not turn into a storm of downloads."""

    conn: int
    version: int
    index: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ChunkSent(Event):
    """The last byte of a ``SendChunk`` left this node (frees an upload slot).

    ``withdrawn``: a chunk sent while it was still arriving (``SendChunk.arriving``)
    did not arrive whole and verified here, so its last block never left and the
    receiver was told to drop what it got (the relay failed; nobody is to blame); or
    an answer was stopped (``StopChunk``) before its last block left.
    """

    conn: int
    version: int
    index: int
    withdrawn: bool = False


@dataclass(frozen=True, slots=True)
class ChunkArriving(Event):
    """The first block of chunk ``index`` of ``version`` arrived on ``conn`` (an
    authenticated peer); the rest is on its way. A RELAY order for it can start
    at once (cut-through), and with ``serve_arriving`` the region's peers may ask
    for it at once. A driver may leave this out for chunks from a peer of our own
    region when neither knob is on: the core then relays them once stored.
    """

    conn: int
    version: int
    index: int


# a driver's ChunkPace comes at the first block this long after the chunk's first: on a
# 100 Mbit/s uplink shared by two pushes, its second 256 KiB block (~45 ms)
PACE_LOOK_S = 0.03


@dataclass(frozen=True, slots=True)
class ChunkPace(Event):
    """The chunk arriving on ``conn`` has been coming for ``PACE_LOOK_S`` or a little
    more: ``got`` bytes of it came after its first block and ``left`` are still to come.
    Sent at most once per arriving chunk, and only while it still arrives (a chunk that
    comes whole within ``PACE_LOOK_S`` has none). The core projects from it when the
    chunk will be whole: a RELAY order waiting ``cut_through_after_s`` for a chunk that
    will take ``2 x`` that or longer goes on at once, with no history of the link needed
    (a version's first chunks over a link; docs/benchmarks.md round 59)."""

    conn: int
    version: int
    index: int
    got: int
    left: int


@dataclass(frozen=True, slots=True)
class ChunkWhole(Event):
    """Every byte of chunk ``index`` of ``version`` arrived on ``conn`` (an authenticated
    peer); it is being hashed and stored, and ``ChunkReceived`` follows. The core cancels
    the chunk's endgame twin requests at once, not a verification later (answers under
    way are stopped where they are; if this copy turns out bad, the chunk is asked for
    again). Optional: a driver that leaves it out cancels them at ``ChunkReceived``."""

    conn: int
    version: int
    index: int


@dataclass(frozen=True, slots=True)
class ChunkWithdrawn(Event):
    """The peer on ``conn`` withdrew chunk ``index`` of ``version`` it was sending us
    while it arrived there: it did not arrive whole and verified at the sender.
    Whatever blocks came are dropped; nobody is to blame; ask someone else."""

    conn: int
    version: int
    index: int


@dataclass(frozen=True, slots=True)
class Publish(Event):
    """Local origin (the trainer) offers a new signed manifest it holds fully."""

    manifest: bytes


@dataclass(frozen=True, slots=True)
class LocalChunks(Event):
    """At start-up: the store already holds these verified chunks of a version.

    ``manifest`` is the signed manifest bytes as stored. Lets a restarted node
    resume without re-downloading what it has.
    """

    manifest: bytes
    have: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Applied(Event):
    """The driver finished an ``ApplyVersion``: ``ok`` and the state digest it got."""

    version: int
    ok: bool
    reason: str = ""


# ----------------------------------------------------------------- actions (core -> driver)


@dataclass(frozen=True, slots=True)
class Progress(Event):
    """Part of a chunk arrived on ``conn`` (the driver's blocks): the peer is alive,
    even if no whole frame came for a while (liveness must not starve behind data)."""

    conn: int


@dataclass(frozen=True, slots=True)
class Acked(Event):
    """Bytes this node sent on ``conn`` are being acknowledged by the peer's TCP (the
    driver sees the sockets' acknowledged-byte count grow): a chunk already handed over
    there is still on its way, not lost. On a long lossy path a 4 MiB chunk may take
    longer than ``request_timeout_s`` after its last byte was handed to the kernel."""

    conn: int


@dataclass(frozen=True, slots=True)
class PathSample(Event):
    """The driver looked at the TCP socket of ``conn`` while a chunk of ours was leaving
    on it: ``queued`` whether its round trip ran above its floor, i.e. a queue stood at
    some bottleneck of the path. Only the origin reads them (``OriginRole.on_path_sample``):
    pushes whose paths show no queue for long, with their windows no longer opening, tell
    it that its site uplink has room (a long fat path, or flows held by random loss)."""

    conn: int
    queued: bool
    rtt: float  # the path's round-trip floor, seconds
    # its window is still opening from its start (slow start, BBR's start-up): no queue
    # yet says nothing of the room on the path
    ramping: bool = False


@dataclass(frozen=True, slots=True)
class EngineServed(Event):
    """The node's engine confirmed serving ``version`` (the fleet view reports it)."""

    version: int | None


@dataclass(frozen=True, slots=True)
class Action:
    pass


@dataclass(frozen=True, slots=True)
class Connect(Action):
    """Dial ``addr`` (host:port). Answer with ``PeerConnected`` or ``ConnectFailed``."""

    addr: str


@dataclass(frozen=True, slots=True)
class SendFrame(Action):
    """Send one control frame on ``conn``."""

    conn: int
    frame: bytes


@dataclass(frozen=True, slots=True)
class SendChunk(Action):
    """Send chunk ``index`` of ``version`` (read from the store) on ``conn``.

    ``size`` is the chunk's length from the manifest, for drivers that model
    transfer time. Answer with ``ChunkSent`` once it has left.

    ``arriving``: the chunk is still arriving here (cut-through relay). Send its
    blocks as they come in; the last only once the whole chunk was verified and
    stored. If it is not (corrupt, the link it came on closed, a local fault), tell
    the receiver to drop the blocks it got and answer ``ChunkSent(withdrawn=True)``.
    """

    conn: int
    version: int
    index: int
    size: int
    arriving: bool = False


@dataclass(frozen=True, slots=True)
class StopChunk(Action):
    """Stop sending chunk ``index`` of ``version`` on ``conn``, an answer to a request
    the peer has cancelled (CANCEL: it got the chunk from another peer first, an endgame
    twin). Not yet started: drop it. Under way: send no further block and withdraw what
    went (``PSW1``/``PSW2``; the peer drops it, nobody is to blame). Either way answer
    ``ChunkSent(withdrawn=True)``. Already gone: nothing (its ``ChunkSent`` stands)."""

    conn: int
    version: int
    index: int


@dataclass(frozen=True, slots=True)
class Close(Action):
    """Close ``conn`` and forget it. ``reason`` goes to the log."""

    conn: int
    reason: str


@dataclass(frozen=True, slots=True)
class AcceptManifest(Action):
    """A verified manifest was accepted: the driver persists it (``raw``).

    ``manifest`` is what the core's ``verify_manifest`` returned for ``raw``:
    the driver stores it as it is, without verifying the signature again.
    """

    version: int
    raw: bytes
    manifest: Any = None


@dataclass(frozen=True, slots=True)
class ApplyVersion(Action):
    """Every chunk of ``version`` is held and verified: apply it, then send ``Applied``."""

    version: int


@dataclass(frozen=True, slots=True)
class Log(Action):
    """A structured log record: ``event`` name plus fields."""

    level: str
    event: str
    fields: dict = field(default_factory=dict)
