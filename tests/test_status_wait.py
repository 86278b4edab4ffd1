"""``GET /status?wait_active=N``: a request that blocks until the node serves version N
(``node.active_wait``): the query's checks, the waiters' rules (Hypothesis against a
model), one real node on this loop (bad input, the token, time-outs, the cap, draining),
and a real fleet on loopback whose nodes answer a waiting request when a publish lands."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.fleet import LoopbackFleet
from node.active_wait import (
    MAX_WAIT_S,
    ActiveWaiters,
    TooManyWaiters,
    parse_wait,
    reached,
)
from node.config import parse_config
from swarm.protocol.wire import MAX_VERSION
from tests.test_node_guard import _config, _free_port, _running

# ---------------------------------------------------------------- the query


def test_the_query_is_read_or_refused_naming_the_parameter() -> None:
    assert parse_wait({}) is None
    assert parse_wait({"other": "x"}) is None
    assert parse_wait({"wait_active": "3"}) == (3, 30.0)
    assert parse_wait({"wait_active": "0", "timeout_s": "0.25"}) == (0, 0.25)
    assert parse_wait({"wait_active": str(MAX_VERSION), "timeout_s": "300"}) == (MAX_VERSION, 300.0)
    bad = [({"timeout_s": "5"}, "timeout_s: only with wait_active"),
           ({"wait_active": "x"}, "wait_active: a version number"),
           ({"wait_active": "1.5"}, "wait_active: a version number"),
           ({"wait_active": "-1"}, "wait_active: must be in 0.."),
           ({"wait_active": str(MAX_VERSION + 1)}, "wait_active: must be in 0.."),
           ({"wait_active": "1", "timeout_s": "soon"}, "timeout_s: seconds"),
           ({"wait_active": "1", "timeout_s": "0"}, "timeout_s: must be over 0"),
           ({"wait_active": "1", "timeout_s": "-3"}, "timeout_s: must be over 0"),
           ({"wait_active": "1", "timeout_s": "nan"}, "timeout_s: must be over 0"),
           ({"wait_active": "1", "timeout_s": "inf"}, "timeout_s: must be over 0"),
           ({"wait_active": "1", "timeout_s": str(MAX_WAIT_S + 1)}, "timeout_s: must be over 0")]
    for query, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_wait(query)


@given(st.dictionaries(st.sampled_from(["wait_active", "timeout_s", "x"]), st.text(max_size=30)))
def test_any_query_gives_a_wait_none_or_a_named_refusal(query: dict[str, str]) -> None:
    try:
        got = parse_wait(query)
    except ValueError as exc:
        assert str(exc).split(":")[0] in ("wait_active", "timeout_s"), exc
        assert len(str(exc)) < 200  # a long parameter is not echoed whole
        return
    if got is not None:
        version, timeout = got
        assert 0 <= version <= MAX_VERSION and 0 < timeout <= MAX_WAIT_S


# ---------------------------------------------------------------- the waiters


def test_waiters_wake_at_their_version_or_later_and_time_out_otherwise() -> None:
    async def scenario() -> None:
        w = ActiveWaiters()
        w.changed(0)
        assert await w.wait(0, 0.01)  # served already: no wait
        t2 = asyncio.ensure_future(w.wait(2, 5))
        t3 = asyncio.ensure_future(w.wait(3, 5))
        late = asyncio.ensure_future(w.wait(9, 0.05))
        await asyncio.sleep(0.01)
        assert len(w) == 3
        w.changed(1)
        await asyncio.sleep(0)
        assert not t2.done() and not t3.done()
        w.changed(3)  # 2 is skipped over: "or later" wakes it too
        assert await t2 and await t3
        assert await late is False  # its time ran out
        assert len(w) == 0 and w.woken == 2
        w.changed(None)  # nothing active (a node that lost its version): nobody reached
        assert not reached(None, 0) and await w.wait(0, 0.01) is False

    asyncio.run(scenario())


def test_the_cap_a_cancelled_request_and_draining() -> None:
    async def scenario() -> None:
        w = ActiveWaiters(limit=2)
        w.changed(0)
        a = asyncio.ensure_future(w.wait(1, 60))
        b = asyncio.ensure_future(w.wait(1, 60))
        await asyncio.sleep(0)
        with pytest.raises(TooManyWaiters):
            await w.wait(1, 60)
        assert await w.wait(0, 60)  # one already served never counts against the cap
        a.cancel()  # the client went away: its place is free once its handler ends
        with pytest.raises(asyncio.CancelledError):
            await a
        assert len(w) == 1
        c = asyncio.ensure_future(w.wait(1, 60))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        w.release_all()
        assert await b is False and await c is False
        assert time.monotonic() - t0 < 1 and len(w) == 0

    asyncio.run(scenario())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("wait"), st.integers(0, 6)),
                          st.tuples(st.just("set"), st.one_of(st.none(), st.integers(0, 6)))),
                max_size=25))
def test_a_waiter_is_woken_iff_the_active_version_reached_it_after_it_came(ops) -> None:
    """Model: a request for v answers True iff the active version was v or later when it
    came, or became so while it waited; the rest answer False when the node drains."""
    async def scenario() -> list[bool]:
        w = ActiveWaiters()
        w.changed(0)
        futs = []
        for op, arg in ops:
            if op == "wait":
                futs.append(asyncio.ensure_future(w.wait(arg, 600)))
            else:
                w.changed(arg)
            await asyncio.sleep(0)
        w.release_all()
        got = list(await asyncio.gather(*futs))
        assert len(w) == 0
        return got

    active: int | None = 0
    model: list[bool] = []
    waiting: list[tuple[int, int]] = []  # (index in model, version)
    for op, arg in ops:
        if op == "wait":
            model.append(reached(active, arg))
            if not model[-1]:
                waiting.append((len(model) - 1, arg))
        else:
            active = arg
            for i, v in waiting:
                model[i] = model[i] or reached(active, v)
    assert asyncio.run(scenario()) == model


# ---------------------------------------------------------------- one real node


def _get(url: str, token: str | None = None, timeout: float = 10) -> tuple[int, dict | str]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_real_node_answers_waits_refuses_bad_ones_and_lets_go_when_it_drains(
        tmp_path: Path) -> None:
    port, api_port = _free_port(), _free_port()
    doc = _config(tmp_path, port, api_port)
    token = "s3cret-token-0123456789"
    (tmp_path / "api.token").write_text(token + "\n")
    doc["api"]["token_file"] = "api.token"
    cfg = parse_config(doc, tmp_path)
    base = f"http://127.0.0.1:{api_port}/status"

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def call(query: str, tok: str | None = token, timeout: float = 10):
            return loop.run_in_executor(None, lambda: _get(base + query, tok, timeout))

        async with _running(cfg) as node:
            code, body = await call("")
            cur = body["active_version"]  # the base checkpoint's
            code, body = await call(f"?wait_active={cur}&timeout_s=5")
            assert code == 200 and body["active_version"] == cur, body
            assert "wait" not in (await call(""))[1]
            assert body["wait"]["reached"] is True and body["wait"]["waited_s"] < 1
            # no token: refused before any wait
            t0 = time.monotonic()
            code, _ = await call("?wait_active=7&timeout_s=60", tok=None)
            assert code == 401 and time.monotonic() - t0 < 5
            for query, name in (("?wait_active=seven", "wait_active"),
                                ("?wait_active=1&timeout_s=900", "timeout_s"),
                                ("?timeout_s=1", "timeout_s")):
                code, text = await call(query)
                assert code == 400 and str(text).startswith(name), (query, text)
            code, body = await call(f"?wait_active={cur + 1}&timeout_s=0.3")
            assert code == 200 and body["wait"] == {"version": cur + 1, "reached": False,
                                                    "waited_s": body["wait"]["waited_s"]}
            assert 0.25 <= body["wait"]["waited_s"] < 5
            # the cap: more waiting requests than it allows get 503 with Retry-After
            node.driver.active_waiters.limit = 1
            first = call(f"?wait_active={cur + 1}&timeout_s=60", timeout=90)
            for _ in range(100):
                if len(node.driver.active_waiters):
                    break
                await asyncio.sleep(0.05)
            code, text = await call(f"?wait_active={cur + 1}&timeout_s=60")
            assert code == 503 and "wait already" in str(text), text
            t0 = time.monotonic()
        # leaving ``_running`` drains the node: the waiting request answers at once
        code, body = await first
        assert code == 200 and body["wait"]["reached"] is False, body
        assert time.monotonic() - t0 < 20

    asyncio.run(scenario())


# ---------------------------------------------------------------- a real fleet


def test_waiting_requests_answer_when_a_published_version_lands() -> None:
    with LoopbackFleet(1, 2, chunk_size=32 * 1024) as fleet:
        fleet.start(timeout=120)
        nxt = max(st["active_version"] for st in fleet.wait_version(
            fleet.status(fleet.nodes[0])["active_version"], timeout=60).values()) + 1
        answers: dict[str, tuple[float, dict]] = {}

        def wait(n) -> None:
            code, body = _get(f"http://{n.api_addr}/status?wait_active={nxt}&timeout_s=120",
                              timeout=150)
            answers[n.name] = (time.monotonic(), body if code == 200 else {"code": code})

        threads = [threading.Thread(target=wait, args=(n,)) for n in fleet.nodes]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert not answers  # nothing to answer yet: they wait
        pub = fleet.publish()
        assert pub["version"] == nxt
        for t in threads:
            t.join(150)
        assert set(answers) == {n.name for n in fleet.nodes}
        for _, body in answers.values():
            assert body["wait"]["reached"] is True, body
            assert body["active_version"] >= nxt and body["active_digest"] == pub["digest"]
            assert body["wait"]["waited_s"] >= 0.4
