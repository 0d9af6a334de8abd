"""Where a shard file's verified memory copies are, and the names of a restore's sources."""

from __future__ import annotations

from dataclasses import dataclass

PRIMARY, REPLICA = "primary", "replica"  # a copy on the node that saved it / on a peer
OWN_COPY, STORAGE = "own_copy", "storage"  # a restore's sources, with REPLICA


@dataclass(frozen=True)
class Holder:
    """A keeper holding a verified copy of one shard file."""

    node_id: str
    role: str  # PRIMARY (on the node that saved it) or REPLICA

    @property
    def source(self) -> str:
        return OWN_COPY if self.role == PRIMARY else REPLICA
