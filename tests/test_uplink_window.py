"""``swarm.protocol.uplink.UplinkWindow`` against modelled uplinks: a pipe of capacity C
chunks/s and round trip R, where k chunks in flight each take k/C + R (fair sharing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol.uplink import UplinkWindow


def drive(win: UplinkWindow, capacity: float, rtt: float, deliveries: int,
          app_limited_every: int = 0) -> list[int]:
    """Keep the window full on a modelled pipe; return the window after each delivery."""
    now, seen = 0.0, []
    for k in range(deliveries):
        w = win.w
        per_chunk = max(w / capacity + rtt, 1e-6)
        now += per_chunk / w  # deliveries of a full window come this far apart
        full = not (app_limited_every and k % app_limited_every == 0)
        win.delivered(1, now, full)
        seen.append(win.w)
    return seen


def test_a_thin_uplink_keeps_few_chunks_in_flight() -> None:
    # 100 Mbit/s, 4 MiB chunks: 3 chunks/s; 80 ms round trip: one chunk is the whole BDP
    win = UplinkWindow(2, 256)
    seen = drive(win, capacity=3.0, rtt=0.08, deliveries=200)
    assert max(seen[-100:]) <= 4, seen[-20:]


def test_a_fat_uplink_grows_the_window() -> None:
    # 10 Gbit/s, 4 MiB chunks: 300 chunks/s; 150 ms round trip: BDP ~45 chunks
    win = UplinkWindow(2, 256)
    seen = drive(win, capacity=300.0, rtt=0.15, deliveries=600)
    assert seen[-1] >= 32, seen[-20:]


def test_deliveries_while_not_full_do_not_move_the_window() -> None:
    win = UplinkWindow(2, 256)
    for k in range(100):
        win.delivered(1, k * 0.1, full=False)
    assert win.w == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        UplinkWindow(0, 4)
    with pytest.raises(ValueError):
        UplinkWindow(5, 4)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 8), span=st.integers(0, 64),
       events=st.lists(st.tuples(st.floats(0.0, 5.0), st.booleans(), st.integers(1, 4)),
                       max_size=300))
def test_window_stays_within_its_bounds(lo: int, span: int,
                                        events: list[tuple[float, bool, int]]) -> None:
    win = UplinkWindow(lo, lo + span)
    now = 0.0
    for dt, full, n in events:
        now += dt  # time never goes back; equal instants are allowed
        win.delivered(n, now, full)
        assert lo <= win.w <= lo + span
        assert lo <= win.best_w <= lo + span


def test_raised_floor_lifts_the_window_and_holds_it() -> None:
    win = UplinkWindow(2, 16)
    win.raise_floor(5)
    assert win.w == 5 and win.lo == 5
    drive(win, capacity=3.0, rtt=0.08, deliveries=200)  # a thin uplink would settle lower
    assert win.w >= 5
    win.raise_floor(100)  # never above the most
    assert win.w == 16 and win.lo == 16


def drive_lagged(win: UplinkWindow, capacity: float, per_push: float, rtt: float,
                 deliveries: int) -> list[int]:
    """Pushes counted until sent, confirmed a round trip later, as the origin runs them:
    ``w`` pushes leave at once, each at ``min(per_push, capacity / w)`` chunks/s (a
    border's downlink caps one push; the uplink caps them all); the slot of a push
    frees when it has left, and its HAVE (``delivered``, with its start) comes
    ``rtt`` later. Returns the window after each delivery."""
    import heapq

    now = 0.0
    events: list[tuple[float, int, float]] = []  # (time, kind 0 sent / 1 have, started)
    busy = 0
    seen: list[int] = []

    def fill() -> None:
        nonlocal busy
        while busy < win.w:
            busy += 1
            took = 1.0 / min(per_push, capacity / win.w)
            heapq.heappush(events, (now + took, 0, now))

    fill()
    while len(seen) < deliveries:
        now, kind, started = heapq.heappop(events)
        if kind == 0:
            busy -= 1
            heapq.heappush(events, (now + rtt, 1, started))
        else:
            win.delivered(1, now, busy >= win.w, started, now - rtt)
            seen.append(win.w)
        fill()
    return seen


def test_a_doubling_is_judged_by_transfers_sent_after_it() -> None:
    # 10 Gbit/s out, each push capped at 1 Gbit/s by its border's downlink (30 chunks/s),
    # 120 ms to the HAVE: right after a doubling the next HAVEs are still the smaller
    # window's. Judged by them, start-up stopped at its first step (the old rule
    # settled at 5-7 here).
    win = UplinkWindow(5, 256)
    seen = drive_lagged(win, capacity=300.0, per_push=30.0, rtt=0.12, deliveries=400)
    # it settles at the pipe's 10 (300 / 30) and probes one less now and then
    assert sorted(seen[-100:])[50] >= 10 and min(seen[-100:]) >= 9, seen[-20:]


def drive_rates(win: UplinkWindow, rate_of: dict[int, float], deliveries: int) -> list[int]:
    """Deliveries of a full window at ``rate_of[w]`` chunks/s (the nearest window below)."""
    now, seen = 0.0, []
    for _ in range(deliveries):
        w = win.w
        rate = rate_of[max(k for k in rate_of if k <= w)]
        now += 1.0 / rate
        win.delivered(1, now, True)
        seen.append(win.w)
    return seen


def test_start_up_goes_on_through_one_round_that_did_not_pay() -> None:
    # The origin's pushes into a region stay on its warm connection: doubling 3 -> 6 put
    # two pushes on each border's downlink and paid nothing; 12 spread over two borders
    # a region and doubled the rate. One round that does not pay does not end start-up
    # (BBR waits for three); two in a row do.
    win = UplinkWindow(3, 256)
    seen = drive_rates(win, {3: 90.0, 6: 90.0, 12: 250.0, 24: 250.0}, deliveries=120)
    assert 12 in seen and not win.startup
    assert win.best_w == 12 and win.w in (11, 12, 13), seen[-20:]


def test_start_up_ends_after_two_rounds_that_did_not_pay() -> None:
    # a thin uplink: no window beats the first; start-up ends after 4 and 8, back at 2
    win = UplinkWindow(2, 256)
    seen = drive_rates(win, {2: 12.0}, deliveries=40)
    assert max(seen) == 8 and not win.startup
    assert seen[-1] <= 3 and win.best_w == 2, seen


def test_lagged_haves_on_a_thin_uplink_keep_the_window_small() -> None:
    # 100 Mbit/s out (3 chunks/s), nothing else caps a push, 80 ms to the HAVE
    win = UplinkWindow(2, 256)
    seen = drive_lagged(win, capacity=3.0, per_push=1000.0, rtt=0.08, deliveries=200)
    assert max(seen[-100:]) <= 4, seen[-20:]


def test_start_up_does_not_double_a_window_it_cannot_fill() -> None:
    # A fat uplink whose rate doubles with the window, but a version's last round closes
    # with fewer chunks left to cross than the window holds: doubling then would leave a
    # probe nobody carried, and the next version would start with it (the simulator's
    # wan-3x4: a second version 8.07 s against 7.58 for the first).
    win = UplinkWindow(2, 256)
    now = 0.0
    for w, backlog in ((2, 100), (4, 100), (8, 3)):
        assert win.w == w
        win.delivered(1, now, True, backlog=backlog)  # the round starts
        for _ in range(w):
            now += 1.0 / (10.0 * w)  # the rate grows with the window
            win.delivered(1, now, True, backlog=backlog)
    assert win.startup and win.w == 8 and win.best_w == 8
    # with a backlog to fill, the same round doubles
    win.delivered(1, now, True, backlog=8)
    for _ in range(8):
        now += 1.0 / 160.0
        win.delivered(1, now, True, backlog=8)
    assert win.w == 16


def test_no_probe_after_a_flat_round_that_the_version_cannot_time() -> None:
    # The emulated WAN (round 40): a second version's round at 4 did not pay, start-up
    # doubled once more with 8 chunks left to cross, and the version's last pushes went
    # 8 at once through the 100 Mbit/s uplink; the round at 8 was never whole and the
    # restart took it back. A probe needs a round's transfers after it: more than 2 x w.
    def run(backlog: int) -> UplinkWindow:
        win = UplinkWindow(2, 256)
        now = 0.0
        for w, rate in ((2, 10.0), (4, 10.0)):  # 2 pays (the first round), 4 does not
            assert win.w == w
            win.delivered(1, now, True, backlog=100 if w == 2 else backlog)  # round starts
            for _ in range(w):
                now += 1.0 / rate
                win.delivered(1, now, True, backlog=100 if w == 2 else backlog)
        return win

    short = run(backlog=8)
    assert short.startup and short.flat == 1 and short.w == 4, (short.w, short.flat)
    long = run(backlog=9)
    assert long.startup and long.flat == 1 and long.w == 8
    # the round after the one not taken ends the start-up at the best window, as before
    now = 10.0
    short.delivered(1, now, True, backlog=3)
    for _ in range(4):
        now += 0.1
        short.delivered(1, now, True, backlog=3)
    assert not short.startup and short.w == short.best_w == 2
    # a round that paid still doubles into a backlog the doubled window can fill (the
    # next version times it: ``restart`` keeps a start-up whose rounds all paid)
    paid = UplinkWindow(2, 256)
    now = 0.0
    for w, rate in ((2, 10.0), (4, 20.0)):
        paid.delivered(1, now, True, backlog=5)
        for _ in range(w):
            now += 1.0 / rate
            paid.delivered(1, now, True, backlog=5)
    assert paid.w == 8 and paid.flat == 0


def test_a_round_does_not_time_the_gap_between_versions() -> None:
    # A round is under way when a version's pushes run out; the next version comes 30 s
    # later. Timed across the gap, the round measured an idle uplink as a slow one and
    # ended start-up; restarted at the publish, it measures the new version's transfers.
    def run(restart: bool) -> UplinkWindow:
        win = UplinkWindow(2, 256)
        now = 0.0
        win.delivered(1, now, True)
        for _ in range(2):
            now += 0.05
            win.delivered(1, now, True)
        assert win.w == 4 and win.startup
        for _ in range(2):  # the last of the version, sent under the new window
            now += 0.05
            win.delivered(1, now, True, started=now - 0.01, sent=now - 0.005)
        now += 30.0
        if restart:
            win.restart(now)
        for _ in range(5):  # the next version: twice the rate at twice the window
            now += 0.025
            win.delivered(1, now, True, started=now - 0.01, sent=now - 0.005)
        return win

    fresh = run(restart=True)
    assert fresh.w == 8 and fresh.flat == 0 and fresh.best == pytest.approx(40.0)
    gapped = run(restart=False)  # what the gap did before: a round that "did not pay"
    assert gapped.flat == 1 and gapped.best == pytest.approx(20.0)


def test_a_start_up_that_saw_a_round_not_pay_ends_between_versions() -> None:
    # A thin uplink: 2 -> 4 did not pay and start-up doubled again to 8, but the version
    # ran out before a round at 8 was whole. Windows that large are never filled for a
    # whole round on the next versions either (the emulated WAN kept 8 for every later
    # version, ~1 s each): the next version starts at the best window measured.
    win = UplinkWindow(2, 256)
    seen = drive_rates(win, {2: 3.0}, deliveries=8)
    assert win.startup and win.w == 8 and win.flat == 1 and win.best_w == 2, seen
    win.restart(100.0)
    assert not win.startup and win.w == 2
    # a start-up whose last round paid (a fat uplink, still growing) goes on
    fat = UplinkWindow(2, 256)
    drive_rates(fat, {2: 10.0, 4: 20.0, 8: 40.0}, deliveries=8)
    assert fat.startup and fat.flat == 0 and fat.w == 8
    fat.restart(100.0)
    assert fat.startup and fat.w == 8


# ------------------------------------------------ start-up on departures (``left``)


def drive_departures(win: UplinkWindow, leave_s: dict[int, float] | Callable[[int], float],
                     waves: int, backlog: int = 1000, fast_s: float = 0.2) -> list[int]:
    """Waves of a full window of pushes issued together; each leaves ``leave_s(w)`` after
    it was issued (or ``leave_s[k]`` of the nearest window ``k`` below). No HAVE comes
    back: only departures move the window. Returns the window after each wave."""
    if not callable(leave_s):
        table = leave_s
        leave_s = lambda w: table[max(k for k in table if k <= w)]  # noqa: E731
    now, seen = 0.0, []
    for _ in range(waves):
        w = win.w
        issued = now
        now += leave_s(w)
        for _ in range(w):
            win.left(now, issued, fast_s, True, backlog, issued)
        seen.append(win.w)
    return seen


def test_a_fat_uplink_opens_on_departures_before_any_have() -> None:
    # 10 Gbit/s out, each push capped at 1 Gbit/s by its border (4 MiB in 34 ms): the
    # uplink is full at 10 in flight, and past that a wave of w pushes takes w x 3.4 ms to
    # leave. HAVEs are a round trip away (fleet-10k: ~0.15 s); departures say the same
    # 34 ms after the pushes start.
    win = UplinkWindow(5, 256)
    seen = drive_departures(win, lambda w: max(0.034, 0.0034 * w), waves=12)
    # each departure of a full window opens it by one: a wave doubles it as it leaves
    assert seen[:2] == [10, 20], seen
    # pushes that take fast_startup_s to leave (59 or more in flight here) end it
    assert not win.on_departures and max(seen) <= 80, seen
    assert win.startup  # the HAVE rounds still run the start-up


def test_departure_rounds_that_do_not_pay_end_the_start_up() -> None:
    # each push leaves 2 ms after the one before, however many are in flight, and 10 ms
    # after it was issued at least (500 pushes a second once 5 are in flight): the
    # rounds' departure rates stop growing, and two rounds that do not pay end it while
    # every push still leaves well within fast_startup_s
    win = UplinkWindow(2, 256)
    now, last, issued = 0.0, 0.0, [0.0] * 2
    while win.on_departures and now < 1.0:
        t = issued.pop(0)
        now = last = max(t + 0.01, last + 0.002)
        win.left(now, t, 0.2, True, 1000, issued[0] if issued else None)
        issued += [now] * (win.w - len(issued))
    assert not win.on_departures and win.dep_flat == 2
    assert now - issued[0] < 0.2  # not ended by a slow push
    assert 5 <= win.w < 100


def test_a_slow_push_ends_the_start_up_on_departures() -> None:
    win = UplinkWindow(2, 256)
    win.left(0.4, 0.0, 0.2, True, 1000, 0.0)  # 4 MiB in 0.4 s: a thin uplink
    assert not win.on_departures and win.w == 2
    drive_departures(win, {2: 0.01}, waves=10)  # fast ones later change nothing
    assert win.w == 2


def test_a_push_still_leaving_ends_it_too() -> None:
    # one region behind a slow direct link: its push is still leaving while the others'
    # come and go in 34 ms (slow-direct: without this, the window reached 12 while the
    # slow link's first push was under way and that link took two more, 3.05 s against 2.22)
    win = UplinkWindow(3, 256)
    win.left(0.034, 0.0, 0.2, True, 1000, 0.0)
    win.left(0.068, 0.034, 0.2, True, 1000, 0.0)
    assert win.on_departures
    win.left(0.21, 0.17, 0.2, True, 1000, 0.0)  # fast, but the oldest is 0.21 s old
    assert not win.on_departures


def test_every_departure_of_a_full_window_opens_it_by_one() -> None:
    win = UplinkWindow(2, 256)
    assert drive_departures(win, {2: 0.03}, waves=2) == [4, 8]
    for k in range(10):  # pushes issued before the last round closed count as well
        win.left(0.07 + 0.001 * k, 0.05, 0.2, True, 1000, 0.05)
    assert win.w == 18
    win.left(0.09, 0.08, 0.2, False, 1000, 0.08)  # the window was not full: nothing
    assert win.w == 18


@pytest.mark.parametrize("step", [1, 2, 3])
def test_each_departure_of_a_full_window_opens_it_by_its_step(step: int) -> None:
    win = UplinkWindow(2, 40, departure_step=step)
    seen = drive_departures(win, {2: 0.03}, waves=3)
    # a wave of w departures opens w x step places: the window grows (1 + step)-fold
    assert seen == [min(40, 2 * (1 + step) ** k) for k in (1, 2, 3)], seen
    win.left(0.2, 0.19, 0.2, False, 1000, 0.19)  # the window was not full: nothing
    assert win.w == seen[-1]


def test_start_up_on_departures_opens_only_a_window_it_can_fill() -> None:
    win = UplinkWindow(4, 256)
    drive_departures(win, {4: 0.03}, waves=3, backlog=3)
    assert win.w == 4 and win.on_departures


def test_not_full_departures_and_an_ended_start_up_do_not_move_it() -> None:
    win = UplinkWindow(2, 256)
    for k in range(20):
        win.left(0.01 * (k + 1), 0.01 * k, 0.2, False, 1000, 0.01 * k)
    assert win.w == 2
    done = UplinkWindow(2, 256)
    drive_rates(done, {2: 12.0}, deliveries=40)  # a thin uplink's start-up ended
    assert not done.startup and not done.on_departures
    w = done.w
    drive_departures(done, {1: 0.01}, waves=10)
    assert done.w == w


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 8), span=st.integers(0, 64), step=st.integers(1, 4),
       events=st.lists(st.tuples(st.sampled_from(("left", "delivered", "restart")),
                                 st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.booleans(),
                                 st.integers(0, 64)), max_size=300))
def test_departures_keep_the_window_within_its_bounds(
        lo: int, span: int, step: int,
        events: list[tuple[str, float, float, bool, int]]) -> None:
    win = UplinkWindow(lo, lo + span, departure_step=step)
    now = 0.0
    for kind, dt, age, full, backlog in events:
        now += dt
        if kind == "left":
            win.left(now, now - age, 0.2, full, backlog, now - 2 * age)
        elif kind == "delivered":
            win.delivered(1, now, full, backlog=backlog)
        else:
            win.restart(now)
        assert lo <= win.w <= lo + span
        assert lo <= win.best_w <= lo + span


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "fast", True])
def test_a_bad_fast_startup_s_is_refused_by_name(bad: object) -> None:
    from swarm.errors import ConfigError
    from swarm.protocol.config import CoreConfig, check_knobs

    with pytest.raises(ConfigError, match="fast_startup_s"):
        knobs = check_knobs({"fast_startup_s": bad}, "swarm")
        CoreConfig(node_id="o", region="r", model="m", listen_addr="127.0.0.1:1",
                   role="origin", **knobs)


@pytest.mark.parametrize("bad", [0, 65, 1.5, "two", True])
def test_a_bad_fast_startup_step_is_refused_by_name(bad: object) -> None:
    from swarm.errors import ConfigError
    from swarm.protocol.config import CoreConfig, check_knobs

    with pytest.raises(ConfigError, match="fast_startup_step"):
        knobs = check_knobs({"fast_startup_step": bad}, "swarm")
        CoreConfig(node_id="o", region="r", model="m", listen_addr="127.0.0.1:1",
                   role="origin", **knobs)
    with pytest.raises(ValueError, match="step"):
        UplinkWindow(2, 8, departure_step=0)
