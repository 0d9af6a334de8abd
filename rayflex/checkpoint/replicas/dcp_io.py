"""DCP's writer and reader with memory replicas: the same files, a faster way to them.

Save (``ReplicatingWriter``): DCP serializes a rank's shard file into memory instead of a
storage stream; the bytes then go to the node's keeper (``ReplicaClient.keep``, which
replicates them) and to storage as one object, followed by its ``<file>.digest`` sidecar.
The sidecar is written before DCP's ``.metadata`` and the commit marker, so the manifest
covers it: a memory copy is used only if it matches what the committed step holds.

Load (``MemoryFirstReader``): DCP plans the load exactly as from storage (it reshards from
whatever layout saved the step); each rank then fetches the byte ranges its plan needs of
every shard file from a keeper holding a verified copy — its own node's first — and reads
from storage only the files no keeper can give it. What came from where is ``report``.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import os
import time
from typing import Optional

from rayflex.checkpoint.replicas.holders import OWN_COPY, REPLICA, STORAGE, Holder
from rayflex.checkpoint.replicas.keeper import digest_of
from rayflex.storage import fs as rfs
from rayflex.checkpoint.dcp_io import SHARD_SUFFIX, CheckpointReader, CheckpointWriter, PrefixFileSystem
from rayflex.checkpoint.manifest import DIGEST_SUFFIX

log = logging.getLogger(__name__)


class _CapturedFile(io.BytesIO):
    """An in-memory shard file that keeps its bytes when DCP closes it."""

    value: bytes = b""

    def close(self) -> None:
        if not self.closed:
            self.value = self.getvalue()
        super().close()


class _KeepingFileSystem(PrefixFileSystem):
    def __init__(self, fs, on_shard) -> None:
        super().__init__()
        self.fs, self._on_shard = fs, on_shard

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or not os.fspath(path).endswith(SHARD_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        captured = _CapturedFile()
        yield captured
        captured.close()
        self._on_shard(os.fspath(path), captured.value)


class ReplicatingWriter(CheckpointWriter):
    """``CheckpointWriter`` whose shard files also go to memory replicas: each is confirmed
    on its node's keeper and its peers' (``kept``) before it is uploaded.

    In an ``emergency`` save (a spot notice) the rank uploads nothing: it hands each file's
    upload to a keeper that stays — its own node's if the node is not leaving, else a peer's
    holding the confirmed replica — and is done once that keeper took it. A preempted node
    then needs the notice to replicate, not to upload; the controller commits the step when
    the keepers' uploads are done (``control.handoff``). A file no
    keeper can take is uploaded by the rank as usual.
    """

    def __init__(self, path: str, *, step: int, client, emergency: bool = False, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.uri, self.step, self.client, self.emergency = path, step, client, emergency
        abandoned = self.fs.abandoned
        self.fs = _KeepingFileSystem(self.fs.fs, self._keep_and_upload)
        self.fs.abandoned = abandoned
        self.kept: dict[str, list[str]] = {}  # shard file -> nodes whose keepers confirmed a copy
        self.handed_off: dict[str, str] = {}  # shard file -> node whose keeper uploads it
        self.kept_until: Optional[float] = None  # time.time() when the last file was confirmed in memory
        self.upload_delay_s = 0.0  # test fault injection: a slow link to storage (RAYFLEX_SLOW_UPLOAD)

    @property
    def off_node(self) -> bool:
        """Every shard file of this rank has a confirmed copy on another node."""
        return bool(self.kept) and all(any(n != self.client.node_id for n in nodes) for nodes in self.kept.values())

    def _keep_and_upload(self, path: str, data: bytes) -> None:
        name = path.rsplit("/", 1)[-1]
        self.fs.check_abandoned()
        digest = digest_of(data)
        leaving = self.client.node_id in self.client.leaving_nodes
        try:
            # An emergency save on a node that stays needs only its own node's copy.
            self.kept[name] = self.client.keep(self.step, name, data, digest=digest,
                                               off_node=leaving or not self.emergency)
        except Exception as e:  # noqa: BLE001 - memory is an extra: storage is the checkpoint
            log.warning("step %d %s: not kept in memory: %s", self.step, name, e)
            self.kept[name] = []
        self.kept_until = max(self.kept_until or 0.0, time.time())
        self.fs.check_abandoned()  # the copies in memory are harmless; an upload now could land in a later attempt's step
        if self.emergency:
            target = self.client.upload_keeper(self.kept[name])
            if target is not None and self.client.hand_off(target, self.step, name, rfs.join(self.uri, name)):
                self.handed_off[name] = target
                return
        if self.upload_delay_s:
            time.sleep(self.upload_delay_s)
        fs = self.fs.fs
        rfs.with_retries(lambda: fs.pipe_file(path, data), what=f"write {rfs.redact_uri(path)}")
        rfs.with_retries(lambda: fs.pipe_file(path + DIGEST_SUFFIX, digest.encode()),
                         what=f"write {rfs.redact_uri(path)}{DIGEST_SUFFIX}")


class _FetchedRanges(io.RawIOBase):
    """A read-only file of which only some byte ranges are present (those a load plan
    reads); reading outside them is an error, never silent zeros."""

    def __init__(self, chunks: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._chunks = sorted(chunks, key=lambda c: c[0])
        self._starts = [offset for offset, _ in self._chunks]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._pos
        elif whence == os.SEEK_END:
            raise io.UnsupportedOperation("a partly fetched file has no known end")
        self._pos = offset
        return self._pos

    def readinto(self, b) -> int:
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i < 0:
            raise OSError(f"offset {self._pos} was not fetched")
        start, chunk = self._chunks[i]
        inside = self._pos - start
        if inside >= len(chunk):
            if inside == len(chunk):
                return 0  # the end of a fetched range: a view never reads past it
            raise OSError(f"offset {self._pos} was not fetched")
        n = min(len(b), len(chunk) - inside)
        memoryview(b)[:n] = memoryview(chunk)[inside:inside + n]
        self._pos += n
        return n


class _MemoryFirstFileSystem:
    """The reader's filesystem, except that fetched shard files are served from memory."""

    def __init__(self, base, fetched: dict[str, _FetchedRanges]) -> None:
        self.base, self.fetched = base, fetched

    def __getattr__(self, name):
        return getattr(self.base, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        fetched = self.fetched.get(os.fspath(path))
        if fetched is None or "r" not in mode:
            with self.base.create_stream(path, mode) as stream:
                yield stream
        else:
            fetched.seek(0)
            yield fetched


class MemoryFirstReader(CheckpointReader):
    def __init__(self, path: str, *, step: int, holders: dict[str, list[Holder]], client,
                 missing: Optional[dict[str, str]] = None, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.step, self.holders, self.client = step, holders, client
        self.missing = dict(missing or {})
        self.report: dict = {"files": {OWN_COPY: 0, REPLICA: 0, STORAGE: 0}, "memory_bytes": 0, "remote_reads": 0,
                             "memory_read_s": 0.0, "fell_back": {}}

    def _start(self, holder: Holder, name: str, ranges: list):
        try:
            return self.client.start_read(holder, self.step, name, ranges)
        except Exception as e:  # noqa: BLE001 - raised again where this copy is read
            return e

    def read_data(self, plan, planner):
        ranges: dict[str, set] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, set()).add((info.offset, info.length))
        fetched: dict[str, _FetchedRanges] = {}
        t0 = time.perf_counter()
        wanted = {name: sorted(r) for name, r in ranges.items()}
        # Every file's best copy is asked for at once; a copy that fails falls to the next.
        pending = {}
        for name in sorted(wanted):
            candidates = self.client.order(self.holders.get(name, []))
            if candidates:
                pending[name] = (candidates, self._start(candidates[0], name, wanted[name]))
        for name in sorted(wanted):
            candidates, first = pending.get(name, ([], None))
            for i, holder in enumerate(candidates):
                try:
                    request = first if i == 0 else self._start(holder, name, wanted[name])
                    if isinstance(request, Exception):
                        raise request
                    chunks = self.client.finish_read(request)
                except Exception as e:  # noqa: BLE001 - that copy is gone: the next one, or storage
                    log.warning("step %d %s: memory copy on %s unreadable: %s", self.step, name,
                                holder.node_id[:12], e)
                    self.report["fell_back"][name] = f"copy on node {holder.node_id[:12]} unreadable: {e}"
                    continue
                fetched[os.fspath(self.fs.concat_path(self.path, name))] = _FetchedRanges(
                    [(offset, chunk) for (offset, _), chunk in zip(wanted[name], chunks)])
                self.report["files"][holder.source] += 1
                self.report["remote_reads"] += holder.node_id != self.client.node_id
                self.report["memory_bytes"] += sum(len(c) for c in chunks)
                self.report["fell_back"].pop(name, None)
                break
            else:
                self.report["files"][STORAGE] += 1
                if name not in self.report["fell_back"]:
                    self.report["fell_back"][name] = self.missing.get(name, "no memory copy")
        self.report["memory_read_s"] = time.perf_counter() - t0
        base = self.fs
        self.fs = _MemoryFirstFileSystem(base, fetched)
        try:
            return super().read_data(plan, planner)
        finally:
            self.fs = base
