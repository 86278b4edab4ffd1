"""Peer socket options. ``[network] unsent_limit_kib``: the kernel holds at most that many
unsent bytes per peer socket (TCP_NOTSENT_LOWAT), so control frames overtake chunk data in
our own queue. ``[network] congestion_control``: the TCP algorithm of each peer socket."""

from __future__ import annotations

import socket

import pytest

from node.tcp import UNSENT_LIMIT, congestion_of, limit_unsent, set_congestion
from tests.tcp_pairs import allowed_congestion, tcp_pair

needs_opt = pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"),
                               reason="no TCP_NOTSENT_LOWAT on this platform")


@needs_opt
def test_the_limit_is_set_on_both_ends_of_a_real_connection() -> None:
    srv, cli, acc = tcp_pair()
    try:
        before = cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
        assert limit_unsent(cli, UNSENT_LIMIT) and limit_unsent(acc, 64 * 1024)
        assert cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == UNSENT_LIMIT
        assert acc.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == 64 * 1024
        assert before != UNSENT_LIMIT  # the kernel's default is not ours
    finally:
        for s in (cli, acc, srv):
            s.close()


@needs_opt
def test_the_limit_bounds_what_the_kernel_takes_from_a_writer() -> None:
    """With the limit, a non-blocking writer whose peer reads nothing is told to wait after
    about the limit plus what TCP sends at once; without it the kernel takes far more
    (its autotuned send buffer, several MiB on loopback)."""

    def accepted(limit: int) -> int:
        srv, cli, acc = tcp_pair()
        try:
            acc.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            if limit:
                limit_unsent(cli, limit)
            cli.setblocking(False)
            block, total = b"\0" * 65536, 0
            for _ in range(4096):  # bounded: 256 MiB at most
                try:
                    total += cli.send(block)
                except BlockingIOError:
                    break
            return total
        finally:
            for s in (cli, acc, srv):
                s.close()

    limited, free = accepted(32 * 1024), accepted(0)
    assert limited < free / 2, (limited, free)


def test_zero_or_no_socket_leaves_the_kernel_default() -> None:
    srv, cli, acc = tcp_pair()
    try:
        assert limit_unsent(cli, 0) is False
        assert limit_unsent(None, UNSENT_LIMIT) is False
        cli.close()
        assert limit_unsent(cli, UNSENT_LIMIT) is False  # a closed socket: no error raised
    finally:
        for s in (acc, srv):
            s.close()


# ---- [network] congestion_control: TCP_CONGESTION on peer sockets

needs_cc = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"),
                              reason="no TCP_CONGESTION on this platform")


@needs_cc
def test_congestion_control_is_set_on_a_real_connection() -> None:
    srv, cli, acc = tcp_pair()
    try:
        # reno is built into every Linux kernel and always allowed
        assert set_congestion(cli, "reno") is None and set_congestion(acc, "reno") is None
        assert congestion_of(cli) == "reno" and congestion_of(acc) == "reno"
        cli.sendall(b"x" * 100_000)  # the connection still works after the switch
        got = 0
        while got < 100_000:
            got += len(acc.recv(65536))
        if "bbr" in allowed_congestion():
            assert set_congestion(cli, "bbr") is None and congestion_of(cli) == "bbr"
    finally:
        for s in (cli, acc, srv):
            s.close()


@needs_cc
def test_a_refused_algorithm_says_why_and_leaves_the_socket_working() -> None:
    srv, cli, acc = tcp_pair()
    try:
        before = congestion_of(cli)
        why = set_congestion(cli, "nosuchcc")
        assert why and isinstance(why, str)
        assert congestion_of(cli) == before  # the system's, unchanged
        assert set_congestion(cli, "") is None and set_congestion(None, "bbr") is None
        cli.sendall(b"ok")
        assert acc.recv(2) == b"ok"
    finally:
        for s in (cli, acc, srv):
            s.close()
