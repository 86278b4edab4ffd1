"""Throughput of the trust layer: chunk hashes, AEAD, manifest sign/verify, store writes.

Prints a table and writes benchmarks/results/trust.json. Chunks are 4 MiB and
cycled over a pool larger than the CPU caches, so the numbers are memory-bound
like a node's, not cache-resident. Each figure is the best of several runs.

    python benchmarks/bench_trust.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402
import xxhash  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305  # noqa: E402

from node.store import ChunkStore  # noqa: E402
from swarm.trust.chunks import DEFAULT_CHUNK_SIZE, chunk_hash  # noqa: E402
from swarm.trust.confidential import decrypt_payload, encrypt_payload, new_node_key  # noqa: E402
from swarm.trust.keys import TrustStore, key_id  # noqa: E402
from swarm.trust.manifest import build_manifest, sign_manifest, verify_manifest  # noqa: E402

CHUNK = DEFAULT_CHUNK_SIZE


def best_rate(fn: Callable[[bytes], object], pool: list[bytes], repeats: int) -> float:
    """Best GB/s of ``fn`` over one pass through ``pool``."""
    fn(pool[0])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in pool:
            fn(c)
        best = min(best, time.perf_counter() - t0)
    return sum(len(c) for c in pool) / best / 1e9


def best_per_second(fn: Callable[[], object], n: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller pool, fewer repeats")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trust.json"))
    args = ap.parse_args()
    pool_n, repeats = (4, 2) if args.quick else (16, 3)
    pool = [os.urandom(CHUNK) for _ in range(pool_n)]
    threads = os.cpu_count() or 1
    results: dict[str, dict] = {}

    def row(name: str, value: float, unit: str, note: str = "") -> None:
        results[name] = {"value": round(value, 3), "unit": unit, "note": note}
        print(f"{name:<44} {value:>12.2f} {unit:<10} {note}")

    print(f"{'measure':<44} {'value':>12} {'unit':<10} note")
    print("-" * 90)
    row(
        "hash sha256 (4 MiB chunks)",
        best_rate(lambda c: hashlib.sha256(c).digest(), pool, repeats),
        "GB/s",
    )
    row("hash blake3, 1 thread", best_rate(chunk_hash, pool, repeats), "GB/s", "chosen")
    row(
        f"hash blake3, {threads} threads",
        best_rate(
            lambda c: blake3.blake3(c, max_threads=blake3.blake3.AUTO).digest(), pool, repeats
        ),
        "GB/s",
    )
    row(
        "hash xxh3-128 (not cryptographic)",
        best_rate(lambda c: xxhash.xxh3_128(c).digest(), pool, repeats),
        "GB/s",
        "reference",
    )

    key = os.urandom(32)
    nonce = b"\x00" * 12
    for name, cls in (("aes-256-gcm", AESGCM), ("chacha20-poly1305", ChaCha20Poly1305)):
        aead = cls(key)
        sealed = [aead.encrypt(nonce, c, None) for c in pool]
        row(
            f"aead {name} seal",
            best_rate(lambda c, a=aead: a.encrypt(nonce, c, None), pool, repeats),
            "GB/s",
            "chosen" if name == "aes-256-gcm" else "",
        )
        row(
            f"aead {name} open",
            best_rate(lambda c, a=aead: a.decrypt(nonce, c, None), sealed, repeats),
            "GB/s",
        )

    payload = b"".join(pool)
    node = new_node_key()
    recips = [node.public_key()] + [new_node_key().public_key() for _ in range(7)]
    sealed_payload: list = []

    def seal_all() -> None:
        sealed_payload[:] = [encrypt_payload(payload, CHUNK, recips, model="m", version=2)]

    def open_all() -> None:
        decrypt_payload(m_enc, ct, node)

    rate = len(payload) / 1e9
    row(
        "confidential encrypt_payload (8 recipients)",
        rate * best_per_second(seal_all, 1, repeats + 1),
        "GB/s",
        "whole payload, warm buffers",
    )
    ct, enc = sealed_payload[0]
    sk0 = Ed25519PrivateKey.generate()
    m_enc = build_manifest(ct, model="m", version=2, kind="full", parent_version=None,
                           parent_digest=None, target_digest=b"\x00" * 32, chunk_size=CHUNK,
                           key_id=key_id(sk0), encryption=enc)  # fmt: skip
    row("confidential decrypt_payload", rate * best_per_second(open_all, 1, repeats + 1), "GB/s")

    sk = Ed25519PrivateKey.generate()
    trust = TrustStore([sk.public_key()])
    base = build_manifest(b"", model="minilm", version=2, kind="patch", parent_version=1,
                          parent_digest=b"\x01" * 32, target_digest=b"\x02" * 32,
                          chunk_size=CHUNK, key_id=key_id(sk))  # fmt: skip
    m = dataclasses.replace(base, payload_length=125 * CHUNK,
                            chunk_hashes=tuple(os.urandom(32) for _ in range(125)))  # fmt: skip
    raw = sign_manifest(m, sk)
    row("manifest size, 125 chunks (500 MiB)", len(raw), "bytes")
    row(
        "manifest sign, 125 chunks",
        best_per_second(lambda: sign_manifest(m, sk), 500, repeats),
        "/s",
    )
    row(
        "manifest verify, 125 chunks",
        best_per_second(lambda: verify_manifest(raw, trust), 500, repeats),
        "/s",
    )
    big = dataclasses.replace(base, payload_length=65536 * CHUNK,
                              chunk_hashes=tuple(os.urandom(32) for _ in range(65536)))  # fmt: skip
    big_raw = sign_manifest(big, sk)
    row(
        "manifest verify, 65536 chunks (256 GiB)",
        best_per_second(lambda: verify_manifest(big_raw, trust), 5, repeats),
        "/s",
        f"{len(big_raw)} bytes",
    )

    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks" / "results") as d:
        full = build_manifest(payload, model="m", version=1, kind="full", parent_version=None,
                              parent_digest=None, target_digest=b"\x00" * 32, chunk_size=CHUNK,
                              key_id=key_id(sk))  # fmt: skip
        with ChunkStore(Path(d) / "store") as store:
            store.put_manifest(sign_manifest(full, sk), full)
            t0 = time.perf_counter()
            for i, c in enumerate(pool):
                store.put_chunk(1, i, c)
            put = len(payload) / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        with ChunkStore(Path(d) / "store") as store:
            assert store.complete(1)
        reopen = len(payload) / (time.perf_counter() - t0) / 1e9
    row("store put_chunk (hash + write + fsync)", put, "GB/s", "this disk")
    row("store reopen + re-verify", reopen, "GB/s")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "cpu_count": threads, "machine": platform.machine(),
            "chunk_bytes": CHUNK, "pool_chunks": pool_n, "repeats": repeats}  # fmt: skip
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
