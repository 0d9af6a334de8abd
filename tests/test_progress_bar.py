"""``handle.wait(progress=True)``'s bar: what a user sees in a terminal, a job log or a
notebook, whether or not a poll caught the run while it was running."""

from __future__ import annotations

import re


class _Handle:
    """A run handle that answers ``statuses`` in turn, then stays on the last one."""

    name = "demo"

    def __init__(self, statuses: list[dict], done_after: int):
        self._statuses, self._polls, self._done_after = statuses, 0, done_after

    def done(self) -> bool:
        return self._polls >= self._done_after

    def status(self) -> dict:
        st = self._statuses[min(self._polls, len(self._statuses) - 1)]
        self._polls += 1
        return st


def _st(state: str, step: int) -> dict:
    return {"state": state, "step": step, "target_steps": 30, "loss": 1.5, "tokens_per_s": 1000.0, "world_size": 2}


def test_the_bar_follows_a_resumed_run_from_the_step_it_resumed_at(capsys):
    from rayflex.api.trainer import _show_progress

    handle = _Handle([_st("PLACING", 12), _st("RUNNING", 12), _st("RUNNING", 20), _st("FINISHED", 30)], done_after=3)
    _show_progress(handle, interval_s=0)
    err = capsys.readouterr().err
    assert "demo: 100%" in err and "30/30" in err
    assert "12/30" in err and not re.search(r"(?<!\d)0/30", err), "it starts at the step the run resumed from"


def test_a_run_that_ended_before_a_poll_saw_it_running_still_ends_with_its_bar(capsys):
    from rayflex.api.trainer import _show_progress

    _show_progress(_Handle([_st("FINISHED", 30)], done_after=0), interval_s=0)
    err = capsys.readouterr().err
    assert "demo: 100%" in err and "30/30" in err


def test_no_bar_when_the_run_cannot_say_where_it_is(capsys):
    from rayflex.api.trainer import _show_progress

    class Gone(_Handle):
        def status(self):
            raise ConnectionError("the controller exited")

    _show_progress(Gone([], done_after=0), interval_s=0)
    assert capsys.readouterr().err == ""
