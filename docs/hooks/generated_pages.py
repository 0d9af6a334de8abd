"""MkDocs hook: the pages generated from the code and the committed results, so they cannot drift.

* ``reference/cli.md``: every ``rayflex`` command and option, from the argparse parsers
  (``rayflex.cli.main.build_parser``), the same text ``--help`` prints;
* ``benchmarks.md``: ``benchmarks/README.md`` (links rewritten for the site);
* ``benchmark-results.md``: every ``benchmarks/results/*.json`` rendered as tables
  (``benchmarks/tables.py``), and the comparison's ratio table.

Nothing here imports torch or starts Ray.
"""

from __future__ import annotations

import argparse
import glob
import os
import posixpath
import re
import sys

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import tables  # noqa: E402  (benchmarks/tables.py)


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) for the parser and every subparser below it, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, path + (name,))


def cli_reference() -> str:
    from rayflex.cli.main import build_parser

    parser = build_parser()
    out = ["# Command-line reference", "",
           "Generated from the argparse parsers in `rayflex/cli/` when the site is built: the same",
           "text `rayflex COMMAND --help` prints.", ""]
    for path, sub in _subcommands(parser):
        if not path:
            continue
        sub.prog = "rayflex " + " ".join(path)
        out += [f"## `rayflex {' '.join(path)}`", ""]
        if sub.description or sub.format_usage():
            out += ["```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out) + "\n"


def benchmarks_page() -> str:
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        text = f.read()
    text = text.replace("](../docs/", "](")
    return text + ("\n\nEvery committed result, rendered as tables: [Committed results](benchmark-results.md).\n")


def results_page() -> str:
    out = ["# Committed results", "",
           "Every file in `benchmarks/results/`, rendered as tables when the site is built",
           "(`python benchmarks/tables.py results FILE` prints the same). Each was measured on the",
           "machine its `machine` rows name; the ratios against the peers measured in the same run",
           "are what carries to another host.", "",
           "## The comparison, as ratios", "",
           "`benchmarks/results/compare.json` (`make compare`), each peer's figure over rayflex's:", "",
           tables.ratio_table(), ""]
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))):
        name = os.path.basename(path)
        out += [f"## {name}", "", tables.result_tables(path), ""]
    return "\n".join(out) + "\n"


GENERATED = {"reference/cli.md": cli_reference, "benchmarks.md": benchmarks_page,
             "benchmark-results.md": results_page}


def on_files(files, config):
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def on_page_markdown(markdown, page, config, files):
    # the getting-started page marks the blocks the suite runs with an HTML comment: not
    # wanted in the page
    markdown = re.sub(r"^<!-- docs-test: run -->\n", "", markdown, flags=re.M)
    # a link to benchmarks/README.md (right on GitHub) is the generated benchmarks page here
    to_page = posixpath.relpath("benchmarks.md", posixpath.dirname(page.file.src_uri) or ".")
    return re.sub(r"\]\((?:\.\./)+benchmarks/README\.md", "](" + to_page, markdown)
