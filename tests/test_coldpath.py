"""``swarm.protocol.coldpath.ColdPath``: one region's first-push against warm-push figures,
checked against a plain model over any sequence of timings (Hypothesis)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from swarm.protocol.coldpath import WARM_PUSHES, ColdPath

times = st.floats(min_value=1e-4, max_value=1e3, allow_nan=False, allow_infinity=False)
steps = st.lists(st.tuples(st.booleans(), times), max_size=200)
factors = st.sampled_from([0.0, 1.5, 3.0, 10.0])


@given(steps, factors, st.integers(min_value=1, max_value=16))
def test_figures_follow_a_plain_model(seq: list[tuple[bool, float]], factor: float,
                                      border_inflight: int) -> None:
    cp = ColdPath()
    cold: float | None = None
    warm: list[float] = []
    slow = False
    for is_cold, dt in seq:
        if is_cold:
            cp.cold(dt)
            cold = dt if cold is None else 0.7 * cold + 0.3 * dt
        else:
            cp.warm(dt)
            warm.append(dt)
        w = min(warm[-WARM_PUSHES:]) if warm else None
        want = factor > 0 and cold is not None and w is not None and cold >= factor * w
        assert cp.judge(factor) == (want != slow)
        slow = want
        assert cp.slow == want
        assert cp.warm_s == w
        assert (cp.cold_s is None) == (cold is None)
        if cold is not None:
            assert math.isclose(cp.cold_s, cold, rel_tol=1e-9)
        d = cp.depth(border_inflight)
        # never under border_inflight, never over 4x; deeper only while the gate is open
        assert border_inflight <= d <= 4 * border_inflight
        if not want:
            assert d == border_inflight
        else:
            assert d == max(border_inflight, min(4 * border_inflight, int(cp.cold_s / cp.warm_s) - 1))


def test_the_gate_stays_shut_until_both_figures_exist() -> None:
    cp = ColdPath()
    assert not cp.judge(3.0) and not cp.slow and cp.depth(2) == 2
    cp.cold(1.2)
    assert not cp.judge(3.0) and not cp.slow
    cp.warm(0.1)
    assert cp.judge(3.0) and cp.slow and cp.depth(2) == 8  # 12x, capped at 4 x 2
    assert not cp.judge(3.0)  # unchanged: no second switch
    assert cp.judge(0.0) and not cp.slow  # 0 turns it off
