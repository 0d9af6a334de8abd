"""Weighted mixtures: exact shares every period, each source's own stream consumed once,
the same order at any dp (the run on a cluster: test_data_mixture_cluster.py)."""

import numpy as np
import pytest

import rayflex as rf
from rayflex.data.dataset import open_dataset, write_synthetic_dataset
from rayflex.data.mixture import MIXTURE_PERIOD, integer_shares, source_counts
from rayflex.errors import ConfigError


def _mixture(tmp_path, weights=(0.7, 0.2, 0.1), global_batch=20):
    uris = [write_synthetic_dataset(f"file://{tmp_path}/src{i}", num_samples=n, seq_len=8, vocab_size=16,
                                    num_shards=2, row_group_rows=25, seed=i)
            for i, n in enumerate((300, 120, 50))]
    data = rf.DataConfig(sources=list(zip(uris, weights)), seq_len=8, global_batch=global_batch, seed=4)
    ds = open_dataset(data)
    return data, ds, ds.sampler(data)


def test_shares_are_exact_every_period(tmp_path):
    assert integer_shares([0.7, 0.2, 0.1]) == [700, 200, 100]
    assert sum(integer_shares([1, 1, 1])) == MIXTURE_PERIOD
    data, ds, s = _mixture(tmp_path)
    assert source_counts(s, MIXTURE_PERIOD // 20) == [700, 200, 100]  # one period = 50 steps of 20
    assert source_counts(s, 3 * MIXTURE_PERIOD // 20) == [2100, 600, 300]


def test_each_source_is_its_own_exact_stream(tmp_path):
    data, ds, s = _mixture(tmp_path)
    positions = np.arange(2 * MIXTURE_PERIOD)
    source, local = s.source_positions(positions)
    for k, share in enumerate(s.shares):
        mine = np.sort(local[source == k])
        np.testing.assert_array_equal(mine, np.arange(2 * share)), "no position skipped or repeated"
    rows = s.rows_at(positions)
    for k, off in enumerate(ds.offsets):
        n = len(ds.datasets[k])
        own = rows[source == k] - off
        assert own.min() >= 0 and own.max() < n
        # Source 2 (50 rows, 200 samples in two periods) went through exactly 4 epochs.
        if k == 2:
            assert np.bincount(own, minlength=n).tolist() == [4] * n


@pytest.mark.parametrize("dp", [1, 2, 4, 5])
def test_the_mixture_order_does_not_depend_on_dp(tmp_path, dp):
    data, ds, s = _mixture(tmp_path)
    for step in (0, 49, 50, 123):
        joined = np.concatenate([s.indices(step, r, dp) for r in range(dp)])
        np.testing.assert_array_equal(joined, s.indices(step))


def test_mixture_rows_come_from_their_source(tmp_path):
    data, ds, s = _mixture(tmp_path)
    idx = s.indices(7)
    rows = ds.rows(idx).numpy()
    for i, row in zip(idx, rows):
        k = int(np.searchsorted(ds.offsets, i, side="right") - 1)
        np.testing.assert_array_equal(row, ds.datasets[k].rows(np.array([i - ds.offsets[k]])).numpy()[0])


def test_bad_mixtures_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="DataConfig.sources: a mixture needs at least two sources"):
        rf.DataConfig(sources=[(f"file://{tmp_path}/a", 1.0)])
    with pytest.raises(ConfigError, match=r"DataConfig.sources\[1\]: weight must be a positive number"):
        rf.DataConfig(sources=[(f"file://{tmp_path}/a", 1.0), (f"file://{tmp_path}/b", -2)])
    with pytest.raises(ConfigError, match="DataConfig.sources: both uri="):
        rf.DataConfig(uri=f"file://{tmp_path}/a", sources=[(f"file://{tmp_path}/a", 1), (f"file://{tmp_path}/b", 1)])
    with pytest.raises(ConfigError, match="gets no samples"):
        integer_shares([1.0, 1e-6])
    a = write_synthetic_dataset(f"file://{tmp_path}/a8", num_samples=20, seq_len=8, vocab_size=16, num_shards=1)
    b = write_synthetic_dataset(f"file://{tmp_path}/b4", num_samples=20, seq_len=4, vocab_size=16, num_shards=1)
    with pytest.raises(ConfigError, match="the sources' rows differ in length"):
        open_dataset(rf.DataConfig(sources=[(a, 1), (b, 1)], seq_len=4))


def test_a_source_too_small_for_its_share_of_a_step_is_refused(tmp_path):
    from rayflex.data.dataset import check_dataset

    big = write_synthetic_dataset(f"file://{tmp_path}/big", num_samples=400, seq_len=8, vocab_size=16, num_shards=1)
    small = write_synthetic_dataset(f"file://{tmp_path}/small", num_samples=10, seq_len=8, vocab_size=16,
                                    num_shards=1)
    with pytest.raises(ConfigError, match=r"DataConfig.sources: .*small has 10 rows but its weight gives it up to "
                                          r"33 samples of a step \(global_batch=64\)"):
        check_dataset(rf.DataConfig(sources=[(big, 1), (small, 1)], seq_len=8, global_batch=64))
    assert len(check_dataset(rf.DataConfig(sources=[(big, 1), (small, 1)], seq_len=8, global_batch=16))) == 410
    with pytest.raises(ConfigError, match=r"DataConfig.sources\[1\]: weight must be a positive number, got inf"):
        rf.DataConfig(sources=[(big, 1), (small, float("inf"))])


def test_two_sources_of_one_size_get_different_orders(tmp_path):
    uris = [write_synthetic_dataset(f"file://{tmp_path}/same{i}", num_samples=100, seq_len=8, vocab_size=16,
                                    num_shards=1, seed=i) for i in range(2)]
    data = rf.DataConfig(sources=[(uris[0], 1), (uris[1], 1)], seq_len=8, global_batch=10)
    s = open_dataset(data).sampler(data)
    a, b = (s.sources[k].rows_at(np.arange(100)) for k in (0, 1))
    assert sorted(a) == sorted(b) == list(range(100)) and not np.array_equal(a, b)
