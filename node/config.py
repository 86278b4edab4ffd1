"""TOML configuration of a node daemon (and of the trainer's seeding node).

Read with ``tomllib`` and validated at start, so a typo fails before anything
listens: every error is a ``ConfigError`` that names the offending key
(``network.listen: ...``). Relative paths are taken relative to the config
file's directory, so a config and its keys can travel together.

Layout (see configs/node.toml for a commented example)::

    [node]     id, region, model, role ("node" | "origin"), warm_memory_mib (heap touched
               at start so the first version runs on warm memory; 0 = off)
    [network]  listen = "host:port", advertise = "host:port" (default: listen),
               bootstrap = ["host:port", ...], swarm_secret (hex) or swarm_secret_file,
               congestion_control ("bbr"; "" = the system's), read_coalesce_ms, ...
    [trust]    trainer_keys = ["trainer.pub", ...]       (Ed25519 public keys, PEM),
               node_key = "node.x25519" (X25519 private key: opens confidential versions)
    [store]    dir, quota_bytes (0 = none), keep_versions (0 = keep all), fsync
    [weights]  base (safetensors), base_version, device ("auto" | "cpu" | "cuda" | "cuda:N")
    [publish]  signing_key, chunk_size, served_dtype, context, anchor_every (0 = off),
               max_lag (0 = off), max_lag_fraction, max_lag_timeout_s,
               recipients = ["keys/a.x25519.pub", "keys/"] (confidential mode: X25519
               public keys, or directories of *.pub files)  (origin only)
    [swarm]    any ``CoreConfig`` policy knob, e.g. mesh_degree = 6
    [engine]   kind ("inprocess" | "vllm" | "sglang"), url, timeouts, pause_mode, ...
               (see ``node.engines.config``)
    [gateway]  listen, hold_max_s, retry_after_s, ... (see ``node.gateway_config``)
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.engines.config import EngineConfig, parse_engine
from node.gateway_config import GatewayConfig, parse_gateway
from node.token_file import read_token
from swarm.errors import ConfigError
from swarm.protocol.config import CoreConfig, check_knobs
from swarm.protocol.stripes import AUTO_LANES

_SECTIONS = {
    "node": {"id", "region", "model", "role", "warm_memory_mib"},
    "network": {"listen", "advertise", "bootstrap", "swarm_secret", "swarm_secret_file",
                "max_connections", "max_connections_per_ip", "upgrade_timeout_s",
                "allow_plaintext", "unsent_limit_kib", "read_coalesce_ms", "read_lowat_kib", "lanes",
                "frames", "max_block_kib",
                "congestion_control", "congestion_restart_s", "congestion_restart_idle_s",
                "warm_up_kib",
                "warm_up_min_rtt_ms"},
    "trust": {"trainer_keys", "node_key"},
    "store": {"dir", "quota_bytes", "keep_versions", "fsync"},
    "weights": {"base", "base_version", "device"},
    "publish": {"signing_key", "chunk_size", "served_dtype", "context", "anchor_every",
                "max_lag", "max_lag_fraction", "max_lag_timeout_s", "recipients",
                "encode_threads"},
    "swarm": None,  # checked against CoreConfig's fields
    "log": {"level", "format"},
    "engine": None,  # checked by node.engines.config.parse_engine
    "tls": {"ca", "cert", "key"},
    "api": {"listen", "token_file"},
    "gateway": None,  # checked by node.gateway_config.parse_gateway
}
MAX_CONFIG_BYTES = 1024 * 1024
MAX_WARM_MEMORY_MIB = 1536  # glibc's trim threshold is an int (node.daemon.tune_malloc)
DEFAULT_WARM_MEMORY_MIB = 256
# an origin's encode works on several views' worth of buffers (the last view, the new one,
# byte planes, the patch and its chunks) beside the trainer's own: with 256 MiB a dense
# 64 MiB version's encode still faulted 12-16k fresh pages from the second version on
# (docs/benchmarks.md round 36)
DEFAULT_ORIGIN_WARM_MEMORY_MIB = 1024
# [network] warm_up_kib by role (node.warm_up): the origin warms its links to the borders
# it pushes to; a node's links between regions stay cold (docs/benchmarks.md rounds 42
# and 53)
DEFAULT_WARM_UP_KIB = 0
DEFAULT_ORIGIN_WARM_UP_KIB = 512


@dataclass(frozen=True)
class TlsFiles:
    """``[tls]``: the swarm CA certificate and this node's certificate and key."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class NodeConfig:
    """A validated node (or origin) configuration."""

    node_id: str
    region: str
    model: str
    role: str
    listen_host: str
    listen_port: int
    advertise: str
    bootstrap: tuple[str, ...]
    swarm_secret: bytes
    trainer_keys: tuple[Path, ...]
    store_dir: Path
    quota_bytes: int | None
    keep_versions: int
    fsync: bool
    base: Path | None
    base_version: int
    device: str
    signing_key: Path | None = None
    chunk_size: int = 4 * 1024 * 1024
    served_dtype: str = "bf16"
    codec_context: str = "auto"  # swarm.codec context models: auto | on | off
    # threads that encode a version's tensors in parallel (0: "auto", see encode_threads())
    encode_threads: int = 0
    anchor_every: int = 0  # every N-th publish is followed by a full checkpoint (0: never)
    max_lag: int = 0  # publishing v waits until the fleet serves v - max_lag (0: never waits)
    max_lag_fraction: float = 1.0  # share of the reporting nodes that must be that current
    max_lag_timeout_s: float = 600.0  # then StalenessTimeout names the laggards
    node_key: Path | None = None  # X25519 private key that opens confidential versions
    recipients: tuple[Path, ...] = ()  # confidential mode: publish encrypted for these keys
    log_level: str = "info"
    log_format: str = "text"  # "text" (key=value) or "json" (one object per line)
    swarm: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    tls: TlsFiles | None = None  # mutual TLS with the swarm CA on the swarm port
    api_listen: tuple[str, int] | None = None  # own HTTP API address (None: the swarm port)
    api_token: str | None = None  # bearer token for every API path but /healthz
    max_connections: int = 1024  # open connections on the swarm port, all peers
    max_connections_per_ip: int = 32  # from one address
    upgrade_timeout_s: float = 10.0  # to finish TLS + the link preface
    # unsent bytes the kernel may hold per peer socket (TCP_NOTSENT_LOWAT; 0: the kernel's own)
    unsent_limit_kib: int = 128
    # the longest a peer link holds its socket while data streams in, to read a batch at
    # once (0: a read per wake-up; node.link: 192 KiB at the link's rate, 2 ms at least)
    read_coalesce_ms: float = 2.0
    # inside a large message (a chunk block), the bytes the kernel gathers before it wakes
    # a peer link, at most (SO_RCVLOWAT; 0: off, timed holds only; node.link._gather)
    read_lowat_kib: int = 256
    # the largest block of a chunk a link sends, on a link fast enough to carry it in
    # 10 ms (a multiple of 256 in 256..1024; 256: always 256 KiB; node.driver._block_size)
    max_block_kib: int = 1024
    # after the mutual-TLS handshake, carry each link message as one AES-256-GCM frame under
    # keys exchanged in the TLS channel, where the peer offers it too (node.frames)
    frames: bool = True
    # TCP congestion control of peer sockets ("": the system's; node.driver.set_congestion)
    congestion_control: str = "bbr"
    # BBR started over on a link whose chunk runs this long, or starts after idle (0: never;
    # node.tcp.CongestionRestart)
    congestion_restart_s: float = 1.0
    # ... and on a link whose chunk starts after this long without one (0: never)
    congestion_restart_idle_s: float = 0.2
    # padding written on an idle link between regions, before any chunk went over it, to
    # open TCP's window for the first version (0: never; node.warm_up; by default 512 on
    # the origin, 0 on a node), on links whose round trip is this long or longer
    warm_up_kib: int = DEFAULT_WARM_UP_KIB
    warm_up_min_rtt_ms: float = 20.0
    # connections a link that carries chunks to another region stripes them over, the
    # dialer's choice (1: one; docs/striped-links.md); they count against the other
    # side's max_connections and max_connections_per_ip. ``lanes_auto`` ("auto" in the
    # TOML): ``lanes`` (stripes.AUTO_LANES) only on a link found capped by random loss
    lanes: int = AUTO_LANES
    lanes_auto: bool = True
    gateway: GatewayConfig | None = None  # the version-pinned request gateway (None: off)
    warm_memory_mib: int = DEFAULT_WARM_MEMORY_MIB  # heap touched once at start (node.daemon.warm_heap)

    def core_config(self, active_version: int | None = None) -> CoreConfig:
        """The protocol core's knobs for this node; ``active_version`` defaults to the base."""
        return CoreConfig(
            node_id=self.node_id,
            region=self.region,
            model=self.model,
            listen_addr=self.advertise,
            role=self.role,
            bootstrap=self.bootstrap,
            swarm_secret=self.swarm_secret,
            active_version=self.base_version if active_version is None else active_version,
            **self.swarm,
        )


# ------------------------------------------------------------------ helpers


def _get(sec: dict, section: str, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    name = f"{section}.{key}"
    if key not in sec:
        if default is ...:
            raise ConfigError(f"{name}: missing (required)")
        return default
    value = sec[key]
    if kind is int and isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{name}: expected {want}, got {type(value).__name__} {value!r}")
    return value


def _nonempty(value: str, name: str, limit: int = 128) -> str:
    if not value or len(value) > limit or any(c.isspace() for c in value):
        raise ConfigError(f"{name}: must be 1..{limit} characters without spaces, got {value!r}")
    return value


def parse_addr(text: str, name: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ``ConfigError`` naming ``name`` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: expected \"host:port\" with a port in 1..65535, got {text!r}")
    return host, int(port)


def _path(base_dir: Path, text: str, name: str) -> Path:
    if not text:
        raise ConfigError(f"{name}: empty path")
    p = Path(text).expanduser()
    return p if p.is_absolute() else base_dir / p


MAX_SECRET_FILE = 4096


def _secret(net: dict, base_dir: Path) -> bytes:
    if "swarm_secret" in net and "swarm_secret_file" in net:
        raise ConfigError("network.swarm_secret: give either swarm_secret or swarm_secret_file")
    if "swarm_secret_file" in net:
        p = _path(base_dir, _get(net, "network", "swarm_secret_file", str), "network.swarm_secret_file")
        try:
            with open(p, "rb") as f:  # bounded: the path may name a device or a huge file
                raw = f.read(MAX_SECRET_FILE + 1)
        except OSError as exc:
            raise ConfigError(f"network.swarm_secret_file: cannot read {p}: {exc.strerror}") from None
        if len(raw) > MAX_SECRET_FILE:
            raise ConfigError(f"network.swarm_secret_file: {p} is larger than {MAX_SECRET_FILE} "
                              "bytes; expected a short hex secret")
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"network.swarm_secret_file: {p} is binary; expected hex digits "
                              "(e.g. `openssl rand -hex 32 > swarm.secret`)") from None
    else:
        text = _get(net, "network", "swarm_secret", str)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigError("network.swarm_secret: expected hex digits") from None
    if len(secret) < 16:
        raise ConfigError("network.swarm_secret: need at least 16 bytes (32 hex digits)")
    return secret


def _swarm_knobs(sec: dict) -> dict[str, Any]:
    return check_knobs(sec, "swarm")  # the one knob check, shared with simulation scenarios


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _int_in(net: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = _get(net, "network", key, int, default)
    if not lo <= value <= hi:
        raise ConfigError(f"network.{key}: must be in {lo}..{hi}, got {value}")
    return value


def _max_block(net: dict) -> int:
    """``[network] max_block_kib``: whole ``wire.BLOCK_BYTES`` blocks, up to
    ``node.driver.MAX_BLOCK_BYTES``."""
    value = _int_in(net, "max_block_kib", 1024, 256, 1024)
    if value % 256:
        raise ConfigError(f"network.max_block_kib: must be a multiple of 256, got {value}")
    return value


def _lanes(net: dict) -> dict[str, Any]:
    """``[network] lanes``: a count in 1..16, or "auto" (node.tcp.RandomLoss decides)."""
    value = net.get("lanes", "auto")
    if value == "auto":
        return {"lanes": AUTO_LANES, "lanes_auto": True}
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 16:
        raise ConfigError(f"network.lanes: \"auto\" or a count in 1..16, got {value!r}")
    return {"lanes": value, "lanes_auto": False}


def _tls(sec: dict | None, base_dir: Path, node_id: str, region: str, role: str) -> TlsFiles | None:
    """``[tls]``: check the files now, and that the certificate names this node."""
    if sec is None:
        return None
    files = TlsFiles(*(_path(base_dir, _get(sec, "tls", k, str), f"tls.{k}")
                       for k in ("ca", "cert", "key")))
    from swarm.trust import ca

    try:
        ca.server_context(files.ca, files.cert, files.key)
        ident = ca.identity_of_pem(files.cert.read_bytes())
    except ConfigError as exc:
        raise ConfigError(f"tls.cert: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"tls.cert: cannot read {files.cert}: {exc.strerror}") from None
    if ident != ca.Identity(node_id, region, role):
        raise ConfigError(f"tls.cert: {files.cert} is for {ident.node_id}/{ident.region}/"
                          f"{ident.role}, this node is {node_id}/{region}/{role}")
    return files


MAX_RECIPIENT_FILES = 1024


def _node_key(trust: dict, base_dir: Path) -> Path | None:
    """``[trust] node_key``: an X25519 private key file, checked now."""
    if "node_key" not in trust:
        return None
    p = _path(base_dir, _get(trust, "trust", "node_key", str), "trust.node_key")
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from swarm.errors import ManifestError
    from swarm.trust.keys import load_private_key

    try:
        key = load_private_key(p)
    except ManifestError as exc:
        raise ConfigError(f"trust.node_key: {exc}") from None
    if not isinstance(key, X25519PrivateKey):
        raise ConfigError(f"trust.node_key: {p} is an Ed25519 key, not an X25519 node key "
                          "(make one with `patchswarm keygen --x25519 FILE`)")
    return p


def _recipients(publish: dict, base_dir: Path) -> tuple[Path, ...]:
    """``[publish] recipients``: X25519 public key files, or directories of ``*.pub``
    files, checked now; the error names the key file."""
    items = _get(publish, "publish", "recipients", list, [])
    files: list[Path] = []
    for i, item in enumerate(items):
        name = f"publish.recipients[{i}]"
        if not isinstance(item, str):
            raise ConfigError(f"{name}: expected a key file or directory path, got {item!r}")
        p = _path(base_dir, item, name)
        if p.is_dir():
            found = sorted(q for q in p.glob("*.pub") if q.is_file())
            if not found:
                raise ConfigError(f"{name}: directory {p} holds no *.pub key files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise ConfigError(f"{name}: {p} does not exist")
    if len(files) > MAX_RECIPIENT_FILES:
        raise ConfigError(f"publish.recipients: {len(files)} keys, at most {MAX_RECIPIENT_FILES}")
    from swarm.errors import ManifestError
    from swarm.trust.confidential import load_recipients
    from swarm.trust.keys import key_id

    seen: dict[str, Path] = {}
    for f in files:
        try:
            (pub,) = load_recipients([f])
        except ManifestError as exc:
            raise ConfigError(f"publish.recipients: {exc}") from None
        kid = key_id(pub)
        if kid in seen:
            raise ConfigError(f"publish.recipients: {f} is the same key as {seen[kid]}")
        seen[kid] = f
    return tuple(files)


def _api(sec: dict, base_dir: Path, tls: bool,
         swarm: tuple[str, int]) -> tuple[tuple[str, int] | None, str | None]:
    """``[api]``: its own address (required with TLS: peers and people differ), a token."""
    listen = None
    if "listen" in sec:
        listen = parse_addr(_get(sec, "api", "listen", str), "api.listen")
        if listen == swarm:
            listen = None
    elif tls:
        raise ConfigError("api.listen: required with [tls] (the swarm port takes only peers "
                          "with swarm certificates), e.g. \"127.0.0.1:7401\"")
    token = None
    if "token_file" in sec:
        path = _path(base_dir, _get(sec, "api", "token_file", str), "api.token_file")
        token = read_token(path, "api.token_file")
    return listen, token


def encode_threads(configured: int) -> int:
    """Threads the origin encodes with: ``configured``, or for 0 ("auto") the CPUs this
    process may run on, at most 8 (an encode is one tensor per thread and bound by
    memory bandwidth well before a trainer host's core count)."""
    if configured > 0:
        return configured
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _publish_control(sec: dict) -> dict[str, Any]:
    """``[publish]`` anchors and bounded staleness (docs/control-plane.md)."""
    anchor_every = _get(sec, "publish", "anchor_every", int, 0)
    if not 0 <= anchor_every <= 1_000_000:
        raise ConfigError(f"publish.anchor_every: must be in 0..1000000 (0 = no anchors), "
                          f"got {anchor_every}")
    max_lag = _get(sec, "publish", "max_lag", int, 0)
    if not 0 <= max_lag <= 1_000_000:
        raise ConfigError(f"publish.max_lag: must be in 0..1000000 (0 = never wait), got {max_lag}")
    fraction = _get(sec, "publish", "max_lag_fraction", (int, float), 1.0)
    if isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
        raise ConfigError(f"publish.max_lag_fraction: must be a number in (0, 1], got {fraction!r}")
    timeout = _get(sec, "publish", "max_lag_timeout_s", (int, float), 600.0)
    if isinstance(timeout, bool) or not 0.0 < timeout <= 7 * 86400:
        raise ConfigError(f"publish.max_lag_timeout_s: must be a number of seconds in "
                          f"(0, 604800], got {timeout!r}")
    if ("max_lag_fraction" in sec or "max_lag_timeout_s" in sec) and max_lag == 0:
        raise ConfigError("publish.max_lag: max_lag_fraction and max_lag_timeout_s need "
                          "max_lag >= 1")
    return {"anchor_every": anchor_every, "max_lag": max_lag,
            "max_lag_fraction": float(fraction), "max_lag_timeout_s": float(timeout)}


# --------------------------------------------------------------------- load


def parse_config(data: dict[str, Any], base_dir: Path, source: Path | None = None) -> NodeConfig:
    """Validate a decoded TOML document into a ``NodeConfig``."""
    for section, value in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{section}: unknown section (expected one of {sorted(_SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{section}: must be a [table]")
        allowed = _SECTIONS[section]
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    raise ConfigError(f"{section}.{key}: unknown key")
    node = data.get("node") or {}
    net = data.get("network") or {}
    trust = data.get("trust") or {}
    store = data.get("store") or {}
    weights = data.get("weights") or {}
    publish = data.get("publish") or {}
    if not node:
        raise ConfigError("node: missing section [node]")
    role = _get(node, "node", "role", str, "node")
    if role not in ("node", "origin"):
        raise ConfigError(f"node.role: expected \"node\" or \"origin\", got {role!r}")
    node_id = _nonempty(_get(node, "node", "id", str), "node.id")
    region = _nonempty(_get(node, "node", "region", str), "node.region", 64)
    model = _nonempty(_get(node, "node", "model", str), "node.model")
    warm = _get(node, "node", "warm_memory_mib", int,
                DEFAULT_ORIGIN_WARM_MEMORY_MIB if role == "origin" else DEFAULT_WARM_MEMORY_MIB)
    if not 0 <= warm <= MAX_WARM_MEMORY_MIB:
        raise ConfigError(f"node.warm_memory_mib: must be in 0..{MAX_WARM_MEMORY_MIB} "
                          f"(0 = off), got {warm}")
    listen = _get(net, "network", "listen", str)
    host, port = parse_addr(listen, "network.listen")
    advertise = _get(net, "network", "advertise", str, listen)
    parse_addr(advertise, "network.advertise")
    bootstrap = _get(net, "network", "bootstrap", list, [])
    for i, b in enumerate(bootstrap):
        if not isinstance(b, str):
            raise ConfigError(f"network.bootstrap[{i}]: expected \"host:port\", got {b!r}")
        parse_addr(b, f"network.bootstrap[{i}]")
    secret = _secret(net, base_dir)
    keys = _get(trust, "trust", "trainer_keys", list, [])
    if role == "node" and not keys:
        raise ConfigError("trust.trainer_keys: a node needs at least one trusted trainer key")
    key_paths = tuple(
        _path(base_dir, _get({f"trainer_keys[{i}]": k}, "trust", f"trainer_keys[{i}]", str),
              f"trust.trainer_keys[{i}]")
        for i, k in enumerate(keys))
    quota = _get(store, "store", "quota_bytes", int, 0)
    if quota < 0:
        raise ConfigError("store.quota_bytes: must be >= 0 (0 = no quota)")
    keep = _get(store, "store", "keep_versions", int, 0)
    if keep < 0:
        raise ConfigError("store.keep_versions: must be >= 0 (0 = keep all)")
    base_text = _get(weights, "weights", "base", str, "")
    base = _path(base_dir, base_text, "weights.base") if base_text else None
    if role == "node" and base is None:
        raise ConfigError("weights.base: a node needs a base safetensors checkpoint")
    base_version = _get(weights, "weights", "base_version", int, 1)
    if base_version < 1:
        raise ConfigError("weights.base_version: must be >= 1 (manifests number versions from 1)")
    device = _get(weights, "weights", "device", str, "auto")
    if device != "auto" and device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"weights.device: expected auto, cpu, cuda or cuda:N, got {device!r}")
    sk = _get(publish, "publish", "signing_key", str, "")
    signing_key = _path(base_dir, sk, "publish.signing_key") if sk else None
    if role == "origin" and signing_key is None:
        raise ConfigError("publish.signing_key: the origin needs an Ed25519 signing key")
    chunk_size = _get(publish, "publish", "chunk_size", int, 4 * 1024 * 1024)
    if not 1024 <= chunk_size <= 64 * 1024 * 1024:
        raise ConfigError("publish.chunk_size: must be in 1 KiB..64 MiB")
    served = _get(publish, "publish", "served_dtype", str, "bf16")
    if served not in ("bf16", "fp8"):
        raise ConfigError(f"publish.served_dtype: expected bf16 or fp8, got {served!r}")
    context = _get(publish, "publish", "context", str, "auto")
    if context not in ("auto", "on", "off"):
        raise ConfigError(f"publish.context: expected auto, on or off, got {context!r}")
    control = _publish_control(publish)
    threads = publish.get("encode_threads", "auto")
    if threads == "auto":
        threads = 0
    elif isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
        raise ConfigError(f"publish.encode_threads: \"auto\" or a number of threads in "
                          f"1..256, got {threads!r}")
    control["encode_threads"] = threads
    if role != "origin":
        for key in ("anchor_every", "max_lag", "max_lag_fraction", "max_lag_timeout_s",
                    "encode_threads"):
            if key in publish:
                raise ConfigError(f"publish.{key}: only the origin (node.role = \"origin\") "
                                  "publishes")
    recipients = _recipients(publish, base_dir)
    if recipients and chunk_size <= 16:
        raise ConfigError("publish.chunk_size: too small for confidential mode")
    node_key = _node_key(trust, base_dir)
    level = _get(data.get("log") or {}, "log", "level", str, "info")
    if level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log.level: expected debug, info, warning or error, got {level!r}")
    log_format = _get(data.get("log") or {}, "log", "format", str, "text")
    if log_format not in ("text", "json"):
        raise ConfigError(f"log.format: expected text or json, got {log_format!r}")
    store_dir = _path(base_dir, _get(store, "store", "dir", str), "store.dir")
    engine = parse_engine(data.get("engine"), base_dir, store_dir)
    if engine.external and role != "node":
        raise ConfigError("engine.kind: only a rollout node (node.role = \"node\") feeds an engine")
    conn_caps = {
        "max_connections": _int_in(net, "max_connections", 1024, 1, 1_000_000),
        "max_connections_per_ip": _int_in(net, "max_connections_per_ip", 32, 1, 1_000_000),
        "unsent_limit_kib": _int_in(net, "unsent_limit_kib", 128, 0, 1 << 20),
        # node.warm_up: on for the origin's pushes, off for nodes (docs/benchmarks.md
        # rounds 42 and 53)
        "warm_up_kib": _int_in(net, "warm_up_kib",
                               DEFAULT_ORIGIN_WARM_UP_KIB if role == "origin" else DEFAULT_WARM_UP_KIB,
                               0, 32 * 1024),
        "read_lowat_kib": _int_in(net, "read_lowat_kib", 256, 0, 4096),
        "max_block_kib": _max_block(net),
        **_lanes(net),
    }
    upgrade = _get(net, "network", "upgrade_timeout_s", (int, float), 10.0)
    if isinstance(upgrade, bool) or not 0.1 <= upgrade <= 600:
        raise ConfigError(f"network.upgrade_timeout_s: must be a number in 0.1..600, got {upgrade!r}")
    coalesce = _get(net, "network", "read_coalesce_ms", (int, float), 2.0)
    if isinstance(coalesce, bool) or not 0 <= coalesce <= 50:
        raise ConfigError(f"network.read_coalesce_ms: must be a number in 0..50, got {coalesce!r}")
    congestion = _get(net, "network", "congestion_control", str, "bbr")
    if not re.fullmatch(r"[a-z0-9_]{0,15}", congestion):
        raise ConfigError("network.congestion_control: a Linux congestion control name "
                          f"(bbr, cubic, ...: [a-z0-9_], at most 15) or \"\", got {congestion!r}")
    restart = _get(net, "network", "congestion_restart_s", (int, float), 1.0)
    if isinstance(restart, bool) or not (restart == 0 or 0.05 <= restart <= 60):
        raise ConfigError("network.congestion_restart_s: 0 (never) or seconds in 0.05..60, "
                          f"got {restart!r}")
    restart_idle = _get(net, "network", "congestion_restart_idle_s", (int, float), 0.2)
    if isinstance(restart_idle, bool) or not (restart_idle == 0 or 0.01 <= restart_idle <= 60):
        raise ConfigError("network.congestion_restart_idle_s: 0 (never) or seconds in 0.01..60, "
                          f"got {restart_idle!r}")
    warm_rtt = _get(net, "network", "warm_up_min_rtt_ms", (int, float), 20.0)
    if isinstance(warm_rtt, bool) or not 0 <= warm_rtt <= 10_000:
        raise ConfigError("network.warm_up_min_rtt_ms: must be a number in 0..10000, "
                          f"got {warm_rtt!r}")
    tls = _tls(data.get("tls"), base_dir, node_id, region, role)
    frames = _get(net, "network", "frames", bool, True)
    plaintext = _get(net, "network", "allow_plaintext", bool, False)
    if tls is None and not plaintext and not _loopback(host):
        raise ConfigError(
            f"tls: a node listening on {host} needs [tls] (mutual TLS with certificates from "
            "the swarm CA: `patchswarm ca`, docs/security.md); set network.allow_plaintext = "
            "true to accept peers whose identity nobody proves")
    api_listen, api_token = _api(data.get("api") or {}, base_dir, tls is not None, (host, port))
    gateway = parse_gateway(data.get("gateway"), base_dir, ((host, port), api_listen))
    if gateway is not None and role != "node":
        raise ConfigError("gateway: only a rollout node (node.role = \"node\") serves requests")
    cfg = NodeConfig(
        tls=tls, api_listen=api_listen, api_token=api_token, upgrade_timeout_s=float(upgrade),
        read_coalesce_ms=float(coalesce), congestion_control=congestion, frames=frames,
        congestion_restart_s=float(restart), congestion_restart_idle_s=float(restart_idle),
        warm_up_min_rtt_ms=float(warm_rtt),
        gateway=gateway,
        warm_memory_mib=warm,
        **conn_caps,
        node_id=node_id, region=region, model=model, role=role, listen_host=host,
        listen_port=port, advertise=advertise, bootstrap=tuple(bootstrap), swarm_secret=secret,
        trainer_keys=key_paths,
        store_dir=store_dir, engine=engine,
        quota_bytes=quota or None, keep_versions=keep,
        fsync=_get(store, "store", "fsync", bool, True), base=base, base_version=base_version,
        device=device, signing_key=signing_key, chunk_size=chunk_size, served_dtype=served,
        codec_context=context, node_key=node_key, recipients=recipients, **control,
        log_level=level, log_format=log_format, swarm=_swarm_knobs(data.get("swarm") or {}), source=source,
    )
    cfg.core_config()  # CoreConfig's own validation (ConfigError naming the knob)
    return cfg


def load_config(path: str | Path) -> NodeConfig:
    """Read and validate a TOML config file; ``ConfigError`` on any problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {p} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse_config(data, p.resolve().parent, p)
