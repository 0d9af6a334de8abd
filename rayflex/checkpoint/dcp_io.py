"""DCP's fsspec writer and reader, made safe for object stores, with tensors stored raw.

``torch.distributed.checkpoint``'s ``FsspecWriter`` calls ``fs.makedirs(step_dir)`` on
every rank before it writes a shard. On S3 a "directory" is only a key prefix, and s3fs
implements ``makedirs`` by checking that the *bucket* exists and, when that check says
no, by calling ``CreateBucket``. The check says no whenever the identity may not list the
bucket, or the endpoint is briefly unreachable — so a checkpoint writer would try to
create buckets on a real account (seen: ``OSError: The specified location-constraint is
not valid`` during an outage). Here directories are made only where they exist
(``fs.ensure_dir``): object-store writes are plain ``PutObject``s under a prefix.

Tensors are stored as their bytes (``RAW_TENSOR``), not as one ``torch.save`` archive per
tensor as DCP's writer does: that archive (a zip container and a pickle per tensor) was
half of an asynchronous save's CPU for a small GPT, all of it taken from training. The
layout is DCP's (its ``.metadata``, its plans, its resharding); only the bytes of a tensor
entry differ, and :class:`CheckpointReader` reads both those and DCP's own archives (so
checkpoints written before the raw format still load). DCP's stock readers refuse raw
entries by name ("unknown extension") rather than misread them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import threading
from typing import Optional

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

from rayflex.constants import knob
from rayflex.storage import fs as rfs
from rayflex.checkpoint import manifest as mf
from rayflex.checkpoint.save_plan import PackedWriteResults, SavePlanCache, metadata_file_bytes, storage_index_of


class SaveAbandoned(RuntimeError):
    """The attempt a save belongs to is over (a peer died): the save can never commit, so
    none of its files is written from here on, and the rank is free to leave."""


SHARD_SUFFIX = ".distcp"  # DCP's shard files (one per rank with single_file_per_rank)
# The transform descriptor of a tensor entry stored as its bytes: C order, native byte
# order (little-endian on every platform torch ships for), dtype and shape from .metadata.
RAW_TENSOR = "rayflex.raw-tensor.v1"


class _HashingStream:
    """A write stream that also hashes what goes through it (DCP only appends)."""

    def __init__(self, stream, hasher) -> None:
        self._stream, self._hasher = stream, hasher

    def write(self, data) -> int:
        written = self._stream.write(data)
        self._hasher.update(data)
        return written

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class PrefixFileSystem(FileSystem):
    """DCP's fsspec filesystem, except that ``mkdir`` never reaches a bucket, no file is
    opened for writing once ``abandoned`` is set, and each shard file gets the fingerprint
    of its bytes beside it (``manifest.DIGEST_SUFFIX``; not on S3, where the commit uses the
    ETag): the commit then records it without reading the file back. On an object store a
    shard file leaves in one PUT (``_one_put``)."""

    abandoned: Optional[threading.Event] = None

    def mkdir(self, path: str | os.PathLike) -> None:
        rfs.ensure_dir(self.fs, os.fspath(path))

    def check_abandoned(self) -> None:
        if self.abandoned is not None and self.abandoned.is_set():
            raise SaveAbandoned("the attempt this checkpoint belongs to is over; it can never commit")

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        writing = "w" in mode
        if writing:
            self.check_abandoned()
        shard = writing and os.fspath(path).endswith(SHARD_SUFFIX)
        hasher = mf.ContentDigest() if shard and not rfs.is_s3(self.fs) else None
        opened = (self._one_put(path, mode) if shard and rfs.is_object_store(self.fs)
                  else super().create_stream(path, mode))
        with opened as stream:
            yield stream if hasher is None else _HashingStream(stream, hasher)
        if hasher is None:
            return
        digest_path = f"{os.fspath(path)}{mf.DIGEST_SUFFIX}"
        rfs.with_retries(lambda: self.fs.pipe_file(digest_path, hasher.fingerprint().encode()),
                         what=f"write {rfs.redact_uri(digest_path)}")


    @contextlib.contextmanager
    def _one_put(self, path, mode: str):
        """A shard file on an object store, buffered whole up to twice ``object_bytes()``, so
        one of ``CheckpointWriter.write_data``'s objects leaves in one PUT (fsspec's default
        block, 5-50 MB, makes it a multipart upload: two more round trips, and an endpoint
        that assembles parts itself copies the object once more). Removed if writing fails,
        as DCP's own stream is."""
        path = os.fspath(path)
        # (5 MB: the least block s3fs accepts, S3's smallest multipart part.)
        with self.fs.open(path, mode, block_size=max(2 * object_bytes(), 5 << 20)) as stream:
            try:
                yield stream
            except BaseException:
                with contextlib.suppress(Exception):
                    self.rm_file(path)
                raise


def object_bytes() -> int:
    """About how large one object of a rank's shard on an object store is."""
    return int(knob("CHECKPOINT_OBJECT_MB")) << 20


class CheckpointWriter(FsspecWriter):
    """``FsspecWriter`` that writes object-store checkpoints as prefixes (no bucket calls)
    and tensors as their bytes (``RAW_TENSOR``); ``kwargs`` are the fsspec constructor
    options (``fs.fsspec_kwargs``). ``abandoned``: set when the save can no longer commit
    (``AsyncCheckpointer.abandon``)."""

    def __init__(self, path: str, abandoned: Optional[threading.Event] = None,
                 plans: Optional[SavePlanCache] = None, **kwargs) -> None:
        """``plans``: the checkpointer's :class:`~rayflex.checkpoint.save_plan.SavePlanCache`
        (rank 0 then writes the last save's ``.metadata`` bytes again while nothing changed)."""
        super().__init__(path, **kwargs)
        fs = PrefixFileSystem()
        fs.fs = self.fs.fs  # the instance DCP already made from these options
        fs.abandoned = abandoned
        self.fs = fs
        self.plans = plans

    def finish(self, metadata, results) -> None:
        """Rank 0: write ``.metadata`` (DCP's ``finish``, from packed write results)."""
        data = (self.plans.metadata_file(metadata, results) if self.plans is not None
                else metadata_file_bytes(metadata, storage_index_of(results)))
        # DCP's names: one .metadata, or a rank's own when the save ran without collectives.
        final = self._get_metadata_path(None if self.use_collectives or self.rank is None else self.rank)
        tmp_path = f"{final}.tmp"
        with self.fs.create_stream(tmp_path, "wb") as stream:
            stream.write(data)
            if self.sync_files:
                with contextlib.suppress(AttributeError, OSError):
                    os.fsync(stream.fileno())
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(tmp_path, final)

    def write_data(self, plan, planner):
        """DCP's ``write_data``, except on an object store: there a rank's entries go into
        objects of about ``object_bytes()`` (at least ``thread_count`` of them), each one
        PUT, ``thread_count`` in flight at once — DCP's one file per thread is a multipart
        upload whose parts leave one after another."""
        fs = getattr(self.fs, "fs", None)  # a live snapshot's writer has a dict for a filesystem
        if not (self.single_file_per_rank and fs is not None and rfs.is_object_store(fs)):
            return super().write_data(plan, planner)
        from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type
        from torch.distributed.checkpoint.planner import WriteItemType

        tensor_bytes = sum(_item_size(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
        objects = max(self.thread_count, math.ceil(tensor_bytes / object_bytes()))
        file_queue: queue.Queue = queue.Queue()
        for i, bucket in enumerate(b for b in _split_by_size_and_type(objects, plan.items) if b):
            name = f"{plan.storage_data.prefix}{i}{SHARD_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, file_queue)

    def _write_data(self, planner, file_queue: queue.Queue):
        """DCP's ``_write_data`` (the files of this rank's plan, ``thread_count`` at a time),
        each tensor written as its bytes."""
        from torch.futures import Future

        rows: list = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def drain() -> None:
            while not errors:
                try:
                    path, name, items = file_queue.get_nowait()
                except queue.Empty:
                    return
                try:
                    written = self._write_file(planner, path, name, items)
                except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                    errors.append(e)
                    return
                with lock:
                    rows.extend(written)

        helpers = [threading.Thread(target=drain, name="rayflex-shard-writer", daemon=True)
                   for _ in range(1, self.thread_count)]
        for t in helpers:
            t.start()
        drain()
        for t in helpers:
            t.join()
        if errors:
            raise errors[0]
        done: Future = Future()
        done.set_result(PackedWriteResults.from_rows(rows))
        return done

    def _write_file(self, planner, path, name: str, items) -> list[tuple]:
        """Write ``items`` to the file ``name``; a ``PackedWriteResults`` row per item."""
        from torch.distributed.checkpoint.planner import WriteItemType

        cache = getattr(planner, "plan_cache", None)
        views = cache.payload_views if cache is not None else None
        rows, offset = [], 0
        with self.fs.create_stream(path, "wb") as stream:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    payload, descriptors = planner.resolve_data(item).getbuffer(), None
                else:
                    descriptors = [RAW_TENSOR]
                    kept = views.get(id(item)) if views is not None else None
                    if kept is not None and kept[0] is item:
                        payload = kept[1]
                    else:
                        payload = self._tensor_payload(item, planner.resolve_data(item), views)
                stream.write(payload)
                n = payload.nbytes
                index = item.index
                rows.append((index.fqn, None if index.offset is None else tuple(index.offset), index.index,
                             name, offset, n, descriptors))
                offset += n
            if self.sync_files:
                with contextlib.suppress(AttributeError, OSError):
                    os.fsync(stream.fileno())
        return rows

    @staticmethod
    def _tensor_payload(item, data, views: Optional[dict]) -> memoryview:
        """The bytes of a tensor entry, checked against its planned chunk; kept in ``views``
        (the plan cache's, for buffers that only change in place) when they are a view."""
        payload = tensor_bytes(data)
        expected = math.prod(item.tensor_data.chunk.sizes) * data.element_size()
        if payload.nbytes != expected:  # the reader would take the chunk's shape from .metadata
            raise ValueError(f"entry {item.index.fqn}: the tensor to write has {payload.nbytes} bytes, "
                             f"its planned chunk {list(item.tensor_data.chunk.sizes)} needs {expected}")
        if views is not None and data.device.type == "cpu" and data.is_contiguous():
            views[id(item)] = (item, payload)  # the item too: its id cannot be reused meanwhile
        return payload


def tensor_bytes(tensor) -> memoryview:
    """A tensor's bytes in C order (a view when it is contiguous on the CPU)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _RangedReads(FileSystem):
    """DCP's fsspec filesystem, except that a read from an object store fetches exactly the
    bytes asked for, in one ranged GET (fsspec's readahead blocks cut a 64 MB tensor into a
    dozen sequential requests: 0.10-0.16 GB/s against 0.75-1.0 for a GET per tensor, moto on
    this host, ``benchmarks/persist.py --storage s3``)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" in mode and not rfs.is_local(self.fs):
            with self.fs.open(os.fspath(path), mode, cache_type="none") as stream:
                yield stream
        else:
            with super().create_stream(path, mode) as stream:
                yield stream


# Shard files a rank reads at once from an object store (each its own requests in flight).
PARALLEL_FILE_READS = 4


class CheckpointReader(FsspecReader):
    """DCP's fsspec reader, reading ``RAW_TENSOR`` entries as their bytes; every other entry
    (pickled objects, the ``torch.save`` archives of checkpoints written before the raw
    format or by stock DCP) goes through DCP's own ``read_data``. ``.metadata`` is read once
    (a loader that looks at it first does not read it again when DCP asks)."""

    _metadata = None

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        ranged = _RangedReads()
        ranged.fs = self.fs.fs
        self.fs = ranged

    def read_metadata(self, *args, **kwargs):
        if args or kwargs:  # a rank's own metadata file (DCP's no-collectives mode)
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._metadata = None  # possibly another checkpoint's
    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # (fqn, chunk offsets) -> (chunk sizes, dtype): what a raw entry's bytes are.
        self._raw_layout = {(fqn, tuple(chunk.offsets)): (tuple(chunk.sizes), md.properties.dtype)
                            for fqn, md in metadata.state_dict_metadata.items()
                            if isinstance(md, TensorStorageMetadata) for chunk in md.chunks}

    def read_data(self, plan, planner):
        raw, others = [], []
        for item in plan.items:
            descriptors = self.storage_data[item.storage_index].transform_descriptors or ()
            (raw if RAW_TENSOR in descriptors else others).append(item)
        if raw:
            self._read_raw(raw, planner)
        return super().read_data(dataclasses.replace(plan, items=others), planner)

    def _read_raw(self, items, planner) -> None:
        per_file: dict[str, list] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if len(per_file) > 1 and not rfs.is_local(self.fs.fs):  # an object store: files in parallel
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(len(per_file), PARALLEL_FILE_READS)) as pool:
                list(pool.map(lambda job: self._read_raw_file(*job, planner), per_file.items()))
        else:
            for relative_path, reqs in per_file.items():
                self._read_raw_file(relative_path, reqs, planner)

    def _read_raw_file(self, relative_path: str, reqs: list, planner) -> None:
        import torch

        reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
        with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
            for req in reqs:
                info = self.storage_data[req.storage_index]
                index = req.storage_index
                sizes, dtype = self._raw_layout[(index.fqn, tuple(index.offset))]
                expected = math.prod(sizes) * dtype.itemsize
                if info.length != expected:
                    raise ValueError(f"{relative_path}: entry {index.fqn} holds {info.length} bytes, its "
                                     f"metadata describes {expected} ({dtype}, {list(sizes)}): the checkpoint's "
                                     f".metadata and shard files do not belong together")
                stream.seek(info.offset)
                target = planner.resolve_tensor(req).detach()
                if _whole_chunk_into(target, req, sizes, dtype):
                    # Straight into the destination (a same-mesh restore on CPU hosts): no
                    # buffer to allocate and fault in, no second copy.
                    got = _read_into(stream, target.reshape(-1).view(torch.uint8).numpy().data)
                    if got != expected:
                        raise ValueError(f"{relative_path} ends inside entry {index.fqn} ({got} of "
                                         f"{expected} bytes at offset {info.offset}): the file is truncated")
                    planner.commit_tensor(req, target)
                    continue
                data, got = _read_exact(stream, expected)
                if got != expected:
                    raise ValueError(f"{relative_path} ends inside entry {index.fqn} ({got} of "
                                     f"{expected} bytes at offset {info.offset}): the file is truncated")
                tensor = (torch.frombuffer(data, dtype=torch.uint8).view(dtype) if expected
                          else torch.empty(0, dtype=dtype)).view(sizes)
                tensor = _narrow(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise ValueError(f"entry {index.fqn}: the load plan wants {list(target.size())}, the "
                                     f"checkpoint's chunk gives {list(tensor.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)


def _whole_chunk_into(target, req, sizes, dtype) -> bool:
    """The read item is the whole saved chunk and its destination a contiguous host tensor
    of its dtype and shape: the bytes can be read into it directly."""
    return (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            and target.numel() > 0 and tuple(target.size()) == tuple(sizes)
            and all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(sizes))


def _read_into(stream, view: memoryview) -> int:
    """Fill ``view`` from ``stream``; the bytes read (fewer at the end of the file)."""
    got, n = 0, len(view)
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def _read_exact(stream, n: int) -> tuple[bytearray, int]:
    """``n`` bytes from ``stream`` into one new buffer (no intermediate copy); (buffer, bytes read)."""
    data = bytearray(n)
    return data, _read_into(stream, memoryview(data))


def _narrow(tensor, offsets, lengths):
    """The part of a saved chunk a read item asks for (DCP's ``narrow_tensor_by_index``)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def missing_shard_files(step_uri: str) -> list[str]:
    """What keeps the DCP checkpoint at ``step_uri`` from being whole: its ``.metadata``
    absent, or a shard file it names absent or shorter than the bytes it places there."""
    from rayflex.checkpoint.manifest import file_sizes

    try:
        metadata = CheckpointReader(step_uri, **rfs.fsspec_kwargs(step_uri)).read_metadata()
    except FileNotFoundError:
        return [".metadata is missing (DCP's save did not finish)"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = file_sizes(step_uri)
    problems = []
    for name, size in sorted(needed.items()):
        if name not in sizes:
            problems.append(f"{name} is missing")
        elif sizes[name] < size:
            problems.append(f"{name} has {sizes[name]} bytes, .metadata places data up to byte {size}")
    return problems
