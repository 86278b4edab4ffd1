"""patchswarm's core library.

- ``swarm.codec``    lossless patch codec for served weights (diff, encode, apply)
- ``swarm.trust``    signed manifests, chunking, trust store, confidential mode
- ``swarm.protocol`` the sans-I/O swarm protocol core (no sockets, no clocks)

Only ``swarm.codec`` touches torch; the protocol moves bytes.
"""

__version__ = "0.1.0"
