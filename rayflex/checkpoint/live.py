"""Live recovery's bytes: the survivors' state of their last finished step, taken in memory
and loaded by the next attempt's ranks at whatever size the cluster now has.

A survivor that left a broken attempt still holds its shards of the model and optimizer
(the update of its last finished step applied, the next one not begun). ``take_snapshot``
writes them with DCP, without collectives (the attempt's are aborted), into memory: the
same raw-tensor shard file and ``.metadata`` a checkpoint has, one set per survivor, each
file the views of the tensors DCP wrote. The controller holds them in Ray's object store
(it owns what the survivors return — Ray copies them in once — so they outlive a survivor
it lets go) and hands their references to the next attempt.

``merge_metadata`` makes one checkpoint of several survivors' files: every chunk of every
tensor once (HSDP replicas hold the same chunks; the lowest rank's copy is read), each
pointing into the survivor's files that hold it; a tensor not wholly covered is refused.
``load_live`` then loads it exactly as a checkpoint from storage — DCP plans the load and
reshards from the old mesh to the new one — so a live recovery and a restore from storage
of the same step give the same bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import math
import os
import pickle
import time
import uuid
import warnings
from typing import Any, Callable, Optional

from rayflex.checkpoint.dcp_io import CheckpointReader, CheckpointWriter

LIVE_URI = "live peers"  # what a checkpoint_loaded event names as the source of a live recovery
_ROOT = "memory://rayflex-live"


class LiveStateIncomplete(RuntimeError):
    """The survivors' files do not hold every chunk of the state: a live recovery is not possible."""


class _Kept:
    """A write stream that keeps what DCP writes as uint8 views of it, one part per write
    (no copy: a survivor's tensors are not touched again, and Ray copies the parts once,
    into its object store, when ``take_live`` returns them). A copy into one new array
    here cost more than the copy itself: the first touch of that much fresh memory, ~0.5 s
    for 210 MB on the 2-core test host."""

    def __init__(self) -> None:
        self.parts: list = []

    def write(self, data) -> int:
        import numpy as np

        part = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        self.parts.append(part)
        return part.nbytes


class _InMemory:
    """DCP's filesystem interface over a dict (path -> the file's parts, uint8 arrays):
    a snapshot's files are views of the tensors (no file layer, no fingerprint: they never
    leave memory unread)."""

    def __init__(self) -> None:
        self.files: dict[str, list] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            raise io.UnsupportedOperation("a snapshot being taken is write-only")
        stream = _Kept()
        yield stream
        self.files[os.fspath(path)] = stream.parts

    def concat_path(self, path, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def mkdir(self, path) -> None:
        pass

    def exists(self, path) -> bool:
        return os.fspath(path) in self.files

    def rm_file(self, path) -> None:
        self.files.pop(os.fspath(path), None)

    def rename(self, path, new_path) -> None:
        self.files[os.fspath(new_path)] = self.files.pop(os.fspath(path))


def take_snapshot(state, *, rank: int, step: int, node_id: str = "",
                  misplaced: Optional[Callable[[dict], list]] = None) -> tuple[dict, dict[str, Any]]:
    """``state`` (a ``TrainState``) of finished step ``step``, serialized in memory without
    collectives: (info, files). ``info`` is small (the DCP metadata's bytes, the run-level
    extras, the survivor's old rank and step); ``files`` maps file name -> its parts (uint8 views).
    ``misplaced``: the keys of the state whose shards would name another rank's place;
    any is a RuntimeError (no snapshot rather than a wrong one)."""
    import torch.distributed.checkpoint as dcp

    from rayflex.checkpoint.checkpointer import OWN

    t0 = time.perf_counter()
    writer = CheckpointWriter(f"{_ROOT}/{uuid.uuid4().hex}")
    memory = writer.fs = _InMemory()
    writer.sync_files = False
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to save in a single process")
        tensors = state.tensor_state()
        tensors.pop(OWN, None)  # a rank's own tensors: a restart from live peers starts them afresh
        wrong = misplaced(tensors) if misplaced is not None else []
        if wrong:
            raise RuntimeError(f"{wrong[0]} (and {len(wrong) - 1} more) hold another rank's mesh coordinate "
                               "(a stale sharding cache)")
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    files, metadata = {}, None
    for full, parts in memory.files.items():
        name = full.rsplit("/", 1)[-1]
        if name.endswith(".metadata"):
            metadata = b"".join(part.tobytes() for part in parts)
        elif name.endswith(".distcp"):
            files[name] = parts
    if metadata is None:
        raise RuntimeError("the live snapshot wrote no .metadata")
    info = {"rank": rank, "node_id": node_id, "step": step, "metadata": metadata, "extra": state.extra_state(),
            "bytes": sum(int(p.nbytes) for parts in files.values() for p in parts),
            "snapshot_s": time.perf_counter() - t0}
    return info, files


def merge_metadata(metadatas: dict[int, Any]) -> Any:
    """One DCP ``Metadata`` over several survivors' snapshots (old rank -> its Metadata):
    every chunk once, read from the lowest rank holding it (relative paths ``r<rank>/<file>``).
    Raises ``LiveStateIncomplete`` naming a tensor whose chunks do not cover it."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    state_md: dict[str, Any] = {}
    storage: dict = {}
    planner_data: dict = {}
    first = None
    for rank in sorted(metadatas):
        md = metadatas[rank]
        first = first or md
        planner_data.update(md.planner_data or {})
        for fqn, item in md.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):
                state_md.setdefault(fqn, item)
                continue
            have = state_md.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
            known = {tuple(c.offsets) for c in have.chunks}
            have.chunks.extend(c for c in item.chunks if tuple(c.offsets) not in known)
        for index, info in md.storage_data.items():
            if index not in storage:  # MetadataIndex compares by (fqn, offset): one copy of a chunk
                storage[index] = dataclasses.replace(info, relative_path=f"r{rank}/{info.relative_path}")
    if first is None:
        raise LiveStateIncomplete("no survivor took a snapshot")
    for fqn, item in state_md.items():
        if isinstance(item, TensorStorageMetadata):
            held = sum(math.prod(c.sizes) for c in item.chunks)
            if held != math.prod(item.size):
                raise LiveStateIncomplete(f"{fqn}: the survivors hold {held} of its {math.prod(item.size)} "
                                          "elements (a shard whose every copy was lost)")
    return Metadata(state_dict_metadata=state_md, planner_data=planner_data, storage_data=storage,
                    storage_meta=first.storage_meta, version=first.version)


class _PartsView(io.RawIOBase):
    """A read-only stream over a survivor's file in memory, the parts its writes left: the
    reader copies each entry straight from them into its destination (joining them into
    one buffer first would copy the whole file)."""

    def __init__(self, parts: list) -> None:
        super().__init__()
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._starts, at = [], 0
        for part in self._parts:
            self._starts.append(at)
            at += len(part)
        self._size, self._at = at, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer) -> int:
        target = memoryview(buffer).cast("B")
        done = 0
        while done < len(target) and self._at < self._size:
            i = bisect.bisect_right(self._starts, self._at) - 1
            part, within = self._parts[i], self._at - self._starts[i]
            n = min(len(target) - done, len(part) - within)
            target[done:done + n] = part[within:within + n]
            done += n
            self._at += n
        return done


class _SnapshotFiles:
    """The reader's filesystem: ``r<rank>/<file>`` is served from that survivor's files,
    fetched (``fetch(rank)``) the first time this rank's plan reads one of them."""

    def __init__(self, base, fetch: Callable[[int], dict]) -> None:
        self.base, self._fetch = base, fetch
        self._files: dict[int, dict] = {}
        self.fetched_ranks: list[int] = []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def files_of(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = self._fetch(rank)
            self.fetched_ranks.append(rank)
        return self._files[rank]

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode:
            raise io.UnsupportedOperation("a live snapshot is read-only")
        holder, name = os.fspath(path).rsplit("/", 2)[-2:]
        yield _PartsView(self.files_of(int(holder[1:]))[name])


class LiveReader(CheckpointReader):
    """DCP's reader over merged survivors' snapshots (``merge_metadata``)."""

    def __init__(self, metadata, fetch: Callable[[int], dict]) -> None:
        super().__init__(f"{_ROOT}-read")
        self._metadata = metadata
        self.fs = _SnapshotFiles(self.fs, fetch)


def load_live(state, live: dict, *, group=None, node_id: str = "") -> dict:
    """Load ``live`` (the controller's ``{"step", "infos": rank -> info, "files": rank ->
    files or a Ray reference to them}``) into ``state`` (a ``TrainState``), resharded to this
    attempt's mesh. Returns what ``AsyncCheckpointer.load_latest`` returns of a checkpoint,
    with ``uri`` = ``LIVE_URI``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rayflex.checkpoint.checkpointer import OWN, packed_hparams

    infos = live["infos"]
    metadata = merge_metadata({int(r): pickle.loads(info["metadata"]) for r, info in infos.items()})

    def fetch(rank: int) -> dict:
        files = live["files"][rank]
        if isinstance(files, dict):
            return files
        import ray

        return ray.get(files)

    reader = LiveReader(metadata, fetch)
    tensors = state.tensor_state(packed=packed_hparams(metadata.state_dict_metadata))
    tensors.pop(OWN, None)  # no snapshot holds any
    t0 = time.perf_counter()
    dcp.load(tensors, storage_reader=reader, process_group=group if dist.is_initialized() else None,
             no_dist=not dist.is_initialized())
    load_s = time.perf_counter() - t0
    state.load_tensor_state(tensors)
    extra = infos[min(infos)]["extra"]  # run-level extras: the same on every rank but the RNG
    state.load_extra(extra)
    read = reader.fs.fetched_ranks
    remote = [r for r in read if infos[r].get("node_id") != node_id]
    return {"step": int(live["step"]), "uri": LIVE_URI, "world_size": int(live.get("world_size", 0)),
            "mesh": live.get("mesh", {}), "skipped": [], "load_s": load_s,
            "total_steps": extra.get("total_steps"), "sample_order": extra.get("sample_order"),
            "recent_steps": [r for r in extra.get("recent_steps") or [] if r["step"] <= int(live["step"])],
            "sources": {"files": {"live_peer": len(read)}, "fell_back": {}, "remote_reads": len(remote),
                        "holders": sorted(read)}}
