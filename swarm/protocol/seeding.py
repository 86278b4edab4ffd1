"""The origin's seeding policy: who feeds which region which chunk.

Three modes, chosen by the origin's ``CoreConfig``:

- ``regions`` (region_aware): the origin is the coordinator of a two-level
  swarm. Per region it grants up to ``border_nodes`` border nodes (ROLE keep)
  and keeps, per version and region, the set of chunks that entered the region
  (``sent``) and those in flight. A chunk enters a region exactly once: pushed
  by the origin (super-seeding: spread over the region's borders, novel chunks
  first so regions hold different chunks to relay), or, with ``relay``,
  relayed by a border of another region that holds it (RELAY order) whenever
  such a border has a free relay slot, which keeps the origin's uplink for
  chunks no region has yet. When the origin cannot push, a border may also be
  ordered to relay a chunk the origin is pushing to it right now: it relays it
  the moment it is stored (``relays``, relay on arrival), without its HAVE and
  a new order in between. A chunk is sent into a region again only when its
  transfer timed out, or when the border that took it left and no other border
  of the region reported it within ``border_grace_s``.
- ``direct`` (origin_only): every node is kept; the origin pushes each node
  every chunk, round-robin over nodes, ``upload_slots`` at a time.
- ``flat`` (not region_aware): the origin is an ordinary seed of a
  region-unaware swarm: it keeps ``origin_peers`` nodes and serves their
  requests; everybody else only gets peer addresses.

The origin is also the tracker: every joining node gets a sample of its region
(PEERS), so the origin's address is the natural bootstrap address.
"""

from __future__ import annotations

import enum
from collections import deque

from swarm.protocol import wire
from swarm.protocol.coldpath import ColdPath
from swarm.protocol.fleet import FleetEntry, FleetTable
from swarm.protocol.peer import Peer
from swarm.protocol.picker import first_pick, iter_bits, popcount
from swarm.protocol.roles import FrameHandler, Host, Role
from swarm.protocol.uplink import UplinkWindow

ORIGIN_SRC = -1
# relays a path must have carried before it may count as slow (``_slow_source``): at 3x
# from the first relay (a cold one against a first push) the emulated WAN's first versions
# most likely lost a path and sent a sixth of a copy more through the thin uplink
MIN_PATH_SAMPLES = 3
# relay-on-arrival orders a border may hold at once (``_ahead_room``): more than one only while
# each waiting order's chunk came through a slow push that has left us (on a thin path: a
# push that has left)
AHEAD_ORDERS = 4
# round trips the pushes' paths must show no queue on the site uplink before the origin
# takes it for one that has room (``clear_startup``): TCP's slow start from its initial
# window fills a thin uplink within ~5 (100 Mbit/s at 81 ms: the emulated WAN's first
# version); a fat one, or paths held by loss, stay clear for as long as pushes leave
CLEAR_RTTS = 6


class SeedMode(enum.Enum):
    REGIONS = "regions"
    DIRECT = "direct"
    FLAT = "flat"

    @classmethod
    def of(cls, origin_only: bool, region_aware: bool) -> SeedMode:
        if origin_only:
            return cls.DIRECT
        return cls.REGIONS if region_aware else cls.FLAT


DIRECT, FLAT, REGIONS = SeedMode.DIRECT, SeedMode.FLAT, SeedMode.REGIONS
# RELAY_ALIVE keeps a relay from timing out for at most this many request_timeout_s
# after it started (one 4 MiB chunk over 150 ms at 1 % loss on one flow: ~70 s)
RELAY_ALIVE_MAX = 12


class RegionPlan:
    """One version in one region: what entered it and what is on its way."""

    __slots__ = ("infl", "inflight", "relayed_at", "remote", "sent")

    def __init__(self, now: float = 0.0, remote: bool = False) -> None:
        self.remote = remote  # not the origin's own region: its pushes cross the site uplink
        self.sent = 0
        self.infl = 0
        self.inflight: dict[int, list] = {}  # index -> [source conn | -1, target conn, deadline | None, started]
        self.relayed_at = now  # last relay into the region ordered or arrived (relay_wait_s)


class OriginRole(Role):
    """The origin (trainer): tracker and seeder of every region. See the module docstring."""

    shares_bitfields = False  # the origin pushes; it never waits to be asked

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        c = host.cfg
        self.mode = SeedMode.of(c.origin_only, c.region_aware)
        self.borders: dict[str, list[Peer]] = {}
        self.plans: dict[int, dict[str, RegionPlan]] = {}
        self.versions: list[int] = []
        self.pushes: dict[tuple[int, int, int], str] = {}  # (conn, v, i) -> region
        self.acked_until: dict[int, float] = {}  # border conn -> its pushes live until (on_acked)
        self.graces: list[tuple[float, str, int, int]] = []  # (due, region, version, bits)
        self.kept = 0
        self.rr: deque[int] = deque()
        self.rr_set: set[int] = set()
        self.pushed: dict[int, dict[int, int]] = {}  # direct: conn -> version -> bits pushed
        self.replaced = 0  # border replacements dialled
        self.resend_now: set[int] = set()  # conns of borders banned: re-plan their chunks at once
        self.table = FleetTable(c.fleet_max)  # every node's last STATUS
        # measured seconds from order to HAVE per chunk into each region (EWMA): by push
        # from the origin, by relay from another region (``_direct_faster``)
        self.push_s: dict[str, float] = {}
        self.relay_s: dict[str, float] = {}
        # ... by relay, per (source region, region): a region is no relay source for
        # another while its relays into it take ``slow_relay_factor`` x a push into it
        # (``_slow_source``: an upload-bound region relays out slowly)
        self.path_s: dict[tuple[str, str], float] = {}
        self.path_n: dict[tuple[str, str], int] = {}  # relays measured on each path
        # measured delivery time of a first push on a border connection (one that had
        # carried no chunk of ours: TCP's window still at its start; EWMA, all regions),
        # and the push each such connection is on: an unmeasured relay is guessed this
        # slow (``_direct_faster``)
        self.cold_s: float | None = None
        # seconds from a push's start to its last byte leaving us, per remote region
        # (EWMA, full-size chunks): where it is long the site links are thin
        # (``_thin_path``)
        self.leave_s: dict[str, float] = {}
        # pushes that left within ``fast_startup_s``: the latest issue time among them, and
        # the regions they went into (``_push_capped``: a region none of whose pushes
        # left fast, while one issued with or after its own did, is behind a slow path)
        self.fast_mark = float("-inf")
        self.fast_took = 0.0  # how long the push issued at ``fast_mark`` took to leave
        self.fast_regions: set[str] = set()
        # per region: first pushes against the fastest recent pushes over used
        # connections, and whether the first are cold_path_factor x the second
        # (``_push_timed``, ``_stay_used``, ``_used_depth``)
        self.cold_paths: dict[str, ColdPath] = {}
        self.first_push: dict[int, tuple[int, int]] = {}  # border conn -> (version, index)
        self.pushed_to: set[int] = set()  # border conns that carried a push of ours
        self.uplink_pushes = 0  # pushes into remote regions not yet confirmed by a HAVE
        self.window = UplinkWindow(c.uplink_window, max(c.uplink_window, c.uplink_window_max),
                                   departure_step=c.fast_startup_step)
        # (sender conn | ORIGIN_SRC, region) -> the border conn it sent to last (``_target``)
        self.warm: dict[tuple[int, str], int] = {}
        # border conn -> the border conns we ordered it to relay to: connections that have
        # carried a chunk, whose TCP window is open (``_target``; pushes: ``pushed_to``)
        self.relayed_to: dict[int, set[int]] = {}
        # push conn -> (when, queued) of its path's last sample (``on_path_sample``); since
        # when samples have shown no queue on the site uplink, and the longest round trip
        # among them (``_clear_for``)
        self.path_seen: dict[int, tuple[float, bool]] = {}
        self.clear_since: float | None = None
        self.clear_rtt = 0.0
        self.clear_logged = False  # the clear run is long enough, and was logged

    # ------------------------------------------------------------------ role hooks
    def frame_handlers(self) -> dict[type[wire.Frame], FrameHandler]:
        return {wire.RelayFail: self._f_relay_fail, wire.RelayAlive: self._f_relay_alive,
                wire.Links: self._f_links, wire.Report: self._f_report,
                wire.Status: self._f_status}

    def _f_status(self, p: Peer, f: wire.Status) -> None:
        """Node -> origin: the versions it is active on and serves (the fleet view)."""
        host = self.host
        latest = max(self.versions) if self.versions else host.active_version
        why = self.table.record(p, f, host.now, latest)
        if why is not None:
            host.log("warning", "status_refused", peer=p.node_id, reason=why)

    def fleet(self) -> list[FleetEntry]:
        return self.table.entries(set(self.host.by_id))

    def _f_relay_fail(self, p: Peer, f: wire.RelayFail) -> None:
        self.on_relay_fail(p, f.version, f.index, f.target)

    def _f_relay_alive(self, p: Peer, f: wire.RelayAlive) -> None:
        self.on_relay_alive(p, f.version, f.index, f.target)

    def _f_links(self, p: Peer, f: wire.Links) -> None:
        self.on_links(p, list(f.ids))

    def _f_report(self, p: Peer, f: wire.Report) -> None:
        """Node -> origin: it banned ``f.node_id`` for corrupt chunks."""
        self.on_report(p, f.node_id)

    def may_serve(self, p: Peer) -> bool:
        # the origin pushes; it serves requests only as the seed of a flat swarm
        return not self.cfg.region_aware and not self.cfg.origin_only

    def on_ban(self, node_id: str) -> None:
        self.schedule()

    def on_shown(self, p: Peer, v: int) -> None:
        if p.border:
            self.schedule()  # its region may take chunks of v now (_schedule_regions)

    def on_holdings(self, p: Peer, v: int, gained: int) -> bool:
        self.on_have(p, v, gained)
        return True

    def after_sent(self) -> None:
        self.schedule()

    def on_local_complete(self, v: int) -> None:
        if v not in self.plans:
            # a restarted origin keeps seeding what it published before (one-shot publish)
            self.on_publish(v)

    def after_heartbeat(self) -> None:
        if self.mode is REGIONS:
            for r in self.host.book.regions():
                self._redial_borders(r)

    def _redial_borders(self, r: str) -> None:
        """Region ``r`` has fewer borders than ``border_nodes``: dial nodes of it we heard
        of, one dial in flight per missing border, each address at most as often as its
        back-off allows (``retry_at``). After a partition heals the region's nodes would
        find us only at their next redial (``redial_s``, jittered): the origin finds them
        at its next heartbeat, and the rest of the region's borders the moment one is back."""
        host, c = self.host, self.cfg
        missing = c.border_nodes - len(self.borders.get(r, ()))
        if missing <= 0:
            return
        connected = {q.node_id for q in host.peers.values()}
        now = host.now
        pending = 0
        cands = []
        for node_id in host.book.region_ids(r):
            e = host.book.get(node_id)
            if e is None or node_id in connected:
                continue
            addr = e[1]
            if addr in host.dialing:
                pending += 1
            elif host.retry_at.get(addr, 0.0) <= now:
                cands.append(addr)
        for addr in cands[: max(0, missing - pending)]:
            host.dial(addr)

    def heartbeat_drop(self, p: Peer) -> bool:
        if not p.kept and self.host.now - p.since > self.cfg.handshake_timeout_s:
            self.host.close(p, "tracker contact done")
            return True
        return False

    def moving(self, v: int) -> bool:
        """Pushes or relay orders of ``v`` under way, or a linked node that showed ``v``,
        lacks some of it and has not reported a newer version active (a border of a
        region still taking it: the origin may push it more)."""
        if any(key[1] == v for key in self.pushes):
            return True
        if any(plan.inflight for plan in self.plans.get(v, {}).values()):
            return True
        st = self.host.holding(v)
        if st is None:
            return False
        for p in self.host.peers.values():
            if p.ready and p.bits.get(v, st.full) != st.full:
                active = self.table.active(p.node_id)
                if active is None or active < v:
                    return True
        return False

    def forget(self, v: int) -> None:
        self.plans.pop(v, None)
        if v in self.versions:
            self.versions.remove(v)
        for pushed in self.pushed.values():
            pushed.pop(v, None)
        for conn in [c for c, (u, _i) in self.first_push.items() if u == v]:
            del self.first_push[conn]
        self.graces = [g for g in self.graces if g[2] != v]

    # ------------------------------------------------------------------ read model
    def region_sent(self, v: int) -> dict[str, int]:
        """Per region: the chunks of ``v`` that entered it (bitsets), as far as the plan knows."""
        return {r: plan.sent for r, plan in self.plans.get(v, {}).items()}

    # ------------------------------------------------------------------ membership
    def on_ready(self, p: Peer) -> None:
        host, c = self.host, self.cfg
        if p.is_origin:
            host.close(p, "two origins in one swarm", "warning")
            return
        host.book.add(p.node_id, p.region, p.listen_addr, 0)
        keep = False
        if self.mode is DIRECT:
            keep = True
        elif self.mode is FLAT:
            keep = self.kept < c.origin_peers
        else:
            bs = self.borders.setdefault(p.region, [])
            if len(bs) < c.border_nodes:
                keep = True
                p.border = True
                bs.append(p)
        p.kept = keep
        if keep:
            self.kept += 1
        region = p.region if c.region_aware else None
        sample = [x for x in host.book.sample(region, c.tracker_sample + 1) if x[0] != p.node_id]
        if p.border and c.relay:
            others = [(b.node_id, r, b.listen_addr, wire.PEER_BORDER)
                      for r, lst in self.borders.items() if r != p.region for b in lst]
            sample = (others + sample)[: wire.MAX_PEERS]
            note = wire.Peers(((p.node_id, p.region, p.listen_addr, wire.PEER_BORDER),)).encode()
            for r, lst in self.borders.items():
                if r != p.region:
                    for b in lst:
                        host.send(b, note)
        # PEERS before ROLE: a node told "tracker only" closes the link on ROLE
        if sample:
            host.send(p, wire.Peers(tuple(sample[: wire.MAX_PEERS])).encode())
        host.send(p, wire.Role(wire.ROLE_KEEP if keep else 0).encode())
        if self.mode is DIRECT:
            self._rr_add(p.conn)
        elif self.mode is REGIONS and keep:
            self._redial_borders(p.region)  # it may be back from a partition: so are others
        self.schedule()

    def on_leave(self, p: Peer) -> None:
        host = self.host
        if p.kept:
            self.kept -= 1
        for key in [k for k in self.pushes if k[0] == p.conn]:
            del self.pushes[key]
        self.pushed.pop(p.conn, None)
        self.path_seen.pop(p.conn, None)
        self.first_push.pop(p.conn, None)
        self.pushed_to.discard(p.conn)
        for key in [k for k, t in self.warm.items() if k[0] == p.conn or t == p.conn]:
            del self.warm[key]  # its connections are gone: nothing is warm there
        self.relayed_to.pop(p.conn, None)
        for targets in self.relayed_to.values():
            targets.discard(p.conn)
        if self.mode is not REGIONS or not p.border:
            self.schedule()
            return
        bs = self.borders.get(p.region, [])
        if p in bs:
            bs.remove(p)
        for v, plans in self.plans.items():
            for plan in plans.values():
                for i, (src, dst, _d, _t0) in list(plan.inflight.items()):
                    if src == p.conn or dst == p.conn:
                        self._drop_inflight(plan, i)
            plan = plans.get(p.region)
            if plan is not None:
                others = 0
                for b in bs:
                    others |= b.bits.get(v, 0)
                lost = p.bits.get(v, 0) & plan.sent & ~others
                if lost:
                    wait = 0.0 if p.conn in self.resend_now else self.cfg.border_grace_s
                    self.graces.append((host.now + wait, p.region, v, lost))
        self.resend_now.discard(p.conn)
        # find a replacement border: dial a node of that region we heard of
        connected = {q.node_id for q in host.peers.values()}
        cands = [i for i in host.book.region_ids(p.region) if i != p.node_id and i not in connected]
        if cands:
            entry = host.book.get(cands[host.rng.randrange(len(cands))])
            if entry is not None:
                self.replaced += 1
                host.dial(entry[1])
        self.schedule()

    def on_report(self, p: Peer, bad: str) -> None:
        """``p`` banned node ``bad`` for corrupt chunks: ban it here too.

        If ``bad`` is a border, every chunk its region got only through it is
        as good as lost (its copies reach nobody), so those chunks are sent into
        the region again at once: the allowed exception to "exactly once".
        """
        host = self.host
        if bad == host.cfg.node_id or bad == p.node_id:
            return
        host.log("warning", "peer_reported", reporter=p.node_id, peer=bad)
        conn = host.by_id.get(bad)
        q = host.peers.get(conn) if conn is not None else None
        if q is not None and q.border:
            self.resend_now.add(q.conn)
        host.ban(bad, f"reported by {p.node_id}: corrupt chunks")
        self.resend_now.discard(conn if conn is not None else -1)
        self.tick()

    def on_links(self, p: Peer, ids: list[str]) -> None:
        """``p``'s cross-region links changed: relays it was ordered to carry over a
        link that is gone will not arrive; they are planned again now."""
        p.links = set(ids)
        host = self.host
        for plans in self.plans.values():
            for plan in plans.values():
                for i, (src, dst, _d, _t0) in list(plan.inflight.items()):
                    if src != p.conn:
                        continue
                    t = host.peers.get(dst)
                    if t is None or t.node_id not in p.links:
                        host.log("info", "relay_cancelled", border=p.node_id, index=i)
                        self._drop_inflight(plan, i)
        self.schedule()

    # ------------------------------------------------------------------ chunk flow
    def on_publish(self, v: int) -> None:
        if self.versions and self._uplink_busy() == 0:
            was = self.window.w
            self.window.restart(self.host.now)  # no round times the gap between versions
            self._window_moved(was, "restart")
        self.versions.append(v)
        self.versions.sort()
        self.plans[v] = {}
        if v == self.versions[-1]:
            # The ANNOUNCE of v just went to every linked node, ahead of anything we send
            # on those links next: a border may take pushes of v now, not a round trip
            # later when its echo shows v. (Not for an older version re-seeded after a
            # restart: a node already past it would drop what we push.)
            for p in self.host.peers.values():
                if p.ready and p.border and v not in p.bits:
                    p.bits[v] = 0
        if self.mode is DIRECT:
            for p in self.host.peers.values():
                if p.ready and p.kept:
                    self._rr_add(p.conn)
        self.schedule()

    def on_have(self, p: Peer, v: int, gained: int) -> None:
        if self.mode is DIRECT:
            self._rr_add(p.conn)
        elif self.mode is REGIONS and p.border and gained:
            plan = self.plans.get(v, {}).get(p.region)
            if plan is not None:
                now = self.host.now
                for i in iter_bits(gained & plan.infl):
                    src, _dst, d, t0 = plan.inflight[i]
                    if t0 is not None:  # None: a relay on arrival that never started
                        self.host.log("debug", "region_delivered", version=v, index=i,
                                      region=p.region, border=p.node_id,
                                      via="push" if src == ORIGIN_SRC else "relay",
                                      s=round(now - t0, 4))
                    # A version's short last chunk (a few bytes past the last full one)
                    # times no path: counted as a chunk, its 0.2 s made pushes look
                    # faster than relays and sent a second copy of a chunk into a region
                    full = self._full_size(v, i)
                    if full and self._via_uplink(plan, src):
                        # a push's deadline was set when its last byte left (``on_sent``)
                        sent = (d - self.cfg.request_timeout_s
                                if src == ORIGIN_SRC and d is not None else None)
                        was = self.window.w
                        self.window.delivered(1, now, self._uplink_busy() >= self._uplink_limit(),
                                              t0, sent, self._uplink_backlog())
                        self._window_moved(was, "have")
                    # measured delivery time into the region, per path kind (routing)
                    if full and t0 is not None:
                        table = self.push_s if src == ORIGIN_SRC else self.relay_s
                        old = table.get(p.region)
                        table[p.region] = now - t0 if old is None else 0.7 * old + 0.3 * (now - t0)
                        s = self.host.peers.get(src) if src != ORIGIN_SRC else None
                        if s is not None:
                            self._path_sample((s.region, p.region), now - t0)
                        if src == ORIGIN_SRC:
                            self._push_timed(p.conn, p.region, (v, i), now - t0)
                    if src != ORIGIN_SRC:
                        plan.relayed_at = now
                    self._drop_inflight(plan, i)
                plan.sent |= gained
                self._relays_start(v, p, gained, now)
        self.schedule()

    def _relays_start(self, v: int, p: Peer, gained: int, now: float) -> None:
        """Border ``p`` now holds ``gained``: relays we ordered it ahead of the chunk
        (relay on arrival) start now; their timing and deadline count from here."""
        for plan in self.plans.get(v, {}).values():
            if plan.infl & gained:
                for i in iter_bits(plan.infl & gained):
                    e = plan.inflight[i]
                    if e[0] == p.conn and e[3] is None:
                        e[2] = now + 2 * self.cfg.request_timeout_s
                        e[3] = now
                        p.relay_busy += 1

    def on_relay_fail(self, p: Peer, v: int, i: int, target: str) -> None:
        p.links.discard(target)
        tc = self.host.by_id.get(target)
        t = self.host.peers.get(tc) if tc is not None else None
        if t is not None:
            plan = self.plans.get(v, {}).get(t.region)
            if plan is not None and i in plan.inflight and plan.inflight[i][0] == p.conn:
                self._drop_inflight(plan, i)
        self.schedule()

    def on_relay_alive(self, p: Peer, v: int, i: int, target: str) -> None:
        """Border ``p`` says its relay of chunk ``i`` of ``v`` to ``target`` is being
        acknowledged: the relay's deadline is at least ``request_timeout_s`` from now.
        Only the relay we ordered ``p`` to carry out, from ``p`` to that target, moves
        (also one ordered ahead of its chunk, which ``p`` forwards as it arrives), and at
        most ``RELAY_ALIVE_MAX x request_timeout_s`` after it started; a report for
        anything else (stale, or already arrived) is ignored."""
        tc = self.host.by_id.get(target)
        t = self.host.peers.get(tc) if tc is not None else None
        plan = self.plans.get(v, {}).get(t.region) if t is not None else None
        e = plan.inflight.get(i) if plan is not None else None
        if e is None or e[0] != p.conn or e[1] != tc:
            return
        rt = self.cfg.request_timeout_s
        if e[3] is not None and self.host.now - e[3] > RELAY_ALIVE_MAX * rt:
            return  # a border cannot hold a region's chunk forever by saying so
        due = self.host.now + rt
        if e[2] is None or due > e[2]:
            e[2] = due
            self.host.counters.relay_alive += 1

    def on_sent(self, conn: int, v: int, i: int) -> bool:
        region = self.pushes.pop((conn, v, i), None)
        if region is None:
            return False
        if region:
            plan = self.plans.get(v, {}).get(region)
            if plan is not None and i in plan.inflight:
                entry = plan.inflight[i]
                if entry[0] == ORIGIN_SRC and entry[2] is None and plan.remote:
                    fast_s = self.cfg.fast_startup_s
                    timed = entry[3] is not None and self._full_size(v, i)
                    # the uplink window's start-up on departures, while it runs
                    start_up = timed and fast_s > 0 and self.window.on_departures
                    full = start_up and self._uplink_busy() >= self._uplink_limit()
                    self.uplink_pushes -= 1  # it has left: the uplink takes the next one
                    if timed:
                        if start_up:
                            was = self.window.w
                            self.window.left(self.host.now, entry[3], fast_s, full,
                                             self._uplink_backlog(), self._oldest_push())
                            self._window_moved(was, "left")
                        dt = self.host.now - entry[3]
                        if dt < fast_s:
                            if entry[3] > self.fast_mark:
                                self.fast_mark, self.fast_took = entry[3], dt
                            elif entry[3] == self.fast_mark:
                                self.fast_took = max(self.fast_took, dt)
                            self.fast_regions.add(region)
                        old = self.leave_s.get(region)
                        self.leave_s[region] = dt if old is None else 0.7 * old + 0.3 * dt
                entry[2] = self.host.now + self.cfg.request_timeout_s
        return True

    def _oldest_push(self) -> float | None:
        """When the oldest push into a remote region still leaving was issued."""
        oldest = None
        for plans in self.plans.values():
            for plan in plans.values():
                if plan.remote and plan.infl:
                    for e in plan.inflight.values():
                        if (e[0] == ORIGIN_SRC and e[2] is None and e[3] is not None
                                and (oldest is None or e[3] < oldest)):
                            oldest = e[3]
        return oldest

    def on_acked(self, conn: int) -> None:
        """A push handed over on ``conn`` is still being acknowledged: its deadline
        counts from now. A push into a region behind a long lossy path can need longer
        than ``request_timeout_s`` after its last byte left (1 % loss, 150 ms: 13 s), and
        its deadline then sent the chunk into the region twice."""
        if any(e[0] == ORIGIN_SRC and e[1] == conn and e[2] is not None
               for plans in self.plans.values() for plan in plans.values()
               for e in plan.inflight.values()):
            self.acked_until[conn] = self.host.now + self.cfg.request_timeout_s

    def on_path_sample(self, conn: int, queued: bool, rtt: float, ramping: bool) -> None:
        """A push leaving on ``conn`` sampled its path (``clear_startup``). A queue on
        every push leaving now is a full bottleneck all of them cross, the site uplink:
        the clear run ends. A queue on some only is their borders' downlinks, which say
        nothing of the uplink. A clear sample from a window no longer opening starts a
        clear run, if none is on; one still opening (TCP's slow start, BBR's start-up:
        a thin uplink looks clear until the window fills it) counts only as no queue."""
        if not self.cfg.clear_startup or self.mode is not REGIONS:
            return
        home = self.cfg.region
        leaving = {c for (c, _v, _i), r in self.pushes.items() if r and r != home}
        if conn not in leaving:
            return
        now = self.host.now
        self.path_seen[conn] = (now, queued)
        if not queued:
            if ramping:
                return
            if self.clear_since is None:
                self.clear_since, self.clear_rtt = now, rtt
                self.host.log("debug", "uplink_clear_run", conn=conn, rtt_ms=round(rtt * 1e3, 1))
            else:
                self.clear_rtt = max(self.clear_rtt, rtt)  # the longest path's slow start
            if self._clear_for(CLEAR_RTTS) and not self.clear_logged:
                self.clear_logged = True
                self.host.log("info", "uplink_clear", since=round(self.clear_since, 3),
                              rtt_ms=round(self.clear_rtt * 1e3, 1))
                self.schedule()
            return
        # (a push not sampled within two round trips says nothing either way yet)
        fresh = 2.0 * max(rtt, self.clear_rtt)
        recent = [seen[1] for c in leaving
                  if (seen := self.path_seen.get(c)) is not None and now - seen[0] <= fresh]
        if all(recent):
            if self.clear_logged:
                self.clear_logged = False
                self.host.log("info", "uplink_queued")
            elif self.clear_since is not None:
                self.host.log("debug", "uplink_clear_run_ended", conn=conn,
                              s=round(now - self.clear_since, 3))
            self.clear_since = None

    def _clear_for(self, rtts: float) -> bool:
        """Whether the pushes' paths have shown no queue on the site uplink for ``rtts``
        round trips (from the first clear sample since the last queue on all of them)."""
        return (self.clear_since is not None
                and self.host.now - self.clear_since >= rtts * self.clear_rtt)

    def _due(self, entry: list) -> float | None:
        """When an in-flight transfer times out: its deadline, or for a push whose bytes
        are still being acknowledged (``on_acked``) the later of that and the ack's.
        (The deadline itself stays: the uplink window reads the hand-off time from it.)"""
        d = entry[2]
        if d is not None and entry[0] == ORIGIN_SRC:
            a = self.acked_until.get(entry[1])
            if a is not None and a > d:
                return a
        return d

    def _drop_inflight(self, plan: RegionPlan, i: int) -> None:
        src, _dst, d, t0 = plan.inflight.pop(i)
        plan.infl &= ~(1 << i)
        if src == ORIGIN_SRC:
            if plan.remote and d is None:
                self.uplink_pushes -= 1
        elif t0 is not None:  # a relay order still waiting for its chunk holds no slot
            s = self.host.peers.get(src)
            if s is not None and s.relay_busy > 0:
                s.relay_busy -= 1

    # ------------------------------------------------------------------ timers
    def next_wakeup(self) -> float | None:
        t = None
        for due, *_ in self.graces:
            if t is None or due < t:
                t = due
        for plans in self.plans.values():
            for plan in plans.values():
                for entry in plan.inflight.values():
                    d = self._due(entry)
                    if d is not None and (t is None or d < t):
                        t = d
        return t

    def tick(self) -> None:
        now = self.host.now
        changed = False
        for conn in [c for c, a in self.acked_until.items() if a <= now]:
            del self.acked_until[conn]
        for v, plans in self.plans.items():
            for r, plan in plans.items():
                for i, entry in list(plan.inflight.items()):
                    d = self._due(entry)
                    if d is not None and d <= now:
                        self.host.log("info", "region_transfer_timeout", version=v, region=r, index=i)
                        self._drop_inflight(plan, i)
                        changed = True
        if self.graces:
            keep = []
            for g in self.graces:
                due, r, v, lost = g
                if due > now:
                    keep.append(g)
                    continue
                plan = self.plans.get(v, {}).get(r)
                if plan is None:
                    continue
                held = 0
                for b in self.borders.get(r, []):
                    held |= b.bits.get(v, 0)
                gone = lost & ~held
                if gone:
                    plan.sent &= ~gone
                    self.host.log("info", "region_resend", version=v, region=r, chunks=gone.bit_count())
                    changed = True
            self.graces = keep
        if changed:
            self.schedule()

    # ------------------------------------------------------------------ scheduling
    def _rr_add(self, conn: int) -> None:
        if conn not in self.rr_set:
            self.rr_set.add(conn)
            self.rr.append(conn)

    def _push(self, p: Peer, v: int, i: int, region: str) -> None:
        self.pushes[(p.conn, v, i)] = region
        self.host.send_chunk(p.conn, v, i)

    def schedule(self) -> None:
        if not self.versions:
            return
        if self.mode is DIRECT:
            self._schedule_direct()
        elif self.mode is REGIONS:
            self._schedule_regions()

    def _schedule_direct(self) -> None:
        host, slots = self.host, self.cfg.upload_slots
        while len(self.pushes) < slots and self.rr:
            conn = self.rr.popleft()
            self.rr_set.discard(conn)
            p = host.peers.get(conn)
            if p is None or not p.ready:
                continue
            pushed = self.pushed.setdefault(conn, {})
            for v in self.versions:
                st = host.holding(v)
                if v not in p.bits or st is None:
                    continue
                need = st.full & ~p.bits[v] & ~pushed.get(v, 0)
                if need:
                    i = first_pick(need, st.short)
                    pushed[v] = pushed.get(v, 0) | (1 << i)
                    self._push(p, v, i, "")
                    if need & (need - 1):
                        self._rr_add(conn)
                    break

    def _schedule_regions(self) -> None:
        host, c = self.host, self.cfg
        now = host.now
        for v in self.versions:
            st = host.holding(v)
            if st is None:
                continue
            full = st.full
            plans = self.plans[v]
            holders: dict[str, list[Peer]] = {}
            rbits: dict[str, int] = {}
            union = 0  # chunks that entered (or are entering) a region remote from the origin
            for r, lst in self.borders.items():
                # only borders that showed the version take its chunks: one that has
                # not may skip it (it took a newer anchor, or the version is outside
                # the window it accepts), and a chunk it drops would hold a slot of the
                # uplink window until it times out. The newest version, just
                # published, counts as shown on every linked border (``on_publish``):
                # its ANNOUNCE is ahead of our pushes on the link, and the echo would
                # cost a round trip before the first byte
                hs = [b for b in lst if b.ready and v in b.bits]
                holders[r] = hs
                bits = 0
                for b in hs:
                    bits |= b.bits.get(v, 0)
                plan = plans.get(r)
                if plan is None and hs:
                    plan = plans[r] = RegionPlan(now, remote=r != c.region)
                if plan is not None:
                    bits |= plan.sent | plan.infl
                rbits[r] = bits
                if r != c.region:
                    union |= bits
            # One transfer per region per pass, regions taking in the fewest transfers
            # first (an idle downlink is the waste to avoid: a region that relays
            # another region's chunks in should not also get the origin's next push
            # while its neighbour idles), then those furthest behind. Passes, not one
            # region filled before the next: the site uplink's window is shared, and
            # filling the first region's share would leave the others idle.
            loads = {r: self._loads(plans[r]) for r in holders if holders[r]}
            active = list(loads)
            while active:
                active.sort(key=lambda r: (len(plans[r].inflight), rbits[r].bit_count()))
                took = []
                for r in active:
                    missing = full & ~rbits[r]
                    if not missing:
                        continue
                    i = self._feed_one(v, r, holders[r], plans[r], loads[r], missing, now,
                                       union, rbits)
                    if i < 0:
                        continue
                    took.append(r)
                    rbits[r] |= 1 << i
                    if r != c.region:
                        union |= 1 << i
                active = took

    def _feed_one(self, v: int, r: str, bs: list[Peer], plan: RegionPlan, load: dict[int, int],
                  missing: int, now: float, union: int, rbits: dict[str, int]) -> int:
        """Start one transfer of a chunk region ``r`` misses: a relay if a border of
        another region can carry one, else a push. The chunk's index, or -1."""
        i = self._relay_one(v, r, bs, plan, load, missing, now, union, home_ok=False)
        if i >= 0:
            return i
        # Novel chunks first (no remote region has them): they can be relayed on. A
        # second copy into the remote regions only once the origin's own pushes into
        # them have left (its uplink is often its site's thin uplink, shared by every
        # region: a second copy there delays the first of others), and not of what a
        # region linked to this one holds and can relay now (unless relays into it
        # stalled).
        cand = missing & ~union
        if not cand:
            relayable = self._relayable(v, r, rbits, plan, now)
            if relayable is None or self._direct_faster(r):
                cand = missing  # no region can relay into r (or r is home)
            elif not self.pushes_leaving():
                cand = missing & ~relayable
        i = self._push_one(v, r, bs, plan, load, cand) if cand else -1
        if i < 0:
            # no push: a border of another region may take the order for a chunk we are
            # pushing to it, carried out as soon as it is stored (relay on arrival)
            i = self._relay_one(v, r, bs, plan, load, missing, now, union, home_ok=False,
                                ahead=True)
        if i < 0 and r != self.cfg.region:
            # the origin's own pushes are at their limit (``push_slots``, its borders'
            # slots): its region's borders may carry novel chunks out, on the same uplink
            i = self._relay_one(v, r, bs, plan, load, missing, now, union, home_ok=True)
        return i

    def _path_sample(self, key: tuple[str, str], dt: float) -> None:
        """A relay on path ``key`` (source region, region) took ``dt``; log a change of
        its standing as a relay source."""
        was = self._slow_source(*key)
        old = self.path_s.get(key)
        self.path_s[key] = dt if old is None else 0.7 * old + 0.3 * dt
        self.path_n[key] = self.path_n.get(key, 0) + 1
        if self._slow_source(*key) != was:
            self.host.log("info", "relay_path_slow" if not was else "relay_path_ok",
                          source=key[0], region=key[1], relay_s=round(self.path_s[key], 3),
                          push_s=round(self.push_s.get(key[1], 0.0), 3))

    def _slow_source(self, src: str, r: str) -> bool:
        """Whether region ``src`` is no relay source for region ``r``: its relays into
        ``r`` have been taking ``slow_relay_factor`` x what a push into ``r`` takes
        (both measured, EWMA; the path over at least ``MIN_PATH_SAMPLES`` relays).
        Routing per region compared a region's pushes with its relays from any region:
        in the simulator's ``upload-bound`` the core regions took chunks from the edge
        region, whose hosts send at 100 Mbit/s (3.4-3.9 s a chunk, against 0.2 s for a
        push from the 10 Gbit trainer), because relays between the two core regions were
        fast. Such chunks are pushed instead, or relayed from a faster source; copies
        into ``r`` stay one. An excluded path is
        measured no more, but the push it is compared with is: where the origin's uplink
        is thin, the pushes that replace its relays slow the origin's pushes down, and the
        path is used again once it is no longer ``slow_relay_factor`` x as slow. (Letting
        its estimate decay so that it is tried again cost ``lossy-long-bbr``'s later
        versions 6-17 %: a relay there runs over a cold 150 ms connection.)"""
        f = self.cfg.slow_relay_factor
        if f <= 0 or self.path_n.get((src, r), 0) < MIN_PATH_SAMPLES:
            return False
        path, push = self.path_s.get((src, r)), self.push_s.get(r)
        return path is not None and push is not None and path > f * push

    def _first(self, v: int, cand: int) -> int:
        """The chunk of ``cand`` to push or relay next: the version's short last chunk
        first, then the lowest (``picker.first_pick``)."""
        st = self.host.holding(v)
        return first_pick(cand, st.short if st is not None else 0)

    def _full_size(self, v: int, i: int) -> bool:
        """Whether chunk ``i`` of ``v`` is at least half a full chunk: only such transfers
        time a path (``push_s``, ``relay_s``, ``cold_s``, the uplink window's rounds)."""
        return self.host.full_size(v, i)

    def _direct_faster(self, r: str) -> bool:
        """Whether a chunk has been reaching region ``r`` sooner pushed by the origin than
        relayed from another region (measured). A relay into ``r`` not measured yet is
        guessed as slow as a first push on a border connection (``cold_s``): its
        border-to-border connection has carried no chunk either, so TCP starts it at its
        initial window; on a long round trip that costs more than a push on a warm
        connection (150 ms: 1.2 s against 0.1 s for 4 MiB). Nothing measured: no."""
        push, relay = self.push_s.get(r), self.relay_s.get(r)
        if relay is None:
            relay = self.cold_s
        return push is not None and relay is not None and push < relay

    def _via_uplink(self, plan: RegionPlan, src: int) -> bool:
        """Whether a transfer into ``plan``'s region from ``src`` crosses the origin's
        site uplink: a push into a remote region, or a relay by a border of its own."""
        if not plan.remote:
            return False
        if src == ORIGIN_SRC:
            return True
        s = self.host.peers.get(src)
        return s is not None and s.region == self.cfg.region

    def pushes_leaving(self) -> bool:
        home = self.cfg.region
        return any(r and r != home for r in self.pushes.values())

    def _uplink_limit(self) -> int:
        """Transfers allowed through the site uplink: the measured window, which never
        drops below one per remote region with a border, so that no region's downlink
        idles while the window is still small (its start-up, on the first version); no
        limit while the pushes' paths have long shown no queue (``on_path_sample``)."""
        home = self.cfg.region
        self.window.raise_floor(sum(1 for r, bs in self.borders.items() if r != home and bs))
        if self._clear_for(CLEAR_RTTS):
            return self.window.hi  # the uplink has room: it is not the limit
        return self.window.w

    def _uplink_free(self, r: str, plan: RegionPlan) -> bool:
        """Whether one more transfer into remote region ``r`` may cross the site uplink:
        the window has room, and ``r`` holds no more than its fair share of it while
        another remote region (with a border) holds less. Without the share the first
        region to show a version would take the whole window and the others' downlinks
        would idle, on the first version with the window at its floor."""
        limit = self._uplink_limit()
        if self._uplink_busy() >= limit:
            return False
        home = self.cfg.region
        remote = [x for x, bs in self.borders.items() if x != home and bs]
        if len(remote) < 2:
            return True
        share = -(-limit // len(remote))
        into = self._uplink_by_region()
        if into.get(r, 0) < share:
            return True
        return not any(into.get(x, 0) < share and self._wants(x) and not self._push_capped(x)
                       for x in remote if x != r)

    def _push_capped(self, r: str) -> bool:
        """Whether remote region ``r`` takes no more direct pushes now: its path from the
        origin is slow, ``slow_path_factor`` x the fastest other region's measured push
        (a push still under way counts as taking at least its age so far), and one is
        under way. A region behind a slow direct link gets its pushes one at a time and
        the rest of its copy by relay; the uplink window's other slots go to the others.
        Before any HAVE has timed a push (the first version's first tenths of a second),
        a region none of whose pushes has left within ``fast_startup_s`` counts as slow
        while a push into it is still leaving that was issued no later than one into
        another region that did leave that fast, and has been leaving at least as long
        as that one took (pushes share the uplink: the difference is the path's). "At
        least": at the moment the fast one leaves, a push issued with it that has not
        left is no faster, and a second push down its path would share it (round 49)."""
        f = self.cfg.slow_path_factor
        if f <= 0:
            return False
        now = self.host.now
        oldest = None
        leaving = None  # the oldest push into r still leaving us
        for plans in self.plans.values():
            plan = plans.get(r)
            if plan is not None and plan.infl:
                for e in plan.inflight.values():
                    if e[0] != ORIGIN_SRC:
                        continue
                    if oldest is None or e[3] < oldest:
                        oldest = e[3]
                    if e[2] is None and e[3] is not None and (leaving is None or e[3] < leaving):
                        leaving = e[3]
        if oldest is None:
            return False  # nothing under way: one may go
        if (leaving is not None and leaving <= self.fast_mark and r not in self.fast_regions
                and now > leaving and now - leaving >= self.fast_took
                and self.cfg.fast_startup_s > 0):
            # No push into r has left fast, and one issued with or after this one did,
            # into another region, in no more time than this one has been leaving: r's
            # direct path is slower than the uplink. Known before any HAVE could time it
            # (`slow-direct`: at the first departure, 34 ms, not ~0.2 s).
            return True
        home = self.cfg.region  # pushes at home cross no uplink: no measure for remote paths
        others = [s for x, s in self.push_s.items() if x != r and x != home]
        if not others:
            return False
        took = max(self.push_s.get(r, 0.0), now - oldest)
        return took > f * min(others)

    def _uplink_by_region(self) -> dict[str, int]:
        """Transfers crossing the site uplink now, per remote region they go into."""
        into: dict[str, int] = {}
        for plans in self.plans.values():
            for x, plan in plans.items():
                if plan.remote and plan.infl:
                    n = sum(1 for e in plan.inflight.values()
                            if self._via_uplink(plan, e[0]) and (e[0] != ORIGIN_SRC or e[2] is None))
                    if n:
                        into[x] = into.get(x, 0) + n
        return into

    def _wants(self, r: str) -> bool:
        """Whether region ``r`` still misses chunks of a version being seeded, or has not
        shown the newest yet (its borders' echo of the ANNOUNCE is a round trip away; an
        older version it has not shown it may skip, so that one does not count)."""
        newest = max(self.versions)
        for v, plans in self.plans.items():
            st = self.host.holding(v)
            if st is None:
                continue
            plan = plans.get(r)
            if plan is None:
                if v == newest:
                    return True
            elif (plan.sent | plan.infl) != st.full:
                return True
        return False

    def _window_moved(self, was: int, how: str) -> None:
        """A debug line where the uplink window changed (``how``: the round that moved it,
        on a HAVE, a departure, or the restart between versions)."""
        win = self.window
        if win.w != was:
            self.host.log("debug", "uplink_window", how=how, w_from=was, w=win.w,
                          startup=win.startup, flat=win.flat, best_w=win.best_w,
                          rate=round(win.last_rate, 2), best=round(win.best, 2),
                          backlog=self._uplink_backlog())

    def _uplink_backlog(self) -> int:
        """Transfers still to cross the site uplink (the uplink window's start-up grows
        only into these): chunks held here that are in no remote region yet and not on
        their way to one, and what a remote region misses that it takes from the origin
        rather than by relay (pushes measured faster, or no relays)."""
        n = 0
        for v, plans in self.plans.items():
            st = self.host.holding(v)
            if st is None:
                continue
            crossed = 0
            for plan in plans.values():
                if plan.remote:
                    crossed |= plan.sent | plan.infl
            n += popcount(st.full & ~crossed)
            for r, plan in plans.items():
                if plan.remote and (not self.cfg.relay or self._direct_faster(r)):
                    n += popcount(crossed & ~(plan.sent | plan.infl))
        return n

    def _uplink_busy(self) -> int:
        """Transfers through the origin's site uplink: its pushes into remote regions
        until they have left, and the relays its own region's borders carry until
        the HAVE."""
        n = self.uplink_pushes
        for b in self.borders.get(self.cfg.region, []):
            n += b.relay_busy
        return n

    def _relayable(self, v: int, r: str, rbits: dict[str, int], plan: RegionPlan,
                   now: float) -> int | None:
        """Chunks region ``r`` misses that another remote region, linked to ``r``'s
        borders, holds: they go in by relay. Nothing while relays into ``r`` have
        stalled for ``relay_wait_s`` (the origin then pushes them itself); None when
        no other remote region is linked to ``r`` at all."""
        c = self.cfg
        if not c.relay or r == c.region:
            return None
        ids = {b.node_id for b in self.borders.get(r, [])}
        held = 0
        linked = False
        for r2, lst in self.borders.items():
            if r2 in (r, c.region):
                continue
            slow = self._slow_source(r2, r)
            for b in lst:
                if b.ready and b.links & ids:
                    linked = True
                    if not slow:
                        held |= b.bits.get(v, 0)
        if not linked:
            return None
        held &= ~rbits.get(r, 0)
        if not held:
            plan.relayed_at = now  # nothing to relay yet: relays are not stalled
        elif now - plan.relayed_at > c.relay_wait_s:
            return 0
        return held

    @staticmethod
    def _loads(plan: RegionPlan) -> dict[int, int]:
        """Transfers occupying each border's inbound slots (conn -> count).

        A push occupies a slot until its last byte has left the origin
        (``ChunkSent``; its deadline is then set), not until the border's HAVE
        comes back: waiting a round trip per chunk would leave the border's
        downlink idle for most of the time on long links. A relay occupies its
        slot until the HAVE (the origin does not see it leave).
        """
        load: dict[int, int] = {}
        for src, dst, d, _t0 in plan.inflight.values():
            if src != ORIGIN_SRC or d is None:
                load[dst] = load.get(dst, 0) + 1
        return load

    def _target(self, bs: list[Peer], load: dict[int, int],
                allowed: set[str] | None = None, warm: int | None = None,
                used: set[int] | None = None, depth: int = 0) -> Peer | None:
        """The border of ``bs`` with a free inbound slot to send to: ``warm`` (the
        connection the sender used last into this region) if it has one, else the least
        loaded of those the sender has sent a chunk to before (``used``, up to ``depth``
        each: ``_used_depth``), else the least loaded. A connection that has carried
        chunks has its TCP window open, and BBR (what nodes ask for) keeps it across
        idle; a new one starts from the initial window: at 150 ms a 4 MiB chunk takes
        ~1.2 s over it against ~0.1 s over a warm one (`lossy-long-bbr`,
        docs/simulation.md round 19). A connection of a loss-based algorithm left idle
        restarts from slow start too (Linux's default), so staying on ``warm`` still
        pays there."""
        best = best_used = None
        best_n = self.cfg.border_inflight
        best_used_n = max(depth, self.cfg.border_inflight) if used else 0
        for b in bs:
            if allowed is not None and b.node_id not in allowed:
                continue
            n = load.get(b.conn, 0)
            if b.conn == warm and n < self.cfg.border_inflight:
                return b
            if n < best_n:
                best = b
                best_n = n
            if used and b.conn in used and n < best_used_n:
                best_used = b
                best_used_n = n
        return best_used if best_used is not None else best

    def _push_timed(self, conn: int, region: str, chunk: tuple[int, int], dt: float) -> None:
        """A full push over border connection ``conn`` into ``region`` took ``dt`` from
        order to HAVE: the first on that connection updates ``cold_s`` and the region's
        cold figure, a later one the region's warm one (a second push stacked behind the
        first is neither: it waited for the first's slow start)."""
        cp = self.cold_paths.get(region)
        if cp is None:
            cp = self.cold_paths[region] = ColdPath()
        if self.first_push.get(conn) == chunk:
            del self.first_push[conn]
            c = self.cold_s
            self.cold_s = dt if c is None else 0.7 * c + 0.3 * dt
            cp.cold(dt)
        elif conn not in self.first_push:
            cp.warm(dt)
        else:
            return
        if cp.judge(self.cfg.cold_path_factor):
            self.host.log("info", "fresh_connections_slow" if cp.slow else "fresh_connections_ok",
                          region=region, cold_s=round(cp.cold_s or 0.0, 3),
                          warm_s=round(cp.warm_s or 0.0, 3))

    def _used_depth(self, region: str) -> int:
        """Transfers a used border of ``region`` may hold at once (``_target``):
        ``border_inflight``, or, where a fresh connection into it is measured slow, as
        many as still land before a chunk over a fresh one would (``ColdPath.depth``).
        (`lossy-long-bbr`: versions 1-4 -4 / -36 / +8 / +2 % against staying at
        ``border_inflight``; docs/simulation.md round 20.)"""
        cp = self.cold_paths.get(region)
        return self.cfg.border_inflight if cp is None else cp.depth(self.cfg.border_inflight)

    def _stay_used(self, used: set[int] | None, region: str) -> set[int] | None:
        """``used`` (connections the sender has sent chunks on) where a fresh connection
        into ``region`` is measured to cost more than queueing on a used one, else None:
        ``_target`` then takes the least loaded border. The measure (``_push_timed``,
        per region): first pushes over fresh border connections into it took
        ``cold_path_factor`` x the fastest push over a used one or more. On a long round
        trip slow start makes a fresh connection slow (150 ms: ~1.2 s for 4 MiB against
        ~0.1 s warm); where it costs little (a short fat path, a network without slow
        start) staying would only pile transfers onto the first borders used
        (docs/simulation.md round 20). Per region: the origin's own region is a LAN, and
        a push there against first pushes across a thin uplink is bandwidth, not slow
        start (round 21)."""
        cp = self.cold_paths.get(region)
        return used if used and cp is not None and cp.slow else None

    def _push_target(self, bs: list[Peer], load: dict[int, int], warm: int | None,
                     region: str) -> Peer | None:
        """The border of ``bs`` a push goes to: ``_target`` (the warm connection, stacked
        up to ``border_inflight``), except with ``spread_pushes`` (off by default: on a
        thin uplink the window's probe then becomes a parallel flow, docs/simulation.md
        round 17) after the uplink window's start-up, where a push
        does not queue behind a transfer on the warm border while another border whose
        connection has carried a push of ours (``pushed_to``: its window open, and BBR
        keeps it across idle) has none in flight. Queued behind the warm one, the push
        added nothing a probe of the window could measure: where the origin's uplink is
        fat and each border's downlink the limit (a fleet), a window of one push per region
        probed one more and always found it paid nothing, and stayed there (fleet-1k's
        second version 1.21-1.23x its bound on two seeds of three against 1.14x,
        docs/simulation.md round 17). A border the origin never pushed to is not taken for
        this (its connection would start from slow start). Start-up keeps stacking: its
        doubled rounds on a thin uplink would otherwise put every push on the wire at once.

        Except while the start-up grows on departures (``spread_startup``: every push so
        far left within ``fast_startup_s``, so the uplink is not what holds them): then a
        push goes to a border with nothing in flight (the warm one first) rather than
        stack behind a push on the warm border. Each border's downlink is the limit
        there, and a push stacked on one border leaves only after the one ahead of it, so
        the window opened by one push per border-downlink time; spread, the departures
        come from every border at once and the window doubles once per push time
        (`slow-direct`'s first version, 3 to 20 in flight at 0.19 s stacked; fleet-1k's
        first versions -0.4 to -1.2 %; docs/simulation.md round 48). A first version's
        connections are all fresh, and several fresh ones ramp up together faster than one.
        A thin uplink never gets here: its first push takes ``fast_startup_s`` to leave
        and ends the start-up before the window lets a second push into a region go. Not
        where a fresh connection into the region was measured slow (``_stay_used``)."""
        if (self.cfg.spread_startup and self.cfg.fast_startup_s > 0 and self.window.on_departures
                and self._stay_used(self.pushed_to, region) is None):
            idle = None
            for b in bs:
                if not load.get(b.conn, 0):
                    if b.conn == warm:
                        return b
                    if idle is None:
                        idle = b
            if idle is not None:
                return idle
        if self.window.startup or not self.cfg.spread_pushes:
            return self._target(bs, load, warm=warm, used=self._stay_used(self.pushed_to, region),
                            depth=self._used_depth(region))
        for b in bs:
            if b.conn == warm and not load.get(b.conn, 0):
                return b
        for b in bs:
            if b.conn in self.pushed_to and not load.get(b.conn, 0):
                return b
        return self._target(bs, load, warm=warm, used=self._stay_used(self.pushed_to, region),
                            depth=self._used_depth(region))

    def _relay_one(self, v: int, r: str, bs: list[Peer], plan: RegionPlan, load: dict[int, int],
                   missing: int, now: float, union: int, home_ok: bool,
                   ahead: bool = False) -> int:
        home = self.cfg.region
        if not self.cfg.relay or r == home:
            return -1  # the origin's own region is fed locally, never across a border
        # Sources outside the origin's own region: they spare its site uplink. A border
        # of the origin's own region (``home_ok``: when the origin cannot push) sends
        # through that same uplink, so it relays only what no remote region has (as the
        # origin would push it).
        for r2 in self.borders:
            lst = self.borders[r2]
            if r2 == r or (r2 == home and not home_ok) or self._slow_source(r2, r):
                continue
            mask = missing & ~union if r2 == home else missing
            if r2 == home and not self._uplink_free(r, plan):
                continue  # they share the origin's site uplink with its remote pushes
            if not mask:
                continue
            for b in lst:
                if not b.links:
                    continue
                extra = False
                if ahead:
                    # relay on arrival (``relays``): a chunk we are pushing to b now goes
                    # on the moment b stores it, without b's HAVE and our order in between
                    # (``_ahead_room``; it takes a relay slot once the chunk is there)
                    room = None if r2 == home else self._ahead_room(b)
                    cand = 0 if room is None else self._incoming(v, r2, b) & mask
                    extra = bool(room)
                elif b.relay_busy < self.cfg.relay_slots:
                    cand = b.bits.get(v, 0) & mask
                else:
                    continue
                if not cand:
                    continue
                t = (self._relayed_target(bs, load, b) if extra
                     else self._relay_target(bs, load, b, r))
                if t is None:
                    continue
                self.warm[(b.conn, r)] = t.conn
                self.relayed_to.setdefault(b.conn, set()).add(t.conn)
                i = self._first(v, cand)
                if not ahead:
                    b.relay_busy += 1
                load[t.conn] = load.get(t.conn, 0) + 1
                plan.inflight[i] = [b.conn, t.conn, now + 2 * self.cfg.request_timeout_s,
                                    None if ahead else now]
                plan.infl |= 1 << i
                plan.relayed_at = now
                self.host.send(b, wire.Relay(v, i, t.node_id).encode())
                self.host.log("debug", "relay_ordered", version=v, index=i, region=r,
                              border=b.node_id, target=t.node_id, on_arrival=ahead)
                return i
        return -1

    def _ahead_room(self, b: Peer) -> int | None:
        """Whether border ``b`` may take a relay order for a chunk still on its way to it
        (relay on arrival): None if not, else how many such orders it holds (0 or more).

        One order waits per border, but for an order whose chunk's push took
        ``2 x cut_through_after_s`` or longer to leave us (a thin site uplink): the border
        forwards such a chunk while it arrives, so once its push has left, the next order
        should be at the border by the time that relay ends, not a HAVE's round trip and
        our next decision later. On the emulated WAN's model the relays into a region
        otherwise lagged their pushes by a chunk, and each version lost up to 0.25 s
        (docs/simulation.md round 30). A push that leaves faster holds the next order back
        as before: in a fat-trainer fleet a second relay from one border only splits that
        border's uplink. At most ``AHEAD_ORDERS`` wait, and one beyond the first goes
        only over a connection ``b`` has relayed on (``_relayed_target``).

        Where pushes into ``b``'s region have been leaving slowly on average
        (``_thin_path``), the next order goes once the push before it has left, however
        fast: a deep TCP window takes a push's bytes at once, so it "left" fast though its
        bytes still queue in the network, and an order held back for its HAVE instead
        travelled behind the next push, reaching ``b`` 0.3-0.9 s after that chunk's first
        block (docs/benchmarks.md round 39). (Sending it before that push has left cost
        the simulator's ``lossy-long-bbr`` 5 % on its first version: an order commits the
        chunk's relay to ``b`` before the origin knows the path it is on.)"""
        slow = 2 * self.cfg.cut_through_after_s if self.cfg.cut_through else None
        if slow is not None and self._thin_path(b.region):
            slow = 0.0  # a thin path: the push before it has left, however fast
        waiting = 0
        for plans in self.plans.values():
            pushes = plans.get(b.region)
            for plan in plans.values():
                if not plan.infl:
                    continue
                for i, e in plan.inflight.items():
                    if e[0] != b.conn or e[3] is not None:
                        continue
                    waiting += 1
                    if waiting >= AHEAD_ORDERS or not self._left_slowly(pushes, i, slow):
                        return None
        return waiting

    def _relay_target(self, bs: list[Peer], load: dict[int, int], b: Peer,
                      r: str) -> Peer | None:
        """The border of region ``r`` (``bs``) that border ``b`` relays its next chunk to.

        Once ``b`` has relayed into ``r``, only over a connection it has relayed on: the
        last one (``warm``) while it holds fewer than ``border_inflight`` transfers, else
        the least loaded of them below one more than that (or ``_used_depth``), else
        none: the order waits for a slot there. A fresh connection only for ``b``'s first
        relay into ``r`` (``_target``). A second connection between the same two regions
        adds nothing to the inlet they share, and starts in slow start beside a full one:
        on the emulated WAN such relays took 1.0-4.5 s for 4 MiB against 0.1-0.9 s over a
        used one, in half the versions of round 30's code, and set those versions' tails
        (docs/benchmarks.md round 31).

        Only into a region whose pushes leave us slowly (``_thin_path``). Where they
        leave fast (a fat trainer, borders whose own downlinks are the limit, not one
        shared inlet) another connection into the region adds capacity: there the rule
        held relays on one target per border, and ``fleet-10k``'s second version went
        from 1.157x to 1.230x its bound (docs/simulation.md round 32)."""
        warm = self.warm.get((b.conn, r))
        used = self.relayed_to.get(b.conn)
        if (not used or not self._thin_path(r)
                or not any(t.conn in used and t.node_id in b.links for t in bs)):
            return self._target(bs, load, b.links, warm, self._stay_used(used, r),
                                self._used_depth(r))
        return self._used_target(bs, load, warm, used, b.links, r)

    def _thin_path(self, r: str) -> bool:
        """Whether our pushes into region ``r`` have been taking ``2 x cut_through_after_s``
        (0.4 s) or longer from start to last byte (EWMA): 4 MiB at under ~84 Mbit/s, a
        thin site uplink or inlet. Not measured yet: no."""
        slow = 2 * self.cfg.cut_through_after_s if self.cfg.cut_through else None
        dt = self.leave_s.get(r)
        return slow is not None and dt is not None and dt >= slow

    def _used_target(self, bs: list[Peer], load: dict[int, int], warm: int | None,
                     used: set[int], allowed: set[str] | None, r: str) -> Peer | None:
        """The border of region ``r`` (``bs``, those in ``allowed``) whose connection
        from the sender is in ``used`` to send to: ``warm`` (the one it sent on last) while
        it holds fewer than ``border_inflight`` transfers, else the least loaded of them
        below one more than that (or ``_used_depth``), else None: the transfer waits."""
        best, best_n = None, max(self._used_depth(r), self.cfg.border_inflight + 1)
        for t in bs:
            if t.conn not in used or (allowed is not None and t.node_id not in allowed):
                continue
            n = load.get(t.conn, 0)
            if t.conn == warm and n < self.cfg.border_inflight:
                return t
            if n < best_n:
                best, best_n = t, n
        return best

    def _relayed_target(self, bs: list[Peer], load: dict[int, int], b: Peer) -> Peer | None:
        """The least loaded border of ``bs`` with a free inbound slot that border ``b`` is
        linked to and has relayed on before, for an order beside one already waiting at
        ``b`` (``_ahead_room``). A second relay at once over a fresh connection starts in
        slow start beside a full inlet: on the emulated WAN's first versions such relays
        took 1.3-2.6 s for 4 MiB against 0.5-0.8 s over a used one (docs/benchmarks.md
        round 30).

        Where pushes into ``b``'s region leave us slowly (``_thin_path``), one slot more:
        a relay holds its slot until the target's HAVE, which comes a queue's drain after
        the relay's last byte left ``b`` (0.3-0.6 s on the emulated WAN), and an order
        held back that long travels behind the push it is for and reaches ``b`` after
        the chunk's first bytes (docs/benchmarks.md round 39)."""
        used = self.relayed_to.get(b.conn)
        best, best_n = None, self.cfg.border_inflight + (1 if self._thin_path(b.region) else 0)
        for t in bs:
            n = load.get(t.conn, 0)
            if used and t.conn in used and t.node_id in b.links and n < best_n:
                best, best_n = t, n
        return best

    def _left_slowly(self, plan: RegionPlan | None, i: int, slow: float | None) -> bool:
        """Whether our push of chunk ``i`` in ``plan`` has left us, after ``slow`` seconds
        or more (its deadline was set when its last byte left: ``on_sent``)."""
        e = plan.inflight.get(i) if plan is not None and slow is not None else None
        if e is None or e[0] != ORIGIN_SRC or e[2] is None:
            return False
        return e[2] - self.cfg.request_timeout_s - e[3] >= slow

    def _incoming(self, v: int, r: str, b: Peer) -> int:
        """Chunks of ``v`` we are pushing to border ``b`` of region ``r`` (bitset)."""
        plan = self.plans.get(v, {}).get(r)
        out = 0
        if plan is not None and plan.infl:
            for i, (src, dst, _d, _t0) in plan.inflight.items():
                if src == ORIGIN_SRC and dst == b.conn:
                    out |= 1 << i
        return out

    def _push_one(self, v: int, r: str, bs: list[Peer], plan: RegionPlan, load: dict[int, int],
                  cand: int) -> int:
        """Push one chunk of ``cand`` into region ``r``.

        Pushes into remote regions leave through the origin's site uplink, usually the
        thinnest link of the swarm. Only ``window.w`` chunks cross it at once (counted
        until they have left, relays by the origin's own region included until their
        HAVE; the window adapts
        to the measured delivery rate, ``swarm.protocol.uplink``): many
        concurrent pushes would share the uplink and all arrive late, together, while a
        chunk that has arrived can already be relayed on by its region, whose uplink
        idles until then.
        """
        if len(self.pushes) >= self.cfg.push_slots:
            return -1
        if plan.remote and (not self._uplink_free(r, plan) or self._push_capped(r)):
            return -1
        t = self._push_target(bs, load, self.warm.get((ORIGIN_SRC, r)), r)
        if t is None:
            return -1
        self.warm[(ORIGIN_SRC, r)] = t.conn
        i = self._first(v, cand)
        if t.conn not in self.pushed_to and self._full_size(v, i):
            # (a short chunk first leaves the connection as cold as it was)
            self.pushed_to.add(t.conn)
            self.first_push[t.conn] = (v, i)
        load[t.conn] = load.get(t.conn, 0) + 1
        if plan.remote:
            self.uplink_pushes += 1
        plan.inflight[i] = [ORIGIN_SRC, t.conn, None, self.host.now]
        plan.infl |= 1 << i
        self._push(t, v, i, r)
        self.host.log("debug", "push", version=v, index=i, region=r, border=t.node_id,
                      uplink_window=self.window.w, cold=self.first_push.get(t.conn) == (v, i))
        return i
