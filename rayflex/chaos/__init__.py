"""``python -m rayflex.chaos``: the chaos runs' command (see ``rayflex.testing.chaos``)."""
