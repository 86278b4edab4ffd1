"""Run a rollout-node daemon: ``patchswarm node --config configs/node.toml``.

The node joins its region's swarm, fetches each new signed version, applies it
to its in-process weights and serves /healthz, /status and /metrics on the
peer port. SIGTERM drains and exits cleanly; a restart resumes from the store.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="node TOML config")


def run(args: argparse.Namespace) -> int:
    from node.config import load_config
    from node.daemon import run_node

    cfg = load_config(args.config)
    return run_node(cfg)
