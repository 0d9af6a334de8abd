"""What a save costs beside training: saves after an attempt's first reuse its DCP save plan
(checkpoint.save_plan.SavePlanCache) and still write the state of their step; the commit records the
digests the writer took instead of reading every shard back."""

from __future__ import annotations

import xxhash

import pytest
import torch

from checkpoint_helpers import tiny_state


def test_later_saves_reuse_the_plan_and_still_write_the_current_values(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.planner import SavePlanner

    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    planned = []
    real_plan = default_planner.create_default_local_save_plan
    monkeypatch.setattr(default_planner, "create_default_local_save_plan",
                        lambda *a, **k: (planned.append(1), real_plan(*a, **k))[1])

    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=1)
    model, opt = state.modules[0], state.optimizers[0]
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=3)
    key = ckpt._plans.key
    for step in (3, 4, 5):
        if step > 3:  # new values under an unchanged plan
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        ckpt.save(state, step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")
        assert key in SavePlanner._cached_metadata, "the plan of the first save is kept for the next"
    assert len(planned) == 1, "the rank's own plan is listed once, then reused"
    assert ckpt._plans.payload_views, "the staged tensors' bytes views are kept with the plan"
    assert AsyncCheckpointer(f"file://{tmp_path}/sync", rank=0, use_async=False)._plans.payload_views is None, \
        "a synchronous save writes live tensors, which need not change only in place: never kept"
    other = AsyncCheckpointer(f"file://{tmp_path}/other", rank=0)
    assert other._plans.key != key, "another attempt in this process plans for itself"

    fresh = tiny_state(seed=9)
    info = AsyncCheckpointer(root, rank=0).load_latest(fresh)
    assert info["step"] == 5
    for a, b in zip(model.parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b), "the last save wrote the weights of its step, not the first save's"
    saved, loaded = opt.state_dict()["state"], fresh.optimizers[0].state_dict()["state"]
    assert all(torch.equal(saved[k][n], loaded[k][n]) for k in saved for n in saved[k])

    ckpt.close()
    assert not any(key in getattr(SavePlanner, name) for name in ckpt._plans._CACHES), "the attempt's plans go with it"


def test_the_commit_records_the_writers_digests_without_reading_the_shards_back(tmp_path, monkeypatch):
    from rayflex.errors import CheckpointError
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    root = f"file://{tmp_path}/ckpt"
    read_back = []
    real_read = mf._file_fingerprint
    monkeypatch.setattr(mf, "_file_fingerprint", lambda fs, path, *a, **k: (
        read_back.append(path.rsplit("/", 1)[-1]), real_read(fs, path, *a, **k))[1])
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=3)
    ckpt.save(tiny_state(seed=2), step=3)
    [report] = ckpt.wait(timeout_s=60)
    assert report.get("committed"), report.get("error")
    manifest = mf.read_manifest(root, 3)
    shards = [rel for rel in manifest.files if rel.endswith(".distcp")]
    assert shards and not any(name.endswith(".distcp") for name in read_back), \
        "rank 0 did not read a shard back to fingerprint it"
    for rel in shards:
        written = (tmp_path / "ckpt" / "step_00000003" / (rel + mf.DIGEST_SUFFIX)).read_text()
        assert manifest.files[rel].fingerprint == written
        assert written == mf.fingerprint_of((tmp_path / "ckpt" / "step_00000003" / rel).read_bytes())

    # Verify still reads every byte: a byte flipped in storage after the commit is caught.
    mf.verify(root, 3)
    shard = tmp_path / "ckpt" / "step_00000003" / shards[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum differs"):
        mf.verify(root, 3)


def test_a_digest_file_that_is_not_a_digest_is_ignored_and_the_file_hashed(tmp_path, caplog):
    from rayflex.checkpoint import manifest as mf

    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"meta")
    (step / "__0_0.distcp").write_bytes(b"shard bytes")
    (step / ("__0_0.distcp" + mf.DIGEST_SUFFIX)).write_text("not a digest\n")
    manifest = mf.commit(f"file://{tmp_path}/ckpt", 3, world_size=1, mesh={})
    assert manifest.files["__0_0.distcp"].fingerprint == mf.fingerprint_of(b"shard bytes") == \
        "xxh3:" + xxhash.xxh3_128_hexdigest(b"shard bytes")
    assert "not a digest this version writes" in caplog.text
    mf.verify(f"file://{tmp_path}/ckpt", 3)


def test_checkpoints_committed_with_blake2b_digests_still_commit_and_verify(tmp_path):
    """Steps written before the CRC-32 fingerprints: a writer's ``.blake2b`` sidecar is
    still recorded (an uncommitted step of an older attempt being committed), and manifests
    that recorded blake2b verify as before."""
    import hashlib

    from rayflex.errors import CheckpointError
    from rayflex.checkpoint import manifest as mf

    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"meta")
    (step / "__0_0.distcp").write_bytes(b"shard bytes")
    (step / "__0_0.distcp.blake2b").write_text(hashlib.blake2b(b"shard bytes", digest_size=32).hexdigest())
    manifest = mf.commit(f"file://{tmp_path}/ckpt", 3, world_size=1, mesh={})
    assert manifest.files["__0_0.distcp"].fingerprint == \
        "blake2b:" + hashlib.blake2b(b"shard bytes", digest_size=32).hexdigest()
    mf.verify(f"file://{tmp_path}/ckpt", 3)
    (step / "__0_0.distcp").write_bytes(b"shard bytez")
    with pytest.raises(CheckpointError, match="checksum differs"):
        mf.verify(f"file://{tmp_path}/ckpt", 3)


def test_checkpoints_committed_with_crc32_fingerprints_still_commit_and_verify(tmp_path):
    """Steps written before the XXH3 fingerprints: a writer's ``crc32:`` sidecar is still
    recorded, and a manifest that recorded it verifies (and catches a flipped byte) as before."""
    import zlib

    from rayflex.errors import CheckpointError
    from rayflex.checkpoint import manifest as mf

    step = tmp_path / "ckpt" / "step_00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"meta")
    (step / "__0_0.distcp").write_bytes(b"shard bytes")
    crc = f"crc32:{zlib.crc32(b'shard bytes'):08x}"
    (step / ("__0_0.distcp" + mf.DIGEST_SUFFIX)).write_text(crc)
    manifest = mf.commit(f"file://{tmp_path}/ckpt", 3, world_size=1, mesh={})
    assert manifest.files["__0_0.distcp"].fingerprint == crc
    mf.verify(f"file://{tmp_path}/ckpt", 3)
    (step / "__0_0.distcp").write_bytes(b"shard bytez")
    with pytest.raises(CheckpointError, match="checksum differs"):
        mf.verify(f"file://{tmp_path}/ckpt", 3)


def test_a_ranks_plan_is_reused_only_for_the_same_tensors_under_the_same_keys():
    from rayflex.checkpoint.save_plan import SavePlanCache

    cache, weight = SavePlanCache(), torch.ones(3)
    assert cache.reusable_local_plan({"w": weight, "lr": 0.1}) is None, "nothing planned yet"
    cache.keep_local_plan({"w": weight, "lr": 0.1}, "plan")
    assert cache.reusable_local_plan({"w": weight, "lr": 0.01}) == "plan", "a new lr is a new value, not a new item"
    for changed in ({"w": weight.clone(), "lr": 0.1},  # a re-created tensor (new staging, loaded state)
                    {"w": weight}, {"w": weight, "lr": 0.1, "x": 1}, {"w": weight, "eps": 0.1},
                    {"w": weight, "lr": torch.tensor(0.1)}):
        assert cache.reusable_local_plan(changed) is None, changed
    cache.clear()
    assert cache.reusable_local_plan({"w": weight, "lr": 0.1}) is None

    import weakref

    replaced = torch.ones(1 << 16)  # a staging buffer that a new staging replaced
    cache.keep_local_plan({"w": replaced}, "plan")
    gone = weakref.ref(replaced)
    del replaced
    assert gone() is None, "the kept plan does not keep a replaced staging's buffers alive"
    assert cache.reusable_local_plan({"w": torch.ones(1 << 16)}) is None


def test_repeat_saves_write_the_same_metadata_without_pickling_it_again(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from rayflex.checkpoint import save_plan
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    pickled = []
    real = save_plan.metadata_file_bytes
    monkeypatch.setattr(save_plan, "metadata_file_bytes", lambda *a: (pickled.append(1), real(*a))[1])
    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=3)
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=5)
    for step in (3, 4):
        ckpt.save(state, step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")
    assert len(pickled) == 1, ".metadata is pickled by the first save, then its bytes reused"
    first, second = ((tmp_path / "ckpt" / f"step_0000000{s}" / ".metadata").read_bytes() for s in (3, 4))
    assert first == second
    metadata = FileSystemReader(str(tmp_path / "ckpt" / "step_00000004")).read_metadata()
    assert metadata.storage_data and metadata.state_dict_metadata, "the file holds the whole metadata"
    assert {i.relative_path for i in metadata.storage_data.values()} == {"__0_0.distcp"}

    # Re-created optimizer state (a new staging) in the same layout: the same bytes again.
    state.optimizers[0].load_state_dict(state.optimizers[0].state_dict())
    ckpt.save(state, step=5)
    assert ckpt.wait(timeout_s=60)[0].get("committed")
    assert len(pickled) == 1
    # Another layout (other shapes): planned and pickled again, and it is what loads.
    torch.manual_seed(5)
    bigger = tiny_state(seed=5)
    bigger.modules[0] = torch.nn.Linear(8, 6)
    bigger.optimizers[0] = torch.optim.AdamW(bigger.modules[0].parameters(), lr=1e-2)
    bigger.modules[0](torch.randn(2, 8)).sum().backward()
    bigger.optimizers[0].step()
    ckpt.save(bigger, step=6)
    [report] = ckpt.wait(timeout_s=60)
    assert report.get("committed"), report.get("error")
    assert len(pickled) == 2
    fresh = tiny_state(seed=9)
    fresh.modules[0] = torch.nn.Linear(8, 6)
    fresh.optimizers[0] = torch.optim.AdamW(fresh.modules[0].parameters(), lr=1e-2)
    assert AsyncCheckpointer(root, rank=0).load_latest(fresh)["step"] == 6
    for a, b in zip(bigger.modules[0].parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b)
    ckpt.close()


def test_write_results_travel_packed_and_describe_the_same_storage_as_dcps():
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from rayflex.checkpoint.dcp_io import RAW_TENSOR
    from rayflex.checkpoint.save_plan import PackedWriteResults, storage_index_of

    packed = PackedWriteResults.from_rows([("model.w", (4, 0), 1, "__1_0.distcp", 0, 64, [RAW_TENSOR]),
                                           ("optim_hparams.w", None, None, "__1_0.distcp", 64, 301, None)])
    travelled = pickle.loads(pickle.dumps(packed))
    assert travelled.blob == packed.blob and len(travelled) == 2
    dcps_own = [WriteResult(index=MetadataIndex("model.w", torch.Size([4, 0]), 1), size_in_bytes=64,
                            storage_data=_StorageInfo("__1_0.distcp", 0, 64, transform_descriptors=[RAW_TENSOR])),
                WriteResult(index=MetadataIndex("optim_hparams.w"), size_in_bytes=301,
                            storage_data=_StorageInfo("__1_0.distcp", 64, 301))]
    assert storage_index_of([travelled]) == storage_index_of([dcps_own])
    assert pickle.dumps(storage_index_of([travelled])) == pickle.dumps(storage_index_of([dcps_own])), \
        ".metadata holds the same objects either way"


def test_the_metadata_broadcast_after_a_save_is_empty_and_rank_zero_keeps_it_whole():
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from rayflex.checkpoint.save_plan import SavePlanCache

    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata.__new__(TensorStorageMetadata)},
                  planner_data={"w": ("w",)})
    cache = SavePlanCache()
    kept = cache.rank_zero_metadata(md)
    assert kept.state_dict_metadata is md.state_dict_metadata and kept.planner_data == md.planner_data
    assert cache.rank_zero_metadata(md) is kept, "the same stand-in while DCP's metadata is the same"
    sent = pickle.loads(pickle.dumps(kept))
    assert type(sent) is Metadata and sent.state_dict_metadata == {}


def test_the_cheap_flattening_matches_dcps_for_rayflexs_state_and_declines_the_rest():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from rayflex.checkpoint.save_plan import flat_view

    state = tiny_state(seed=4).tensor_state()
    assert flat_view(state) == flatten_state_dict(state)
    assert list(flat_view(state)[0]) == list(flatten_state_dict(state)[0]), "the same order: the same plan"
    for other in ({"a": {"b": {"c": 1}}}, {"a": [torch.ones(1)]}, {"a": {"b": [1, 2]}}, {"a.b": 1, "a": {"b": 2}}):
        assert flat_view(other) is None, other


def test_uploads_yield_to_training_only_while_the_loop_runs(tmp_path, monkeypatch):
    # A periodic save's upload runs at RAYFLEX_UPLOAD_NICE beside the next steps; a final,
    # stop or emergency save (the loop has ended: a spot notice's deadline) runs at the
    # process's own priority, and a lowered thread is raised back after its upload.
    import os
    import threading

    from rayflex.checkpoint import dcp_io
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    if os.geteuid() != 0:
        pytest.skip("raising a thread's priority back needs root (CAP_SYS_NICE)")
    monkeypatch.setenv("RAYFLEX_UPLOAD_NICE", "7")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    seen = []
    write = dcp_io.CheckpointWriter._write_data

    def noting(self, *args, **kwargs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(dcp_io.CheckpointWriter, "_write_data", noting)
    ckpt = AsyncCheckpointer(f"file://{tmp_path}/ckpt", rank=0, use_async=True, keep=3)
    state = tiny_state()
    for step, reason in ((1, "periodic"), (2, "emergency"), (3, "periodic"), (4, "final")):
        ckpt.save(state, step=step, reason=reason)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report
    assert seen == [7, own, 7, own], seen
