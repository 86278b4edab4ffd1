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
