"""The ``patchswarm`` command line.

Each subcommand lives beside the layer it drives and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``. Their modules import torch
lazily, so ``patchswarm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from swarm import __version__
from swarm.errors import PatchswarmError

# name -> (module, one-line help). Order is the order shown by --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "diff": ("swarm.codec.cli_diff", "diff two safetensors checkpoints into a patch"),
    "apply": ("swarm.codec.cli_apply", "apply a patch to a safetensors checkpoint"),
    "inspect": ("swarm.codec.cli_inspect", "show a patch's header and per-tensor records"),
    "keygen": ("swarm.trust.cli_keygen", "make an Ed25519 signing key pair"),
    "pack": ("swarm.trust.cli_pack", "sign a payload into a manifest plus chunks"),
    "verify": ("swarm.trust.cli_verify", "check a packed version's signature and chunks"),
    "ca": ("swarm.trust.cli_ca", "swarm CA for mutual TLS: init, issue node certificates"),
    "node": ("node.cli", "run a rollout-node daemon"),
    "publish": ("trainer.cli_publish", "publish a new version from the trainer"),
    "demo": ("trainer.cli_demo", "run a whole fleet on loopback (trainer + nodes)"),
    "sim": ("simulations.cli", "simulate a fanout over a modelled network"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchswarm",
        description=(
            "Ship lossless patches of RL policy weights from a trainer to rollout "
            "nodes through regional gossip swarms."
        ),
    )
    parser.add_argument("--version", action="version", version=f"patchswarm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
                continue  # command not built yet in this checkout
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
