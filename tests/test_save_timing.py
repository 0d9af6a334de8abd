"""The save-timing policy (``CheckpointConfig.when_busy``): a due save never makes training
wait for the previous upload unless asked to."""

import pytest

import rayflex as rf
from rayflex.errors import ConfigError
from rayflex.checkpoint.save_timing import save_timing


def _timing(**kw):
    args = dict(due=False, required=False, busy=False, pending=False, when_busy="defer")
    return save_timing(**{**args, **kw})


def test_a_due_save_is_taken_on_time_when_the_previous_one_is_written():
    assert _timing(due=True).save and not _timing(due=True).pending
    assert not _timing().save  # nothing due, nothing pending


def test_a_due_save_waits_while_an_upload_runs_then_is_taken_once():
    first = _timing(due=True, busy=True)
    assert not first.save and first.pending and first.deferred_now
    # Still busy: it keeps waiting, the event is not repeated, more due saves join it.
    again = _timing(due=True, busy=True, pending=True)
    assert not again.save and again.pending and not again.deferred_now
    assert _timing(busy=True, pending=True).pending
    # The upload ended: the one save is taken at this boundary.
    done = _timing(pending=True)
    assert done.save and not done.pending


def test_asked_for_saves_and_the_wait_policy_never_defer():
    required = _timing(due=True, required=True, busy=True, pending=True)
    assert required.save and not required.pending  # it serves the pending one too
    wait = _timing(due=True, busy=True, when_busy="wait")
    assert wait.save and not wait.pending


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"when_busy.*unknown policy 'skip'.*defer, wait"):
        rf.CheckpointConfig(when_busy="skip")
