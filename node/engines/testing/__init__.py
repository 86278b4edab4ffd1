"""Test doubles of real engines that keep their documented contracts (no GPU needed)."""
