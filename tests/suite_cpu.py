"""Where the suite's CPU goes: CPU-seconds per test, counting every process the test started.

Opt-in (``make test-cpu``, or ``RAYFLEX_SUITE_CPU=out.json pytest ...``): each pytest(-xdist)
worker moves itself into a cgroup-v1 ``cpuacct`` group of its own before any test runs, so
the Ray daemons, workers and servers it starts are counted with it; ``cpuacct.usage`` is read
around every test phase. A shared cluster's idle CPU between tests lands on the test that runs
while it idles, which is where it is spent. Needs root and ``/sys/fs/cgroup/cpuacct``; without
them the report says so and the tests run as usual. The groups are removed at the end.

The wall time of a suite on a slow host is about its CPU-seconds over the CPUs it gets, plus the
waits that do not shrink (poll intervals, timeouts): so a change's figure is CPU-s saved.
"""

import json
import os
import time

import pytest

ROOT = "/sys/fs/cgroup/cpuacct"
ENV = "RAYFLEX_SUITE_CPU"


class _Account:
    def __init__(self, out: str):
        self.out = out
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.group = f"{ROOT}/rayflex_suite_{os.getpid()}"
        self.rows: list[dict] = []
        self.error = None
        try:
            os.mkdir(self.group)
            with open(f"{self.group}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            self.error = f"no cpuacct group ({e}): needs root and cgroup v1 cpuacct at {ROOT}"
            self.group = None

    def usage_s(self) -> float:
        if self.group is None:
            return 0.0
        with open(f"{self.group}/cpuacct.usage") as f:
            return int(f.read()) / 1e9

    def add(self, nodeid: str, phase: str, cpu_s: float, wall_s: float):
        self.rows.append({"test": nodeid, "phase": phase, "cpu_s": round(cpu_s, 3),
                          "wall_s": round(wall_s, 3)})

    def finish(self):
        path = f"{self.out}.{self.worker}"
        with open(path, "w") as f:
            json.dump({"worker": self.worker, "error": self.error, "rows": self.rows,
                       "total_cpu_s": round(self.usage_s(), 3)}, f)
        if self.group is not None:
            # Processes that outlived the session (none, if every fixture cleaned up) go back.
            try:
                with open(f"{self.group}/cgroup.procs") as f:
                    pids = f.read().split()
                for pid in pids:
                    try:
                        with open(f"{ROOT}/cgroup.procs", "w") as g:
                            g.write(pid)
                    except OSError:
                        pass
                os.rmdir(self.group)
            except OSError:
                pass


_ACCOUNT: _Account | None = None


def pytest_configure(config):
    global _ACCOUNT
    out = os.environ.get(ENV)
    if out and os.environ.get("PYTEST_XDIST_WORKER") is None and config.getoption("numprocesses", None):
        return  # the xdist controller runs no tests: only its workers account
    if out:
        _ACCOUNT = _Account(os.path.abspath(out))


def _timed(phase):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args, **kwargs):
        if _ACCOUNT is None:
            yield
            return
        cpu0, wall0 = _ACCOUNT.usage_s(), time.monotonic()
        yield
        _ACCOUNT.add(item.nodeid, phase, _ACCOUNT.usage_s() - cpu0, time.monotonic() - wall0)
    return hook


pytest_runtest_setup = _timed("setup")
pytest_runtest_call = _timed("call")
pytest_runtest_teardown = _timed("teardown")


@pytest.hookimpl(trylast=True)  # after conftest has closed the shared cluster
def pytest_sessionfinish(session, exitstatus):
    if _ACCOUNT is not None:
        _ACCOUNT.finish()


def report(out: str) -> dict:
    """CPU-s and wall-s per test file over every worker's part (``out.gw0``, ``out.gw1``...)."""
    import glob

    files: dict[str, dict] = {}
    total, errors = 0.0, []
    for path in sorted(glob.glob(f"{out}.*")):
        part = json.load(open(path))
        total += part["total_cpu_s"]
        if part["error"]:
            errors.append(part["error"])
        for row in part["rows"]:
            f = files.setdefault(row["test"].split("::")[0], {"cpu_s": 0.0, "wall_s": 0.0, "tests": set()})
            f["cpu_s"] += row["cpu_s"]
            f["wall_s"] += row["wall_s"]
            f["tests"].add(row["test"])
    by_file = sorted(({"file": k, "cpu_s": round(v["cpu_s"], 1), "wall_s": round(v["wall_s"], 1),
                       "tests": len(v["tests"])} for k, v in files.items()), key=lambda r: -r["cpu_s"])
    return {"total_cpu_s": round(total, 1), "errors": sorted(set(errors)), "by_file": by_file}


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tests/suite_cpu.py OUT   (OUT as given in RAYFLEX_SUITE_CPU)")
    result = report(sys.argv[1])
    print(json.dumps({k: v for k, v in result.items() if k != "by_file"}))
    for row in result["by_file"]:
        print(f"{row['cpu_s']:8.1f} CPU-s {row['wall_s']:8.1f} wall-s {row['tests']:4d} tests  {row['file']}")
