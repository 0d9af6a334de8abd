"""On a hang or a dead worker: pull every rank's flight record, name the deadlock, and
record the verdict.

Runs in RUNNING right after the detector reports the fault and before the attempt is torn
down (the records are the blocked processes' own). A dead worker is investigated too: on
gloo a collective mismatch often kills a rank outright (a rank that receives more bytes
than it expects aborts), and the survivors' records still say who changed the program.
Not for lost nodes or preemptions (their causes are known, and actors on a lost node may
take seconds to fail a call). The verdict (``faults/diagnosis``)
becomes a ``hang_diagnosed`` event and the fault's cause: the ranks it names are the ones
replaced, and a program-level verdict is what the failure policy compares when the same
step hangs again after a restart.
"""

from __future__ import annotations

import logging
import time

from rayflex.constants import knob
from rayflex.faults.diagnosis import diagnose
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def investigate(ctx, attempt, fault) -> None:
    """Diagnose ``fault`` (a hang or a dead worker) from the ranks' flight records, in place."""
    died = any(isinstance(e, ev.WorkerDied) for e in fault.events)
    lost = any(isinstance(e, ev.NodeLost) for e in fault.events)
    if not (fault.hang or died) or lost or fault.kind == "preemption" or not hasattr(attempt.group, "flight_records"):
        return
    t0 = time.time()
    try:
        # A frozen or dead rank would only make the others wait for the timeout: it is
        # silent anyway.
        gone = frozenset(fault.bad_ranks) if fault.hang == "frozen" or died else frozenset()
        records, silent = attempt.group.flight_records(knob("DIAGNOSIS_TIMEOUT_S"), skip=gone)
    except Exception as e:  # noqa: BLE001 - the diagnosis is a bonus; recovery must go on
        log.warning("could not pull the ranks' flight records: %s", e)
        return
    diagnosis = diagnose(records, attempt.plan.world_size, silent)
    fault.diagnosis = diagnosis
    step = ctx.ledger.step + 1
    ctx.record(ev.HangDiagnosed(step=step, trigger="hang" if fault.hang else "worker_died",
                                verdict=diagnosis.sentence, diagnosis=diagnosis.kind,
                                ranks=list(diagnosis.ranks), group=diagnosis.group, members=list(diagnosis.members),
                                op=diagnosis.op, seq=diagnosis.seq, program_level=diagnosis.program_level,
                                answered=sorted(records), table=[dict(row) for row in diagnosis.table],
                                diagnose_s=time.time() - t0))
    log.warning("%s at step %d diagnosed: %s", "hang" if fault.hang else "worker death", step, diagnosis.sentence)
    if fault.hang == "collective" and diagnosis.ranks:
        # Everyone answered, so the detector could only guess by phase; the records name
        # the rank(s) at fault, and only they need replacing.
        fault.bad_ranks = set(diagnosis.ranks)
    fault.error = f"{fault.error}; diagnosis: {diagnosis.sentence}"
