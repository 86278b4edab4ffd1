"""The core's read model: what drivers, status pages, the publisher and the
simulator may read of a ``NodeCore`` (a mixin of it), and nothing they may change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarm.protocol.handshake import READY
from swarm.protocol.picker import iter_bits

if TYPE_CHECKING:
    from swarm.protocol.config import CoreConfig
    from swarm.protocol.counters import Counters
    from swarm.protocol.fleet import FleetEntry
    from swarm.protocol.membership import AddressBook
    from swarm.protocol.peer import Peer
    from swarm.protocol.roles import Role
    from swarm.protocol.uploads import UploadSlots
    from swarm.protocol.versions import ApplyState, VersionSet


class ReadModel:
    cfg: CoreConfig
    peers: dict[int, Peer]
    book: AddressBook
    counters: Counters
    active_version: int | None
    versions: VersionSet
    uploads: UploadSlots
    apply: ApplyState
    role: Role
    speaks: tuple[int, int]

    @property
    def uploading(self) -> int:
        return len(self.uploads)

    @property
    def is_border(self) -> bool:
        return self.role.is_border

    @property
    def manifests(self) -> dict[int, Any]:
        """Verified manifests we hold, by version."""
        return {v: st.manifest for v, st in self.versions.states.items()}

    @property
    def staged_versions(self) -> list[int]:
        """Versions newer than the active one that we know of (being fetched or complete)."""
        a = -1 if self.active_version is None else self.active_version
        return sorted(v for v in self.versions.states if v > a)

    def have(self, version: int) -> set[int]:
        st = self.versions.get(version)
        return set(iter_bits(st.have)) if st is not None else set()

    def complete(self, version: int) -> bool:
        st = self.versions.get(version)
        return st is not None and st.complete

    def peer_list(self) -> list[dict[str, Any]]:
        return [
            {"id": p.node_id, "region": p.region, "addr": p.listen_addr, "role": p.role,
             "kind": str(p.kind), "border": p.border, "proto": p.proto}
            for p in self.peers.values() if p.state is READY
        ]

    def peer_region(self, conn: int) -> str | None:
        """The region of the peer on ``conn`` (None: unknown connection or no handshake yet)."""
        p = self.peers.get(conn)
        return p.region if p is not None and p.region else None

    def peer_proto(self, conn: int) -> int:
        """The protocol version the link on ``conn`` speaks (0: no handshake yet)."""
        p = self.peers.get(conn)
        return p.proto if p is not None and p.state is READY else 0

    def peer_border(self, conn: int) -> bool:
        """Whether the link on ``conn`` carries chunks between regions: on the origin, to a
        border it feeds; on a node, to a border of another region."""
        p = self.peers.get(conn)
        return p is not None and p.border

    def regions_seen(self) -> list[str]:
        """Regions other than ours of the nodes we are linked to or heard of."""
        seen = {p.region for p in self.peers.values() if p.region}
        seen |= set(self.book.regions())
        seen.discard(self.cfg.region)
        return sorted(seen)

    def region_chunks(self, version: int) -> dict[str, int]:
        """Per other region, the chunks of ``version`` known to be there (bitsets).

        Holdings that linked peers showed, plus (origin) what the seeding plan
        saw enter each region.
        """
        union: dict[str, int] = {}
        for p in self.peers.values():
            if p.region and p.region != self.cfg.region:
                union[p.region] = union.get(p.region, 0) | p.bits.get(version, 0)
        for region, sent in self.role.region_sent(version).items():
            union[region] = union.get(region, 0) | sent
        return union

    def fleet(self) -> list[FleetEntry]:
        """Origin: the last version report (STATUS) of every node; ``[]`` on a node."""
        return self.role.fleet()

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.cfg.node_id, "region": self.cfg.region, "role": self.cfg.role,
            "active_version": self.active_version, "staged_versions": self.staged_versions,
            "applying": self.apply.applying, "border": self.is_border, "peers": self.peer_list(),
            "counters": self.counters.as_dict(),
            "protocol": list(self.speaks),
        }
