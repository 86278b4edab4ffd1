"""A region partition that heals, on emulated geography (network namespaces): the
regions that can still reach the trainer move on, the cut-off region keeps serving
its verified version, and it catches up by itself once its uplink is back
(issue #10's fault suite). Needs root and iproute2; slow."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab.netlab import NetLab, available

ROOT = Path(__file__).resolve().parent.parent
WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(WHY is not None, reason=WHY or "")]

# Runs inside the trainer's namespace (the fleet is polled over the lab's network).
INNER = textwrap.dedent("""
    import json, subprocess, sys, time
    from lab.fleet import LoopbackFleet
    from lab.netlab import NetLab

    lab = NetLab(2, 2, uplink_mbit=50, tag=sys.argv[1])
    out = {}
    with LoopbackFleet(2, 2, chunk_size=32 * 1024, lab=lab, swarm={"redial_s": 1.0}) as fleet:
        fleet.start(timeout=180)
        v2 = fleet.publish()
        fleet.wait_version(v2["version"], timeout=90)
        r0 = [n for n in fleet.nodes if n.region == "region-0"]
        r1 = [n for n in fleet.nodes if n.region == "region-1"]
        lab.cut(1)
        v3 = fleet.publish()
        st0 = fleet.wait_version(v3["version"], timeout=90, nodes=r0)
        out["region0_digest_ok"] = all(s["active_digest"] == v3["digest"] for s in st0.values())
        time.sleep(3)
        # the cut region is out of the trainer's reach: ask from inside each node's namespace
        def inside(n):
            code = ("import urllib.request, json; print(json.loads(urllib.request.urlopen("
                    f"'http://{n.api_addr}/status', timeout=5).read())['active_version'])")
            r = subprocess.run([*n.prefix, sys.executable, "-c", code], capture_output=True,
                               text=True, timeout=60)
            return int(r.stdout.strip()) if r.returncode == 0 else r.stderr[-300:]
        out["region1_during_cut"] = [inside(n) for n in r1]
        out["trainer_reaches_region1"] = any(fleet.status(n) for n in r1)
        t0 = time.monotonic()
        lab.heal(1)
        st1 = fleet.wait_version(v3["version"], timeout=180, nodes=r1)
        out["heal_to_v3_s"] = round(time.monotonic() - t0, 2)
        out["region1_digest_ok"] = all(s["active_digest"] == v3["digest"] for s in st1.values())
        out["bad_chunks"] = sum(fleet.status(n)["bad_chunks"] for n in fleet.nodes)
    print("RESULT " + json.dumps(out))
""")


def test_a_partitioned_region_serves_its_version_and_catches_up_after_healing():
    with NetLab(2, 2, uplink_mbit=50) as lab:
        res = subprocess.run([*lab.exec_prefix(lab.ns_trainer), sys.executable, "-c", INNER,
                              lab.tag], capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["region0_digest_ok"] and out["region1_digest_ok"]
    assert out["region1_during_cut"] == [2, 2]  # still serving the version it verified
    assert not out["trainer_reaches_region1"]  # the cut was real
    assert out["bad_chunks"] == 0
    assert out["heal_to_v3_s"] < 120
    print(out)
