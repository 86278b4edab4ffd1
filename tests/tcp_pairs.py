"""Real TCP connections on loopback for the socket-option tests, and what the kernel
allows (``net.ipv4.tcp_allowed_congestion_control``)."""

from __future__ import annotations

import socket


def tcp_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listening socket, dialer, accepted): close all three."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    return srv, cli, acc


def allowed_congestion() -> list[str]:
    """The congestion controls an unprivileged socket may ask for here."""
    try:
        with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []
