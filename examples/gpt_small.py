"""The example job: a small GPT trained with FSDP2 over 4 Ray workers.

Run it with ``rayflex run examples/gpt_small.py`` (or ``make demo``). Everything here is
ordinary config; override any field from the command line, e.g.
``--set parallel.pp=2 --set run.steps=50``.

Environment knobs (so the same file works locally, under ``ray job submit`` and in tests):
  RAYFLEX_DEMO_DATA     where the token dataset lives (written on first use)
  RAYFLEX_DEMO_STORAGE  where run directories go (file://..., s3://bucket/prefix)
"""

import os

from rayflex import (CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, RunConfig,
                     ScalingConfig, Trainer)
from rayflex.data.dataset import TokenDataset, write_synthetic_dataset
from rayflex.models import GPTConfig, gpt

SEQ_LEN = 64
DATA = os.environ.get("RAYFLEX_DEMO_DATA", "file://" + os.path.abspath("data/synthetic-gpt"))
STORAGE = os.environ.get("RAYFLEX_DEMO_STORAGE", "file://" + os.path.abspath("runs"))


def ensure_dataset(uri: str = DATA) -> str:
    """Write the synthetic Markov-chain token dataset once; reuse it afterwards."""
    try:
        TokenDataset(uri)
    except Exception:  # noqa: BLE001 - missing or empty: (re)write it
        write_synthetic_dataset(uri, num_samples=8192, seq_len=SEQ_LEN, vocab_size=256, num_shards=8)
    return uri


trainer = Trainer(
    model=gpt(GPTConfig(vocab_size=256, seq_len=SEQ_LEN, d_model=128, n_layers=4, n_heads=4)),
    data=DataConfig(uri=ensure_dataset(), seq_len=SEQ_LEN, global_batch=32, seed=0),
    run=RunConfig(name="gpt-demo", storage=STORAGE, steps=200,
                  optimizer=OptimizerConfig(lr=3e-3, warmup_steps=10, grad_clip=1.0)),
    scaling=ScalingConfig(num_workers=4, cpus_per_worker=1),
    parallel=ParallelConfig(pp=1),
    checkpoint=CheckpointConfig(every_steps=50, keep=2),
)
