"""A rank's checkpoint shard on an object store leaves as objects of about
``RAYFLEX_CHECKPOINT_OBJECT_MB``, each in one PUT (never assembled from multipart parts),
and loads back bit for bit (moto's server on loopback, through s3fs)."""

from __future__ import annotations

import pytest
import torch

from rayflex.checkpoint import manifest as mf


def _state(seed: int):
    """Six 256x256 layers after one AdamW step: ~4.7 MB of tensors with the optimizer's."""
    from rayflex.checkpoint.checkpointer import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return TrainState(modules=[model], optimizers=[opt], get_step=lambda: 3), model, opt


def _shard_objects(s3_client, root: str, step: int) -> dict[str, tuple[int, str]]:
    bucket, prefix = root.removeprefix("s3://").split("/", 1)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{mf.step_name(step)}/")
    return {o["Key"].rsplit("/", 1)[-1]: (o["Size"], o["ETag"].strip('"'))
            for o in listed.get("Contents", []) if o["Key"].endswith(".distcp")}


@pytest.mark.parametrize("object_mb, threads", [(1, 2), (64, 2)])
def test_a_shard_leaves_as_objects_of_the_configured_size_each_in_one_put(
        s3_endpoint, s3_bucket, s3_client, monkeypatch, object_mb, threads):
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    monkeypatch.setenv("RAYFLEX_CHECKPOINT_OBJECT_MB", str(object_mb))
    root = f"{s3_bucket}/ckpt"
    state, model, opt = _state(0)
    total = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(),
                                                       *[v for s in opt.state.values() for v in s.values()
                                                         if torch.is_tensor(v) and v.dim()]])
    saver = AsyncCheckpointer(root, rank=0, use_async=True, keep=2, upload_threads=threads)
    saver.save(state, step=3)
    [report] = saver.wait(timeout_s=60)
    assert report.get("committed"), report.get("error")

    objects = _shard_objects(s3_client, root, 3)
    # At least one object per upload thread, and as many more as the size asks for.
    assert len(objects) == max(threads, -(-total // (object_mb << 20))), objects
    assert sum(size for size, _ in objects.values()) >= total
    # A multipart object's ETag ends in "-<parts>": every object here was one PUT.
    assert all("-" not in etag for _, etag in objects.values()), objects
    assert all(size < 2 * (object_mb << 20) for size, _ in objects.values()), objects

    other, model2, opt2 = _state(1)
    loaded = AsyncCheckpointer(root, rank=0, use_async=True, keep=2).load_latest(other)
    assert loaded["step"] == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
