"""A small synchronous JSON-over-HTTP client for engine adapters (stdlib only).

Adapters run in a worker thread, so a blocking client with hard timeouts is
the simplest correct thing. Every failure becomes an ``EngineError`` with one
line that says what was called and what went wrong:

- connection refused / reset, DNS: ``engine at URL is unreachable: ...``
- timeout: ``POST URL/path: no answer within T s``
- non-2xx: ``POST URL/path: HTTP 400: <the server's error text>``, the error
  text taken from the JSON body (``message``, ``error.message``, ``detail``)
  or the plain body, cut to 300 characters.

``uncertain`` is set by the caller (it knows whether the call could have
changed weights), through ``EngineHTTP.call(..., uncertain=True)``.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from node.engines.base import EngineError

MAX_ERROR_TEXT = 300
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class Response:
    status: int
    body: Any  # decoded JSON, or the text when the body is not JSON
    text: str


def error_text(raw: str) -> str:
    """The server's own error message out of a JSON or text body."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return " ".join(raw.split())[:MAX_ERROR_TEXT]
    if isinstance(obj, dict):
        for key in ("message", "error", "detail"):
            v = obj.get(key)
            if isinstance(v, dict):
                v = v.get("message", v)
            if v:
                return str(v)[:MAX_ERROR_TEXT]
    return json.dumps(obj)[:MAX_ERROR_TEXT]


class EngineHTTP:
    """JSON GET/POST against one engine base URL with timeouts and a bearer key."""

    def __init__(self, base_url: str, *, timeout_s: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = api_key

    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
             uncertain: bool = False, ok_statuses: tuple[int, ...] = ()) -> Response:
        """One request; ``EngineError`` on no answer or a status outside 2xx/``ok_statuses``."""
        url = f"{self.base_url}{path}"
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        limit = self.timeout_s if timeout_s is None else timeout_s
        what = f"{method} {url}"
        try:
            with urllib.request.urlopen(req, timeout=limit) as r:
                raw = r.read(MAX_BODY_BYTES).decode("utf-8", "replace")
                status = r.status
        except urllib.error.HTTPError as exc:
            raw = exc.read(MAX_BODY_BYTES).decode("utf-8", "replace") if exc.fp else ""
            if exc.code in ok_statuses:
                return Response(exc.code, _decode(raw), raw)
            raise EngineError(f"{what}: HTTP {exc.code}: {error_text(raw) or exc.reason}",
                              uncertain=uncertain) from None
        except TimeoutError:
            raise EngineError(f"{what}: no answer within {limit:g} s", uncertain=uncertain) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise EngineError(f"{what}: no answer within {limit:g} s",
                                  uncertain=uncertain) from None
            raise EngineError(f"engine at {self.base_url} is unreachable ({what}): {reason}",
                              uncertain=uncertain) from None
        except (ConnectionError, OSError, http.client.HTTPException) as exc:
            raise EngineError(f"engine at {self.base_url} is unreachable ({what}): "
                              f"{type(exc).__name__}: {exc}", uncertain=uncertain) from None
        return Response(status, _decode(raw), raw)

    def get(self, path: str, **kw: Any) -> Response:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.call("POST", path, {} if body is None else body, **kw)


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw
