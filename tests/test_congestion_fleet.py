"""``[network] congestion_control`` that the kernel refuses: real node processes on
loopback log one warning naming the reason, keep the system's algorithm, say so in
``/status``, and move versions as before (a local setting is never a reason to fail)."""

from __future__ import annotations

from lab.fleet import LoopbackFleet


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
