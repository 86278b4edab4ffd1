"""Striped links in the node driver (``[network] lanes``, docs/striped-links.md).

A link may carry its chunk blocks over extra connections ("lanes"), so that one
region's inbound copy is not capped by one TCP flow on a long lossy path. Here:
the sender's seq window and lane choice, blocks asked for again (``PSQ2``) and the
receiver's stall checks, the lane offers and asks (``PST2``/``PSA2``), dialing,
accepting and reading lanes, and ``lanes = "auto"``'s probe of the link's TCP
(``RandomLoss``). ``StripedLinks`` is a part of ``node.driver.Driver`` (a mixin: it
uses the driver's loop, core, connections and counters)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from node.buffers import aligned_buffer
from node.conn import CONNECT_TIMEOUT_S, MAX_LINK_MESSAGE, Arrival, Conn, Lane
from node.link import Link, Placed, dial
from node.tcp import (
    RandomLoss,
    keeps_window_across_idle,
    limit_unsent,
    loss_share,
    path_sample,
    unacked_bytes,
)
from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import stripes, wire

log = logging.getLogger("patchswarm.node")

# a region found lossy is taken as such (its links get lanes without a probe) this long
# after the last link into it was found capped; then links probe afresh, so a loss that
# went away does not leave every new link striped
REGION_LANES_S = 600.0


class StripedLinks:
    """Striped links: the part of ``Driver`` that runs lanes (module docstring)."""

    @staticmethod
    def _take_seq(c: Conn) -> int | None:
        """A seq for the next striped chunk, if the peer's window has room."""
        if len(c.unfinished) >= stripes.WINDOW:
            return None
        seq = c.seq
        c.seq = (seq + 1) & stripes.MAX_SEQ
        c.unfinished.add(seq)
        return seq

    @staticmethod
    def _lane_with_room(c: Conn) -> Link | None:
        """Of the link's connections that take a write now, the least loaded: bytes in
        its transport's buffer plus bytes the kernel holds unacknowledged (a lane whose
        flow is slow, in loss recovery say, holds more and gets fewer blocks); ties go
        round the lanes."""
        conns = [(c.link, c.sock), *((lane.link, lane.sock) for lane in c.lanes)]
        k = len(conns)
        best, least = -1, 0
        for j in range(k):
            at = (c.next_lane + j) % k
            link, sock = conns[at]
            if not link.writable:
                continue
            load = link.buffered() + ((unacked_bytes(sock) or 0) if sock is not None else 0)
            if best < 0 or load < least:
                best, least = at, load
        if best < 0:
            return None
        c.next_lane = best + 1
        return conns[best][0]

    @staticmethod
    async def _any_lane_drained(c: Conn) -> None:
        futs = [link.drained() for link in (c.link, *(lane.link for lane in c.lanes))]
        try:
            await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in futs:
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()  # retrieved: a closed lane shows in its reader
        if c.link.closed:
            raise ConnectionError(c.link.reason or "link closed")

    async def _resend_block(self, c: Conn) -> None:
        """Send one block the peer asked for again (``PSQ2``) on the least loaded
        connection (the lane it is stuck on holds the most)."""
        seq, b = c.resends[0]
        rec = c.out.get(seq)
        if rec is None:  # finished meanwhile
            c.resends.popleft()
            return
        lane = self._lane_with_room(c)
        if lane is None:
            await self._any_lane_drained(c)
            return
        c.resends.popleft()
        v, i, payload = rec[0], rec[1], rec[2]
        off = b * wire.BLOCK_BYTES
        self.wire_bytes["sent"] += lane.send_nowait(
            stripes.pack_stripe_header(seq, v, i, b, len(payload)),
            payload[off:off + wire.BLOCK_BYTES])
        self.blocks_resent += 1

    def _check_stalls(self, c: Conn) -> None:
        """The receiver of a striped link: ask again (``PSQ2``) for the blocks of a chunk
        stuck on a lane (``StripedAssembler.stalled``), turning a stuck block's copy away
        from the chunk's buffer (``Link.divert``); look again when one may be due."""
        asm = c.stripes
        if asm is None or c.closing or self.conns.get(c.id) is not c:
            return
        now = self.now()
        for seq, blocks in asm.stalled(now, divert=lambda s, b, k: self._divert(c, s, b, k)):
            self.stripe_wants += 1
            log.info("peer %s: striped chunk %d had no block for %.1f s while later ones "
                     "came: asking again for %d blocks", c.addr, seq, stripes.STALL_S,
                     len(blocks))
            c.ctrl.append(stripes.pack_want(seq, blocks))
            c.wake.set()
        due = asm.next_stall_check()
        if c.stall_timer is not None:
            c.stall_timer.cancel()
            c.stall_timer = None
        if due is not None and self.loop is not None:
            c.stall_timer = self.loop.call_at(max(due, now + 0.01), self._check_stalls, c)

    @staticmethod
    def _divert(c: Conn, seq: int, block: int, conn: int) -> bool:
        """Turn connection ``conn``'s copy of striped block ``block`` of ``seq`` away from
        the chunk's buffer, if that is the block it is receiving now."""
        link = c.link if conn == 0 else next((x.link for x in c.lanes if x.n == conn), None)
        header = link.placing() if link is not None else None
        if header is None or stripes.magic_of(header) != stripes.STRIPE_MAGIC:
            return False
        s, _, where = stripes.unpack_where(header)
        return s == seq and where & (stripes.MAX_BLOCKS - 1) == block and link.divert()

    def _stripes(self, c: Conn) -> stripes.StripedAssembler:
        if c.stripes is None:
            c.stripes = stripes.StripedAssembler(alloc=aligned_buffer)
        return c.stripes

    def _chunks_flow(self, c: Conn) -> None:
        """A chunk starts on ``c``, either way. If we dialed it and it goes to another
        region, offer a token on it and open ``[network] lanes - 1`` more connections
        with it (once per link): only links that carry chunks between regions (the
        origin's to the borders, the borders' to each other) get lanes, not every
        node's link to the tracker."""
        if c.laning or not c.outbound or not self.core.authenticated(c.id):
            return
        c.laning = True
        if self.lanes <= 1 or self.lanes_auto or not self._other_region(c):
            return  # "auto": once the link's sender finds it capped by loss (_probe_loss)
        self._offer_lanes(c)

    def _other_region(self, c: Conn) -> bool:
        region = self.core.peer_region(c.id)
        return region is not None and region != self.core.cfg.region

    def _offer_lanes(self, c: Conn) -> None:
        """The dialer offers a token on ``c`` (once): the lanes are dialed once the peer
        echoes it (``_on_striped``); a lane whose token reached the peer before the offer
        would be refused."""
        if c.lane_token is not None or c.closing:
            return
        c.lane_token = os.urandom(stripes.TOKEN_BYTES)
        c.ctrl.append(stripes.pack_offer(c.lane_token))
        c.wake.set()

    def _probe_loss(self, c: Conn, first: bool) -> None:
        """``[network] lanes = "auto"``: a plain block is about to go on ``c``; now and
        then look at its socket (``RandomLoss``) and, once it is found capped by random
        loss, get lanes: the dialer offers, an acceptor asks the dialer to (``PSA2``).
        Only links to another region, under a loss-based congestion control: BBR does
        not back off on random loss (lanes measured no faster under it).

        Once one link to a region was found capped, the next link to that region takes
        as many lanes with its first chunk (``region_lanes``): the paths into one region
        share its WAN. Probing each link afresh left every link's first chunk to crawl
        on one flow until the probe fired and the chunk restarted over lanes (the
        origin's pushes of a second version go to borders it had not pushed to)."""
        probe = c.loss
        if probe is None:
            c.loss_checked = True
            in_use = self.congestion_in_use
            if (c.sock is None or in_use is None or keeps_window_across_idle(in_use)
                    or c.lane_token is not None or not self._other_region(c)):
                return
            learned = self._region_lanes(c)
            if learned is not None:
                self._take_region_lanes(c, learned)
                return
            probe = c.loss = RandomLoss()
        elif self.region_lanes:
            # another link to this region was found capped while this one's probe ran
            learned = self._region_lanes(c)
            if learned is not None:
                self._take_region_lanes(c, learned)
                return
        now = self.now()
        if not first and not probe.due(now):
            return
        sample = path_sample(c.sock)
        if sample is None:
            c.loss = None
            return
        if not probe.sample(now, *sample, fresh=first):
            return
        c.loss = None
        if c.lane_token is not None:
            return  # the dialer offered meanwhile
        self.loss_capped += 1
        retrans, srtt, floor = sample
        share = loss_share(c.sock, probe.queued)
        lanes = stripes.lanes_for_loss(share)
        region = self.core.peer_region(c.id)
        if region is not None:
            self.region_lanes[region] = (lanes, self.now())
        log.info("peer %s: capped by random loss (%d retransmitted, %d of them at a full "
                 "queue; %.2f %% of segments, round trip %.1f ms, floor %.1f ms): %s %d lanes",
                 c.addr, retrans, probe.queued, 100 * (share or 0.0), srtt / 1000, floor / 1000,
                 "opening" if c.outbound else "asking for", lanes - 1)
        self._get_lanes(c, lanes)
        if region is not None:
            self._lanes_for_region(region, lanes, c)

    def _lanes_for_region(self, region: str, lanes: int, found: Conn) -> None:
        """Region ``region`` was found capped by random loss on link ``found``: our other
        links that carry chunks into it (the origin's to its borders there, a border's to
        the borders there) get as many lanes now, before their next chunk, so that it
        does not start on one flow (a chunk restarted over lanes loses what it sent)."""
        for c in list(self.conns.values()):
            if (c is found or c.closing or c.lane_token is not None or c.sock is None
                    or not self.core.authenticated(c.id) or not self.core.peer_border(c.id)
                    or self.core.peer_region(c.id) != region):
                continue
            self._take_region_lanes(c, lanes)

    def _region_lanes(self, c: Conn) -> int | None:
        """The lanes a link into ``c``'s region was found to need, if one was lately."""
        got = self.region_lanes.get(self.core.peer_region(c.id) or "")
        if got is None or self.now() - got[1] > REGION_LANES_S:
            return None
        return got[0]

    def _take_region_lanes(self, c: Conn, lanes: int) -> None:
        """``c`` gets the lanes another link to its region was found to need
        (``region_lanes``), without a probe of its own."""
        c.loss, c.loss_checked = None, True
        if c.lane_token is not None:
            return
        self.lanes_learned += 1
        log.info("peer %s: its region's links are capped by random loss: %s %d lanes",
                 c.addr, "opening" if c.outbound else "asking for", lanes - 1)
        self._get_lanes(c, lanes)

    def _get_lanes(self, c: Conn, lanes: int) -> None:
        """``lanes`` connections for ``c`` in all: the dialer offers a token, an acceptor
        names one and asks the dialer to dial them (``PSA2`` with the count)."""
        c.want_lanes = lanes
        if c.outbound:
            self._offer_lanes(c)
            return
        # the acceptor names the token: the dialer dials at once, no offer and echo
        c.lane_token, c.asked = os.urandom(stripes.TOKEN_BYTES), True
        self.lane_tokens[c.lane_token] = c.id
        c.ctrl.append(stripes.pack_ask(c.lane_token, c.want_lanes))
        c.wake.set()

    async def _open_lanes(self, c: Conn, token: bytes, lanes: int) -> None:
        """Dial lanes 1 .. ``lanes - 1`` of ``c`` at once (each a TLS handshake: on a
        150 ms path one after another took 0.6 s apiece)."""
        await asyncio.gather(*(self._open_lane(c, token, n) for n in range(1, lanes)))

    async def _open_lane(self, c: Conn, token: bytes, n: int) -> None:
        host, _, port = c.addr.rpartition(":")
        if c.closing or c.id not in self.conns:
            return
        try:
            link = await dial(host.strip("[]"), int(port),
                              ssl_context=self.tls.client if self.tls is not None else None,
                              max_message=MAX_LINK_MESSAGE, timeout=CONNECT_TIMEOUT_S + 5.0,
                              read_coalesce_s=self.read_coalesce_s,
                              read_lowat=self.read_lowat, lane=True, frames=self.frames)
        except (TimeoutError, OSError, ValueError) as exc:
            log.warning("peer %s: lane %d not opened: %s", c.addr, n, exc)
            return
        why = None
        try:
            ident = self._tls_identity(link.get_extra_info("ssl_object"), c.addr)
            if c.identity is not None and (ident is None or ident[0] != c.identity[0]):
                raise ProtocolError("another node answered")
            await link.send(stripes.pack_lane(token, n))
            echo = await asyncio.wait_for(link.recv(), CONNECT_TIMEOUT_S + 5.0)
            if echo is None:
                why = link.reason or "closed"
            elif isinstance(echo, Placed) or bytes(echo) != stripes.pack_lane(token, n):
                why = "no lane acceptance"
        except (ProtocolError, TimeoutError, ConnectionError) as exc:
            why = str(exc) or type(exc).__name__
        if why is not None or c.closing or c.id not in self.conns:
            self.lanes_refused += why is not None
            if why is not None:
                log.warning("peer %s: lane %d refused: %s", c.addr, n, why)
            await link.close("lane not taken")
            return
        lane = self._attach_lane(c, n, link)
        lane.reader = self._spawn(self._lane_reader(c, lane))

    async def _accept_lane(self, link: Link, identity: tuple[str, str, str] | None,
                           addr: str) -> None:
        """A connection that says it is a lane: its first message names the link (token)."""
        why = None
        c = None
        try:
            first = await asyncio.wait_for(link.recv(), self.guard.upgrade_timeout_s)
            if first is None or isinstance(first, Placed):
                raise ProtocolError("no lane message")
            token, n = stripes.unpack_lane(first)
            c = self.conns.get(self.lane_tokens.get(token, -1))
            if c is None or c.closing or not self.core.authenticated(c.id):
                raise ProtocolError("no link offered that token")
            if c.identity is not None and (identity is None or identity[0] != c.identity[0]):
                raise ProtocolError("a lane of another node's link")
            if any(lane.n == n for lane in c.lanes) or len(c.lanes) >= stripes.MAX_LANES - 1:
                raise ProtocolError(f"lane {n} is taken")
            link.send_nowait(first)  # accepted: the dialer attaches it too
        except (ProtocolError, TimeoutError, ConnectionError) as exc:
            why = str(exc) or type(exc).__name__
        if why is not None or c is None:
            self.lanes_refused += 1
            log.warning("lane from %s refused: %s", addr, why)
            await link.close(f"lane refused: {why}")
            return
        lane = self._attach_lane(c, n, link)
        await self._lane_reader(c, lane)

    def _attach_lane(self, c: Conn, n: int, link: Link) -> Lane:
        sock = link.get_extra_info("socket")
        limit_unsent(sock, self.unsent_limit)
        self._congestion(sock)
        link.place_with(lambda header, k: self._place_lane(c, header, k, n),
                        stripes.STRIPE_HEADER_LEN)
        lane = Lane(n, link, sock)
        c.lanes.append(lane)
        self.lanes_opened += 1
        log.info("peer %s: lane %d open (%d connections)", c.addr, n, 1 + len(c.lanes))
        c.wake.set()
        return lane

    def _place_lane(self, c: Conn, header: bytes, n: int, lane: int) -> memoryview | None:
        if c.id not in self.conns or stripes.magic_of(header) != stripes.STRIPE_MAGIC:
            return None
        return self._stripes(c).place(header, n, lane)

    async def _lane_reader(self, c: Conn, lane: Lane) -> None:
        """A lane carries striped blocks and nothing else; when it ends, its link ends."""
        reason = "closed by peer"
        try:
            async for data in self._incoming(c, lane.link):
                if isinstance(data, Placed):
                    whole = None if data.diverted else self._stripes(c).placed(data.header)
                    await self._stripe_block(c, data.header, whole)
                elif stripes.magic_of(data) == stripes.STRIPE_MAGIC:
                    await self._on_striped(c, data)
                else:
                    reason = "a lane carries chunk blocks only"
                    break
            else:
                reason = lane.link.reason or reason
        except ProtocolError as exc:
            reason = str(exc)
        except (TimeoutError, ConnectionError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await lane.link.close(reason[:200])
        if c.id in self.conns and not c.closing:
            await self._drop(c, f"lane {lane.n}: {reason}")

    def _lanes_end(self, c: Conn) -> None:
        """``c`` closed: so do its lanes; its offered token is void."""
        for timer in (c.stall_timer, c.ack_timer, c.path_timer):
            if timer is not None:
                timer.cancel()
        c.stall_timer = c.ack_timer = c.path_timer = None
        if c.lane_token is not None and self.lane_tokens.get(c.lane_token) == c.id:
            del self.lane_tokens[c.lane_token]
        for lane in c.lanes:
            lane.link.abort()

    async def _on_striped(self, c: Conn, data: bytes | bytearray) -> None:
        """A striped link's messages (``swarm.protocol.stripes``): blocks, DONE, PSW2, PST2."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "striped link message before the handshake")
            return
        magic = stripes.magic_of(data)
        try:
            if magic == stripes.STRIPE_MAGIC:
                await self._stripe_block(c, data, self._stripes(c).feed(data))
            elif magic == stripes.DONE_MAGIC:
                seq = stripes.unpack_done(data)
                if seq not in c.unfinished:
                    raise ProtocolError(f"done for striped chunk {seq}, not one we sent")
                c.unfinished.discard(seq)
                c.out.pop(seq, None)
                c.wake.set()
            elif magic == stripes.WITHDRAW_MAGIC:
                seq, v, i = stripes.unpack_withdraw(data)
                self._stripes(c).withdraw(seq)
                c.ctrl.append(stripes.pack_done(seq))
                c.wake.set()
                log.info("peer %s withdrew chunk %d of version %d", c.addr, i, v)
                a = self.arrivals.get((v, i))
                if a is not None and a.conn == c.id:
                    self._copy_withdrawn((v, i), a)
                self.feed(ev.ChunkWithdrawn(self.now(), c.id, v, i))
            elif magic == stripes.WANT_MAGIC:
                seq, blocks = stripes.unpack_want(data)
                rec = c.out.get(seq)
                if rec is not None:  # else finished meanwhile: nothing to send again
                    for b in blocks:
                        # each block once, and only one handed over already (blocks go
                        # whole; a chunk forwarded as it arrives has nothing past them)
                        if b * wire.BLOCK_BYTES < rec[4] and not (rec[3] >> b) & 1:
                            rec[3] |= 1 << b
                            c.resends.append((seq, b))
                    c.wake.set()
            elif magic == stripes.ASK_MAGIC:
                token, wanted = stripes.unpack_ask(data)
                if not c.outbound:
                    raise ProtocolError("a lane ask from the dialer (it offers)")
                # a dialer that stripes no links lets it be; one that offered already
                # waits for its echo (the acceptor takes our offer over its ask). With
                # lanes = "auto" it opens as many as the acceptor measured a need for.
                if self.lanes > 1 and c.lane_token is None and not c.closing:
                    c.laning = c.offer_taken = True
                    c.lane_token = token
                    if self.lanes_auto and wanted is not None:
                        c.want_lanes = wanted
                    self._spawn(self._open_lanes(c, token, c.want_lanes or self.lanes))
            elif magic == stripes.OFFER_MAGIC:
                token = stripes.unpack_offer(data)
                if c.outbound:  # the peer took our offer: dial the lanes now
                    if c.lane_token is None or token != c.lane_token or c.offer_taken:
                        raise ProtocolError("a lane offer echo that answers no offer")
                    c.offer_taken = True
                    self._spawn(self._open_lanes(c, token, c.want_lanes or self.lanes))
                    return
                if c.lane_token is not None:
                    if not c.asked or c.lanes:
                        raise ProtocolError("a second lane offer on one link")
                    # our ask crossed the dialer's offer: take the offer
                    self.lane_tokens.pop(c.lane_token, None)
                    c.asked = False
                c.lane_token = token
                self.lane_tokens[token] = c.id
                c.ctrl.append(stripes.pack_offer(token))  # taken: the dialer may open lanes
                c.wake.set()
        except ProtocolError as exc:
            await self._drop(c, str(exc))

    async def _stripe_block(self, c: Conn, header: bytes | bytearray | memoryview,
                            whole: stripes.Whole | None) -> None:
        """A striped block is in (``whole``: its chunk is complete): as ``_block_done``;
        then whether a chunk is stuck on a lane (``_check_stalls``)."""
        asm = c.stripes
        if asm is None or len(header) < stripes.STRIPE_HEADER_LEN:
            return
        asm.touch(stripes.unpack_where(header)[0], self.now())
        self._check_stalls(c)
        if whole is not None:
            seq, v, i, payload = whole
            c.ctrl.append(stripes.pack_done(seq))
            c.wake.set()
            await self._on_chunk(c, (v, i, payload))
            return
        seq, v, where = stripes.unpack_where(header)
        key = (v, where >> stripes.BLOCK_BITS)
        ch = asm.open.get(seq)
        if ch is not None:  # not a late block of a withdrawn chunk
            if c.blocks.pending == key:
                # the sender restarted, striped, the chunk it was sending on the link
                # itself (lanes came up mid-chunk); that copy's PSW1 follows
                c.restriped.add(key)
            a = self.arrivals.get(key)
            if a is None:  # its first block: a RELAY may go on from here
                a = self.arrivals[key] = Arrival(c.id, ch.buf, ch.length, t0=self.now())
                self.feed(ev.ChunkArriving(self.now(), c.id, *key))
            elif (a.conn == c.id and a.buf is not ch.buf and key in c.restriped
                  and a.state == "arriving"):
                # relays cut through from the copy on the link go on from this one:
                # the same bytes, verified the same (they wait while its prefix is shorter)
                a.buf = ch.buf
            if a.conn == c.id and a.buf is ch.buf:
                a.got = asm.prefix(seq)
                if a.watchers:
                    a.changed()
                pace = a.pace_due(self.now())
                if pace is not None:
                    self.feed(ev.ChunkPace(self.now(), c.id, *key, *pace))
        now = self.now()
        if now - c.heard_at >= 0.25:
            c.heard_at = now
            self.feed(ev.Progress(now, c.id))
