"""``[network] congestion_control`` that the kernel refuses: real node processes on
loopback log one warning naming the reason, keep the system's algorithm, say so in
``/status``, and move versions as before (a local setting is never a reason to fail)."""

from __future__ import annotations

from lab.fleet import LoopbackFleet
from node.tcp import keeps_window_across_idle, slow_start_after_idle


def test_a_refused_congestion_control_is_reported_and_nothing_else_changes() -> None:
    with LoopbackFleet(1, 2, chunk_size=32 * 1024,
                       network={"congestion_control": "nosuchcc"}) as fleet:
        fleet.start(timeout=120)
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        for st in statuses.values():
            tr = st["transport"]
            assert tr["congestion_refused"], tr  # the kernel's reason
            assert tr["congestion_control"] not in (None, "nosuchcc"), tr  # the system's
        logs = [n.log.read_text(errors="replace") for n in fleet.nodes]
        for text in logs:
            assert text.count("congestion control 'nosuchcc' refused") == 1, text[-2000:]


def test_a_loss_based_congestion_control_reports_the_restart_after_idle() -> None:
    """CUBIC on the peer links: ``/status`` says whether Linux restarts an idle link's
    window (this namespace's ``net.ipv4.tcp_slow_start_after_idle``), and where it does
    each node says so once in its log; with BBR, which Linux exempts, it is None."""
    ssai = slow_start_after_idle()
    with LoopbackFleet(1, 2, chunk_size=32 * 1024,
                       network={"congestion_control": "cubic"}) as fleet:
        fleet.start(timeout=120)
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        for st in statuses.values():
            tr = st["transport"]
            assert tr["congestion_control"] == "cubic" and not tr["congestion_refused"], tr
            assert tr["slow_start_after_idle"] is ssai, tr
            assert tr["congestion_restarts"] == 0, tr  # BBR's start-up only: not for CUBIC
        for n in fleet.nodes:
            text = n.log.read_text(errors="replace")
            assert text.count("tcp_slow_start_after_idle=1") == (1 if ssai else 0), text[-2000:]


def test_the_restart_after_idle_is_read_from_the_namespace(tmp_path) -> None:
    f = tmp_path / "ssai"
    for text, want in (("1\n", True), ("0\n", False), ("2\n", None), ("\xff", None), ("", None)):
        f.write_text(text, encoding="latin-1")
        assert slow_start_after_idle(str(f)) is want, text
    assert slow_start_after_idle(str(tmp_path / "missing")) is None
    assert keeps_window_across_idle("bbr") and not keeps_window_across_idle("cubic")
