"""Wire format: round trips, limits, and hostile bytes (Hypothesis)."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore


def test_round_trip_every_frame_type() -> None:
    frames = [
        (wire.HELLO, 1, "m", "a", "r", "h:1", "node", b"n" * 16),
        (wire.AUTH, b"m" * 32),
        (wire.PING,),
        (wire.PEERS, [["a", "r", "h:1", 2]]),
        (wire.ROLE, 1),
        (wire.ANNOUNCE, b"manifest"),
        (wire.BITFIELD, 3, b"\x05"),
        (wire.HAVE, 3, [0, 2]),
        (wire.REQUEST, 3, [1]),
        (wire.CANCEL, 3, [1]),
        (wire.REJECT, 3, [1]),
        (wire.RELAY, 3, 1, "b"),
        (wire.RELAY_FAIL, 3, 1, "b"),
        (wire.RELAY_ALIVE, 3, 1, "b"),
        (wire.LINKS, ["b", "c"]),
    ]
    for f in frames:
        got = wire.decode(wire.encode(*f))
        assert type(got) is wire.FRAME_TYPES[f[0]]
        assert got.encode() == wire.encode(*f)  # the typed frame has the untyped frame's bytes
        assert wire.decode(got.encode()) == got


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", wire.encode(99), wire.encode(wire.HAVE, 1), wire.encode(wire.HAVE, -1, [0]),
    wire.encode(wire.HAVE, 1, []), wire.encode(wire.HAVE, 1, [wire.MAX_CHUNKS]),
    wire.encode(wire.HAVE, 1, list(range(wire.MAX_INDICES + 1))),
    wire.encode(wire.HELLO, 1, "m", "a", "r", "h", "king", b"n" * 16),
    wire.encode(wire.HELLO, 1, "m", "a" * 200, "r", "h", "node", b"n" * 16),
    wire.encode(wire.AUTH, b"short"), wire.encode(wire.PEERS, [["a", "r"]]),
    wire.encode(wire.ROLE, 7), wire.encode(wire.ANNOUNCE, b""),
    wire.encode(wire.RELAY_ALIVE, 1, 0), wire.encode(wire.RELAY_ALIVE, 1, wire.MAX_CHUNKS, "b"),
    wire.encode(wire.RELAY_ALIVE, 1, 0, ""), wire.encode(wire.REQUEST, 1.5, [1]),
    b"\x81\xa1a\x01",  # a map, not an array
    wire.encode(wire.PING) + b"x",  # trailing bytes
    wire.encode(wire.BITFIELD, 1, b"\x00" * (wire.MAX_CHUNKS // 8 + 1)),
])
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frame)


def test_small_frame_limit() -> None:
    big = wire.encode(wire.PEERS, [["a" * 100, "r" * 60, "h" * 250, 0]] * 60)
    assert len(big) > wire.MAX_SMALL_FRAME_BYTES or wire.decode(big)


def test_chunk_header_round_trip_and_errors() -> None:
    msg = wire.pack_chunk(7, 3, b"payload")
    assert wire.is_chunk_message(msg)
    assert not wire.is_chunk_message(wire.encode(wire.PING))
    v, i, data = wire.unpack_chunk(msg)
    assert (v, i, bytes(data)) == (7, 3, b"payload")
    for bad in (msg[:10], b"XXXX" + msg[4:], msg + b"extra", msg[:-1]):
        with pytest.raises(ProtocolError):
            wire.unpack_chunk(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decode_random_bytes_never_raises_anything_else(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        wire.decode(data)


def _core() -> NodeCore:
    cfg = CoreConfig(node_id="me", region="r", model="m", listen_addr="me:1")
    return NodeCore(cfg, verify_manifest=lambda raw: (_ for _ in ()).throw(ValueError("no")),
                    rng=random.Random(0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=200), st.sampled_from([
    wire.encode(wire.HELLO, 1, "m", "peer", "r", "p:1", "node", b"n" * 16),
    wire.encode(wire.AUTH, b"x" * 32), wire.encode(wire.HAVE, 1, [0]), wire.encode(wire.PING),
])), max_size=8))
def test_random_frames_into_core_never_raise(frames: list[bytes]) -> None:
    core = _core()
    core.raise_internal_errors = True
    core.handle(ev.PeerConnected(0.0, 1, False, "x"))
    for k, fr in enumerate(frames):
        acts = core.handle(ev.FrameReceived(0.1 * k, 1, fr))
        assert all(isinstance(a, ev.Action) for a in acts)
    # a closed conn is forgotten; more frames on it are ignored
    assert len(core.peers) <= 1


def test_small_frames_decode_once_and_are_shared() -> None:
    b = wire.Have(3, (1, 2)).encode()
    assert wire.decode(b) is wire.decode(bytes(bytearray(b)))  # equal bytes, one frozen frame
    with pytest.raises(ProtocolError):
        wire.decode(wire.encode(wire.HAVE, 3, []))  # errors are never cached
    with pytest.raises(ProtocolError):
        wire.decode(wire.encode(wire.HAVE, 3, []))
