"""A rank's side of hang diagnosis: torch's collective flight recorder, read on demand.

torch's c10d flight recorder keeps a ring of the process's last N collectives and
point-to-point ops over every process group — gloo's as well as NCCL's — each with its
sequence number in its group, op, tensor sizes and dtypes, and whether it completed.
rayflex turns it on before the first process group exists (``TORCH_FR_BUFFER_SIZE``;
``ElasticConfig.flight_recorder`` entries, 0 = off) and reads it only when the controller
investigates a hang: one C++ call, which answers while the training thread is blocked
inside a collective. Nothing is recorded in Python on the training path.

:class:`GroupLabels` names each process group by its role in the mesh, so a verdict says
"the dp group (ranks 2, 3)" rather than torch's group number; :func:`read_flight_record`
turns the dump into :class:`~rayflex.worker.status.FlightRecord` (torch-free, for the
controller), keeping only this attempt's entries (a reused process's recorder still holds
the previous attempt's, whose group numbers the new groups reuse).

torch's recorder does not see gloo's point-to-point ops (a pipeline's sends and
receives): :class:`P2PLog` records those in rayflex, at the one call every pipeline
schedule makes for them (``schedules._batch_p2p``): op, peer, shape, and the Work, whose
``is_completed()`` says at read time whether the op finished.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import pickle
import threading
import time
from typing import Any, Optional

from rayflex.worker.status import CollectiveEntry, FlightRecord

log = logging.getLogger(__name__)

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"

# torch's profiling names (backend prefix stripped) -> the collective a user calls.
_OP_NAMES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "_allgather_base": "all_gather",
    "allgather": "all_gather", "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reducescatter": "reduce_scatter", "alltoall_base": "all_to_all",
    "alltoall": "all_to_all", "sendrecv": "p2p",
}


def enable(entries: int) -> bool:
    """Turn the recorder on for this process (before its first process group is made).
    A value the user set in the environment wins. Returns whether it is on."""
    if os.environ.get(BUFFER_ENV):
        return int(os.environ[BUFFER_ENV]) > 0
    if entries <= 0:
        return False
    os.environ[BUFFER_ENV] = str(int(entries))
    return True


class GroupLabels:
    """torch's process-group names -> (role, global ranks) for one attempt."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[str, tuple]] = {}

    def add(self, group: Any, label: str) -> None:
        import torch.distributed as dist

        if group is None:
            return
        name = str(group.group_name)
        # The first role given wins: the world group is named before the mesh's groups, and
        # a mesh dimension that spans the world may be the world group itself.
        self._by_name.setdefault(name, (label, tuple(dist.get_process_group_ranks(group))))

    def add_mesh(self, mesh: Any, plan: Any) -> None:
        """The device mesh's groups, one per dimension larger than 1."""
        for dim in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(dim)) > 1:
                self.add(mesh.get_group(dim), _mesh_label(dim, plan))

    def of(self, name: str, desc: str = "") -> tuple[str, tuple]:
        return self._by_name.get(str(name), (f"group {desc or name}", ()))


class P2PLog:
    """The pipeline's point-to-point ops of this process, numbered per group (a bounded
    ring, like torch's recorder). One per process (:meth:`install`); :meth:`attach` hooks
    the schedules' p2p entry point once a pipeline is built; :meth:`reset` starts an
    attempt's numbering."""

    _installed: Optional["P2PLog"] = None

    def __init__(self, entries: int) -> None:
        self._ring: collections.deque = collections.deque(maxlen=max(1, entries))
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._attached = False

    @classmethod
    def install(cls, entries: int) -> "P2PLog":
        """The process's log; it records once :meth:`attach` has hooked the schedules."""
        if cls._installed is None:
            cls._installed = cls(entries)
        return cls._installed

    def attach(self) -> None:
        """Hook the pipeline schedules' p2p entry point (once per process). Called when a
        pipeline is built, so that a run without one never imports torch's pipelining
        package (~1 s of CPU per worker start)."""
        with self._lock:
            if self._attached:
                return
            from torch.distributed.pipelining import schedules

            original = schedules._batch_p2p

            def recorded(p2p_ops, desc=None):
                works = original(p2p_ops, desc=desc)
                self.note(p2p_ops, works)
                return works

            schedules._batch_p2p = recorded
            self._attached = True

    def reset(self) -> None:
        with self._lock:
            self._ring.clear()
            self._seq.clear()

    def note(self, p2p_ops, works) -> None:
        works = list(works or [])
        now = time.time()
        with self._lock:
            for i, p in enumerate(p2p_ops):
                name = str(getattr(p.group, "group_name", "0")) if p.group is not None else "0"
                self._seq[name] = self._seq.get(name, 0) + 1
                op = getattr(p.op, "__name__", str(p.op))
                work = works[i] if len(works) == len(p2p_ops) else (works[-1] if works else None)
                self._ring.append((name, self._seq[name], "send" if "send" in op else "recv",
                                   tuple(p.tensor.shape), str(p.tensor.dtype).replace("torch.", ""), now, work))

    def entries(self) -> list[tuple]:
        """(group name, seq, op, shape, dtype, time, completed) per op, oldest first."""
        with self._lock:
            ring = list(self._ring)
        out = []
        for name, seq, op, shape, dtype, t, work in ring:
            try:
                done = work is None or bool(work.is_completed())
            except Exception:  # noqa: BLE001 - a Work of a destroyed group
                done = True
            out.append((name, seq, op, shape, dtype, t, done))
        return out


def _mesh_label(dim: str, plan: Any) -> str:
    if dim == "dp_shard" and getattr(plan, "dp_replicate", 1) == 1:
        return "dp"
    return dim


def _op_name(profiling_name: str) -> str:
    op = profiling_name.split(":", 1)[-1]
    return _OP_NAMES.get(op, op)


def read_flight_record(rank: int, step: int, phase: str, labels: Optional[GroupLabels], since_s: float,
                       step_starts: list[tuple[float, int]], p2p_log: Optional[P2PLog] = None) -> FlightRecord:
    """This rank's collectives issued since ``since_s`` (the attempt's start), oldest
    first. ``step_starts``: (time, step) of each step started, oldest first, to tell which
    step an op belongs to."""
    if not os.environ.get(BUFFER_ENV) or int(os.environ[BUFFER_ENV]) <= 0:
        return FlightRecord(rank=rank, step=step, phase=phase, available=False,
                            error="the flight recorder is off (ElasticConfig.flight_recorder=0)")
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    except Exception as e:  # noqa: BLE001 - a torch without the recorder: say so, do not fail
        return FlightRecord(rank=rank, step=step, phase=phase, available=False,
                            error=f"torch's flight recorder could not be read: {type(e).__name__}: {e}")
    labels = labels or GroupLabels()
    starts = [t for t, _ in step_starts]
    entries = []
    for raw in dump.get("entries", []):
        created = raw.get("time_created_ns", 0) / 1e9
        if created < since_s:
            continue
        name, desc = (tuple(raw.get("process_group") or ("", "")) + ("", ""))[:2]
        label, members = labels.of(name, desc)
        p2p = bool(raw.get("is_p2p"))
        i = bisect.bisect_right(starts, created) - 1
        entries.append(CollectiveEntry(
            group=label, members=members, seq=int(raw.get("p2p_seq_id" if p2p else "collective_seq_id") or 0),
            op=_op_name(str(raw.get("profiling_name", "?"))),
            sizes=tuple(tuple(s) for s in raw.get("input_sizes") or ()),
            dtypes=tuple(str(d).lower() for d in raw.get("input_dtypes") or ()),
            completed=bool(raw.get("retired")) or raw.get("state") == "completed", p2p=p2p, started=created,
            step=step_starts[i][1] if i >= 0 else 0))
    # gloo's p2p ops, from rayflex's log (torch's recorder has them on NCCL only).
    recorded_p2p = {(e.group, e.members) for e in entries if e.p2p}
    for name, seq, op, shape, dtype, created, done in (p2p_log.entries() if p2p_log is not None else []):
        label, members = labels.of(name)
        if created < since_s or (label, members) in recorded_p2p:
            continue
        i = bisect.bisect_right(starts, created) - 1
        entries.append(CollectiveEntry(group=label, members=members, seq=seq, op=op, sizes=(shape,),
                                       dtypes=(dtype,), completed=done, p2p=True, started=created,
                                       step=step_starts[i][1] if i >= 0 else 0))
    entries.sort(key=lambda e: e.started)
    return FlightRecord(rank=rank, step=step, phase=phase, entries=tuple(entries))
