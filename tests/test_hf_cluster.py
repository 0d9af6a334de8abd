"""A Hugging Face model through the whole product on the shared two-node cluster: HF
weights -> a 0-step rayflex run at pp=2 (Ray actors, the step-0 checkpoint) -> ``rayflex
ckpt export`` -> ``from_pretrained`` gives back the original model. (pp=2 x dp=2 round
trips, with training, are in tests/test_hf_export.py on plain processes: each Ray worker
here imports transformers, seconds of this machine's 2 cores.)"""

import json

import pytest
import torch

import rayflex as rf
from rayflex.models import hf_causal_lm
from rayflex.checkpoint import manifest as mf

from hf_helpers import SEQ_LEN, hf_model, tiny_config

pytestmark = pytest.mark.cluster


def test_a_zero_step_run_converts_hf_weights_and_the_export_gives_them_back(two_node_cluster, dataset_uri,
                                                                           tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from rayflex.cli import main

    original = hf_model(tiny_config("llama"))
    original.save_pretrained(tmp_path / "src")
    spec = hf_causal_lm(tmp_path / "src", init_from=tmp_path / "src")
    result = rf.Trainer(model=spec, data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=8),
                        run=rf.RunConfig(name="convert", storage=f"file://{tmp_path}/runs", steps=0),
                        scaling=rf.ScalingConfig(num_workers=2), parallel=rf.ParallelConfig(pp=2)).fit()
    assert result.status == "finished" and result.steps_completed == 0
    run_dir = tmp_path / "runs" / "convert"
    assert mf.list_committed(f"file://{run_dir}/checkpoints") == [0]
    plan = next(e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                if e["kind"] == "plan_chosen")
    assert (plan["pp"], plan["dp"]) == (2, 1)

    assert main(["ckpt", "export", f"file://{run_dir}", "--hf", str(tmp_path / "out")]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    ids = torch.randint(0, original.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, original(ids).logits)  # the same weights, bit for bit
