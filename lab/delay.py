"""A user-space delay line for the emulated WAN: NFQUEUE packets held, then accepted.

This kernel has ``tbf`` and ``htb`` but no ``netem``, so ``lab.netlab`` adds
propagation delay with an nftables ``queue num N`` rule and one holder process
per queue, run inside the rule's network namespace (NFQUEUE sockets are per
namespace)::

    python -m lab.delay --queue 0 --delay-ms 40 --stats FILE

Every packet of the queue is held ``--delay-ms`` and then accepted. The delay is
constant per queue, so packets leave in arrival order: the held set is a FIFO
(a deque of ``(release time, packet id)``), and a release is *one* batch
verdict (``NFQNL_MSG_VERDICT_BATCH``: accept every id up to the last one due)
whatever the number of packets due. Costs kept low because the fleet shares the
machine's cores:

- only the IPv4 header is copied to user space (``COPY_PACKET``, 20 bytes), for
  the packet's length (``NFQA_CAP_LEN``, else the header's total length);
- ``NFQA_CFG_F_GSO``: GSO/GRO super-packets are queued whole, not segmented (not
  with ``--loss``, below);
- one thread; while it holds packets it wakes once per tick (``min(0.5 ms,
  delay / 10)``) and reads everything that arrived, up to ``BATCH`` messages per
  receive call, instead of waking per packet.

``--loss P`` also drops packets at random, each with probability P, from a seeded
generator (``--seed``): long lossy paths, where a loss-based TCP flow is capped near
MSS / RTT x 1.22 / sqrt(P) (Mathis et al.). A lossy queue does not ask for whole GSO
super-packets: the kernel queues each segment, so P is per segment (dropping a
super-packet would lose tens of segments at once).

Memory is bounded: past ``--max-held`` packets (or ``--max-held-mib`` of
packet bytes) a new packet is dropped and counted, and the kernel queue itself
is capped at the same length (its own drops are read from
``/proc/net/netfilter/nfnetlink_queue``). On SIGTERM/SIGINT the holder accepts
everything still held, writes its counters (JSON) to ``--stats`` and exits.

Uses the low-level cffi layer of ``fnfqueue`` (``fnfqueue.lib``): its
``Connection`` class runs a reader thread with a condition variable per packet
and has no batch verdict.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import json
import os
import random
import resource
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

BATCH = 64
PACKET_BUF = 1024  # netlink header, attributes and the first COPY_RANGE bytes
COPY_RANGE = 20  # the IPv4 header: its total length field


class HolderError(RuntimeError):
    pass


def kernel_queue_stats(queue: int) -> dict[str, int] | None:
    """This namespace's kernel counters for ``queue`` (nfnetlink_queue proc file)."""
    try:
        text = Path("/proc/net/netfilter/nfnetlink_queue").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if f and int(f[0]) == queue:
            return {"waiting": int(f[2]), "queue_dropped": int(f[5]),
                    "user_dropped": int(f[6]), "last_id": int(f[7])}
    return None


class Holder:
    """One NFQUEUE queue bound in this network namespace; see the module docstring."""

    def __init__(self, queue: int, delay_s: float, max_held: int = 100_000,
                 max_held_bytes: int = 256 << 20, tick_s: float | None = None,
                 loss: float = 0.0, seed: int = 0) -> None:
        from fnfqueue import ffi, lib  # the wan extra; imported here so the lab imports without it

        self.ffi, self.lib = ffi, lib
        self.queue, self.delay_s = queue, delay_s
        self.tick_s = tick_s if tick_s is not None else min(0.0005, delay_s / 10)
        self.max_held, self.max_held_bytes = max_held, max_held_bytes
        self.held: collections.deque[tuple[float, int, int]] = collections.deque()
        self.held_bytes = 0
        if not 0.0 <= loss < 1.0:
            raise HolderError(f"loss must be in [0, 1), got {loss}")
        self.loss = loss
        self.rng = random.Random(seed)
        self.stats = {"queue": queue, "delay_ms": delay_s * 1e3, "loss": loss, "packets": 0,
                      "bytes": 0, "dropped_lost": 0, "dropped_over_cap": 0, "max_held": 0,
                      "max_held_bytes": 0, "verdict_batches": 0, "wakeups": 0}
        self.conn = ffi.new("struct nfq_connection *")
        if lib.init_connection(self.conn) == -1:
            raise HolderError(f"nfnetlink: {os.strerror(ffi.errno)}")
        fl = fcntl.fcntl(self.conn.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.conn.fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        with contextlib.suppress(OSError):  # a deeper socket buffer rides out bursts
            s = socket.socket(fileno=os.dup(self.conn.fd))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.close()
        self._bufs = [ffi.new("char[]", PACKET_BUF) for _ in range(BATCH)]
        self._pkts = [ffi.new("struct nfq_packet *") for _ in range(BATCH)]
        self._arr = ffi.new("struct nfq_packet *[]", BATCH)
        for i in range(BATCH):
            self._arr[i] = self._pkts[i]
        self._used = BATCH
        self._verdict = ffi.new("struct nfq_packet *")
        self._verdict.queue_id = queue
        self._seq = 0
        self._control(lib.bind_queue, queue)
        self._control(lib.set_mode, queue, COPY_RANGE, lib.NFQNL_COPY_PACKET)
        if not loss:
            self._control(lib.set_flags, queue, lib.NFQA_CFG_F_GSO, lib.NFQA_CFG_F_GSO)
        self._control(lib.set_maxlen, queue, max_held)

    # ------------------------------------------------------------ netlink

    def _control(self, fn: Any, *args: Any) -> None:
        """Send one config message with an ACK request and wait for its answer."""
        self._seq += 1
        if fn(self.conn, *args, 1, self._seq) == -1:
            raise HolderError(f"{fn.__name__}: {os.strerror(self.ffi.errno)}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            select.select([self.conn.fd], [], [], 0.5)
            for p in self._receive():
                if p.seq != self._seq:
                    continue
                err = self.lib.parse_packet(p)
                if err == -1:
                    return
                raise HolderError(f"queue {self.queue}: {os.strerror(err)}")
        raise HolderError(f"queue {self.queue}: no answer from nfnetlink")

    def _receive(self) -> list[Any]:
        for i in range(self._used):  # only what the last receive filled
            p = self._pkts[i]
            p.buffer = self._bufs[i]
            p.len = PACKET_BUF
        n = self.lib.receive(self.conn, self._arr, BATCH)
        self._used = BATCH if n == -1 else n
        if n == -1:
            e = self.ffi.errno
            if e in (errno.EAGAIN, errno.EWOULDBLOCK):
                return []
            if e == errno.ENOBUFS:  # the kernel dropped messages: counted in /proc
                self.stats["enobufs"] = self.stats.get("enobufs", 0) + 1
                return []
            raise HolderError(f"receive: {os.strerror(e)}")
        return self._pkts[:n]

    def _verdict_upto(self, pid: int, action: int) -> None:
        self._verdict.id = pid
        fn = self.lib.set_verdict_batch if action == self.lib.NF_ACCEPT else self.lib.set_verdict
        if fn(self.conn, self._verdict, action, 0, 0, 0) == -1:
            raise HolderError(f"verdict: {os.strerror(self.ffi.errno)}")

    # ------------------------------------------------------------ the loop

    def _take(self, now: float) -> int:
        """Read every message waiting (bounded per wake-up); returns how many packets."""
        lib, ffi, got = self.lib, self.ffi, 0
        release = now + self.delay_s
        for _ in range(64):  # at most 64 x BATCH messages before releasing again
            pkts = self._receive()
            if not pkts:
                break
            for p in pkts:
                if p.seq != 0 or lib.parse_packet(p) != 0:
                    continue  # a late control answer
                a = p.attr[lib.NFQA_CAP_LEN]
                if a.buffer:
                    size = socket.ntohl(ffi.cast("uint32_t *", a.buffer)[0])
                else:
                    a = p.attr[lib.NFQA_PAYLOAD]
                    h = ffi.cast("unsigned char *", a.buffer) if a.buffer and a.len >= 4 else None
                    size = (h[2] << 8 | h[3]) if h is not None else 0
                got += 1
                if self.loss and self.rng.random() < self.loss:
                    self.stats["dropped_lost"] += 1
                    self._verdict_upto(p.id, lib.NF_DROP)
                    continue
                if len(self.held) >= self.max_held or self.held_bytes + size > self.max_held_bytes:
                    self.stats["dropped_over_cap"] += 1
                    self._verdict_upto(p.id, lib.NF_DROP)
                    continue
                self.held.append((release, p.id, size))
                self.held_bytes += size
                self.stats["bytes"] += size
            if len(pkts) < BATCH:
                break
        self.stats["packets"] += got
        self.stats["max_held"] = max(self.stats["max_held"], len(self.held))
        self.stats["max_held_bytes"] = max(self.stats["max_held_bytes"], self.held_bytes)
        return got

    def _release(self, now: float) -> None:
        last = None
        held = self.held
        due = now + self.tick_s / 4
        while held and held[0][0] <= due:
            _, last, size = held.popleft()
            self.held_bytes -= size
        if last is not None:
            self._verdict_upto(last, self.lib.NF_ACCEPT)
            self.stats["verdict_batches"] += 1

    def run(self, stop: list[bool]) -> None:
        """Wake when a packet comes or the oldest is due, but at most once per ``tick_s``
        while packets are held: a busy link then costs one wake-up per tick, not one per
        packet. A packet read after such a pause is taken as ``tick_s / 2`` old, so its
        delay is right within +-``tick_s / 2``."""
        fd, held, tick = self.conn.fd, self.held, self.tick_s
        last_wake = 0.0
        while not stop[0]:
            now = time.monotonic()
            age = 0.0
            if held and now - last_wake < tick:
                time.sleep(tick - (now - last_wake))
                age = tick / 2
                now = time.monotonic()
            timeout = max(0.0, held[0][0] - now) if held else 0.5
            try:
                ready = select.select([fd], [], [], timeout)[0] if timeout > 0 else True
            except InterruptedError:
                continue
            now = time.monotonic()
            last_wake = now
            self.stats["wakeups"] += 1
            if ready:
                self._take(now - age)
            self._release(now)

    def close(self) -> None:
        """Accept everything still held, unbind, close."""
        if self.held:
            with contextlib.suppress(HolderError):
                self._verdict_upto(self.held[-1][1], self.lib.NF_ACCEPT)
            self.held.clear()
        with contextlib.suppress(HolderError):
            self._seq += 1
            self.lib.unbind_queue(self.conn, self.queue, 0, self._seq)
        self.lib.close_connection(self.conn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lab.delay",
        description="Hold every packet of an NFQUEUE queue for a fixed delay, then accept it "
                    "(run inside the network namespace of the nftables rule; needs root).")
    ap.add_argument("--queue", type=int, required=True, help="NFQUEUE number of the rule")
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay added")
    ap.add_argument("--max-held", type=int, default=100_000,
                    help="packets held at most (user space and kernel queue); more are dropped")
    ap.add_argument("--max-held-mib", type=float, default=256.0,
                    help="packet bytes held at most; more are dropped")
    ap.add_argument("--loss", type=float, default=0.0,
                    help="drop each TCP segment with this probability (default 0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the --loss generator")
    ap.add_argument("--stats", type=Path, default=None, help="write counters here (JSON) on exit")
    ap.add_argument("--nice", type=int, default=-10,
                    help="scheduling priority of the holder (default -10: the emulated network "
                         "keeps its delay when the hosts under test load every core; needs root, "
                         "else it stays as it is)")
    args = ap.parse_args(argv)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    stop = [False]

    def on_signal(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        holder = Holder(args.queue, args.delay_ms / 1e3, args.max_held,
                        int(args.max_held_mib * (1 << 20)), loss=args.loss, seed=args.seed)
    except (HolderError, OSError, ImportError) as exc:
        print(f"lab.delay: {exc}", file=sys.stderr)
        return 2
    print("ready", flush=True)
    try:
        holder.run(stop)
    finally:
        holder.stats["kernel"] = kernel_queue_stats(args.queue)
        holder.close()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        holder.stats["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)
        if args.stats:
            args.stats.write_text(json.dumps(holder.stats) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
