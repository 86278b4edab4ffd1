"""Policy knobs of the protocol core, one frozen dataclass per node.

The same ``CoreConfig`` drives the real node (built from TOML) and every
simulated node (built from a scenario), so a strategy is just a set of knob
values: ``region_aware=False`` is the flat BitTorrent-style swarm,
``relay=False`` makes the origin feed every region itself, ``origin_only=True``
makes every node download from the origin alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarm.errors import ConfigError

ROLES = ("node", "origin")
# fields that say who a node is, set by its driver: not policy knobs
IDENTITY_FIELDS = frozenset({"node_id", "region", "model", "listen_addr", "role", "bootstrap",
                             "swarm_secret", "active_version"})


_DAY = 86_400.0
# Every numeric knob's range, as data: a value outside it, NaN or an infinity is a
# ConfigError naming the knob (the node's [swarm] and a scenario's [protocol] alike).
KNOB_RANGES: dict[str, tuple[float, float]] = {
    "border_nodes": (1, 1024), "mesh_degree": (1, 1024), "mesh_low": (1, 1024),
    "mesh_high": (1, 1024), "heartbeat_s": (0.01, 3600.0), "peer_timeout_s": (0.02, _DAY),
    "handshake_timeout_s": (0.01, 3600.0), "redial_s": (0.0, _DAY),
    "max_known_peers": (1, 1_000_000), "origin_peers": (0, 100_000), "tracker_sample": (0, 10_000),
    "pipeline": (1, 1024), "max_requests": (1, 65_536), "upload_slots": (1, 4096),
    "upload_queue": (0, 65_536), "request_timeout_s": (0.01, _DAY), "have_batch_s": (0.0, 60.0),
    "endgame_chunks": (0, 1 << 20), "endgame_twin_after_s": (0.0, 3600.0),
    "slow_factor": (1.0, 1e6), "slow_min_samples": (1, 1 << 20),
    "max_bad_chunks": (1, 1 << 20), "ban_s": (0.0, 365 * _DAY), "max_timeouts": (1, 1 << 20),
    "border_inflight": (1, 4096), "push_slots": (1, 65_536), "relay_slots": (1, 4096),
    "uplink_window": (1, 65_536), "uplink_window_max": (1, 65_536), "slow_path_factor": (0.0, 1e6),
    "border_grace_s": (0.0, _DAY), "keep_versions": (1, 1 << 20), "apply_retries": (0, 1000),
    "apply_retry_s": (0.0, _DAY), "status_interval_s": (0.0, _DAY), "status_delay_s": (0.0, 3600.0),
    "fleet_max": (1, 10_000_000), "unavailable_s": (0.0, _DAY),
    "relay_wait_s": (0.0, _DAY), "slow_relay_factor": (0.0, 1e6), "cold_path_factor": (0.0, 1e6),
    "serve_arriving_region": (0, 1_000_000), "serve_arriving_endgame": (0, 1 << 20),
    "early_requests": (1, 1024),
    "cut_through_after_s": (0.0, 3600.0),
    "fast_startup_s": (0.0, 3600.0), "fast_startup_step": (1, 64),
}


@dataclass(frozen=True)
class CoreConfig:
    node_id: str
    region: str
    model: str
    listen_addr: str  # "host:port" others dial
    role: str = "node"  # "node" (rollout host) | "origin" (the trainer)
    bootstrap: tuple[str, ...] = ()  # addrs to dial at start (the origin acts as tracker)
    swarm_secret: bytes = b""  # HMAC key proving swarm membership in the handshake
    # ---- strategy
    region_aware: bool = True  # False -> "flat": region-unaware BitTorrent-style swarm
    relay: bool = True  # regions relay chunks to each other; False -> origin feeds every region
    border_nodes: int = 8  # nodes per region that take chunks from outside (their downlinks are the region's inflow)
    origin_only: bool = False  # "direct": every node downloads only from the origin
    # ---- membership
    mesh_degree: int = 8  # more neighbours, more idle senders to pick from (HAVE frames grow with it)
    mesh_low: int = 4
    mesh_high: int = 12
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    redial_s: float = 5.0  # back-off before dialling an address that failed again
    max_known_peers: int = 256  # address book bound
    origin_peers: int = 16  # flat: how many nodes the origin keeps as ordinary peers
    tracker_sample: int = 16  # peers the origin hands out per joining node
    # ---- chunk exchange
    pipeline: int = 1  # outstanding requests per peer (spread requests over peers)
    max_requests: int = 2  # outstanding requests per node (all peers); see docs/protocol.md
    upload_slots: int = 2  # few concurrent uploads: each chunk is forwardable sooner
    upload_queue: int = 0  # queued requests beyond the slots; more are rejected (0: the requester asks an idle peer)
    request_timeout_s: float = 10.0
    have_batch_s: float = 0.02  # HAVEs are batched for this long (0: send at once)
    endgame_chunks: int = 8  # duplicate requests only when this few chunks are missing
    # ... and only for a chunk whose first request is this old and overdue (its peer's own
    # chunk time), or which the twin's peer would deliver sooner (0: at once, rounds 1-59)
    endgame_twin_after_s: float = 0.1
    slow_factor: float = 4.0  # evict a peer slower than this x the median of peers
    slow_min_samples: int = 3
    max_bad_chunks: int = 2  # corrupt chunks (per node id, across reconnects) before a ban
    ban_s: float = 600.0  # a banned node id is refused (and not dialled) for this long
    max_timeouts: int = 3  # request timeouts before a peer is dropped
    # ---- seeding (origin)
    border_inflight: int = 2  # chunks in flight into a region per border node
    push_slots: int = 24  # origin: chunks it pushes into regions at once (counted until sent)
    uplink_window: int = 2  # origin: least chunks leaving through its site uplink at once (swarm.protocol.uplink)
    uplink_window_max: int = 256  # ... and most; the window adapts between them by measured delivery rate
    # origin: while every push into a remote region leaves within this long (a fat site
    # uplink: each push capped by its border's downlink), the uplink window's start-up
    # doubles on the pushes' departures, a round trip before their HAVEs (0: off;
    # swarm.protocol.uplink, docs/simulation.md round 34)
    fast_startup_s: float = 0.2
    # ... by this many places per departure while the window is full: 2, it triples once a
    # push time (1: doubles, as TCP's slow start; `slow-direct`'s first version 2.097 ->
    # 2.070 s, fleet-1k's 4.490 -> 4.454, later versions the same; docs/simulation.md round 49)
    fast_startup_step: int = 2
    relay_slots: int = 1  # concurrent cross-region relays per border node
    # origin: a remote region whose pushes take this many times the fastest other remote
    # region's (a push under way counts its age) gets one push at a time; the rest of its
    # copy comes by relay and the uplink window's other slots go to the others (0: off)
    slow_path_factor: float = 2.0
    # border: relay a chunk while it arrives (the last block once verified), once it has
    # been arriving cut_through_after_s (0: from its first block). A chunk that arrives fast
    # (a fat path) is relayed whole once stored: from its first block, cut-through cost the
    # simulator's fat-trainer scenarios 5-13 %; after 0.2 s none moves, and the emulated long
    # lossy WAN is 21 % faster on a first version, 10 % on later ones (docs/simulation.md
    # round 23). Over a link whose last chunk took 2 x cut_through_after_s or longer, from
    # the first block at once (round 32); once the chunk's own pace (ChunkPace, 30 ms after
    # its first block) projects that long, at once (round 59: a link's first chunks)
    cut_through: bool = True
    cut_through_after_s: float = 0.2
    # origin: after the uplink window's start-up, a push goes to another border it has
    # pushed to that is idle rather than queue behind one on the warm border. Off: on the
    # emulated WAN's thin uplink the window's probe then runs as a parallel flow and the
    # versions where it fired were slow; a fat-trainer fleet's steady state gains 3-4 %
    # (docs/simulation.md round 17)
    spread_pushes: bool = False
    # origin: while the uplink window's start-up grows on departures (every push left
    # within fast_startup_s: the uplink is not the limit), a push goes to an idle border
    # rather than stack behind one on the warm border, so the window opens by a push per
    # border at once (a first version over a fat uplink; docs/simulation.md round 48)
    spread_startup: bool = True
    # origin: once pushes into remote regions whose TCP windows are no longer opening have
    # shown no queue on their paths for 6 round trips (the driver's ``ev.PathSample``), the
    # site uplink has room: the uplink window stops limiting pushes, until a queue shows
    # on every push leaving. Off: the simulator's fat trainer over long lossy links gains
    # 2x (`lossy-long` 20.1 -> ~10 s), but the emulated lossy WAN behind a 100 Mbit/s
    # uplink showed no gain (docs/simulation.md round 50)
    clear_startup: bool = False
    # a chunk arriving from a peer may be asked for by the region's peers at once (sent
    # block by block as it comes, the last once verified here): see docs/protocol.md.
    # Offered (COMING) only by a node that knows at least serve_arriving_region nodes of
    # its region: it shortens a large region's start-up (fleet-10k -4 %) and costs small
    # regions 1-4 % (docs/simulation.md, round 10)
    serve_arriving: bool = True
    serve_arriving_region: int = 48
    # ... and in a smaller region at the end of a version: once a node lacks at most this
    # many chunks, none of them held whole by a region peer, it offers those arriving here
    # from outside the region. Nothing else is left to fetch then, so its peers take them
    # while they arrive instead of a hop after the last byte (docs/protocol.md) (0: off)
    serve_arriving_endgame: int = 2
    # requests a node keeps out at once for chunks its peers only have arriving (COMING; one
    # per peer): with 1, a large region's start-up left a node's second request slot idle
    # while its one early answer came at the arrival's pace (fleet-10k 1.169x / 1.153x the
    # bound; with 2: 1.153x / 1.131x, docs/simulation.md round 46)
    early_requests: int = 2
    border_grace_s: float = 5.0  # wait before re-sending what a departed border held
    relay_wait_s: float = 5.0  # origin: push a chunk a linked region could relay only after relays into the region stalled this long
    # origin: a region whose relays into another take this many times a push into it is
    # no relay source for it (measured per path; an upload-bound region) (0: off)
    slow_relay_factor: float = 5.0
    # origin: once a first push over a fresh border connection has measured this many
    # times a push into the region (TCP's slow start on a long round trip), a push or
    # relay whose warm border is full goes to a border its sender has sent chunks to,
    # not a new connection (0: never; docs/protocol.md)
    cold_path_factor: float = 3.0
    # ---- versions
    active_version: int | None = 0  # version held at start (0 = the base checkpoint)
    keep_versions: int = 3  # versions kept announced/served behind the active one
    apply_retries: int = 3
    apply_retry_s: float = 5.0
    unavailable_s: float = 15.0  # a wanted version nobody linked shows this long is skipped (anchor fallback)
    # ---- fleet view (see swarm.protocol.fleet)
    status_interval_s: float = 30.0  # re-report versions to the origin this often (0: on change only)
    status_delay_s: float = 0.25  # spread reports after a change over this long (per node id)
    fleet_max: int = 1_000_000  # origin: nodes it keeps a report of

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not one of {ROLES}")
        for name in ("node_id", "region", "model", "listen_addr"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 256:
                raise ConfigError(f"{name}: must be a non-empty string of at most 256 characters")
        for name, (lo, hi) in KNOB_RANGES.items():
            value = getattr(self, name)
            # NaN fails both comparisons; infinities fail the upper bound
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
                raise ConfigError(f"{name}: must be a number in {lo}..{hi}, got {value!r}")
        if not (self.mesh_low <= self.mesh_degree <= self.mesh_high):
            raise ConfigError("mesh: need 1 <= mesh_low <= mesh_degree <= mesh_high")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ConfigError("peer_timeout_s: must be longer than heartbeat_s "
                              f"({self.peer_timeout_s} <= {self.heartbeat_s})")
        if not isinstance(self.swarm_secret, bytes):
            raise ConfigError("swarm_secret: must be bytes")
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))

    @property
    def is_origin(self) -> bool:
        return self.role == "origin"


def check_knobs(knobs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate policy knobs (``CoreConfig`` fields) from a config file or a scenario.

    The one place knob names and types are checked (the node's ``[swarm]``, a
    scenario's ``[protocol]``): ``ConfigError`` names ``where.knob``. Ranges are
    ``CoreConfig.__post_init__``'s job. Floats may be written as integers.
    """
    fields = {f.name: f for f in dataclasses.fields(CoreConfig)}
    out: dict[str, Any] = {}
    for key, value in knobs.items():
        if key in IDENTITY_FIELDS:
            raise ConfigError(f"{where}.{key}: set it in its own section, not under [{where}]")
        f = fields.get(key)
        if f is None:
            raise ConfigError(f"{where}.{key}: unknown protocol knob "
                              f"(known: {', '.join(sorted(set(fields) - IDENTITY_FIELDS))})")
        default = f.default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        else:
            ok = True
        if not ok:
            raise ConfigError(f"{where}.{key}: expected {type(default).__name__}, got {value!r}")
        out[key] = value
    return out
