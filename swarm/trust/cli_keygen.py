"""Make a key pair: KEYFILE gets the private key (PEM, mode 0600), KEYFILE.pub the public key.

By default an Ed25519 signing key for a trainer; with --x25519 an X25519 key a
node uses to receive confidential versions. Refuses to overwrite existing files.
"""

from __future__ import annotations

import argparse

from swarm.trust.keys import generate_keypair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("keyfile", metavar="KEYFILE", help="where to write the private key")
    parser.add_argument(
        "--x25519",
        action="store_true",
        help="make a node's X25519 encryption key instead of an Ed25519 signing key",
    )


def run(args: argparse.Namespace) -> int:
    kind = "x25519" if args.x25519 else "ed25519"
    _, kid = generate_keypair(args.keyfile, kind=kind)
    print(f"wrote {kind} key {kid}: {args.keyfile} (private, 0600), {args.keyfile}.pub")
    return 0
