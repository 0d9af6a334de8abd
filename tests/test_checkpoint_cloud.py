"""Checkpoints on GCS (gcsfs) and Azure Blob (adlfs), against local emulators on loopback
(``tests/cloud_fixtures.py``): committed with checksums, loaded back bit for bit,
resumed at another world size, a corrupt newest step detected and passed over, and never
a bucket or container created. The multi-rank tests use plain local processes (no Ray).
"""

from __future__ import annotations

import sys

import pytest
import torch

from checkpoint_helpers import save_committed, tiny_state
from cloud_fixtures import (create_azure_container, create_gcs_bucket, fresh_bucket_name,
                            is_bucket_creation)
from conftest import SEQ_LEN, small_gpt
from rayflex.errors import ConfigError, StorageError
from rayflex.checkpoint import manifest as mf

STORES = ["gs", "az"]


class CloudStore:
    """A fresh bucket (container) on one emulator, made the way an operator would."""

    def __init__(self, scheme: str, emulator):
        self.scheme, self.emulator = scheme, emulator
        self.bucket = fresh_bucket_name()
        create = create_gcs_bucket if scheme == "gs" else create_azure_container
        create(emulator.endpoint, self.bucket)
        self.uri = f"{scheme}://{self.bucket}"

    def log_offset(self) -> int:
        return len(self.emulator.synced_log())

    def bucket_creations_since(self, offset: int) -> list[str]:
        return [line for line in self.emulator.requests_since(offset) if is_bucket_creation(self.scheme, line)]

    def foreign_write(self, uri: str, data: bytes) -> None:
        """Overwrite an object as another process would: a filesystem of its own, not the
        cached one rayflex uses."""
        import fsspec

        from rayflex.storage.fs import fsspec_kwargs

        fs, path = fsspec.core.url_to_fs(uri, skip_instance_cache=True, **fsspec_kwargs(uri))
        fs.pipe_file(path, data)


@pytest.fixture(params=STORES)
def cloud(request):
    env = request.getfixturevalue("gcs_env" if request.param == "gs" else "azure_env")
    return CloudStore(request.param, env)


def test_checkpoint_round_trip(cloud):
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer
    from rayflex.storage.fs import check_storage

    root = f"{cloud.uri}/runs/round-trip/checkpoints"
    check_storage(root)
    state = tiny_state()
    save_committed(root, state)
    assert mf.list_committed(root) == [3]
    manifest = mf.verify(root, 3)
    assert any(name.endswith(".metadata") for name in manifest.files)
    assert all(f.fingerprint.startswith("xxh3:") for f in manifest.files.values())

    fresh = tiny_state(seed=1)
    assert AsyncCheckpointer(root, rank=0, keep=2).load_latest(fresh)["step"] == 3
    for a, b in zip(state.modules[0].parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b)
    assert fresh.optimizers[0].state_dict()["state"][0]["exp_avg"].equal(
        state.optimizers[0].state_dict()["state"][0]["exp_avg"])


def test_no_bucket_or_container_is_ever_created(cloud):
    """Saving, committing, retention and loading are object calls under a prefix; a
    missing bucket fails with the command that creates it, and stays missing."""
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer
    from rayflex.storage.fs import check_bucket, check_storage, exists

    offset = cloud.log_offset()
    root = f"{cloud.uri}/deep/prefix/checkpoints"
    check_storage(root)
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=1)
    for step in (1, 2):
        ckpt.save(tiny_state(), step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")
    assert mf.list_committed(root) == [2], "retention removed step 1"
    assert AsyncCheckpointer(root, rank=0).load_latest(tiny_state(seed=1))["step"] == 2

    missing = f"{cloud.scheme}://{fresh_bucket_name()}"
    word = "bucket" if cloud.scheme == "gs" else "container"
    with pytest.raises(StorageError, match=f"{word} .* does not exist.*Fix: create it with"):
        check_storage(f"{missing}/runs")
    with pytest.raises(StorageError, match=f"{word} .* does not exist"):
        check_bucket(f"{missing}/data")
    lost = AsyncCheckpointer(f"{missing}/ckpt", rank=0, use_async=True)
    lost.save(tiny_state(), step=1)
    [report] = lost.wait(timeout_s=60)
    assert "error" in report and not report.get("committed"), report

    before = cloud.emulator.synced_log()[:offset].splitlines()
    assert any(is_bucket_creation(cloud.scheme, line) for line in before), \
        "the detector sees the fixture's own creation of the bucket"
    requests = cloud.emulator.requests_since(offset)
    assert sum(cloud.bucket[:12] in line for line in requests) > 10, \
        f"the emulator's access log shows no traffic for this test: {requests[:5]}"
    assert cloud.bucket_creations_since(offset) == []
    assert not exists(missing + "/ckpt"), f"{missing} was created"


@pytest.mark.parametrize("scheme, extra", [("gs", "gcp"), ("gcs", "gcp"), ("az", "azure"), ("abfs", "azure")])
def test_missing_package_names_the_extra(scheme, extra, monkeypatch):
    """Validation, before any work: the config names the extra that installs the package."""
    import rayflex as rf

    module = "gcsfs" if extra == "gcp" else "adlfs"
    monkeypatch.setitem(sys.modules, module, None)  # `import gcsfs` now raises ImportError
    with pytest.raises(ConfigError, match=rf"RunConfig\.storage.*{module}.*pip install 'rayflex\[{extra}\]'"):
        rf.RunConfig(name="no-extra", storage=f"{scheme}://bucket/runs")
    with pytest.raises(ConfigError, match=rf"pip install 'rayflex\[{extra}\]'"):
        rf.CheckpointConfig(uri=f"{scheme}://bucket/ckpt")
    from rayflex.storage.fs import resolve

    with pytest.raises(ConfigError, match=rf"pip install 'rayflex\[{extra}\]'"):
        resolve(f"{scheme}://bucket/x")


def _spec(dataset_uri: str, storage: str, steps: int):
    import rayflex as rf

    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=12),
                      run=rf.RunConfig(name="cloud", storage=storage, steps=steps),
                      scaling=rf.ScalingConfig(num_workers=2, min_workers=1),
                      checkpoint=rf.CheckpointConfig(every_steps=2, keep=5)).spec


def _assert_ran(got: dict, restored: int, steps: int) -> None:
    assert got["restored_step"] == restored, got
    for r in got["runs"]:
        assert r.get("state") == "done" and r["step"] == steps, r
        assert not r["checkpoint_errors"], r["checkpoint_errors"][0][-800:]


@pytest.mark.multiproc
def test_resharded_resume_and_corrupt_byte_fallback(cloud, dataset_uri):
    """Two ranks save; one rank resumes from their checkpoint (DCP reshards) and saves;
    a flipped byte in that newest step is detected, and two ranks resume from the older
    one instead."""
    from rayflex.storage.fs import join, listdir, resolve
    from rayflex.testing.chaos.local_workers import LocalWorkerPool

    storage = f"{cloud.uri}/runs"
    root = f"{storage}/cloud/checkpoints"
    with LocalWorkerPool(2, timeout_s=120) as pool:
        _assert_ran(pool.attempt([0, 1], _spec(dataset_uri, storage, 4), 4), restored=0, steps=4)
        assert mf.list_committed(root) == [2, 4]
        assert mf.verify(root, 4).world_size == 2

        _assert_ran(pool.attempt([1], _spec(dataset_uri, storage, 6), 6), restored=4, steps=6)
        assert mf.list_committed(root) == [2, 4, 6]
        assert mf.verify(root, 6).world_size == 1

        shard = next(n for n in listdir(mf.step_dir(root, 6)) if n.endswith(".distcp"))
        shard_uri = join(mf.step_dir(root, 6), shard)
        fs, path = resolve(shard_uri)
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 0x01
        cloud.foreign_write(shard_uri, bytes(data))
        assert mf.resolve_loadable(root).step == 4, "the flipped byte is detected"

        _assert_ran(pool.attempt([0, 1], _spec(dataset_uri, storage, 8), 8), restored=4, steps=8)
    assert mf.list_committed(root) == [2, 4, 6, 8]
    assert mf.verify(root, 6).world_size == 2, "step 6 was written anew by the resumed run"


@pytest.mark.parametrize("scheme", STORES)
def test_probe_fails_fast_naming_a_dead_endpoint(scheme, monkeypatch):
    """Nothing listens on the port: the start-up probe answers in seconds (one attempt, not
    the packages' own minute of retries), names the endpoint and the setting, and shows no
    secret."""
    import time

    from cloud_fixtures import AZURITE_KEY, HOST_CLOUD_ENV, azurite_connection_string
    from rayflex.local_ray import free_ports
    from rayflex.storage.fs import check_storage

    for name in HOST_CLOUD_ENV:
        monkeypatch.delenv(name, raising=False)
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    if scheme == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        service, setting = "GCS", "STORAGE_EMULATOR_HOST"
    else:
        endpoint += "/devstoreaccount1"
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(endpoint))
        service, setting = "Azure Blob", "AZURE_STORAGE_CONNECTION_STRING"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        check_storage(f"{scheme}://bucket/runs")
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert f"cannot reach the {service} endpoint {endpoint}" in message and setting in message
    assert AZURITE_KEY not in message
