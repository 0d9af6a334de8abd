"""URI -> fsspec filesystem, retries with backoff, and a start-up storage probe.

Everything rayflex writes (checkpoints, run artefacts) goes through a ``str`` URI and
fsspec, never a ``pathlib.Path``: a Path collapses ``s3://bucket`` into ``s3:/bucket``.
Three schemes are supported: ``file://`` (and bare local paths, the embedded default),
``s3://`` (s3fs; any S3-compatible endpoint) and ``memory://`` (tests, one process).

Credentials come from the usual AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``,
instance roles, ...) unless set explicitly on :class:`StorageOptions`. They never appear
in a repr, a log line or an error message.

Retries are layered: botocore retries a few times inside one request, s3fs retries a few
transport errors, and :func:`with_retries` wraps a whole logical operation (write a file,
list a directory) with exponential backoff. The outer layer is the one that logs, so an
operator sees that storage is flaky before it turns into a failure. The layers multiply:
a transport error that persists costs up to 3 (botocore) x 5 (s3fs) requests per attempt,
so a listing that keeps failing takes tens of seconds to become a StorageError. That is
meant for background work (checkpoint upload); the start-up probe uses one attempt.

s3fs caches directory listings per filesystem instance (and fsspec shares instances per
process), so objects written by another process are invisible to a cached listing. Every
listing and stat here drops the cache for its path first.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import fsspec

from rayflex.constants import count_knob, knob
from rayflex.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

SUPPORTED_SCHEMES = ("file", "s3", "memory")


def _s3_config() -> dict:
    """botocore settings of the regular S3 client (timeouts: ``constants``)."""
    return {"connect_timeout": knob("STORAGE_CONNECT_TIMEOUT_S"), "read_timeout": knob("STORAGE_READ_TIMEOUT_S"),
            "retries": {"max_attempts": count_knob("STORAGE_REQUEST_ATTEMPTS"), "mode": "standard"}}


def _probe_s3_config() -> dict:
    """The start-up probe's: one attempt, short timeouts, so it fails fast."""
    return {"connect_timeout": knob("STORAGE_PROBE_CONNECT_TIMEOUT_S"),
            "read_timeout": knob("STORAGE_PROBE_READ_TIMEOUT_S"),
            "retries": {"max_attempts": 1, "mode": "standard"}}


_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|key", re.IGNORECASE)


def _mask(value: Any) -> str:
    return "None" if value is None else "'***'"


@dataclass(frozen=True)
class StorageOptions:
    """How to reach object storage. Every field is optional.

    ``endpoint_url``: an S3-compatible endpoint (MinIO, moto, R2, ...); defaults to
    ``AWS_ENDPOINT_URL_S3`` then ``AWS_ENDPOINT_URL`` from the environment.
    ``key``/``secret``/``token``: explicit credentials; prefer the environment (they are
    pickled along with the options when sent to Ray actors).
    ``extra``: passed to the fsspec filesystem constructor (``client_kwargs`` and
    ``config_kwargs`` are merged with rayflex's defaults).
    """

    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    anon: bool = False
    key: Optional[str] = field(default=None, repr=False)
    secret: Optional[str] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)
    extra: dict = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        extra = {k: ("'***'" if _SECRET_KEY.search(str(k)) else v) for k, v in self.extra.items()}
        return (f"StorageOptions(endpoint_url={self.endpoint_url!r}, region={self.region!r}, "
                f"anon={self.anon!r}, key={_mask(self.key)}, secret={_mask(self.secret)}, "
                f"token={_mask(self.token)}, extra={extra!r})")

    __str__ = __repr__

    def resolved_endpoint(self) -> Optional[str]:
        """The S3 endpoint in effect: the explicit one, else the environment's, else AWS."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def credential_source(self) -> str:
        """Where the credentials come from, in words, without revealing them."""
        if self.anon:
            return "anonymous access (StorageOptions.anon=True)"
        if self.key:
            return f"StorageOptions.key (access key id ending in {self.key[-4:]!r})"
        env_key = os.environ.get("AWS_ACCESS_KEY_ID")
        if env_key:
            return f"AWS_ACCESS_KEY_ID (access key id ending in {env_key[-4:]!r})"
        if os.environ.get("AWS_PROFILE"):
            return f"AWS_PROFILE={os.environ['AWS_PROFILE']!r}"
        return "the default AWS credential chain (config files, instance role)"


def scheme_of(uri: str) -> str:
    """The URI's scheme, lower case; a bare path is ``file``.

    Raises ConfigError for a scheme rayflex does not support (including fsspec chains
    such as ``simplecache::s3://``), listing the ones it does.
    """
    if not isinstance(uri, str) or not uri:
        raise ConfigError("storage uri", f"{uri!r} is not a non-empty string URI",
                          "pass e.g. 's3://bucket/prefix' or '/abs/local/dir'")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    if "::" in uri or scheme not in SUPPORTED_SCHEMES:
        shown = uri.split("://", 1)[0] if "://" in uri else uri
        raise ConfigError(
            "storage uri", f"{redact_uri(uri)!r} uses unsupported scheme {shown!r}",
            "use one of " + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            + " or a plain local path")
    if scheme == "s3" and not uri[len("s3://"):].strip("/"):
        raise ConfigError("storage uri", f"{uri!r} names no bucket",
                          "use s3://BUCKET/optional/prefix")
    return scheme


def redact_uri(uri: str) -> str:
    """Hide ``user:password@`` in a URI before it goes into a message."""
    return re.sub(r"^([a-zA-Z0-9+.-]+://)[^/@]*@", r"\1***@", uri)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def fsspec_kwargs(uri: str, options: Optional[StorageOptions] = None) -> dict:
    """Constructor kwargs of the filesystem for ``uri``.

    Also what ``torch.distributed.checkpoint.FsspecWriter(path, **kwargs)`` takes, so DCP
    and rayflex share one cached filesystem instance (fsspec caches by kwargs).
    """
    options = options or StorageOptions()
    scheme = scheme_of(uri)
    if scheme != "s3":
        return dict(options.extra)
    kwargs: dict[str, Any] = {"config_kwargs": _s3_config()}
    endpoint = options.resolved_endpoint()
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    region = options.region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        kwargs["client_kwargs"] = {"region_name": region}
    if options.anon:
        kwargs["anon"] = True
    for name in ("key", "secret", "token"):
        if getattr(options, name):
            kwargs[name] = getattr(options, name)
    return _merge(kwargs, options.extra)


def resolve(uri: str, options: Optional[StorageOptions] = None
            ) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for ``uri``; ``path`` is in the filesystem's own form
    (``bucket/key`` for s3, an absolute path for local and memory)."""
    scheme_of(uri)
    fs, path = fsspec.core.url_to_fs(uri, **fsspec_kwargs(uri, options))
    return fs, path.rstrip("/") or path


def join(uri: str, *parts: str) -> str:
    """Join URI segments with ``/`` (never ``os.path.join``: URIs are not local paths)."""
    out = uri
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = (out if out.endswith("/") else out + "/") + part
    return out


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple:
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    return "s3" in _protocols(fs)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


def can_append(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether files on ``fs`` can be appended to in place (local disk, memory); an object
    store cannot, so a file that grows is rewritten whole there."""
    return is_local(fs) or "memory" in _protocols(fs)


def has_directories(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` has real directories that must exist before a file is written in
    them. Object stores have none (a "directory" is a key prefix), and asking one to make
    it is worse than useless: s3fs answers a ``makedirs`` of a bucket it cannot see
    (no ListBucket permission, or the endpoint briefly down) with ``CreateBucket``.
    ``memory://`` keeps its pseudo-directories (an empty one still lists)."""
    return is_local(fs) or "memory" in _protocols(fs)


def ensure_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Make directory ``path`` where directories exist; never a bucket-level call."""
    if has_directories(fs):
        fs.makedirs(path, exist_ok=True)


# --------------------------------------------------------------------------- retries

_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                   "TooManyRequestsException", "RequestThrottled", "ProvisionedThroughputExceeded",
                   "RequestTimeout", "RequestTimeoutException", "InternalError",
                   "ServiceUnavailable", "OperationAborted"}
# OSErrors that retrying cannot fix (a bad request, a missing thing, a full disk).
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EEXIST, errno.EISDIR,
                     errno.ENOTDIR, errno.EINVAL, errno.ENAMETOOLONG, errno.ENOSPC, errno.EROFS,
                     errno.ENOTEMPTY, errno.ENOSYS, getattr(errno, "EDQUOT", -1),
                     getattr(errno, "EMSGSIZE", -1), getattr(errno, "EREMCHG", -1)}


def _client_error_transient(err: BaseException) -> Optional[bool]:
    """Classify a botocore ClientError by code and HTTP status; None if not one."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    if code in _THROTTLE_CODES or (code.isdigit() and int(code) >= 500):
        return True
    return int(status) >= 500 or int(status) == 429


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: connection trouble, timeouts, throttling, 5xx."""
    if isinstance(err, (FileNotFoundError, PermissionError, FileExistsError,
                        IsADirectoryError, NotADirectoryError)):
        return False
    # s3fs turns ClientErrors into OSErrors and keeps the original as __cause__.
    for candidate in (err, err.__cause__):
        if candidate is None:
            continue
        verdict = _client_error_transient(candidate)
        if verdict is not None:
            return verdict
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    try:
        from botocore import exceptions as bex
        if isinstance(err, (bex.ConnectionError, bex.HTTPClientError)):
            return True
        if isinstance(err, bex.BotoCoreError):  # NoCredentials, ParamValidation, ...
            return False
    except ImportError:  # pragma: no cover - s3fs absent
        pass
    try:
        import aiohttp
        if isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    return False


_sleep = time.sleep  # replaced by tests to observe backoff without waiting


def backoff_delay(attempt: int, base_delay_s: float, max_delay_s: float) -> float:
    """Delay before retry ``attempt`` (1-based): exponential, capped, with "equal jitter"
    (half fixed, half random) so many ranks retrying at once do not stay in lockstep."""
    ceiling = min(max_delay_s, base_delay_s * (2 ** (attempt - 1)))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def with_retries(fn: Callable[[], T], *, attempts: Optional[int] = None, base_delay_s: Optional[float] = None,
                 max_delay_s: Optional[float] = None, what: str = "storage operation") -> T:
    """Call ``fn()``; retry transient failures with backoff, logging each at WARNING.

    Non-transient errors (not found, access denied, bad request) propagate unchanged at
    once, so callers can still catch ``FileNotFoundError``. When the attempts run out the
    last error is wrapped in StorageError naming ``what`` (the operation and the URI).
    Unset, ``attempts`` and the delays are the ``STORAGE_RETRY_*`` knobs.
    """
    attempts = count_knob("STORAGE_RETRY_ATTEMPTS") if attempts is None else attempts
    base_delay_s = knob("STORAGE_RETRY_BASE_DELAY_S") if base_delay_s is None else base_delay_s
    max_delay_s = knob("STORAGE_RETRY_MAX_DELAY_S") if max_delay_s is None else max_delay_s
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - classified below
            if not is_transient(err):
                raise
            if attempt == attempts:
                raise StorageError(
                    f"{what} failed after {attempts} attempts: {type(err).__name__}: {err}. "
                    "Fix: check that the storage endpoint is up and reachable from this node; "
                    "transient errors (timeouts, throttling, 5xx) persisted") from err
            delay = backoff_delay(attempt, base_delay_s, max_delay_s)
            logger.warning("%s failed (attempt %d/%d, %s: %s); retrying in %.2fs",
                           what, attempt, attempts, type(err).__name__, err, delay)
            _sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- small API
# Every function takes a URI and resolves it: fsspec caches the filesystem instance, so
# this is cheap, and callers never juggle (fs, path) pairs.


def write_text_atomic(uri: str, text: str, options: Optional[StorageOptions] = None) -> None:
    """Write ``text`` so that readers see the old content or the new, never half.

    Local: temp file in the same directory, fsync, ``os.replace``. S3: one PUT, which S3
    makes visible atomically. Memory: one assignment.
    """
    fs, path = resolve(uri, options)
    data = text.encode("utf-8")

    def _write() -> None:
        if is_local(fs):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        else:
            fs.pipe_file(path, data)
            fs.invalidate_cache(path)

    with_retries(_write, what=f"write {redact_uri(uri)}")


def read_text(uri: str, options: Optional[StorageOptions] = None) -> str:
    """Read a whole small file. Raises FileNotFoundError if it does not exist."""
    fs, path = resolve(uri, options)
    return with_retries(lambda: fs.cat_file(path), what=f"read {redact_uri(uri)}").decode("utf-8")


def exists(uri: str, options: Optional[StorageOptions] = None) -> bool:
    """Whether a file or non-empty directory exists at ``uri``.

    Uses ``info`` rather than ``fs.exists``: s3fs's ``exists`` turns some errors into
    False, which would make an unreachable endpoint look like a missing checkpoint.
    """
    fs, path = resolve(uri, options)

    def _exists() -> bool:
        fs.invalidate_cache(path)
        try:
            fs.info(path)
            return True
        except FileNotFoundError:
            return False

    return with_retries(_exists, what=f"stat {redact_uri(uri)}")


def listdir(uri: str, options: Optional[StorageOptions] = None) -> list[str]:
    """Sorted names (not paths) of the direct children of ``uri``.

    A missing directory lists as empty: object stores have no empty directories, so
    "missing" and "empty" cannot be told apart there and must not be on disk either.
    The listing cache is dropped first, so writes by other processes are seen.
    """
    fs, path = resolve(uri, options)

    def _ls() -> list[str]:
        fs.invalidate_cache(path)
        try:
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries
                 if e.rstrip("/") != path.rstrip("/")}
        return sorted(n for n in names if n)

    return with_retries(_ls, what=f"list {redact_uri(uri)}")


def remove_tree(uri: str, options: Optional[StorageOptions] = None) -> None:
    """Delete ``uri`` and everything under it; a missing tree is not an error."""
    fs, path = resolve(uri, options)

    def _rm() -> None:
        fs.invalidate_cache(path)
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(path)

    with_retries(_rm, what=f"remove {redact_uri(uri)}")


# --------------------------------------------------------------------------- probe


def _is_connection_failure(err: BaseException) -> bool:
    try:
        from botocore import exceptions as bex
        if isinstance(err, (bex.ConnectionError, bex.HTTPClientError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(err, (ConnectionError, TimeoutError))


def missing_bucket_error(uri: str, options: Optional[StorageOptions] = None, *,
                         field: str = "storage uri") -> StorageError:
    """The error for an ``s3://`` URI whose bucket does not exist, naming the bucket, the
    endpoint and the command that creates it (``field``: which setting holds the URI)."""
    options = options or StorageOptions()
    bucket = redact_uri(uri).split("://", 1)[-1].split("/", 1)[0]
    endpoint = options.resolved_endpoint()
    return StorageError(
        f"bucket {bucket!r} does not exist at {endpoint or 'the default AWS endpoint'} "
        f"({field} {redact_uri(uri)}). Fix: create it with `aws s3 mb s3://{bucket}"
        + (f" --endpoint-url {endpoint}`" if endpoint else "`")
        + f" or point the {field} at an existing bucket")


def check_bucket(uri: str, options: Optional[StorageOptions] = None, *, field: str = "storage uri") -> None:
    """Raise :func:`missing_bucket_error` if ``uri`` is on S3 and its bucket does not exist.

    Read-only (one HEAD of the bucket), for URIs rayflex reads but must not write, such as
    the dataset; a bucket that exists but refuses the HEAD counts as existing."""
    if scheme_of(uri) != "s3":
        return
    fs, path = resolve(uri, options)
    bucket = path.split("/", 1)[0]
    try:
        with_retries(lambda: fs.info(bucket, refresh=True), what=f"stat bucket {bucket!r}")
    except FileNotFoundError as err:
        raise missing_bucket_error(uri, options, field=field) from err
    except PermissionError:
        pass


def check_storage(uri: str, options: Optional[StorageOptions] = None) -> None:
    """Write, read back and delete a tiny probe object under ``uri``.

    Run before any actor starts, so a missing bucket, a dead endpoint or refused
    credentials fail the run in seconds with a message that says what to fix, instead of
    at the first checkpoint an hour in. The S3 client used here has a short connect
    timeout and no retries; it is not cached and not shared.
    """
    options = options or StorageOptions()
    scheme = scheme_of(uri)
    shown = redact_uri(uri)
    kwargs = fsspec_kwargs(uri, options)
    if scheme == "s3":
        kwargs = _merge(kwargs, {"config_kwargs": _probe_s3_config(), "skip_instance_cache": True})
    fs, root = fsspec.core.url_to_fs(uri, **kwargs)
    if scheme == "s3":
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not a constructor kwarg)
    root = root.rstrip("/")
    probe = f"{root}/.rayflex-probe-{uuid.uuid4().hex[:12]}"
    payload = f"rayflex storage probe {uuid.uuid4().hex}".encode()
    endpoint = options.resolved_endpoint() or "the default AWS endpoint"
    t0 = time.monotonic()
    try:
        if scheme == "file":
            os.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, payload)
        back = fs.cat_file(probe)
        if back != payload:
            raise StorageError(
                f"storage probe at {shown}: wrote {len(payload)} bytes and read back "
                f"{len(back)} different bytes. Fix: check the storage service's consistency "
                "settings or caching proxies in front of it")
        fs.rm(probe)
    except StorageError:
        raise
    except FileNotFoundError as err:
        if scheme == "s3":
            raise missing_bucket_error(uri, options) from err
        raise StorageError(f"storage probe at {shown} failed: {err}. Fix: use a directory "
                           "this process can create and write") from err
    except PermissionError as err:
        if scheme == "s3":
            raise StorageError(
                f"{endpoint} refused the credentials for {shown} "
                f"(credentials from {options.credential_source()}): {err}. Fix: set "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key allowed to "
                f"put, get and delete objects under {shown}") from err
        raise StorageError(f"permission denied writing under {shown}: {err}. Fix: choose a "
                           "directory this user can write, or fix its permissions") from err
    except Exception as err:  # noqa: BLE001 - every failure becomes a StorageError
        if scheme == "s3" and _is_connection_failure(err):
            raise StorageError(
                f"cannot reach the S3 endpoint {endpoint} for {shown} after "
                f"{time.monotonic() - t0:.1f}s: {type(err).__name__}: {err}. Fix: check "
                "StorageOptions.endpoint_url / AWS_ENDPOINT_URL_S3, that the service is up, "
                "and that this node can reach it") from err
        try:
            from botocore.exceptions import NoCredentialsError
            if isinstance(err, NoCredentialsError):
                raise StorageError(
                    f"no credentials found for {shown}. Fix: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or StorageOptions(anon=True) "
                    "for a public bucket") from err
        except ImportError:  # pragma: no cover
            pass
        raise StorageError(f"storage probe at {shown} failed: {type(err).__name__}: {err}. "
                           "Fix: check the storage uri and that the service is healthy") from err
    logger.info("storage probe at %s ok (%.2fs)", shown, time.monotonic() - t0)
