"""``[engine]``: which inference engine a node feeds, and how (validated at start).

Keys (all optional; ``kind = "inprocess"`` needs none of the others)::

    kind                 "inprocess" (default) | "vllm" | "sglang"
    url                  the engine's base URL, e.g. "http://127.0.0.1:30000" (vllm, sglang)
    timeout_s            seconds for a control call (pause, version, health); default 10
    commit_timeout_s     seconds for the weight load itself; default 300
    pause_mode           "wait" (default): pause without dropping requests, resume them after;
                         "keep": do not pause (the engine's own update lock orders it);
                         "abort": abort in-flight requests first (only when set here)
    exchange_dir         where update files are written for the engine to read (same host);
                         default <store.dir>/engine-exchange
    api_key              bearer token for the engine's API (or api_key_file)
    api_key_file         a file holding it
    sparse_max_fraction  above this fraction of a tensor changed, ship it whole; default 0.25
    probe_s              how often the node asks the engine which version it serves; default 5
    retry_max_s          longest back-off between attempts to bring the engine up to date; default 30

Every error is a ``ConfigError`` naming the key (``engine.timeout_s: ...``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from swarm.errors import ConfigError

KINDS = ("inprocess", "vllm", "sglang")
PAUSE_MODES = ("keep", "wait", "abort")
KEYS = {"kind", "url", "timeout_s", "commit_timeout_s", "pause_mode", "exchange_dir", "api_key",
        "api_key_file", "sparse_max_fraction", "probe_s", "retry_max_s"}


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "inprocess"
    url: str | None = None
    timeout_s: float = 10.0
    commit_timeout_s: float = 300.0
    pause_mode: str = "wait"
    exchange_dir: Path | None = None
    api_key: str | None = None
    sparse_max_fraction: float = 0.25
    probe_s: float = 5.0
    retry_max_s: float = 30.0

    @property
    def external(self) -> bool:
        return self.kind != "inprocess"


def _seconds(sec: dict, key: str, default: float, hi: float = 86400.0) -> float:
    if key not in sec:
        return default
    v = sec[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 < v <= hi:
        raise ConfigError(f"engine.{key}: must be a positive finite number of seconds "
                          f"(at most {hi:g}), got {v!r}")
    return float(v)


def _str(sec: dict, key: str) -> str | None:
    if key not in sec:
        return None
    v = sec[key]
    if not isinstance(v, str) or not v:
        raise ConfigError(f"engine.{key}: expected a non-empty string, got {v!r}")
    return v


def parse_engine(sec: dict[str, Any] | None, base_dir: Path, store_dir: Path) -> EngineConfig:
    """Validate the ``[engine]`` table (``None``: the section is absent)."""
    sec = sec or {}
    if not isinstance(sec, dict):
        raise ConfigError("engine: must be a [table]")
    for key in sec:
        if key not in KEYS:
            raise ConfigError(f"engine.{key}: unknown key (expected one of {sorted(KEYS)})")
    kind = sec.get("kind", "inprocess")
    if kind not in KINDS:
        raise ConfigError(f"engine.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    url = _str(sec, "url")
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"engine.url: expected http(s)://host:port, got {url!r}")
        try:
            parts.port  # noqa: B018 (validates the port)
        except ValueError:
            raise ConfigError(f"engine.url: bad port in {url!r}") from None
    if kind != "inprocess" and url is None:
        raise ConfigError(f"engine.url: required for kind = {kind!r} (the engine's base URL)")
    pause = sec.get("pause_mode", "wait")
    if pause not in PAUSE_MODES:
        raise ConfigError(f"engine.pause_mode: expected keep, wait or abort, got {pause!r}")
    frac = sec.get("sparse_max_fraction", 0.25)
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 <= frac <= 1.0:
        raise ConfigError(f"engine.sparse_max_fraction: must be a number in 0..1, got {frac!r}")
    if "api_key" in sec and "api_key_file" in sec:
        raise ConfigError("engine.api_key: give either api_key or api_key_file")
    key = _str(sec, "api_key")
    key_file = _str(sec, "api_key_file")
    if key_file is not None:
        p = Path(key_file).expanduser()
        p = p if p.is_absolute() else base_dir / p
        try:
            key = p.read_text()[:4096].strip()
        except OSError as exc:
            raise ConfigError(f"engine.api_key_file: cannot read {p}: {exc.strerror}") from None
        if not key:
            raise ConfigError(f"engine.api_key_file: {p} is empty")
    xdir = _str(sec, "exchange_dir")
    if xdir is not None:
        p = Path(xdir).expanduser()
        exchange = p if p.is_absolute() else base_dir / p
    else:
        exchange = store_dir / "engine-exchange"
    timeout = _seconds(sec, "timeout_s", 10.0)
    commit_timeout = _seconds(sec, "commit_timeout_s", 300.0)
    if commit_timeout < timeout:
        raise ConfigError(f"engine.commit_timeout_s: must be >= engine.timeout_s ({timeout:g})")
    return EngineConfig(
        kind=kind, url=url, timeout_s=timeout, commit_timeout_s=commit_timeout, pause_mode=pause,
        exchange_dir=exchange, api_key=key, sparse_max_fraction=float(frac),
        probe_s=_seconds(sec, "probe_s", 5.0, 3600.0),
        retry_max_s=_seconds(sec, "retry_max_s", 30.0, 3600.0),
    )
