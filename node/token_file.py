"""Bearer tokens read from files (``[api] token_file``, ``[gateway] token_file``)."""

from __future__ import annotations

from pathlib import Path

from swarm.errors import ConfigError

MAX_TOKEN_FILE = 4096


def read_token(path: Path, key: str) -> str:
    """The token in ``path``; ``ConfigError`` naming ``key`` if it cannot be one.

    Bounded read: the path may name a device or a huge file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
        token = raw.decode("ascii").strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is binary; expected a text token") from None
    if not 16 <= len(token) <= MAX_TOKEN_FILE or any(c.isspace() for c in token):
        raise ConfigError(f"{key}: {path}: the token must be 16..{MAX_TOKEN_FILE} characters "
                          "without spaces")
    return token
