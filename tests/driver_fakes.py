"""What the node driver's apply path reads of a store, for driver-level tests that
feed versions directly (no swarm): manifests and payloads by version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FakeManifest:
    kind: str
    parent_digest: bytes
    target_digest: bytes
    encryption: Any = None


class FakeStore:
    def __init__(self) -> None:
        self.m: dict[int, tuple[FakeManifest, bytes]] = {}
        self.recorded: list[int] = []

    def manifest(self, v: int) -> FakeManifest:
        return self.m[v][0]

    def payload(self, v: int) -> bytes:
        return self.m[v][1]

    def payload_view(self, v: int, first: int = 0) -> memoryview:
        if first:
            raise NotImplementedError("the fake store keeps whole payloads, not chunks")
        return memoryview(self.payload(v))

    def set_active(self, v: int, digest: bytes) -> None:
        self.recorded.append(v)

    def active(self) -> Any:
        return None
