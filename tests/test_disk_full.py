"""A node whose store fills up (a real tmpfs, real processes): the fault stays local
(issue #10, fault 1). Nobody is banned or blamed, /healthz says what is wrong, the
node backs off instead of re-downloading in a loop, and it catches up once there is
room again."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from lab.fleet import LoopbackFleet

_healthz = LoopbackFleet.healthz


def test_full_disk_is_local_and_recovers() -> None:
    fleet = LoopbackFleet(1, 3, chunk_size=32 * 1024)
    victim = fleet.nodes[2]
    store = fleet.workdir / f"{victim.name}-store"
    store.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(store)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fleet.close()
        pytest.skip(f"needs root to mount a tmpfs: {r.stderr.strip()}")
    try:
        with fleet:
            fleet.start(timeout=120)
            pub = fleet.publish()  # ~500 kB of patch: does not fit in 96 KiB
            others = [n for n in fleet.nodes if n is not victim]
            fleet.wait_version(pub["version"], timeout=60, nodes=others)
            deadline = time.monotonic() + 30
            code, text = _healthz(victim.api_addr)
            while code != 503 and time.monotonic() < deadline:
                time.sleep(0.2)
                code, text = _healthz(victim.api_addr)
            assert code == 503 and "store: cannot keep chunks" in text, (code, text)
            st = fleet.status(victim)
            assert st["transport"]["local_faults"] >= 1
            statuses = {n.name: fleet.status(n) for n in fleet.nodes}
            assert all(s["bad_chunks"] == 0 for s in statuses.values())
            # nobody was banned: the victim still has its region peers and the trainer
            assert {"n0-0", "n0-1"} <= {p["id"] for p in statuses[victim.name]["peers"]}
            assert all(victim.name in {p["id"] for p in statuses[n.name]["peers"]}
                       for n in others)
            # the back-off holds requests back: far fewer faults than retries at line rate
            time.sleep(3)
            faults = fleet.status(victim)["transport"]["local_faults"]
            assert faults <= 12, faults
            subprocess.run(["mount", "-o", "remount,size=16m", str(store)], check=True)
            st = fleet.wait_version(pub["version"], timeout=90, nodes=[victim])[victim.name]
            assert st["active_digest"] == pub["digest"]
            deadline = time.monotonic() + 30
            while _healthz(victim.api_addr)[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _healthz(victim.api_addr)[0] == 200
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)
        # the fleet's own clean-up ran while the tmpfs was still mounted on the store, so
        # the mount point (and the work directory holding it) outlived it
        shutil.rmtree(fleet.workdir, ignore_errors=True)
