"""Per-connection state the core keeps about one peer."""

from __future__ import annotations

import enum

from swarm.protocol.handshake import HELLO_WAIT, HandshakeState


class PeerKind(enum.StrEnum):
    """Where the peer on the other end sits, for the traffic counters."""

    SAME = "same_region"
    CROSS = "cross_region"
    ORIGIN = "from_origin"


SAME = PeerKind.SAME
CROSS = PeerKind.CROSS
ORIGIN = PeerKind.ORIGIN
KINDS = tuple(PeerKind)


class Peer:
    """One connection. ``bits[v]`` is what the peer holds of version ``v``;
    a key in ``bits`` means the peer knows that version's manifest."""

    __slots__ = (
        "addr", "arrival_s", "bits", "border", "busy", "can_req", "coming", "conn", "ewma", "hello_in",
        "hello_out", "identity", "kept", "kind", "last_heard", "last_sent", "links", "listen_addr",
        "node_id", "outbound", "proto", "region", "relay_busy", "req", "role", "samples", "since",
        "state", "timeouts",
    )

    def __init__(self, conn: int, outbound: bool, addr: str, now: float) -> None:
        self.conn = conn
        self.outbound = outbound
        self.addr = addr
        self.state: HandshakeState = HELLO_WAIT
        self.since = now
        self.hello_out = b""
        self.hello_in = b""
        self.identity: tuple[str, str, str] | None = None  # proven by the transport (mTLS)
        self.node_id = ""
        self.region = ""
        self.listen_addr = ""
        self.role = "node"
        self.proto = 0  # the protocol version the link speaks (``handshake.negotiate``), from the HELLO
        self.kind = SAME
        self.border = False  # origin's view: a border it feeds; node's view: a cross-region border link
        self.kept = False  # origin kept this link (ROLE keep sent / received)
        self.can_req = False  # we may request chunks from this peer
        self.bits: dict[int, int] = {}
        # of ``bits``, the chunks it only said are arriving there (COMING, not stored yet)
        self.coming: dict[int, int] = {}
        self.req: dict[tuple[int, int], float] = {}  # our outstanding requests -> sent at
        self.last_heard = now
        self.last_sent = now
        self.busy = False  # rejected our last request; skip until it speaks again
        self.ewma = 0.0  # seconds per chunk, request -> arrival
        self.samples = 0
        self.timeouts = 0
        self.relay_busy = 0  # origin's view: relays this border is carrying out
        self.links: set[str] = set()  # origin's view: cross-region borders it is linked to
        # how long the last chunk announced arriving from it took, first block to stored
        self.arrival_s: float | None = None

    @property
    def is_origin(self) -> bool:
        return self.role == "origin"

    @property
    def ready(self) -> bool:
        return self.state is HandshakeState.READY
