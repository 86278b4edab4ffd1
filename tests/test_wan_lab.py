"""The emulated WAN's delay (``lab.delay`` holders in a ``lab.netlab`` lab): packets
really wait, a transfer still goes through, and ``close`` leaves nothing behind.

Needs root, nftables/iptables-nft and the ``wan`` extra (``scripts/wan_setup.sh``);
skipped elsewhere. Slow: run with ``pytest -m slow``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lab.netlab import NetLab, delay_available

WHY = delay_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(WHY is not None, reason=WHY or "")]

RECEIVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5001)); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
print(n, flush=True)
"""


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _lab_netns() -> set[str]:
    return {w for w in _netns_names().split() if w.startswith("psw")}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _send_from_trainer(lab: NetLab, region: int, host: int, nbytes: int, timeout: float) -> int:
    """``nbytes`` over one TCP connection from the trainer's host to a host; what arrived."""
    rx = subprocess.Popen([*lab.exec_prefix(lab.ns_host(region, host)), sys.executable, "-c",
                           RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "listening"
        send = (f"import socket; s=socket.create_connection(('{lab.ip_host(region, host)}', "
                f"5001), timeout=10); s.sendall(b'x'*{nbytes}); s.close()")
        subprocess.run([*lab.exec_prefix(lab.ns_trainer), sys.executable, "-c", send],
                       check=True, timeout=timeout)
        return int(rx.communicate(timeout=timeout)[0].strip())
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(5)


def test_delayed_lab_delays_moves_data_and_cleans_up():
    lab = NetLab(2, 2, uplink_mbit=50, host_mbit=1000, trainer_in_region=0, delay_ms=20,
                 intra_delay_ms=2)
    with lab:
        names = list(lab.namespaces)
        pids = [h["pid"] for h in lab.holders]
        assert len(pids) == 1 + 4  # the core, and one per host (the trainer is host 0-1)
        assert all(n in _netns_names() for n in names)

        # round trips: 2 x 20 ms between regions, 2 x 2 ms inside one
        cross = lab.tcp_rtt_ms(lab.ns_trainer, lab.ip_host(1, 0))
        intra = lab.tcp_rtt_ms(lab.ns_host(1, 0), lab.ip_host(1, 1))
        assert 40 <= cross <= 40 + 8, cross
        assert 4 <= intra <= 4 + 4, intra

        # 4 MB from the trainer's host into region 1 through its 50 Mbit uplink
        up0 = lab.uplink_bytes()
        t0 = time.monotonic()
        got = _send_from_trainer(lab, 1, 1, 4_000_000, timeout=60)
        elapsed = time.monotonic() - t0
        assert got == 4_000_000
        assert elapsed > 4_000_000 * 8 / 50e6 * 0.9  # shaped
        up1 = lab.uplink_bytes()
        into = up1[1]["into"] - up0[1]["into"]
        assert 4_000_000 <= into <= 4_400_000  # payload + headers, counted once

        stats = lab.delay_stats()
        core = next(s for s in stats if s["ns"] == lab.ns_core)
        assert core["packets"] > 0 and core["kernel_dropped"] == 0
        assert core["cpu_s"] is not None
    # everything gone: namespaces, holder processes (their nft tables went with the
    # namespaces, and were deleted before)
    assert not any(n in _netns_names() for n in names)
    assert not any(_alive(p) for p in pids)
    finals = [h.get("final") for h in lab.holders]
    assert all(f is not None and f["dropped_over_cap"] == 0 for f in finals)
    assert sum(f["packets"] for f in finals) > 0


def test_a_failed_build_removes_what_it_made():
    lab = NetLab(2, 2, delay_ms=10, trainer_in_region=5)  # no region 5
    with pytest.raises(Exception, match="trainer_in_region"):
        lab.build()
    assert not lab.namespaces and not lab.holders


def test_stopping_the_bench_midway_leaves_nothing_behind(tmp_path):
    """SIGTERM to ``bench_wan.py`` while its fleet starts: the fleet, the holders and the
    namespaces all go (the bench turns SIGTERM into the ^C path)."""
    import os
    import signal
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    before = _lab_netns()
    bench = subprocess.Popen(
        [sys.executable, str(root / "benchmarks" / "bench_wan.py"), "--quick", "--systems",
         "patchswarm", "--out", str(tmp_path / "wan.json")],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        assert bench.stdout is not None
        line = bench.stdout.readline()  # "run 1/1 patchswarm: delay ok ..." once the lab is up
        assert "delay ok" in line, line
        time.sleep(3)
        ours = _lab_netns() - before
        assert ours
        group = subprocess.run(["ps", "-o", "pid=", "-g", str(bench.pid)], capture_output=True,
                               text=True).stdout.split()
        os.kill(bench.pid, signal.SIGTERM)
        out = bench.communicate(timeout=120)[0]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    assert bench.returncode == 130, out[-2000:]
    assert not (_lab_netns() & ours)
    assert not any(_alive(int(p)) for p in group if int(p) != bench.pid)
    assert not (tmp_path / "wan.json").exists()


def test_a_lossy_lab_drops_its_share_of_segments_and_tcp_still_delivers():
    """``NetLab(loss=)``: the core's holder drops each segment with that probability (it
    asks the kernel for segments, not GSO super-packets); TCP retransmits, every byte
    arrives."""
    lab = NetLab(1, 1, uplink_mbit=50, delay_ms=5, loss=0.02)
    with lab:
        assert _send_from_trainer(lab, 0, 0, 3_000_000, timeout=120) == 3_000_000
    final = lab.holders[0]["final"]
    assert final["loss"] == 0.02 and final["packets"] > 2000  # segments, not super-packets
    share = final["dropped_lost"] / final["packets"]
    assert 0.01 <= share <= 0.035, final
