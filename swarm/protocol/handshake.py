"""Versioned handshake with proof of swarm membership.

Both ends send ``HELLO`` at once (protocol version, model, node id, region,
listen address, role, a fresh 16-byte nonce). On the peer's ``HELLO`` each end
sends ``AUTH = HMAC-SHA256(secret, TAG + sender_hello + receiver_hello)``: the
transcript holds both nonces, so a MAC cannot be replayed on another
connection, and the order of the two hellos differs per direction, so a MAC
cannot be reflected back. A connection is ready once the peer's ``AUTH``
checks out. Any other frame before that is out of order and closes it.

The states and their legal inputs are data (``TRANSITIONS``), as in h11's
``_state.py``; ``expect`` is the only reader of the table. The core carries out
the side effects (send AUTH, check the MAC, resolve duplicate connections):

| state      | input          | action                      | next       |
|------------|----------------|-----------------------------|------------|
| HELLO_WAIT | HELLO ok       | send AUTH                   | AUTH_WAIT  |
| AUTH_WAIT  | AUTH ok        | send state (announce, ...)  | READY      |
| READY      | any other frame| its handler                 | READY      |
| any        | anything else  | close "out of order"        | -          |
"""

from __future__ import annotations

import enum
import hashlib
import hmac

from swarm.errors import ProtocolError
from swarm.protocol import wire


class HandshakeState(enum.Enum):
    HELLO_WAIT = "hello_wait"
    AUTH_WAIT = "auth_wait"
    READY = "ready"


HELLO_WAIT = HandshakeState.HELLO_WAIT
AUTH_WAIT = HandshakeState.AUTH_WAIT
READY = HandshakeState.READY

#: (state, frame class) -> next state; READY also takes every frame but HELLO and AUTH
TRANSITIONS: dict[tuple[HandshakeState, type[wire.Frame]], HandshakeState] = {
    (HELLO_WAIT, wire.Hello): AUTH_WAIT,
    (AUTH_WAIT, wire.Auth): READY,
}
_HANDSHAKE_FRAMES = (wire.Hello, wire.Auth)
_OUT_OF_ORDER = {HELLO_WAIT: "before HELLO", AUTH_WAIT: "before AUTH", READY: "after the handshake"}


def expect(state: HandshakeState, frame: wire.Frame) -> HandshakeState:
    """The state ``frame`` leads to from ``state``; ``ProtocolError`` if it is out of order."""
    nxt = TRANSITIONS.get((state, type(frame)))
    if nxt is not None:
        return nxt
    if state is READY and not isinstance(frame, _HANDSHAKE_FRAMES):
        return READY
    raise ProtocolError(f"{frame.NAME} {_OUT_OF_ORDER[state]}")


AUTH_TAG = b"patchswarm-auth-v1\x00"


def mac(secret: bytes, sender_hello: bytes, receiver_hello: bytes) -> bytes:
    return hmac.new(secret, AUTH_TAG + sender_hello + receiver_hello, hashlib.sha256).digest()


def check_mac(secret: bytes, got: bytes, sender_hello: bytes, receiver_hello: bytes) -> bool:
    return hmac.compare_digest(got, mac(secret, sender_hello, receiver_hello))


#: the protocol versions this release speaks, oldest and newest (``wire``)
SPEAKS = (wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION)


class VersionRefused(ProtocolError):
    """The peer speaks no protocol version we do: a release too old or too new for us.
    Neither end is at fault; the link closes and the dialer backs off."""


def negotiate(theirs: int, speaks: tuple[int, int] = SPEAKS) -> int:
    """The version a link speaks: the older of both ends' newest. ``VersionRefused`` if
    we no longer speak it. (The peer, seeing our newest, makes the same check with its
    own oldest, so both ends agree or the link closes.)"""
    lo, hi = speaks
    v = min(theirs, hi)
    if v < lo:
        raise VersionRefused(f"protocol version {theirs} is too old (we speak {lo}..{hi})")
    return v


def hello_frame(*, model: str, node_id: str, region: str, addr: str, role: str, nonce: bytes,
                proto: int = wire.PROTOCOL_VERSION) -> bytes:
    return wire.Hello(proto, model, node_id, region, addr, role, nonce).encode()


def check_hello(f: wire.Hello, *, model: str, node_id: str,
                speaks: tuple[int, int] = SPEAKS) -> int:
    """Refuse a HELLO that cannot join this swarm; the protocol version the link speaks."""
    v = negotiate(f.proto, speaks)
    if f.model != model:
        raise ProtocolError(f"model {f.model!r} is not ours ({model!r})")
    if f.node_id == node_id:
        raise ProtocolError("connected to ourselves")
    return v
