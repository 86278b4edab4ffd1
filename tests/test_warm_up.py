"""Warm-up of long links (node.warm_up): padding that opens a link's TCP window before
its first chunk.

The policy (``WarmUp``) under any sequence of looks; the padding message and the
placer's view of it; and real node processes on loopback (``warm_up_min_rtt_ms = 0``,
so that loopback links count as long): every link between regions is warmed from the
side that uploads on it, every byte of padding sent is received, the warm-ups end
before the first version, which lands bitwise; an outsider's padding before its
handshake, or past ``wire.PAD_LIMIT`` after it, closes its link.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.fleet import LoopbackFleet
from node.conn import Conn
from node.driver import _leaves_blocks_alone
from node.warm_up import WARM_UP_MAX_S, WarmUp, WarmUps
from swarm.protocol import wire
from tests.peer_client import connect, ending, join

_looks = st.lists(st.tuples(st.floats(0, 2.0), st.sampled_from([None, True, False])),
                  max_size=300)


@given(budget=st.integers(0, 3 * wire.PAD_MESSAGE_BYTES + 5), looks=_looks)
def test_a_warm_up_pads_within_its_budget_and_ends_for_good(budget: int, looks: list) -> None:
    w = WarmUp(budget, now=10.0)
    now, sent, ended_at_look = 10.0, 0, None
    for k, (dt, startup) in enumerate(looks):
        now += dt
        n = w.next_pad(now, startup)
        if ended_at_look is not None:
            assert n == 0  # over for good
            continue
        if n == 0:
            ended_at_look = k
            assert w.why in ("budget", "time", "path_full")
            if w.why == "path_full":
                assert startup is False and sent > 0  # never before the first message
            elif w.why == "time":
                assert now - 10.0 >= WARM_UP_MAX_S
            else:
                assert sent == budget
            continue
        assert 0 < n <= wire.PAD_MESSAGE_BYTES
        assert now - 10.0 < WARM_UP_MAX_S and not (startup is False and sent > 0)
        sent += n
        assert w.sent == sent <= budget
    if ended_at_look is None and sent == budget and looks:
        assert w.next_pad(now, True) == 0 and w.why == "budget"


def test_padding_messages_and_the_placer() -> None:
    for n in (4, 5, 1000, wire.PAD_MESSAGE_BYTES):
        pad = wire.pack_pad(n)
        assert len(pad) == n and wire.is_pad_message(pad)
        assert not wire.is_block_message(pad) and not wire.is_chunk_message(pad)
        # padding queued behind a block leaves the block assembler alone (node.link)
        assert _leaves_blocks_alone(bytearray(pad))
    assert not _leaves_blocks_alone(wire.pack_withdraw(1, 2))
    for bad in (0, 3, wire.PAD_MESSAGE_BYTES + 1):
        with pytest.raises(ValueError):
            wire.pack_pad(bad)


def _warm(st: dict | None) -> dict:
    return ((st or {}).get("transport") or {}).get("warm_up") or {}


async def _pad_before_hello(addr: str) -> str:
    link = await connect(addr)
    try:
        await link.send(wire.pack_pad(wire.PAD_MESSAGE_BYTES))
        return await asyncio.wait_for(ending(link), 10)
    finally:
        await link.close()


async def _pad_past_the_limit(addr: str, secret: bytes) -> str:
    """A member that knows the swarm secret pads its link past ``wire.PAD_LIMIT``."""
    link = await join(addr, secret, "padder", "region-1")
    try:
        pad = wire.pack_pad(wire.PAD_MESSAGE_BYTES)
        try:
            for _ in range(wire.PAD_LIMIT // len(pad) + 8):  # bounded: the limit and a little
                await link.send(pad)
        except (ConnectionError, RuntimeError):
            pass  # closed under us: the reason is what the test reads
        return await asyncio.wait_for(ending(link, most=5000), 20)
    finally:
        await link.close()


def test_as_shipped_only_the_origin_warms_its_links() -> None:
    """[network] warm_up_kib by role, through the real configs (node.config): the origin's
    default (512) warms its links to the borders, a node's (0) warms none. The round-trip
    floor is lowered so that loopback links count as long ones."""
    with LoopbackFleet(2, 2, chunk_size=32 * 1024, network={"warm_up_min_rtt_ms": 0}) as fleet:
        fleet.start(timeout=120)
        deadline = time.monotonic() + 30
        while True:
            warm = {n.name: _warm(fleet.status(n)) for n in fleet.nodes}
            origin = _warm(fleet.trainer_status())
            if origin.get("links") == 4 and not origin.get("warming"):
                break
            assert time.monotonic() < deadline, (origin, warm)
            time.sleep(0.2)
        assert 0 < origin["pad_sent"] <= 4 * 512 * 1024 and origin["pad_received"] == 0
        assert all(w["links"] == 0 and w["pad_sent"] == 0 for w in warm.values()), warm
        assert sum(w["pad_received"] for w in warm.values()) == origin["pad_sent"]
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {s["active_digest"] for s in statuses.values()} == {pub["digest"]}


def test_links_between_regions_are_warmed_before_the_first_version() -> None:
    with LoopbackFleet(2, 2, chunk_size=32 * 1024,
                       network={"warm_up_min_rtt_ms": 0, "warm_up_kib": 512}) as fleet:
        fleet.start(timeout=120)
        # every node borders the other region (border_nodes >= 2): the origin warms its
        # links to all four, each node its links to the other region's two
        deadline = time.monotonic() + 30
        while True:
            sts = {n.name: fleet.status(n) for n in fleet.nodes}
            sts["trainer"] = fleet.trainer_status()
            warm = {k: _warm(v) for k, v in sts.items()}
            if ({k: w.get("links") for k, w in warm.items()}
                    == {**{n.name: 2 for n in fleet.nodes}, "trainer": 4}
                    and not any(w.get("warming") for w in warm.values())):
                break
            assert time.monotonic() < deadline, warm
            time.sleep(0.2)
        # the origin warmed the borders it feeds (one region each at least), and the
        # borders their links to the other region's borders; nobody pads the origin
        assert warm["trainer"]["pad_received"] == 0
        sent = sum(w["pad_sent"] for w in warm.values())
        assert sent == sum(w["pad_received"] for w in warm.values())
        for w in warm.values():
            assert w["pad_sent"] <= w["links"] * 512 * 1024
            assert set(w["ended"]) <= {"budget", "path_full", "time"}, w
            assert sum(w["ended"].values()) == w["links"]
        links = {k: w["links"] for k, w in warm.items()}
        metrics = fleet.http(fleet.nodes[0].addr, "/metrics").decode()
        assert 'patchswarm_warm_up_pad_bytes_total{' in metrics and 'direction="sent"' in metrics
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {s["active_digest"] for s in statuses.values()} == {pub["digest"]}
        assert all(s["bad_chunks"] == 0 for s in statuses.values())
        # the version warmed nothing more (its links carried chunks)
        assert {n.name: _warm(s)["links"] for n, s in
                ((n, statuses[n.name]) for n in fleet.nodes)} == {
                    k: v for k, v in links.items() if k != "trainer"}
        # padding from an outsider before its handshake, or past the limit after it,
        # closes its link (and nothing else)
        target = fleet.nodes[0]
        assert "padding before the handshake" in asyncio.run(_pad_before_hello(target.addr))
        secret = bytes.fromhex((fleet.workdir / "swarm.secret").read_text().strip())
        ended = asyncio.run(_pad_past_the_limit(target.addr, secret))
        assert "bytes of padding, over the" in ended, ended
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {s["active_digest"] for s in statuses.values()} == {pub["digest"]}


class _Core:
    """What ``WarmUps`` reads of the core: every link authenticated, between regions and
    speaking padding (``NodeCore``'s read model answers the same questions)."""

    def authenticated(self, conn: int) -> bool:
        return True

    def peer_border(self, conn: int) -> bool:
        return True

    def peer_proto(self, conn: int) -> int:
        return wire.PAD_PROTOCOL


class _Host(WarmUps):
    """The part of the driver ``WarmUps`` uses, over real loopback TCP sockets."""

    def __init__(self, kib: int) -> None:
        self._warm_setup(kib, 0.0)
        self.core = _Core()
        self.conns: dict[int, Conn] = {}
        self.loop = asyncio.get_running_loop()
        self.slow_start_after_idle = None

    def now(self) -> float:
        return self.loop.time()


async def _warm_ups_one_at_a_time() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    pairs = []
    try:
        host = _Host(kib=128)
        for k in range(3):
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
            pairs.append((a, b))
            c = Conn(k + 1, None, True, f"peer{k}", sock=a)  # type: ignore[arg-type]
            host.conns[c.id] = c
        c1, c2, c3 = host.conns.values()
        for c in (c1, c2, c3):
            host._warm_look(c, 0)
        assert list(host.warming) == [1] and len(host.warm_queue) == 2
        assert host.warm_status()["warming"] == 3
        while (pad := host._warm_pad(c1)) is not None:  # the writer: every pad to the kernel
            c1.sock.sendall(pad)
        assert c1.warm.sent == 128 * 1024 and c1.warm.why == "budget"
        for _ in range(200):  # its turn ends once the peer acknowledged it all
            if 1 not in host.warming:
                break
            await asyncio.sleep(0.01)
        assert list(host.warming) == [2] and host.warm_ended == {"budget": 1}
        # a chunk on any link ends the warm-ups under way and forgets the queued ones
        host._chunk_moved(c3)
        assert not host.warming and not host.warm_queue and c3.carried and c3.warm is None
        assert host.warm_ended == {"budget": 1, "chunks": 1}
        host._warm_look(c3, 0)  # a link that carried a chunk is never warmed
        assert c3.warm is None and host.warm_ups == 2
        assert host._warm_pad(c2) is None  # over for good
        # a link whose round trip is under warm_up_min_rtt_ms is left alone (loopback)
        host.warm_up_min_rtt_s = 0.02
        c4 = Conn(9, None, True, "peer9", sock=c1.sock)  # type: ignore[arg-type]
        host.conns[c4.id] = c4
        host._warm_look(c4, 0)
        assert c4.warm is None and not host.warm_queue and host.warm_ups == 2
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        server.close()


def test_a_node_warms_one_link_at_a_time_and_stops_at_the_first_chunk() -> None:
    asyncio.run(_warm_ups_one_at_a_time())
