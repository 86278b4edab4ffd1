"""The ban table is bounded and expires (issue #10, attack 4: it never shrank)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol.bans import BanList


def test_ban_expires_and_strikes_reset():
    b = BanList(ban_s=10.0)
    assert b.strike("x", 0.0) == 1 and b.strike("x", 1.0) == 2
    assert b.ban("x", 1.0) and not b.ban("x", 2.0)  # second ban only extends
    assert b.banned("x", 11.9) and not b.banned("x", 12.1)
    assert b.strike("x", 12.2) == 1  # the slate was wiped with the ban
    assert b.strike("y", 0.0) == 1 and b.strike("y", 20.0) == 1  # stale strikes forgotten


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=8), max_size=400), st.integers(1, 64))
def test_tables_stay_bounded(ids, limit):
    b = BanList(ban_s=1e9, max_ids=limit)
    for i, node in enumerate(ids):
        b.strike(node, float(i))
        b.ban(node, float(i))
        assert len(b._strikes) <= limit and len(b) <= limit
    if ids:
        assert b.banned(ids[-1], float(len(ids)))  # the newest survives eviction
