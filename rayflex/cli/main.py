"""``rayflex run | plan | placement | status | report | diagnose | ckpt | data``: one module per command.

SPEC is a Python file (``examples/gpt_small.py``) or ``module:attr`` defining ``trainer``
(a :class:`rayflex.Trainer`, or a function returning one).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from rayflex.cli import ckpt, data, diagnose, plan, report, run, status
from rayflex.errors import RayflexError

COMMANDS = (run, plan, status, report, diagnose, ckpt, data)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayflex", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_subcommand(sub)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except RayflexError as e:
        print(f"rayflex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
