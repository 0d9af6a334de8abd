"""The run's replica keepers: one actor per node that hosts ranks, owned by the controller.

Owned by the controller, a keeper lives as long as the run (a rank's death does not take
its node's copies) and goes with it (no replica outlives the run that needs it). Each is
named after the run and its node, so a rank finds its node's keeper — and rank 0 every
keeper — by name, with no handle passed around. ``cover`` runs at every placement: new
nodes get a keeper, and every keeper's peers are chosen again over the nodes that are left.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from rayflex.checkpoint.replicas.peers import choose_peers

log = logging.getLogger(__name__)

KEEPER_PREFIX = "rayflex-replicas"


def keeper_name(run: str, node_id: str) -> str:
    return f"{KEEPER_PREFIX}:{run}:{node_id}"


def node_of_keeper(run: str, name: str) -> Optional[str]:
    prefix = f"{KEEPER_PREFIX}:{run}:"
    return name[len(prefix):] if name.startswith(prefix) else None


class KeeperSet:
    def __init__(self, run: str, copies: int, budget_bytes: Optional[int]):
        self.run, self.copies, self.budget_bytes = run, copies, budget_bytes
        self.keepers: dict[str, Any] = {}  # node id -> actor handle

    def cover(self, nodes: set[str], topology) -> dict[str, list[str]]:
        """A keeper on each of ``nodes``, and peers chosen over them; returns the peers."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rayflex.constants import knob_env
        from rayflex.checkpoint.replicas.keeper import ReplicaKeeper

        alive = {n.node_id for n in topology.nodes}
        named = set(ray.util.list_named_actors())  # a dead actor's name is free again
        for node in [n for n in self.keepers if n not in alive or keeper_name(self.run, n) not in named]:
            self.keepers.pop(node)  # gone with its node (or on its own): a new one where needed
        for node in sorted(nodes - set(self.keepers)):
            # Threaded: a restore's reads must not wait behind a save's puts. No CPU: it
            # mostly waits, and a node's worker slots stay the workers'.
            actor = ray.remote(ReplicaKeeper).options(
                name=keeper_name(self.run, node), num_cpus=0, max_concurrency=8, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote(self.run, node, self.budget_bytes, knob_env())
            self.keepers[node] = actor
        peers = choose_peers(topology, sorted(self.keepers), self.copies)  # every keeper left is on a live node
        for node, chosen in peers.items():
            try:
                self.keepers[node].set_peers.remote([self.keepers[p] for p in chosen], chosen)
            except Exception as e:  # noqa: BLE001 - a keeper whose node just went
                log.warning("replica keeper on %s: peers not set: %s", node[:12], e)
        return peers

    def stats(self, timeout_s: float = 10.0) -> dict[str, dict]:
        import ray

        refs = {node: k.stats.remote() for node, k in self.keepers.items()}
        out = {}
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - dead keeper
                out[node] = {"error": f"{type(e).__name__}: {e}"}
        return out

    def wait_uploads(self, step: Optional[int], timeout_s: float, poll_s: float = 0.2) -> dict[str, str]:
        """Wait until no live keeper has an upload of ``step`` (None: of any step) pending
        (an emergency save handed them over); returns file name -> final state
        (``keeper.UPLOADED`` or "failed: ..."; still PENDING if ``timeout_s`` ran out). A
        keeper that died took its pending files with it: they are absent here, and the
        step's check against DCP's ``.metadata`` names them."""
        import time

        import ray

        from rayflex.checkpoint.replicas.keeper import PENDING

        deadline = time.monotonic() + timeout_s
        while True:
            states: dict[str, str] = {}
            refs = {node: k.uploads.remote(step) for node, k in self.keepers.items()}
            for node, ref in refs.items():
                try:
                    states.update(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
                except Exception as e:  # noqa: BLE001 - gone with its node
                    log.warning("replica keeper on %s did not report its uploads: %s", node[:12], e)
            if PENDING not in states.values() or time.monotonic() >= deadline:
                return states
            time.sleep(poll_s)

    def committed(self, step: int) -> None:
        """``step`` is committed: every keeper drops the older steps."""
        for actor in self.keepers.values():
            actor.committed.remote(step)

    def clear(self) -> None:
        import ray

        for actor in self.keepers.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self.keepers.clear()
