"""The public Python API: Trainer, RunHandle, Result (re-exported by ``rayflex``)."""
