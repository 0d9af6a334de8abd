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

import os

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from rayflex.storage import fs as rfs


class PrefixFileSystem(FileSystem):
    """DCP's fsspec filesystem, except that ``mkdir`` never reaches a bucket."""

    def mkdir(self, path: str | os.PathLike) -> None:
        rfs.ensure_dir(self.fs, os.fspath(path))


class CheckpointWriter(FsspecWriter):
    """``FsspecWriter`` that writes object-store checkpoints as prefixes (no bucket calls);
    ``kwargs`` are the fsspec constructor options (``fs.fsspec_kwargs``)."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        fs = PrefixFileSystem()
        fs.fs = self.fs.fs  # the instance DCP already made from these options
        self.fs = fs



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
