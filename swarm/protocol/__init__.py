"""The sans-I/O swarm protocol core (see docs/protocol.md)."""
