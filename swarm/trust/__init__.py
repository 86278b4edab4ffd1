"""Signed manifests, chunks and trust (see docs/manifest.md)."""
