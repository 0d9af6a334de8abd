"""examples/notebook.ipynb runs headless in a real Jupyter kernel (nbclient + ipykernel).

The kernel is this interpreter's: jupyter_client runs a kernelspec whose argv starts with
``python`` with ``sys.executable``, and ipykernel also provides a built-in ``python3``
spec for the running interpreter, so no ``ipykernel install`` is needed (if a machine's
``python3`` spec points elsewhere: ``python -m ipykernel install --sys-prefix``).
The notebook starts and shuts down its own loopback Ray.
"""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


def _texts(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
            elif "data" in o:
                out.append(str(o["data"].get("text/plain", "")))
    return "\n".join(out)


def test_notebook_runs_headless(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_before = dict(os.environ)
    try:
        # The kernel inherits our environment: no cluster address to join by accident, and
        # the fast control-plane knobs of the test suite.
        os.environ.pop("RAY_ADDRESS", None)
        client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = _texts(nb)
    assert "progress: step" in text                      # the live status loop
    assert "notebook-demo: 100%" in text and "120/120" in text  # the progress bar of the resumed run
    assert "stopped: status=stopped" in text
    assert "resumed run: status=finished steps=120" in text
    assert "checkpoint_loaded" in text                   # the event table shows the resume
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2                              # the loss plot and the run report
