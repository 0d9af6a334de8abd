"""Tiny Hugging Face models for tests/test_hf_models.py, and one rank of its pp x dp runs
(in a spawned process: importable by the child)."""

from __future__ import annotations

import torch

VOCAB, SEQ_LEN = 128, 32


def tiny_config(family: str, **overrides):
    """A 2-layer, 32-wide model of ``family`` (no dropout: rayflex runs without it);
    ``overrides`` are set on the config after it is made."""
    import transformers as tf

    rope = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    make = {
        "llama": lambda: tf.LlamaConfig(**rope),
        "qwen2": lambda: tf.Qwen2Config(**rope),
        "qwen3": lambda: tf.Qwen3Config(**rope, head_dim=16),
        "mistral": lambda: tf.MistralConfig(**rope, sliding_window=8),  # shorter than SEQ_LEN: masked
        # layer 0 attends to everything before it, layer 1 within a window of 8
        "qwen2-window": lambda: tf.Qwen2Config(**rope, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False),
    }[family]
    cfg = make()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def hf_model(config, seed: int = 0):
    """HF's own ForCausalLM of ``config`` with HF's own seeded initialisation."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def saved(model, directory) -> str:
    """``model.save_pretrained(directory)`` (safetensors); returns the directory."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.save_pretrained(str(directory))
    return str(directory)


def untied_copy(model):
    """``model`` (tied or not) as an untied HF model whose lm_head is a copy of its
    embedding when it was tied: what rayflex trains (rayflex.models.hf.TIE_RULE)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    untied = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    untied.load_state_dict(state, strict=True)
    return untied


def hf_reference_losses(model, spec, steps: int) -> list[float]:
    """``model`` trained in this process with HF's forward and loss, on the batches a rayflex
    run of ``spec`` (a TrainSpec) sees, with its optimizer: AdamW, the same clipping and
    learning-rate schedule (rayflex.testing.reference, with HF in place of the blocks)."""
    from rayflex.data.dataset import TokenDataset

    opt_cfg = spec.run.optimizer
    opt = opt_cfg.build(model.parameters())
    ds = TokenDataset(spec.data.uri)
    sampler = ds.sampler(spec.data)
    seq = spec.data.seq_len
    model.train()
    losses = []
    for step in range(1, steps + 1):
        rows = ds.rows(sampler.indices(step - 1, 0, 1))
        x, y = rows[:, :seq], rows[:, 1:seq + 1]
        opt.zero_grad(set_to_none=True)
        # HF's causal-LM loss; shift_labels: the targets are already shifted (the row's next tokens)
        loss = model(input_ids=x, labels=x, shift_labels=y.contiguous(), use_cache=False).loss
        loss.backward()
        if opt_cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr_of_step(step, spec.run.steps)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_rank(rank: int, jobs: list, ports, results) -> None:
    """Rank ``rank`` of each job ``(key, TrainSpec)`` in turn: a real TrainWorker
    (meta-device build, FSDP2, pipeline) on gloo, rendezvous on the port ``ports`` (this
    rank's queue) hands it when the job starts (a port chosen earlier may have gone to a
    connection of the job before); answers ``(key, rank, losses)`` once the rank has left
    the job's process group, and exits when the last is sent."""
    import os
    import traceback

    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    for key, spec in jobs:
        worker, answer = None, None
        try:
            port = ports.get(timeout=240)
            plan = plan_mesh(spec.model, spec.parallel, spec.data, spec.scaling.num_workers)
            worker = TrainWorker(rank, spec, plan)
            worker.setup("127.0.0.1", port, restore=False)
            worker.start(spec.run.steps)
            if not worker.join(120):
                raise TimeoutError(f"rank {rank} of {key}: training did not finish in 120 s")
            status = worker.poll()
            if status.error:
                raise RuntimeError(status.error)
            answer = [r.loss for r in status.records]
        except BaseException:  # noqa: BLE001 - the test raises it with the traceback
            answer = {"exception": traceback.format_exc()}
        finally:
            if worker is not None:
                worker.release(timeout_s=10, checkpoint_grace_s=0)
            results.put((key, rank, answer))
    # Nothing is left to free: skip the interpreter's teardown (seconds of a 2-core budget)
    # once the answers are flushed.
    results.close()
    results.join_thread()
    os._exit(0)
