"""The commit protocol of checkpoints: a step counts only once its marker exists.

Layout under a checkpoint root::

    {root}/step_00000100/__0_0.distcp ...   shards written by torch.distributed.checkpoint
    {root}/step_00000100/.metadata          DCP writes it last, after every shard
    {root}/step_00000100/<rayflex files>    small extras (trainer state, ...)
    {root}/step_00000100/COMMITTED.json     the marker: written LAST, holds the Manifest

A crash at any moment leaves either a committed step (marker present, every file listed
in it) or an uncommitted directory that loaders ignore and :func:`gc_uncommitted` removes.
The marker is one small object: a single PUT on S3, an atomic rename on disk, so it is
either fully there or not at all. Committed steps are immutable: a second commit of the
same step is refused. Deleting goes the other way round: the marker first, so a step that
is half deleted is never mistaken for a committed one.

Fingerprints, and why two kinds:

* ``etag:<value>`` on S3. The server computes the ETag at upload; it is returned by every
  listing, so commit and verify cost one LIST per step and no download. It detects an
  object that was rewritten, replaced or truncated after commit (a flipped byte gives a
  new MD5/ETag). It does not prove the bytes equal what the writer had in memory
  (multipart and SSE-KMS ETags are not a plain MD5, and no client-side hash is taken),
  and it cannot be recomputed if the checkpoint is copied to another kind of storage;
  such a copy is then checked by size only (with a warning). S3 itself checksums data at
  rest and TLS protects it in transit, so the ETag is the cheap check that matters.
* ``xxh3:<hex>`` elsewhere (local disk, GCS, Azure, memory): a checksum of the content
  (XXH3, 128 bits, through the ``xxhash`` package: ~26 GB/s on one core of this project's
  host against CRC-32's 3.1 GB/s, so that writing and verifying a checkpoint are bounded by
  the storage, not the checksum).
  The writer checksums each shard file as it writes it and leaves the result beside it
  (``<file>.digest``, :data:`DIGEST_SUFFIX`); commit records it instead of reading the file
  back (rank 0 would otherwise read the whole checkpoint, every rank's shards, after every
  save — a download on GCS or Azure). Files without one (small extras, an uploader
  process's shards) are read and checksummed at commit. Verify reads every byte again.
  Not a cryptographic hash: it guards against corruption, truncation and a file replaced by
  another one (sizes are recorded too), not against an adversary who can write the bucket,
  and the writer checksums every byte of every save beside training. Checkpoints committed
  before record ``crc32:`` or ``blake2b:`` (writers' digests in ``<file>.blake2b``); those
  are still committed and verified as such.

Verification always compares the same kind the manifest recorded.

All remote operations go through :func:`rayflex.storage.fs.with_retries`. Concurrency
assumption: one committer (rank 0 / the controller) and at most one save in flight, which
is always newer than the newest committed step; gc relies on that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Optional

import xxhash

from rayflex.errors import CheckpointError, ConfigError
from rayflex.storage.fs import StorageOptions, Store, is_s3, join, redact_uri, resolve, with_retries

logger = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
METADATA = ".metadata"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_HASH_CHUNK = 4 << 20
# Beside a shard file: the fingerprint of its bytes (``xxh3:<hex>``), written by the writer
# (checkpoint.dcp_io) or a replica keeper; the commit records it as the file's fingerprint.
DIGEST_SUFFIX = ".digest"
# What writers left beside shard files before: a blake2b (32-byte) hex digest.
LEGACY_DIGEST_SUFFIX = ".blake2b"
_WRITTEN_FINGERPRINT = re.compile(r"xxh3:[0-9a-f]{32}|crc32:[0-9a-f]{8}")
_LEGACY_DIGEST = re.compile(r"[0-9a-f]{64}")


class ContentDigest:
    """The fingerprint a writer computes over a shard file's bytes as it writes them (its
    ``DIGEST_SUFFIX`` sidecar): XXH3-128 (``kind="crc32"``: the CRC-32 that checkpoints
    committed before recorded). Both release the GIL on large buffers."""

    def __init__(self, kind: str = "xxh3") -> None:
        self.kind = kind
        self._xxh = xxhash.xxh3_128() if kind == "xxh3" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def fingerprint(self) -> str:
        return f"xxh3:{self._xxh.hexdigest()}" if self._xxh is not None else f"crc32:{self._crc:08x}"


def fingerprint_of(data) -> str:
    """The fingerprint of ``data`` (what a writer leaves beside a file of these bytes)."""
    digest = ContentDigest()
    digest.update(data)
    return digest.fingerprint()


def step_name(step: int) -> str:
    """The directory name of ``step`` (zero-padded so names sort like numbers)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def step_dir(root: "str | Store", step: int) -> str:
    """URI of the directory of ``step``."""
    return join(root.uri if isinstance(root, Store) else root, step_name(step))


def parse_step(name: str) -> Optional[int]:
    """The step of a ``step_XXXXXXXX`` name or path; None for anything else."""
    match = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileRecord:
    size: int
    fingerprint: str  # "etag:...", "xxh3:..." (or "crc32:", "blake2b:..." in checkpoints committed before)


@dataclass(frozen=True)
class Manifest:
    """What a committed step contains; the marker file's content."""

    step: int
    world_size: int
    mesh: dict
    files: dict  # relpath -> FileRecord
    created_at: str
    extra: dict = field(default_factory=dict)
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "step": self.step, "world_size": self.world_size,
            "mesh": self.mesh, "created_at": self.created_at, "extra": self.extra,
            "files": {rel: {"size": r.size, "fingerprint": r.fingerprint}
                      for rel, r in sorted(self.files.items())},
        }, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        try:
            raw = json.loads(text)
            if raw.get("format", 1) > FORMAT_VERSION:
                raise CheckpointError(
                    f"manifest format {raw['format']} is newer than this rayflex understands "
                    f"({FORMAT_VERSION}). Fix: upgrade rayflex to load this checkpoint")
            return cls(step=int(raw["step"]), world_size=int(raw["world_size"]),
                       mesh=dict(raw["mesh"]), created_at=str(raw["created_at"]),
                       extra=dict(raw.get("extra", {})), format=int(raw.get("format", 1)),
                       files={rel: FileRecord(size=int(r["size"]), fingerprint=str(r["fingerprint"]))
                              for rel, r in raw["files"].items()})
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"malformed checkpoint manifest: {type(err).__name__}: {err}") from err


@dataclass(frozen=True)
class SkippedStep:
    step: int
    reason: str


@dataclass(frozen=True)
class Resolution:
    """Outcome of :func:`resolve_loadable`: the step to load (if any) and what was passed
    over on the way, so the caller can put the skipped steps on the run's timeline."""

    manifest: Optional[Manifest]
    step_uri: Optional[str]
    skipped: tuple = ()  # SkippedStep, newest first

    @property
    def step(self) -> Optional[int]:
        return None if self.manifest is None else self.manifest.step


# --------------------------------------------------------------------------- internals


def _list_files(fs, path: str) -> dict:
    """relpath -> fsspec info of every file under ``path`` (recursive, one listing)."""
    fs.invalidate_cache(path)  # see writes made by other processes (s3fs caches listings)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = path.rstrip("/") + "/"
    out = {}
    for name, info in found.items():
        if info.get("type", "file") == "file" and name.startswith(prefix) and name != prefix:
            out[name[len(prefix):]] = info
    return out


def file_sizes(uri: str, options: Optional[StorageOptions] = None) -> dict[str, int]:
    """relpath -> size of every file under ``uri`` (fresh: not a cached listing)."""
    fs, path = resolve(uri, options)
    found = with_retries(lambda: _list_files(fs, path), what=f"list {redact_uri(uri)}")
    return {rel: int(info["size"]) for rel, info in found.items()}


def _etag(info: dict) -> Optional[str]:
    value = info.get("ETag") or info.get("etag")
    return str(value).strip('"') if value else None


def _file_fingerprint(fs, path: str, kind: str = "xxh3", digest_size: int = 16) -> str:
    """Read ``path`` and fingerprint it: ``xxh3``, or ``crc32`` / ``blake2b`` (of
    ``digest_size`` bytes) for what checkpoints committed before recorded."""
    def _hash() -> str:
        hasher = hashlib.blake2b(digest_size=digest_size) if kind == "blake2b" else ContentDigest(kind)
        with fs.open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                hasher.update(chunk)
        return "blake2b:" + hasher.hexdigest() if kind == "blake2b" else hasher.fingerprint()
    return with_retries(_hash, what=f"hash {path}")


def _s3_etag(fs, path: str, info: dict) -> Optional[str]:
    etag = _etag(info)
    if etag is None:
        fs.invalidate_cache(path)
        etag = _etag(with_retries(lambda: fs.info(path), what=f"stat {path}"))
    return None if etag is None else "etag:" + etag


def _fingerprint(fs, path: str, info: dict) -> str:
    if is_s3(fs):
        etag = _s3_etag(fs, path, info)
        if etag is not None:
            return etag
    return _file_fingerprint(fs, path)


def _read_digests(fs, path: str, files: dict) -> dict[str, bytes]:
    """{rel: content} of the digest files writers left beside their files (``DIGEST_SUFFIX``,
    or ``LEGACY_DIGEST_SUFFIX`` from before), each read once. Not on S3, whose ETag costs
    nothing either."""
    if is_s3(fs):
        return {}
    return {rel: with_retries(lambda rel=rel: fs.cat_file(f"{path}/{rel}"), what=f"read {rel}")
            for rel in files if rel.endswith((DIGEST_SUFFIX, LEGACY_DIGEST_SUFFIX))}


def _written_digest(rel: str, digests: dict[str, bytes]) -> Optional[str]:
    """The fingerprint a file's writer left beside it, if any: what the commit records
    without reading the file. A digest file itself: the fingerprint of the bytes already read."""
    if rel in digests:
        return fingerprint_of(digests[rel])
    for suffix, form, kind in ((DIGEST_SUFFIX, _WRITTEN_FINGERPRINT, ""),
                               (LEGACY_DIGEST_SUFFIX, _LEGACY_DIGEST, "blake2b:")):
        if rel + suffix in digests:
            digest = digests[rel + suffix].decode(errors="replace").strip()
            if form.fullmatch(digest):
                return kind + digest
            logger.warning("ignoring %s%s: not a digest this version writes (%r); hashing the file",
                           rel, suffix, digest[:80])
    return None


def _current_fingerprint(fs, path: str, info: dict, recorded: str) -> Optional[str]:
    """The fingerprint of the same kind as ``recorded``; None where it cannot be taken."""
    kind = recorded.split(":", 1)[0]
    if kind in ("xxh3", "crc32"):
        return _file_fingerprint(fs, path, kind)
    if kind == "blake2b":  # 16 bytes when the commit hashed the file, 32 from a writer's digest
        return _file_fingerprint(fs, path, "blake2b", digest_size=len(recorded.split(":", 1)[1]) // 2)
    if kind == "etag" and is_s3(fs):
        return _s3_etag(fs, path, info)
    logger.warning("cannot compute a %r fingerprint for %s on this storage; checked its "
                   "size only", kind, path)
    return None


def _step_dirs(store: Store) -> list[int]:
    return sorted(s for s in map(parse_step, store.listdir()) if s is not None)


def _is_committed(store: Store, step: int) -> bool:
    return store.exists(step_name(step), MARKER)


def _remove_step(store: Store, step: int) -> None:
    store.remove_tree(step_name(step), MARKER)  # marker first: never a half-deleted "committed"
    store.remove_tree(step_name(step))


# --------------------------------------------------------------------------- public API


def commit(root: "str | Store", step: int, *, world_size: int, mesh: dict, extra: Optional[dict] = None,
           options: Optional[StorageOptions] = None) -> Manifest:
    """Record every file of ``step`` with size and fingerprint, then write the marker.

    Call it once every rank's save has finished (DCP's ``.metadata`` exists). Refuses an
    already committed step and a step without ``.metadata``.
    """
    store = Store.of(root, options)
    name, shown = step_name(step), redact_uri(step_dir(store, step))
    if _is_committed(store, step):
        raise CheckpointError(
            f"step {step} at {shown} is already committed; refusing to overwrite its marker. "
            "Fix: committed steps are immutable; save under a new step number")
    fs, path = store.fs, store.path_of(name)
    files = with_retries(lambda: _list_files(fs, path), what=f"list {shown}")
    files.pop(MARKER, None)
    if METADATA not in files:
        raise CheckpointError(
            f"cannot commit step {step}: {shown}/{METADATA} is missing "
            f"({len(files)} other files present). DCP writes it last, so the save has not "
            "finished or failed. Fix: commit only after every rank's save completed")
    digests = _read_digests(fs, path, files)
    records = {rel: FileRecord(size=int(info["size"]),
                               fingerprint=_written_digest(rel, digests) or _fingerprint(fs, f"{path}/{rel}", info))
               for rel, info in sorted(files.items())}
    manifest = Manifest(step=step, world_size=int(world_size), mesh=dict(mesh), files=records,
                        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        extra=dict(extra or {}))
    text = manifest.to_json()  # serialize before writing: a bad extra fails here, not half-way
    store.write_text_atomic(text, name, MARKER)
    logger.info("committed checkpoint step %d at %s (%d files, %d bytes)", step, shown,
                len(records), sum(r.size for r in records.values()))
    return manifest


def read_manifest(root: "str | Store", step: int, options: Optional[StorageOptions] = None) -> Manifest:
    """The manifest of a committed step; CheckpointError if it is not committed."""
    store = Store.of(root, options)
    marker = join(step_dir(store, step), MARKER)
    try:
        text = store.read_text(step_name(step), MARKER)
    except FileNotFoundError:
        raise CheckpointError(f"step {step} is not committed: {redact_uri(marker)} does not "
                              "exist. Fix: load a committed step (see list_committed)") from None
    try:
        manifest = Manifest.from_json(text)
    except CheckpointError as err:
        raise CheckpointError(f"step {step}: {redact_uri(marker)}: {err}") from err
    if manifest.step != step:
        raise CheckpointError(f"step {step}: {redact_uri(marker)} describes step "
                              f"{manifest.step}; the directory was renamed or copied wrongly")
    return manifest


def list_committed(root: "str | Store", options: Optional[StorageOptions] = None) -> list[int]:
    """Committed steps under ``root``, ascending. Directories without a marker are ignored."""
    store = Store.of(root, options)
    return [s for s in _step_dirs(store) if _is_committed(store, s)]


def latest_committed(root: "str | Store", options: Optional[StorageOptions] = None) -> Optional[int]:
    steps = list_committed(root, options)
    return steps[-1] if steps else None


def verify(root: "str | Store", step: int, *, deep: bool = True, only: Optional[Iterable[str]] = None,
           options: Optional[StorageOptions] = None) -> Manifest:
    """Check that committed ``step`` is intact: every recorded file present, right size,
    and (``deep``) the same fingerprint. Raises CheckpointError naming each bad file.

    On S3 ``deep`` costs nothing extra (ETags come with the listing); on disk it rereads
    every byte. ``only``: fingerprint just these files (the ranks of a restore split the
    rereading between them). Extra files not in the manifest are ignored.
    """
    store = Store.of(root, options)
    manifest = read_manifest(store, step)
    only = None if only is None else set(only)
    sdir = step_dir(store, step)
    fs, path = store.fs, store.path_of(step_name(step))
    found = with_retries(lambda: _list_files(fs, path), what=f"list {redact_uri(sdir)}")
    problems = []
    for rel, record in sorted(manifest.files.items()):
        info = found.get(rel)
        if info is None:
            problems.append(f"{rel} is missing")
            continue
        size = int(info["size"])
        if size != record.size:
            problems.append(f"{rel} has size {size} bytes, manifest says {record.size}")
            continue
        if deep and (only is None or rel in only):
            current = _current_fingerprint(fs, f"{path}/{rel}", info, record.fingerprint)
            if current is not None and current != record.fingerprint:
                problems.append(f"{rel} checksum differs (manifest {record.fingerprint}, "
                                f"found {current})")
    if problems:
        raise CheckpointError(
            f"checkpoint step {step} at {redact_uri(sdir)} is corrupt: " + "; ".join(problems)
            + ". Fix: load an older committed step (resolve_loadable does so) and delete this one")
    return manifest


def resolve_loadable(root: "str | Store", *, deep: bool = True,
                     options: Optional[StorageOptions] = None) -> Resolution:
    """The newest committed step that verifies, skipping (and logging) corrupt ones.

    Storage errors (endpoint down) propagate instead of counting as corruption: falling
    back to an older step because the network blinked would silently lose progress.
    """
    store = Store.of(root, options)
    skipped: list[SkippedStep] = []
    for step in reversed(list_committed(store)):
        try:
            manifest = verify(store, step, deep=deep)
        except CheckpointError as err:
            logger.warning("skipping checkpoint step %d: %s", step, err)
            skipped.append(SkippedStep(step=step, reason=str(err)))
            continue
        return Resolution(manifest=manifest, step_uri=step_dir(store, step), skipped=tuple(skipped))
    return Resolution(manifest=None, step_uri=None, skipped=tuple(skipped))


def apply_retention(root: "str | Store", keep: int, options: Optional[StorageOptions] = None) -> list[int]:
    """Delete committed steps older than the newest ``keep``; return the removed steps."""
    if not isinstance(keep, int) or keep < 1:
        raise ConfigError("CheckpointConfig.keep", f"must be an int >= 1, got {keep!r}",
                          "keep at least the newest checkpoint (keep=1)")
    store = Store.of(root, options)
    doomed = list_committed(store)[:-keep]
    for step in doomed:
        _remove_step(store, step)
        logger.info("retention: removed checkpoint step %d under %s", step, redact_uri(store.uri))
    return doomed


def gc_uncommitted(root: "str | Store", *, older_than_step: Optional[int] = None,
                   steps: Optional[Iterable[int]] = None,
                   options: Optional[StorageOptions] = None) -> list[int]:
    """Delete step directories without a marker (leftovers of a crash); return their steps.

    A directory is removed only if it cannot be a save still in flight: its step is below
    ``older_than_step`` (default: the newest committed step), or it is listed in ``steps``
    (the caller knows that save was abandoned). Pass ``older_than_step`` above every step
    only when no worker can be saving (e.g. at restart, before workers start). Committed
    steps are never removed, even when listed.
    """
    store = Store.of(root, options)
    all_steps = _step_dirs(store)
    committed = {s for s in all_steps if _is_committed(store, s)}
    threshold = older_than_step if older_than_step is not None else max(committed, default=None)
    explicit = set(steps or ())
    removed = []
    for step in all_steps:
        if step in committed:
            continue
        if not ((threshold is not None and step < threshold) or step in explicit):
            continue
        if _is_committed(store, step):  # committed since we listed: keep it
            continue
        store.remove_tree(step_name(step))
        logger.info("removed uncommitted checkpoint step %d under %s", step, redact_uri(store.uri))
        removed.append(step)
    return removed


QUARANTINE = "QUARANTINED.json"


def quarantine(root: "str | Store", step: int, reason: str, options: Optional[StorageOptions] = None) -> None:
    """Withdraw a committed step that failed verification.

    The reason goes to ``QUARANTINED.json`` (for the post-mortem), then the marker is
    removed: loaders ignore the step from now on, and a later save of the same step number
    (the resumed run passing it again) may clear the directory and write it anew.
    """
    store = Store.of(root, options)
    store.write_text_atomic(json.dumps({"step": step, "reason": reason}), step_name(step), QUARANTINE)
    store.remove_tree(step_name(step), MARKER)
    logger.warning("quarantined checkpoint step %d at %s: %s", step, redact_uri(step_dir(store, step)), reason)


def clear_after(root: "str | Store", step: int, options: Optional[StorageOptions] = None) -> list[int]:
    """Remove every step directory newer than ``step`` that is not committed (leftovers of
    an attempt that crashed mid-upload, or quarantined steps), so the resumed run writes
    those steps into empty directories. Committed steps are never touched."""
    store, removed = Store.of(root, options), []
    for s in _step_dirs(store):
        if s > step and not _is_committed(store, s):
            store.remove_tree(step_name(s))
            removed.append(s)
    if removed:
        logger.info("cleared uncommitted step directories %s under %s", removed, redact_uri(store.uri))
    return removed
