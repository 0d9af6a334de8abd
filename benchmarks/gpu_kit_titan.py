"""The GPU kit's peer: one torchtitan run of the kit's workload; prints one JSON object.

    python benchmarks/gpu_kit_titan.py [--seq-len 2048] [--global-batch 4] [--steps 12]
                                       [--no-cuda-graphs] [--out F]

torchtitan's own trainer (``torchtitan.trainer.Trainer``, built from a ``Trainer.Config``
as its ``train.py`` does) on its ``llama3`` "1B" flavour with its own attention (FlexAttention: 0.3 dropped SDPA), changed only
where the kit's workload (``gpu_kit_workload.titan_settings``) says: weight tying off (the
embedding then gets torchtitan's own embedding init), no activation checkpointing,
compile of model and loss, the kit's batch, sequence length and AdamW. Its defaults stay
(the chunked loss, CUDA graphs of forward/backward unless ``--no-cuda-graphs``).

Two things are the kit's, because the GPU machine has no network: a tokenizer that only
knows its vocabulary size, and a dataloader of seeded random tokens (rayflex's side reads
synthetic tokens too). Step times are the wall-clock gaps between finished steps (each
step ends with ``torch.cuda.synchronize``), the method rayflex is measured by.

torchtitan needs CUDA: it imports triton unconditionally and falls back to "cuda" as its
device type, so it cannot run on a CPU-only host (the kit's CPU mode checks this run's
settings against rayflex's instead).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial

sys.path.insert(0, os.path.dirname(__file__))
import gpu_kit_workload as wl  # noqa: E402
from common import emit, setup_logging  # noqa: E402
from rounds import step_figures  # noqa: E402


def _components():
    """The kit's tokenizer and synthetic dataloader as torchtitan components (defined on
    first use: torchtitan is imported only where it runs)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class VocabOnlyTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, **_):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("the kit trains on synthetic token ids")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("the kit trains on synthetic token ids")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0
            seed: int = 0

        def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **_):
            self.config, self.seq_len, self.batch = config, seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(config.seed)

        def __iter__(self):
            while True:
                rows = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1),
                                     generator=self.generator)
                yield {"input": rows[:, :-1]}, rows[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict) -> None:
            pass

    return VocabOnlyTokenizer, SyntheticTokens


def build_config(w: wl.Workload, *, dump_folder: str, cuda_graphs: bool = True):
    """torchtitan's ``Trainer.Config`` for ``w`` (see the module's docstring)."""
    from torch import nn
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    s = wl.titan_settings(w)
    if s["model"]["flavor"] != "1B":
        raise ValueError(f"the kit runs torchtitan's llama3 1B flavour only; got the shape of {w.name}")
    spec = model_registry("1B", attn_backend=s["model"]["attn_backend"])
    model = spec.model
    model.enable_weight_tying = s["model"]["enable_weight_tying"]
    if not model.enable_weight_tying:  # untied, the embedding needs an init of its own (tied, it has none)
        model.tok_embeddings.param_init = {"weight": partial(nn.init.normal_, std=1.0)}
    tokenizer, data = _components()
    t, o = s["training"], s["optimizer"]
    return Trainer.Config(
        model_spec=spec,
        dump_folder=dump_folder,
        hf_assets_path=dump_folder,
        tokenizer=tokenizer.Config(vocab_size=w.vocab_size),
        dataloader=data.Config(vocab_size=w.vocab_size, seed=w.seed),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=s["lr_scheduler"]["warmup_steps"]),
        training=TrainingConfig(**t, disable_cuda_graphs=not cuda_graphs),
        metrics=MetricsProcessor.Config(log_freq=s["metrics"]["log_freq"]),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=s["compile"]["enable"], components=s["compile"]["components"]),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(w: wl.Workload, *, cuda_graphs: bool = True) -> dict:
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    t_launch = time.time()
    config = build_config(w, dump_folder=tempfile.mkdtemp(prefix="rayflex-gpu-kit-titan-"), cuda_graphs=cuda_graphs)
    trainer = config.build()
    finished: dict[int, float] = {}
    train_step = trainer.train_step

    def timed_step(data_iterator):
        train_step(data_iterator)
        torch.cuda.synchronize()
        finished[trainer.step] = time.time()

    trainer.train_step = timed_step
    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    status = "finished"
    try:
        trainer.train()
    except Exception as e:  # reported in the JSON: the kit goes on with the other systems
        status = f"failed: {type(e).__name__}: {e}"
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {"system": "torchtitan", "float8": False, "status": status, "params": params,
            **step_figures(finished, set(), t_launch, w.tokens_per_step), "setup_s": None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(), "cuda_graphs": cuda_graphs,
            "settings": wl.titan_settings(w)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="torchtitan's training.disable_cuda_graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    setup_logging()
    import torch

    if not torch.cuda.is_available():
        print("torchtitan needs CUDA (it imports triton and picks cuda as its device type)", file=sys.stderr)
        return 2
    out = run(wl.llama3_1b(seq_len=args.seq_len, global_batch=args.global_batch, steps=args.steps),
              cuda_graphs=not args.no_cuda_graphs)
    emit(out, args.out)
    return 0 if out["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
