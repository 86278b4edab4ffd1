"""Liveness: the core's heartbeat (timeouts, pings, slow-peer eviction)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.protocol import wire
from swarm.protocol.handshake import READY

if TYPE_CHECKING:
    from swarm.protocol.core import NodeCore
    from swarm.protocol.peer import Peer


def heartbeat(self: NodeCore) -> None:
    """Every ``heartbeat_s``: handshake and request timeouts, silent peers, pings,
    the slow-peer outlier, expired redial back-offs, then top up requests."""
    c = self.cfg
    now = self.now
    ping = None
    slow: list[Peer] = []
    for p in list(self.peers.values()):
        if p.state is not READY:
            if now - p.since > c.handshake_timeout_s:
                self.close(p, "handshake timeout")
            continue
        if p.req:
            expired = self.exchange.expire(p, now)
            if expired:
                self.log("info", "request_timeout", peer=p.node_id, chunks=expired)
                if p.timeouts >= c.max_timeouts:
                    self.close(p, f"{p.timeouts} request timeouts", "warning")
                    continue
        elif now - p.last_heard > c.peer_timeout_s:
            self.close(p, "peer timeout (no heartbeat)")
            continue
        if self.role.heartbeat_drop(p):
            continue
        p.busy = False
        if now - p.last_sent >= c.heartbeat_s:
            if ping is None:
                ping = wire.Ping().encode()
            self.send(p, ping)
        if p.can_req and p.samples >= c.slow_min_samples:
            slow.append(p)
    # drop the slowest peer if it is a timing outlier and we can afford to lose it
    out = self.exchange.slow_outlier(slow) if len(self.by_id) > c.mesh_low else None
    if out is not None:
        worst, median = out
        self.close(worst, f"slow peer ({worst.ewma:.2f}s per chunk, median {median:.2f}s)")
    self.role.after_heartbeat()
    if self.retry_at:
        self.retry_at = {a: t for a, t in self.retry_at.items() if t > now}
    self.exchange.fill_all()
