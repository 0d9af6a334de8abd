"""The sampler is world-size independent; datasets read the same from any fsspec URI."""

import numpy as np
import pytest

from rayflex.data.dataset import GlobalSampler, TokenDataset, write_synthetic_dataset


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6])
def test_dp_slices_of_a_step_are_the_global_batch(dp):
    s = GlobalSampler(num_samples=100, global_batch=12, seed=3)
    for step in range(20):
        joined = np.concatenate([s.indices(step, r, dp) for r in range(dp)])
        np.testing.assert_array_equal(joined, s.indices(step, 0, 1))


def test_every_sample_once_per_epoch_then_new_order():
    s = GlobalSampler(num_samples=96, global_batch=12, seed=0)
    epoch0 = np.concatenate([s.indices(k) for k in range(8)])
    epoch1 = np.concatenate([s.indices(k) for k in range(8, 16)])
    assert sorted(epoch0) == list(range(96)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_batches_straddling_an_epoch_boundary():
    s = GlobalSampler(num_samples=10, global_batch=4, seed=1)
    stream = np.concatenate([s.step_rows(k) for k in range(5)])  # 20 positions = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    # A step that straddles the boundary still consumes exactly its own rows.
    assert sorted(s.indices(2)) == sorted(stream[8:12])


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_each_rank_reads_its_own_blocks(dp):
    # Round-robin windows: a step takes an equal share of each block of its window, and a
    # rank's share of the step is a run of whole blocks, so no two ranks need one block.
    s = GlobalSampler(num_samples=64 * 40, global_batch=64, seed=5, block_rows=16, window_blocks=8)
    for step in range(12):
        blocks = [set((s.indices(step, r, dp) // 16).tolist()) for r in range(dp)]
        assert sum(len(b) for b in blocks) == len(set().union(*blocks)) == 8


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_dataset_roundtrip(tmp_path, scheme):
    uri = f"file://{tmp_path}/ds" if scheme == "file" else f"memory://rayflex-test-{tmp_path.name}/ds"
    write_synthetic_dataset(uri, num_samples=50, seq_len=8, vocab_size=16, num_shards=3, seed=2)
    ds = TokenDataset(uri, cache_groups=1)
    assert len(ds) == 50 and ds.row_len == 9
    rows = ds.rows(np.array([0, 49, 17, 33, 0]))
    assert rows.shape == (5, 9) and int(rows.max()) < 16
    assert (rows[0] == rows[4]).all()


def test_synthetic_data_is_learnable():
    """Successors are concentrated: the empirical bigram entropy is far below ln(vocab)."""
    import math

    uri = "memory://rayflex-test-learnable/ds"
    write_synthetic_dataset(uri, num_samples=400, seq_len=32, vocab_size=64, branching=4, seed=0)
    rows = TokenDataset(uri).rows(np.arange(400)).numpy()
    counts = np.zeros((64, 64))
    np.add.at(counts, (rows[:, :-1].ravel(), rows[:, 1:].ravel()), 1)
    p = counts / counts.sum(1, keepdims=True).clip(min=1)
    h = -(counts * np.log(np.where(p > 0, p, 1))).sum() / counts.sum()
    assert h < 0.5 * math.log(64)


def test_check_dataset_refuses_a_global_batch_larger_than_the_dataset(tmp_path):
    from rayflex.config import DataConfig
    from rayflex.data.dataset import check_dataset
    from rayflex.errors import ConfigError

    uri = write_synthetic_dataset(f"file://{tmp_path}/ds", num_samples=10, seq_len=8, vocab_size=16, num_shards=2)
    assert len(check_dataset(DataConfig(uri=uri, seq_len=8, global_batch=10))) == 10
    with pytest.raises(ConfigError, match=r"global_batch=11 is larger than the dataset: .* has 10 rows.*"
                                          r"Fix: lower global_batch to at most 10, or write at least 11 rows"):
        check_dataset(DataConfig(uri=uri, seq_len=8, global_batch=11))
    with pytest.raises(ConfigError, match=r"DataConfig.seq_len: seq_len=9 needs rows of 10 tokens but .* has 9"):
        check_dataset(DataConfig(uri=uri, seq_len=9, global_batch=4))


def test_s3_dataset_missing_bucket_vs_missing_shards(s3_endpoint, s3_bucket):
    from rayflex.errors import ConfigError, StorageError

    with pytest.raises(StorageError) as info:
        TokenDataset("s3://rayflex-no-such-bucket/tokens")
    assert str(info.value).startswith(f"bucket 'rayflex-no-such-bucket' does not exist at {s3_endpoint} "
                                      "(DataConfig.uri s3://rayflex-no-such-bucket/tokens)")
    assert "aws s3 mb s3://rayflex-no-such-bucket" in str(info.value)
    with pytest.raises(ConfigError, match="no Parquet shards"):  # the bucket exists, the data does not
        TokenDataset(f"{s3_bucket}/tokens")
    write_synthetic_dataset(f"{s3_bucket}/tokens", num_samples=12, seq_len=4, vocab_size=8, num_shards=2)
    assert len(TokenDataset(f"{s3_bucket}/tokens")) == 12


def test_reading_rows_imports_neither_pandas_nor_arrow_compute_and_starts_no_arrow_pool(tmp_path):
    # Every worker process reads data at start-up: Arrow's own conversions would import
    # pandas and pyarrow.compute there (~1 CPU-s per process), and a thread of Arrow's
    # pools still up when the process exits can abort it (exit -6, "terminate called
    # without an active exception"), at random, after its work is done.
    import subprocess
    import sys

    uri = write_synthetic_dataset(f"file://{tmp_path}/d", num_samples=48, seq_len=16, vocab_size=64, num_shards=2)
    code = ("import os, sys\nimport pyarrow.parquet\nfrom rayflex.data.dataset import TokenDataset\n"
            "threads = lambda: len(os.listdir('/proc/self/task'))\nbefore = threads()\n"
            f"ds = TokenDataset({uri!r})\nrows = ds.rows(__import__('numpy').arange(len(ds)))\n"
            "print(rows.shape, sorted(m for m in ('pandas', 'pyarrow.compute') if m in sys.modules),"
            " 'new threads:', threads() - before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.strip() == "torch.Size([48, 17]) [] new threads: 0", done.stdout


def test_rows_of_unequal_length_are_refused_with_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    rows = pa.array([[1, 2, 3], [4, 5]], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": rows}), str(tmp_path / "d" / "part-0.parquet"))
    with pytest.raises(ValueError, match=r"rows of unequal length \(2\.\.3 tokens\).*rayflex.data.prepare"):
        TokenDataset(f"file://{tmp_path}/d")


def test_fixed_size_list_rows_read_like_list_rows(tmp_path):
    """``fixed_size_list<int32>``, what numpy-backed writers and HF ``datasets`` store
    fixed-length sequences as, reads the same rows as ``list<int32>``, across row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = np.arange(64 * 17, dtype=np.int32).reshape(64, 17)
    for name, column in (("fixed", pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), 17)),
                         ("list", pa.array(tokens.tolist(), type=pa.list_(pa.int32())))):
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"tokens": column}), str(tmp_path / name / "part-0.parquet"), row_group_size=24)
    fixed, listed = TokenDataset(f"file://{tmp_path}/fixed"), TokenDataset(f"file://{tmp_path}/list")
    assert fixed.row_len == listed.row_len == 17 and len(fixed) == 64
    order = np.random.default_rng(0).permutation(64)
    assert np.array_equal(fixed.rows(order).numpy(), tokens[order])
    assert np.array_equal(listed.rows(order).numpy(), tokens[order])


def test_a_tokens_column_that_is_no_list_of_ids_is_refused_with_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(["a b c", "d e f"])}), str(tmp_path / "d" / "part-0.parquet"))
    with pytest.raises(ValueError, match=r"column 'tokens' is string.*list<int> or fixed_size_list<int>"):
        TokenDataset(f"file://{tmp_path}/d")
