"""An outsider on a node's swarm port, for tests: speaks the link protocol
(``node.link``) directly, sends what the test says and reports how the link ended."""

from __future__ import annotations

import ssl

from node.driver import MAX_LINK_MESSAGE
from node.link import Link, dial


async def connect(addr: str, ssl_context: ssl.SSLContext | None = None,
                  timeout: float = 5.0) -> Link:
    host, _, port = addr.rpartition(":")
    return await dial(host, int(port), ssl_context=ssl_context, max_message=MAX_LINK_MESSAGE,
                      timeout=timeout)


async def ending(link: Link, most: int = 50) -> str:
    """Read up to ``most`` messages: ``closed: <reason>`` if the node closed the link."""
    for _ in range(most):
        if await link.recv() is None:
            return f"closed: {link.reason}"
    return "still open"
