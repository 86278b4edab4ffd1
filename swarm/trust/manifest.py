"""Signed manifests: what a trainer publishes for every version.

A manifest names one version of one model: its parent (version and state
digest) for a patch, or none for a full checkpoint; the digest of the state it
produces; and the length, chunk size and BLAKE3 hash of every chunk of its
payload. The trainer signs it with Ed25519. Nodes check the signature over the
raw signed bytes *before* they decode or trust any field, then validate every
field against hard size limits. Anything malformed raises ``ManifestError``.

Wire format (format 1; docs/manifest.md is the full spec):

    envelope = msgpack array [ "patchswarm-manifest", key_id: str, body: bin, sig: bin(64) ]
    sig      = Ed25519(key, b"patchswarm-manifest\\x00" + body)
    body     = canonical msgpack map (keys sorted, shortest encodings, float64)

Both envelope and body must be canonical: re-encoding the decoded value must
give back the same bytes, so each manifest has exactly one encoding.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.errors import ManifestError
from swarm.trust.chunks import HASH_LEN, chunk_count, hash_chunks
from swarm.trust.keys import KEY_ID_RE, TrustStore, key_id

FORMAT_VERSION = 1
ENVELOPE_TAG = "patchswarm-manifest"
SIGNING_CONTEXT = b"patchswarm-manifest\x00"
SIGNATURE_LEN = 64
DIGEST_LEN = 32

# Hard limits. A manifest beyond them is refused before anything is allocated
# in proportion to it. MAX_CHUNK_COUNT x 4 MiB chunks = 1 TiB payloads.
MAX_CHUNK_COUNT = 262_144
MIN_CHUNK_SIZE = 1
MAX_CHUNK_SIZE = 64 * 1024 * 1024
MAX_MODEL_LEN = 128
MAX_VERSION = 2**63 - 1
MAX_OPTIONAL_FIELDS = 16
MAX_ENCRYPTION_BYTES = 256 * 1024
# A patch's layout (``Manifest.records``), varints: a plain patch only, so it shares the
# room an encrypted one's ``encryption`` map has.
MAX_RECORDS_BYTES = 256 * 1024
RECORDS_KEY = "opt.records"
# ... and the patch's header itself where it is this small (most models: a few KiB to tens)
MAX_HEADER_BYTES = 64 * 1024
HEADER_KEY = "opt.header"
MAX_BODY_BYTES = HASH_LEN * MAX_CHUNK_COUNT + 2 * MAX_ENCRYPTION_BYTES
MAX_MANIFEST_BYTES = MAX_BODY_BYTES + 1024
MAX_NESTING = 8

MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
KINDS = ("patch", "full")
# Format 1 ignores body keys with this prefix (forward-compatible optional data);
# any other unknown key is refused, as is a body of another format version.
OPTIONAL_PREFIX = "opt."

REQUIRED_KEYS = frozenset(
    {
        "fmt",
        "model",
        "version",
        "kind",
        "parent_version",
        "parent_digest",
        "target_digest",
        "payload_length",
        "chunk_size",
        "chunk_hashes",
        "created_at",
        "key_id",
        "encryption",
    }
)


@dataclass(frozen=True)
class Manifest:
    """A decoded, validated manifest. Build with ``build_manifest``; never construct raw bytes."""

    model: str
    version: int  # monotonic, >= 1
    kind: str  # "patch" (needs parent) | "full" (bootstrap checkpoint)
    parent_version: int | None
    parent_digest: bytes | None  # 32-byte state digest of the parent
    target_digest: bytes  # 32-byte state digest after applying
    payload_length: int
    chunk_size: int
    chunk_hashes: tuple[bytes, ...]
    created_at: float
    key_id: str
    encryption: dict | None = field(default=None, hash=False)
    # The patch's layout (``swarm.codec.format.record_layout``): the byte sizes of its
    # header and of each record, in order; they add up to ``payload_length``. Optional
    # (body key ``opt.records``, so nodes of before it ignore it): with it a node
    # decodes each record once the chunks holding it arrived, in any order.
    records: tuple[int, ...] | None = field(default=None, hash=False)
    # The patch's header (its first ``records[0]`` bytes: the tensor table), where it is
    # at most ``MAX_HEADER_BYTES``: a node decodes records before the chunk holding the
    # header arrived. Optional (``opt.header``); only with ``records``.
    header: bytes | None = field(default=None, hash=False)

    @property
    def chunk_count(self) -> int:
        return len(self.chunk_hashes)

    def chunk_length(self, index: int) -> int:
        """Bytes in chunk ``index`` (the last one may be short)."""
        if not 0 <= index < self.chunk_count:
            raise IndexError(f"chunk {index} out of range (0..{self.chunk_count - 1})")
        if index < self.chunk_count - 1:
            return self.chunk_size
        return self.payload_length - self.chunk_size * (self.chunk_count - 1)

    def chunk_offset(self, index: int) -> int:
        """Byte offset of chunk ``index`` in the payload."""
        self.chunk_length(index)
        return index * self.chunk_size

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None

    def record_starts(self) -> list[int] | None:
        """Where the patch's header and each record begin, then its end (``records``'
        running sums); None without a layout."""
        if self.records is None:
            return None
        out = [0]
        for n in self.records:
            out.append(out[-1] + n)
        return out


# ---------------------------------------------------------------- encoding


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    return obj


def canonical_packb(obj: Any) -> bytes:
    """Canonical msgpack: map keys sorted, shortest int/str/bin forms, floats as float64."""
    return msgpack.packb(_canonical(obj), use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} not allowed")


def _unpackb(data: bytes, *, max_len: int) -> Any:
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        use_list=True,
        ext_hook=_reject_ext,
        timestamp=0,
        max_str_len=max_len,
        max_bin_len=max_len,
        max_array_len=max(MAX_CHUNK_COUNT, 64),
        max_map_len=64,
        max_ext_len=0,
    )


def _check_plain(obj: Any, depth: int = 0) -> None:
    """Only nil, bool, int, float, str, bin, array and str-keyed map, nested at most MAX_NESTING."""
    if depth > MAX_NESTING:
        raise ManifestError("manifest nests too deeply")
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return
    if isinstance(obj, list):
        for v in obj:
            _check_plain(v, depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ManifestError("manifest map keys must be strings")
            _check_plain(v, depth + 1)
        return
    raise ManifestError(f"manifest holds a value of unsupported type {type(obj).__name__}")


def pack_records(sizes: tuple[int, ...]) -> bytes:
    """``Manifest.records`` as its body value: unsigned LEB128 varints, one a part."""
    out = bytearray()
    for v in sizes:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def patch_layout(payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A plain patch's layout for ``build_manifest(**patch_layout(payload))``: its
    ``records`` (None where they would not fit the manifest: past ~85,000 records) and
    its ``header`` (None past ``MAX_HEADER_BYTES``). Leaving either out only costs
    nodes decoding ahead. A malformed patch raises ``PatchFormatError``."""
    from swarm.codec.format import record_layout

    sizes = tuple(record_layout(payload))
    if len(pack_records(sizes)) > MAX_RECORDS_BYTES:
        return {"records": None, "header": None}
    head = bytes(memoryview(payload).cast("B")[:sizes[0]]) if sizes[0] <= MAX_HEADER_BYTES \
        else None
    return {"records": sizes, "header": head}


def unpack_records(raw: object) -> tuple[int, ...]:
    if type(raw) is not bytes or not raw or len(raw) > MAX_RECORDS_BYTES:
        raise ManifestError(f"field {RECORDS_KEY} must be 1..{MAX_RECORDS_BYTES} bytes")
    out: list[int] = []
    v = shift = 0
    for b in raw:
        v |= (b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift > 56:
                raise ManifestError(f"field {RECORDS_KEY}: a size runs past 8 bytes")
            continue
        out.append(v)
        v = shift = 0
    if shift:
        raise ManifestError(f"field {RECORDS_KEY}: the last size is cut short")
    if pack_records(tuple(out)) != raw:  # one encoding per manifest (module docstring)
        raise ManifestError(f"field {RECORDS_KEY} is not canonically encoded")
    return tuple(out)


def _body_dict(m: Manifest) -> dict[str, Any]:
    body = {
        "fmt": FORMAT_VERSION,
        "model": m.model,
        "version": m.version,
        "kind": m.kind,
        "parent_version": m.parent_version,
        "parent_digest": m.parent_digest,
        "target_digest": m.target_digest,
        "payload_length": m.payload_length,
        "chunk_size": m.chunk_size,
        "chunk_hashes": b"".join(m.chunk_hashes),
        "created_at": float(m.created_at),
        "key_id": m.key_id,
        "encryption": m.encryption,
    }
    if m.records is not None:
        body[RECORDS_KEY] = pack_records(m.records)
    if m.header is not None:
        body[HEADER_KEY] = m.header
    return body


def encode_body(m: Manifest) -> bytes:
    """The canonical body bytes that the signature covers."""
    validate_manifest(m)
    return canonical_packb(_body_dict(m))


# -------------------------------------------------------------- validation


def _need_int(name: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise ManifestError(f"field {name} must be an integer")
    if not lo <= v <= hi:
        raise ManifestError(f"field {name}={v} out of range [{lo}, {hi}]")
    return v


def _need_digest(name: str, v: Any) -> bytes:
    if type(v) is not bytes or len(v) != DIGEST_LEN:
        raise ManifestError(f"field {name} must be {DIGEST_LEN} bytes")
    return v


def validate_manifest(m: Manifest) -> None:
    """Check every field of ``m`` against the format's rules and size limits."""
    if type(m.model) is not str or not MODEL_RE.match(m.model):
        raise ManifestError(
            f"field model must be 1..{MAX_MODEL_LEN} chars of [A-Za-z0-9._:/@+-], "
            "starting with a letter or digit"
        )
    _need_int("version", m.version, 1, MAX_VERSION)
    if m.kind not in KINDS:
        raise ManifestError(f"field kind must be one of {KINDS}, got {m.kind!r}")
    if m.kind == "patch":
        _need_int("parent_version", m.parent_version, 1, m.version - 1)
        _need_digest("parent_digest", m.parent_digest)
    elif m.parent_version is not None or m.parent_digest is not None:
        raise ManifestError("a full checkpoint has no parent_version or parent_digest")
    _need_digest("target_digest", m.target_digest)
    _need_int("chunk_size", m.chunk_size, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    _need_int("payload_length", m.payload_length, 0, MAX_CHUNK_COUNT * m.chunk_size)
    if type(m.chunk_hashes) is not tuple:
        raise ManifestError("field chunk_hashes must be a tuple of hashes")
    expected = chunk_count(m.payload_length, m.chunk_size)
    if expected > MAX_CHUNK_COUNT:
        raise ManifestError(f"{expected} chunks exceed the limit of {MAX_CHUNK_COUNT}")
    if len(m.chunk_hashes) != expected:
        raise ManifestError(
            f"{len(m.chunk_hashes)} chunk hashes for {m.payload_length} bytes in "
            f"chunks of {m.chunk_size} (needs {expected})"
        )
    for i, h in enumerate(m.chunk_hashes):
        if type(h) is not bytes or len(h) != HASH_LEN:
            raise ManifestError(f"chunk hash {i} must be {HASH_LEN} bytes")
    if type(m.created_at) is not float or not math.isfinite(m.created_at) or m.created_at < 0:
        raise ManifestError("field created_at must be a finite, non-negative float")
    if type(m.key_id) is not str or not KEY_ID_RE.match(m.key_id):
        raise ManifestError("field key_id must be 32 lowercase hex digits")
    if m.encryption is not None:
        from swarm.trust.confidential import validate_encryption

        validate_encryption(m.encryption, m)
    if m.records is not None:
        _validate_records(m)
    if m.header is not None:
        if m.records is None:
            raise ManifestError("field header comes with field records only")
        if type(m.header) is not bytes or len(m.header) != m.records[0] \
                or len(m.header) > MAX_HEADER_BYTES:
            raise ManifestError(f"field header must be the patch's first {m.records[0]} bytes, "
                                f"at most {MAX_HEADER_BYTES}")


def _validate_records(m: Manifest) -> None:
    r = m.records
    if m.kind != "patch" or m.encryption is not None:
        raise ManifestError("field records belongs to a plain (unencrypted) patch only")
    if type(r) is not tuple or not r or not all(type(v) is int and v >= 1 for v in r):
        raise ManifestError("field records must be a tuple of sizes of 1 byte or more")
    if sum(r) != m.payload_length:
        raise ManifestError(
            f"field records adds up to {sum(r)} bytes, the payload is {m.payload_length}")
    if len(pack_records(r)) > MAX_RECORDS_BYTES:
        raise ManifestError(f"field records takes more than {MAX_RECORDS_BYTES} bytes")


def _from_body(body: dict[str, Any]) -> Manifest:
    if not isinstance(body, dict):
        raise ManifestError("manifest body is not a map")
    fmt = body.get("fmt")
    if type(fmt) is not int:
        raise ManifestError("manifest body has no format version")
    if fmt != FORMAT_VERSION:
        raise ManifestError(f"unsupported manifest format {fmt} (this node reads {FORMAT_VERSION})")
    missing = REQUIRED_KEYS - body.keys()
    if missing:
        raise ManifestError(f"manifest lacks field(s) {', '.join(sorted(missing))}")
    unknown = [k for k in body if k not in REQUIRED_KEYS]
    bad = [k for k in unknown if not k.startswith(OPTIONAL_PREFIX)]
    if bad:
        raise ManifestError(f"unknown manifest field(s) {', '.join(sorted(bad)[:4])}")
    if len(unknown) > MAX_OPTIONAL_FIELDS:
        raise ManifestError("too many optional manifest fields")
    hashes = body["chunk_hashes"]
    if type(hashes) is not bytes or len(hashes) % HASH_LEN:
        raise ManifestError(f"field chunk_hashes must be a multiple of {HASH_LEN} bytes")
    if len(hashes) // HASH_LEN > MAX_CHUNK_COUNT:
        raise ManifestError(f"more than {MAX_CHUNK_COUNT} chunks")
    enc = body["encryption"]
    if enc is not None and not isinstance(enc, dict):
        raise ManifestError("field encryption must be a map or nil")
    m = Manifest(
        model=body["model"],
        version=body["version"],
        kind=body["kind"],
        parent_version=body["parent_version"],
        parent_digest=body["parent_digest"],
        target_digest=body["target_digest"],
        payload_length=body["payload_length"],
        chunk_size=body["chunk_size"],
        chunk_hashes=tuple(hashes[i : i + HASH_LEN] for i in range(0, len(hashes), HASH_LEN)),
        created_at=body["created_at"],
        key_id=body["key_id"],
        encryption=enc,
        records=unpack_records(body[RECORDS_KEY]) if RECORDS_KEY in body else None,
        header=body.get(HEADER_KEY),
    )
    validate_manifest(m)
    return m


# ------------------------------------------------------------- public API


def build_manifest(
    payload: bytes | bytearray | memoryview,
    *,
    model: str,
    version: int,
    kind: str,
    parent_version: int | None,
    parent_digest: bytes | None,
    target_digest: bytes,
    chunk_size: int,
    key_id: str,
    created_at: float | None = None,
    encryption: dict | None = None,
    records: list[int] | tuple[int, ...] | None = None,
    header: bytes | None = None,
) -> Manifest:
    """Describe ``payload`` (already encrypted, in confidential mode) as a manifest;
    ``records``, ``header``: a plain patch's layout (``patch_layout``)."""
    if type(chunk_size) is not int or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestError(
            f"chunk size {chunk_size} out of range [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
        )
    m = Manifest(
        model=model,
        version=version,
        kind=kind,
        parent_version=parent_version,
        parent_digest=None if parent_digest is None else bytes(parent_digest),
        target_digest=bytes(target_digest),
        payload_length=len(memoryview(payload).cast("B")),
        chunk_size=chunk_size,
        chunk_hashes=hash_chunks(payload, chunk_size),
        created_at=float(time.time() if created_at is None else created_at),
        key_id=key_id,
        encryption=encryption,
        records=None if records is None else tuple(records),
        header=None if header is None else bytes(header),
    )
    validate_manifest(m)
    return m


def sign_manifest(manifest: Manifest, key: Ed25519PrivateKey) -> bytes:
    """The canonical signed envelope of ``manifest``; ``key`` must match its key_id."""
    if key_id(key) != manifest.key_id:
        raise ManifestError(
            f"manifest names key {manifest.key_id} but is signed with key {key_id(key)}"
        )
    body = encode_body(manifest)
    sig = key.sign(SIGNING_CONTEXT + body)
    return canonical_packb([ENVELOPE_TAG, manifest.key_id, body, sig])


def _open_envelope(raw: bytes) -> tuple[str, bytes, bytes]:
    """Split a raw envelope into (key_id, body, signature); nothing in it trusted yet."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ManifestError("manifest must be bytes")
    raw = bytes(raw)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(raw)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        env = _unpackb(raw, max_len=MAX_BODY_BYTES)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ManifestError(
            f"manifest envelope is not valid msgpack ({type(exc).__name__})"
        ) from None
    if not (isinstance(env, list) and len(env) == 4 and env[0] == ENVELOPE_TAG):
        raise ManifestError("not a patchswarm manifest envelope")
    _, kid, body, sig = env
    if type(kid) is not str or not KEY_ID_RE.match(kid):
        raise ManifestError("manifest envelope has a malformed key id")
    if type(body) is not bytes or type(sig) is not bytes or len(sig) != SIGNATURE_LEN:
        raise ManifestError("manifest envelope has a malformed body or signature")
    if canonical_packb(env) != raw:
        raise ManifestError("manifest envelope is not canonically encoded")
    return kid, body, sig


def _decode_body(body: bytes, envelope_kid: str) -> Manifest:
    try:
        obj = _unpackb(body, max_len=MAX_BODY_BYTES)
    except Exception as exc:
        raise ManifestError(f"manifest body is not valid msgpack ({type(exc).__name__})") from None
    _check_plain(obj)
    if canonical_packb(obj) != body:
        raise ManifestError("manifest body is not canonically encoded")
    m = _from_body(obj)
    if m.key_id != envelope_kid:
        raise ManifestError("manifest body names another key than its envelope")
    return m


def verify_manifest(raw: bytes, trust: TrustStore) -> Manifest:
    """Check the signature with a trusted key, then decode and validate the body.

    Raises ``ManifestError`` for every failure: malformed or oversized input,
    unknown or revoked key, bad signature, invalid field. Whether the version
    applies to a node's state is a separate check (``TrustStore.check_applicable``).
    """
    kid, body, sig = _open_envelope(raw)
    pub = trust.get(kid)
    try:
        pub.verify(sig, SIGNING_CONTEXT + body)
    except InvalidSignature:
        raise ManifestError(f"bad signature on manifest (key {kid})") from None
    return _decode_body(body, kid)


def decode_manifest_unverified(raw: bytes) -> Manifest:
    """Decode without checking the signature. Only for diagnostics and for data
    this node verified before it stored it; never trust the result otherwise."""
    kid, body, _ = _open_envelope(raw)
    return _decode_body(body, kid)
