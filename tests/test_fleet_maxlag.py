"""Bounded staleness and the fleet view with real node processes (issue #12).

The trainer's ``Publisher`` runs in this process with ``[publish] max_lag = 1``;
two nodes run as ``patchswarm node`` processes on loopback and report their
versions to the origin. A node frozen with SIGSTOP (its engine does not move)
keeps the next publish blocked; the ``StalenessTimeout`` names it; a
``publish_async`` handle completes once it is thawed and catches up. The origin's
``/fleet``, its fleet metrics and ``patchswarm fleet`` show the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lab.fleet import LoopbackFleet, until
from node.config import load_config
from trainer.fleet import StalenessTimeout
from trainer.publisher import Publisher
from trainer.served import served_view


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"enc.weight": torch.randn(128, 128, generator=g),
            "enc.bias": torch.randn(128, generator=g)}


def step(m: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 5e-3 * torch.randn(v.shape, generator=g) for k, v in m.items()}


def test_max_lag_blocks_names_the_laggard_and_releases() -> None:
    m = masters(0)
    with LoopbackFleet(1, 2, chunk_size=8 * 1024,
                       swarm={"redial_s": 1.0, "status_interval_s": 2.0},
                       trainer_sections={"publish": {"max_lag": 1, "max_lag_timeout_s": 6}}
                       ) as fleet:
        fleet.start_nodes_only(served_view(m, "bf16"))
        fast, slow = fleet.nodes
        pub = Publisher(load_config(fleet.workdir / "trainer.toml"))
        pub.start()
        try:
            for k, v in enumerate((2, 3, 4)):  # v waits for v-1 everywhere: all current
                m = step(m, k + 1)
                assert pub.publish(m).version == v
            fleet.wait_version(4, timeout=60)
            view = pub.wait(4, timeout=30)  # every node reported version 4
            assert view.regions() == {"region-0": {4: 2}}
            _check_fleet_api(fleet, latest=4)

            os.kill(slow.proc.pid, signal.SIGSTOP)  # frozen: applies and reports nothing
            try:
                m = step(m, 10)
                assert pub.publish(m).version == 5  # needs 4: both serve it
                until("the fast node at 5", lambda: (fleet.status(fast) or {}).get(
                    "active_version") == 5, timeout=30)
                m = step(m, 11)
                t0 = time.monotonic()
                with pytest.raises(StalenessTimeout) as err:
                    pub.publish(m)  # needs 5: the frozen node serves 4
                assert time.monotonic() - t0 >= 5.5
                msg = str(err.value)
                assert "version 5: 50% of 2 node(s)" in msg, msg
                assert "n0-1 (region-0) serves v4" in msg, msg
                assert [lg.node_id for lg in err.value.laggards] == ["n0-1"]
                assert pub.version == 5 and pub.store.versions()[-1] == 5  # nothing published
                handle = pub.publish_async(m)
                assert handle.version == 6
                time.sleep(2.0)
                assert not handle.done()
            finally:
                os.kill(slow.proc.pid, signal.SIGCONT)
            r = handle.result(timeout=60)  # the thawed node catches up to 5: released
            assert r.version == 6 and r.lag_wait_s > 1.0
            fleet.wait_version(6, timeout=60)
            pub.wait(6, timeout=30)
            _check_fleet_api(fleet, latest=6)

            def timed() -> dict | None:  # sampled every 0.5 s by the origin
                doc = json.loads(fleet.http(fleet.trainer_api_addr, "/fleet"))
                return doc["publish_to_active_s"] if "6" in doc["publish_to_active_s"] else None

            times = until("publish-to-active times of version 6", timed, timeout=10)
            assert 0 <= times["6"]["p50"] <= times["6"]["p100"] < 30
        finally:
            pub.close()


def _check_fleet_api(fleet: LoopbackFleet, latest: int) -> dict:
    """/fleet, the fleet metrics and ``patchswarm fleet`` agree with the nodes."""
    def current() -> dict | None:
        doc = json.loads(fleet.http(fleet.trainer_api_addr, "/fleet") or b"null")
        ok = doc and all(e["active"] == latest for e in doc["entries"]) and doc["nodes"] == 2
        return doc if ok else None

    doc = until(f"/fleet at version {latest}", current, timeout=30)
    assert doc["latest"] == latest and {e["node_id"] for e in doc["entries"]} == {"n0-0", "n0-1"}
    metrics = fleet.http(fleet.trainer_api_addr, "/metrics").decode()
    assert f'patchswarm_fleet_nodes_serving{{region="region-0",version="{latest}"}} 2.0' in metrics
    assert 'patchswarm_fleet_lag_versions_bucket{le="0"} 2.0' in metrics
    assert fleet.http(fleet.nodes[0].api_addr, "/fleet") is None  # 404: only the origin has it
    cmd = [sys.executable, "-m", "patchswarm", "fleet", "--api", fleet.trainer_api_addr, "--once"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "region-0" in out and f"v{latest}" in out and "100% serve the latest" in out, out
    out = subprocess.run([*cmd[:4], "--config", str(fleet.workdir / "trainer.toml"), "--json",
                          "--once"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out)["latest"] == latest
    return doc
