"""The ``patchswarm`` command line.

Each subcommand lives beside the layer it drives and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``. Their modules import torch
lazily, so ``patchswarm --help`` stays fast. This module sits above every layer
(docs/architecture.md): the library (``swarm``) never imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

from swarm import __version__
from swarm.errors import PatchswarmError
from swarm.protocol import wire


# Plain import statements (not import by string), so the layering rules of
# tests/test_architecture.py see every dependency of the command line.
def _diff() -> ModuleType:
    from swarm.codec import cli_diff
    return cli_diff


def _apply() -> ModuleType:
    from swarm.codec import cli_apply
    return cli_apply


def _inspect() -> ModuleType:
    from swarm.codec import cli_inspect
    return cli_inspect


def _keygen() -> ModuleType:
    from swarm.trust import cli_keygen
    return cli_keygen


def _pack() -> ModuleType:
    from swarm.trust import cli_pack
    return cli_pack


def _verify() -> ModuleType:
    from swarm.trust import cli_verify
    return cli_verify


def _ca() -> ModuleType:
    from swarm.trust import cli_ca
    return cli_ca


def _node() -> ModuleType:
    from node import cli
    return cli


def _publish() -> ModuleType:
    from trainer import cli_publish
    return cli_publish


def _fleet() -> ModuleType:
    from patchswarm import cli_fleet
    return cli_fleet


def _demo() -> ModuleType:
    from lab import cli_demo
    return cli_demo


def _sim() -> ModuleType:
    from simulations import cli
    return cli


# name -> (module loader, one-line help). Order is the order shown by --help.
COMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "diff": (_diff, "diff two safetensors checkpoints into a patch"),
    "apply": (_apply, "apply a patch to a safetensors checkpoint"),
    "inspect": (_inspect, "show a patch's header and per-tensor records"),
    "keygen": (_keygen, "make an Ed25519 signing key pair"),
    "pack": (_pack, "sign a payload into a manifest plus chunks"),
    "verify": (_verify, "check a packed version's signature and chunks"),
    "ca": (_ca, "swarm CA for mutual TLS: init, issue node certificates"),
    "node": (_node, "run a rollout-node daemon"),
    "publish": (_publish, "publish a new version from the trainer"),
    "fleet": (_fleet, "which version every node serves, per region (the origin's view)"),
    "demo": (_demo, "run a whole fleet on loopback (trainer + nodes)"),
    "sim": (_sim, "simulate a fanout over a modelled network"),
}

# packages an installation may leave out (the node image ships no lab/ or simulations/)
_OPTIONAL = ("lab", "simulations", "trainer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchswarm",
        description=(
            "Ship lossless patches of RL policy weights from a trainer to rollout "
            "nodes through regional gossip swarms."
        ),
    )
    parser.add_argument("--version", action="version",
                        version=f"patchswarm {__version__} (swarm protocol "
                                f"{wire.MIN_PROTOCOL_VERSION}..{wire.PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (load, help_text) in COMMANDS.items():
        try:
            module = load()
        except ModuleNotFoundError as exc:
            if exc.name in _OPTIONAL:
                continue  # this installation leaves that application out
            raise
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except PatchswarmError as exc:
        print(f"patchswarm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"patchswarm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
