"""Pytest fixtures: GCS and Azure Blob emulators on loopback, for gcsfs and adlfs.

Loaded from ``tests/conftest.py``'s ``pytest_plugins``.

* ``gcs_emulator`` (session): ``gcp-storage-emulator`` (PyPI) in a subprocess, in memory.
* ``azurite`` (session): Azurite's blob service (npm), installed on first use into
  ``.cache/azurite`` (git-ignored; a file lock keeps two xdist workers from installing at
  once), data under a temporary directory, telemetry off.
* ``gcs_env`` / ``azure_env`` (function): point the cloud's usual environment
  (``STORAGE_EMULATOR_HOST``; ``AZURE_STORAGE_CONNECTION_STRING``) at the emulator for
  the test, hide the host's own cloud settings, and restore everything afterwards.

Each emulator listens on 127.0.0.1 only, writes an access log (one line per request,
which the no-bucket-creation tests read), and is stopped, by the PID this fixture
started, at session end even when tests fail. An emulator that cannot be installed or
started fails the tests that need it, with its log; it never skips them.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AZURITE_DIR = REPO / ".cache" / "azurite"
AZURITE_VERSION = "3.35.0"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
START_TIMEOUT_S = 30.0
# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

HOST_CLOUD_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
                  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "AZURE_STORAGE_CONNECTION_STRING",
                  "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
                  "AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID",
                  "AZURE_STORAGE_ANON")


@dataclass
class Emulator:
    """A running emulator: where it listens and its access log."""

    name: str
    endpoint: str
    log: Path
    proc: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def synced_log(self) -> str:
        """The log once every request made so far is in it: the emulator writes its log
        asynchronously (Azurite buffers it), so send a marked request and wait for it."""
        marker = f"rayflex-log-sync-{uuid.uuid4().hex}"
        try:
            urllib.request.urlopen(f"{self.endpoint}/{marker}", timeout=5).close()
        except OSError:
            pass  # a 4xx answer is expected; only its log line matters
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = self.log_text()
            if marker in text:
                return text[:text.index(marker)]
            time.sleep(0.05)  # polling a condition, bounded by the deadline
        raise AssertionError(f"{self.name} did not log request {marker} within 10 s; "
                             f"cannot tell which requests it served")

    def requests_since(self, offset: int) -> list[str]:
        """Access-log lines of requests after byte ``offset`` (``len(synced_log())``)."""
        return [line for line in self.synced_log()[offset:].splitlines() if '"' in line]


def _free_port() -> int:
    from rayflex.local_ray import free_ports

    return free_ports(1)[0]


def _wait_listening(name: str, port: int, proc: subprocess.Popen, log: Path) -> None:
    """Poll until ``port`` accepts connections; fail with the emulator's log otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)  # polling a condition, bounded by the deadline
    _stop(proc)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
    pytest.fail(f"{name} did not start listening on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f}s "
                f"(exit code {proc.poll()}). Its log:\n{tail}\nFix: see the log above; the "
                "cloud storage tests need this emulator and do not skip without it", pytrace=False)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("gcs-emulator") / "access.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                 "--port", str(port), "--in-memory"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=str(log.parent))
    try:
        _wait_listening("gcp-storage-emulator", port, proc, log)
        yield Emulator("gcp-storage-emulator", f"http://127.0.0.1:{port}", log, proc)
    finally:
        _stop(proc)


def _install_azurite() -> Path:
    """``npm install azurite`` into .cache/azurite once (the lock serializes xdist workers)."""
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    with open(AZURITE_DIR / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if AZURITE_BIN.exists():
            return AZURITE_BIN
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("Azurite (the Azure Blob emulator) is not installed and npm is not on PATH. "
                        "Fix: install Node.js 18+ with npm, or run `npm install --prefix "
                        f"{AZURITE_DIR} azurite@{AZURITE_VERSION}` by hand", pytrace=False)
        done = subprocess.run([npm, "install", "--prefix", str(AZURITE_DIR), "--no-audit", "--no-fund",
                               f"azurite@{AZURITE_VERSION}"], capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not AZURITE_BIN.exists():
            pytest.fail(f"`npm install azurite@{AZURITE_VERSION}` into {AZURITE_DIR} failed "
                        f"(exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}\nFix: check "
                        "that this machine reaches the npm registry (or its mirror)", pytrace=False)
        return AZURITE_BIN


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    binary = _install_azurite()
    port = _free_port()
    work = tmp_path_factory.mktemp("azurite")
    log = work / "access.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                                 "--location", str(work / "data"), "--skipApiVersionCheck", "--loose",
                                 "--disableTelemetry"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=str(work))
    try:
        _wait_listening("Azurite", port, proc, log)
        yield Emulator("Azurite", f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", log, proc)
    finally:
        _stop(proc)


def azurite_connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint};")


def _clear_cloud_env(mp: pytest.MonkeyPatch) -> None:
    for name in HOST_CLOUD_ENV:
        mp.delenv(name, raising=False)


def _clear_instance_caches() -> None:
    """fsspec caches filesystems by constructor arguments; the environment is not one."""
    import adlfs
    import gcsfs.core

    gcsfs.core.GCSFileSystem.clear_instance_cache()
    adlfs.AzureBlobFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_env(gcs_emulator):
    with pytest.MonkeyPatch.context() as mp:
        _clear_cloud_env(mp)
        mp.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
        _clear_instance_caches()
        try:
            yield gcs_emulator
        finally:
            _clear_instance_caches()


@pytest.fixture
def azure_env(azurite):
    with pytest.MonkeyPatch.context() as mp:
        _clear_cloud_env(mp)
        mp.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(azurite.endpoint))
        _clear_instance_caches()
        try:
            yield azurite
        finally:
            _clear_instance_caches()


def create_gcs_bucket(endpoint: str, name: str) -> None:
    """What an operator does once, outside rayflex (rayflex never creates buckets)."""
    req = urllib.request.Request(f"{endpoint}/storage/v1/b?project=rayflex-test",
                                 data=json.dumps({"name": name}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200, resp.status


def create_azure_container(endpoint: str, name: str) -> None:
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(azurite_connection_string(endpoint)).create_container(name)


def fresh_bucket_name() -> str:
    return f"rayflex-test-{uuid.uuid4().hex[:16]}"


def is_bucket_creation(store: str, line: str) -> bool:
    """Whether an access-log line is a create-bucket (GCS) / create-container (Azure) call."""
    if store == "gs":
        return '"POST /storage/v1/b?' in line or '"POST /storage/v1/b ' in line
    return '"PUT ' in line and "restype=container" in line and "comp=" not in line

