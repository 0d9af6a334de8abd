"""The documented `ray job submit` recipe (docs/user_surfaces.md), executed as written.

The bash block is read from docs/user_surfaces.md (not copied here) and its commands are typed, one
by one, into one bash session — in a scratch copy of what a user's checkout holds
(examples/, .gitignore, a .venv whose activate script is this venv's), with a scratch HOME
so the token `ray get-auth-token --generate` writes is its own. Between two commands the
test waits only where a user would: after the first submit, for a few steps to show in
the logs. Ray's default ports (6379, 8265) are used, as in the recipe: this is the one
test that needs them, so it is marked slow (``make test-slow``) and never shares a run
with another Ray head.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent


def readme_job_commands() -> list[str]:
    """The commands of the documented `ray job submit` recipe (continuations joined)."""
    text = (REPO / "docs" / "user_surfaces.md").read_text()
    section = text[text.index("**The recipe**"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


class Shell:
    """One bash session that commands are typed into; each returns (exit code, output)."""

    def __init__(self, cwd: Path, env: dict):
        self.proc = subprocess.Popen(["bash"], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.transcript: list[str] = []

    def run(self, command: str, timeout_s: float) -> tuple[int, str]:
        marker = f"__rc_{time.monotonic_ns()}__"
        self.proc.stdin.write(f"{command}\necho {marker}$?\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"`{command}` still running after {timeout_s}s:\n{''.join(out)[-3000:]}")
            if marker in line:  # output without a final newline (a progress bar) precedes it
                before, _, rc = line.partition(marker)
                out.append(before)
                self.transcript.append(f"$ {command}\n{''.join(out)}")
                return int(rc), "".join(out)
            out.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_the_readme_job_recipe_runs_as_written(tmp_path):
    commands = readme_job_commands()
    assert any(c.startswith("ray start --head") for c in commands) and any(c.startswith("kill $HEAD") for c in commands)
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    home.mkdir()
    shutil.copytree(REPO / "examples", checkout / "examples")
    shutil.copy(REPO / ".gitignore", checkout / ".gitignore")
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "activate").write_text(f". {VENV}/bin/activate\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYFLEX_"))}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    shell = Shell(checkout, env)
    run_dir = checkout / "runs" / "gpt-job"
    head_pid = None
    try:
        for command in commands:
            timeout = 300 if "logs -f" in command else 120
            rc, out = shell.run(command, timeout)
            assert rc == 0, f"`{command}` exited {rc}:\n{out[-3000:]}"
            if command.startswith("HEAD="):
                head_pid = int(shell.run("echo $HEAD", 10)[1].strip())
            if "--submission-id gpt-job-1" in command:
                # a user watches the logs for a while before stopping the job
                deadline = time.monotonic() + 180
                while len(_steps(run_dir)) < 5 and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert len(_steps(run_dir)) >= 5, "the first job trained a few steps"
            if "job stop" in command:
                result = json.loads((run_dir / "result.json").read_text())
                assert result["status"] == "stopped", result
                stopped_at = result["steps_completed"]
        # The second job resumed at the stop checkpoint and ran to the end, every step once.
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "finished" and result["steps_completed"] == 60, result
        assert _steps(run_dir) == list(range(1, 61))
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["kind"] == "checkpoint_loaded"] == [stopped_at]
        assert '"status": "finished"' in shell.transcript[-2], "the followed logs end with the result"
        # `kill $HEAD` stopped the head and everything it started: the process is gone.
        deadline = time.monotonic() + 60
        while _alive(head_pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(head_pid), "the head exited"
        head_pid = None
    finally:
        if head_pid is not None:  # a failed step: stop the head the way the recipe does
            os.kill(head_pid, signal.SIGTERM)
        shell.close()
        (tmp_path / "transcript.txt").write_text("\n".join(shell.transcript))
        print("\n".join(shell.transcript)[-6000:])
