"""``simulations.emulated``: the simulator's ``wan-3x4`` calibrated to a bench run."""

from __future__ import annotations

import pytest

from simulations.emulated import emulated_wan, predict

RUN = {"size_bytes": 64 << 20, "chunk_bytes": 4 << 20, "handoff_s": 0.3}


def test_the_run_s_cpu_and_hand_off_replace_the_file_s() -> None:
    sc = emulated_wan(**RUN, node_cpu_s_per_gb=12.0, apply_cpu_s_per_gb=2.0)
    assert sc is not None
    cpu = sc.regions[0].cpu
    assert cpu.apply_mb_s == pytest.approx(500.0)
    # per GB received: hash + io + per-chunk overhead + apply = what the nodes measured
    per_gb = 1e3 / cpu.hash_mb_s + 1e3 / cpu.io_mb_s + 2.0 \
        + cpu.chunk_overhead_ms / 1e3 * (1e9 / RUN["chunk_bytes"])
    assert per_gb == pytest.approx(12.0)
    assert sc.encode_s == 0.3 and sc.patch_bytes == RUN["size_bytes"]
    assert all(r.cpu == cpu for r in sc.regions)


def test_another_shape_or_an_impossible_measurement_is_not_fitted() -> None:
    assert emulated_wan(**RUN, node_cpu_s_per_gb=12.0, apply_cpu_s_per_gb=2.0, regions=4) is None
    assert emulated_wan(**RUN, node_cpu_s_per_gb=12.0, apply_cpu_s_per_gb=2.0,
                        uplink_mbit=50.0) is None
    assert emulated_wan(**RUN, node_cpu_s_per_gb=12.0, apply_cpu_s_per_gb=2.0, loss=0.7) is None
    assert emulated_wan(**RUN, node_cpu_s_per_gb=1.0, apply_cpu_s_per_gb=2.0) is None


def test_a_slower_machine_predicts_a_slower_fanout() -> None:
    fast = predict(emulated_wan(**RUN, node_cpu_s_per_gb=8.0, apply_cpu_s_per_gb=1.0))
    slow = predict(emulated_wan(**RUN, node_cpu_s_per_gb=16.0, apply_cpu_s_per_gb=8.0))
    assert fast["bound_s"] <= fast["held_s"] <= fast["serving_s"]
    assert slow["serving_s"] > fast["serving_s"]


def test_the_bench_s_delay_and_loss_are_the_links_and_a_lossy_long_wan_is_slower() -> None:
    """``--delay-ms 75 --loss 0.001`` (round 22's long lossy WAN): every inter-region
    link of the file takes them, and the prediction is slower than the clean 40 ms one
    (longer slow start, frames held by retransmission timeouts)."""
    small = {**RUN, "size_bytes": 16 << 20, "node_cpu_s_per_gb": 8.0, "apply_cpu_s_per_gb": 1.0}
    lossy = emulated_wan(**small, delay_ms=75.0, loss=0.001)
    clean = emulated_wan(**small)
    assert lossy is not None and clean is not None
    assert {(x.latency_ms, x.loss) for x in lossy.links.values()} == {(75.0, 0.001)}
    assert {(x.latency_ms, x.loss) for x in clean.links.values()} == {(40.0, 0.0)}
    assert lossy.regions == clean.regions  # the machine's calibration does not move
    assert predict(lossy)["serving_s"] > predict(clean)["serving_s"]
