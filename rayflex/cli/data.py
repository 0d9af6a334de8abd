"""``rayflex data prepare INPUT OUT --tokenizer DIR --seq-len N``: text -> token shards on
Ray Data (:mod:`rayflex.data.prepare`), on the cluster at ``RAY_ADDRESS`` or a local one."""

from __future__ import annotations

import json


def add_subcommand(subparsers) -> None:
    d = subparsers.add_parser("data", help="prepare token datasets")
    actions = d.add_subparsers(dest="data_action", required=True)
    p = actions.add_parser("prepare", help="tokenize JSONL / Parquet / text files into token Parquet shards")
    p.add_argument("input", help="a file or directory on any fsspec URI (s3://, gs://, file://, a local path)")
    p.add_argument("out", help="the directory to write the shards and rayflex_dataset.json into")
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json, or a Hugging Face name")
    p.add_argument("--seq-len", type=int, required=True, help="the model's context length (rows hold seq_len + 1 ids)")
    p.add_argument("--format", choices=("json", "parquet", "text"), help="default: from the input's extension")
    p.add_argument("--text-column", default="text", help="the documents' column (JSONL / Parquet; default text)")
    p.add_argument("--row-group-rows", type=int, help="rows per Parquet row group (default: about 1 MB)")
    p.add_argument("--eos-token", help="the end-of-text token placed between documents (default: found by name)")
    p.add_argument("--workers", type=int, default=2, help="Ray Data tokenizer actors (default 2)")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT already holds")
    p.set_defaults(func=cmd_data)


def cmd_data(args) -> int:
    from rayflex.data.prepare import prepare
    from rayflex.local_ray import ensure_ray

    ensure_ray(args.workers)
    manifest = prepare(_uri(args.input), _uri(args.out), args.tokenizer, args.seq_len, fmt=args.format,
                       text_column=args.text_column, row_group_rows=args.row_group_rows,
                       eos_token=args.eos_token, concurrency=args.workers, overwrite=args.overwrite)
    print(json.dumps(manifest, indent=1))
    return 0


def _uri(path: str) -> str:
    import os

    return path if "://" in path else f"file://{os.path.abspath(path)}"
