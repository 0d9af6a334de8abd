"""A weighted mixture trained on the shared loopback cluster equals one process, and each
step consumed the mixture order's rows. (Its own module: a module's tests run on one
xdist worker together, and the unit tests' module must not start Ray.)"""

import json

import pytest

import rayflex as rf
from rayflex.data.dataset import open_dataset, write_synthetic_dataset

pytestmark = pytest.mark.cluster


def test_a_mixture_run_trains_what_one_process_trains(two_node_cluster, tmp_path):
    from rayflex.testing.reference import single_process_losses

    from conftest import small_gpt

    uris = [write_synthetic_dataset(f"file://{tmp_path}/m{i}", num_samples=200, seq_len=32, vocab_size=128,
                                    num_shards=2, row_group_rows=50, seed=i) for i in range(2)]
    trainer = rf.Trainer(model=small_gpt(n_layers=1),
                         data=rf.DataConfig(sources=[(uris[0], 3.0), (uris[1], 1.0)], seq_len=32, global_batch=8,
                                            log_samples=True),
                         run=rf.RunConfig(name="mix", storage=f"file://{tmp_path}/runs", steps=4),
                         scaling=rf.ScalingConfig(num_workers=2))
    result = trainer.fit(progress=False)
    assert result.status == "finished"
    reference = single_process_losses(trainer.spec, 4)
    assert [m["loss"] for m in result.metrics] == pytest.approx(reference, rel=1e-5)
    data = trainer.spec.data
    sampler = open_dataset(data).sampler(data)
    lines = [json.loads(x) for x in (tmp_path / "runs" / "mix" / "samples.jsonl").read_text().splitlines()]
    assert [line["indices"] for line in lines] == [sampler.indices(s).tolist() for s in range(4)]
