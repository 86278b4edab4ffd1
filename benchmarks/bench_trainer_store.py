"""A long-running trainer's footprint: what its store and its core hold, version after version.

Real ``patchswarm node`` processes on loopback (``lab.fleet.LoopbackFleet``), the
trainer's ``Publisher`` in this process, started once and never restarted, as an RL
job runs it. Each step publishes the next version of a small BF16 model (a few Adam-
like steps' worth of change), waits until every node serves it, and records:

- the versions in the trainer's store and their bytes on disk;
- the versions its protocol core still holds (announces, plans pushes for);
- the versions in each node's store.

With ``[publish] anchor_every`` set, the store should stay near ``anchor_every`` +
``keep_versions`` versions however long the trainer runs (docs/control-plane.md);
until round 46 a running trainer collected nothing until its next restart.

Prints a table and writes ``benchmarks/results/trainer_store.json``.

    python benchmarks/bench_trainer_store.py --versions 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lab.fleet import LoopbackFleet  # noqa: E402
from node.config import load_config  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402
from trainer.served import served_view  # noqa: E402


def masters(seed: int, mib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1024, int(mib * (1 << 20) / 2) // 1024 * 1024)  # BF16 elements served
    return {"w.weight": torch.randn(n // 1024, 1024, generator=g),
            "b.bias": torch.randn(1024, generator=g)}


def step(m: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 2e-3 * torch.randn(v.shape, generator=g) for k, v in m.items()}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=60, help="publishes (anchors come on top)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--mib", type=float, default=2.0, help="served view size")
    ap.add_argument("--anchor-every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=1, help="trainer [store] keep_versions")
    ap.add_argument("--swarm-keep", type=int, default=3, help="[swarm] keep_versions")
    ap.add_argument("--every", type=int, default=10, help="print a row every this many")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_store.json")
    args = ap.parse_args()

    m = masters(0, args.mib)
    rows = []
    t_start = time.perf_counter()
    with LoopbackFleet(1, args.nodes, chunk_size=256 * 1024,
                       swarm={"keep_versions": args.swarm_keep},
                       trainer_sections={"publish": {"anchor_every": args.anchor_every},
                                         "store": {"keep_versions": args.keep}}) as fleet:
        fleet.start_nodes_only(served_view(m, "bf16"))
        pub = Publisher(load_config(fleet.workdir / "trainer.toml"))
        pub.start()
        store_dir = Path(pub.cfg.store_dir)
        try:
            print(f"{'published':>9} {'version':>7} {'store versions':>14} {'store MB':>9} "
                  f"{'core versions':>13} {'node store versions':>19}")
            for k in range(1, args.versions + 1):
                m = step(m, k)
                pub.publish(m)
                fleet.wait_version(pub.version, timeout=120)
                if k % args.every and k != args.versions:
                    continue
                core = pub.node.driver.call(lambda: sorted(pub.node.core.manifests))
                nodes = [len([d for d in (fleet.workdir / f"{n.name}-store" / "versions").iterdir()])
                         for n in fleet.nodes]
                row = {"published": k, "version": pub.version, "store_versions": len(pub.store.versions()),
                       "store_bytes": dir_bytes(store_dir), "core_versions": len(core),
                       "node_store_versions": nodes}
                rows.append(row)
                print(f"{k:>9} {pub.version:>7} {row['store_versions']:>14} "
                      f"{row['store_bytes'] / 1e6:>9.2f} {row['core_versions']:>13} {nodes!s:>19}")
        finally:
            pub.close()
    out = {"bench": "trainer_store", "label": args.label, "versions": args.versions,
           "nodes": args.nodes, "mib": args.mib, "anchor_every": args.anchor_every,
           "keep_versions": args.keep, "swarm_keep_versions": args.swarm_keep,
           "wall_s": round(time.perf_counter() - t_start, 1), "cpus": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
