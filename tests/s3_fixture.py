"""Pytest fixtures: a real S3 endpoint on loopback (moto's threaded server) for s3fs.

Loaded from ``tests/conftest.py`` with ``pytest_plugins = ["s3_fixture"]``.

* ``moto_server`` (session): the server on 127.0.0.1 and a port the OS picks (port 0,
  so no race for a "free" port); stopped at session end even when tests fail.
* ``s3_endpoint`` (function): the endpoint URL; sets test credentials, region and
  ``AWS_ENDPOINT_URL_S3`` for the test and restores the environment afterwards, and
  isolates the test from the host's ``~/.aws``.
* ``s3_bucket`` (function): a fresh, uniquely named bucket, yielded as ``s3://name``.
* ``s3_client`` (function): a plain boto3 client on the endpoint, for tests that act as
  "another process" (bypassing s3fs and its listing cache).

Known quirk: moto's responses carry two ``Server`` headers (http.server's and moto's
``server: amazon.com``). aiohttp's C parser accepts that, its pure-Python parser (used
under ``python -X dev`` or ``AIOHTTP_NO_EXTENSIONS=1``) rejects it, and then every s3fs
request fails with "Duplicate 'Server' header found". Run the S3 tests without dev mode.

Moto keeps all buckets in this process's memory; moto's ``mock_aws`` decorator patches
botocore process-wide and must not be used in the same tests as this server.
"""

from __future__ import annotations

import uuid

import pytest

TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "rayflex-test-key",
    "AWS_SECRET_ACCESS_KEY": "rayflex-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_server():
    import logging

    from moto.server import ThreadedMotoServer

    # One log line per HTTP request drowns every failing test's output.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_endpoint(moto_server, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TEST_ENV.items():
            mp.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
                     "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ENDPOINT_URL_S3", moto_server)
        # Never read the host's ~/.aws files.
        mp.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config-absent"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials-absent"))
        yield moto_server


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name=TEST_ENV["AWS_DEFAULT_REGION"],
                        aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3_bucket(s3_client):
    name = f"rayflex-test-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    yield f"s3://{name}"
