"""DCP's fsspec writer and reader, made safe for object stores.

``torch.distributed.checkpoint``'s ``FsspecWriter`` calls ``fs.makedirs(step_dir)`` on
every rank before it writes a shard. On S3 a "directory" is only a key prefix, and s3fs
implements ``makedirs`` by checking that the *bucket* exists and, when that check says
no, by calling ``CreateBucket``. The check says no whenever the identity may not list the
bucket, or the endpoint is briefly unreachable — so a checkpoint writer would try to
create buckets on a real account (seen: ``OSError: The specified location-constraint is
not valid`` during an outage). Here directories are made only where they exist
(``fs.ensure_dir``): object-store writes are plain ``PutObject``s under a prefix.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from rayflex.storage import fs as rfs
from rayflex.storage import manifest as mf


class SaveAbandoned(RuntimeError):
    """The attempt a save belongs to is over (a peer died): the save can never commit, so
    none of its files is written from here on, and the rank is free to leave."""


SHARD_SUFFIX = ".distcp"  # DCP's shard files (one per rank with single_file_per_rank)


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
    opened for writing once ``abandoned`` is set, and each shard file gets the digest of
    its bytes beside it (``manifest.DIGEST_SUFFIX``; not on S3, where the commit uses the
    ETag): the commit then records it without reading the file back."""

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
        shard = writing and os.fspath(path).endswith(SHARD_SUFFIX) and not rfs.is_s3(self.fs)
        hasher = mf.content_hasher() if shard else None
        with super().create_stream(path, mode) as stream:
            yield stream if hasher is None else _HashingStream(stream, hasher)
        if hasher is None:
            return
        digest_path = f"{os.fspath(path)}{mf.DIGEST_SUFFIX}"
        rfs.with_retries(lambda: self.fs.pipe_file(digest_path, hasher.hexdigest().encode()),
                         what=f"write {rfs.redact_uri(digest_path)}")


class CheckpointWriter(FsspecWriter):
    """``FsspecWriter`` that writes object-store checkpoints as prefixes (no bucket calls);
    ``kwargs`` are the fsspec constructor options (``fs.fsspec_kwargs``). ``abandoned``: set
    when the save can no longer commit (``AsyncCheckpointer.abandon``)."""

    def __init__(self, path: str, abandoned: Optional[threading.Event] = None, **kwargs) -> None:
        super().__init__(path, **kwargs)
        fs = PrefixFileSystem()
        fs.fs = self.fs.fs  # the instance DCP already made from these options
        fs.abandoned = abandoned
        self.fs = fs


class SavePlanCache:
    """DCP's save-plan caching, scoped to one checkpointer (one attempt's mesh and state).

    Without it every save re-plans: each rank lists its write items, rank 0 gathers every
    plan, de-duplicates them and builds the metadata, and scatters the plans back — pickling
    hundreds of items per rank each time (40% of a save's CPU for a small GPT, all of it
    running beside training in an asynchronous save). ``DefaultSavePlanner(
    enable_plan_caching=True)`` sends an empty plan when a rank's plan is unchanged and rank
    0 reuses the global plan and metadata. DCP keys its cache by planner class, process-wide;
    a key per checkpointer keeps a reused process's next attempt (another world size, another
    split) from reading this one's plans, and ``clear`` drops them when the attempt ends.
    Every rank of an attempt builds its checkpointer at setup, so all start uncached
    together and fill their caches in the same save."""

    _CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
               "_cached_metadata")

    def __init__(self) -> None:
        import uuid

        self.key = f"rayflex-{uuid.uuid4().hex}"

    def planner(self):
        from torch.distributed.checkpoint import DefaultSavePlanner

        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self.key  # DCP's attribute (its default is the class name)
        return planner

    def clear(self) -> None:
        from torch.distributed.checkpoint.planner import SavePlanner

        for name in self._CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)


def missing_shard_files(step_uri: str) -> list[str]:
    """What keeps the DCP checkpoint at ``step_uri`` from being whole: its ``.metadata``
    absent, or a shard file it names absent or shorter than the bytes it places there."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from rayflex.storage.manifest import file_sizes

    try:
        metadata = FsspecReader(step_uri, **rfs.fsspec_kwargs(step_uri)).read_metadata()
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
