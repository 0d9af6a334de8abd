"""ReplicaKeeper: one per node, holding checkpoint shard files in host memory.

A rank that saves hands its serialized shard file (the bytes DCP writes to storage) to the
keeper on its own node, which keeps it and forwards it to its peers on other nodes (chosen
by ``replicas.peers``): the training process sends each byte once, over the node's own
object store. The keeper is a separate process owned by the run's controller, so it
outlives the ranks of its node — a rank that dies finds its copy there after the restart —
and its peers' copies outlive the node.

What it holds is bounded by a byte budget per node: the oldest steps go first, a step the
previous commit superseded goes at once, and a file that fits in no budget is refused (the
restore then reads it from storage). A plain class: ``ray.remote`` at spawn time
(``replicas.keepers``) makes it an actor, and unit tests use it as is.

In an emergency save (a spot notice) a rank hands the *upload* of its file to a keeper
off its leaving node (``upload``): the rank is done once its bytes are in memory on a node
that stays, and the keeper writes them to storage while the node goes; the controller
commits the step once every keeper's uploads of it are done (``uploads``).

Bytes travel as uint8 numpy arrays: Ray moves those through the object store without
pickling copies (one copy in, and a reader on the same node maps the result without
another), which is what makes a restore from memory several times faster than storage.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from rayflex.checkpoint.replicas.holders import PRIMARY, REPLICA
from rayflex.checkpoint.manifest import DIGEST_SUFFIX, fingerprint_of

log = logging.getLogger(__name__)

PENDING, UPLOADED = "pending", "uploaded"  # a handed-off upload's state (else "failed: <why>")
DEFAULT_BUDGET_FRACTION = 0.25  # of the node's RAM when CheckpointConfig.memory_budget_gb is None


# What replicas are checked with: the fingerprint the shard's DIGEST_SUFFIX sidecar holds.
digest_of = fingerprint_of


@dataclass
class Shard:
    data: "np.ndarray"  # uint8, owned by this keeper
    digest: str
    role: str  # PRIMARY or REPLICA
    origin_node: str  # where the rank that saved it ran


class ReplicaKeeper:
    def __init__(self, run: str, node_id: str, budget_bytes: Optional[int] = None,
                 knobs: Optional[dict[str, str]] = None):
        from rayflex.constants import adopt_knobs

        adopt_knobs(knobs)  # the controller's RAYFLEX_* settings (storage endpoint, test faults)
        self.run, self.node_id = run, node_id
        self.budget_bytes = int(budget_bytes) if budget_bytes else default_budget_bytes()
        self._shards: dict[int, dict[str, Shard]] = {}  # step -> file name -> shard
        self._peers: list[Any] = []  # actor handles of the keepers that take our replicas
        self._peer_nodes: list[str] = []
        self._lock = threading.Lock()
        self.held_bytes = self.peak_held_bytes = 0
        self.refused: list[dict] = []
        self.evicted_steps: list[int] = []
        self.baseline_rss = _rss_bytes()
        # Private memory (USS: pages no other process maps), sampled after every put: what
        # the copies cost the node. RSS also counts object-store pages a call mapped, which
        # are the object store's memory, shared and freed with the call.
        self.baseline_private = self.peak_private = _private_bytes()
        self._uploads: dict[int, dict[str, str]] = {}  # step -> file name -> PENDING / UPLOADED / failed
        self._upload_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rayflex-replica-upload")

    # ----------------------------------------------------------------- peers
    def set_peers(self, peers: list[Any], peer_nodes: list[str]) -> None:
        """Where this node's primaries are replicated from now on (``peers.choose``)."""
        with self._lock:
            self._peers, self._peer_nodes = list(peers), list(peer_nodes)

    def peer_nodes(self) -> list[str]:
        return list(self._peer_nodes)

    # ----------------------------------------------------------------- keeping
    def put(self, step: int, name: str, data, *, digest: str, origin_node: str,
            role: str = PRIMARY) -> dict:
        """Keep ``name`` of ``step``; a primary is forwarded to every peer. Returns what
        happened and, for a primary, the refs of the peers' ``put``s and their nodes (a
        caller that must know where the replicas landed waits on them)."""
        data = np.frombuffer(data, dtype=np.uint8)
        got = digest_of(data)
        if got != digest:  # damaged in transit: keeping it would only poison a restore
            self.refused.append({"step": step, "file": name, "why": "digest mismatch on arrival"})
            return {"kept": False, "why": "digest mismatch on arrival", "replicas": [], "replica_nodes": []}
        # The argument is a view of the object store's buffer: the keeper's own copy is what it keeps.
        owned = data.copy()
        kept, why = self._admit(step, name, Shard(owned, digest, role, origin_node))
        self._note_memory()
        replicas, replica_nodes = [], []
        if role == PRIMARY:
            with self._lock:
                peers = list(zip(self._peers, self._peer_nodes))
            for peer, peer_node in peers:
                try:
                    replicas.append(peer.put.remote(step, name, owned, digest=digest, origin_node=origin_node,
                                                    role=REPLICA))
                    replica_nodes.append(peer_node)
                except Exception as e:  # noqa: BLE001 - a peer gone with its node: the next placement replaces it
                    log.warning("keeper %s: replica of %s (step %d) not sent: %s", self.node_id[:12], name, step, e)
        return {"kept": kept, "why": why, "replicas": replicas, "replica_nodes": replica_nodes}

    def _admit(self, step: int, name: str, shard: Shard) -> tuple[bool, str]:
        # A file costs twice its size while it arrives (the object store's buffer it came
        # in and the keeper's copy): the budget bounds that peak, not just what is held.
        size = len(shard.data)
        need = 2 * size
        with self._lock:
            old = self._shards.get(step, {}).pop(name, None)
            if old is not None:  # the same step saved again (an attempt that crashed mid-upload)
                self.held_bytes -= len(old.data)
            # Older steps make room, oldest first, but only for a file that then fits: the
            # step being written is never evicted for itself.
            older = sorted(s for s in self._shards if s < step and not self._uploading(s))
            reclaimable = sum(len(sh.data) for s in older for sh in self._shards[s].values())
            if self.held_bytes - reclaimable + need <= self.budget_bytes:
                for victim in older:
                    if self.held_bytes + need <= self.budget_bytes:
                        break
                    self._drop_step(victim)
                    self.evicted_steps.append(victim)
            if self.held_bytes + need > self.budget_bytes:
                why = (f"{size / 2**20:.1f} MiB (twice that while it arrives) does not fit the node's replica budget "
                       f"({self.budget_bytes / 2**20:.0f} MiB, {self.held_bytes / 2**20:.1f} MiB held)")
                self.refused.append({"step": step, "file": name, "why": why})
                log.warning("keeper %s: step %d %s not kept: %s", self.node_id[:12], step, name, why)
                return False, why
            self._shards.setdefault(step, {})[name] = shard
            self.held_bytes += size
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return True, ""

    def _drop_step(self, step: int) -> None:
        for shard in self._shards.pop(step, {}).values():
            self.held_bytes -= len(shard.data)

    def committed(self, step: int) -> None:
        """``step`` is committed in storage: every older step is superseded."""
        with self._lock:
            for old in [s for s in self._shards if s < step and not self._uploading(s)]:
                self._drop_step(old)
            for old in [s for s in self._uploads if s < step]:
                self._uploads.pop(old)

    def drop_after(self, step: int) -> None:
        """A restart resumes from ``step``: later steps were never committed (or were rolled back)."""
        with self._lock:
            for newer in [s for s in self._shards if s > step and not self._uploading(s)]:
                self._drop_step(newer)

    # ----------------------------------------------------------------- handed-off uploads
    def upload(self, step: int, name: str, uri: str) -> dict:
        """Write the kept ``name`` of ``step`` to ``uri`` (and its digest sidecar) in the
        background; ``{"accepted": bool, "why": str}`` at once. The file stays held while
        it uploads: ``committed``/``drop_after`` never drop a step with an upload pending."""
        with self._lock:
            shard = self._shards.get(step, {}).get(name)
            if shard is None:
                return {"accepted": False, "why": f"no {name} of step {step} held on node {self.node_id[:12]}"}
            self._uploads.setdefault(step, {})[name] = PENDING
        self._upload_pool.submit(self._upload, step, name, uri, shard)
        return {"accepted": True, "why": ""}

    def _upload(self, step: int, name: str, uri: str, shard: Shard) -> None:
        from rayflex.constants import slow_upload
        from rayflex.storage import fs as rfs

        try:
            fault = slow_upload()  # test fault injection: a slow link to storage
            if fault is not None and fault.applies_to(step):
                time.sleep(fault.seconds)
            fs, path = rfs.resolve(uri)
            data = shard.data.tobytes()
            rfs.with_retries(lambda: fs.pipe_file(path, data), what=f"write {rfs.redact_uri(uri)}")
            rfs.with_retries(lambda: fs.pipe_file(path + DIGEST_SUFFIX, shard.digest.encode()),
                             what=f"write {rfs.redact_uri(uri)}{DIGEST_SUFFIX}")
            state = UPLOADED
        except Exception as e:  # noqa: BLE001 - reported to the controller, which then does not commit
            log.error("keeper %s: upload of step %d %s failed: %s", self.node_id[:12], step, name, e)
            state = f"failed: {type(e).__name__}: {e}"
        with self._lock:
            self._uploads.setdefault(step, {})[name] = state

    def uploads(self, step: Optional[int] = None) -> dict[str, str]:
        """The handed-off uploads of ``step``: file name -> PENDING, UPLOADED or "failed: ...";
        of every step (keys ``"<step>/<file>"``) when ``step`` is None."""
        with self._lock:
            if step is not None:
                return dict(self._uploads.get(step, {}))
            return {f"{s}/{name}": state for s, files in self._uploads.items() for name, state in files.items()}

    def _uploading(self, step: int) -> bool:
        return PENDING in self._uploads.get(step, {}).values()

    # ----------------------------------------------------------------- restoring
    def inventory(self, step: int) -> dict[str, dict]:
        """What this keeper holds of ``step``: file name -> digest, size, role, origin node."""
        with self._lock:
            return {name: {"digest": s.digest, "size": len(s.data), "role": s.role, "origin_node": s.origin_node}
                    for name, s in self._shards.get(step, {}).items()}

    def read(self, step: int, name: str, ranges: list[tuple[int, int]]) -> list["np.ndarray"]:
        """The byte ranges ``(offset, length)`` of a kept file (what one rank's load plan
        needs), as views: Ray copies each once into the object store."""
        with self._lock:
            shard = self._shards.get(step, {}).get(name)
        if shard is None:
            raise KeyError(f"keeper on node {self.node_id[:12]} holds no {name} of step {step}")
        return [shard.data[offset:offset + length] for offset, length in ranges]

    # ----------------------------------------------------------------- accounting
    def stats(self) -> dict:
        """Bytes held now and at most, and this process's resident memory (measured)."""
        with self._lock:
            steps = {s: sorted(files) for s, files in self._shards.items()}
        return {"node_id": self.node_id, "budget_bytes": self.budget_bytes, "held_bytes": self.held_bytes,
                "peak_held_bytes": self.peak_held_bytes, "steps": steps, "refused": list(self.refused),
                "evicted_steps": list(self.evicted_steps), "rss_bytes": _rss_bytes(),
                "peak_rss_bytes": _peak_rss_bytes(), "baseline_rss_bytes": self.baseline_rss,
                "private_bytes": _private_bytes(), "peak_private_bytes": self.peak_private,
                "baseline_private_bytes": self.baseline_private,
                "peers": self.peer_nodes(), "pid": os.getpid()}


    def _note_memory(self) -> None:
        self.peak_private = max(self.peak_private, _private_bytes())


def _private_bytes() -> int:
    import psutil

    try:
        return psutil.Process().memory_full_info().uss
    except (psutil.Error, AttributeError):
        return _rss_bytes()


def default_budget_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total * DEFAULT_BUDGET_FRACTION)


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """The process's high-water resident memory (Linux VmHWM; elsewhere the current RSS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _rss_bytes()
