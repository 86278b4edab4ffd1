"""Connection caps and deadlines for the swarm port, below the link layer (issue #10,
attack 3).

2,000 sockets trickling bytes once exhausted a node's file descriptors. The guard

- refuses a connection at once (``admit`` is False: the caller aborts it) beyond
  ``max_total`` open connections or ``max_per_ip`` from one address;
- gives every connection ``upgrade_timeout_s`` to become a swarm link (TLS handshake
  and the peer's preface; ``node.link.ReadPacer`` keeps the deadline and calls
  ``note_timed_out`` when it aborts one). With TLS the handshake has the same deadline.

Counters (``refused``, ``timed_out``) go to ``/status`` and ``/metrics``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GuardStats:
    open: int = 0
    refused: int = 0
    timed_out: int = 0
    per_ip: Counter = field(default_factory=Counter)


class ConnectionGuard:
    def __init__(self, *, max_total: int, max_per_ip: int, upgrade_timeout_s: float) -> None:
        self.max_total = max_total
        self.max_per_ip = max_per_ip
        self.upgrade_timeout_s = upgrade_timeout_s
        self.stats = GuardStats()

    def admit(self, ip: str) -> bool:
        """Count a new connection from ``ip``; False (counted as refused) over a cap."""
        st = self.stats
        if st.open >= self.max_total or st.per_ip[ip] >= self.max_per_ip:
            st.refused += 1
            return False
        st.open += 1
        st.per_ip[ip] += 1
        return True

    def release(self, ip: str) -> None:
        """An admitted connection from ``ip`` closed."""
        st = self.stats
        st.open -= 1
        st.per_ip[ip] -= 1
        if st.per_ip[ip] <= 0:
            del st.per_ip[ip]

    def note_timed_out(self) -> None:
        self.stats.timed_out += 1
