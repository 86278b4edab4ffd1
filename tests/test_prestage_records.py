"""Decoding a patch record by record, in any order, from its manifest's layout
(``Manifest.records``): the codec's ``feed_header`` / ``feed_record``, the manifest
field, ``InProcessWeights.prefeed_record`` / ``stage_records`` and the driver's
prestage and apply over a real ``ChunkStore``. Whatever the order and the split, the
result is bit for bit the one-shot apply's; a wrong layout or a bad record never
changes what is served."""

from __future__ import annotations

import asyncio
import collections
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.engines.inprocess import InProcessWeights
from swarm.codec import PatchApplier, encode_patch
from swarm.codec.format import record_layout
from swarm.errors import ManifestError, PatchApplyError, PatchFormatError
from tests.prestage_support import prestage_done, run_driver


def _states(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Dense, sparse and unchanged tensors of several sizes, a deleted one and a new one."""
    g = torch.Generator().manual_seed(seed)
    old = {f"layer{k}.weight": torch.randn(32 + 8 * k, 48, generator=g).to(torch.bfloat16)
           for k in range(8)}
    old["norm"] = torch.randn(48, generator=g).to(torch.bfloat16)
    old["gone"] = torch.randn(16, generator=g).to(torch.bfloat16)
    new = {}
    for name, t in old.items():
        if name == "gone":
            continue
        step = torch.randn(t.shape, generator=g) * (0.5 if "layer1" in name else 0.01)
        new[name] = t if "layer7" in name else (t.float() * (1 + step)).to(torch.bfloat16)
    new["fresh"] = torch.randn(24, generator=g).to(torch.bfloat16)
    return old, new


OLD, NEW = _states()
RESULT = encode_patch(OLD, NEW, threads=1)
PATCH = RESULT.patch
SIZES = record_layout(PATCH)
STARTS = [sum(SIZES[:i]) for i in range(len(SIZES) + 1)]
COUNT = len(SIZES) - 1  # records


def _part(q: int) -> bytes:
    """Part ``q`` of the patch: -1 its header, 0.. its records."""
    return PATCH[STARTS[q + 1]:STARTS[q + 2]]


def _bits(w: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in w.items()}


def _clone(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.items()}


# ------------------------------------------------------------------ the codec


def test_layout_adds_up_and_names_every_record() -> None:
    assert sum(SIZES) == len(PATCH)
    assert COUNT >= 8  # dense, sparse, delete, put
    with pytest.raises(PatchFormatError):
        record_layout(PATCH + b"\x00")
    with pytest.raises(PatchFormatError):
        record_layout(PATCH[:-1])
    with pytest.raises(PatchFormatError):
        record_layout(b"\xff" * 64)


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(range(COUNT)))
def test_records_in_any_order_give_the_one_shot_result(order: list[int]) -> None:
    w = _clone(OLD)
    a = PatchApplier(w, stage=True)
    a.feed_header(_part(-1))
    for k in order:
        a.feed_record(k, _part(k))
        assert _bits(w) == _bits(OLD)  # stage mode: nothing changes before finish
    assert a.records_fed == COUNT
    report = a.finish()
    assert report.target_digest == RESULT.target_digest
    assert _bits(w) == _bits(NEW)


def test_out_of_order_misuse_is_refused_and_changes_nothing() -> None:
    w = _clone(OLD)
    with pytest.raises(PatchApplyError):
        PatchApplier(w).feed_header(_part(-1))  # not staged
    a = PatchApplier(w, stage=True)
    with pytest.raises(PatchApplyError):
        a.feed_record(0, _part(0))  # no header yet
    a = PatchApplier(w, stage=True)
    with pytest.raises(PatchFormatError):
        a.feed_header(_part(-1) + b"\x00")  # not exactly the header
    a = PatchApplier(w, stage=True)
    a.feed_header(_part(-1))
    with pytest.raises(PatchApplyError):
        a.feed(_part(0))  # mixed with in-order feeding
    for bad in (lambda a: a.feed_record(COUNT, _part(0)),  # no such record
                lambda a: a.feed_record(0, _part(1)),  # another record's bytes
                lambda a: a.feed_record(0, _part(0) + b"\x00"),  # one byte more
                lambda a: a.feed_record(0, _part(0)[:-1])):  # one byte less
        a = PatchApplier(w, stage=True)
        a.feed_header(_part(-1))
        with pytest.raises(PatchFormatError):
            bad(a)
        with pytest.raises(PatchApplyError):  # a failed applier stays failed
            a.feed_record(1, _part(1))
    a = PatchApplier(w, stage=True)
    a.feed_header(_part(-1))
    a.feed_record(0, _part(0))
    with pytest.raises(PatchApplyError):
        a.feed_record(0, _part(0))  # twice
    a = PatchApplier(w, stage=True)
    a.feed_header(_part(-1))
    for k in range(COUNT - 1):
        a.feed_record(k, _part(k))
    with pytest.raises(PatchFormatError, match="missing"):
        a.finish()
    assert _bits(w) == _bits(OLD)


def test_a_patch_of_another_base_is_refused_at_its_header() -> None:
    w = _clone(NEW)
    with pytest.raises(PatchApplyError, match="base"):
        PatchApplier(w, stage=True).feed_header(_part(-1))


# --------------------------------------------------------------- the manifest


def _manifest(records, **kw):
    from swarm.trust.manifest import build_manifest

    args = dict(model="m", version=2, kind="patch", parent_version=1,
                parent_digest=RESULT.base_digest, target_digest=RESULT.target_digest,
                chunk_size=kw.pop("chunk_size", 1024), key_id="0" * 32, created_at=1.0)
    args.update(kw)
    return build_manifest(PATCH, records=records, **args)


def test_manifest_carries_the_layout_signed() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.trust.keys import TrustStore, key_id
    from swarm.trust.manifest import patch_layout, sign_manifest, verify_manifest

    key = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
    layout = patch_layout(PATCH)
    m = _manifest(layout["records"], header=layout["header"], key_id=key_id(key))
    got = verify_manifest(sign_manifest(m, key), TrustStore([key.public_key()]))
    assert got.records == tuple(SIZES)
    assert got.header == _part(-1)
    assert got.record_starts() == STARTS
    # without a layout the manifest is byte for byte what it was before the field
    plain = _manifest(None, key_id=key_id(key))
    raw = sign_manifest(plain, key)
    assert b"opt.records" not in raw
    assert verify_manifest(raw, TrustStore([key.public_key()])).records is None


@pytest.mark.parametrize(("records", "kw", "match"), [
    ((*SIZES[:-1], SIZES[-1] + 1), {}, "adds up"),
    ((0, *SIZES), {}, "1 byte or more"),
    ((), {}, "1 byte or more"),
    (tuple(SIZES), {"kind": "full", "parent_version": None, "parent_digest": None},
     "plain"),
])
def test_a_layout_that_cannot_be_is_refused(records, kw, match) -> None:
    with pytest.raises(ManifestError, match=match):
        _manifest(records, **kw)


@pytest.mark.parametrize(("records", "header", "match"), [
    (None, b"x", "with field records only"),
    (tuple(SIZES), b"x" * (SIZES[0] - 1), "first"),
    (tuple(SIZES), b"x" * (SIZES[0] + 1), "first"),
])
def test_a_header_that_cannot_be_is_refused(records, header, match) -> None:
    with pytest.raises(ManifestError, match=match):
        _manifest(records, header=header)


def test_a_large_header_is_left_out_of_the_manifest(monkeypatch) -> None:
    import swarm.trust.manifest as mf

    monkeypatch.setattr(mf, "MAX_HEADER_BYTES", SIZES[0] - 1)
    assert mf.patch_layout(PATCH) == {"records": tuple(SIZES), "header": None}
    monkeypatch.setattr(mf, "MAX_RECORDS_BYTES", 2)
    assert mf.patch_layout(PATCH) == {"records": None, "header": None}


@pytest.mark.parametrize(("raw", "match"), [
    (b"\x80", "cut short"),
    (b"\x81\x00", "canonical"),  # 1 with a needless continuation byte
    (b"\xff" * 9 + b"\x01", "8 bytes"),
    (b"", "bytes"),
    ("text", "bytes"),
])
def test_a_malformed_layout_field_is_refused(raw, match) -> None:
    from swarm.trust.manifest import unpack_records

    with pytest.raises(ManifestError, match=match):
        unpack_records(raw)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 2**50), min_size=1, max_size=50))
def test_layout_field_round_trips(sizes: list[int]) -> None:
    from swarm.trust.manifest import pack_records, unpack_records

    assert unpack_records(pack_records(tuple(sizes))) == tuple(sizes)


# ------------------------------------------------------------ the weights holder


@settings(max_examples=40, deadline=None)
@given(ahead=st.lists(st.integers(-1, COUNT - 1), unique=True))
def test_parts_decoded_ahead_then_the_rest_give_the_one_shot_result(ahead: list[int]) -> None:
    """Any subset decoded ahead, in any order (a record before the header is refused
    and later decoded by the stage); the stage reads only what is left."""
    w = InProcessWeights(_clone(OLD), 1, "cpu")
    kept: set[int] = set()
    for q in ahead:
        ok = w.prefeed_record(2, RESULT.base_digest, q, _part(q))
        assert ok == (q == -1 or -1 in kept)
        if ok:
            kept.add(q)
    assert w.prefed_records(2) == kept
    asked: list[list[int]] = []

    def read(parts: list[int]) -> dict[int, bytes]:
        asked.append(parts)
        return {q: _part(q) for q in parts}

    w.stage_records(2, RESULT.base_digest, COUNT, read)
    assert sorted(asked[0] if asked else []) == [q for q in range(-1, COUNT) if q not in kept]
    assert w.commit(2, RESULT.target_digest) == RESULT.target_digest
    assert _bits(w.weights) == _bits(NEW)


def test_a_bad_record_ahead_is_forgotten_and_the_stage_reports_it() -> None:
    w = InProcessWeights(_clone(OLD), 1, "cpu")
    assert w.prefeed_record(2, RESULT.base_digest, -1, _part(-1))
    assert not w.prefeed_record(2, RESULT.base_digest, 0, _part(1))  # wrong bytes
    assert w.prefed_records(2) == set()
    corrupt = {q: _part(q) for q in range(-1, COUNT)}
    corrupt[0] = corrupt[1]
    with pytest.raises(PatchFormatError):
        w.stage_records(2, RESULT.base_digest, COUNT, lambda parts: corrupt)
    with pytest.raises(PatchFormatError, match="layout"):  # the layout names fewer records
        w.stage_records(2, RESULT.base_digest, COUNT - 1,
                        lambda parts: {q: _part(q) for q in parts if q < COUNT - 1})
    assert _bits(w.weights) == _bits(OLD)
    assert w.version == 1


def test_parts_ahead_of_another_state_are_not_decoded() -> None:
    w = InProcessWeights(_clone(OLD), 1, "cpu")
    assert not w.prefeed_record(2, b"\x01" * 32, -1, _part(-1))
    assert not w.prefeed_record(1, RESULT.base_digest, -1, _part(-1))  # not newer
    assert w.prefeed_record(2, RESULT.base_digest, -1, _part(-1))
    other = encode_patch(OLD, _states(1)[1], threads=1)
    w.stage(3, "patch", other.patch, other.base_digest)
    w.commit(3, other.target_digest)
    assert w.prefed_records(2) == set()  # the state moved on


# ------------------------------------------------------------------ the driver


def _signed(size: int, records, header=None):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.trust.chunks import split_payload
    from swarm.trust.keys import TrustStore, key_id
    from swarm.trust.manifest import build_manifest, sign_manifest

    key = Ed25519PrivateKey.from_private_bytes(b"\x05" * 32)
    m = build_manifest(PATCH, model="m", version=2, kind="patch", parent_version=1,
                       parent_digest=RESULT.base_digest, target_digest=RESULT.target_digest,
                       chunk_size=size, key_id=key_id(key), created_at=1.0, records=records,
                       header=header)
    return m, sign_manifest(m, key), split_payload(PATCH, size), TrustStore([key.public_key()])


def _fanout(root: Path, size: int, order: list[int], records,
            header: bytes | None = None) -> tuple[bytes, list, int]:
    """Chunks stored in ``order`` with a prestage step after each but the last, then
    the apply: (its digest, the parts decoded ahead after each chunk, the bytes it
    counted as decoded ahead)."""
    m, signed, chunks, trust = _signed(size, records, header)
    w = InProcessWeights(_clone(OLD), 1, "cpu")

    async def body(drv, store) -> tuple[bytes, list, int]:
        store.put_manifest(signed, m)
        seen = []
        reads: collections.Counter[int] = collections.Counter()
        read_chunk = store.read_chunk

        def counted(version: int, index: int):
            reads[index] += 1
            return read_chunk(version, index)

        store.read_chunk = counted
        for i in order[:-1]:
            store.put_chunk(2, i, chunks[i])
            drv._prestage_kick(2)
            await prestage_done(drv)
            seen.append(w.prefed_records(2))
        # each chunk was read (and hashed) once at most, however many records it holds
        assert max(reads.values(), default=0) <= 1, reads
        store.put_chunk(2, order[-1], chunks[order[-1]])
        digest = await asyncio.to_thread(drv._apply_truth, 2)
        return digest, seen, drv._ahead_bytes

    out = run_driver(root, trust, w, body)
    assert out[0] == RESULT.target_digest
    assert _bits(w.weights) == _bits(NEW)
    return out


def _whole(held: set[int], size: int, header: bool) -> set[int]:
    """The parts whose every byte lies in a held chunk, if the header does or the
    manifest carries it."""
    whole = {q for q in range(-1, COUNT)
             if all(i in held for i in range(STARTS[q + 1] // size,
                                              (STARTS[q + 2] - 1) // size + 1))}
    if header:
        return whole | {-1}
    return whole if -1 in whole else set()


@settings(max_examples=25, deadline=None)
@given(size=st.sampled_from([97, 256, 1000, 4096]), header=st.booleans(), data=st.data())
def test_driver_decodes_every_record_it_holds_whatever_the_order(size: int, header: bool,
                                                                  data) -> None:
    """Real ``ChunkStore`` and ``Driver``: after each chunk, exactly the parts whose
    bytes are all held are decoded (none before the header, which the manifest may
    carry); the apply decodes the rest and the weights end bitwise at the target."""
    n = -(-len(PATCH) // size)
    order = data.draw(st.permutations(range(n)))
    with tempfile.TemporaryDirectory() as tmp:
        _, seen, ahead = _fanout(Path(tmp), size, order, tuple(SIZES),
                                 _part(-1) if header else None)
    for k, got in enumerate(seen):
        assert got == _whole(set(order[:k + 1]), size, header)
    last = seen[-1] if seen else set()
    assert ahead == sum(STARTS[q + 2] - STARTS[q + 1] for q in last)


def test_a_layout_that_lies_falls_back_to_decoding_in_order(tmp_path, caplog) -> None:
    """A signed layout that does not match the patch (the trainer's mistake): nothing
    is decoded ahead, the apply decodes the patch in order, says so, and lands."""
    lie = (SIZES[0] + 1, SIZES[1] - 1, *SIZES[2:])
    n = -(-len(PATCH) // 256)
    with caplog.at_level("WARNING", logger="patchswarm.node"):
        _, seen, ahead = _fanout(tmp_path, 256, list(range(n)), lie)
    assert all(not s for s in seen)
    assert ahead == 0
    assert "does not match its manifest's layout" in caplog.text


def _lying_header() -> bytes:
    """A valid header of the patch's header's length that differs from it: two
    tensors' shapes transposed (the first such edit whose table compresses to the same
    length)."""
    from swarm.codec.format import decode_header, encode_header

    h = decode_header(_part(-1))
    for k, e in enumerate(h.entries):
        if len(e.shape) == 2 and e.shape[0] != e.shape[1]:
            entries = list(h.entries)
            entries[k] = type(e)(e.name, e.op, e.dtype, (e.shape[1], e.shape[0]))
            lie = encode_header(h.base_digest, h.target_digest, entries)
            if len(lie) == SIZES[0]:
                return lie
    raise AssertionError("no same-length edit of the header")


@pytest.mark.parametrize("how", ["valid, other shapes", "corrupt"])
def test_a_header_that_lies_falls_back_to_decoding_in_order(tmp_path, caplog, how) -> None:
    """The manifest's copy of the header is signed but differs from the patch's own: the
    records decoded ahead with it are dropped, the apply decodes the patch in order from
    its own header, says so, and lands bitwise."""
    if how == "corrupt":
        lie = bytearray(_part(-1))
        lie[-1] ^= 0xFF  # in the compressed table: its checksum fails
        lie = bytes(lie)
    else:
        lie = _lying_header()
    n = -(-len(PATCH) // 256)
    with caplog.at_level("WARNING", logger="patchswarm.node"):
        digest, _, ahead = _fanout(tmp_path, 256, list(range(n)), tuple(SIZES), lie)
    assert digest == RESULT.target_digest
    assert ahead == 0
    assert "header differs" in caplog.text


def test_a_record_spanning_chunks_is_handed_over_as_its_pieces(monkeypatch) -> None:
    """The prestage does not join a record that spans chunks: the applier gets the views
    of each chunk it lies in (``swarm.codec.planes`` reads them where they lie), a record
    in one chunk a view of it; either way exactly the record's bytes."""
    got: dict[int, object] = {}
    real = PatchApplier.feed_record

    def spy(self, index, data):
        got[index] = data
        return real(self, index, data)

    monkeypatch.setattr(PatchApplier, "feed_record", spy)
    size = 97
    n = -(-len(PATCH) // size)
    with tempfile.TemporaryDirectory() as tmp:
        _fanout(Path(tmp), size, list(range(n)), tuple(SIZES), _part(-1))
    spanning = [q for q in range(COUNT)
                if STARTS[q + 1] // size != (STARTS[q + 2] - 1) // size]
    # records that end in the last chunk are decoded by the apply, from a run of chunks
    # read into one buffer (``_read_parts``): a view of it
    ahead = [q for q in range(COUNT) if (STARTS[q + 2] - 1) // size < n - 1]
    assert set(spanning) & set(ahead) and set(got) == set(range(COUNT))
    for q, data in got.items():
        pieces = data if isinstance(data, list) else [data]
        assert isinstance(data, list) == (q in spanning and q in ahead)
        if q not in ahead:
            continue
        assert len(pieces) == (STARTS[q + 2] - 1) // size - STARTS[q + 1] // size + 1
        assert b"".join(bytes(p) for p in pieces) == _part(q)
