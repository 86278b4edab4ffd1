"""Publish a new version from the trainer: diff, sign, seed every region.

``patchswarm publish --config configs/trainer.toml NEW.safetensors`` starts the
origin node from the config, diffs NEW against the last published version
(the config's base checkpoint the first time), signs the manifest and seeds
the patch until every region holds every chunk, with a progress bar per
region. Nodes come back to a restarted origin on their own (border nodes redial
it); before seeding, the command waits (``--wait-peers``) for ``--regions``
regions, or else for every region the previous run met (``regions.json`` in the
trainer's store), or else for one; after seeding it stays up ``--linger``
seconds so that nodes which found no peer yet can still reach the tracker. FP32 tensors in NEW are taken as masters and turned into the served
view (``publish.served_dtype``); BF16/FP8 tensors are published as they are.
For training loops, the ``trainer.publisher.Publisher`` API keeps the origin
running between versions.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="NEW.safetensors", help="the new weights")
    parser.add_argument("--config", required=True, metavar="FILE", help="trainer TOML config")
    parser.add_argument("--regions", type=int, metavar="N",
                        help="regions to wait for before and while seeding (default: those the "
                             "last run met, all of them)")
    parser.add_argument("--wait-peers", type=float, default=10.0, metavar="S",
                        help="seconds to let nodes connect before seeding is judged (default 10)")
    parser.add_argument("--linger", type=float, default=5.0, metavar="S",
                        help="stay up this long after seeding, as the tracker for nodes that "
                             "redial late (default 5, the nodes' default redial_s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="give up seeding after this many seconds (default 600)")


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    from node.config import load_config
    from swarm.errors import ConfigError, PatchswarmError
    from trainer.publisher import Publisher

    cfg = load_config(args.config)
    try:
        new = load_file(args.checkpoint)
    except FileNotFoundError:
        raise ConfigError(f"{args.checkpoint} does not exist") from None
    except Exception as exc:
        raise PatchswarmError(f"{args.checkpoint}: not a readable safetensors file: {exc}") from None
    pub = Publisher(cfg)
    pub.start()
    try:
        expected = set(pub.remembered_regions())
        deadline = time.monotonic() + args.wait_peers
        while time.monotonic() < deadline:
            met = pub.regions()
            if args.regions is not None:
                if len(met) >= args.regions:
                    break
            elif met and expected <= set(met):
                break
            time.sleep(0.2)
        fp32 = any(t.dtype == torch.float32 and not k.endswith(".scale") for k, t in new.items())
        r = pub.publish(new) if fp32 else pub.publish_served(new)
        print(f"version {r.version}: patch of {r.patch_bytes:,} bytes in {r.chunks} chunks, "
              f"{r.changed:,} of {r.elements:,} values changed", flush=True)
        bars: dict[str, tqdm] = {}

        def show(prog: dict[str, int]) -> None:
            for region, n in sorted(prog.items()):
                bar = bars.get(region)
                if bar is None:
                    bar = bars[region] = tqdm(total=r.chunks, desc=region, unit="chunk",
                                              position=len(bars), file=sys.stdout)
                bar.update(min(n, r.chunks) - bar.n)

        ok = pub.wait_seeded(r.version, args.timeout, regions=args.regions, on_progress=show)
        for bar in bars.values():
            bar.close()
        if not ok:
            print(f"version {r.version} did not reach every region within {args.timeout:.0f} s",
                  file=sys.stderr)
            return 1
        print(f"version {r.version} seeded into {len(bars)} region(s)", flush=True)
        time.sleep(max(0.0, args.linger))
        return 0
    finally:
        pub.close()
