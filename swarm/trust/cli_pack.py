"""Sign a payload (a patch or a full checkpoint) into DIR/manifest plus DIR/chunks/.

The target state digest comes from the patch header (patchswarm patches) or
from the tensors of a safetensors checkpoint (with --full), unless given with
--target-digest. A patch needs its parent: --parent-version, and
--parent-digest unless the patch header names its base. With --recipient
(repeatable) the chunks are encrypted for those nodes' X25519 keys.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from swarm.errors import ManifestError, PatchswarmError
from swarm.trust.chunks import DEFAULT_CHUNK_SIZE, split_payload
from swarm.trust.keys import load_private_key, load_public_key

MANIFEST_NAME = "manifest"
CHUNKS_DIR = "chunks"


def chunk_file_name(index: int) -> str:
    return f"{index:08d}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("payload", metavar="PAYLOAD", help="patch or checkpoint file to publish")
    parser.add_argument("--key", required=True, metavar="KEYFILE", help="Ed25519 private key")
    parser.add_argument("--model", required=True, metavar="NAME", help="model id")
    parser.add_argument("--version", required=True, type=int, metavar="N", help="version (>= 1)")
    parser.add_argument("--parent-version", type=int, metavar="M", help="version patched")
    parser.add_argument("--parent-digest", metavar="HEX", help="state digest of the parent")
    parser.add_argument("--target-digest", metavar="HEX", help="state digest after applying")
    parser.add_argument("--full", action="store_true", help="a full checkpoint, no parent")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, metavar="BYTES", help="chunk size"
    )
    parser.add_argument(
        "--recipient",
        action="append",
        default=[],
        metavar="PUBFILE",
        help="encrypt for this node's X25519 public key (repeatable; confidential mode)",
    )
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory")


def _hex32(text: str | None, what: str) -> bytes | None:
    if text is None:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ManifestError(f"{what} is not hex") from None
    if len(raw) != 32:
        raise ManifestError(f"{what} must be 32 bytes (64 hex digits)")
    return raw


def derive_digests(payload: bytes, path: Path) -> tuple[bytes | None, bytes | None]:
    """(base, target) state digests read from the payload itself, if it says."""
    if payload[:4] == b"PSWP":
        from swarm.codec.format import decode_header

        try:
            header = decode_header(payload)
        except PatchswarmError as exc:
            raise ManifestError(f"{path}: {exc}") from None
        return header.base_digest, header.target_digest
    if path.suffix == ".safetensors":
        from safetensors.torch import load as load_safetensors

        from swarm.codec.digest import state_digest

        try:
            tensors = load_safetensors(payload)
        except Exception as exc:  # safetensors raises its own error types on bad files
            raise ManifestError(f"{path}: not a readable safetensors file ({exc})") from None
        return None, state_digest(tensors)
    return None, None


def write_pack(directory: Path, raw_manifest: bytes, payload: bytes, chunk_size: int) -> None:
    """Write the pack layout DIR/manifest and DIR/chunks/NNNNNNNN as one transaction.

    The new pack is built and fsynced in a sibling temporary directory, then
    swapped in by renames; an existing pack at DIR is removed only after the new
    one is complete, so a full disk or a crash leaves the old pack (or nothing)
    in place, never a mix or a pack without its chunks.
    """
    if directory.exists() and not directory.is_dir():
        raise ManifestError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST_NAME).is_file():
        raise ManifestError(f"{directory} is a non-empty directory that holds no pack; "
                            "refusing to replace it")
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=parent))
    old = parent / f".{directory.name}.old"
    try:
        (tmp / CHUNKS_DIR).mkdir()
        for i, chunk in enumerate(split_payload(payload, chunk_size)):
            _write_synced(tmp / CHUNKS_DIR / chunk_file_name(i), chunk)
        _write_synced(tmp / MANIFEST_NAME, raw_manifest)
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not directory.exists():
            os.replace(old, directory)  # put the previous pack back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _layout(payload: bytes) -> dict:
    """The patch's layout for the manifest; none for bytes that do not parse as a
    patch (packed as given: the nodes' apply reports them)."""
    from swarm.errors import PatchFormatError
    from swarm.trust.manifest import patch_layout

    try:
        return patch_layout(payload)
    except PatchFormatError:
        return {}


def run(args: argparse.Namespace) -> int:
    from swarm.trust.keys import key_id
    from swarm.trust.manifest import (
        MAX_CHUNK_SIZE,
        MIN_CHUNK_SIZE,
        build_manifest,
        sign_manifest,
    )

    path = Path(args.payload)
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
    key = load_private_key(args.key)
    if not hasattr(key, "sign"):
        raise ManifestError(f"{args.key}: an X25519 key cannot sign; use an Ed25519 key")
    base, target = derive_digests(payload, path)
    target = _hex32(args.target_digest, "--target-digest") or target
    if target is None:
        raise ManifestError("cannot tell the target state digest; pass --target-digest HEX")
    parent_digest = _hex32(args.parent_digest, "--parent-digest")
    if not MIN_CHUNK_SIZE <= args.chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestError(f"--chunk-size must be {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE} bytes, "
                            f"not {args.chunk_size}")
    if args.full:
        if payload[:4] == b"PSWP":
            raise ManifestError(f"{path} is a patch; --full takes a whole safetensors checkpoint")
        if args.parent_version is not None or parent_digest is not None:
            raise ManifestError("--full takes no --parent-version or --parent-digest")
        kind = "full"
    else:
        kind = "patch"
        if args.parent_version is None:
            raise ManifestError("a patch needs --parent-version (or pass --full)")
        if parent_digest is not None and base is not None and parent_digest != base:
            raise ManifestError("--parent-digest differs from the base digest in the patch")
        parent_digest = parent_digest or base
        if parent_digest is None:
            raise ManifestError("cannot tell the parent state digest; pass --parent-digest HEX")
    encryption = None
    if args.recipient:
        from swarm.trust.confidential import encrypt_payload

        recipients = [load_public_key(p) for p in args.recipient]
        if any(hasattr(r, "verify") for r in recipients):
            raise ManifestError("--recipient takes X25519 public keys (keygen --x25519)")
        payload, encryption = encrypt_payload(
            payload, args.chunk_size, recipients, model=args.model, version=args.version
        )
    manifest = build_manifest(
        payload,
        model=args.model,
        version=args.version,
        kind=kind,
        parent_version=args.parent_version,
        parent_digest=parent_digest,
        target_digest=target,
        chunk_size=args.chunk_size,
        key_id=key_id(key),
        encryption=encryption,
        **(_layout(payload) if kind == "patch" and encryption is None else {}),
    )
    raw = sign_manifest(manifest, key)
    out = Path(args.output)
    try:
        write_pack(out, raw, payload, args.chunk_size)
    except OSError as exc:
        raise ManifestError(f"cannot write {out}: {exc.strerror or exc}") from None
    mode = "encrypted " if encryption else ""
    print(
        f"packed {args.model} version {args.version} ({kind}, {manifest.payload_length} "
        f"{mode}bytes, {manifest.chunk_count} chunks) signed by {manifest.key_id} into {out}"
    )
    return 0
