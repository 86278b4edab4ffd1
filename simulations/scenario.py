"""Simulation scenarios: the TOML schema, parsed and validated into dataclasses.

A scenario names everything the network model and the fleet need; anything
wrong (unknown key, wrong type, out of range, a link to a region that does not
exist) is a :class:`swarm.errors.ConfigError` that names the offending key,
e.g. ``regions[2].uplink_mbps: must be > 0``. The full schema, with defaults,
is in ``docs/simulation.md``; ``configs/sim/small.toml`` shows every knob.

Sizes are bytes (int) or strings with a unit (``"500 MB"``, ``"4 MiB"``).
Bandwidths are Mbit/s: a number, or a distribution table
``{dist = "uniform", low = .., high = ..}`` / ``{dist = "lognormal", median = ..,
sigma = ..}``, optionally with ``stragglers = {fraction = .., factor = ..}`` in the
region (that share of nodes runs at ``factor`` times the drawn rate).
"""

from __future__ import annotations

import math
import random
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulations.network import CONGESTION
from swarm.errors import ConfigError
from swarm.protocol.config import check_knobs
from swarm.protocol.stripes import AUTO_LANES

# strategy -> CoreConfig knobs (the protocol's own switches; see docs/protocol.md).
# "full" is patchswarm shipping the whole served checkpoint (``payload.full``).
# The one list of strategies: the CLI, the scenario and the driver read it.
STRATEGY_KNOBS: dict[str, dict[str, Any]] = {
    "patchswarm": {"region_aware": True, "relay": True, "origin_only": False},
    "per-region": {"region_aware": True, "relay": False, "origin_only": False},
    "direct": {"region_aware": True, "relay": False, "origin_only": True},
    "flat": {"region_aware": False, "relay": True, "origin_only": False},
    "full": {"region_aware": True, "relay": True, "origin_only": False},
}
STRATEGIES = tuple(STRATEGY_KNOBS)
TRAINER_SITE = "trainer"
MAX_NODES = 200_000

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


@dataclass(frozen=True)
class Bandwidth:
    """A per-node bandwidth in Mbit/s: fixed or drawn from a distribution."""

    dist: str = "fixed"  # fixed | uniform | lognormal
    value: float = 1000.0  # fixed value, or lognormal median
    low: float = 0.0
    high: float = 0.0
    sigma: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high)
        if self.dist == "lognormal":
            return self.value * math.exp(rng.gauss(0.0, self.sigma))
        return self.value

    @property
    def minimum(self) -> float:
        """Smallest value the distribution can produce (lognormal: 3 sigma below)."""
        if self.dist == "uniform":
            return self.low
        if self.dist == "lognormal":
            return self.value * math.exp(-3.0 * self.sigma)
        return self.value


@dataclass(frozen=True)
class Region:
    name: str
    nodes: int
    uplink: Bandwidth
    downlink: Bandwidth
    latency_ms: float = 0.5  # one-way, between two nodes of the region
    egress_mbps: float = math.inf  # aggregate out of the region (all flows)
    ingress_mbps: float = math.inf  # aggregate into the region
    # standing queue of the shaped egress/ingress while it carries chunk data (a tbf or
    # router buffer that loss-based TCP keeps full): added to everything crossing it
    queue_ms: float = 0.0
    straggler_fraction: float = 0.0
    straggler_factor: float = 1.0
    loss: float = 0.0  # random packet loss between two nodes of the region
    cpu: Cpu = field(default_factory=lambda: Cpu())


@dataclass(frozen=True)
class Link:
    """A directed site-to-site link (sites: region names and ``trainer``)."""

    src: str
    dst: str
    mbps: float
    latency_ms: float
    loss: float = 0.0  # random packet loss: caps each TCP flow (Mathis), delays frames


@dataclass(frozen=True)
class Cpu:
    """What a node's CPU spends on the chunks it receives and the versions it applies.

    A received chunk of ``s`` bytes costs ``s/hash + s/io + chunk_overhead`` seconds
    of one core (``io``: everything else a byte costs: socket, TLS, link
    framing, the store write, its share of sending it on); applying a version of
    ``F`` bytes costs ``F/apply``. Jobs queue FIFO on ``cores`` cores; the core hears
    ``ChunkReceived`` / ``Applied`` when its job is done. ``inf`` rates cost nothing.
    """

    hash_mb_s: float = math.inf
    io_mb_s: float = math.inf
    apply_mb_s: float = math.inf
    chunk_overhead_ms: float = 0.0
    cores: int = 1

    @property
    def free(self) -> bool:
        return (self.hash_mb_s == self.io_mb_s == self.apply_mb_s == math.inf
                and self.chunk_overhead_ms == 0.0)

    def chunk_s(self, size: int) -> float:
        return size / 1e6 / self.hash_mb_s + size / 1e6 / self.io_mb_s + self.chunk_overhead_ms / 1e3

    def apply_s(self, size: int) -> float:
        return size / 1e6 / self.apply_mb_s


@dataclass(frozen=True)
class Cut:
    region: str
    start_s: float
    duration_s: float


@dataclass(frozen=True)
class Faults:
    churn: float = 0.0  # share of nodes that leave during the churn window
    churn_window_s: tuple[float, float] = (0.0, 0.0)
    downtime_s: float = 1.0  # how long a leaver stays away before it rejoins
    rejoin: bool = True  # leavers come back (restarted, resuming from their store)
    joiners: float = 0.0  # share of extra, empty nodes joining during the window
    cuts: tuple[Cut, ...] = ()
    slow_fraction: float = 0.0  # share of nodes that turn slow at ``slow_at_s``
    slow_factor: float = 1.0
    slow_at_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    strategies: tuple[str, ...]
    regions: tuple[Region, ...]
    trainer_region: str  # "" -> the trainer is its own site, linked to every region
    trainer_uplink_mbps: float
    links: dict[tuple[str, str], Link]
    patch_bytes: int
    chunk_bytes: int
    full_bytes: int
    versions: int = 1
    start_s: float = 1.0  # first publication; before it the fleet connects (a warm mesh)
    interval_s: float = 0.0  # 0: publish the next version once every live node holds the last
    apply_s: float = 0.0
    loss: float = 0.0  # default loss of every link and region ([network] loss)
    # the nodes' TCP congestion control ([network] congestion): "bbr" (what a node asks
    # for, node.driver.set_congestion) is not capped by random loss; "cubic" / "reno" (a
    # host that refuses BBR) are, near the Mathis ceiling (network.flow_ceiling)
    congestion: str = "bbr"
    mss: int = 1460
    # per-segment headers a link's shaper counts (Ethernet 14 + IPv4 20 + TCP 32 = 66 with
    # timestamps): chunk bytes take (mss + header_bytes) / mss of a link's capacity
    header_bytes: int = 0
    connect_timeout_s: float = 3.0
    sharing: str = "maxmin"  # flow model: local max-min water-filling, or cap/n bottleneck shares
    # 0: a chunk is one message, control frames queue behind every chunk byte queued on the
    # connection; N: chunks go out in N-byte blocks, a control frame waits for one block at most
    interleave_block_bytes: int = 256 * 1024
    slow_start: bool = False  # a connection's first bytes ramp up from initial_window, x2 per RTT
    initial_window: int = 10  # segments (Linux IW10)
    # with slow_start: a connection's window halves once per retransmission timeout (its RTT
    # + 200 ms) since its last chunk left, down to initial_window (Linux halves a window left
    # unused, RFC 2861, and restarts an idle one: Simulation._idle_restart); loss-based
    # congestion only: Linux exempts BBR (a congestion control with its own cong_control)
    idle_restart: bool = True
    # the node's [network] lanes: each cross-region peer link stripes a chunk over this
    # many TCP connections, each with its own window and loss ceiling. Modelled as one
    # flow with ``lanes`` x the per-flow loss ceiling and x the initial window; on a shared
    # bottleneck it still takes one flow's share (docs/striped-links.md)
    lanes: int = 1
    # lanes = "auto" (the node's default, and a scenario file's unless it says): ``lanes``
    # connections only on links with random loss, under a loss-based congestion control,
    # where the node's RandomLoss finds them (it looks at a sending socket first: their
    # initial windows are not counted)
    lanes_auto: bool = False
    # the node's [network] warm_up_kib / warm_up_min_rtt_ms (node.warm_up): with slow_start,
    # a link between regions up before the node moved any chunk is warmed by the side that
    # uploads on it, one link at a time per node (its start-up's rounds to hand the padding
    # over, and one more for its acknowledgements), and its first chunk starts from a window
    # of initial_window + the padding. The padding's own bytes are not modelled.
    warm_up_kib: int = 0  # a node's, off as shipped
    origin_warm_up_kib: int = 512  # the origin's [network] warm_up_kib, on as shipped (round 53)
    warm_up_min_rtt_ms: float = 20.0
    encode_s: float = 0.0  # trainer: time from the publish call to the hand-off to its core
    host_cores: int = 0  # > 0: every node shares one CPU of this many cores (one emulation box)
    max_time_s: float = 3600.0
    faults: Faults = field(default_factory=Faults)
    protocol: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return sum(r.nodes for r in self.regions)

    @property
    def sites(self) -> tuple[str, ...]:
        names = tuple(r.name for r in self.regions)
        return names if self.trainer_region else (TRAINER_SITE, *names)

    def trainer_site(self) -> str:
        return self.trainer_region or TRAINER_SITE

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def link(self, src: str, dst: str) -> Link:
        return self.links[(src, dst)]

    def payload_bytes(self, strategy: str) -> int:
        return self.full_bytes if strategy == "full" else self.patch_bytes


# ---------------------------------------------------------------------- parsing


class _Table:
    """A TOML table that remembers which keys were read, to reject unknown ones."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'scenario'}: must be a table")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.data.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.data

    def num(
        self,
        key: str,
        default: float | None = None,
        *,
        lo: float | None = None,
        lo_open: bool = False,
        hi: float | None = None,
    ) -> float:
        v = self.raw(key, default)
        if v is None:
            raise ConfigError(f"{self._key(key)}: required")
        if isinstance(v, str) and v.strip().lower() in ("inf", "unlimited"):
            v = math.inf
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{self._key(key)}: must be a number, got {v!r}")
        v = float(v)
        if math.isnan(v):
            raise ConfigError(f"{self._key(key)}: must be a number, got nan")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ConfigError(
                f"{self._key(key)}: must be {'>' if lo_open else '>='} {lo:g}, got {v:g}"
            )
        if hi is not None and v > hi:
            raise ConfigError(f"{self._key(key)}: must be <= {hi:g}, got {v:g}")
        return v

    def int(
        self, key: str, default: int | None = None, *, lo: int = 0, hi: int | None = None
    ) -> int:
        v = self.raw(key, default)
        if v is None:
            raise ConfigError(f"{self._key(key)}: required")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self._key(key)}: must be an integer, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            raise ConfigError(
                f"{self._key(key)}: must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}"
            )
        return v

    def str(self, key: str, default: str | None = None) -> str:
        v = self.raw(key, default)
        if v is None:
            raise ConfigError(f"{self._key(key)}: required")
        if not isinstance(v, str):
            raise ConfigError(f"{self._key(key)}: must be a string, got {v!r}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self._key(key)}: must be true or false, got {v!r}")
        return v

    def size(self, key: str, default: Any = None) -> int:
        v = self.raw(key, default)
        if v is None:
            raise ConfigError(f"{self._key(key)}: required")
        n = parse_size(v, self._key(key))
        if n <= 0:
            raise ConfigError(f"{self._key(key)}: must be > 0 bytes")
        return n

    def table(self, key: str) -> _Table:
        return _Table(self.raw(key, {}), self._key(key))

    def tables(self, key: str) -> list[_Table]:
        v = self.raw(key, [])
        if not isinstance(v, list):
            raise ConfigError(
                f"{self._key(key)}: must be an array of tables ([[{self._key(key)}]])"
            )
        return [_Table(item, f"{self._key(key)}[{i}]") for i, item in enumerate(v)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(f"{self._key(unknown[0])}: unknown key")


def parse_size(v: Any, where: str = "size") -> int:
    """``4194304`` or ``"4 MiB"`` / ``"500MB"`` -> bytes."""
    if isinstance(v, bool):
        raise ConfigError(f"{where}: must be a size, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", v)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f'{where}: not a size: {v!r} (use bytes or e.g. "4 MiB", "500 MB")')


def _bandwidth(t: _Table, key: str, default: Any) -> Bandwidth:
    v = t.raw(key, default)
    where = t._key(key)
    if isinstance(v, int | float) and not isinstance(v, bool):
        if not v > 0:
            raise ConfigError(f"{where}: must be > 0, got {v}")
        return Bandwidth("fixed", float(v))
    if isinstance(v, Bandwidth):
        return v
    d = _Table(v, where)
    kind = d.str("dist")
    if kind == "fixed":
        bw = Bandwidth("fixed", d.num("value", lo=0, lo_open=True))
    elif kind == "uniform":
        lo = d.num("low", lo=0, lo_open=True)
        hi = d.num("high", lo=lo)
        bw = Bandwidth("uniform", (lo + hi) / 2, lo, hi)
    elif kind == "lognormal":
        bw = Bandwidth(
            "lognormal", d.num("median", lo=0, lo_open=True), sigma=d.num("sigma", lo=0, hi=3)
        )
    else:
        raise ConfigError(f"{where}.dist: must be fixed, uniform or lognormal, got {kind!r}")
    d.done()
    return bw


def _latency(t: _Table, default: float) -> float:
    """One-way ``latency_ms``, or ``rtt_ms`` (= 2 x one-way); not both."""
    if t.has("latency_ms") and t.has("rtt_ms"):
        raise ConfigError(f"{t._key('rtt_ms')}: give latency_ms (one-way) or rtt_ms, not both")
    if t.has("rtt_ms"):
        return t.num("rtt_ms", lo=0) / 2.0
    return t.num("latency_ms", default, lo=0)


def _cpu(t: _Table, base: Cpu, done: bool = False) -> Cpu:
    """A ``[cpu]`` table (or a region's ``cpu = {...}``) over ``base``'s values."""
    cpu = Cpu(
        hash_mb_s=t.num("hash_mb_s", base.hash_mb_s, lo=0, lo_open=True),
        io_mb_s=t.num("io_mb_s", base.io_mb_s, lo=0, lo_open=True),
        apply_mb_s=t.num("apply_mb_s", base.apply_mb_s, lo=0, lo_open=True),
        chunk_overhead_ms=t.num("chunk_overhead_ms", base.chunk_overhead_ms, lo=0, hi=60_000),
        cores=t.int("cores", base.cores, lo=1, hi=4096),
    )
    if done:
        t.done()
    return cpu


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario TOML file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read scenario: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
    return parse_scenario(data, default_name=p.stem)


def parse_scenario(data: dict[str, Any], default_name: str = "scenario") -> Scenario:
    """Validate a parsed TOML document into a :class:`Scenario`."""
    top = _Table(data, "")
    name = top.str("name", default_name)
    seed = top.int("seed", 0, lo=0, hi=2**63 - 1)
    strategies = top.raw("strategies", ["patchswarm"])
    if isinstance(strategies, str):
        strategies = [strategies]
    strategies = validate_strategies(strategies, "strategies")
    max_time = top.num("max_time_s", 3600.0, lo=0, lo_open=True)

    pay = top.table("payload")
    patch_bytes = pay.size("patch")
    chunk_bytes = pay.size("chunk", 4 * 2**20)
    full_bytes = pay.size("full", patch_bytes)
    versions = pay.int("versions", 1, lo=1, hi=1000)
    interval = pay.num("interval_s", 0.0, lo=0)
    start_s = pay.num("start_s", 1.0, lo=0)
    apply_s = pay.num("apply_s", 0.0, lo=0)
    pay.done()
    for what, size in (("patch", patch_bytes), ("full", full_bytes)):
        if -(-size // chunk_bytes) > 100_000:
            raise ConfigError(
                f"payload.{what}: more than 100000 chunks of payload.chunk; raise the chunk size"
            )

    net = top.table("network")
    loss = net.num("loss", 0.0, lo=0, hi=0.5)
    mss = net.int("mss", 1460, lo=100, hi=65536)
    header_bytes = net.int("header_bytes", 0, lo=0, hi=1024)
    ctimeout = net.num("connect_timeout_s", 3.0, lo=0, lo_open=True)
    congestion = net.str("congestion", "bbr")
    if congestion not in CONGESTION:
        raise ConfigError(f"network.congestion: must be one of {', '.join(CONGESTION)}, "
                          f"got {congestion!r}")
    sharing = net.str("sharing", "maxmin")
    if sharing not in ("maxmin", "bottleneck"):
        raise ConfigError(f"network.sharing: must be maxmin or bottleneck, got {sharing!r}")
    block = net.raw("interleave_block_bytes", 256 * 1024)
    block = 0 if block == 0 else parse_size(block, "network.interleave_block_bytes")
    if block < 0:
        raise ConfigError("network.interleave_block_bytes: must be >= 0 (0: whole-chunk messages)")
    slow_start = net.bool("slow_start", False)
    iw = net.int("initial_window", 10, lo=1, hi=1000)
    idle_restart = net.bool("idle_restart", True)
    lanes_auto = net.raw("lanes", "auto") == "auto"  # the node's default
    lanes = AUTO_LANES if lanes_auto else net.int("lanes", 1, lo=1, hi=64)
    warm_kib = net.int("warm_up_kib", 0, lo=0, hi=32 * 1024)
    origin_warm_kib = net.int("origin_warm_up_kib", 512, lo=0, hi=32 * 1024)
    warm_rtt = net.num("warm_up_min_rtt_ms", 20.0, lo=0)
    net.done()

    ct = top.table("cpu")
    host_cores = ct.int("host_cores", 0, lo=0, hi=4096)
    d_cpu = _cpu(ct, Cpu())
    ct.done()

    defaults = top.table("defaults")
    d_up = _bandwidth(defaults, "uplink_mbps", 1000.0)
    d_down = _bandwidth(defaults, "downlink_mbps", 1000.0)
    d_lat = _latency(defaults, 0.5)
    d_loss = defaults.num("loss", loss, lo=0, hi=0.5)
    defaults.done()

    regions: list[Region] = []
    for rt in top.tables("regions"):
        rname = rt.str("name")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", rname):
            raise ConfigError(
                f"{rt.path}.name: must be 1-63 chars of letters, digits, '_', '.', '-'"
            )
        if rname == TRAINER_SITE:
            raise ConfigError(
                f"{rt.path}.name: {TRAINER_SITE!r} is reserved for the trainer's site"
            )
        if any(r.name == rname for r in regions):
            raise ConfigError(f"{rt.path}.name: duplicate region {rname!r}")
        strag = rt.table("stragglers")
        sf = strag.num("fraction", 0.0, lo=0, hi=1)
        sk = strag.num("factor", 1.0, lo=0, lo_open=True, hi=1)
        strag.done()
        regions.append(
            Region(
                name=rname,
                nodes=rt.int("nodes", lo=1, hi=MAX_NODES),
                uplink=_bandwidth(rt, "uplink_mbps", d_up),
                downlink=_bandwidth(rt, "downlink_mbps", d_down),
                latency_ms=_latency(rt, d_lat),
                loss=rt.num("loss", d_loss, lo=0, hi=0.5),
                cpu=_cpu(rt.table("cpu"), d_cpu, done=True),
                egress_mbps=rt.num("egress_mbps", math.inf, lo=0, lo_open=True),
                ingress_mbps=rt.num("ingress_mbps", math.inf, lo=0, lo_open=True),
                queue_ms=rt.num("queue_ms", 0.0, lo=0, hi=10_000),
                straggler_fraction=sf,
                straggler_factor=sk,
            )
        )
        rt.done()
    if not regions:
        raise ConfigError("regions: at least one [[regions]] table is required")
    if sum(r.nodes for r in regions) > MAX_NODES:
        raise ConfigError(f"regions: more than {MAX_NODES} nodes in total")
    names = {r.name for r in regions}

    tr = top.table("trainer")
    trainer_region = tr.str("region", "")
    if trainer_region and trainer_region not in names:
        raise ConfigError(
            f"trainer.region: unknown region {trainer_region!r} (known: {', '.join(sorted(names))})"
        )
    trainer_up = tr.num("uplink_mbps", 10_000.0, lo=0, lo_open=True)
    encode_s = tr.num("encode_s", 0.0, lo=0)
    encode_s += patch_bytes / 1e6 / tr.num("encode_mb_s", math.inf, lo=0, lo_open=True)
    tr.done()
    sites = ([] if trainer_region else [TRAINER_SITE]) + [r.name for r in regions]

    lt = top.table("links")
    dflt_mbps = lt.num("mbps", math.inf, lo=0, lo_open=True)
    dflt_lat = _latency(lt, 40.0)
    dflt_loss = lt.num("loss", loss, lo=0, hi=0.5)
    links: dict[tuple[str, str], Link] = {}
    for a in sites:
        for b in sites:
            if a != b:
                links[(a, b)] = Link(a, b, dflt_mbps, dflt_lat, dflt_loss)
    for pt in lt.tables("pairs"):
        src = pt.str("from")
        dst = pt.str("to")
        for k, s in (("from", src), ("to", dst)):
            if s not in sites:
                raise ConfigError(f"{pt.path}.{k}: unknown site {s!r} (known: {', '.join(sites)})")
        if src == dst:
            raise ConfigError(f"{pt.path}: from and to are the same site {src!r}")
        old = links[(src, dst)]
        link = Link(
            src,
            dst,
            pt.num("mbps", old.mbps, lo=0, lo_open=True),
            _latency(pt, old.latency_ms),
            pt.num("loss", old.loss, lo=0, hi=0.5),
        )
        links[(src, dst)] = link
        if pt.bool("symmetric", True):
            links[(dst, src)] = Link(dst, src, link.mbps, link.latency_ms, link.loss)
        pt.done()
    lt.done()

    ft = top.table("faults")
    window = ft.raw("churn_window_s", [0.0, 0.0])
    if (
        not isinstance(window, list)
        or len(window) != 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in window)
        or not 0 <= window[0] <= window[1]
    ):
        raise ConfigError(
            "faults.churn_window_s: must be [start, end] seconds with 0 <= start <= end"
        )
    cuts = []
    for ct in ft.tables("cuts"):
        cr = ct.str("region")
        if cr not in names:
            raise ConfigError(f"{ct.path}.region: unknown region {cr!r}")
        cuts.append(Cut(cr, ct.num("start_s", lo=0), ct.num("duration_s", lo=0, lo_open=True)))
        ct.done()
    slow = ft.table("slow")
    faults = Faults(
        churn=ft.num("churn", 0.0, lo=0, hi=0.9),
        churn_window_s=(float(window[0]), float(window[1])),
        downtime_s=ft.num("downtime_s", 1.0, lo=0),
        rejoin=ft.bool("rejoin", True),
        joiners=ft.num("joiners", 0.0, lo=0, hi=1),
        cuts=tuple(cuts),
        slow_fraction=slow.num("fraction", 0.0, lo=0, hi=1),
        slow_factor=slow.num("factor", 1.0, lo=0, lo_open=True, hi=1),
        slow_at_s=slow.num("at_s", 0.0, lo=0),
    )
    slow.done()
    ft.done()
    if (faults.churn > 0 or faults.joiners > 0) and faults.churn_window_s[
        1
    ] <= faults.churn_window_s[0]:
        raise ConfigError("faults.churn_window_s: churn or joiners need a window with end > start")

    proto = top.raw("protocol", {})
    if not isinstance(proto, dict):
        raise ConfigError("protocol: must be a table of CoreConfig fields")
    proto = check_knobs(proto, "protocol")  # names and types; ranges when a node is built
    top.done()

    return Scenario(
        name=name,
        seed=seed,
        strategies=strategies,
        regions=tuple(regions),
        trainer_region=trainer_region,
        trainer_uplink_mbps=trainer_up,
        links=links,
        patch_bytes=patch_bytes,
        chunk_bytes=chunk_bytes,
        full_bytes=full_bytes,
        versions=versions,
        start_s=start_s,
        interval_s=interval,
        apply_s=apply_s,
        loss=loss,
        congestion=congestion,
        mss=mss,
        header_bytes=header_bytes,
        connect_timeout_s=ctimeout,
        sharing=sharing,
        interleave_block_bytes=block,
        slow_start=slow_start,
        initial_window=iw,
        idle_restart=idle_restart,
        lanes=lanes,
        lanes_auto=lanes_auto,
        warm_up_kib=warm_kib,
        origin_warm_up_kib=origin_warm_kib,
        warm_up_min_rtt_ms=warm_rtt,
        encode_s=encode_s,
        host_cores=host_cores,
        max_time_s=max_time,
        faults=faults,
        protocol=dict(proto),
    )


def validate_strategies(values: Any, where: str = "--strategies") -> tuple[str, ...]:
    if not isinstance(values, list | tuple) or not values:
        raise ConfigError(f"{where}: must be a non-empty list of strategies")
    out = []
    for s in values:
        if s not in STRATEGIES:
            raise ConfigError(
                f"{where}: unknown strategy {s!r} (choose from {', '.join(STRATEGIES)})"
            )
        if s not in out:
            out.append(s)
    return tuple(out)
