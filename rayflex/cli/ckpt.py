"""``rayflex ckpt list|inspect|verify|export URI``: the committed checkpoints of a run, and a
Hugging Face directory made from one (:func:`rayflex.export_hf`).
"""

from __future__ import annotations

import sys

from rayflex.errors import ConfigError, RayflexError


def add_subcommand(subparsers) -> None:
    c = subparsers.add_parser("ckpt", help="list, inspect, verify or export checkpoints")
    c.add_argument("action", choices=("list", "inspect", "verify", "export"))
    c.add_argument("uri", help="checkpoint root, e.g. s3://bucket/runs/NAME/checkpoints (export: also the run "
                               "directory or one step directory)")
    c.add_argument("--step", type=int, help="this committed step instead of the newest")
    c.add_argument("--hf", metavar="OUT", help="export: the local directory to write the Hugging Face model into")
    c.add_argument("--overwrite", action="store_true", help="export: replace a previous export in OUT")
    c.add_argument("--shard-size", default="2GB", help="export: largest safetensors file (default 2GB)")
    c.set_defaults(func=cmd_ckpt)


def cmd_ckpt(args) -> int:
    from rayflex.checkpoint import manifest as mf

    if args.action == "export":
        return _cmd_export(args)
    if args.action == "list":
        for step in mf.list_committed(args.uri):
            print(mf.step_dir(args.uri, step))
        return 0
    step = args.step if args.step is not None else mf.latest_committed(args.uri)
    if step is None:
        print(f"no committed checkpoint under {args.uri}", file=sys.stderr)
        return 1
    if args.action == "inspect":
        m = mf.read_manifest(args.uri, step)
        print(m.to_json())
        return 0
    try:
        m = mf.verify(args.uri, step, deep=True)
    except RayflexError as e:
        print(f"CORRUPT: {e}", file=sys.stderr)
        return 2
    print(f"ok: step {m.step}, {len(m.files)} files verified")
    return 0


def _cmd_export(args) -> int:
    from rayflex.api.export import export_hf
    from rayflex.models.hf_export import parse_size

    if not args.hf:
        raise ConfigError("rayflex ckpt export", "no output directory", "add --hf OUT (a local directory)")
    result = export_hf(args.uri, args.hf, step=args.step, shard_bytes=parse_size(args.shard_size),
                       overwrite=args.overwrite)
    print("\n".join(result.lines()))
    return 0
