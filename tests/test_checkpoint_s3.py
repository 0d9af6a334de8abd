"""Checkpoints on a real S3 endpoint (moto's threaded server on loopback) through s3fs:
committed with ETag fingerprints, retention applied, resumed with the same losses."""

import pytest

from rayflex.testing.reference import single_process_losses
from rayflex.storage import manifest as mf

from conftest import loopback_cluster
from s3_fixture import TEST_ENV
from test_checkpoint_cluster import STEPS, _crash_at_step_4, _trainer

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def s3_cluster(moto_server, tmp_path_factory):
    """A cluster whose processes see the S3 endpoint and test credentials in their env."""
    import boto3

    with pytest.MonkeyPatch.context() as mp:
        for k, v in TEST_ENV.items():
            mp.setenv(k, v)
        mp.setenv("AWS_ENDPOINT_URL_S3", moto_server)
        boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket="rayflex-ckpt")
        with loopback_cluster([{"num_cpus": 4}]):
            yield "s3://rayflex-ckpt"


def test_checkpoint_resume_on_s3(s3_cluster, dataset_uri, monkeypatch):
    storage = f"{s3_cluster}/runs"
    _crash_at_step_4(dataset_uri, storage, "s3run", monkeypatch, workers=2)
    root = f"{storage}/s3run/checkpoints"
    assert mf.list_committed(root) == [2]
    manifest = mf.verify(root, 2)
    assert any(name.endswith(".metadata") for name in manifest.files)
    assert all(f.fingerprint.startswith("etag:") for f in manifest.files.values())
    trainer = _trainer(dataset_uri, storage, "s3run", workers=2)
    result = trainer.fit(progress=False)
    assert result.steps_completed == STEPS
    assert mf.list_committed(root) == [6, 8], "retention keeps the newest 2 committed steps"
    reference = single_process_losses(trainer.spec, STEPS)
    assert [m["loss"] for m in result.metrics[2:]] == pytest.approx(reference[2:], rel=1e-5)
