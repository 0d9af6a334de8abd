"""NoticePolicy: what a spot notice for a node of the running attempt leads to, from the
time left and the time an emergency checkpoint needs (a step, the save, the margin)."""

import pytest

from rayflex.faults.policy import NoticePolicy

TIMES = dict(needed_s=10.0, step_s=1.0, save_s=4.0, margin_s=5.0, committed_step=40, node_id="node-b-0123456789")


@pytest.mark.parametrize("ranks, left, saving, action, joins, says", [
    ([], 60.0, False, "no_workers", False, "no worker on the node"),
    ([2, 3], 10.0, False, "emergency_checkpoint", False, "10.0s left >= 10.0s needed (a step 1.00s + checkpoint "
                                                         "4.00s + margin 5.0s)"),
    ([2, 3], 30.0, True, "emergency_checkpoint", True, "joins the emergency checkpoint already under way"),
    ([2, 3], 9.9, False, "restore_last_committed", False, "only 9.9s left, an emergency checkpoint needs 10.0s: "
                                                          "restoring the last committed checkpoint (step 40) "
                                                          "without node node-b-01234"),
    # too short beside a save under way: that save cannot finish before the node goes either
    ([2, 3], 3.0, True, "restore_last_committed", False, "only 3.0s left"),
])
def test_a_notice_is_decided_from_the_time_left_and_the_time_a_save_needs(ranks, left, saving, action, joins, says):
    decision = NoticePolicy().decide(ranks=ranks, seconds_left=left, saving=saving, **TIMES)
    assert (decision.action, decision.joins) == (action, joins) and says in decision.reason
