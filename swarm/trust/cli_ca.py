"""The swarm CA for mutual TLS: create it, and issue node and trainer certificates.

    patchswarm ca init CA_DIR
    patchswarm ca issue NODE_ID --region R [--role node|origin] --ca CA_DIR -o OUT_DIR

Keep CA_DIR/ca.key offline or on the trainer's host: whoever holds it can mint
identities. Give each node its own NODE_ID.key/.crt and CA_DIR/ca.crt. See
docs/security.md for the threat model.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ca_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create a swarm CA (ca.key 0600, ca.crt)",
                          description="Create a new swarm CA in CA_DIR; refuses to overwrite.")
    init.add_argument("ca_dir", metavar="CA_DIR")
    init.add_argument("--name", default="patchswarm swarm CA", help="the CA's common name")
    init.add_argument("--days", type=int, default=3650, help="validity (default %(default)s)")
    iss = sub.add_parser("issue", help="issue a node or trainer certificate",
                         description="Issue NODE_ID.key (0600) and NODE_ID.crt into OUT_DIR, "
                                     "binding the node id, region and role to the key.")
    iss.add_argument("node_id", metavar="NODE_ID")
    iss.add_argument("--region", required=True, help="the node's region")
    iss.add_argument("--role", choices=("node", "origin"), default="node",
                     help="origin for the trainer (default %(default)s)")
    iss.add_argument("--ca", required=True, metavar="CA_DIR", help="directory made by `ca init`")
    iss.add_argument("-o", "--output", required=True, metavar="OUT_DIR")
    iss.add_argument("--days", type=int, default=365, help="validity (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from swarm.trust import ca

    if args.ca_command == "init":
        key, cert = ca.init_ca(args.ca_dir, name=args.name, days=args.days)
        print(f"swarm CA created: {cert} (share it), {key} (private, 0600: keep it safe)")
    else:
        key, cert = ca.issue(args.ca, args.node_id, region=args.region, role=args.role,
                             out_dir=args.output, days=args.days)
        print(f"issued {args.role} {args.node_id} (region {args.region}): {cert}, {key} (0600)")
    return 0
