"""The documentation: the README is the front door, the site builds strictly and renders, and
the getting-started page's code runs.

The site is built the way `make docs` builds it (``mkdocs build --strict``: a broken link, a
page left out of the navigation, a stale API name in the reference or a warning from the
docstrings fails), into a scratch folder, and the built HTML is read back. The code blocks of
docs/getting-started.md marked ``<!-- docs-test: run -->`` run in one namespace, in order, as
a reader would paste them; none of them starts Ray.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import tables  # noqa: E402  (benchmarks/tables.py)

README_LIMIT_BYTES = 12 * 1024
RUN_MARK = "<!-- docs-test: run -->"


def marked_blocks(page: Path) -> list[str]:
    """The fenced Python blocks that directly follow the run mark."""
    return re.findall(re.escape(RUN_MARK) + r"\n```python\n(.*?)```", page.read_text(), re.S)


def test_the_readme_is_short_and_its_table_and_picture_come_from_committed_results():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= README_LIMIT_BYTES
    for needed in ("make demo", "make test", "make docs", "rf.Trainer(", "rayflex run "):
        assert needed in readme
    # the comparison table is the committed result's ratios, not numbers typed in by hand
    assert tables.ratio_table() in readme
    # the picture is the committed chaos run, drawn by the script the README names
    svg = REPO / "docs" / "assets" / "chaos-timeline.svg"
    assert "docs/assets/chaos-timeline.svg" in readme
    assert svg.read_text() == tables.chaos_timeline_svg(), \
        "redraw it: python benchmarks/tables.py timeline --out docs/assets/chaos-timeline.svg"
    # every relative link points at a file of the repository
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_the_site_builds_strictly_and_renders(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]

    home = (site / "index.html").read_text()
    assert re.search(r"<title>rayflex</title>", home)
    nav = home[home.index('class="md-nav'):]
    for entry in ("Getting started", "Concepts", "How-to guides", "Reference", "Benchmarks", "Architecture"):
        assert entry in nav, f"{entry!r} missing from the navigation"
    assert re.search(r'<pre><span></span><code>|<div class="highlight"><pre>', home), "no code block rendered"
    image = re.search(r'<img[^>]+src="([^"]+chaos-timeline\.svg)"', home)
    assert image and (site / image.group(1)).is_file()

    guide = (site / "guides" / "checkpoints" / "index.html").read_text()
    assert re.search(r"<h1[^>]*>Checkpoints: upload, interval, memory replicas, resuming", guide)
    started = (site / "getting-started" / "index.html").read_text()
    assert started.count('class="highlight"') >= 4 and RUN_MARK not in started
    # the references are generated: every subcommand, the public classes and their fields
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("rayflex run", "rayflex plan", "rayflex ckpt", "rayflex data prepare", "--set"):
        assert command in cli
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="rayflex.api.trainer.Trainer"' in api and "preflight" in api
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert 'id="rayflex.config.CheckpointConfig.every_steps"' in config
    results = (site / "benchmark-results" / "index.html").read_text()
    assert "compare.json" in results and "<table>" in results


def test_the_getting_started_code_runs(monkeypatch, tmp_path):
    blocks = marked_blocks(REPO / "docs" / "getting-started.md")
    assert len(blocks) >= 3
    monkeypatch.chdir(REPO)  # the blocks name files as a reader in the checkout would
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    namespace: dict = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, "docs/getting-started.md", "exec"), namespace)  # noqa: S102
    printed = out.getvalue()
    assert "plan: pp=2 x dp=2 = 4 ranks" in printed
    assert "DataConfig.global_batch" in printed and "Fix:" in printed
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized(), "a getting-started block started Ray"
