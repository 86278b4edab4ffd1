"""``benchmarks/wan_tcp.py`` on a trace written the way ``bench_wan.py --tcp-trace`` writes
it (``@ <epoch> <namespace>`` then ``ss -tinH`` output, real lines) and a node log through
``node.logs.TextFormatter``: it finds the slow cross-region chunk and prints its sender's
socket, the other busy flows into the region, and the JSON."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from node.logs import TextFormatter

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
T0 = 1_796_304_679.0

# ss -tinH lines as the kernel wrote them on the emulated WAN (n2-1 -> n1-0, and n2-1 -> n1-1)
SLOW = ("0      {q}     10.213.2.2:7400  10.213.1.1:45798\n"
        "\t bbr wscale:10,10 rto:284 rtt:{rtt}/17.284 ato:40 mss:1448 pmtu:1500 rcvmss:1125 "
        "advmss:1448 cwnd:{cwnd} bytes_sent:2976 bytes_acked:2914 segs_out:7 segs_in:8 "
        "bbr:(bw:{bw}bps,mrtt:80.464,pacing_gain:1,cwnd_gain:2) send 2005491bps lastsnd:28 "
        "pacing_rate {pace}bps delivery_rate {bw}bps delivered:5 busy:196ms unacked:{unacked} "
        "retrans:0/{rt} rcv_space:14480 minrtt:80.464 snd_wnd:70656\n")
OTHER = ("0      200000 10.213.2.2:7400  10.213.1.2:51111\n"
         "\t bbr wscale:10,10 rto:284 rtt:90.1/1.2 mss:1448 cwnd:900 "
         "bbr:(bw:73815024bps,mrtt:80.4,pacing_gain:1.25,cwnd_gain:2) pacing_rate 92268780bps "
         "delivery_rate 73815024bps unacked:800 minrtt:80.4\n")


def _received(node: str, at: float, peer: str, index: int, first: float, s: float) -> str:
    rec = logging.LogRecord("patchswarm.node", logging.DEBUG, __file__, 1, "chunk_received",
                            None, None)
    rec.created, rec.msecs = at, (at % 1) * 1000
    rec.fields = {"peer": peer, "version": 2, "index": index, "state": "stored",  # type: ignore[attr-defined]
                  "first_block_at": first, "s": s, "relays": 0}
    return TextFormatter(node).format(rec)


def _run(logdir: Path, *extra: str) -> str:
    res = subprocess.run([sys.executable, str(BENCH / "wan_tcp.py"), str(logdir), "--version", "2",
                          *extra], capture_output=True, text=True, timeout=60, check=True)
    return res.stdout


def test_the_slow_chunk_its_socket_and_the_flows_beside_it(tmp_path: Path) -> None:
    (tmp_path / "n1-0.log").write_text("\n".join([
        # from the other region: 3.0 s (slow) and 0.4 s (not)
        _received("n1-0", T0 + 3.0, "10.213.2.2:7400", 5, T0, 3.0),
        _received("n1-0", T0 + 0.5, "10.213.2.3:7400", 6, T0 + 0.1, 0.4),
        # from its own region: never a cross-region transfer, however slow
        _received("n1-0", T0 + 4.0, "10.213.1.2:7400", 7, T0 + 0.2, 3.8),
    ]) + "\n")
    trace = []
    for k, (bw, cwnd) in enumerate([(7333376, 146), (12811488, 270)]):
        trace.append(f"@ {T0 + 0.5 + k:.3f} pswab-h2-1\n")
        trace.append(SLOW.format(q=334488, rtt=107.6, cwnd=cwnd, bw=bw, pace=bw * 2,
                                 unacked=146, rt=2 + k))
        trace.append(OTHER)
        trace.append(f"@ {T0 + 0.5 + k:.3f} pswab-h1-0\n")  # the receiver's side: not the sender
        trace.append("0      0      10.213.1.1:45798  10.213.2.2:7400\n\t bbr cwnd:10\n")
    trace.append(f"@ {T0 + 9:.3f} pswab-h2-1\n")  # long after the transfer: left out
    trace.append(SLOW.format(q=0, rtt=81.0, cwnd=300, bw=99000000, pace=99000000, unacked=0, rt=9))
    (tmp_path / "tcp-trace.txt").write_text("".join(trace))

    out = _run(tmp_path, "--siblings", "--out", str(tmp_path / "t.json"))
    assert "n2-1 -> n1-0  chunk 5  0.00-3.00 s (3.00 s)" in out
    assert "chunk 6" not in out and "chunk 7" not in out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith(("0.50", "1.50"))]
    assert len(rows) == 2, out
    assert "7.33" in rows[0] and "146" in rows[0] and "0/2" in rows[0]
    assert "12.81" in rows[1] and "25.62" in rows[1]  # BBR's estimate, the pacing rate
    assert all("others: n1-1 73.82" in r for r in rows), rows
    got = json.loads((tmp_path / "t.json").read_text())
    assert [(t["from"], t["to"], t["index"]) for t in got] == [("n2-1", "n1-0", 5)]
    assert [s["bbr_bw_mbit"] for s in got[0]["samples"]] == [7.33, 12.81]
    assert got[0]["samples"][1]["retrans"] == "0/3" and got[0]["samples"][0]["cwnd"] == "146"


def test_no_trace_is_a_clear_error(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(BENCH / "wan_tcp.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--tcp-trace" in res.stderr
