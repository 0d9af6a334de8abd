"""``benchmarks/data.py`` at toy sizes, as CI runs it: its corpus is written as
``fixed_size_list<int32>`` rows, which the zero-copy reader once refused (the committed
data.json predated that, so nothing noticed until a user ran it)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_data_benchmark_runs_at_toy_sizes(tmp_path):
    out = tmp_path / "data.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data.py"), "--shards", "4",
                           "--rows-per-shard", "64", "--seq-len", "32", "--group-rows", "16", "--batch", "16",
                           "--steps", "6", "--step-s", "0.001", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step_s"] == 0.001 and result["global_batch"] == 16 and result["data_wait"]
