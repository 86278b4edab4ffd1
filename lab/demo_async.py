"""``patchswarm demo --async``: the RL loop on a loopback fleet (issue #12).

Real ``patchswarm node`` processes (``lab.fleet.LoopbackFleet``, mutual TLS by
default), each with a request gateway in front of the in-process engine over a
tiny random-init Llama (``lab.tiny_llama``). In this process:

- the trainer: AdamW steps on the FP32 masters, published on a schedule
  (``--interval``) through the real ``Publisher`` with ``[publish] max_lag``
  and ``anchor_every``; each publish records how long ``max_lag`` held it;
- a rollout client: one thread per node sending version-pinned ``/generate``
  requests through the gateways, alternately ``min_version`` and
  ``exact_version`` = the latest published version; it counts 409s (honouring
  ``Retry-After``; ``ahead`` re-pins at once) and records each sample's
  ``version_start`` / ``version_end`` stamps and its lag;
- a late joiner: one more node started with a fresh store after
  ``--join-after`` publishes; it reaches the fleet through the newest anchor,
  and its bytes received are compared with the whole chain of patches.

A sample's **lag** counts training steps: the state of the latest published
version when the answer completed minus the state of the version that started
producing it (an anchor carries the state of the patch before it: no step).
With ``max_lag = L`` no admitted sample lags more than L (a node can only
move on after the generation ends: ``pause_mode = "wait"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT_LEN = 6
NEW_TOKENS = 8


@dataclass
class Sample:
    """One answered request."""

    node: str
    pin: str  # "min_version" | "exact_version"
    target: int
    version_start: int
    version_end: int
    latest_at_completion: int
    at_s: float  # seconds since the demo's start
    lag: int = 0  # training steps (see the module docstring)


@dataclass
class ClientStats:
    """What the rollout client saw (shared by its threads; ``lock`` guards it)."""

    samples: list[Sample] = field(default_factory=list)
    conflicts: list[dict[str, Any]] = field(default_factory=list)  # one per 409
    other: dict[str, int] = field(default_factory=dict)  # other statuses / errors
    retry_after_s: float = 0.0  # seconds slept on Retry-After
    lock: threading.Lock = field(default_factory=threading.Lock)


def _post(url: str, body: dict[str, Any], timeout: float = 30.0
          ) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            doc = json.loads(exc.read())
        except ValueError:
            doc = None
        return exc.code, dict(exc.headers), doc


class RolloutClient:
    """One thread per node gateway; see the module docstring."""

    def __init__(self, latest: Callable[[], int], t0: float, vocab: int, gap_s: float = 0.1,
                 max_retry_s: float = 5.0) -> None:
        self.latest = latest  # the latest published version, now
        self.t0 = t0
        self.vocab = vocab
        self.gap_s = gap_s
        self.max_retry_s = max_retry_s
        self.stats = ClientStats()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def add(self, name: str, url: str) -> None:
        """Start sending requests to the gateway at ``url``."""
        t = threading.Thread(target=self._loop, args=(name, url), name=f"rollout-{name}",
                             daemon=True)
        self.threads.append(t)
        t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)

    def _count(self, what: str) -> None:
        with self.stats.lock:
            self.stats.other[what] = self.stats.other.get(what, 0) + 1

    def _sleep(self, headers: dict[str, str]) -> None:
        try:
            s = float(headers.get("Retry-After", "1"))
        except ValueError:
            s = 1.0
        s = min(max(s, 0.0), self.max_retry_s)
        with self.stats.lock:
            self.stats.retry_after_s += s
        self.stop.wait(s)

    def _loop(self, name: str, url: str) -> None:
        k = 0
        while not self.stop.is_set():
            pin = "min_version" if k % 2 == 0 else "exact_version"
            k += 1
            target = self.latest()
            ids = [1 + (k * 7 + i * 13) % (self.vocab - 1) for i in range(PROMPT_LEN)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS},
                    pin: target}
            while not self.stop.is_set():
                try:
                    status, headers, out = _post(url + "/generate", body)
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    self._count(type(exc).__name__)  # not up yet (the joiner), or going away
                    self.stop.wait(0.5)
                    break
                if status == 200:
                    stamp = (out or {}).get("patchswarm") or {}
                    s = Sample(name, pin, target, int(stamp["version_start"]),
                               int(stamp["version_end"]), self.latest(),
                               round(time.monotonic() - self.t0, 3))
                    with self.stats.lock:
                        self.stats.samples.append(s)
                    break
                if status == 409:
                    doc = out or {}
                    with self.stats.lock:
                        self.stats.conflicts.append({
                            "node": name, "pin": pin, "target": target,
                            "reason": doc.get("reason"), "served": doc.get("served_version"),
                            "retry_after": headers.get("Retry-After")})
                    if doc.get("reason") == "ahead":  # waiting here never helps: re-pin
                        break
                    self._sleep(headers)  # behind / commit_pending: come back then
                    continue
                self._count(str(status))
                if status == 503:
                    self._sleep(headers)
                    continue
                break
            self.stop.wait(self.gap_s)


def run(args: argparse.Namespace) -> int:
    """Run the demo (flags from ``lab.cli_demo``); 0 when every check passed."""
    summary = run_loop(regions=args.regions, nodes_per_region=args.nodes_per_region,
                       versions=args.versions, interval_s=args.interval,
                       max_lag=args.max_lag, anchor_every=args.anchor_every,
                       join_after=args.join_after, lr=args.lr, chunk_size=args.chunk_size,
                       timeout=args.timeout, tls=args.tls, keep=args.keep, progress=True)
    print_table(summary)
    if args.keep:
        print(f"work directory kept: {summary['workdir']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if summary["ok"] else 1


def run_loop(*, regions: int = 2, nodes_per_region: int = 2, versions: int = 8,
             interval_s: float = 1.5, max_lag: int = 1, anchor_every: int = 3,
             join_after: int = 5, lr: float = 1e-5, chunk_size: int = 16 * 1024,
             timeout: float = 90.0, tls: bool = True, keep: bool = False,
             progress: bool = False) -> dict[str, Any]:
    """Run the loop; the summary object (``--json``; see ``print_table``)."""
    import torch

    from lab.fleet import FleetError, LoopbackFleet, until
    from lab.tiny_llama import LlamaTrainer, llama_masters, model_config
    from node.config import load_config
    from trainer.publisher import Publisher, PublishResult
    from trainer.served import served_view

    if versions < 1:
        raise FleetError("--versions must be >= 1")
    if max_lag < 1:
        raise FleetError("--max-lag must be >= 1 (the demo is about bounded staleness)")
    if anchor_every < 0:
        raise FleetError("--anchor-every must be >= 0")
    if not 0 <= join_after <= versions:
        raise FleetError(f"--join-after must be 0..{versions} (0: no joiner)")
    if not interval_s >= 0:
        raise FleetError("--interval must be >= 0 seconds")

    def say(msg: str) -> None:
        if progress:
            print(msg, flush=True)

    torch.set_num_threads(1)  # tiny matrices; the nodes need the cores
    torch.manual_seed(0)
    t0 = time.monotonic()
    cfg = model_config()
    masters = llama_masters(0)
    base = served_view(masters, "bf16")
    trainer = LlamaTrainer(masters, cfg, lr=lr)
    # one node more in region 0: the late joiner (the other regions' spares stay off)
    joining = join_after > 0
    fleet = LoopbackFleet(
        regions, nodes_per_region + (1 if joining else 0), chunk_size=chunk_size, tls=tls,
        keep_workdir=keep, model="tiny-llama", model_config=cfg,
        gateway={"retry_after_s": 1, "hold_max_s": 5},
        swarm={"redial_s": 1.0, "keep_versions": 3},
        trainer_sections={"publish": {"max_lag": max_lag, "anchor_every": anchor_every,
                                      "max_lag_timeout_s": timeout},
                          "store": {"keep_versions": 1}})
    spare = f"-{nodes_per_region}"
    first = [n for n in fleet.nodes if not n.name.endswith(spare)] if joining else fleet.nodes
    joiner = next((n for n in fleet.nodes if n.name == f"n0{spare}"), None) if joining else None
    results: list[PublishResult] = []
    step_of = {1: 0}  # version -> training step of its weights (an anchor: its patch's)
    published_at: dict[int, float] = {1: 0.0}
    join: dict[str, Any] = {}
    client: RolloutClient | None = None
    pub: Publisher | None = None
    try:
        say(f"starting {len(first)} nodes ({regions} regions x {nodes_per_region}) with a "
            f"gateway each on loopback{' (mutual TLS)' if tls else ''}; model: tiny Llama, "
            f"{sum(t.numel() for t in base.values()):,} parameters served as bf16 ...")
        fleet.start_nodes_only(base, timeout=timeout, nodes=first)
        pub = Publisher(load_config(fleet.workdir / "trainer.toml"))
        pub.start()
        pub.wait(1, min_nodes=len(first), timeout=timeout)  # every node reports: max_lag counts it
        say(f"fleet up in {time.monotonic() - t0:.1f} s; publishing {versions} versions every "
            f"{interval_s:g} s with max_lag = {max_lag}, anchor_every = {anchor_every}")
        p = pub
        client = RolloutClient(lambda: p.version, t0, int(cfg["vocab_size"]))
        for n in first:
            assert n.gateway_url is not None
            client.add(n.name, n.gateway_url)
        monitor: threading.Thread | None = None
        next_at = time.monotonic() + interval_s
        for k in range(versions):
            m = trainer.step()
            time.sleep(max(0.0, next_at - time.monotonic()))
            asked = time.monotonic()
            r = pub.publish_async(m).result(timeout=timeout + 60)
            next_at = max(next_at + interval_s, time.monotonic())
            results.append(r)
            step_of[r.version] = k + 1
            published_at[r.version] = round(time.monotonic() - t0, 3)
            extra = ""
            if r.anchor is not None:
                step_of[r.anchor.version] = k + 1
                published_at[r.anchor.version] = published_at[r.version]
                extra = f" + anchor v{r.anchor.version} ({r.anchor.patch_bytes:,} bytes)"
            say(f"  v{r.version}: {r.patch_bytes:,} bytes{extra}, held {r.lag_wait_s:.2f} s "
                f"by max_lag (asked {asked - t0:.1f} s), loss {trainer.last_loss:.3f}")
            if joiner is not None and k + 1 == join_after:
                join = {"node": joiner.name, "started_s": round(time.monotonic() - t0, 3),
                        "latest_at_start": pub.version}
                fleet.start_node(joiner)
                assert joiner.gateway_url is not None
                client.add(joiner.name, joiner.gateway_url)
                monitor = threading.Thread(target=_watch_joiner, args=(fleet, joiner, join, t0),
                                           daemon=True)
                monitor.start()
                say(f"  late joiner {joiner.name} started (fresh store) at v{pub.version}")
        last = pub.version
        everyone = first + ([joiner] if joiner is not None else [])
        statuses = fleet.wait_version(last, timeout, nodes=everyone)
        pub.wait(last, timeout=timeout, min_nodes=len(everyone))
        time.sleep(1.0)  # a last round of requests on the last version
        client.close()
        if monitor is not None:
            monitor.join(timeout)

        def timed() -> dict[str, Any] | None:  # the origin samples these every 0.5 s
            doc = json.loads(fleet.http(fleet.trainer_api_addr, "/fleet") or b"null") or {}
            times = doc.get("publish_to_active_s") or {}
            return times if str(last) in times else None

        with contextlib.suppress(AssertionError):
            until("publish-to-active times", timed, timeout=5)
        times = timed() or {}
        final = {n.name: (statuses.get(n.name) or {}).get("active_version") for n in everyone}
    finally:
        if client is not None:
            client.close()
        if pub is not None:
            pub.close()
        fleet.close()
    return summarize(results, step_of, published_at, times, client.stats if client else None,
                     join, final, max_lag, anchor_every, time.monotonic() - t0,
                     workdir=str(fleet.workdir) if keep else None)


def _watch_joiner(fleet: Any, joiner: Any, join: dict[str, Any], t0: float) -> None:
    """Until the joiner is active at the version that was latest when it started: then
    record its bytes received and the versions it activated on the way."""
    target = join["latest_at_start"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = fleet.status(joiner)
        if st is not None and (st.get("active_version") or 0) >= target:
            join["caught_up_s"] = round(time.monotonic() - t0, 3)
            join["active_version"] = st["active_version"]
            join["received_bytes"] = sum(st["bytes"]["received"].values())
            join["activated"] = sorted(int(v) for v in (st.get("activated_at") or {}))
            return
        time.sleep(0.1)


def _histogram(xs: list[int]) -> dict[str, int]:
    """How many of each value, by value (JSON keys)."""
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def summarize(results: list[Any], step_of: dict[int, int], published_at: dict[int, float],
              times: dict[str, Any], stats: ClientStats | None, join: dict[str, Any],
              final: dict[str, int | None], max_lag: int, anchor_every: int,
              wall_s: float, workdir: str | None = None) -> dict[str, Any]:
    """The demo's result object (``--json``)."""
    samples = stats.samples if stats else []
    conflicts = stats.conflicts if stats else []
    steps = sorted(step_of.items())

    def step_at(v: int) -> int:  # versions published later than v have larger numbers
        return max((s for ver, s in steps if ver <= v), default=0)

    for s in samples:
        s.lag = step_at(s.latest_at_completion) - step_at(s.version_start)
    rows: list[dict[str, Any]] = []
    for r in results:
        for x, kind in ((r, r.kind), (r.anchor, "anchor")):
            if x is None:
                continue
            v = x.version
            mine = [s for s in samples if s.version_start == v]
            t = times.get(str(v)) or {}
            rows.append({
                "version": v, "kind": kind, "step": step_of.get(v), "bytes": x.patch_bytes,
                "published_s": published_at.get(v), "lag_wait_s": round(x.lag_wait_s, 3),
                "p50_active_s": t.get("p50"), "p100_active_s": t.get("p100"),
                "conflicts": sum(1 for c in conflicts if c["target"] == v),
                "samples": len(mine), "sample_lags": _histogram([s.lag for s in mine]),
            })
    last = results[-1] if results else None
    last_v = (last.anchor.version if last and last.anchor else last.version) if last else 1
    lags = [s.lag for s in samples]
    if join.get("active_version") is not None:
        reached = join["active_version"]
        patches = [r for r in results if r.version <= reached]
        anchors = [r.anchor for r in results if r.anchor is not None and r.anchor.version <= reached]
        join["whole_chain_bytes"] = sum(r.patch_bytes for r in patches)
        if anchors:
            a = anchors[-1]
            join["anchor"] = a.version
            join["anchor_bytes"] = a.patch_bytes
            join["anchor_plus_after_bytes"] = a.patch_bytes + sum(
                r.patch_bytes for r in patches if r.version > a.version)
            join["via_anchor"] = a.version in join.get("activated", []) and not any(
                v in join.get("activated", []) for v in range(2, a.version))
        else:
            join["via_anchor"] = False
    reasons: dict[str, int] = {}
    for c in conflicts:
        reasons[str(c["reason"])] = reasons.get(str(c["reason"]), 0) + 1
    converged = bool(final) and all(v == last_v for v in final.values())
    bound_ok = all(x <= max_lag for x in lags)
    return {
        "mode": "async",
        "max_lag": max_lag,
        "anchor_every": anchor_every,
        "final_version": last_v,
        "nodes": final,
        "converged": converged,
        "versions": rows,
        "samples": len(samples),
        "samples_stamped": all(s.version_start <= s.version_end for s in samples),
        "spanning_samples": sum(1 for s in samples if s.version_start != s.version_end),
        "sample_lags": _histogram(lags),
        "max_sample_lag": max(lags, default=None),
        "lag_bound_respected": bound_ok,
        "conflicts": len(conflicts),
        "conflict_reasons": reasons,
        "retry_after_slept_s": round(stats.retry_after_s, 1) if stats else 0.0,
        "other_outcomes": dict(stats.other) if stats else {},
        "joiner": join or None,
        "wall_s": round(wall_s, 1),
        "ok": converged and bool(samples) and bound_ok,
        **({"workdir": workdir} if workdir else {}),
    }


def print_table(s: dict[str, Any]) -> None:
    """The per-version table and the joiner line."""
    def num(x: Any, f: str = ".2f") -> str:
        return "-" if x is None else format(x, f)

    print()
    print(f"{'version':>7} {'kind':<6} {'bytes':>9} {'published':>9} {'held':>6} "
          f"{'p50/p100 active':>16} {'409s':>5} {'samples':>7}  lag (steps: samples)")
    for r in s["versions"]:
        lags = " ".join(f"{k}:{n}" for k, n in r["sample_lags"].items()) or "-"
        active = f"{num(r['p50_active_s'])} / {num(r['p100_active_s'])}"
        print(f"{r['version']:>7} {r['kind']:<6} {r['bytes']:>9,} {num(r['published_s'], '.1f'):>8}s"
              f" {num(r['lag_wait_s']):>5}s {active:>15}s {r['conflicts']:>5} {r['samples']:>7}"
              f"  {lags}")
    print()
    reasons = ", ".join(f"{k} {n}" for k, n in sorted(s["conflict_reasons"].items())) or "none"
    print(f"samples {s['samples']} (stamped: {'yes' if s['samples_stamped'] else 'NO'}, "
          f"spanning a commit: {s['spanning_samples']}); lag in steps "
          f"{' '.join(f'{k}:{n}' for k, n in s['sample_lags'].items()) or '-'}; max "
          f"{s['max_sample_lag']} (max_lag {s['max_lag']}: "
          f"{'respected' if s['lag_bound_respected'] else 'EXCEEDED'})")
    print(f"409s {s['conflicts']} ({reasons}); slept {s['retry_after_slept_s']} s on Retry-After")
    j = s.get("joiner")
    if j:
        if j.get("received_bytes") is None:
            print(f"joiner {j['node']}: did not catch up")
        else:
            via = f"via anchor v{j['anchor']}" if j.get("via_anchor") else "via the chain"
            print(f"joiner {j['node']}: started at v{j['latest_at_start']} "
                  f"({j['started_s']:.1f} s), active v{j['active_version']} at "
                  f"{j['caught_up_s']:.1f} s {via}; fetched {j['received_bytes']:,} bytes vs "
                  f"whole chain of patches {j['whole_chain_bytes']:,} "
                  f"(anchor + patches after it: {j.get('anchor_plus_after_bytes', 0):,})")
    ok = "yes" if s["converged"] else "NO"
    print(f"every node at v{s['final_version']}: {ok}; wall {s['wall_s']} s")
