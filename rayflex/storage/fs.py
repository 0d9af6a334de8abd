"""URI -> fsspec filesystem, retries with backoff, and a start-up storage probe.

Everything rayflex writes (checkpoints, run artefacts) goes through a ``str`` URI and
fsspec, never a ``pathlib.Path``: a Path collapses ``s3://bucket`` into ``s3:/bucket``.
Supported: ``file://`` (and bare local paths, the embedded default), ``memory://``
(tests, one process) and three object stores, each through its fsspec package:
``s3://`` (s3fs, a core dependency; any S3-compatible endpoint), ``gs://`` (gcsfs, the
``gcp`` extra) and ``az://``/``abfs://`` (adlfs, the ``azure`` extra). A URI whose package
is missing fails validation with a ConfigError naming the extra to install.

Credentials come from each cloud's usual chain unless set explicitly on
:class:`StorageOptions`: the AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``,
instance roles); Google's (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud, the metadata
server; anonymous against an emulator named by ``STORAGE_EMULATOR_HOST``); Azure's
(``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``, a service principal,
``DefaultAzureCredential``). They never appear in a repr, a log line or an error message.

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
from rayflex.schemes import AZURE, GCS, OBJECT_STORES, S3, SUPPORTED_SCHEMES, ObjectStore, check_backend, redact_uri  # noqa: F401

logger = logging.getLogger(__name__)

T = TypeVar("T")



# The scheme table is shared with config's URI checks (``rayflex/schemes.py``).
_S3, _GCS, _AZURE = S3, GCS, AZURE


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

    def resolved_endpoint(self, family: str = "s3") -> Optional[str]:
        """The endpoint in effect for ``family`` ("s3", "gs", "az"): the explicit one, else
        the environment's (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``;
        ``STORAGE_EMULATOR_HOST``; the connection string's ``BlobEndpoint``), else None
        (the cloud's public endpoint)."""
        if family == "gs":
            host = self.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
            if not host or host == "default":
                return None
            return host if host.startswith(("http://", "https://")) else f"http://{host}"
        if family == "az":
            return _azure_blob_endpoint()
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def credential_source(self, family: str = "s3") -> str:
        """Where the credentials come from, in words, without revealing them."""
        if family == "gs":
            return _gcs_credential_source(self)
        if family == "az":
            return _azure_credential_source(self)
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


def _azure_blob_endpoint() -> Optional[str]:
    """The Blob endpoint of ``AZURE_STORAGE_CONNECTION_STRING`` (an emulator such as
    Azurite names one), else the account's public endpoint, else None."""
    conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or ""
    parts = dict(p.split("=", 1) for p in conn.split(";") if "=" in p)
    if parts.get("BlobEndpoint"):
        return parts["BlobEndpoint"]
    account = parts.get("AccountName") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    return f"https://{account}.blob.core.windows.net" if account else None


def _gcs_credential_source(options: "StorageOptions") -> str:
    if options.anon:
        return "anonymous access (StorageOptions.anon=True)"
    if options.token:
        return "StorageOptions.token"
    if options.resolved_endpoint("gs") and not options.endpoint_url:
        return "anonymous access (STORAGE_EMULATOR_HOST names an emulator)"
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return "the key file named by GOOGLE_APPLICATION_CREDENTIALS"
    return "the default Google credential chain (gcloud, the metadata server)"


def _azure_credential_source(options: "StorageOptions") -> str:
    if options.anon:
        return "anonymous access (StorageOptions.anon=True)"
    extra = options.extra
    if extra.get("connection_string") or extra.get("account_key") or extra.get("sas_token"):
        return "StorageOptions.extra"
    conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        account = dict(p.split("=", 1) for p in conn.split(";") if "=" in p).get("AccountName")
        return f"AZURE_STORAGE_CONNECTION_STRING (account {account!r})"
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    for env in ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        if os.environ.get(env):
            return f"{env} for AZURE_STORAGE_ACCOUNT_NAME={account!r}"
    if os.environ.get("AZURE_STORAGE_CLIENT_ID"):
        return "the service principal AZURE_STORAGE_CLIENT_ID/_SECRET/TENANT_ID"
    return f"DefaultAzureCredential for account {account!r} (az login, managed identity)"


def object_store(uri: str) -> Optional[ObjectStore]:
    """The object store ``uri`` lives on; None for local paths and ``memory://``."""
    return OBJECT_STORES.get(scheme_of(uri))


_GCS_CLASSES: dict = {}


def _gcs_class(*, emulator: bool) -> type:
    """gcsfs's core filesystem; against an emulator (``STORAGE_EMULATOR_HOST``), one whose
    rename is copy + delete: emulators lack GCS's ``moveTo`` call, and gcsfs retries its
    501 answer six times (~35 s) before falling back to exactly that, on every rename
    (DCP renames its ``.metadata`` into place)."""
    if emulator not in _GCS_CLASSES:
        from fsspec.asyn import AsyncFileSystem
        from gcsfs.core import GCSFileSystem

        if emulator:
            class EmulatorGCSFileSystem(GCSFileSystem):
                _mv_file = AsyncFileSystem._mv_file
                mv_file = fsspec.asyn.sync_wrapper(AsyncFileSystem._mv_file)

            _GCS_CLASSES[emulator] = EmulatorGCSFileSystem
        else:
            _GCS_CLASSES[emulator] = GCSFileSystem
    return _GCS_CLASSES[emulator]


def _gcs_probe_class() -> type:
    """The probe's GCS filesystem: one attempt per request. gcsfs retries every request
    six times with backoff (~35 s against a dead endpoint), fixed when its class is made."""
    if "probe" not in _GCS_CLASSES:
        from gcsfs.retry import retry_request

        base = fsspec.get_filesystem_class("gs")
        inner = getattr(base._request, "__wrapped__", None)
        _GCS_CLASSES["probe"] = base if inner is None else type(
            "ProbeGCSFileSystem", (base,), {"_request": retry_request(retries=1)(inner)})
    return _GCS_CLASSES["probe"]


def require_backend(uri: str, *, field: str = "storage uri") -> None:
    """Import the fsspec package ``uri``'s scheme needs (a ConfigError naming the extra
    that installs it if it is missing: ``schemes.check_backend``) and pick gcsfs's class."""
    store = check_backend(uri, field=field)
    if store is GCS and os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") is None:
        # gcsfs's default class looks up each bucket's layout over gRPC (the storage
        # control API) before using it: rayflex's whole-object writes gain nothing,
        # and an emulator, which has no such API, stalls every first call for 60 s.
        cls = _gcs_class(emulator=bool(StorageOptions().resolved_endpoint("gs")))
        if fsspec.get_filesystem_class("gs") is not cls:
            fsspec.register_implementation("gs", cls, clobber=True)
            fsspec.register_implementation("gcs", cls, clobber=True)


def scheme_of(uri: str, *, field: str = "storage uri") -> str:
    """The URI's scheme, lower case; a bare path is ``file``.

    Raises ConfigError (for setting ``field``) for a scheme rayflex does not support
    (including fsspec chains such as ``simplecache::s3://``), listing the ones it does,
    for an object-store URI without a bucket, and for one whose package is missing.
    """
    if not isinstance(uri, str) or not uri:
        raise ConfigError(field, f"{uri!r} is not a non-empty string URI",
                          "pass e.g. 's3://bucket/prefix' or '/abs/local/dir'")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    if "::" in uri or scheme not in SUPPORTED_SCHEMES:
        shown = uri.split("://", 1)[0] if "://" in uri else uri
        raise ConfigError(
            field, f"{redact_uri(uri)!r} uses unsupported scheme {shown!r}",
            "use one of " + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            + " or a plain local path")
    if scheme in OBJECT_STORES and not uri.split("://", 1)[1].strip("/"):
        word = "container" if OBJECT_STORES[scheme].family == "az" else "bucket"
        raise ConfigError(field, f"{redact_uri(uri)!r} names no {word}",
                          f"use {scheme}://{word.upper()}/optional/prefix")
    require_backend(uri, field=field)
    return scheme


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
    store = object_store(uri)
    if store is _GCS:
        return _merge(_gcs_kwargs(options), options.extra)
    if store is _AZURE:
        return _merge(_azure_kwargs(options), options.extra)
    if store is not _S3:
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


def _gcs_kwargs(options: StorageOptions, *, probe: bool = False) -> dict:
    """gcsfs: the endpoint passed explicitly (so filesystems for two endpoints are two
    cached instances), anonymous against an emulator, Google's chain otherwise."""
    # gcsfs's request timeout bounds a whole request (a multi-MB shard chunk included), so
    # only the probe, whose requests are tiny, sets one.
    kwargs: dict[str, Any] = {"requests_timeout": knob("STORAGE_PROBE_READ_TIMEOUT_S")} if probe else {}
    endpoint = options.resolved_endpoint("gs")
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    if options.token:
        kwargs["token"] = options.token
    elif options.anon or (endpoint and not options.endpoint_url):
        kwargs["token"] = "anon"  # what Google's own clients do under STORAGE_EMULATOR_HOST
    return kwargs


def _azure_kwargs(options: StorageOptions, *, probe: bool = False) -> dict:
    """adlfs reads the account, key, SAS and connection string from the environment
    itself; only timeouts (and anonymity) are rayflex's. Never given the secrets, so they
    are not part of any kwargs dict that could be printed."""
    if options.endpoint_url:
        raise ConfigError("StorageOptions.endpoint_url", "is not used for Azure Blob storage",
                          "set BlobEndpoint in AZURE_STORAGE_CONNECTION_STRING (or "
                          "StorageOptions.extra['account_host']) instead")
    prefix = "STORAGE_PROBE_" if probe else "STORAGE_"
    kwargs: dict[str, Any] = {"connection_timeout": knob(prefix + "CONNECT_TIMEOUT_S"),
                              "read_timeout": knob(prefix + "READ_TIMEOUT_S")}
    if options.anon:
        kwargs["anon"] = True
    return kwargs


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


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """S3, GCS or Azure Blob: neither a local disk nor ``memory://``."""
    return not is_local(fs) and "memory" not in _protocols(fs)


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


def _is_connection_error(err: BaseException) -> bool:
    """The endpoint could not be reached or did not answer, in any backend's words
    (builtin, botocore for s3fs, aiohttp for gcsfs, azure-core for adlfs)."""
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    try:
        from botocore import exceptions as bex
        if isinstance(err, (bex.ConnectionError, bex.HTTPClientError)):
            return True
    except ImportError:  # pragma: no cover - s3fs absent
        pass
    try:
        import aiohttp  # gcsfs's transport
        if isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    if (type(err).__module__ or "").startswith("azure"):
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError
        return isinstance(err, (ServiceRequestError, ServiceResponseError))
    return False


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
    if _is_connection_error(err):
        return True
    verdict = _cloud_error_transient(err)
    if verdict is not None:
        return verdict
    try:
        from botocore import exceptions as bex
        if isinstance(err, bex.BotoCoreError):  # NoCredentials, ParamValidation, ...
            return False
    except ImportError:  # pragma: no cover - s3fs absent
        pass
    try:
        import aiohttp
        if isinstance(err, aiohttp.ClientPayloadError):  # a response cut short
            return True
    except ImportError:  # pragma: no cover
        pass
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    return False


def _cloud_error_transient(err: BaseException) -> Optional[bool]:
    """Classify gcsfs's HttpError and azure-core's errors by HTTP status; None if neither."""
    for candidate in (err, err.__cause__):
        if candidate is None:
            continue
        module = type(candidate).__module__ or ""
        if module.startswith("gcsfs") and type(candidate).__name__ == "HttpError":
            code = getattr(candidate, "code", None) or 0
            return int(code) >= 500 or int(code) in (408, 429)
        if module.startswith("azure"):
            from azure.core import exceptions as aex
            if isinstance(candidate, (aex.ServiceRequestError, aex.ServiceResponseError)):
                return True  # connection refused/reset, timeouts
            if isinstance(candidate, (aex.ClientAuthenticationError, aex.ResourceNotFoundError,
                                      aex.ResourceExistsError)):
                return False
            if isinstance(candidate, aex.HttpResponseError):
                code = getattr(candidate, "status_code", None) or 0
                return int(code) >= 500 or int(code) in (408, 429)
    return None


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
# A Store resolves its root once; the functions after it take one URI each (a Store of it).


class Store:
    """A storage root resolved once (scheme checked, backend found, filesystem built) and the
    small-file operations under it, each wrapped in :func:`with_retries`. ``parts`` name
    what lies below the root ("step_00000004", "COMMITTED"); they are joined in the
    filesystem's own form, so nothing below the root is resolved or validated again."""

    def __init__(self, uri: str, options: Optional[StorageOptions] = None):
        self.uri = uri
        self.fs, self.path = resolve(uri, options)

    @classmethod
    def of(cls, root: "str | Store", options: Optional[StorageOptions] = None) -> "Store":
        """``root`` itself if it is a Store, else the Store of that URI."""
        if isinstance(root, Store):
            if options is not None:
                raise ValueError("a Store was resolved with its options already; pass the URI to apply other options")
            return root
        return cls(root, options)

    def uri_of(self, *parts: str) -> str:
        return join(self.uri, *parts)

    def path_of(self, *parts: str) -> str:
        """The filesystem path of ``parts`` below the root (no URI round trip)."""
        tail = "/".join(p for p in (str(part).strip("/") for part in parts) if p)
        return f"{self.path.rstrip('/')}/{tail}" if tail else self.path

    def _shown(self, parts) -> str:
        return redact_uri(self.uri_of(*parts))

    def write_text_atomic(self, text: str, *parts: str) -> None:
        """Write ``text`` so that readers see the old content or the new, never half.

        Local: temp file in the same directory, fsync, ``os.replace``. Object stores: one PUT
        (upload), which S3, GCS and Azure Blob make visible atomically. Memory: one assignment.
        """
        fs, path, data = self.fs, self.path_of(*parts), text.encode("utf-8")

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

        with_retries(_write, what=f"write {self._shown(parts)}")

    def read_bytes(self, *parts: str) -> bytes:
        """Read a whole small file. Raises FileNotFoundError if it does not exist."""
        path = self.path_of(*parts)
        return with_retries(lambda: self.fs.cat_file(path), what=f"read {self._shown(parts)}")

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode("utf-8")

    def exists(self, *parts: str) -> bool:
        """Whether a file or non-empty directory exists there.

        Uses ``info`` rather than ``fs.exists``: s3fs's ``exists`` turns some errors into
        False, which would make an unreachable endpoint look like a missing checkpoint.
        """
        fs, path = self.fs, self.path_of(*parts)

        def _exists() -> bool:
            fs.invalidate_cache(path)
            try:
                fs.info(path)
                return True
            except FileNotFoundError:
                return False

        return with_retries(_exists, what=f"stat {self._shown(parts)}")

    def listdir(self, *parts: str) -> list[str]:
        """Sorted names (not paths) of the direct children there.

        A missing directory lists as empty: object stores have no empty directories, so
        "missing" and "empty" cannot be told apart there and must not be on disk either.
        The listing cache is dropped first, so writes by other processes are seen.
        """
        fs, path = self.fs, self.path_of(*parts)

        def _ls() -> list[str]:
            fs.invalidate_cache(path)
            try:
                entries = fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries
                     if e.rstrip("/") != path.rstrip("/")}
            return sorted(n for n in names if n)

        return with_retries(_ls, what=f"list {self._shown(parts)}")

    def remove_tree(self, *parts: str) -> None:
        """Delete that path and everything under it; a missing tree is not an error."""
        fs, path = self.fs, self.path_of(*parts)

        def _rm() -> None:
            fs.invalidate_cache(path)
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            fs.invalidate_cache(path)

        with_retries(_rm, what=f"remove {self._shown(parts)}")


def write_text_atomic(uri: str, text: str, options: Optional[StorageOptions] = None) -> None:
    """:meth:`Store.write_text_atomic` of one URI."""
    Store(uri, options).write_text_atomic(text)


def read_text(uri: str, options: Optional[StorageOptions] = None) -> str:
    """Read a whole small file. Raises FileNotFoundError if it does not exist."""
    return Store(uri, options).read_text()


def exists(uri: str, options: Optional[StorageOptions] = None) -> bool:
    """:meth:`Store.exists` of one URI."""
    return Store(uri, options).exists()


def listdir(uri: str, options: Optional[StorageOptions] = None) -> list[str]:
    """:meth:`Store.listdir` of one URI."""
    return Store(uri, options).listdir()


def remove_tree(uri: str, options: Optional[StorageOptions] = None) -> None:
    """:meth:`Store.remove_tree` of one URI."""
    Store(uri, options).remove_tree()


# --------------------------------------------------------------------------- probe


def _is_connection_failure(err: BaseException) -> bool:
    return any(c is not None and _is_connection_error(c) for c in (err, err.__cause__))


def _create_command(store: ObjectStore, bucket: str, endpoint: Optional[str]) -> str:
    if store.family == "gs":
        return (f"`gcloud storage buckets create gs://{bucket}`" if not endpoint else
                f"`curl -X POST {endpoint}/storage/v1/b -H 'Content-Type: application/json' "
                f"-d '{{\"name\": \"{bucket}\"}}'` (an emulator)")
    if store.family == "az":
        return (f"`az storage container create --name {bucket}` (with the account's "
                "--connection-string or --account-name)")
    return f"`aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}`" if endpoint else "`")


def missing_bucket_error(uri: str, options: Optional[StorageOptions] = None, *,
                         field: str = "storage uri") -> StorageError:
    """The error for an object-store URI whose bucket (container) does not exist, naming
    it, the endpoint and the command that creates it (``field``: which setting holds the
    URI). rayflex itself never creates one."""
    options = options or StorageOptions()
    store = object_store(uri) or _S3
    bucket = redact_uri(uri).split("://", 1)[-1].split("/", 1)[0]
    endpoint = options.resolved_endpoint(store.family)
    word = "container" if store.family == "az" else "bucket"
    return StorageError(
        f"{word} {bucket!r} does not exist at {endpoint or f'the default {store.service} endpoint'} "
        f"({field} {redact_uri(uri)}). Fix: create it with {_create_command(store, bucket, endpoint)}"
        f" or point the {field} at an existing {word}; rayflex never creates {word}s")


def check_bucket(uri: str, options: Optional[StorageOptions] = None, *, field: str = "storage uri") -> None:
    """Raise :func:`missing_bucket_error` if ``uri`` is on an object store and its bucket
    (container) does not exist.

    Read-only (one stat of the bucket), for URIs rayflex reads but must not write, such
    as the dataset; a bucket that exists but refuses the stat counts as existing."""
    if object_store(uri) is None:
        return
    fs, path = resolve(uri, options)
    bucket = path.split("/", 1)[0]

    def _stat() -> None:
        fs.invalidate_cache(bucket)
        fs.info(bucket, refresh=True) if is_s3(fs) else fs.info(bucket)

    try:
        with_retries(_stat, what=f"stat bucket {bucket!r}")
    except FileNotFoundError as err:
        raise missing_bucket_error(uri, options, field=field) from err
    except PermissionError:
        pass


def _probe_filesystem(uri: str, options: StorageOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    """A filesystem of its own for the probe (not cached, not shared): short timeouts and,
    where the package allows it, a single attempt."""
    store = object_store(uri)
    kwargs = fsspec_kwargs(uri, options)
    if store is _S3:
        kwargs = _merge(kwargs, {"config_kwargs": _probe_s3_config()})
    elif store is _GCS:
        kwargs = _merge(kwargs, _gcs_kwargs(options, probe=True))
    elif store is _AZURE:
        kwargs = _merge(kwargs, _azure_kwargs(options, probe=True))
    if store is not None:
        kwargs["skip_instance_cache"] = True
    if store is _GCS:
        cls = _gcs_probe_class()
        return cls(**kwargs), cls._strip_protocol(uri).rstrip("/")
    fs, root = fsspec.core.url_to_fs(uri, **kwargs)
    if store is _S3:
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not a constructor kwarg)
    if store is _AZURE:
        # azure-storage's retry policy (3 retries, 15 s initial backoff: ~90 s against a
        # dead endpoint) is built into the client adlfs made; the probe gets one attempt.
        policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
        if policy is not None and hasattr(policy, "total_retries"):
            policy.total_retries = 0
    return fs, root.rstrip("/")


def _credentials_fix(store: ObjectStore) -> str:
    if store.family == "gs":
        return ("set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or run "
                "`gcloud auth application-default login`), or STORAGE_EMULATOR_HOST for an emulator")
    if store.family == "az":
        return ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN (or `az login`)")
    return "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"


def _is_missing_credentials(err: BaseException) -> bool:
    for candidate in (err, err.__cause__):
        if candidate is None:
            continue
        module, name = type(candidate).__module__ or "", type(candidate).__name__
        if (module.startswith("botocore") and name == "NoCredentialsError") or \
                (module.startswith("google.auth") and name == "DefaultCredentialsError") or \
                (module.startswith("azure") and name in ("ClientAuthenticationError",
                                                         "CredentialUnavailableError")):
            return True
    return False


def check_storage(uri: str, options: Optional[StorageOptions] = None) -> None:
    """Write, read back and delete a tiny probe object under ``uri``.

    Run before any actor starts, so a missing bucket, a dead endpoint or refused
    credentials fail the run in seconds with a message that says what to fix, instead of
    at the first checkpoint an hour in. The client used here has short timeouts and (on
    S3) no retries; it is not cached and not shared. Nothing is created but the probe
    object: never a bucket, a container or a directory marker.
    """
    options = options or StorageOptions()
    scheme = scheme_of(uri)
    store = object_store(uri)
    shown = redact_uri(uri)
    fs, root = _probe_filesystem(uri, options)
    probe = f"{root}/.rayflex-probe-{uuid.uuid4().hex[:12]}"
    payload = f"rayflex storage probe {uuid.uuid4().hex}".encode()
    family = store.family if store else "s3"
    endpoint = (options.resolved_endpoint(family)
                or f"the default {store.service if store else 'S3'} endpoint")
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
    except (StorageError, ConfigError):
        raise
    except FileNotFoundError as err:
        if store is not None:
            raise missing_bucket_error(uri, options) from err
        raise StorageError(f"storage probe at {shown} failed: {err}. Fix: use a directory "
                           "this process can create and write") from err
    except PermissionError as err:
        if store is not None:
            raise StorageError(
                f"{endpoint} refused the credentials for {shown} "
                f"(credentials from {options.credential_source(family)}): {err}. Fix: "
                f"{_credentials_fix(store)} for an identity allowed to put, get and delete "
                f"objects under {shown}") from err
        raise StorageError(f"permission denied writing under {shown}: {err}. Fix: choose a "
                           "directory this user can write, or fix its permissions") from err
    except Exception as err:  # noqa: BLE001 - every failure becomes a StorageError
        if store is _AZURE and any(getattr(e, "error_code", None) == "ContainerNotFound"
                                   for e in (err, err.__cause__)):
            raise missing_bucket_error(uri, options) from err  # adlfs does not map this one
        if store is not None and _is_connection_failure(err):
            hint = {"s3": "StorageOptions.endpoint_url / AWS_ENDPOINT_URL_S3",
                    "gs": "StorageOptions.endpoint_url / STORAGE_EMULATOR_HOST",
                    "az": "the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING"}[family]
            raise StorageError(
                f"cannot reach the {store.service} endpoint {endpoint} for {shown} after "
                f"{time.monotonic() - t0:.1f}s: {type(err).__name__}: {err}. Fix: check "
                f"{hint}, that the service is up, and that this node can reach it") from err
        if store is not None and _is_missing_credentials(err):
            raise StorageError(
                f"no usable credentials for {shown} (tried {options.credential_source(family)}): "
                f"{type(err).__name__}. Fix: {_credentials_fix(store)}"
                + (", or StorageOptions(anon=True) for a public bucket" if family != "az" else ""))  \
                from err
        raise StorageError(f"storage probe at {shown} failed: {type(err).__name__}: {err}. "
                           "Fix: check the storage uri and that the service is healthy") from err
    logger.info("storage probe at %s ok (%.2fs)", shown, time.monotonic() - t0)
