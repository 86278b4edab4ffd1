"""Versioned handshake with proof of swarm membership.

Both ends send ``HELLO`` at once (protocol version, model, node id, region,
listen address, role, a fresh 16-byte nonce). On the peer's ``HELLO`` each end
sends ``AUTH = HMAC-SHA256(secret, TAG + sender_hello + receiver_hello)``: the
transcript holds both nonces, so a MAC cannot be replayed on another
connection, and the order of the two hellos differs per direction, so a MAC
cannot be reflected back. A connection is ready once the peer's ``AUTH``
checks out. Any other frame before that is out of order and closes it.

States (per connection):

| state      | input          | action                      | next       |
|------------|----------------|-----------------------------|------------|
| HELLO_WAIT | HELLO ok       | send AUTH                   | AUTH_WAIT  |
| HELLO_WAIT | anything else  | close "out of order"        | -          |
| AUTH_WAIT  | AUTH ok        | send state (announce, ...)  | READY      |
| AUTH_WAIT  | AUTH bad       | close "bad auth"            | -          |
| AUTH_WAIT  | anything else  | close "out of order"        | -          |
| READY      | HELLO / AUTH   | close "out of order"        | -          |
"""

from __future__ import annotations

import hashlib
import hmac

from swarm.errors import ProtocolError
from swarm.protocol import wire

HELLO_WAIT = 0
AUTH_WAIT = 1
READY = 2

AUTH_TAG = b"patchswarm-auth-v1\x00"


def mac(secret: bytes, sender_hello: bytes, receiver_hello: bytes) -> bytes:
    return hmac.new(secret, AUTH_TAG + sender_hello + receiver_hello, hashlib.sha256).digest()


def check_mac(secret: bytes, got: bytes, sender_hello: bytes, receiver_hello: bytes) -> bool:
    return hmac.compare_digest(got, mac(secret, sender_hello, receiver_hello))


def hello_frame(*, model: str, node_id: str, region: str, addr: str, role: str, nonce: bytes) -> bytes:
    return wire.encode(wire.HELLO, wire.PROTOCOL_VERSION, model, node_id, region, addr, role, nonce)


def check_hello(f: list, *, model: str, node_id: str) -> None:
    """Refuse a decoded HELLO that cannot join this swarm."""
    if f[1] != wire.PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {f[1]} (we speak {wire.PROTOCOL_VERSION})")
    if f[2] != model:
        raise ProtocolError(f"model {f[2]!r} is not ours ({model!r})")
    if f[3] == node_id:
        raise ProtocolError("connected to ourselves")
