"""Linux ``perf`` helpers shared by the benchmarks: stop a profiler, group a flat profile.

``PERF_GROUPS`` sorts ``perf report`` rows (dso + symbol) into the stages a node's CPU goes
to. Fresh pages get a group of their own: on a VM, the kernel zeroing memory on first touch
can cost more than the copies that touch it (docs/benchmarks.md, WAN round 6).
"""

from __future__ import annotations

import collections
import signal
import subprocess
from pathlib import Path

# (group, substrings of "dso symbol") in priority order, for perf's flat profile
PERF_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("kernel: fresh pages (zeroing, page faults)", ("clear_page", "folio_zero", "exc_page_fault",
                                                   "do_anonymous_page", "handle_mm_fault",
                                                   "do_huge_pmd", "alloc_pages", "get_page_from_freelist")),
    ("kernel: page-cache copies (file write/read)", ("copy_folio_from_iter", "filemap_",
                                                    "ext4_", "generic_perform_write")),
    ("kernel: socket I/O and TCP", ("tcp_", "skb", "_copy_to_iter", "_copy_from_iter",
                                    "sock_", "ip_", "__dev_queue", "net_rx", "loopback",
                                    "inet_", "csum_", "copy_user")),
    ("kernel: other", ("[kernel",)),
    ("TLS (OpenSSL)", ("libssl", "libcrypto", "_ssl.")),
    ("hash (BLAKE3)", ("blake3",)),
    ("codec (zstd, numpy, XXH3, torch)", ("zstd", "_multiarray", "xxhash", "libtorch",
                                         "libgomp", "numpy")),
    ("memcpy/memset (user space, any caller)", ("memmove", "memcpy", "memset")),
    ("websocket framing (aiohttp C)", ("aiohttp", "reader_c", "mask.")),
    ("event loop (uvloop)", ("uvloop", "loop.cpython")),
    ("msgpack", ("msgpack",)),
    ("Python interpreter", ("libpython", "python3")),
    ("libc other (malloc, ...)", ("libc.so",)),
]


def interrupt(proc: subprocess.Popen) -> None:
    """Stop a profiler we started with ^C (it writes its output then), else kill it."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def record(perf: str, pid: int, out: Path, freq: int = 999,
           call_graph: str | None = None) -> subprocess.Popen:
    """``perf record`` of process ``pid`` (every thread, kernel included) until ``interrupt``;
    with ``call_graph`` ("dwarf", "fp") the samples carry their stacks, so ``perf report
    -G`` names who e.g. touched the fresh pages (through libpython, not Python frames)."""
    graph = ["--call-graph", call_graph] if call_graph else []
    return subprocess.Popen([perf, "record", *graph, "-F", str(freq), "-p", str(pid),
                             "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_perf(perf: str, data: Path) -> dict[str, float]:
    """Share of samples (%) per ``PERF_GROUPS`` group from a ``perf record`` file."""
    out = subprocess.run([perf, "report", "-i", str(data), "--no-children", "--sort", "dso,sym",
                          "--stdio", "-g", "none", "--percent-limit", "0"],
                         capture_output=True, text=True, check=False).stdout
    shares: collections.Counter = collections.Counter()
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "%" not in line:
            continue
        pct, _, rest = line.partition("%")
        try:
            p = float(pct)
        except ValueError:
            continue
        group = next((g for g, marks in PERF_GROUPS if any(m in rest for m in marks)), "other")
        shares[group] += p
    return {g: round(p, 1) for g, p in shares.most_common()}
