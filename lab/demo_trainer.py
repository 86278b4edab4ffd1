"""The trainer process of the loopback fleet (started by ``patchswarm demo``).

It loads the packaged all-MiniLM-L6-v2 FP32 masters (or a synthetic stand-in),
writes their served view as the base checkpoint every node starts from, runs
the origin node through ``Publisher`` and then obeys one command per stdin
line, answering one JSON object per stdout line:

- ``publish``: one real AdamW REINFORCE step, then publish the new version;
- ``quit`` (or end of input): drain and exit.

Run as ``python -m lab.demo_trainer --config trainer.toml --base-out base.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--base-out", required=True)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s trainer %(levelname)s %(message)s")

    import torch
    from safetensors.torch import save_file

    from lab.minilm import PolicyTrainer, load_masters
    from node.config import load_config
    from swarm.codec import state_digest
    from trainer.publisher import Publisher
    from trainer.served import served_view

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config)
    masters = load_masters()
    base = served_view(masters.weights, cfg.served_dtype)
    save_file(base, args.base_out)
    trainer = PolicyTrainer(masters.weights, lr=args.lr, seed=args.seed)
    pub = Publisher(cfg, base=base, persist_view=False)
    pub.start()
    _say({"event": "ready", "source": masters.source, "version": pub.version,
          "digest": state_digest(base).hex(), "elements": sum(t.numel() for t in base.values())})
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd != "publish":
                _say({"event": "error", "error": f"unknown command {cmd!r}"})
                continue
            t0 = time.perf_counter()
            new = trainer.step()
            step_s = time.perf_counter() - t0
            r = pub.publish(new)
            _say({"event": "published", "version": r.version, "patch_bytes": r.patch_bytes,
                  "chunks": r.chunks, "changed": r.changed, "elements": r.elements,
                  "digest": r.target_digest.hex(), "published_at": r.published_at,
                  "step_s": round(step_s, 4), "encode_s": round(r.encode_s, 4)})
    finally:
        pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
