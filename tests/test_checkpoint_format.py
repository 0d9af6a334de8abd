"""What a checkpoint's shard files hold: tensors as their bytes (checkpoint.dcp_io.RAW_TENSOR),
the optimizer's hyper-parameters as one entry per parameter (checkpoint.HPARAMS_KEY); and checkpoints
written in DCP's own format with one entry per hyper-parameter (rayflex's layout before)
still resume exactly."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from checkpoint_helpers import save_committed, tiny_state


def _odd_tensors() -> dict:
    torch.manual_seed(0)
    return {"f32": torch.randn(5, 3), "bf16": torch.randn(4, 6).to(torch.bfloat16),
            "i64": torch.arange(7), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
            "transposed": torch.randn(3, 5).t(), "flag": torch.tensor([True, False, True]),
            "note": {"text": "kept as a pickled entry", "tuple": (1, 2.0, None)}}


def test_tensors_are_stored_as_their_bytes_and_load_back_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from rayflex.checkpoint.dcp_io import RAW_TENSOR, CheckpointReader, CheckpointWriter

    saved = _odd_tensors()
    path = str(tmp_path / "step")
    dcp.save(saved, storage_writer=CheckpointWriter(path, single_file_per_rank=True), no_dist=True)

    # Each tensor entry is exactly its bytes (DCP's own writer: a ~1 KB torch.save archive each).
    storage = CheckpointReader(path).read_metadata().storage_data
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            [info] = [info for index, info in storage.items() if index.fqn == key]
            assert info.transform_descriptors == [RAW_TENSOR] and info.length == value.numel() * value.element_size()
    stock = str(tmp_path / "stock")
    dcp.save(saved, storage_writer=FsspecWriter(stock, single_file_per_rank=True), no_dist=True)
    assert _shard_bytes(path) < _shard_bytes(stock) - 500 * 7

    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"text": "", "tuple": ()}
              for k, v in saved.items()}
    dcp.load(target, storage_reader=CheckpointReader(path), no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert target[key].dtype == value.dtype and torch.equal(target[key], value), key
    assert target["note"] == saved["note"]

    # DCP's stock reader refuses the raw entries by their name instead of misreading them.
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as refused:
        dcp.load({k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)},
                 storage_reader=FsspecReader(path), no_dist=True)
    assert RAW_TENSOR in repr(refused.value.failures)


def _shard_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(f"{path}/*.distcp"))


def test_a_truncated_shard_is_named_not_misread(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from rayflex.checkpoint.dcp_io import CheckpointReader, CheckpointWriter

    saved = {"w": torch.randn(64, 64)}
    path = str(tmp_path / "step")
    dcp.save(saved, storage_writer=CheckpointWriter(path, single_file_per_rank=True), no_dist=True)
    [shard] = glob.glob(f"{path}/*.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointException) as refused:
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=CheckpointReader(path), no_dist=True)
    assert "the file is truncated" in repr(refused.value.failures)


def test_the_optimizers_hyper_parameters_are_one_entry_and_resume_as_saved(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from rayflex.checkpoint.checkpointer import HPARAMS_KEY, AsyncCheckpointer
    from rayflex.checkpoint.dcp_io import CheckpointReader
    from rayflex.checkpoint.manifest import step_dir

    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=4)
    opt = state.optimizers[0]
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=3)
    for step, lr in ((3, 0.01), (4, 0.002)):  # a schedule changed the lr between the saves
        for group in opt.param_groups:
            group["lr"] = lr
        ckpt.save(state, step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")

    entries = CheckpointReader(step_dir(root, 4)).read_metadata().state_dict_metadata
    assert sorted(k for k in entries if k.startswith(HPARAMS_KEY)) == [f"{HPARAMS_KEY}.bias", f"{HPARAMS_KEY}.weight"]
    assert isinstance(entries[f"{HPARAMS_KEY}.weight"], BytesStorageMetadata)
    assert not [k for k in entries if ".param_groups." in k], "one entry per hyper-parameter is back"

    fresh = tiny_state(seed=11)
    fresh.optimizers[0].param_groups[0]["betas"] = (0.5, 0.5)
    assert AsyncCheckpointer(root, rank=0).load_latest(fresh)["step"] == 4
    group = fresh.optimizers[0].param_groups[0]
    assert group["lr"] == 0.002 and group["betas"] == (0.9, 0.999), "the hyper-parameters of step 4"
    _assert_same_training_state(state, fresh)


def test_a_checkpoint_in_dcps_own_format_with_one_entry_per_hyper_parameter_resumes(tmp_path):
    """rayflex's checkpoints before the raw format and the packed hyper-parameters."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import EXTRA_FILE, AsyncCheckpointer

    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=5)
    state.optimizers[0].param_groups[0]["lr"] = 0.004
    path = mf.step_dir(root, 7)
    dcp.save(state.tensor_state(packed=False), storage_writer=FsspecWriter(path, single_file_per_rank=True),
             no_dist=True)
    with open(os.path.join(tmp_path, "ckpt", os.path.basename(path), EXTRA_FILE), "w") as f:
        json.dump(state.extra_state(), f)
    mf.commit(root, 7, world_size=1, mesh={}, extra={"reason": "rayflex"})

    fresh = tiny_state(seed=12)
    assert AsyncCheckpointer(root, rank=0).load_latest(fresh)["step"] == 7
    assert fresh.optimizers[0].param_groups[0]["lr"] == 0.004
    _assert_same_training_state(state, fresh)

    save_committed(root, fresh, step=8)  # and the resumed run saves in the current format
    again = tiny_state(seed=13)
    assert AsyncCheckpointer(root, rank=0).load_latest(again)["step"] == 8
    _assert_same_training_state(state, again)


def _assert_same_training_state(a, b) -> None:
    for p, q in zip(a.modules[0].parameters(), b.modules[0].parameters()):
        assert torch.equal(p, q)
    sa, sb = a.optimizers[0].state_dict(), b.optimizers[0].state_dict()
    assert all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in sa["state"][k])
    assert [{k: v for k, v in g.items() if k != "params"} for g in sa["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in sb["param_groups"]]


def test_a_tensor_that_does_not_fill_its_planned_chunk_is_refused_before_it_is_written():
    """The reader takes an entry's shape from .metadata: bytes of another size would be read
    as a different tensor, so the writer refuses them, naming the entry."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from rayflex.checkpoint.dcp_io import CheckpointWriter

    planned = WriteItem(index=MetadataIndex("model.w", torch.Size([0, 0])), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 3])),
                                                    properties=TensorProperties(dtype=torch.float32),
                                                    size=torch.Size([3, 3])))
    views: dict = {}
    with pytest.raises(ValueError, match=r"entry model.w: the tensor to write has 16 bytes, its planned chunk \[3, 3\]"):
        CheckpointWriter._tensor_payload(planned, torch.zeros(2, 2), views)
    assert not views
    assert CheckpointWriter._tensor_payload(planned, torch.ones(3, 3), views).nbytes == 36
    assert views[id(planned)][0] is planned, "a view of a CPU tensor is kept for the next save"
    views = {}
    CheckpointWriter._tensor_payload(planned, torch.ones(3, 6)[:, :3], views)
    assert not views, "a non-contiguous tensor's bytes are a copy: never kept"


def test_a_checkpoint_carries_the_metrics_of_its_last_steps(tmp_path):
    """What a restart writes for steps no live rank reported (control.ledger): the saving
    rank's metrics of the steps up to the save, none past it."""
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    root = f"file://{tmp_path}/ckpt"
    recent = [{"step": s, "loss": 3.0 - s / 10, "step_time_s": 0.1, "lr": 1e-3, "grad_norm": 1.0, "time": 1.0 + s,
               "samples": 8, "data_wait_s": 0.0, "world_size": 1} for s in (1, 2, 3, 4)]
    state = tiny_state(seed=3, recent_steps=lambda: recent)
    save_committed(root, state, step=3)
    info = AsyncCheckpointer(root, rank=0).load_latest(tiny_state(seed=4))
    assert info["step"] == 3 and info["recent_steps"] == recent[:3]


def test_a_checkpointer_given_another_root_commits_there(tmp_path):
    # The benchmarks point one checkpointer at a fresh directory per round: its commits,
    # retention and loads follow the root it has now, not the one it first resolved.
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    first, second = f"file://{tmp_path}/first", f"file://{tmp_path}/second"
    ckpt = AsyncCheckpointer(first, rank=0, use_async=True, keep=2)
    for root, step in ((first, 1), (second, 2)):
        ckpt.root = root
        ckpt.save(tiny_state(), step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")
    assert (mf.list_committed(first), mf.list_committed(second)) == ([1], [2])
    assert ckpt.load_latest(tiny_state(seed=1))["step"] == 2


def test_a_flipped_byte_read_by_the_load_is_caught_by_its_check_and_the_older_step_loaded_over_it(tmp_path):
    """The checksums are taken while the load reads the same files (one pass over the disk):
    a step that fails them is withdrawn after it was loaded, and the older step loaded over it."""
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    root = f"file://{tmp_path}/ckpt"
    older, newer = tiny_state(seed=1), tiny_state(seed=2)
    save_committed(root, older, step=3)
    save_committed(root, newer, step=4)
    [shard] = glob.glob(f"{tmp_path}/ckpt/step_00000004/*.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))

    target = tiny_state(seed=9)
    info = AsyncCheckpointer(root, rank=0).load_latest(target)
    assert info["step"] == 3 and any("step 4" in s and "checksum differs" in s for s in info["skipped"]), info
    for got, want in zip(target.modules[0].state_dict().values(), older.modules[0].state_dict().values()):
        assert torch.equal(got, want)
    assert mf.list_committed(root) == [3]  # step 4 withdrawn
