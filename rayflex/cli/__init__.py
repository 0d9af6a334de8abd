"""The ``rayflex`` command line: one module per command; ``main`` dispatches."""

from rayflex.cli.main import main

__all__ = ["main"]
