"""``node.daemon.warm_heap``: memory touched at start is what the first version reuses.

Each case runs in a fresh interpreter: malloc settings and the heap are per process.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc tuning")

PROBE = """
import json, sys, numpy as np
from node.daemon import tune_malloc, warm_heap

def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) * 1024

warm = int(sys.argv[1]) << 20
assert tune_malloc(warm)
r0 = rss()
got = warm_heap(warm)
r1 = rss()
# what a first version allocates: chunk-sized buffers, kept, each written once
bufs = [np.empty(4 << 20, dtype=np.uint8) for _ in range(16)]
for b in bufs:
    b.fill(7)
r2 = rss()
print(json.dumps({"warmed": got, "warm_rss": r1 - r0, "grew": r2 - r1}))
"""


def _probe(warm_mib: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(warm_mib)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_buffers_after_a_warm_start_reuse_touched_memory() -> None:
    cold = _probe(0)
    warm = _probe(96)
    assert cold["warmed"] == 0 and warm["warmed"] == 96 << 20
    assert warm["warm_rss"] >= 90 << 20  # touched, and kept after free
    assert cold["grew"] >= 60 << 20  # 64 MiB of fresh pages
    assert warm["grew"] <= 8 << 20  # reused: no new pages


def test_nothing_to_warm_is_a_no_op() -> None:
    from node.daemon import warm_heap

    assert warm_heap(0) == 0


ORIGIN_PROBE = """
import json, resource, sys
import torch
from swarm.codec import encode_patch
from trainer.publisher import warm_memory

g = torch.Generator().manual_seed(1)
# a dense 64 MiB BF16 version: every value moves
base = {f"t{k}": torch.randn(1 << 21, generator=g).to(torch.bfloat16) for k in range(16)}
new = {k: (v.float() + torch.randn(v.shape, generator=g)).to(torch.bfloat16)
       for k, v in base.items()}
done = warm_memory(int(sys.argv[1]))
again = warm_memory(int(sys.argv[1]))
faults = []
for _ in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    enc = encode_patch(base, new, threads=2)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    del enc
print(json.dumps({"done": done, "again": again, "faults": faults}))
"""


def _origin_probe(warm_mib: int) -> dict:
    out = subprocess.run([sys.executable, "-c", ORIGIN_PROBE, str(warm_mib)],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_origin_encodes_each_version_in_memory_it_touched_before() -> None:
    """``trainer.publisher.warm_memory`` (``Publisher.start``): a dense 64 MiB encode's
    planes, patch and join come from the kept heap, not fresh pages each version (the
    join alone is above glibc's largest dynamic mmap threshold, 32 MiB); once per
    process; ``warm_memory_mib = 0`` leaves malloc alone."""
    cold = _origin_probe(0)
    warm = _origin_probe(256)
    assert not cold["done"] and not cold["again"]
    assert warm["done"] and warm["again"]
    page = 4096
    assert min(cold["faults"]) >= (48 << 20) // page  # every version: fresh pages
    # measured warm: 1.9-4.1k for the first version, 0-2.5k after (heap layout varies)
    assert warm["faults"][0] <= (32 << 20) // page  # the first version too (warmed at start)
    assert max(warm["faults"][1:]) <= (16 << 20) // page
