"""`rayflex data prepare`: text -> token shards on Ray Data (two tokenizer actors on the
shared loopback cluster), trained with `rayflex run`; a dataset made by another tokenizer,
or with ids beyond the model's vocabulary, is refused before any actor starts."""

import json

import numpy as np
import pytest

from rayflex.errors import ConfigError

from tokenizer_helpers import WORDS, train_tokenizer

pytestmark = pytest.mark.cluster

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~2 MB of JSONL documents in 4 files, and the byte-level BPE tokenizer (vocab 300)."""
    root = tmp_path_factory.mktemp("prepare")
    rng = np.random.default_rng(0)
    (root / "text").mkdir()
    for f in range(4):
        with open(root / "text" / f"part-{f}.jsonl", "w") as out:
            for _ in range(1500):
                doc = " ".join(rng.choice(WORDS, size=int(rng.integers(20, 120))))
                out.write(json.dumps({"text": doc, "id": int(rng.integers(1 << 30))}) + "\n")
    return root, train_tokenizer(root / "tok", 300, seed=1)


@pytest.fixture(scope="module")
def prepared(corpus, two_node_cluster):
    from rayflex.cli.main import main

    root, tok = corpus
    out = root / "tokens"
    assert main(["data", "prepare", str(root / "text"), str(out), "--tokenizer", tok, "--seq-len", "32",
                 "--format", "json", "--row-group-rows", "64", "--workers", "2"]) == 0
    return out


def test_prepare_writes_packed_rows_and_a_manifest(corpus, prepared):
    from tokenizers import Tokenizer

    from rayflex.data.dataset import TokenDataset

    root, tok = corpus
    manifest = json.loads((prepared / "rayflex_dataset.json").read_text())
    ds = TokenDataset(f"file://{prepared}")
    assert manifest["rows"] == len(ds) > 1000 and manifest["tokens"] == len(ds) * 33 and ds.row_len == 33
    assert manifest["tokenizer"]["vocab_size"] == 300 and manifest["shards"] >= 1
    assert ds.block_rows == 64, "row groups sized as asked"
    rows = ds.rows(np.arange(len(ds))).numpy()
    assert rows.min() >= 0 and rows.max() < 300
    eos = manifest["tokenizer"]["eos_id"]
    assert (rows == eos).sum() > 1000, "documents are separated by the end-of-text id"
    text = Tokenizer.from_file(f"{tok}/tokenizer.json").decode(rows[5].tolist(), skip_special_tokens=False)
    words = text.replace("<|endoftext|>", " ").split()
    assert len(words) > 5 and set(words[1:-1]) <= set(WORDS), words  # a row may cut its first and last word


def test_the_prepared_data_trains_with_rayflex_run(corpus, prepared, tmp_path):
    from rayflex.cli.main import main

    root, tok = corpus
    spec = tmp_path / "spec.py"
    spec.write_text(f'''
import rayflex as rf
from rayflex.models import GPTConfig, gpt

trainer = rf.Trainer(
    model=gpt(GPTConfig(vocab_size=320, seq_len=32, d_model=32, n_layers=1, n_heads=2)),
    data=rf.DataConfig(uri="file://{prepared}", seq_len=32, global_batch=8, tokenizer="{tok}"),
    run=rf.RunConfig(name="prepared", storage="file://{tmp_path}/runs", steps=4),
    scaling=rf.ScalingConfig(num_workers=2))
''')
    assert main(["run", str(spec), "--no-progress"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "prepared" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]


def test_a_dataset_of_another_tokenizer_or_a_larger_vocabulary_is_refused(corpus, prepared, tmp_path):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    root, tok = corpus
    other = train_tokenizer(tmp_path / "other", 280, seed=2)

    def trainer(vocab, tokenizer):
        return rf.Trainer(model=gpt(GPTConfig(vocab_size=vocab, seq_len=32, d_model=32, n_layers=1, n_heads=2)),
                          data=rf.DataConfig(uri=f"file://{prepared}", seq_len=32, global_batch=8,
                                             tokenizer=tokenizer),
                          run=rf.RunConfig(name="refused", storage=f"file://{tmp_path}/runs", steps=2),
                          scaling=rf.ScalingConfig(num_workers=2))

    with pytest.raises(ConfigError, match=r"DataConfig.tokenizer: .* was tokenized by 'tok' .*vocabulary 300\), "
                                          r"not by .*other.*vocabulary 280\).*Fix: prepare the data again"):
        trainer(320, other).submit()
    with pytest.raises(ConfigError, match=r"DataConfig.uri: .*tokenized by 'tok' \(vocabulary 300\) but the "
                                          r"model's vocabulary is 256.*Fix: prepare the data with the model's"):
        trainer(256, None).submit()
    assert not (tmp_path / "runs" / "refused").exists(), "refused before the run directory was made"


def test_bad_prepare_input_is_refused_before_any_work(corpus, prepared, tmp_path):
    from rayflex.data.prepare import prepare

    root, tok = corpus
    with pytest.raises(ConfigError, match=r"OUT: .* is not empty.*Fix: choose a new directory or pass --overwrite"):
        prepare(f"file://{root}/text", f"file://{prepared}", tok, 32, fmt="json")
    with pytest.raises(ConfigError, match=r"--format: cannot tell the format"):
        prepare(f"file://{root}/text", f"file://{tmp_path}/o", tok, 32)
    with pytest.raises(ConfigError, match=r"--tokenizer: no tokenizer.json"):
        prepare(f"file://{root}/text", f"file://{tmp_path}/o", str(tmp_path / "nope"), 32, fmt="json")
    with pytest.raises(ConfigError, match=r"--text-column: .* has no column 'body'"):
        prepare(f"file://{root}/text", f"file://{tmp_path}/o", tok, 32, fmt="json", text_column="body")
    # --overwrite replaces OUT only once the input passed its checks: a typo loses nothing.
    before = sorted(p.name for p in prepared.iterdir())
    with pytest.raises(ConfigError, match="--text-column"):
        prepare(f"file://{root}/text", f"file://{prepared}", tok, 32, fmt="json", text_column="body", overwrite=True)
    assert sorted(p.name for p in prepared.iterdir()) == before
