"""``rayflex ckpt list|inspect|verify URI``: the committed checkpoints of a run."""

from __future__ import annotations

import sys

from rayflex.errors import RayflexError


def add_subcommand(subparsers) -> None:
    c = subparsers.add_parser("ckpt", help="list, inspect or verify checkpoints")
    c.add_argument("action", choices=("list", "inspect", "verify"))
    c.add_argument("uri", help="checkpoint root, e.g. s3://bucket/runs/NAME/checkpoints")
    c.add_argument("--step", type=int)
    c.set_defaults(func=cmd_ckpt)


def cmd_ckpt(args) -> int:
    from rayflex.storage import manifest as mf

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
