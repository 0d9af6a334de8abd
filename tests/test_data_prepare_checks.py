"""`rayflex data prepare`'s mistakes fail before Ray Data starts (no cluster here): a
missing input, a missing output bucket, a text column the input does not have. They used to
fail after 5-15 s of Ray Data work, with its traceback (and, for the bucket, after the
writer tried to create it)."""

import json
import uuid

import pytest

from rayflex.errors import ConfigError, StorageError

from tokenizer_helpers import train_tokenizer


class RayDataReached(Exception):
    pass


@pytest.fixture(autouse=True)
def no_ray_data(monkeypatch):
    """``prepare`` hands the input to Ray Data through ``_pyarrow_fs``: reaching it means
    every check passed."""
    def tripwire(uri):
        raise RayDataReached(uri)

    monkeypatch.setattr("rayflex.data.prepare._pyarrow_fs", tripwire)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare_checks")
    (root / "text").mkdir()
    with open(root / "text" / "part-0.jsonl", "w") as out:
        for i in range(4):
            out.write(json.dumps({"body": f"the cat sat on mat {i}", "id": i}) + "\n")
    return root, train_tokenizer(root / "tok", 300, seed=1)


def _prepare(inp, out, tok, **kw):
    from rayflex.data.prepare import prepare

    return prepare(inp, out, tok, 32, fmt="json", **kw)


def test_an_input_that_does_not_exist(corpus, tmp_path):
    root, tok = corpus
    with pytest.raises(ConfigError, match=r"INPUT: file://.*/nope does not exist\. Fix: pass an existing file"):
        _prepare(f"file://{root}/nope", f"file://{tmp_path}/o", tok, text_column="body")
    assert not (tmp_path / "o").exists()


def test_a_text_column_the_input_does_not_have(corpus, tmp_path):
    root, tok = corpus
    with pytest.raises(ConfigError, match=r"--text-column: .* has no column 'text' \(it has \['body', 'id'\]\)"):
        _prepare(f"file://{root}/text", f"file://{tmp_path}/o", tok)


def test_an_input_of_another_format(corpus, tmp_path):
    root, tok = corpus
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.jsonl").write_text("text,id\nhello,1\n")
    with pytest.raises(ConfigError, match=r"INPUT: .*a.jsonl is not JSON lines of objects"):
        _prepare(f"file://{tmp_path}/csv", f"file://{tmp_path}/o", tok)
    with pytest.raises(ConfigError, match=r"INPUT: .* holds no parquet file \(.parquet\)"):
        from rayflex.data.prepare import prepare

        prepare(f"file://{root}/text", f"file://{tmp_path}/o", tok, 32, fmt="parquet")


def test_an_output_bucket_that_does_not_exist_is_named_and_never_created(corpus, s3_endpoint):
    import s3fs

    root, tok = corpus
    bucket = f"rayflex-missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(StorageError, match=rf"bucket '{bucket}' does not exist .*rayflex never creates buckets"):
        _prepare(f"file://{root}/text", f"s3://{bucket}/tokens", tok, text_column="body")
    fs = s3fs.S3FileSystem(anon=False, client_kwargs={"endpoint_url": s3_endpoint})
    assert not fs.exists(bucket)


def test_good_input_reaches_ray_data(corpus, tmp_path):
    root, tok = corpus
    with pytest.raises(RayDataReached):
        _prepare(f"file://{root}/text", f"file://{tmp_path}/o", tok, text_column="body")
