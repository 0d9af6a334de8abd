"""A new user's mistakes fail on the driver, in under 2 s, before Ray is touched.

Each test calls ``Trainer.fit()`` / ``.submit()`` as a user would and asserts the message
the user reads. ``ensure_ray`` is replaced by a tripwire (``RayTouched``): a preflight that
lets a mistake through fails the test instead of starting Ray on this machine.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rayflex as rf
from rayflex.data.dataset import write_synthetic_dataset
from rayflex.models import GPTConfig, ModelSpec, ModelSummary, gpt
from rayflex.models.contract import check_model_contract
from rayflex.models.gpt_blocks import lm_loss

VOCAB, SEQ, D = 32, 16, 16
ROWS = 24


class RayTouched(Exception):
    """The preflight passed: submit() went on to connect to Ray."""


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def tripwire(*args, **kwargs):
        raise RayTouched("preflight passed; submit() called ensure_ray")

    monkeypatch.setattr("rayflex.api.trainer.ensure_ray", tripwire)


@pytest.fixture(scope="module", autouse=True)
def torch_meta_warm():
    """The first meta-device op of a process imports ``torch._dynamo`` (1-2 s here, inside
    torch: its Python meta kernels are wrapped in ``torch._disable_dynamo``). submit() paid
    it before this preflight existed (``ModelSummary.of`` builds blocks on meta); the 2 s
    bound below is on rayflex's checks, so the import is done once up front."""
    import importlib

    importlib.import_module("torch._dynamo")


@pytest.fixture(scope="module")
def data_uri(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    return write_synthetic_dataset(f"file://{root}/tokens", num_samples=ROWS, seq_len=SEQ, vocab_size=VOCAB,
                                   num_shards=2, seed=3)


# ------------------------------------------------------------------------ a toy model
class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)

    def forward(self, tokens):
        return self.tok(tokens)


class Mlp(nn.Module):
    def __init__(self, width_out: int = D):
        super().__init__()
        self.fc = nn.Linear(D, width_out)

    def forward(self, x):
        return self.fc(x)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = nn.Linear(D, VOCAB)

    def forward(self, x):
        return self.lm(x)


class ReturnsTuple(Mlp):
    def forward(self, x):
        y = self.fc(x)
        return y, y.pow(2).mean()  # e.g. an auxiliary loss


class Widens(Mlp):
    def __init__(self):
        super().__init__(width_out=2 * D)


class ReturnsLong(Mlp):
    def forward(self, x):
        return self.fc(x).long()


class UsesItem(Mlp):
    def forward(self, x):
        return self.fc(x) * (2.0 if x.abs().max() > 10 else 1.0)  # Python control flow on data


class UsesMask(Mlp):
    def forward(self, x):
        y = self.fc(x)
        return y + y[y > 0].sum() * 0  # boolean mask: nonzero has no meta kernel


def toy(middle=Mlp, loss_fn=lm_loss) -> ModelSpec:
    blocks = [Embed, middle, Head]
    return ModelSpec(name="toy", num_blocks=3, build_block=lambda i: blocks[i](), loss_fn=loss_fn, hidden_size=D)


def trainer(tmp_path, data_uri, model=None, *, global_batch=8, seq_len=SEQ, pp=1) -> rf.Trainer:
    return rf.Trainer(model=model or toy(), data=rf.DataConfig(uri=data_uri, seq_len=seq_len, global_batch=global_batch),
                      run=rf.RunConfig(name=f"preflight-{uuid.uuid4().hex[:8]}", storage=f"file://{tmp_path}/runs",
                                       steps=2),
                      scaling=rf.ScalingConfig(num_workers=pp), parallel=rf.ParallelConfig(pp=pp))


def rejected(call, error=rf.ConfigError) -> str:
    """The message ``call()`` fails with; asserts it came before any work: Ray never started."""
    import ray

    with pytest.raises(error) as info:
        call()
    assert not ray.is_initialized()
    return str(info.value)


# ------------------------------------------------------------------------ data
@pytest.mark.parametrize("entry", ["fit", "submit"])
def test_global_batch_larger_than_the_dataset(tmp_path, data_uri, entry):
    t = trainer(tmp_path, data_uri, global_batch=32)
    message = rejected(getattr(t, entry))
    assert message == (f"DataConfig.global_batch: global_batch=32 is larger than the dataset: {data_uri} has "
                       f"{ROWS} rows, so every step would repeat rows of its own batch. Fix: lower "
                       f"global_batch to at most {ROWS}, or write at least 32 rows")


def test_a_global_batch_equal_to_the_dataset_passes(tmp_path, data_uri):
    with pytest.raises(RayTouched):
        trainer(tmp_path, data_uri, global_batch=ROWS).fit()


def test_data_on_a_missing_bucket_names_the_bucket(tmp_path, s3_endpoint):
    bucket = f"rayflex-missing-{uuid.uuid4().hex[:12]}"
    uri = f"s3://{bucket}/tokens"
    message = rejected(trainer(tmp_path, uri).fit, error=rf.StorageError)
    assert message == (f"bucket {bucket!r} does not exist at {s3_endpoint} (DataConfig.uri {uri}). Fix: create it "
                       f"with `aws s3 mb s3://{bucket} --endpoint-url {s3_endpoint}` or point the "
                       "DataConfig.uri at an existing bucket; rayflex never creates buckets")


# ------------------------------------------------------------------------ model contract
def test_a_block_returning_a_tuple_at_pp2(tmp_path, data_uri):
    message = rejected(trainer(tmp_path, data_uri, toy(ReturnsTuple), pp=2).fit)
    assert message.startswith("ModelSpec block 1: block 1 returned a tuple of 2 (Tensor[2, 16, 16] float32, "
                              "Tensor[] float32), not a single tensor. Fix: return one tensor from forward()")
    assert "Stage.forward()" not in message


def test_a_block_whose_output_does_not_fit_the_next(tmp_path, data_uri):
    message = rejected(trainer(tmp_path, data_uri, toy(Widens)).fit)
    assert message.startswith("ModelSpec block 2: forward on the output of block 1 (Tensor[2, 16, 32] float32) "
                              "raised RuntimeError: ")
    assert message.endswith("Fix: make block 1 return what block 2 takes (shape and dtype), or make block 2 "
                            "accept Tensor[2, 16, 32] float32")


class Buggy(Mlp):
    def forward(self, x):
        scale = self.scales[0]  # noqa: F841 - the bug: no such attribute
        return self.fc(x)


def test_a_block_with_a_bug_of_its_own_is_pointed_at_not_at_its_input(tmp_path, data_uri):
    """A block that raises for a reason of its own used to get the shape hint ("make block 0
    return what block 1 takes"); the fix now names the line that raised."""
    message = rejected(trainer(tmp_path, data_uri, toy(Buggy)).fit)
    assert message.startswith("ModelSpec block 1: forward on the output of block 0 (Tensor[2, 16, 16] float32) "
                              "raised AttributeError: ")
    line = Buggy.forward.__code__.co_firstlineno + 1
    assert message.endswith(f"Fix: fix block 1's forward: it raised at {__file__}:{line}")


def test_a_block_whose_dtype_does_not_fit_the_next(tmp_path, data_uri):
    message = rejected(trainer(tmp_path, data_uri, toy(ReturnsLong)).fit)
    assert message == ("ModelSpec block 2: its lm (Linear) received int64 input from block 1 "
                       "(Tensor[2, 16, 16] int64) but its weight is float32. Fix: make block 1 return "
                       "float32 (cast with .to(...)) or give block 2 matching parameter dtypes")


@pytest.mark.parametrize("loss_fn, expected", [
    (lambda logits: logits.mean(),
     "ModelSpec.loss_fn: has signature (logits) but rayflex calls loss_fn(output, targets) (too many "
     "positional arguments). Fix: define loss_fn(output, targets) returning the mean loss of the microbatch "
     "as a scalar tensor"),
    (lambda out, targets: F.cross_entropy(out.transpose(1, 2), targets, reduction="none"),
     "ModelSpec.loss_fn: returned Tensor[2, 16] float32 on the head's output Tensor[2, 16, 32] float32 and "
     "targets Tensor[2, 16] int64; rayflex needs a scalar tensor (it calls loss.backward()). Fix: reduce it "
     "to the mean loss of the microbatch, e.g. return loss.mean()"),
    (lambda out, targets: 0.0,
     "ModelSpec.loss_fn: returned a float on the head's output Tensor[2, 16, 32] float32 and targets "
     "Tensor[2, 16] int64; rayflex needs a scalar tensor (it calls loss.backward()). Fix: reduce it to the "
     "mean loss of the microbatch, e.g. return loss.mean()"),
    (lambda out, targets: F.cross_entropy(out, targets),  # forgot to flatten [B, T, V]
     "ModelSpec.loss_fn: on the head's output Tensor[2, 16, 32] float32 and targets Tensor[2, 16] "
     "int64 raised RuntimeError: "),
], ids=["signature", "not-scalar", "not-a-tensor", "raises"])
def test_loss_mistakes(tmp_path, data_uri, loss_fn, expected):
    message = rejected(trainer(tmp_path, data_uri, toy(loss_fn=loss_fn)).fit)
    assert message.startswith(expected)


def test_gpt_rows_longer_than_its_positions(tmp_path, data_uri):
    model = gpt(GPTConfig(vocab_size=VOCAB, seq_len=8, d_model=16, n_layers=1, n_heads=2))
    message = rejected(trainer(tmp_path, data_uri, model, seq_len=SEQ).fit)
    assert message == ("DataConfig.seq_len: seq_len=16 is longer than the model's GPTConfig.seq_len=8 (its "
                       "learned positions). Fix: use DataConfig(seq_len<=8) or GPTConfig(seq_len>=16)")


def test_the_reference_gpt_passes(tmp_path, data_uri):
    model = gpt(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2))
    with pytest.raises(RayTouched):
        trainer(tmp_path, data_uri, model, pp=2).submit()


@pytest.mark.parametrize("middle", [UsesItem, UsesMask])
def test_models_that_cannot_run_on_meta_are_not_rejected(tmp_path, data_uri, caplog, middle):
    with caplog.at_level(logging.DEBUG, logger="rayflex.models.contract"):
        with pytest.raises(RayTouched):
            trainer(tmp_path, data_uri, toy(middle)).fit()
    assert "checked only up to block 1" in caplog.text and "cannot run on the meta device" in caplog.text


def test_the_check_of_a_300m_gpt_never_builds_its_weights():
    # Fast because it runs on the meta device: no weight is allocated or initialised. The
    # bound is the mechanism's, not a number of seconds: the process grows by far less than
    # the 1.2 GB the float32 weights would take (a host 3x slower is slower, not red).
    import psutil

    cfg = GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=16, n_heads=16)
    model = gpt(cfg)
    weights = 4 * sum(model.param_counts())
    assert 250e6 < weights / 4 < 350e6
    me = psutil.Process()
    before = me.memory_info().rss
    check_model_contract(model, batch=2, seq_len=cfg.seq_len)
    assert me.memory_info().rss - before < weights / 10


# ------------------------------------------------------------------------ shipping the spec
def _closure_spec() -> ModelSpec:
    width = 8  # captured: the spec must travel with it

    def build(i):
        return nn.Embedding(VOCAB, width) if i == 0 else nn.Linear(width, VOCAB)

    return ModelSpec(name="closure", num_blocks=2, build_block=build,
                     loss_fn=lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten()))


def _lambda_spec() -> ModelSpec:
    return toy()


@pytest.mark.parametrize("make", [_closure_spec, _lambda_spec], ids=["closure", "lambda"])
def test_closure_and_lambda_specs_survive_the_trip_to_the_workers(make):
    spec = make()
    back = ModelSummary.of(spec).load()
    assert back is not spec and back.num_blocks == spec.num_blocks
    for i in range(spec.num_blocks):
        ours, theirs = spec.block(i).state_dict(), back.block(i).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    logits, targets = torch.randn(2, 4, VOCAB), torch.randint(0, VOCAB, (2, 4))
    assert torch.equal(spec.loss_fn(logits, targets), back.loss_fn(logits, targets))
    check_model_contract(back, batch=2, seq_len=4)


# ------------------------------------------------------------------------ RAYFLEX_* knobs
@pytest.mark.parametrize("raw, problem", [("soon", "is not a number"), ("-3", "must be > 0")])
def test_a_bad_knob_value_fails_before_ray(tmp_path, data_uri, monkeypatch, raw, problem):
    """Read only where used, a bad knob used to fail once the workers started (12-14 s)."""
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", raw)
    message = rejected(trainer(tmp_path, data_uri).fit)
    assert message.startswith(f"RAYFLEX_HEARTBEAT_TIMEOUT_S: '{raw}' {problem}")
    assert "Fix: set a number > 0 (the default is 30), or unset it" in message
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_misspelled_knob_is_named_with_the_nearest_one(tmp_path, data_uri, monkeypatch):
    monkeypatch.setenv("RAYFLEX_POLL_INTERVAL", "0.5")
    with pytest.warns(UserWarning, match=r"RAYFLEX_POLL_INTERVAL is not a rayflex setting and is ignored; "
                                         r"did you mean RAYFLEX_POLL_INTERVAL_S\?"):
        with pytest.raises(RayTouched):  # a warning, not an error: the run goes on
            trainer(tmp_path, data_uri).fit()


# ------------------------------------------------------------------------ resuming a run name
@pytest.mark.parametrize("d_model, fits", [(16, True), (32, False)])
def test_resubmitting_a_run_name_with_another_model(tmp_path, data_uri, d_model, fits):
    """The run's newest checkpoint holds a d_model=16 GPT. The same model resumes; another
    one used to fail 18 s in, in the workers' DCP load, after rewriting spec.json and
    result.json. Now: refused before Ray starts, every file of the run as it was."""
    import hashlib

    from rayflex.models.spec import build_stage
    from rayflex.checkpoint.checkpointer import TrainState

    from checkpoint_helpers import save_committed

    def model(width):
        return gpt(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=2, n_heads=2))

    t = trainer(tmp_path, data_uri, model(d_model))
    saved = build_stage(model(16), [0, 1, 2, 3])
    state = TrainState(modules=[saved], optimizers=[rf.OptimizerConfig().build(saved.parameters())], get_step=lambda: 5)
    save_committed(t.spec.checkpoint_uri, state, step=5)
    run_dir = tmp_path / "runs" / t.spec.run.name
    (run_dir / "spec.json").write_text('{"model": {"name": "gpt-16"}}')
    (run_dir / "result.json").write_text('{"state": "FINISHED"}')

    def files():
        return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = files()
    if fits:
        with pytest.raises(RayTouched):
            t.fit()
    else:
        message = rejected(t.fit)  # before Ray: the tripwire
        assert message.startswith(f"model: run {t.spec.run.name!r} resumes from its checkpoint at step 5, which "
                                  "holds another model: blocks.0.pos.weight: saved [16, 16], model [16, 32]; "
                                  "blocks.0.tok.weight: saved [32, 16], model [32, 32]; ")
        assert "more)" in message
        assert "Fix: use a new RunConfig.name for a new model" in message
    assert files() == before
