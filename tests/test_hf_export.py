"""Weights out (rayflex.models.hf_export, ``rayflex ckpt export``): Hugging Face weights ->
a rayflex run at pp=2 x dp=2 -> committed checkpoint -> HF directory -> from_pretrained
gives the original model's logits (a step-0 checkpoint) and rayflex's own logits of the
trained weights (after training), sharded or not, from any storage, with clear errors.

Every multi-process test reads the checkpoints of ONE 4-process session (``runs``). Its
step-0 checkpoints are written by real TrainWorkers asked to train to step 0: the worker's
final save then holds the weights it built from ``init_from``, no optimizer step taken
(``RunConfig(steps=0)`` itself is refused by the config today).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import rayflex as rf
from rayflex import export_hf
from rayflex.checkpoint.reader import CheckpointWeights
from rayflex.cli.main import main as rayflex_main
from rayflex.errors import CheckpointError, ConfigError
from rayflex.models.hf import causal_lm
from rayflex.models.hf_export import StateDictWeights, write_hf
from rayflex.models.spec import build_stage
from rayflex.testing.processes import ForkedContext

from hf_helpers import SEQ_LEN, VOCAB, hf_model, saved, tiny_config

STEPS = 2


def _ids(batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _loaded(directory):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                attn_implementation="sdpa").eval()


def _logits(model) -> torch.Tensor:
    """An HF model's logits, or a rayflex stage's (its output is the logits)."""
    with torch.no_grad():
        out = model(_ids())
    return getattr(out, "logits", out)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def _train_spec(directory, name: str, storage: str, dataset_uri: str) -> rf.TrainSpec:
    return rf.TrainSpec(model=causal_lm(directory, init_from=directory),
                        data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=8),
                        run=rf.RunConfig(name=name, storage=storage, steps=STEPS,
                                         optimizer=rf.OptimizerConfig(lr=3e-3, warmup_steps=1)),
                        scaling=rf.ScalingConfig(num_workers=4, torch_threads=1), parallel=rf.ParallelConfig(pp=2),
                        checkpoint=rf.CheckpointConfig(every_steps=STEPS, keep=3))


def _write_spec_json(spec: rf.TrainSpec) -> None:
    """What the controller writes into the run directory when a run starts."""
    from rayflex.control.controller import _describe_spec
    from rayflex.models.summary import summarized
    from rayflex.storage.rundir import RunDirectory

    RunDirectory(spec.run.run_dir).write_json("spec.json", _describe_spec(summarized(spec)))


def serve_rank(rank: int, jobs, results) -> None:
    """Rank ``rank`` of each job ``(key, TrainSpec, end_step, port)`` taken from ``jobs``
    until a None (a forked process): a real TrainWorker on gloo that restores the run's
    newest checkpoint and trains to ``end_step``, saving there. ``end_step=0`` trains
    nothing: the worker's final save then writes the weights it built (HF's, through
    ``init_from``) as step 0."""
    import traceback

    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    while (job := jobs.get(timeout=240)) is not None:
        key, spec, end_step, port = job
        worker, answer = None, None
        try:
            worker = TrainWorker(rank, spec, plan_mesh(spec.model, spec.parallel, spec.data, 4))
            worker.setup("127.0.0.1", port, restore=True)
            worker.start(end_step)
            if not worker.join(120):
                raise TimeoutError(f"rank {rank} of {key}: did not finish in 120 s")
            status = worker.poll()
            errors = [c["error"] for c in status.checkpoints if c.get("error")]
            if status.error or errors:
                raise RuntimeError(status.error or errors)
            answer = {"step": status.step, "saved": [c["step"] for c in status.checkpoints if c.get("committed")]}
        except BaseException:  # noqa: BLE001 - the test raises it with the traceback
            answer = {"exception": traceback.format_exc()}
        finally:
            if worker is not None:
                worker.release(timeout_s=10, checkpoint_grace_s=0)
            results.put((key, rank, answer))
    results.close()
    results.join_thread()
    os._exit(0)  # nothing left to free: skip the interpreter's teardown


@pytest.fixture(scope="module")
def runs(dataset_uri, tmp_path_factory):
    """One session of 4 gloo processes, three jobs: a Llama run saved at step 0 (nothing
    trained), the same run resumed and trained to step STEPS, and a tied GPT-2 run saved at
    step 0. Returns name -> (HF model, its directory, TrainSpec)."""
    from rayflex.local_ray import free_ports

    ctx = ForkedContext()  # its server has imported torch, the worker and transformers (conftest)
    results, queues = ctx.Queue(), [ctx.Queue() for _ in range(4)]
    procs = [ctx.Process(target=serve_rank, args=(r, queues[r], results), daemon=True) for r in range(4)]
    for p in procs:
        p.start()  # they import while the runs are prepared here
    try:
        root = tmp_path_factory.mktemp("hf-export")
        storage = f"file://{root}/runs"
        sources = {"llama": hf_model(tiny_config("llama"), seed=1).eval(),
                   "gpt2": hf_model(tiny_config("gpt2", tie_word_embeddings=True), seed=2).eval()}
        out = {}
        for name, model in sources.items():
            directory = saved(model, root / f"hf-{name}")
            spec = _train_spec(directory, f"hf-{name}", storage, dataset_uri)
            _write_spec_json(spec)
            out[name] = (model, directory, spec)
        jobs = [("llama-0", out["llama"][2], 0), ("llama", out["llama"][2], STEPS), ("gpt2-0", out["gpt2"][2], 0)]
        for key, spec, end_step in jobs:
            port = free_ports(1)[0]  # chosen when the job starts (an earlier one may be taken by now)
            for q in queues:
                q.put((key, spec, end_step, port))
            for _ in range(4):
                got_key, rank, answer = results.get(timeout=240)
                assert got_key == key and "exception" not in answer, answer.get("exception", answer)
                assert answer["step"] == end_step, (key, rank, answer)
                assert answer["saved"] == [end_step], (key, rank, answer)
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def _run_dir(runs, name: str) -> str:
    return runs[name][2].run.run_dir


def _checkpoint_state(spec: rf.TrainSpec, step: int) -> dict:
    """The model entries of a committed step, read with DCP straight into the chained
    blocks (no exporter involved)."""
    import torch.distributed.checkpoint as dcp

    from rayflex.checkpoint.dcp_io import CheckpointReader
    from rayflex.checkpoint.manifest import step_dir

    stage = build_stage(spec.model, list(range(spec.model.num_blocks)))
    state = stage.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process")
        dcp.load({"model": state}, storage_reader=CheckpointReader(step_dir(spec.checkpoint_uri, step)), no_dist=True)
    stage.load_state_dict(state)
    return stage.eval()


# ------------------------------------------------------------------------------ round trip
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_step0_export_reproduces_the_original_hf_model(runs, name, tmp_path):
    model, _, spec = runs[name]
    result = export_hf(_run_dir(runs, name), tmp_path / "out", step=0)
    assert result.step == 0 and result.files == ("config.json", "model.safetensors")
    exported = _loaded(tmp_path / "out")
    assert _max_diff(_logits(exported), _logits(model)) <= 1e-6
    # bit for bit: no step was trained, and nothing on the way rounds
    theirs = model.state_dict()
    for key, tensor in exported.state_dict().items():
        source = theirs[key] if key in theirs else theirs["transformer.wte.weight"]
        assert torch.equal(tensor, source), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    if name == "gpt2":  # the tie rule: trained untied, exported untied, loaded untied
        assert model.config.tie_word_embeddings is True
        assert exported.lm_head.weight.data_ptr() != exported.transformer.wte.weight.data_ptr()
        assert any("tie_word_embeddings=false" in n for n in result.notes)


@pytest.mark.multiproc
def test_trained_export_matches_rayflex_forward_of_the_checkpoint(runs, tmp_path):
    model, _, spec = runs["llama"]
    result = export_hf(_run_dir(runs, "llama"), tmp_path / "out")  # the newest committed step
    assert result.step == STEPS
    ours = _logits(_checkpoint_state(spec, STEPS))
    assert _max_diff(_logits(_loaded(tmp_path / "out")), ours) <= 1e-6
    assert _max_diff(ours, _logits(model)) > 1e-3  # it trained: "equal" means something


@pytest.mark.multiproc
def test_sharded_export_has_an_index_and_loads(runs, tmp_path):
    from safetensors import safe_open

    result = export_hf(_run_dir(runs, "llama"), tmp_path / "sharded", shard_bytes=20_000)
    names = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert result.shards == len(names) > 2
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == names
    for name in names:  # no shard holds more than shard_bytes unless one tensor is larger
        with safe_open(str(tmp_path / "sharded" / name), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            nbytes = [4 * torch.Size(s).numel() for s in sizes]
            assert sum(nbytes) <= 20_000 or len(nbytes) == 1
    assert index["metadata"]["total_size"] == result.total_bytes
    export_hf(_run_dir(runs, "llama"), tmp_path / "whole")
    assert _max_diff(_logits(_loaded(tmp_path / "sharded")), _logits(_loaded(tmp_path / "whole"))) == 0


# ------------------------------------------------------------------------------ CLI and sources
@pytest.mark.multiproc
def test_cli_export_writes_the_same_files_from_every_kind_of_source(runs, tmp_path, capsys):
    run_dir = _run_dir(runs, "llama")
    export_hf(run_dir, tmp_path / "api", step=STEPS)
    root = f"{run_dir}/checkpoints"
    for i, source in enumerate([run_dir, root, f"{root}/step_{STEPS:08d}"]):
        out = tmp_path / f"cli{i}"
        assert rayflex_main(["ckpt", "export", source, "--hf", str(out), "--step", str(STEPS)]) == 0
        printed = capsys.readouterr().out
        assert f"exported step {STEPS}" in printed and "from_pretrained" in printed and str(out) in printed
        for name in ("config.json", "model.safetensors"):
            assert (out / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), (source, name)
    # the other subcommands still work on the same checkpoints
    assert rayflex_main(["ckpt", "list", root]) == 0
    assert capsys.readouterr().out.split() == [f"{root}/step_{0:08d}", f"{root}/step_{STEPS:08d}"]
    assert rayflex_main(["ckpt", "verify", root]) == 0
    assert capsys.readouterr().out.startswith(f"ok: step {STEPS}")
    assert rayflex_main(["ckpt", "inspect", root, "--step", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 0
    # a refused export is an error line and exit status 2, not a traceback
    assert rayflex_main(["ckpt", "export", run_dir, "--hf", str(tmp_path / "cli0")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert rayflex_main(["ckpt", "export", run_dir, "--hf", str(tmp_path / "cli0"), "--overwrite", "--step", "0"]) == 0
    assert json.loads((tmp_path / "cli0" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.multiproc
def test_export_from_another_storage_reads_the_same_checkpoint(runs, tmp_path):
    import fsspec

    run_dir = _run_dir(runs, "llama")
    memory = fsspec.filesystem("memory")
    memory.put(run_dir.removeprefix("file://"), "/hf-export-copy", recursive=True)
    try:
        export_hf("memory:///hf-export-copy", tmp_path / "mem")
        export_hf(run_dir, tmp_path / "disk")
    finally:
        memory.rm("/hf-export-copy", recursive=True)
    mem, disk = (tmp_path / d / "model.safetensors" for d in ("mem", "disk"))
    assert mem.read_bytes() == disk.read_bytes()


@pytest.mark.multiproc
def test_only_the_model_entries_are_read_one_block_at_a_time(runs, tmp_path, monkeypatch):
    spec = runs["llama"][2]
    calls = []
    original = CheckpointWeights.load

    def recording(self, keys):
        calls.append(sorted(keys))
        return original(self, keys)

    monkeypatch.setattr(CheckpointWeights, "load", recording)
    export_hf(_run_dir(runs, "llama"), tmp_path / "out", shard_bytes=20_000)
    blocks = [{k.split(".")[1] for k in keys} for keys in calls]
    assert blocks == [{str(i)} for i in range(spec.model.num_blocks)]  # each block once, in order
    expected = sorted(build_stage(spec.model, list(range(spec.model.num_blocks)), "meta").state_dict())
    assert sorted(k for keys in calls for k in keys) == expected  # no optimizer state


# ------------------------------------------------------------------------------ errors
@pytest.mark.multiproc
def test_a_failed_export_leaves_nothing_loadable(runs, tmp_path, monkeypatch):
    original = CheckpointWeights.load
    calls = []

    def failing(self, keys):
        calls.append(keys)
        if len(calls) == 3:
            raise OSError("storage went away")
        return original(self, keys)

    monkeypatch.setattr(CheckpointWeights, "load", failing)
    with pytest.raises(OSError, match="storage went away"):
        export_hf(_run_dir(runs, "llama"), tmp_path / "out", shard_bytes=20_000)
    assert os.listdir(tmp_path) == []  # neither out nor its temporary sibling


@pytest.mark.multiproc
def test_checkpoint_errors_name_the_step_and_the_fix(runs, tmp_path):
    run_dir = _run_dir(runs, "llama")
    with pytest.raises(CheckpointError, match=rf"step 5 of run 'hf-llama' is not committed .*committed: 0, {STEPS}"):
        export_hf(run_dir, tmp_path / "out", step=5)
    # a corrupt newest step is refused (it is verified first), naming the older one to take
    copy = tmp_path / "copy"
    shutil.copytree(run_dir.removeprefix("file://"), copy)
    shard = next((copy / "checkpoints" / f"step_{STEPS:08d}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"corrupt.*older committed steps: 0; choose one with --step"):
        export_hf(str(copy), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert rayflex_main(["ckpt", "verify", str(copy / "checkpoints")]) == 2
    export_hf(str(copy), tmp_path / "out", step=0)  # the intact older step still exports


def test_a_run_without_a_committed_checkpoint_is_refused(tmp_path, dataset_uri):
    model = hf_model(tiny_config("llama"), seed=1)
    directory = saved(model, tmp_path / "hf")
    spec = _train_spec(directory, "never-saved", f"file://{tmp_path}/runs", dataset_uri)
    _write_spec_json(spec)
    (tmp_path / "runs" / "never-saved" / "checkpoints" / "step_00000004").mkdir(parents=True)  # a save cut short
    with pytest.raises(CheckpointError, match=r"no committed checkpoint .*step_00000004 without COMMITTED.json"):
        export_hf(spec.run.run_dir, tmp_path / "out")
    with pytest.raises(ConfigError, match="found no run at"):
        export_hf(f"file://{tmp_path}/runs/elsewhere", tmp_path / "out")


def test_a_run_whose_model_is_not_hf_is_refused_clearly(tmp_path, dataset_uri):
    from conftest import small_gpt

    spec = rf.TrainSpec(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN),
                        run=rf.RunConfig(name="gpt", storage=f"file://{tmp_path}/runs"))
    _write_spec_json(spec)
    with pytest.raises(ConfigError, match=r"not a Hugging Face model.*rayflex\.models\.hf\.causal_lm"):
        export_hf(spec.run.run_dir, tmp_path / "out")
    assert rayflex_main(["ckpt", "export", spec.run.run_dir, "--hf", str(tmp_path / "out")]) == 2


def test_out_dir_rules(tmp_path):
    from rayflex.models.hf_export import check_out_dir

    with pytest.raises(ConfigError, match="is not a local directory"):
        check_out_dir("s3://bucket/model")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        check_out_dir(tmp_path / "busy")
    with pytest.raises(ConfigError, match="not a previous export"):  # overwrite replaces exports only
        check_out_dir(tmp_path / "busy", overwrite=True)
    (tmp_path / "empty").mkdir()
    assert check_out_dir(f"file://{tmp_path}/empty") == str(tmp_path / "empty")


# ------------------------------------------------------------------------------ in memory (no processes)
def test_a_spec_in_memory_exports_to_what_its_blocks_compute(tmp_path):
    """write_hf from a state dict: the blocks' function is HF's after the export (Qwen3,
    from scratch), and an overwrite replaces the previous export whole."""
    spec = causal_lm(tiny_config("qwen3"))
    stage = build_stage(spec, list(range(spec.num_blocks))).eval()
    weights = StateDictWeights.of(spec, stage.state_dict())
    write_hf(weights, tmp_path / "out", shard_bytes=10_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        ours = stage(_ids())
    assert _max_diff(_logits(_loaded(tmp_path / "out")), ours) <= 1e-6
    write_hf(weights, tmp_path / "out", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_bf16_weights_keep_their_bits_and_dtype(tmp_path):
    from safetensors.torch import load_file

    spec = causal_lm(tiny_config("gpt2"))
    state = {k: v.to(torch.bfloat16) for k, v in build_stage(spec, list(range(spec.num_blocks))).state_dict().items()}
    result = write_hf(StateDictWeights.of(spec, state), tmp_path / "out")
    assert result.dtype == "bfloat16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    from rayflex.models.hf import to_hf_key

    assert written.keys() == {to_hf_key(spec, k) for k in state}
    assert all(torch.equal(written[to_hf_key(spec, k)], v) and written[to_hf_key(spec, k)].dtype == v.dtype
               for k, v in state.items())


def test_a_state_dict_that_does_not_match_the_config_is_named(tmp_path):
    spec = causal_lm(tiny_config("llama"))
    state = build_stage(spec, list(range(spec.num_blocks))).state_dict()
    del state["blocks.2.mlp.up_proj.weight"]
    with pytest.raises(ConfigError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        write_hf(StateDictWeights.of(spec, state), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shard_sizes_parse():
    from rayflex.models.hf_export import parse_size

    assert parse_size("2GB") == 2 * 1024 ** 3
    assert parse_size("500MiB") == 500 * 1024 ** 2
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError, match="as a size"):
        parse_size("two gigs")


def test_the_example_job_builds_its_model_and_passes_preflight(tmp_path, monkeypatch):
    """examples/hf_llama.py as `rayflex run` loads it: the tiny Llama is written on first
    use (nothing downloaded), its weights are what the run starts from, and the whole
    configuration passes the checks a run makes before Ray starts."""
    import os

    from rayflex.cli.run import load_trainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAYFLEX_HF_MODEL_DIR", str(tmp_path / "tiny-llama"))
    monkeypatch.setenv("RAYFLEX_DEMO_DATA", f"file://{tmp_path}/data")
    monkeypatch.setenv("RAYFLEX_DEMO_STORAGE", f"file://{tmp_path}/runs")
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_llama.py")
    trainer = load_trainer(example)
    trainer.preflight()
    hf = trainer.spec.model.metadata["hf"]
    assert hf["family"] == "llama" and hf["init_from"] == str(tmp_path / "tiny-llama")
    assert (tmp_path / "tiny-llama" / "model.safetensors").exists()
    assert trainer.spec.parallel.pp == 2 and trainer.spec.scaling.num_workers == 4
