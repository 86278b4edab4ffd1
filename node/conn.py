"""A link's state in the driver (``Conn``): its connections, send queues, reassembly,
striping and the watches on its sockets; and ``Arrival``, a chunk arriving for
cut-through relays. Plain data: the driver and its parts (``node.striping``,
``node.tcp_watch``) act on it."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from node.buffers import aligned_buffer
from node.link import Link
from node.tcp import CongestionRestart, RandomLoss
from swarm.protocol import events as ev
from swarm.protocol import stripes, wire
from swarm.trust.chunks import chunk_hasher

MAX_LINK_MESSAGE = wire.CHUNK_HEADER_LEN + wire.MAX_CHUNK_BYTES  # a chunk block's message
CONNECT_TIMEOUT_S = 5.0
# lanes came up while a chunk went on one connection: it is restarted over all of them
# while at least this much of it is left and at most half of it was sent
RESTRIPE_MIN_LEFT = 2 * wire.BLOCK_BYTES


@dataclass
class Arrival:
    """A chunk whose blocks are arriving on link ``conn``, for cut-through relays: its
    first ``got`` bytes in ``buf`` are final; ``state`` becomes ``stored`` once the whole
    chunk was verified and kept, ``failed`` if it was not (corrupt, withdrawn, the link
    closed, a local fault). Every change wakes the writers of the links relaying it."""

    conn: int
    buf: memoryview
    length: int
    got: int = 0
    state: str = "arriving"  # arriving | stored | failed
    t0: float = 0.0  # when its first block came (loop time; the debug log's transfer times)
    watchers: list = field(default_factory=list)  # Conns whose writers stream it
    # withdrawn while another copy of the chunk, whole, was being verified: its relays
    # wait for that verdict (``Driver._copy_withdrawn``)
    withdrawn: bool = False
    got0: int = -1  # bytes in with its first block (its pace counts the bytes after)
    paced: bool = False  # its ``ChunkPace`` went to the core

    def changed(self) -> None:
        for w in self.watchers:
            w.wake.set()

    def pace_due(self, now: float) -> tuple[int, int] | None:
        """``(bytes since the first block, bytes left)`` for the core's ``ChunkPace``, at
        the first block ``PACE_LOOK_S`` or more after the first one; at most once, and
        only while the chunk is still coming."""
        if self.paced:
            return None
        if self.got0 < 0:
            self.got0 = self.got
            return None
        if now - self.t0 < ev.PACE_LOOK_S or not self.got0 < self.got < self.length:
            return None
        self.paced = True
        return self.got - self.got0, self.length - self.got


@dataclass
class Lane:
    """An extra connection of a striped link (``swarm.protocol.stripes``): blocks only."""

    n: int
    link: Link
    sock: Any = None
    reader: asyncio.Task | None = None


@dataclass
class Conn:
    """One link to a peer, with its ordered send queue."""

    id: int
    link: Link
    outbound: bool
    addr: str
    # Control frames go before the next block of a chunk (see _writer): they wait for
    # one block on the wire, never for a whole chunk.
    ctrl: deque = field(default_factory=deque)
    data: deque = field(default_factory=deque)  # (version, index, arriving) chunks to send
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Chunks are reassembled in aligned, not zero-filled buffers (the assembler writes
    # every byte it returns): the store writes them to disk with O_DIRECT, no page cache.
    # Each block is hashed as it is taken, while in the cache: the store's check of the
    # whole chunk compares that hash (``BlockAssembler.digest``), no second pass.
    blocks: wire.BlockAssembler = field(
        default_factory=lambda: wire.BlockAssembler(alloc=aligned_buffer, hasher=chunk_hasher))
    heard_at: float = 0.0  # last Progress fed to the core (rate-limited)
    writer: asyncio.Task | None = None
    closing: bool = False
    sock: Any = None  # the TCP socket under the link (options, BBR restarts), if known
    restart: CongestionRestart = field(default_factory=CongestionRestart)
    restart_timer: asyncio.TimerHandle | None = None  # the next CongestionRestart.next_check
    handed: int = 0  # bytes of the chunk being sent handed to the link so far
    block_bytes: int = wire.BLOCK_BYTES  # its blocks' size on this link (Driver._block_size)
    # striped links (docs/striped-links.md): the extra connections, the token they carry,
    # the receiving assembler, and the sender's seq counter and unfinished window
    identity: tuple[str, str, str] | None = None
    lanes: list[Lane] = field(default_factory=list)
    lane_token: bytes | None = None
    laning: bool = False  # the dialer asked for lanes (once per link)
    offer_taken: bool = False  # the dialer: the peer echoed our lane offer
    stripes: stripes.StripedAssembler | None = None
    seq: int = 0
    unfinished: set = field(default_factory=set)
    next_lane: int = 0  # where the next look for a lane with room starts
    # ``[network] lanes = "auto"``: whether this link's sender is capped by random loss
    # (None: not looked into, or not a link that could be; ``loss_checked``: decided so)
    loss: RandomLoss | None = None
    loss_checked: bool = False
    asked: bool = False  # the acceptor asked the dialer for lanes (PSA2, its own token)
    want_lanes: int = 0  # connections the link is to have once striped (0: the node's count)
    # the sender's striped chunks the peer has not finished: seq -> [v, i, payload, the
    # blocks sent again (bits), bytes handed over so far], and blocks the peer asked for
    # again (PSQ2), to send
    out: dict = field(default_factory=dict)
    resends: deque = field(default_factory=deque)
    stall_timer: asyncio.TimerHandle | None = None  # the receiver's next stalled() look
    # whether its bytes are still being acknowledged (ev.Acked keeps a push or relay
    # alive): the origin after a chunk was handed over, a border while it relays one to
    # another region and after; the next look, the count last seen
    ack_timer: asyncio.TimerHandle | None = None
    ack_seen: int = 0
    # the origin: the next look at the path of a push leaving on it (``ev.PathSample``)
    path_timer: asyncio.TimerHandle | None = None
    in_chunk: bool = False  # a chunk is being sent (the ack watch goes on meanwhile)
    # the receiver: chunks whose copy on the link itself (PSB1) the sender restarted
    # striped, once lanes came up mid-chunk; that copy's withdrawal is expected, not news
    restriped: set = field(default_factory=set)
    # the chunk the writer is sending, and one it is to stop (``ev.StopChunk``: the
    # requester cancelled it) at its next block
    sending: tuple[int, int] | None = None
    stop: tuple[int, int] | None = None
    # warm-up (node.warm_up): this link's, the next look at it, padding taken from the
    # peer, and whether a chunk block went either way on it (never warmed then)
    warm: Any = None
    warm_timer: asyncio.TimerHandle | None = None
    pad_in: int = 0
    carried: bool = False

    def queued(self) -> int:
        return len(self.ctrl) + len(self.data)
