"""The demo and lab harness: a loopback fleet, emulated geography, a MiniLM step generator,
the RL-loop demo on a tiny Llama (``demo_async``, ``tiny_llama``).

Nothing a trainer or a node imports lives here; this package depends on
``trainer`` and ``node``, never the reverse (tests/test_architecture.py).
"""
