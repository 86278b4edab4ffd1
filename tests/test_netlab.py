"""Emulated geography (network namespaces + tbf): the lab itself, and a real fleet in it.

Needs root and iproute2; skipped elsewhere. Slow: run with ``pytest -m slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.netlab import NetLab, available

ROOT = Path(__file__).resolve().parent.parent
WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(WHY is not None, reason=WHY or "")]

RECEIVER = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 5001)); s.listen(1)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
print(n)
"""


def _transfer(lab: NetLab, src: str, dst_ns: str, dst_ip: str, nbytes: int) -> float:
    rx = subprocess.Popen([*lab.exec_prefix(dst_ns), sys.executable, "-c", RECEIVER],
                          stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        send = (f"import socket,time; s=socket.create_connection(('{dst_ip}',5001),timeout=10); "
                f"t=time.monotonic(); s.sendall(b'x'*{nbytes}); s.close(); print(time.monotonic()-t)")
        t0 = time.monotonic()
        subprocess.run([*lab.exec_prefix(src), sys.executable, "-c", send], check=True, timeout=60)
        got = int(rx.communicate(timeout=60)[0])
        elapsed = time.monotonic() - t0
    finally:
        if rx.poll() is None:
            rx.kill()
    assert got == nbytes
    return elapsed


def test_lab_routes_between_regions_shapes_uplinks_and_cleans_up():
    with NetLab(2, 1, uplink_mbit=20) as lab:
        names = list(lab.namespaces)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
        # 4 MB across a 20 Mbit uplink takes at least ~1.6 s; inside a region it is fast.
        cross = _transfer(lab, lab.ns_host(0, 0), lab.ns_host(1, 0), lab.ip_host(1, 0), 4_000_000)
        assert cross > 1.4
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def test_host_route_attributes_go_on_every_hosts_route_to_other_regions():
    with NetLab(2, 2, host_route={"initcwnd": "64", "initrwnd": "32"}) as lab:
        for r in range(2):
            for h in range(2):
                routes = subprocess.run([*lab.exec_prefix(lab.ns_host(r, h)), "ip", "route"],
                                        capture_output=True, text=True, check=True).stdout
                default = next(x for x in routes.splitlines() if x.startswith("default"))
                assert "initcwnd 64" in default and "initrwnd 32" in default
                local = next(x for x in routes.splitlines() if x.startswith("10.213."))
                assert "initcwnd" not in local  # inside the region: the kernel's default


def test_fleet_converges_in_the_lab_with_one_copy_per_region(tmp_path):
    out = tmp_path / "netlab.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_loopback.py"), "--netlab",
         "--regions", "2", "--nodes-per-region", "2", "--uplink-mbit", "50",
         "--params", "2000000", "--versions", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    for run in runs.values():
        for row in run["versions"]:
            assert row["converged"]
            assert row["cross_region_ratio"] <= 1.02
