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
    seen = np.concatenate([s.indices(k) for k in range(5)])  # 20 positions = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_dataset_roundtrip(tmp_path, scheme):
    uri = f"file://{tmp_path}/ds" if scheme == "file" else f"memory://rayflex-test-{tmp_path.name}/ds"
    write_synthetic_dataset(uri, num_samples=50, seq_len=8, vocab_size=16, num_shards=3, seed=2)
    ds = TokenDataset(uri, cache_shards=1)
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
