"""Discrete-event simulation of a patchswarm fanout (see docs/simulation.md).

The real protocol core (``swarm.protocol.core.NodeCore``) runs for every node in
virtual time over a modelled network; ``runner.run_strategy`` is the entry point,
``patchswarm sim`` the command line.
"""
