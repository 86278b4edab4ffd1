"""Connection caps and deadlines for the swarm port, below HTTP (issue #10, attack 3).

aiohttp's server bounds header *sizes* but not how long a client may take to
send them, nor how many connections one address may hold: 2,000 sockets
trickling a request header once exhausted a node's file descriptors. The
guard wraps each connection's protocol and

- refuses a connection at once (``abort``) beyond ``max_total`` open
  connections or ``max_per_ip`` from one address;
- gives every connection ``upgrade_timeout_s`` to become a swarm websocket
  (the driver calls ``established`` once the upgrade succeeded); a connection
  that has not by then is aborted. With TLS the TLS handshake has the same
  deadline (``ssl_handshake_timeout``), and the guard's clock starts after it.

Counters (``refused``, ``timed_out``) go to ``/status`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


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
        self._established: set[int] = set()  # id() of transports that became websockets

    def established(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None:
            self._established.add(id(transport))

    def wrap(self, factory: Any) -> Any:
        return lambda: _Guarded(self, factory())


class _Guarded(asyncio.Protocol):
    """Forwards every call to aiohttp's protocol once the connection is admitted."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.ip: str | None = None
        self.admitted = False
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        g, st = self.guard, self.guard.stats
        peer = transport.get_extra_info("peername")
        self.ip = peer[0] if peer else "?"
        if st.open >= g.max_total or st.per_ip[self.ip] >= g.max_per_ip:
            st.refused += 1
            transport.abort()
            return
        self.admitted = True
        self.transport = transport
        st.open += 1
        st.per_ip[self.ip] += 1
        self.timer = asyncio.get_running_loop().call_later(g.upgrade_timeout_s, self._deadline)
        self.inner.connection_made(transport)

    def _deadline(self) -> None:
        self.timer = None
        t = self.transport
        if t is not None and id(t) not in self.guard._established and not t.is_closing():
            self.guard.stats.timed_out += 1
            t.abort()

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        st = self.guard.stats
        st.open -= 1
        st.per_ip[self.ip] -= 1
        if st.per_ip[self.ip] <= 0:
            del st.per_ip[self.ip]
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.guard._established.discard(id(self.transport))
        self.inner.connection_lost(exc)


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections pass through a ``ConnectionGuard``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.guard = guard

    async def start(self) -> None:
        # BaseSite.start registers the site; TCPSite.start's create_server is ours
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        extra: dict[str, Any] = {}
        if self._ssl_context is not None:
            extra["ssl_handshake_timeout"] = self.guard.upgrade_timeout_s
        self._server = await loop.create_server(
            self.guard.wrap(server), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port, **extra)
