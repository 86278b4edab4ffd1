"""The fleet view: which version every node is active on and serves.

Nodes report to the origin with a STATUS frame (``wire.Status``) when their
active or engine-served version changes, and every ``status_interval_s``
(so the origin can tell a silent node from a current one). Most nodes are not
linked to the origin (it is their tracker only): a node with something to
report and no origin link dials its bootstrap list, sends STATUS right after
the handshake and is let go by the origin's ROLE as usual. Reports after a
change wait a per-node delay within ``status_delay_s`` so that a fleet that
activates a version together does not dial the origin in one instant.

The origin keeps one ``FleetEntry`` per node id (bounded: the oldest report
goes first), read through ``NodeCore.fleet()``. A STATUS is read only from a
peer that finished the handshake, in the name the handshake (and, on the real
transport, its certificate) proved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.protocol import wire

if TYPE_CHECKING:
    from swarm.protocol.peer import Peer
    from swarm.protocol.roles import Host


@dataclass(frozen=True, slots=True)
class FleetEntry:
    node_id: str
    region: str
    active: int | None  # version applied on the node's truth
    served: int | None  # version its engine confirmed serving (None: not reported)
    reported_at: float  # core time of the last report
    connected: bool  # linked to the origin now

    @property
    def serving(self) -> int | None:
        """The version requests are answered with: the engine's, else the active one."""
        return self.served if self.served is not None else self.active


class FleetTable:
    """Origin side: the last STATUS of every node, bounded by ``limit`` entries."""

    __slots__ = ("_entries", "limit", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: dict[str, tuple[str, int | None, int | None, float]] = {}
        self.refused = 0  # reports of versions the origin never published

    def record(self, p: Peer, f: wire.Status, now: float, latest: int | None) -> str | None:
        """Keep ``p``'s report; a reason string when it is refused."""
        for name, v in (("active", f.active), ("served", f.served)):
            if v is not None and (latest is None or v > latest):
                self.refused += 1
                return f"{name} version {v} is newer than any published ({latest})"
        e = self._entries
        e.pop(p.node_id, None)  # re-inserted last: dict order is report order
        e[p.node_id] = (p.region, f.active, f.served, now)
        while len(e) > self.limit:
            del e[next(iter(e))]
        return None

    def active(self, node_id: str) -> int | None:
        """The version ``node_id`` last reported active (None: no report, or none active)."""
        e = self._entries.get(node_id)
        return None if e is None else e[1]

    def entries(self, connected: set[str]) -> list[FleetEntry]:
        return [FleetEntry(n, r, a, s, t, n in connected)
                for n, (r, a, s, t) in sorted(self._entries.items())]

    def __len__(self) -> int:
        return len(self._entries)


class StatusReporter:
    """Node side: when to tell the origin our versions, and telling it."""

    __slots__ = ("_delay", "_due", "_host", "_periodic", "_sent")

    def __init__(self, host: Host) -> None:
        self._host = host
        h = hashlib.blake2b(host.cfg.node_id.encode(), digest_size=8).digest()
        self._delay = host.cfg.status_delay_s * int.from_bytes(h, "little") / 2.0**64
        self._sent: tuple[int | None, int | None] | None = None
        self._due: float | None = None  # report at (after a change, or a failed dial)
        self._periodic: float | None = None  # re-report at (liveness for the fleet view)

    def current(self) -> tuple[int | None, int | None]:
        h = self._host
        return (h.active_version, h.served_version)

    @property
    def pending(self) -> bool:
        return self._due is not None

    def changed(self) -> None:
        """Our active or served version changed: report it after our spread delay."""
        if self.current() != self._sent:
            due = self._host.now + self._delay
            if self._due is None or due < self._due:
                self._due = due

    def next_wakeup(self) -> float | None:
        a, b = self._due, self._periodic
        if a is None:
            return b
        return a if b is None or a < b else b

    def tick(self, origin_link: Peer | None, dial_origin: Callable[[], None]) -> None:
        """Report now if due: over ``origin_link``, else by dialling the origin
        (the report then goes right after the handshake, see ``send``)."""
        h = self._host
        now = h.now
        if self._periodic is not None and now >= self._periodic:
            self._periodic = None
            if self._due is None or self._due > now:
                self._due = now
        if self._due is None or now < self._due:
            return
        if origin_link is not None:
            self.send(origin_link)
            return
        dial_origin()
        # if that dial fails (or is refused) try again later, not at every wake-up
        self._due = now + max(h.cfg.redial_s, h.cfg.heartbeat_s)

    def send(self, p: Peer) -> None:
        """Send our STATUS on the (origin) link ``p``."""
        h = self._host
        active, served = self.current()
        h.send(p, wire.Status(wire.STATUS_FORMAT, active, served).encode())
        self._sent = (active, served)
        self._due = None
        iv = h.cfg.status_interval_s
        self._periodic = h.now + iv if iv > 0 else None
