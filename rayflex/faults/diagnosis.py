"""Name the deadlock: which rank, group and collective a hang is about.

A plain function over every live rank's flight record (``worker.status.FlightRecord``:
the rank's recent collectives, numbered per process group as torch numbers them), so the
verdict can be tested without Ray or torch. Per group instance (its role in the mesh and
its members), the collective the group is stuck at is the lowest sequence number some
member has not completed; what each member did at that number says what went wrong:

* ``not_responding``: members that did not answer the investigation (a frozen process);
* ``op_mismatch``: members issued different ops at that number (one broadcasts where the
  others all-reduce); when the odd op is the one the others issue *after* theirs, the
  rank skipped a collective (``missing``);
* ``size_mismatch``: the same op with other shapes or dtypes;
* ``missing``: a member never entered it while the others wait (it skipped it, or went on
  to another group's collective);
* ``behind``: a member has not reached it yet and waits in no collective (still computing);
* ``p2p_mismatch``: in a point-to-point group, a rank waits for a message its peer never
  sent (the peer sent fewer than it receives);
* ``all_waiting``: every member waits in the same collective with the same arguments: the
  program agrees, so the network or a peer's transport is at fault;
* ``unknown``: no record to judge by.

Several groups may look stuck at once (a rank that skipped a dp collective waits alone in
a world one); the cause is the group whose stuck collective was issued first.
``program_level`` verdicts (mismatches, a missing collective) repeat identically after a
restart: the failure policy fails the run with the verdict instead of looping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from rayflex.worker.status import CollectiveEntry, FlightRecord

PROGRAM_LEVEL = frozenset({"op_mismatch", "size_mismatch", "missing", "p2p_mismatch"})


@dataclass(frozen=True)
class Diagnosis:
    """The verdict: ``kind`` (see the module docstring), one ``sentence``, the ranks at
    fault, the group and collective, and a table row per member of that group."""

    kind: str
    sentence: str
    ranks: tuple = ()
    group: str = ""
    members: tuple = ()
    op: str = ""
    seq: int = 0
    table: tuple = ()

    @property
    def program_level(self) -> bool:
        return self.kind in PROGRAM_LEVEL

    def signature(self) -> str:
        """What stays the same when the same bug hangs the same step again (no sequence
        numbers or times, which depend on the attempt)."""
        return f"{self.kind} in {self.group} {self.op} by ranks {list(self.ranks)}"


@dataclass
class _Finding:
    diagnosis: Diagnosis
    issued: float  # when the stuck collective was first issued (the earliest is the cause)


@dataclass
class _GroupView:
    label: str
    members: tuple
    p2p: bool
    entries: dict = field(default_factory=dict)  # rank -> {seq: CollectiveEntry}


def diagnose(records: dict[int, FlightRecord], world_size: int, silent: Iterable[int] = ()) -> Diagnosis:
    """The verdict for a hang, from the records of the ranks that answered. ``silent``:
    ranks that did not answer (also every rank of ``range(world_size)`` missing from
    ``records``)."""
    silent = set(silent) | {r for r in range(world_size) if r not in records}
    usable = {r: rec for r, rec in records.items() if rec.available}
    if not usable:
        why = "; ".join(sorted({rec.error for rec in records.values() if rec.error})) or "no rank answered"
        if silent:
            return Diagnosis(kind="not_responding", sentence=f"{_are(silent)} not responding; no flight record "
                             f"to say more ({why})", ranks=tuple(sorted(silent)))
        return Diagnosis(kind="unknown", sentence=f"no flight record to diagnose the hang by ({why})")
    views = _views(usable)
    deviations = [d for r in sorted(usable) for d in [_deviation(usable[r])] if d is not None]
    if deviations:
        # A rank whose collectives this step differ from its previous step's changed its
        # program (skipped one, called another, passed other sizes): it is the cause, and
        # its peers' waits are consequences. The earliest change is the first cause.
        return _deviation_verdict(min(deviations, key=lambda d: d[0].started), views, usable, silent)
    findings = [f for view in views for f in [_examine(view, usable, silent)] if f is not None]
    if not findings:
        if silent:
            return Diagnosis(kind="not_responding", ranks=tuple(sorted(silent)),
                             sentence=f"{_are(silent)} not responding; the others wait in no collective",
                             table=_phase_table(usable, silent))
        return Diagnosis(kind="unknown", sentence="no rank waits in a collective: the hang is outside "
                         "communication (data loading, a lock, the host)", table=_phase_table(usable, silent))
    # A finding that names a cause beats "everyone waits" (a group whose members all wait
    # on a peer stuck elsewhere); among those, the collective issued first is the cause.
    return min(findings, key=lambda f: (f.diagnosis.kind == "all_waiting", f.issued)).diagnosis


# ----------------------------------------------------------------- per rank
# Excluded from the step-to-step comparison: the checkpoint group's collectives run on a
# background thread, in whichever steps a save happens.
_UNCOMPARED = frozenset({"checkpoint"})


def _sig(e: CollectiveEntry) -> tuple:
    return (e.group, e.members, e.p2p, e.op, e.sizes, e.dtypes)


def _deviation(record: FlightRecord) -> Optional[tuple]:
    """Where ``record``'s rank stopped doing what it did the step before: (the entry that
    differs or follows the gap, the expected entry, how) or None. Every step of a training
    loop issues the same collectives in the same order, so the latest step must be a
    prefix of the one before and every finished step equal to the one before. The first
    step of an attempt is no reference (a pipeline infers shapes in it)."""
    entries = [e for e in record.entries if e.group not in _UNCOMPARED]
    steps = sorted({e.step for e in entries if e.step > 0})
    if len(steps) < 3:
        return None
    by_step = {k: sorted((e for e in entries if e.step == k), key=lambda e: e.started) for k in steps}
    for prev, now in zip(steps[1:], steps[2:]):
        if now != prev + 1:
            continue
        expected, got = by_step[prev], by_step[now]
        latest = now == steps[-1]
        for i, e in enumerate(got):
            if i >= len(expected):
                return e, None, "extra", now
            if _sig(e) != _sig(expected[i]):
                if i + 1 < len(expected) and _sig(e) == _sig(expected[i + 1]):
                    return e, expected[i], "skipped", now
                if (e.group, e.members, e.op) == (expected[i].group, expected[i].members, expected[i].op):
                    return e, expected[i], "sizes", now
                return e, expected[i], "op", now
        if not latest and len(got) < len(expected):
            # A finished step that issued fewer: it skipped the rest and went on.
            nxt = by_step.get(now + 1, [])
            return (nxt[0] if nxt else got[-1] if got else expected[len(got)]), expected[len(got)], "skipped", now
    return None


def _skipped_seq(record: FlightRecord, expected: CollectiveEntry, after: CollectiveEntry) -> int:
    """The number the skipped op would have had in its group: one past the rank's last op
    there before ``after`` (the op it went on to)."""
    key = (expected.group, expected.members, expected.p2p)
    done = [x.seq for x in record.entries if (x.group, x.members, x.p2p) == key and x.started < after.started]
    return max(done, default=0) + 1


def _deviation_verdict(deviation: tuple, views, records, silent) -> Diagnosis:
    e, expected, how, step = deviation
    rank = next(r for r, rec in records.items() if any(x is e for x in rec.entries))
    group_of = expected or e
    where = _describe_group(group_of.group, group_of.members)
    view = next((v for v in views if (v.label, v.members, v.p2p) == (group_of.group, group_of.members, group_of.p2p)),
                None)
    stuck: dict[tuple, list[int]] = {}
    for r, by_seq in sorted(view.entries.items() if view else ()):
        pending = [x for x in by_seq.values() if not x.completed]
        if r != rank and pending:
            first = min(pending, key=lambda x: x.seq)
            stuck.setdefault((first.op, first.seq), []).append(r)
    peers = "".join(f"; {_wait(rs)} in {op} #{seq} of {where}" for (op, seq), rs in stuck.items())
    if silent & set(group_of.members):
        peers += f"; {_are(sorted(silent & set(group_of.members)))} not responding"
    if how == "skipped":
        kind = "p2p_mismatch" if expected.p2p else "missing"
        seq = _skipped_seq(records[rank], expected, e)
        went = f"{e.op} #{e.seq} of {_group_name_of(e)}"
        sentence = (f"rank {rank} skipped {expected.op} #{seq} of {where} in step {step}: it went on to "
                    f"{went}, which follows it in step {step - 1}" + peers)
        if expected.p2p and expected.op == "send":
            sentence = (f"rank {rank} sent one message too few in {where} in step {step}: it went on to {went} "
                        f"where step {step - 1} sent one more" + peers)
        return Diagnosis(kind=kind, sentence=sentence, ranks=(rank,), group=expected.group, members=expected.members,
                         op=expected.op, seq=seq, table=_table(view, seq, records, silent))
    if how == "sizes":
        sentence = (f"rank {rank} passed {_args((e.op, e.sizes, e.dtypes))} to {e.op} #{e.seq} of {where} in step "
                    f"{step}, {_args((expected.op, expected.sizes, expected.dtypes))} at the same point of step "
                    f"{step - 1}" + _others_at(view, e, rank) + peers)
        return Diagnosis(kind="size_mismatch", sentence=sentence, ranks=(rank,), group=e.group, members=e.members,
                         op=e.op, seq=e.seq, table=_table(view, e.seq, records, silent))
    if how == "op":
        sentence = (f"rank {rank} called {e.op} #{e.seq} of {_group_name_of(e)} in step {step} where it called "
                    f"{expected.op} of {where} in step {step - 1}" + _others_at(view, e, rank) + peers)
        return Diagnosis(kind="op_mismatch", sentence=sentence, ranks=(rank,), group=e.group, members=e.members,
                         op=e.op, seq=e.seq, table=_table(view, e.seq, records, silent))
    sentence = f"rank {rank} issued {e.op} #{e.seq} of {_group_name_of(e)} beyond what step {step - 1} issued" + peers
    return Diagnosis(kind="op_mismatch", sentence=sentence, ranks=(rank,), group=e.group, members=e.members, op=e.op,
                     seq=e.seq, table=_table(view, e.seq, records, silent))


def _others_at(view: Optional["_GroupView"], e: CollectiveEntry, rank: int) -> str:
    """", where ranks 0, 2 called all_reduce(float[4])" for the peers' op at the same number."""
    if view is None:
        return ""
    sigs: dict[tuple, list[int]] = {}
    for r, by_seq in sorted(view.entries.items()):
        if r != rank and e.seq in by_seq:
            x = by_seq[e.seq]
            sigs.setdefault((x.op, x.sizes, x.dtypes), []).append(r)
    return "".join(f", where {_ranks(rs)} called {_call(sig)}" for sig, rs in sigs.items())


def _table(view: Optional["_GroupView"], seq: int, records, silent) -> tuple:
    if view is None:
        return _phase_table(records, silent)
    if view.p2p:
        return tuple(_p2p_row(r, view, records, silent) for r in view.members)
    return tuple(_row(r, view, seq, records, silent) for r in view.members)


# ----------------------------------------------------------------- per group
def _views(records: dict[int, FlightRecord]) -> list[_GroupView]:
    views: dict[tuple, _GroupView] = {}
    for rank, rec in records.items():
        for e in rec.entries:
            key = (e.group, tuple(e.members), e.p2p)
            view = views.setdefault(key, _GroupView(e.group, tuple(e.members), e.p2p))
            view.entries.setdefault(rank, {})[e.seq] = e
    return list(views.values())


def _examine(view: _GroupView, records: dict[int, FlightRecord], silent: set[int]) -> Optional[_Finding]:
    pending = {r: min(s for s, e in by_seq.items() if not e.completed)
               for r, by_seq in view.entries.items() if any(not e.completed for e in by_seq.values())}
    if not pending:
        return None
    if view.p2p:
        return _examine_p2p(view, pending, records, silent)
    seq = min(pending.values())
    at_seq = {r: by_seq[seq] for r, by_seq in view.entries.items() if seq in by_seq}
    waiting = sorted(r for r in pending if pending[r] == seq)
    issued = min(at_seq[r].started for r in waiting)
    first = at_seq[waiting[0]]
    where = _group_name(view)
    members_silent = sorted(set(view.members) & silent)
    # The table: what every member did at the stuck number.
    table = tuple(_row(r, view, seq, records, silent) for r in view.members)

    def verdict(kind, ranks, sentence, op=first.op):
        return _Finding(Diagnosis(kind=kind, sentence=sentence, ranks=tuple(sorted(ranks)), group=view.label,
                                  members=view.members, op=op, seq=seq, table=table), issued)

    # Different ops or arguments at the same number (completed or not: a broadcast may
    # "complete" on bytes that were meant for an all-reduce).
    signatures: dict[tuple, list[int]] = {}
    for r, e in sorted(at_seq.items()):
        signatures.setdefault((e.op, e.sizes, e.dtypes), []).append(r)
    if len(signatures) > 1:
        (major_sig, major), *rest = sorted(signatures.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        odd = sorted(r for _, ranks in rest for r in ranks)
        odd_sig = rest[0][0]
        if _follows(view, major, major_sig, odd_sig):
            return verdict("missing", odd, f"{_ranks(odd)} skipped {major_sig[0]} #{seq} of {where}: "
                           f"{_it(odd)} issued {_call(odd_sig)}, which the others issue after it; "
                           f"{_wait(major)} in {_call(major_sig)} #{seq}", op=major_sig[0])
        if odd_sig[0] != major_sig[0]:
            # ``op``: what the odd rank called, as the step-to-step comparison names it.
            return verdict("op_mismatch", odd, f"{_ranks(odd)} called {odd_sig[0]} #{seq} of {where} where "
                           f"{_ranks(major)} called {major_sig[0]}", op=odd_sig[0])
        return verdict("size_mismatch", odd, f"{_ranks(odd)} passed {_args(odd_sig)} to {major_sig[0]} #{seq} of "
                       f"{where} where {_ranks(major)} passed {_args(major_sig)}", op=major_sig[0])
    if members_silent:
        return verdict("not_responding", members_silent, f"{_are(members_silent)} not responding; "
                       f"{_wait(waiting)} in {first.op} #{seq} of {where}")
    absent = sorted(r for r in view.members if r not in at_seq and r in records)
    if absent:
        # Never entered: waiting elsewhere (skipped it or went on), or still computing.
        elsewhere = {r: _waits_in(records[r], exclude=view) for r in absent}
        moved_on = sorted(r for r in absent if elsewhere[r] is not None)
        if moved_on:
            r = moved_on[0]
            e = elsewhere[r]
            return verdict("missing", moved_on, f"{_ranks(moved_on)} never entered {first.op} #{seq} of {where} "
                           f"that {_ranks(waiting)} wait in; {_it(moved_on)} went on to {e.op} #{e.seq} of "
                           f"{_group_name_of(e)}")
        behind = {r: seq - 1 - max((s for s, e in view.entries.get(r, {}).items() if e.completed), default=0)
                  for r in absent}
        slow = sorted(absent)
        n = max(behind.values())
        phases = ", ".join(f"rank {r} in {records[r].phase} at step {records[r].step}" for r in slow)
        return verdict("behind", slow, f"{_are(slow)} behind by {n} collective{'s' if n != 1 else ''} in "
                       f"{where} ({phases}); {_wait(waiting)} in {first.op} #{seq}")
    return verdict("all_waiting", [], f"every rank of {where} waits in {first.op} #{seq} with the same "
                   f"arguments: the program agrees, the transport does not (a network or peer problem)")


def _examine_p2p(view: _GroupView, pending: dict[int, int], records, silent) -> Optional[_Finding]:
    """Point-to-point: a rank waits in a recv whose message its peer never sent."""
    where = _group_name(view)
    issued = min(view.entries[r][s].started for r, s in pending.items())
    members_silent = sorted(set(view.members) & silent)
    table = tuple(_p2p_row(r, view, records, silent) for r in view.members)
    if members_silent:
        waiting = sorted(pending)
        return _Finding(Diagnosis(kind="not_responding", ranks=tuple(members_silent), group=view.label,
                                  members=view.members, op="recv", table=table,
                                  sentence=f"{_are(members_silent)} not responding; {_wait(waiting)} in "
                                           f"point-to-point ops of {where}"), issued)
    blocked = sorted(r for r, s in pending.items() if view.entries[r][s].op == "recv")
    # The rank that changed its program: this step it sent fewer messages than in the
    # step before (every step of a pipeline schedule sends the same). Its peers' waits are
    # consequences.
    for r in view.members:
        changed = _changed_program(view, r)
        if changed is not None and any(b != r for b in blocked):
            step, sent_now, sent_before = changed
            waiter = next(b for b in blocked if b != r)
            e = view.entries[waiter][pending[waiter]]
            return _Finding(Diagnosis(
                kind="p2p_mismatch", ranks=(r,), group=view.label, members=view.members, op="send", seq=e.seq,
                table=table, sentence=f"rank {r} sent {sent_now} messages in step {step} of {where} where it sent "
                                      f"{sent_before} in step {step - 1} ({sent_before - sent_now} too few); rank "
                                      f"{waiter} waits in recv #{e.seq} for one that never comes"), issued)
    # No earlier step to compare with: a receiver expecting more than its peer sent.
    sends = {r: sum(1 for e in view.entries.get(r, {}).values() if e.op == "send") for r in view.members}
    recvs = {r: sum(1 for e in view.entries.get(r, {}).values() if e.op == "recv") for r in view.members}
    if len(view.members) == 2 and blocked:
        a, b = view.members
        shorts = [(recvs[rx] - sends[tx], rx, tx) for rx, tx in ((a, b), (b, a))
                  if rx in blocked and sends[tx] < recvs[rx]]
        if len(shorts) == 1:
            short, receiver, sender = shorts[0]
            e = view.entries[receiver][pending[receiver]]
            return _Finding(Diagnosis(
                kind="p2p_mismatch", ranks=(sender,), group=view.label, members=view.members, op="send",
                seq=e.seq, table=table,
                sentence=f"rank {receiver} waits in recv #{e.seq} of {where} for a message rank {sender} "
                         f"never sent: rank {sender} sent {sends[sender]}, rank {receiver} receives "
                         f"{recvs[receiver]} ({short} too few sent)"), issued)
    waiting = sorted(pending)
    return _Finding(Diagnosis(kind="all_waiting", ranks=(), group=view.label, members=view.members, op="p2p",
                              table=table, sentence=f"{_wait(waiting)} in point-to-point ops of {where} "
                                                    "whose counts match: a transport problem"), issued)


# ----------------------------------------------------------------- helpers
def _follows(view: _GroupView, major: list[int], major_sig: tuple, odd_sig: tuple) -> bool:
    """Whether, in a majority rank's own history, ``odd_sig``'s op comes right after
    ``major_sig``'s: the odd rank is one collective ahead (it skipped the majority's)."""
    history = view.entries.get(major[0], {})
    return any(e.completed and (e.op, e.sizes, e.dtypes) == major_sig
               and s + 1 in history and (history[s + 1].op, history[s + 1].sizes, history[s + 1].dtypes) == odd_sig
               for s, e in history.items())


def _step_ops(view: _GroupView, rank: int) -> tuple[int, list, Optional[list]]:
    """``rank``'s ops in this group in its latest step and in the step before (None when
    the ring does not hold that step whole), in issue order."""
    by_seq = view.entries.get(rank, {})
    if not by_seq:
        return 0, [], None
    now = max(e.step for e in by_seq.values())
    ops_now = [by_seq[s] for s in sorted(by_seq) if by_seq[s].step == now]
    before = [by_seq[s] for s in sorted(by_seq) if by_seq[s].step == now - 1]
    # A step whose first op fell out of the ring would look short: it counts when the
    # ring still holds the group's first op, or an op before that step's first.
    whole = bool(before) and (min(by_seq) <= 1 or before[0].seq > min(by_seq))
    return now, ops_now, before if whole else None


def _changed_program(view: _GroupView, rank: int) -> Optional[tuple[int, int, int]]:
    """(step, sent now, sent before) when ``rank`` sent fewer messages this step than in
    the step before *and* its ops are not a prefix of that step's (it skipped one and
    went on; a rank that is merely stuck partway through is a prefix)."""
    step, now, before = _step_ops(view, rank)
    if before is None:
        return None
    sig = [(e.op, e.sizes, e.dtypes) for e in now]
    prev = [(e.op, e.sizes, e.dtypes) for e in before]
    sent_now, sent_before = sum(1 for e in now if e.op == "send"), sum(1 for e in before if e.op == "send")
    if sent_now < sent_before and sig != prev[:len(sig)]:
        return step, sent_now, sent_before
    return None


def _waits_in(record: FlightRecord, exclude: _GroupView) -> Optional[CollectiveEntry]:
    pending = [e for e in record.entries if not e.completed
               and (e.group, tuple(e.members), e.p2p) != (exclude.label, exclude.members, exclude.p2p)]
    return min(pending, key=lambda e: e.started) if pending else None


def _row(rank: int, view: _GroupView, seq: int, records, silent) -> dict:
    rec = records.get(rank)
    if rank in silent or rec is None:
        return {"rank": rank, "step": None, "phase": "not responding", "last_completed": None, "at": "?"}
    by_seq = view.entries.get(rank, {})
    done = max((s for s, e in by_seq.items() if e.completed), default=0)
    e = by_seq.get(seq)
    if e is None:
        other = _waits_in(rec, view)
        at = f"never entered (waits in {other.op} #{other.seq} of {_group_name_of(other)})" if other else \
            "never entered"
    else:
        at = f"{'done' if e.completed else 'waits in'} {_call((e.op, e.sizes, e.dtypes))}"
    return {"rank": rank, "step": rec.step, "phase": rec.phase, "last_completed": done, "at": at}


def _p2p_row(rank: int, view: _GroupView, records, silent) -> dict:
    rec = records.get(rank)
    if rank in silent or rec is None:
        return {"rank": rank, "step": None, "phase": "not responding", "sent": None, "received": None, "at": "?"}
    by_seq = view.entries.get(rank, {})
    pending = [e for e in by_seq.values() if not e.completed]
    at = ", ".join(f"waits in {e.op} #{e.seq}" for e in sorted(pending, key=lambda e: e.seq)) or "idle"
    return {"rank": rank, "step": rec.step, "phase": rec.phase,
            "sent": sum(1 for e in by_seq.values() if e.op == "send"),
            "received": sum(1 for e in by_seq.values() if e.op == "recv"), "at": at}


def _phase_table(records, silent) -> tuple:
    rows = [{"rank": r, "step": rec.step, "phase": rec.phase} for r, rec in sorted(records.items())]
    rows += [{"rank": r, "step": None, "phase": "not responding"} for r in sorted(silent)]
    return tuple(sorted(rows, key=lambda row: row["rank"]))


def _group_name(view: _GroupView) -> str:
    return _describe_group(view.label, view.members)


def _group_name_of(e: CollectiveEntry) -> str:
    return _describe_group(e.group, e.members)


def _describe_group(label: str, members: tuple) -> str:
    return f"the {label} group ({_span(members)})"


def _span(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _ranks(ranks) -> str:
    return _span(ranks)


def _are(ranks) -> str:
    """"rank 3 is" / "ranks 0, 1 are"."""
    ranks = list(ranks)
    return f"{_span(ranks)} {'is' if len(ranks) == 1 else 'are'}"


def _wait(ranks) -> str:
    ranks = list(ranks)
    return f"{_span(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def _it(ranks) -> str:
    return "it" if len(list(ranks)) == 1 else "they"


def _args(sig: tuple) -> str:
    _, sizes, dtypes = sig
    return ", ".join(f"{d}{list(s)}" for s, d in zip(sizes, dtypes)) or "no tensors"


def _call(sig: tuple) -> str:
    return f"{sig[0]}({_args(sig)})"
