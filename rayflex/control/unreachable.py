"""Nodes that stopped answering before Ray noticed.

A frozen machine (a kernel hang, a saturated NIC, every process SIGSTOPped) closes no
socket, so nothing "dies": the heartbeat names its ranks unresponsive within seconds, but
Ray keeps listing the node until its health check gives up (about a minute by default).
A restart that placed ranks there would wait for that. When every rank of a node froze,
the restart asks the node to run a no-op task; a node that does not is left out of
placement until it answers (its probe stays pending and is read at every placement) or
Ray drops it.
"""

from __future__ import annotations

from typing import Any


class UnreachableNodes:
    def __init__(self, cluster):
        self._cluster = cluster
        self._probes: dict[str, Any] = {}  # node -> its pending probe

    @property
    def nodes(self) -> set[str]:
        return set(self._probes)

    def check(self, nodes: set[str], timeout_s: float) -> set[str]:
        """Probe ``nodes``; return (and from now on leave out) the ones that did not answer
        within ``timeout_s``."""
        if not nodes:
            return set()
        probes = self._cluster.probe_nodes(sorted(nodes))
        silent = self._cluster.unanswered(probes, timeout_s)
        self._probes.update({n: probes[n] for n in silent})
        return silent

    def refresh(self, listed: set[str]) -> set[str]:
        """Forget nodes Ray no longer lists and nodes whose probe has run since; returns
        the ones that answered (usable again)."""
        for node in [n for n in self._probes if n not in listed]:
            del self._probes[node]
        if not self._probes:
            return set()
        back = set(self._probes) - self._cluster.unanswered(dict(self._probes), 0.0)
        for node in back:
            del self._probes[node]
        return back
