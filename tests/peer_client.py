"""An outsider on a node's swarm port, for tests: speaks the link protocol
(``node.link``) directly, sends what the test says and reports how the link ended."""

from __future__ import annotations

import asyncio
import os
import ssl

from node.driver import MAX_LINK_MESSAGE
from node.link import Link, dial


async def connect(addr: str, ssl_context: ssl.SSLContext | None = None,
                  timeout: float = 5.0) -> Link:
    host, _, port = addr.rpartition(":")
    return await dial(host, int(port), ssl_context=ssl_context, max_message=MAX_LINK_MESSAGE,
                      timeout=timeout)


async def join(addr: str, secret: bytes, node_id: str, region: str = "region-0") -> Link:
    """Join ``addr`` as a member that knows the swarm secret: HELLO and AUTH sent, the
    peer's HELLO read; the link, for the test to go on with."""
    from lab.fleet import MODEL
    from swarm.protocol import handshake as hs
    from swarm.protocol import wire

    link = await connect(addr)
    mine = hs.hello_frame(model=MODEL, node_id=node_id, region=region,
                          addr="127.0.9.9:1", role="node", nonce=os.urandom(16))
    await link.send(mine)
    theirs = await asyncio.wait_for(link.recv(), 5)
    assert theirs is not None
    await link.send(wire.encode(wire.AUTH, hs.mac(secret, mine, bytes(theirs))))
    return link


async def ending(link: Link, most: int = 50) -> str:
    """Read up to ``most`` messages: ``closed: <reason>`` if the node closed the link."""
    for _ in range(most):
        if await link.recv() is None:
            return f"closed: {link.reason}"
    return "still open"
