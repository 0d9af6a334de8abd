"""Checkpoints on an S3 account whose identity may not create buckets.

moto enforces IAM here: the writer's user may read, write, delete and list objects in
its bucket, and nothing at the bucket level (no CreateBucket, HeadBucket or
GetBucketLocation), as with a least-privilege role scoped to a prefix. DCP's stock
fsspec writer answers that with a CreateBucket call and fails; rayflex's writer treats
object-store directories as prefixes, so the save commits and loads back.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from checkpoint_helpers import save_committed, tiny_state
from rayflex.checkpoint import manifest as mf

WRITER_POLICY = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
         "Resource": "arn:aws:s3:::{bucket}/*"},
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "arn:aws:s3:::{bucket}"},
        {"Effect": "Deny", "Action": ["s3:CreateBucket"], "Resource": "*"},
    ],
}


@pytest.fixture
def prefix_only_identity(s3_endpoint, s3_client, monkeypatch):
    """A bucket, and the credentials of a user who may only use objects inside it; IAM
    is enforced while the test runs. Yields the bucket's URI."""
    import boto3
    import s3fs
    from moto.core.authorization import enable_iam_authentication

    suffix = uuid.uuid4().hex[:12]
    bucket, user = f"rayflex-prefix-only-{suffix}", f"ckpt-writer-{suffix}"
    s3_client.create_bucket(Bucket=bucket)
    iam = boto3.client("iam", endpoint_url=s3_endpoint, region_name="us-east-1")
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="prefix-only",
                        PolicyDocument=json.dumps(WRITER_POLICY).replace("{bucket}", bucket))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    # fsspec caches filesystems by constructor arguments, and credentials from the
    # environment are not among them: drop instances made with the root test keys.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with enable_iam_authentication():
            yield f"s3://{bucket}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_stock_dcp_writer_would_create_a_bucket(prefix_only_identity):
    """The premise: without rayflex's writer, this identity cannot save at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from rayflex.storage.fs import fsspec_kwargs

    path = f"{prefix_only_identity}/stock/step_00000001"
    with pytest.raises(BaseException, match="(?i)denied|not authorized|forbidden|permission"):
        dcp.save(tiny_state(scheduler=True).tensor_state(), storage_writer=FsspecWriter(path, **fsspec_kwargs(path)))


def test_checkpoint_saves_and_loads_without_bucket_permissions(prefix_only_identity):
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    root = f"{prefix_only_identity}/runs/prefix-only/checkpoints"
    state = tiny_state(scheduler=True)
    save_committed(root, state)
    assert mf.list_committed(root) == [3]
    assert mf.verify(root, 3).files, "the manifest covers the shards it committed"

    fresh = tiny_state(scheduler=True)
    with torch.no_grad():
        for p in fresh.modules[0].parameters():
            p.zero_()
    assert AsyncCheckpointer(root, rank=0, keep=2).load_latest(fresh)["step"] == 3
    for a, b in zip(state.modules[0].parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b)
