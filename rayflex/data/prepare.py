"""``rayflex data prepare``: text on any fsspec URI -> token Parquet shards, on Ray Data.

Documents (JSONL lines, a Parquet text column, or the lines of text files) are tokenized
by a pool of Ray Data actors (one tokenizer each: ``map_batches`` over the cluster), each
followed by the tokenizer's end-of-text id, concatenated and cut into rows of
``seq_len + 1`` ids (the training row: inputs and shifted targets). Each batch's last
partial row is dropped (at most ``seq_len`` tokens per batch of documents). The shards are
written by Ray Data's ``write_parquet`` with row groups sized for the reader
(``rayflex.data.dataset``), and a manifest ``rayflex_dataset.json`` next to them records the
tokens, rows, shards, seq_len and the tokenizer (name, vocabulary size, end-of-text id and
the sha256 of its serialised form): the trainer refuses a dataset whose tokenizer or
vocabulary does not match the model's (:func:`check_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from rayflex.errors import ConfigError
from rayflex.storage.fs import check_bucket, read_text, redact_uri, resolve, write_text_atomic

if TYPE_CHECKING:
    from rayflex.config import DataConfig

log = logging.getLogger(__name__)

MANIFEST = "rayflex_dataset.json"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer made a dataset: compared, never trusted by name alone."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int


def load_tokenizer(name_or_dir: str, eos_token: Optional[str] = None):
    """A ``tokenizers.Tokenizer`` and its identity, from a local directory (or file)
    holding ``tokenizer.json``, or a Hugging Face name (needs the hub or its cache)."""
    from tokenizers import Tokenizer

    path = os.path.join(name_or_dir, "tokenizer.json") if os.path.isdir(name_or_dir) else name_or_dir
    if os.path.isfile(path):
        tok = Tokenizer.from_file(path)
    elif os.path.exists(name_or_dir) or name_or_dir.startswith(("/", ".", "~")):
        # A path (an "org/model" hub name also has a slash, so only these count as paths).
        raise ConfigError("--tokenizer", f"no tokenizer.json at {name_or_dir!r}",
                          "point at a directory saved with tokenizer.save_pretrained(DIR) or a tokenizer.json file")
    else:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name_or_dir).backend_tokenizer
        except Exception as e:  # noqa: BLE001 - offline, unknown name, not a fast tokenizer
            raise ConfigError("--tokenizer", f"cannot load tokenizer {name_or_dir!r}: {e}",
                              "pass a local directory with tokenizer.json (offline: the hub is not reachable)") from e
    vocab = tok.get_vocab(with_added_tokens=True)
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    eos = next((vocab[t] for t in candidates if t in vocab), None)
    if eos is None:
        raise ConfigError("--eos-token", f"the tokenizer has none of the end-of-text tokens {list(candidates)}",
                          "name the one it uses with --eos-token TOKEN")
    serialised = tok.to_str()
    identity = TokenizerIdentity(name=os.path.basename(os.path.normpath(name_or_dir)),
                                 sha256=hashlib.sha256(serialised.encode()).hexdigest(),
                                 vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_id=int(eos))
    return tok, identity


class TokenizeAndPack:
    """Ray Data's callable class: one tokenizer per actor, a batch of documents in, rows of
    ``row_len`` token ids out (a ``tokens`` list<int32> column)."""

    def __init__(self, serialised: str, eos_id: int, row_len: int, text_column: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(serialised)
        self.eos_id, self.row_len, self.text_column = eos_id, row_len, text_column

    def __call__(self, batch: dict) -> "object":
        import pyarrow as pa

        texts = [t for t in batch[self.text_column].tolist() if isinstance(t, str) and t]
        pieces = []
        for enc in self.tok.encode_batch(texts, add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=np.int32))
            pieces.append(np.array([self.eos_id], dtype=np.int32))
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        rows = len(stream) // self.row_len
        values = pa.array(stream[: rows * self.row_len])
        offsets = pa.array(np.arange(0, rows * self.row_len + 1, self.row_len, dtype=np.int32))
        return pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})


def _pyarrow_fs(uri: str):
    """Ray Data reads and writes through pyarrow; give it rayflex's fsspec filesystem (the
    same endpoint and credentials as checkpoints and training reads)."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = resolve(uri)
    return PyFileSystem(FSSpecHandler(fs)), path


def default_row_group_rows(seq_len: int) -> int:
    """About 1 MB of int32 ids per row group: a cheap ranged read, a small cache entry."""
    return max(16, (1 << 20) // (4 * (seq_len + 1)))


def prepare(input_uri: str, out_uri: str, tokenizer: str, seq_len: int, *, fmt: Optional[str] = None,
            text_column: str = "text", row_group_rows: Optional[int] = None, batch_size: int = 256,
            concurrency: int = 2, eos_token: Optional[str] = None, overwrite: bool = False) -> dict:
    """Tokenize ``input_uri`` into token shards at ``out_uri``; returns the manifest.

    Every check (arguments, tokenizer, input, text column, output) runs before Ray Data
    starts, reading one input file's first record or footer; ``OUT`` is replaced
    (``overwrite``) only once they all passed, and never has its bucket created."""
    if seq_len < 1:
        raise ConfigError("--seq-len", f"must be >= 1, got {seq_len}", "pass the model's context length")
    fmt = fmt or _format_of(input_uri)
    tok, identity = load_tokenizer(tokenizer, eos_token)
    columns = _columns_of(input_uri, fmt)
    if text_column not in columns:
        raise ConfigError("--text-column", f"{redact_uri(input_uri)} has no column {text_column!r} "
                          f"(it has {columns})", "name the text column with --text-column")
    check_bucket(out_uri, field="OUT")  # the writer would try to create a missing bucket
    out_fs, out_path = resolve(out_uri)
    if out_fs.exists(out_path) and out_fs.ls(out_path) and not overwrite:
        raise ConfigError("OUT", f"{redact_uri(out_uri)} is not empty", "choose a new directory or pass --overwrite")
    import ray.data

    in_fs, in_path = _pyarrow_fs(input_uri)
    reader = {"json": ray.data.read_json, "parquet": ray.data.read_parquet, "text": ray.data.read_text}[fmt]
    ds = reader(in_path, filesystem=in_fs)
    if overwrite and out_fs.exists(out_path):
        out_fs.rm(out_path, recursive=True)  # only now: every check above has passed
    rows_per_group = row_group_rows or default_row_group_rows(seq_len)
    packed = ds.map_batches(TokenizeAndPack, fn_constructor_args=(tok.to_str(), identity.eos_id, seq_len + 1,
                                                                  text_column),
                            batch_size=batch_size, batch_format="numpy", concurrency=concurrency)
    pa_fs, pa_path = _pyarrow_fs(out_uri)
    packed.write_parquet(pa_path, filesystem=pa_fs, row_group_size=rows_per_group,
                         min_rows_per_file=rows_per_group)
    from rayflex.data.dataset import TokenDataset

    try:
        written = TokenDataset(out_uri)
    except ConfigError as e:
        raise ConfigError("INPUT", f"{redact_uri(input_uri)} gave no full row of {seq_len + 1} tokens ({e.problem})",
                          "check the input and --text-column, or lower --seq-len") from None
    manifest = {"format": 1, "seq_len": seq_len, "rows": len(written), "tokens": len(written) * (seq_len + 1),
                "shards": len(written._shards), "row_groups": written.num_row_groups,
                "row_group_rows": rows_per_group, "tokenizer": asdict(identity), "source": redact_uri(input_uri)}
    write_text_atomic(f"{out_uri.rstrip('/')}/{MANIFEST}", json.dumps(manifest, indent=1))
    log.info("prepared %d rows (%d tokens) in %d shards at %s", manifest["rows"], manifest["tokens"],
             manifest["shards"], redact_uri(out_uri))
    return manifest


def _columns_of(input_uri: str, fmt: str) -> list[str]:
    """The columns Ray Data will read from ``input_uri``, from its first file alone (its
    first JSON record, its Parquet footer); ConfigError if the input does not exist or holds
    no file of the format."""
    fs, path = resolve(input_uri)
    if not fs.exists(path):
        raise ConfigError("INPUT", f"{redact_uri(input_uri)} does not exist",
                          "pass an existing file or directory (a local path or an s3://, gs://, az:// URI)")
    if fmt == "text":
        return ["text"]  # Ray Data's read_text gives one "text" column of lines
    suffixes = tuple(ext for ext, f in FORMATS.items() if f == fmt)
    files = [path] if fs.isfile(path) else sorted(f for f in fs.find(path) if f.endswith(suffixes))
    if not files:
        raise ConfigError("INPUT", f"{redact_uri(input_uri)} holds no {fmt} file ({', '.join(suffixes)})",
                          "point INPUT at the files, or pass the --format they are in")
    with fs.open(files[0], "rb") as f:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(f).names)
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    record = e
                if not isinstance(record, dict):
                    raise ConfigError("INPUT", f"{redact_uri(files[0])} is not JSON lines of objects (its first "
                                      f"line: {line[:80]!r})", "pass one JSON object per line, or the --format "
                                      "the file is in")
                return list(record)
    return []


def _format_of(uri: str) -> str:
    ext = os.path.splitext(uri.rstrip("/"))[1].lower()
    if ext in FORMATS:
        return FORMATS[ext]
    raise ConfigError("--format", f"cannot tell the format of {redact_uri(uri)} from its name",
                      f"pass --format json|parquet|text (extensions known: {sorted(FORMATS)})")


def read_manifest(uri: str) -> Optional[dict]:
    try:
        return json.loads(read_text(f"{uri.rstrip('/')}/{MANIFEST}"))
    except FileNotFoundError:
        return None


def check_manifest(data: "DataConfig", model_vocab: int) -> None:
    """Refuse a prepared dataset (each source of a mixture) the model cannot read: ids
    beyond the model's vocabulary, or (``DataConfig.tokenizer`` given) another tokenizer
    than the one named."""
    want = load_tokenizer(data.tokenizer)[1] if data.tokenizer else None
    for uri in [u for u, _ in data.sources] if data.sources else [data.uri]:
        _check_source(uri, data.tokenizer, want, model_vocab)


def _check_source(uri: str, tokenizer: Optional[str], want: Optional[TokenizerIdentity], model_vocab: int) -> None:
    manifest = read_manifest(uri)
    if manifest is None:
        if tokenizer:
            raise ConfigError("DataConfig.tokenizer", f"{redact_uri(uri)} has no {MANIFEST}, so its tokenizer "
                              "is unknown", "prepare it with `rayflex data prepare`, or drop DataConfig.tokenizer")
        return
    made_by = manifest["tokenizer"]
    if model_vocab and made_by["vocab_size"] > model_vocab:
        raise ConfigError("DataConfig.uri", f"{redact_uri(uri)} was tokenized by {made_by['name']!r} "
                          f"(vocabulary {made_by['vocab_size']}) but the model's vocabulary is {model_vocab}: "
                          "ids beyond it would index past the embedding",
                          "prepare the data with the model's tokenizer, or give the model a vocabulary "
                          f">= {made_by['vocab_size']}")
    if want is not None and want.sha256 != made_by["sha256"]:
        raise ConfigError("DataConfig.tokenizer", f"{redact_uri(uri)} was tokenized by {made_by['name']!r} "
                          f"(sha256 {made_by['sha256'][:12]}, vocabulary {made_by['vocab_size']}), not by "
                          f"{tokenizer!r} (sha256 {want.sha256[:12]}, vocabulary {want.vocab_size})",
                          "prepare the data again with this tokenizer, or point DataConfig.tokenizer at the "
                          "one the data was made with")
