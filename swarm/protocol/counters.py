"""Chunk traffic counters of one core, split by the kind of peer on the other end."""

from __future__ import annotations

from typing import Any

from swarm.protocol.peer import KINDS, PeerKind


class Counters:
    __slots__ = ("bad_chunks", "dup_chunks", "endgame_coming", "endgame_twins", "local_faults", "recv_bytes", "recv_chunks", "region_recv",
                 "region_sent", "relay_alive", "relays", "sent_bytes", "sent_chunks", "served_arriving", "uploads_cancelled",
                 "version_refused", "withdrawn")

    def __init__(self) -> None:
        self.sent_bytes = dict.fromkeys(KINDS, 0)
        self.recv_bytes = dict.fromkeys(KINDS, 0)
        self.sent_chunks = dict.fromkeys(KINDS, 0)
        self.recv_chunks = dict.fromkeys(KINDS, 0)
        self.region_sent: dict[tuple[str, str], int] = {}  # (src, dst region) -> bytes we sent
        self.region_recv: dict[tuple[str, str], int] = {}  # (src, dst region) -> bytes we received
        self.dup_chunks = 0
        self.bad_chunks = 0
        self.local_faults = 0  # chunks we failed to keep for a local reason (not the sender's)
        # a border's RELAY orders: carried out at once (chunk held), carried out the moment
        # the chunk was stored (relay on arrival), started while the chunk was still
        # arriving (cut-through), failed (RELAY_FAIL sent; withdrawn cut-throughs included)
        self.relays = {"at_once": 0, "on_arrival": 0, "cut_through": 0, "failed": 0}
        # RELAY_ALIVE: a border, relays it reported on their way; the origin, relay
        # deadlines those reports moved
        self.relay_alive = 0
        self.withdrawn = 0  # chunks a peer withdrew while sending them to us (not its fault)
        self.served_arriving = 0  # answers we started while the chunk still arrived here
        # chunks offered (COMING) at a version's end only (``serve_arriving_endgame``)
        self.endgame_coming = 0
        # twin requests asked in a version's endgame (``endgame_chunks``; held back until
        # the first request is overdue, ``endgame_twin_after_s``)
        self.endgame_twins = 0
        # answers under way that their requester cancelled (it got the chunk elsewhere
        # first): stopped (``ev.StopChunk``) instead of sent whole for nothing
        self.uploads_cancelled = 0
        self.version_refused = 0  # links closed at the HELLO: no protocol version in common

    def sent(self, kind: PeerKind, src: str, dst: str, size: int) -> None:
        self.sent_bytes[kind] += size
        self.sent_chunks[kind] += 1
        rk = (src, dst)
        self.region_sent[rk] = self.region_sent.get(rk, 0) + size

    def received(self, kind: PeerKind, size: int) -> None:
        self.recv_bytes[kind] += size
        self.recv_chunks[kind] += 1

    def received_from(self, src: str, dst: str, size: int) -> None:
        rk = (src, dst)
        self.region_recv[rk] = self.region_recv.get(rk, 0) + size

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent_bytes": {str(k): n for k, n in self.sent_bytes.items()},
            "recv_bytes": {str(k): n for k, n in self.recv_bytes.items()},
            "sent_chunks": {str(k): n for k, n in self.sent_chunks.items()},
            "recv_chunks": {str(k): n for k, n in self.recv_chunks.items()},
            "region_sent": {f"{a}->{b}": n for (a, b), n in self.region_sent.items()},
            "region_recv": {f"{a}->{b}": n for (a, b), n in self.region_recv.items()},
            "dup_chunks": self.dup_chunks, "bad_chunks": self.bad_chunks,
            "local_faults": self.local_faults, "relays": dict(self.relays),
            "relay_alive": self.relay_alive,
            "withdrawn": self.withdrawn, "served_arriving": self.served_arriving,
            "endgame_coming": self.endgame_coming,
            "endgame_twins": self.endgame_twins,
            "uploads_cancelled": self.uploads_cancelled,
            "version_refused": self.version_refused,
        }
