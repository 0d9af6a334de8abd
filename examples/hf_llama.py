"""Bring your own model: a Hugging Face Llama trained at pp=2 x dp=2 on 4 Ray workers, then
exported back to a directory ``from_pretrained`` loads.

Run it with ``rayflex run examples/hf_llama.py`` (a few dozen steps, a checkpoint every
10). The model is a tiny Llama made here on first use: ``save_pretrained`` writes its
config and HF-initialised weights into ``data/tiny-llama`` (nothing is downloaded;
``HF_HUB_OFFLINE=1`` changes nothing). Point ``RAYFLEX_HF_MODEL_DIR`` at any local Llama,
Qwen2, Qwen3, Mistral or GPT-2 directory instead; the token data below is written for that
model's vocabulary.

Then export the run's newest checkpoint and load it back::

    rayflex ckpt export runs/hf-llama-demo --hf data/tiny-llama-trained
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('data/tiny-llama-trained')"

Its embedding and ``lm_head`` are tied, as in small Llamas: rayflex trains them untied
(``lm_head`` starts as a copy) and the export's config says ``tie_word_embeddings=false``.

Environment knobs (as in gpt_small.py):
  RAYFLEX_DEMO_DATA     where the token dataset lives (written on first use)
  RAYFLEX_DEMO_STORAGE  where run directories go (file://..., s3://bucket/prefix)
  RAYFLEX_HF_MODEL_DIR  the Hugging Face model directory (made on first use if absent)
"""

import os
import sys

from rayflex import (CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, RunConfig,
                     ScalingConfig, Trainer)
from rayflex.data.dataset import TokenDataset, write_synthetic_dataset
from rayflex.models import hf_causal_lm

NAME = "hf-llama-demo"
SEQ_LEN = 64
MODEL_DIR = os.path.abspath(os.environ.get("RAYFLEX_HF_MODEL_DIR", "data/tiny-llama"))
STORAGE = os.environ.get("RAYFLEX_DEMO_STORAGE", "file://" + os.path.abspath("runs"))


def ensure_model(directory: str = MODEL_DIR) -> str:
    """A tiny Llama (HF's own initialisation, seed 0) saved once; reused afterwards."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ_LEN,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    tmp = f"{directory}.tmp-{os.getpid()}"
    LlamaForCausalLM(config).save_pretrained(tmp)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    os.replace(tmp, directory)  # whole or not at all (another first use may race this one)
    return directory


def ensure_dataset(vocab_size: int) -> str:
    """The synthetic Markov-chain tokens, written once per vocabulary size."""
    uri = os.environ.get("RAYFLEX_DEMO_DATA", "file://" + os.path.abspath(f"data/synthetic-v{vocab_size}"))
    try:
        TokenDataset(uri)
    except Exception:  # noqa: BLE001 - missing or empty: (re)write it
        write_synthetic_dataset(uri, num_samples=8192, seq_len=SEQ_LEN, vocab_size=vocab_size, num_shards=8)
    return uri


model = hf_causal_lm(ensure_model(), init_from=MODEL_DIR)

trainer = Trainer(
    model=model,
    data=DataConfig(uri=ensure_dataset(model.metadata["hf"]["size"]["vocab_size"]), seq_len=SEQ_LEN,
                    global_batch=16, seed=0),
    run=RunConfig(name=NAME, storage=STORAGE, steps=40,
                  optimizer=OptimizerConfig(lr=3e-3, warmup_steps=5, grad_clip=1.0)),
    scaling=ScalingConfig(num_workers=4, cpus_per_worker=1),
    parallel=ParallelConfig(pp=2),
    checkpoint=CheckpointConfig(every_steps=10, keep=2),
)

print(f"hf_llama: {model.name} from {MODEL_DIR}; when the run ends, export its newest checkpoint with\n"
      f"  rayflex ckpt export {STORAGE}/{NAME} --hf data/tiny-llama-trained\n"
      "and load it with AutoModelForCausalLM.from_pretrained('data/tiny-llama-trained')", file=sys.stderr)
