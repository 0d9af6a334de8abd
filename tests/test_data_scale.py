"""The data path at scale: an O(1)-memory sample order with row-group locality, a reader
that loads row groups (not shards), and a prefetcher that has the next steps' rows ready."""

import threading
import time

import numpy as np
import pytest

from rayflex.config import DataConfig
from rayflex.data.dataset import Prefetcher, TokenDataset, write_synthetic_dataset
from rayflex.data.sampler import Bijection, GlobalSampler
from rayflex.errors import ConfigError


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 1025, 4096])
def test_a_bijection_is_a_permutation(n):
    images = Bijection(n, key=7)(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))
    if n > 16:
        assert not np.array_equal(images, np.arange(n)), "a shuffle, not the identity"
        assert not np.array_equal(images, Bijection(n, key=8)(np.arange(n))), "the key changes the order"


@pytest.mark.parametrize("n,block,window", [(1024, 341, 16), (1000, 7, 3), (10007, 100, 4), (64, 8, 1), (50, 0, 16)])
def test_every_row_once_per_epoch_in_a_new_order_each_epoch(n, block, window):
    s = GlobalSampler(n, global_batch=10, seed=3, block_rows=block, window_blocks=window)
    epochs = [s.rows_at(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(n))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6])
def test_the_order_does_not_depend_on_dp(dp):
    s = GlobalSampler(10_000, global_batch=12, seed=1, block_rows=64, window_blocks=4)
    for step in (0, 1, 833, 834, 5000):  # 834 straddles the first epoch's end
        joined = np.concatenate([s.indices(step, r, dp) for r in range(dp)])
        np.testing.assert_array_equal(joined, s.indices(step, 0, 1))


def test_a_step_touches_a_window_of_blocks_not_the_whole_dataset():
    block, window = 100, 4
    s = GlobalSampler(1_000_000, global_batch=256, seed=0, block_rows=block, window_blocks=window)
    for step in range(0, 200, 7):
        blocks = np.unique(s.indices(step) // block)
        assert len(blocks) <= 2 * window, (step, len(blocks))  # one window, or the seam of two
    # The uniform sampler (one window) spreads a step over ~all of 10,000 blocks instead.
    uniform = GlobalSampler(1_000_000, global_batch=256, seed=0)
    assert len(np.unique(uniform.indices(3) // block)) > 200


def test_a_billion_samples_need_no_permutation_array():
    import tracemalloc

    s = GlobalSampler(10**9, global_batch=1024, seed=0, block_rows=4096, window_blocks=16)
    s.indices(10**6, 3, 8)  # first call builds the cached bijections
    tracemalloc.start()
    rows = s.indices(10**6 + 1, 3, 8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak  # < 1 MB (a permutation of 10^9 would be 8 GB)
    assert rows.min() >= 0 and rows.max() < 10**9 and len(set(rows.tolist())) == 128


def _dataset(tmp_path, **kw):
    uri = write_synthetic_dataset(f"file://{tmp_path}/ds", num_samples=400, seq_len=8, vocab_size=16,
                                  num_shards=2, row_group_rows=50, seed=4)
    return TokenDataset(uri, **kw)


def test_the_reader_loads_row_groups_not_shards(tmp_path):
    ds = _dataset(tmp_path)
    assert len(ds) == 400 and ds.num_row_groups == 8 and ds.block_rows == 50
    whole = ds.rows(np.arange(400)).numpy()  # the reference: every group read
    fresh = _dataset(tmp_path)
    np.testing.assert_array_equal(fresh.rows(np.array([260, 255, 299])).numpy(), whole[[260, 255, 299]])
    assert fresh.stats.groups_loaded == 2, "row 0's group (opening) and rows 250-299's group"
    assert fresh.stats.rows_loaded == 100 and fresh.stats.bytes_loaded > 0


def test_the_dataset_sampler_follows_the_row_groups_and_the_config(tmp_path):
    ds = _dataset(tmp_path)
    s = ds.sampler(DataConfig(uri=ds.uri, seq_len=8, global_batch=20, seed=5, shuffle_window=2))
    assert (s.num_samples, s.global_batch, s.seed, s.block_rows, s.window_blocks) == (400, 20, 5, 50, 2)
    for step in range(0, 20):
        assert len(ds.groups_of(s.indices(step))) <= 4


def test_the_prefetcher_has_the_next_steps_rows_cached(tmp_path):
    ds = _dataset(tmp_path, cache_groups=8)
    s = GlobalSampler(len(ds), global_batch=20, seed=2, block_rows=ds.block_rows, window_blocks=2)
    ds.rows(s.indices(0, 1, 2))
    loaded = ds.stats.groups_loaded
    needed = set(ds.groups_of(np.concatenate([s.indices(k, 1, 2) for k in (1, 2)])).tolist())
    expected = loaded + len(needed - set(ds.groups_of(s.indices(0, 1, 2)).tolist()))
    prefetch = Prefetcher(ds, s, dp_rank=1, dp=2, depth=2)
    prefetch.ahead_of(0)
    deadline = time.monotonic() + 30  # the thread's pace is the machine's: wait for the loads, not a time
    while ds.stats.groups_loaded < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    prefetch.close()
    assert ds.stats.groups_loaded == expected, "steps 1 and 2's row groups, each once"
    before = ds.stats.groups_loaded
    ds.rows(s.indices(1, 1, 2))
    ds.rows(s.indices(2, 1, 2))
    assert ds.stats.groups_loaded == before, "steps 1 and 2 found their row groups cached"


def test_two_threads_wanting_one_row_group_read_it_once(tmp_path):
    ds = _dataset(tmp_path)
    start = threading.Barrier(4)

    def read():
        start.wait()
        ds.rows(np.arange(300, 350))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ds.stats.groups_loaded == 2  # row 0's group at open, then 300-349's once


def test_a_read_stuck_in_another_thread_does_not_hold_the_step(tmp_path, monkeypatch):
    # A prefetch read that never returns (a dead endpoint, an earlier attempt's thread in a
    # reused process): the step waits DATA_PENDING_READ_WAIT_S, then reads the group itself.
    monkeypatch.setenv("RAYFLEX_DATA_PENDING_READ_WAIT_S", "0.2")
    ds = _dataset(tmp_path)
    expected = TokenDataset(ds.uri).rows(np.arange(300, 350))
    entered, release = threading.Event(), threading.Event()
    real_read = ds._read_group

    def first_read_hangs(g):
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return real_read(g)

    monkeypatch.setattr(ds, "_read_group", first_read_hangs)
    stuck = threading.Thread(target=ds.warm, args=(np.arange(300, 350),), daemon=True)
    stuck.start()
    assert entered.wait(10)
    got = ds.rows(np.arange(300, 350))  # returns while the other read is still stuck
    assert stuck.is_alive() and (got == expected).all()
    release.set()
    stuck.join(10)
    assert not stuck.is_alive() and (ds.rows(np.arange(300, 350)) == expected).all()


def test_blocks_that_straddle_row_groups_get_a_cache_that_holds_them(tmp_path):
    from rayflex.data.dataset import open_dataset

    # 225 rows per shard in groups of 50: each shard ends in a 25-row group (as Ray Data
    # writes them), so from the first shard's end on a 50-row block spans two groups.
    uri = write_synthetic_dataset(f"file://{tmp_path}/straddle", num_samples=450, seq_len=8, vocab_size=16,
                                  num_shards=2, row_group_rows=50, seed=4)
    data = DataConfig(uri=uri, seq_len=8, global_batch=30, seed=1, shuffle_window=2)
    ds = open_dataset(data)
    assert ds.block_rows == 50 and not ds.blocks_aligned and ds.cache_groups == 2 * 2 * 2 + 4
    assert _dataset(tmp_path).blocks_aligned and open_dataset(
        DataConfig(uri=_dataset(tmp_path).uri, seq_len=8, global_batch=20, shuffle_window=2)).cache_groups == 2 * 2 + 4
    s = ds.sampler(data)
    touched: set = set()
    for step in range(len(ds) // 30):  # one epoch: every group needed is read once, never again
        idx = s.indices(step)
        touched |= set(ds.groups_of(idx).tolist())
        ds.rows(idx)
    assert ds.stats.groups_loaded == len(touched | {0})


def test_bad_data_knobs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="DataConfig.shuffle_window"):
        DataConfig(uri=f"file://{tmp_path}/d", shuffle_window=0)
    with pytest.raises(ConfigError, match="DataConfig.prefetch_steps"):
        DataConfig(uri=f"file://{tmp_path}/d", prefetch_steps=-1)


def test_read_bytes_are_the_tokens_column_and_an_empty_dataset_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "two").mkdir()
    tokens = pa.array([list(range(9))] * 20, type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"doc_id": pa.array(range(20)), "tokens": tokens}), tmp_path / "two" / "a.parquet",
                   row_group_size=10)
    ds = TokenDataset(f"file://{tmp_path}/two")
    md = pq.ParquetFile(tmp_path / "two" / "a.parquet").metadata
    assert ds.stats.bytes_loaded == md.row_group(0).column(1).total_compressed_size  # tokens, not doc_id
    assert ds.rows(np.array([19])).tolist() == [list(range(9))]
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"tokens": pa.array([], type=pa.list_(pa.int32()))}), tmp_path / "empty" / "a.parquet")
    with pytest.raises(ConfigError, match=r"DataConfig.uri: the Parquet shards under .* hold no rows"):
        TokenDataset(f"file://{tmp_path}/empty")


def test_a_hub_name_with_a_slash_is_not_taken_for_a_path(monkeypatch):
    from rayflex.data.prepare import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"--tokenizer: cannot load tokenizer 'no-such-org/no-such-model'"):
        load_tokenizer("no-such-org/no-such-model")
    with pytest.raises(ConfigError, match=r"--tokenizer: no tokenizer.json at './missing'"):
        load_tokenizer("./missing")
