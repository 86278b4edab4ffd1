"""Check a packed version: the manifest signature against trusted keys, then every chunk.

Exits 0 when all checks out, otherwise 1 with a one-line reason naming what
failed (bad signature, unknown key, chunk N hash mismatch, missing chunk N...).
Encrypted chunks are checked as ciphertext: no decryption key is needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.errors import ChunkError, ManifestError
from swarm.trust.cli_pack import CHUNKS_DIR, MANIFEST_NAME, chunk_file_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="directory written by `patchswarm pack`")
    parser.add_argument(
        "--trust",
        action="append",
        required=True,
        metavar="PUBFILE",
        help="a trusted Ed25519 public key (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from swarm.trust.chunks import verify_chunk
    from swarm.trust.keys import TrustStore
    from swarm.trust.manifest import MAX_MANIFEST_BYTES, verify_manifest

    directory = Path(args.directory)
    trust = TrustStore.from_files(args.trust)
    mpath = directory / MANIFEST_NAME
    try:
        with mpath.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(f"cannot read {mpath}: {exc.strerror or exc}") from None
    m = verify_manifest(raw, trust)
    for i in range(m.chunk_count):
        cpath = directory / CHUNKS_DIR / chunk_file_name(i)
        try:
            with cpath.open("rb") as f:
                data = f.read(m.chunk_length(i) + 1)
        except FileNotFoundError:
            raise ChunkError(f"missing chunk {i} ({cpath})") from None
        except OSError as exc:
            raise ChunkError(f"cannot read chunk {i}: {exc.strerror or exc}") from None
        verify_chunk(m, i, data)
    enc = " encrypted" if m.encryption else ""
    print(
        f"ok: {m.model} version {m.version} ({m.kind}, {m.payload_length}{enc} bytes, "
        f"{m.chunk_count} chunks) signed by {m.key_id}"
    )
    return 0
