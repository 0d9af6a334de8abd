"""rayflex.storage.fs: URI resolution, retries, the small file API and the storage probe.

S3 cases run against moto's threaded server on loopback (see s3_fixture.py).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
import uuid

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from rayflex.errors import ConfigError, StorageError
from rayflex.storage import fs as sfs
from rayflex.storage.fs import (StorageOptions, check_storage, exists, join, listdir,
                                read_text, remove_tree, resolve, with_retries,
                                write_text_atomic)


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.fixture
def no_sleep(monkeypatch):
    delays: list[float] = []
    monkeypatch.setattr(sfs, "_sleep", delays.append)
    return delays


@pytest.fixture(params=["file", "memory", "s3"])
def base_uri(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/data"
    elif request.param == "memory":
        uri = f"memory://rayflex-test-{uuid.uuid4().hex[:8]}"
        yield uri
        remove_tree(uri)
    else:
        yield request.getfixturevalue("s3_bucket") + "/data"


def _dead_endpoint() -> str:
    """An address where nobody listens: bind port 0, note the port, close the socket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- resolve


def test_resolve_local_memory_and_s3(tmp_path, s3_endpoint):
    fs, path = resolve(f"file://{tmp_path}/a/")
    assert sfs.is_local(fs) and path == f"{tmp_path}/a"
    fs2, path2 = resolve(str(tmp_path / "b"))  # a bare local path
    assert sfs.is_local(fs2) and path2 == f"{tmp_path}/b"
    fs3, path3 = resolve("memory://x/y")
    assert "memory" in fs3.protocol and path3 == "/x/y"
    fs4, path4 = resolve("s3://bucket/run/ckpt")
    assert sfs.is_s3(fs4) and path4 == "bucket/run/ckpt"
    assert fs4.client_kwargs.get("endpoint_url", fs4.endpoint_url) == s3_endpoint


def test_explicit_endpoint_wins_over_environment(s3_endpoint):
    kwargs = sfs.fsspec_kwargs("s3://b/p", StorageOptions(endpoint_url="http://other:9000"))
    assert kwargs["endpoint_url"] == "http://other:9000"
    assert sfs.fsspec_kwargs("s3://b/p")["endpoint_url"] == s3_endpoint


@pytest.mark.parametrize("uri", ["hdfs://nn/x", "webhdfs://nn/x", "simplecache::s3://b/x", "S3A://b/x"])
def test_unknown_scheme_is_a_config_error(uri):
    with pytest.raises(ConfigError) as info:
        resolve(uri)
    message = str(info.value)
    assert uri.split("://")[0].split("::")[0] in message
    assert "s3://" in message and "file://" in message and "memory://" in message


def test_s3_uri_without_bucket_is_a_config_error():
    with pytest.raises(ConfigError, match="bucket"):
        resolve("s3://")


def test_join_keeps_the_scheme():
    assert join("s3://b", "ckpt", "step_00000001") == "s3://b/ckpt/step_00000001"
    assert join("s3://b/root/", "/x/") == "s3://b/root/x"
    assert join("file:///", "tmp") == "file:///tmp"
    assert join("/data/run", "a/b", "") == "/data/run/a/b"
    assert join("memory://r") == "memory://r"


def test_options_never_show_secrets():
    opts = StorageOptions(endpoint_url="http://e", key="AKIAEXAMPLE1234",
                          secret="very-secret-value", token="session-token-value",
                          extra={"client_kwargs": {}, "password": "hunter2"})
    for text in (repr(opts), str(opts), f"{opts}"):
        assert "very-secret-value" not in text and "session-token-value" not in text
        assert "hunter2" not in text and "AKIAEXAMPLE1234" not in text
    assert "http://e" in repr(opts)
    assert "very-secret-value" not in opts.credential_source()
    # ... but they do reach the filesystem.
    kwargs = sfs.fsspec_kwargs("s3://b", opts)
    assert kwargs["secret"] == "very-secret-value" and kwargs["key"] == "AKIAEXAMPLE1234"


# --------------------------------------------------------------------------- retries


def test_transient_errors_are_retried_with_backoff(no_sleep, caplog):
    errors = [EndpointConnectionError(endpoint_url="http://x"), TimeoutError("slow"),
              OSError(errno.EIO, "io"), _client_error("SlowDown", 503),
              OSError(errno.EBUSY, "busy")]
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    with caplog.at_level(logging.WARNING, logger="rayflex.storage.fs"):
        assert with_retries(flaky, attempts=6, base_delay_s=0.1, max_delay_s=0.3,
                            what="write s3://b/k") == "ok"
    assert len(calls) == 6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5 and all("write s3://b/k" in r.getMessage() for r in warnings)
    # Exponential with jitter in [ceiling/2, ceiling], capped at max_delay_s.
    for attempt, delay in enumerate(no_sleep, start=1):
        ceiling = min(0.3, 0.1 * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling


def test_exhausted_retries_raise_storage_error_naming_the_operation(no_sleep):
    calls = []

    def down():
        calls.append(1)
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    with pytest.raises(StorageError, match=r"read s3://b/key failed after 3 attempts") as info:
        with_retries(down, attempts=3, what="read s3://b/key")
    assert len(calls) == 3 and isinstance(info.value.__cause__, ConnectionRefusedError)


def test_retry_attempts_and_s3_timeouts_follow_the_environment(no_sleep, monkeypatch):
    monkeypatch.setenv("RAYFLEX_STORAGE_RETRY_ATTEMPTS", "2")
    monkeypatch.setenv("RAYFLEX_STORAGE_RETRY_MAX_DELAY_S", "0.05")
    monkeypatch.setenv("RAYFLEX_STORAGE_READ_TIMEOUT_S", "7")
    calls = []

    def down():
        calls.append(1)
        raise TimeoutError("slow")

    with pytest.raises(StorageError, match="failed after 2 attempts"):
        with_retries(down, what="op")
    assert len(calls) == 2 and all(d <= 0.05 for d in no_sleep)
    assert sfs.fsspec_kwargs("s3://b")["config_kwargs"]["read_timeout"] == 7
    monkeypatch.setenv("RAYFLEX_STORAGE_RETRY_ATTEMPTS", "1.5")
    with pytest.raises(ValueError, match="RAYFLEX_STORAGE_RETRY_ATTEMPTS='1.5' is not a whole number"):
        with_retries(down, what="op")


@pytest.mark.parametrize("err", [
    FileNotFoundError("no such key"), PermissionError("access denied"),
    _client_error("NoSuchBucket", 404), _client_error("AccessDenied", 403),
    OSError(errno.EINVAL, "InvalidBucketName"), NoCredentialsError(), ValueError("bug"),
])
def test_non_transient_errors_are_not_retried(no_sleep, err):
    calls = []

    def fail():
        calls.append(1)
        raise err

    with pytest.raises(type(err)):
        with_retries(fail, attempts=5, what="op")
    assert len(calls) == 1 and no_sleep == []


def test_s3fs_translated_throttling_is_transient():
    # s3fs turns ClientError(SlowDown) into OSError(EBUSY) with the ClientError as cause.
    err = OSError(errno.EBUSY, "Please reduce your request rate")
    err.__cause__ = _client_error("SlowDown", 503)
    assert sfs.is_transient(err)
    denied = OSError(errno.EIO, "odd")
    denied.__cause__ = _client_error("InvalidArgument", 400)
    assert not sfs.is_transient(denied)


# --------------------------------------------------------------------------- small API


def test_text_round_trip_listing_and_removal(base_uri):
    assert listdir(base_uri) == []
    assert not exists(join(base_uri, "a.json"))
    write_text_atomic(join(base_uri, "a.json"), '{"v": 1}')
    write_text_atomic(join(base_uri, "sub", "b.txt"), "héllo")
    assert read_text(join(base_uri, "a.json")) == '{"v": 1}'
    assert read_text(join(base_uri, "sub", "b.txt")) == "héllo"
    write_text_atomic(join(base_uri, "a.json"), '{"v": 2}')  # overwrite
    assert read_text(join(base_uri, "a.json")) == '{"v": 2}'
    assert exists(join(base_uri, "a.json")) and exists(join(base_uri, "sub"))
    assert listdir(base_uri) == ["a.json", "sub"]  # no temp files left behind
    with pytest.raises(FileNotFoundError):
        read_text(join(base_uri, "missing"))
    remove_tree(join(base_uri, "sub"))
    remove_tree(join(base_uri, "sub"))  # idempotent
    assert listdir(base_uri) == ["a.json"]


def test_writes_by_another_process_are_seen(s3_bucket, s3_client):
    uri = f"{s3_bucket}/shared"
    write_text_atomic(join(uri, "a"), "1")
    assert listdir(uri) == ["a"]  # s3fs has now cached this listing
    s3_client.put_object(Bucket=s3_bucket[5:], Key="shared/b", Body=b"2")
    assert listdir(uri) == ["a", "b"]
    assert exists(join(uri, "b"))


# --------------------------------------------------------------------------- probe


def test_check_storage_passes_and_leaves_nothing_behind(base_uri):
    check_storage(base_uri)
    assert listdir(base_uri) == []


def test_check_storage_missing_bucket(s3_endpoint):
    bucket = f"rayflex-absent-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StorageError) as info:
        check_storage(f"s3://{bucket}/run")
    message = str(info.value)
    assert f"bucket '{bucket}' does not exist" in message
    assert f"aws s3 mb s3://{bucket}" in message and s3_endpoint in message


def test_check_storage_dead_endpoint_fails_fast(s3_endpoint):
    dead = _dead_endpoint()
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        check_storage("s3://bucket/run", StorageOptions(endpoint_url=dead))
    assert time.monotonic() - t0 < 5
    assert "cannot reach the S3 endpoint" in str(info.value) and dead in str(info.value)


def test_check_storage_refused_credentials(s3_bucket):
    # moto accepts any credentials unless IAM authentication is switched on; the server
    # thread shares this process's moto settings, so this toggles it for this test only.
    from moto.core.authorization import enable_iam_authentication

    secret = "definitely-not-the-secret-" + uuid.uuid4().hex
    options = StorageOptions(key="AKIABADKEY000BAD", secret=secret)
    with enable_iam_authentication():
        with pytest.raises(StorageError) as info:
            check_storage(f"{s3_bucket}/run", options)
    message = str(info.value)
    assert "refused the credentials" in message and "AWS_ACCESS_KEY_ID" in message
    assert secret not in message and secret not in repr(info.value)
    assert "0BAD" in message  # the key id's tail, to tell keys apart


def test_check_storage_unwritable_local_dir(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(StorageError, match="permission denied"):
        check_storage(str(locked / "run"))
