"""Hugging Face decoders as rayflex ModelSpecs (rayflex.models.hf): the same function as HF's
model, causal wherever a pipeline cuts, HF's weights in and keys both ways, tied
embeddings trained untied, sizes the planner reads, and pp=2 x dp=2 training that
reproduces HF's own training step for step."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

import rayflex as rf
from rayflex.errors import ConfigError
from rayflex.models.hf import TIE_RULE, causal_lm, from_hf_key, to_hf_key
from rayflex.models.spec import build_stage
from rayflex.testing.processes import ForkedContext

from hf_helpers import SEQ_LEN, VOCAB, hf_model, hf_reference_losses, saved, tiny_config, train_rank, untied_copy

FAMILIES = ["llama", "qwen2", "qwen2-window", "qwen3", "mistral", "gpt2"]


def _ids(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _chained(spec) -> torch.nn.Module:
    return build_stage(spec, list(range(spec.num_blocks)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF model, directory it was saved to)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        model = hf_model(tiny_config(family), seed=i).eval()
        out[family] = model, saved(model, tmp_path_factory.mktemp(family))
    return out


# ------------------------------------------------------------------------------ the function
@pytest.mark.parametrize("family", FAMILIES)
def test_chained_blocks_give_hf_logits(checkpoints, family):
    model, directory = checkpoints[family]
    spec = causal_lm(directory, init_from=directory)
    assert spec.num_blocks == model.config.num_hidden_layers + 2
    with torch.no_grad():
        ours, theirs = _chained(spec)(_ids()), model(_ids()).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2-window", "gpt2"])
def test_a_changed_future_token_never_changes_earlier_logits(family):
    # the user's config asks for eager attention, which without a mask would attend ahead
    spec = causal_lm(tiny_config(family, _attn_implementation="eager"))
    model = _chained(spec).eval()
    ids = _ids(batch=1)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 9, SEQ_LEN - 2):  # the windows are 8: t=9 is past them
            changed = ids.clone()
            changed[0, t + 1] = (changed[0, t + 1] + 1) % VOCAB
            out = model(changed)
            assert torch.equal(out[:, :t + 1], base[:, :t + 1]), (family, t)
            assert not torch.equal(out[:, t + 1], base[:, t + 1])  # the token itself is seen


def test_blocks_pass_the_model_contract_and_gpt2_positions_are_checked():
    from rayflex.models.contract import check_model_contract

    for family in FAMILIES:
        check_model_contract(causal_lm(tiny_config(family)), batch=2, seq_len=SEQ_LEN)
    with pytest.raises(ConfigError, match="64 learned positions"):
        check_model_contract(causal_lm(tiny_config("gpt2")), batch=2, seq_len=80)


# ------------------------------------------------------------------------------ configs
def test_unsupported_model_type_names_it_and_the_supported_ones():
    from transformers import BertConfig

    with pytest.raises(ConfigError) as info:
        causal_lm(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    message = str(info.value)
    assert "'bert'" in message
    assert "gpt2, llama, mistral, qwen2, qwen3" in message


def test_a_directory_is_read_offline_and_a_missing_one_fails_clearly(checkpoints, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, directory = checkpoints["qwen3"]
    spec = causal_lm(directory)  # the config only: weights from scratch
    assert spec.metadata["hf"]["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match="has no config.json"):
        causal_lm(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="not a directory"):
        causal_lm(directory, init_from=tmp_path / "nowhere")


# ------------------------------------------------------------------------------ weights
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_keys_map_to_every_hf_key_and_back(checkpoints, family):
    model, directory = checkpoints[family]
    spec = causal_lm(directory, init_from=directory)
    ours = _chained(spec).state_dict()
    mapped = {to_hf_key(spec, k): v for k, v in ours.items()}
    assert mapped.keys() == model.state_dict().keys()
    assert all(from_hf_key(spec, to_hf_key(spec, k)) == k for k in ours)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in mapped.items())
    assert to_hf_key(spec, "blocks.1.mlp.down_proj.weight" if family == "llama" else "blocks.1.mlp.c_proj.weight") \
        == ("model.layers.0.mlp.down_proj.weight" if family == "llama" else "transformer.h.0.mlp.c_proj.weight")
    with pytest.raises(ConfigError):
        from_hf_key(spec, "model.layers.7.mlp.up_proj.weight")  # a layer the model does not have


def test_sharded_checkpoints_load_block_by_block(checkpoints, tmp_path):
    model, _ = checkpoints["llama"]
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    spec = causal_lm(tmp_path, init_from=tmp_path)
    with torch.no_grad():
        assert (_chained(spec)(_ids()) - model(_ids()).logits).abs().max().item() <= 1e-6


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_named(checkpoints, tmp_path, damage):
    """A shard the index lists but the directory lacks, or one cut short by a copy, used to
    fail with a bare FileNotFoundError / safetensors' "incomplete metadata", naming no file."""
    model, _ = checkpoints["llama"]
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    if damage == "missing":
        shard.unlink()
        expected = rf"{shard} is missing \(model.safetensors.index.json lists it\).*every shard the index lists"
    else:
        shard.write_bytes(shard.read_bytes()[:64])
        expected = rf"{shard} is not a readable safetensors file \(.*\).*may be truncated"
    with pytest.raises(ConfigError, match=expected):
        causal_lm(tmp_path, init_from=tmp_path)


def test_missing_and_unexpected_weights_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = checkpoints["llama"]
    tensors = load_file(f"{directory}/model.safetensors")
    config = tiny_config("llama")

    missing = tmp_path / "missing"
    missing.mkdir()
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(missing / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"lacks tensors the model needs: model\.layers\.1\.mlp\.up_proj\.weight"):
        causal_lm(config, init_from=missing)

    extra = tmp_path / "extra"
    extra.mkdir()
    save_file({**tensors, "model.layers.2.mlp.up_proj.weight": tensors["model.layers.1.mlp.up_proj.weight"].clone()},
              str(extra / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"does not use: model\.layers\.2\.mlp\.up_proj\.weight"):
        causal_lm(config, init_from=extra)

    # weights that change after the spec was made fail where the block is built, by name
    late = tmp_path / "late"
    late.mkdir()
    save_file(tensors, str(late / "model.safetensors"))
    spec = causal_lm(config, init_from=late)
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.norm")}, str(late / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"no tensors for block 3: model\.norm\.weight"):
        spec.block(3)


def test_meta_setup_restores_rotary_buffers_and_loaded_weights(checkpoints):
    """The worker's path: build on meta, ``to_empty``, then fill each block from one full
    build (rayflex.worker.meta_init); inv_freq is a non-persistent buffer."""
    from rayflex.worker.meta_init import materialize_block

    _, directory = checkpoints["qwen3"]
    spec = causal_lm(directory, init_from=directory)
    plain = _chained(spec)
    meta = build_stage(spec, list(range(spec.num_blocks)), "meta")
    meta.to_empty(device="cpu")
    for i in range(spec.num_blocks):
        materialize_block(meta.blocks[str(i)], spec, i, torch.device("cpu"))
    buffers = dict(meta.named_buffers())
    assert "blocks.1.rotary_emb.inv_freq" in buffers
    for name, tensor in [*plain.named_parameters(), *plain.named_buffers()]:
        theirs = buffers.get(name, dict(meta.named_parameters()).get(name))
        assert torch.equal(tensor, theirs), name


# ------------------------------------------------------------------------------ tied embeddings
def test_tied_gpt2_is_trained_untied_from_a_copy_of_its_embedding(tmp_path):
    from transformers import GPT2LMHeadModel

    tied = hf_model(tiny_config("gpt2", tie_word_embeddings=True), seed=5).eval()
    directory = saved(tied, tmp_path)
    spec = causal_lm(directory, init_from=directory)
    hf = spec.metadata["hf"]
    assert hf["config"]["tie_word_embeddings"] is False and hf["source_tied_embeddings"] is True
    assert hf["tie_rule"] == TIE_RULE
    model = _chained(spec)
    head, embedding = model.blocks["3"].lm_head.weight, model.blocks["0"].wte.weight
    assert torch.equal(head, embedding) and head.data_ptr() != embedding.data_ptr()  # a copy
    with torch.no_grad():
        assert (model(_ids()) - tied(_ids()).logits).abs().max().item() <= 1e-6

    # what an exporter writes (the exported config, the mapped keys) is HF's untied model
    exported = GPT2LMHeadModel(type(tied.config).from_dict(hf["config"]))
    exported.load_state_dict({to_hf_key(spec, k): v for k, v in model.state_dict().items()}, strict=True)
    assert exported.lm_head.weight.data_ptr() != exported.transformer.wte.weight.data_ptr()

    # from scratch too, the head starts as a copy of the embedding
    scratch = _chained(causal_lm(tiny_config("llama", tie_word_embeddings=True, pad_token_id=0)))
    assert torch.equal(scratch.blocks["3"].lm_head.weight, scratch.blocks["0"].embed_tokens.weight)
    assert not scratch.blocks["0"].embed_tokens.weight[0].any()  # HF's zeroed padding row


# ------------------------------------------------------------------------------ metadata, planner
def test_metadata_reaches_the_summary_spec_json_and_workers(checkpoints):
    from rayflex.control.controller import _describe_spec
    from rayflex.models.summary import ModelSummary, summarized

    _, directory = checkpoints["qwen2"]
    spec = causal_lm(directory, init_from=directory)
    summary = ModelSummary.of(spec)
    assert summary.metadata == spec.metadata
    assert summary.metadata["hf"]["architectures"] == ["Qwen2ForCausalLM"]
    train = summarized(rf.TrainSpec(model=spec, data=rf.DataConfig(uri="file:///unused", seq_len=SEQ_LEN),
                                    run=rf.RunConfig(name="hf")))
    described = json.loads(json.dumps(_describe_spec(train)))
    assert described["model"]["metadata"] == spec.metadata
    loaded = pickle.loads(pickle.dumps(summary)).load()
    assert torch.equal(loaded.block(1).self_attn.q_proj.weight, spec.block(1).self_attn.q_proj.weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_counts_the_real_parameters(family):
    from rayflex.models.summary import ModelSummary
    from rayflex.planning.capacity.memory import describe_model

    spec = causal_lm(tiny_config(family, tie_word_embeddings=family == "gpt2"))
    real = sum(p.numel() for p in _chained(spec).parameters())
    described = describe_model(ModelSummary.of(spec), SEQ_LEN)  # from the metadata: nothing runs
    assert described.total_params == real
    assert list(described.block_params) == spec.param_counts()
    assert [b.kind for b in described.blocks] == ["embedding", "transformer", "transformer", "head"]


def test_planner_activation_formula_matches_a_measurement():
    from rayflex.planning.capacity.memory import block_activation_bytes, describe_model, measure_activation_bytes

    for family in ("llama", "qwen3", "gpt2"):
        spec = causal_lm(tiny_config(family))
        model = describe_model(spec, SEQ_LEN)
        measured = measure_activation_bytes(spec, SEQ_LEN, micro_batch=2, vocab_size=VOCAB)
        modeled = [block_activation_bytes(model, b, 2 * SEQ_LEN, 2) / (2 * SEQ_LEN) for b in model.blocks]
        assert modeled == pytest.approx(measured, rel=0.01), family


def test_import_rayflex_does_not_import_transformers():
    import subprocess
    import sys

    import rayflex.models

    code = ("import sys, rayflex, rayflex.models; from rayflex.planning.capacity import memory; "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert rayflex.models.hf_causal_lm is causal_lm  # the lazy table's name


# ------------------------------------------------------------------------------ training
TRAINED = ["llama", "qwen2", "gpt2"]
STEPS = 3


@pytest.fixture(scope="module")
def trained(checkpoints, dataset_uri, tmp_path_factory):
    """Each of TRAINED at pp=2 x dp=2 (4 gloo processes, one session), and the same HF
    model trained in this process; GPT-2 from a tied checkpoint."""
    from rayflex.local_ray import free_ports

    jobs, references = [], {}
    for family in TRAINED:
        model = checkpoints[family][0] if family != "gpt2" else hf_model(tiny_config("gpt2", tie_word_embeddings=True),
                                                                        seed=9)
        directory = saved(model, tmp_path_factory.mktemp(f"train-{family}"))
        spec = rf.TrainSpec(model=causal_lm(directory, init_from=directory),
                            data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=8),
                            run=rf.RunConfig(name=f"hf-{family}", storage=f"file://{directory}/run", steps=STEPS,
                                             optimizer=rf.OptimizerConfig(lr=3e-3, warmup_steps=1)),
                            scaling=rf.ScalingConfig(num_workers=4, torch_threads=1),
                            parallel=rf.ParallelConfig(pp=2), checkpoint=rf.CheckpointConfig(resume=False))
        jobs.append((family, spec))
        references[family] = (untied_copy(model), spec)
    ctx = ForkedContext()
    results, ports = ctx.Queue(), [ctx.Queue() for _ in range(4)]
    procs = [ctx.Process(target=train_rank, args=(r, jobs, ports[r], results), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    threads = torch.get_num_threads()
    got: dict = {}

    def start_job() -> None:
        port = free_ports(1)[0]  # chosen when the job starts, as LocalWorkerPool does
        for q in ports:
            q.put(port)

    def collect_job() -> None:
        for _ in range(4):
            key, rank, losses = results.get(timeout=240)
            assert not isinstance(losses, dict), losses["exception"]
            got.setdefault(key, {})[rank] = losses

    try:
        start_job()  # the workers start (imports, first job) while the HF side trains here
        torch.set_num_threads(1)
        expected = {f: hf_reference_losses(m, spec, STEPS) for f, (m, spec) in references.items()}
        torch.set_num_threads(threads)
        collect_job()
        for _ in TRAINED[1:]:
            start_job()
            collect_job()
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got, expected


@pytest.mark.multiproc
@pytest.mark.parametrize("family", TRAINED)
def test_pp2_dp2_training_reproduces_hf_training(trained, family):
    got, expected = trained
    assert len(got[family]) == 4
    for rank, losses in got[family].items():  # every rank agrees on the step's loss
        assert losses == pytest.approx(expected[family], abs=1e-5, rel=0), (family, rank, losses, expected[family])
    assert expected[family][-1] < expected[family][0]  # it trains, so "equal" means something
