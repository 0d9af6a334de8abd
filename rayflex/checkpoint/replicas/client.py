"""A rank's side of memory replicas: hand a saved shard to its node's keeper; find and read
the copies a restore can use.

Everything here is best effort by design: storage is the source of truth and a memory copy
only a faster way to the same bytes. A keeper that is missing, dead or slow makes a save
skip its memory copy (a warning) and a restore read that file from storage (the
``checkpoint_loaded`` event says which files and why) — never a failed save or restore.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from rayflex.constants import knob
from rayflex.checkpoint.replicas.holders import Holder
from rayflex.checkpoint.replicas.keeper import PRIMARY
from rayflex.checkpoint.replicas.keepers import keeper_name, node_of_keeper
from rayflex.checkpoint.manifest import DIGEST_SUFFIX

log = logging.getLogger(__name__)


class ReplicaClient:
    def __init__(self, run: str, node_id: str):
        self.run, self.node_id = run, node_id
        self._handles: dict[str, Any] = {}
        self.leaving_nodes: set[str] = set()  # nodes a spot notice named (``leaving``)

    def _keeper(self, node_id: str) -> Optional[Any]:
        import ray

        if node_id not in self._handles:
            try:
                self._handles[node_id] = ray.get_actor(keeper_name(self.run, node_id))
            except ValueError:  # none (yet) on that node
                return None
        return self._handles[node_id]

    @staticmethod
    def _get(ref, timeout_s: float):
        import ray

        return ray.get(ref, timeout=timeout_s)

    def _all_keepers(self) -> dict[str, Any]:
        import ray

        out = {}
        for name in ray.util.list_named_actors():
            node = node_of_keeper(self.run, name)
            if node is not None and (handle := self._keeper(node)) is not None:
                out[node] = handle
        return out

    # ----------------------------------------------------------------- saving
    def keep(self, step: int, name: str, data: bytes, *, digest: str, off_node: bool) -> list[str]:
        """Give ``name`` of ``step`` to this node's keeper (which replicates it) and wait
        until it holds it — with ``off_node``, also until its peers on other nodes do.
        Returns the nodes whose keepers confirmed a copy (empty: storage only)."""
        keeper = self._keeper(self.node_id)
        if keeper is None:
            log.warning("no replica keeper on node %s: step %d %s is kept in storage only",
                        self.node_id[:12], step, name)
            return []
        import numpy as np

        timeout = knob("REPLICA_TIMEOUT_S")
        try:
            got = self._get(keeper.put.remote(step, name, np.frombuffer(data, dtype=np.uint8), digest=digest,
                                              origin_node=self.node_id), timeout)
        except Exception as e:  # noqa: BLE001 - a keeper gone or slow: storage still gets the file
            log.warning("step %d %s: not kept in memory (%s); storage only", step, name, e)
            return []
        holders = [self.node_id] if got.get("kept") else []
        if not off_node:
            return holders
        for node, ref in zip(got.get("replica_nodes", []), got.get("replicas", [])):
            try:
                if self._get(ref, timeout).get("kept"):
                    holders.append(node)
            except Exception as e:  # noqa: BLE001 - that peer went: the others may hold it
                log.warning("step %d %s: replica on %s not confirmed: %s", step, name, node[:12], e)
        return holders

    def leaving(self, nodes) -> None:
        """``nodes`` are about to go (a spot notice): an emergency save hands its uploads
        to keepers elsewhere."""
        self.leaving_nodes = set(nodes or ())

    def upload_keeper(self, holders: list[str]) -> Optional[str]:
        """The node whose keeper should upload a file held on ``holders`` in an emergency
        save: this node's if it stays, else a holder's that stays; None: upload it yourself."""
        staying = [n for n in holders if n not in self.leaving_nodes]
        if self.node_id in staying:
            return self.node_id
        return staying[0] if staying else None

    def hand_off(self, node_id: str, step: int, name: str, uri: str) -> bool:
        """Ask the keeper on ``node_id`` to upload its copy of ``name`` to ``uri``; True once
        it accepted (the upload itself goes on after this rank is gone)."""
        keeper = self._keeper(node_id)
        if keeper is None:
            return False
        try:
            got = self._get(keeper.upload.remote(step, name, uri), knob("REPLICA_TIMEOUT_S"))
        except Exception as e:  # noqa: BLE001 - that keeper went: upload it yourself
            log.warning("step %d %s: keeper on %s did not take the upload: %s", step, name, node_id[:12], e)
            return False
        if not got["accepted"]:
            log.warning("step %d %s: keeper on %s refused the upload: %s", step, name, node_id[:12], got["why"])
        return bool(got["accepted"])

    def committed(self, step: int) -> None:
        """Tell every keeper ``step`` is committed (older steps are superseded)."""
        for keeper in self._all_keepers().values():
            keeper.committed.remote(step)

    # ----------------------------------------------------------------- restoring
    def locate(self, step: int, step_uri: str, files: list[str]) -> tuple[dict[str, list[Holder]], dict]:
        """(file -> keepers holding a copy whose digest matches the one committed beside
        it in storage; what could not be found, file -> why). Also drops every keeper's
        steps after ``step``: the restart resumes here, later saves were never committed."""
        keepers = self._all_keepers()
        for keeper in keepers.values():
            keeper.drop_after.remote(step)
        refs = {node: k.inventory.remote(step) for node, k in keepers.items()}
        inventories = {}
        for node, ref in refs.items():
            try:
                inventories[node] = self._get(ref, knob("REPLICA_TIMEOUT_S"))
            except Exception as e:  # noqa: BLE001 - its node just went: its copies with it
                log.warning("replica keeper on %s did not answer: %s", node[:12], e)
        # Only the files some keeper holds need their committed digest (one GET each).
        committed = _committed_digests(step_uri, sorted({n for inv in inventories.values() for n in inv}
                                                        & set(files)))
        holders: dict[str, list[Holder]] = {}
        missing: dict[str, str] = {}
        for name in files:
            want = committed.get(name)
            held = [(node, inv[name]) for node, inv in inventories.items() if name in inv]
            ok = [Holder(node, kept["role"]) for node, kept in held if want is not None and kept["digest"] == want]
            if ok:
                holders[name] = ok
            elif not held:
                missing[name] = "no live keeper holds it (its node and its replicas' nodes lost, or never kept)"
            elif want is None:
                missing[name] = "no digest beside it in storage (saved without memory replicas)"
            else:
                missing[name] = "the copies in memory do not match the committed digest"
        return holders, missing

    def start_read(self, holder: Holder, step: int, name: str, ranges: list[tuple[int, int]]) -> list:
        """Ask for the byte ranges of one file from one keeper (``finish_read`` collects
        them): a restore asks for every file at once, so local and remote copies arrive
        together. One call per file: splitting a remote file into 4 concurrent calls made
        a 256 MiB replica read 2.4x slower here (2 cores; Ray moves each part as an object)."""
        keeper = self._keeper(holder.node_id)
        if keeper is None:
            raise LookupError(f"no keeper on node {holder.node_id[:12]}")
        return [keeper.read.remote(step, name, ranges)]

    def finish_read(self, pending: list) -> list:
        out: list = []
        for ref in pending:
            out += self._get(ref, knob("REPLICA_READ_TIMEOUT_S"))
        return out

    def read(self, holder: Holder, step: int, name: str, ranges: list[tuple[int, int]]) -> list:
        return self.finish_read(self.start_read(holder, step, name, ranges))

    # ----------------------------------------------------------------- DCP's reader and writer
    def writer(self, path: str, *, step: int, emergency: bool, **options):
        """DCP's writer for a save of ``step`` that also keeps each shard file in memory
        (``emergency``: and hands its upload to a keeper, see ``ReplicatingWriter``)."""
        from rayflex.checkpoint.replicas.dcp_io import ReplicatingWriter

        return ReplicatingWriter(path, step=step, client=self, emergency=emergency, **options)

    def reader(self, path: str, *, step: int, holders: dict, missing: dict, **options):
        """DCP's reader for ``step`` that reads what it can from the copies ``locate`` found;
        its ``report`` says which shard files came from where."""
        from rayflex.checkpoint.replicas.dcp_io import MemoryFirstReader

        return MemoryFirstReader(path, step=step, holders=holders, missing=missing, client=self, **options)

    def order(self, holders: list[Holder]) -> list[Holder]:
        """This node's copy first (no network), then the saving node's, then replicas."""
        return sorted(holders, key=lambda h: (h.node_id != self.node_id, h.role != PRIMARY, h.node_id))


def _committed_digests(step_uri: str, files: list[str]) -> dict[str, str]:
    """The digest each shard's rank wrote beside it (files without one are left out)."""
    from rayflex.storage.fs import join as fs_join
    from rayflex.storage.fs import read_text

    def read(name: str) -> Optional[str]:
        try:
            return read_text(fs_join(step_uri, name + DIGEST_SUFFIX)).strip()
        except Exception:  # noqa: BLE001 - absent: saved without replicas
            return None

    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        return {name: d for name, d in zip(files, pool.map(read, files)) if d}
