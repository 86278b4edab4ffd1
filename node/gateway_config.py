"""``[gateway]``: the version-pinned request gateway in front of the engine (node.gateway).

Keys (the gateway is off when the section is absent)::

    listen              "host:port" the gateway listens on (required in the section)
    hold_max_s          longest an exact-pinned request in flight may delay an engine commit;
                        default 10
    retry_after_s       Retry-After (seconds) on a 409 when the commit cadence is not yet
                        known; default 2
    max_body_bytes      largest request body accepted (413 above); default 1 MiB
    upstream_timeout_s  whole-request limit towards the engine (504 after it); default 300
    token_file          a file holding a bearer token every gateway request must carry
                        (same scheme as [api] token_file)
    model_config        the model's Hugging Face config.json, for the in-process runner
                        (default: config.json beside [weights] base)

Every error is a ``ConfigError`` naming the key (``gateway.hold_max_s: ...``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.token_file import read_token
from swarm.errors import ConfigError

KEYS = {"listen", "hold_max_s", "retry_after_s", "max_body_bytes", "upstream_timeout_s",
        "token_file", "model_config"}


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    hold_max_s: float = 10.0
    retry_after_s: float = 2.0
    max_body_bytes: int = 1024 * 1024
    upstream_timeout_s: float = 300.0
    token: str | None = None
    model_config: Path | None = None  # None: config.json beside the base checkpoint


def _seconds(sec: dict, key: str, default: float, lo: float, hi: float) -> float:
    if key not in sec:
        return default
    v = sec[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise ConfigError(f"gateway.{key}: must be a number of seconds in {lo:g}..{hi:g}, "
                          f"got {v!r}")
    return float(v)


def _path(base_dir: Path, sec: dict, key: str) -> Path | None:
    if key not in sec:
        return None
    v = sec[key]
    if not isinstance(v, str) or not v:
        raise ConfigError(f"gateway.{key}: expected a non-empty path, got {v!r}")
    p = Path(v).expanduser()
    return p if p.is_absolute() else base_dir / p


def parse_gateway(sec: Any, base_dir: Path,
                  taken: tuple[tuple[str, int] | None, ...] = ()) -> GatewayConfig | None:
    """Validate ``[gateway]`` (``None``: absent, the gateway is off). ``taken``: the
    node's other listening addresses, which the gateway may not share."""
    if sec is None:
        return None
    if not isinstance(sec, dict):
        raise ConfigError("gateway: must be a [table]")
    for key in sec:
        if key not in KEYS:
            raise ConfigError(f"gateway.{key}: unknown key (expected one of {sorted(KEYS)})")
    from node.config import parse_addr

    listen = sec.get("listen")
    if not isinstance(listen, str):
        raise ConfigError("gateway.listen: required, \"host:port\" (e.g. \"127.0.0.1:7402\")")
    host, port = parse_addr(listen, "gateway.listen")
    if (host, port) in taken:
        raise ConfigError(f"gateway.listen: {listen} is already the node's swarm or API address")
    body = sec.get("max_body_bytes", 1024 * 1024)
    if isinstance(body, bool) or not isinstance(body, int) or not 1024 <= body <= 256 * 1024 * 1024:
        raise ConfigError(f"gateway.max_body_bytes: must be an integer in 1024..268435456, "
                          f"got {body!r}")
    token_file = _path(base_dir, sec, "token_file")
    return GatewayConfig(
        host=host, port=port,
        hold_max_s=_seconds(sec, "hold_max_s", 10.0, 0.0, 3600.0),
        retry_after_s=_seconds(sec, "retry_after_s", 2.0, 1.0, 3600.0),
        max_body_bytes=body,
        upstream_timeout_s=_seconds(sec, "upstream_timeout_s", 300.0, 0.1, 86400.0),
        token=read_token(token_file, "gateway.token_file") if token_file is not None else None,
        model_config=_path(base_dir, sec, "model_config"),
    )
