"""`rayflex report` and goodput, on a synthetic run directory (no Ray).

The timeline: 30 steps at world size 4 with checkpoints at 10 and 20, a preemption notice,
the node lost at step 30, a restart at world size 2 from the step-20 checkpoint (steps
21..30 redone), a stop at step 40, then a resubmission that resumes from 40 and finishes
at 50. Every step takes 1 s.
"""

import json

import pytest

from rayflex.cli.main import main
from rayflex.telemetry.goodput import goodput, goodput_breakdown
from rayflex.telemetry.report import MARKER_KINDS, write_report

T0 = 1_700_000_000.0


def _step(step, t, ws, loss=None):
    return {"step": step, "loss": loss if loss is not None else 5.5 - 0.08 * step, "step_time_s": 1.0,
            "tokens_per_s": 1024.0 * ws, "lr": 1e-3, "grad_norm": 1.0, "world_size": ws, "time": T0 + t}


def _ev(kind, t, step=None, **kw):
    return {"kind": kind, "time": T0 + t, "step": step, **kw}


def synthetic_run():
    metrics, events = [], []
    events += [_ev("run_started", 0, 0, name="synth", target_steps=50),
               _ev("plan_chosen", 5, world_size=4, pp=1, dp=4),
               _ev("workers_started", 5, 0, world_size=4, setup_s=5.0)]
    metrics += [_step(s, 5 + s, 4) for s in range(1, 31)]                       # t = 6 .. 35
    events += [_ev("checkpoint_committed", 15.2, 10, blocked_s=0.2),
               _ev("checkpoint_committed", 25.2, 20, blocked_s=0.2),
               _ev("preemption_notice", 33, 28, node_id="n1", source="ray_drain"),
               _ev("node_lost", 36, 31, node_id="n1", ranks=[2, 3]),
               _ev("restarted", 37, 20, world_size=2, from_step=20, reason="node lost"),
               _ev("plan_chosen", 40, world_size=2, pp=1, dp=2),
               _ev("checkpoint_loaded", 40, 20, world_size=2, saved_world_size=4),
               _ev("workers_started", 40, 20, world_size=2, setup_s=3.0)]
    metrics += [_step(s, 40 + (s - 20), 2) for s in range(21, 41)]              # t = 41 .. 60
    events += [_ev("checkpoint_committed", 50.2, 30, blocked_s=0.1),
               _ev("checkpoint_committed", 60.5, 40, blocked_s=0.1, reason="stop"),
               _ev("run_stopped", 61, 40, reason="stopped by user"),
               # second driver session, 39 s later: resumes from 40
               _ev("run_started", 100, 40, name="synth", target_steps=50),
               _ev("plan_chosen", 105, world_size=2, pp=1, dp=2),
               _ev("checkpoint_loaded", 105, 40, world_size=2, saved_world_size=2),
               _ev("workers_started", 105, 40, world_size=2, setup_s=5.0)]
    metrics += [_step(s, 105 + (s - 40), 2) for s in range(41, 51)]             # t = 106 .. 115
    events += [_ev("checkpoint_committed", 115.5, 50, blocked_s=0.1, reason="final"),
               _ev("run_finished", 116, 50)]
    return metrics, events


@pytest.fixture
def run_dir(tmp_path):
    metrics, events = synthetic_run()
    d = tmp_path / "runs" / "synth"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (d / "result.json").write_text(json.dumps({"name": "synth", "status": "finished", "steps_completed": 50,
                                               "target_steps": 50}))
    return d


def test_goodput_counts_only_the_committed_final_history():
    metrics, events = synthetic_run()
    g = goodput_breakdown(metrics, events)
    # Wall: two sessions, 0..61 and 100..116 (the 39 s without a driver do not count).
    assert g.sessions == 2
    assert g.wall_s == pytest.approx(61 + 16)
    # Steps 21..30 of the first pass were rolled back by the restart; 50 steps survive.
    assert g.rolled_back_s == pytest.approx(10)
    assert g.useful_s == pytest.approx(50)
    assert goodput(metrics, events) == pytest.approx(50 / 77)


def test_goodput_of_a_failed_run_stops_at_its_last_checkpoint():
    metrics = [_step(s, s, 2) for s in range(1, 26)]
    events = [_ev("run_started", 0, 0), _ev("workers_started", 0, 0),
              _ev("checkpoint_committed", 20.5, 20), _ev("run_failed", 26, 25, reason="worker died")]
    g = goodput_breakdown(metrics, events)
    assert g.committed_step == 20
    assert g.useful_s == pytest.approx(20) and g.uncommitted_s == pytest.approx(5)
    assert g.value == pytest.approx(20 / 26)
    assert goodput([], []) == 0.0


def test_report_cli_draws_every_event(run_dir, tmp_path, capsys):
    from matplotlib.image import imread

    out = tmp_path / "out"
    rc = main(["report", "synth", "--storage", f"file://{run_dir.parent}", "--out", str(out)])
    assert rc == 0
    assert "report.png" in capsys.readouterr().out

    png = out / "report.png"
    assert png.stat().st_size > 30_000
    img = imread(str(png))
    assert img.shape[0] >= 600 and img.shape[1] >= 800
    gray = img[..., :3].mean(axis=2)
    assert gray.std() > 0.05                       # not a blank canvas
    assert (gray < 0.9).mean() > 0.02              # ink: curves, markers, text

    summary = json.loads((out / "report.json").read_text())
    _, events = synthetic_run()
    expected = sum(e["kind"] in MARKER_KINDS for e in events)
    assert expected == 11
    assert summary["markers"] == expected
    assert summary["marker_kinds"] == {"checkpoint_committed": 5, "checkpoint_loaded": 2, "preemption_notice": 1,
                                       "node_lost": 1, "restarted": 1, "run_stopped": 1}
    assert summary["rolled_back_points"] == 10
    assert summary["goodput"] == pytest.approx(50 / 77)

    page = (out / "report.html").read_text()
    assert f'data-markers="{expected}"' in page
    assert "data:image/png;base64," in page
    assert "goodput" in page.lower()


def test_write_report_defaults_to_the_run_directory(run_dir):
    png, page = write_report(f"file://{run_dir}")
    assert png == f"file://{run_dir}/report.png" and page == f"file://{run_dir}/report.html"
    assert (run_dir / "report.png").stat().st_size > 30_000


def test_report_of_a_missing_run_says_where_it_looked(tmp_path, capsys):
    rc = main(["report", "nope", "--storage", f"file://{tmp_path}"])
    assert rc == 2
    assert "not a rayflex run directory" in capsys.readouterr().err


def test_status_reads_runs_without_a_driver_from_their_directories(run_dir, tmp_path):
    from rayflex.telemetry.status import finished_runs

    # A second run whose driver died mid-way: events and metrics, no result.json.
    dead = run_dir.parent / "killed"
    dead.mkdir()
    (dead / "events.jsonl").write_text(json.dumps(_ev("run_started", 0, 0, target_steps=100)) + "\n"
                                       + json.dumps(_ev("checkpoint_committed", 5.5, 5)) + "\n")
    (dead / "metrics.jsonl").write_text("".join(json.dumps(_step(s, s, 2)) + "\n" for s in range(1, 8)))
    (run_dir.parent / "not-a-run").mkdir()

    rows = {r["name"]: r for r in finished_runs(f"file://{run_dir.parent}")}
    assert set(rows) == {"synth", "killed"}
    assert rows["synth"]["state"] == "FINISHED" and rows["synth"]["goodput"] == pytest.approx(50 / 77)
    assert rows["killed"]["state"] == "NO DRIVER"
    assert rows["killed"]["step"] == 7 and rows["killed"]["target_steps"] == 100
    assert rows["killed"]["last_checkpoint"]["step"] == 5
    assert rows["killed"]["goodput"] == pytest.approx(5 / 7)


def test_a_newer_event_kind_is_listed_but_changes_nothing_drawn(run_dir, tmp_path):
    """A run directory written by a newer rayflex (a kind this version does not know):
    the same markers, goodput and status, and the event table lists the new line."""
    before = tmp_path / "before"
    write_report(f"file://{run_dir}", str(before))
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(_ev("elastic_resize_planned", 45, 25, target=4, why="capacity returned")) + "\n")
    after = tmp_path / "after"
    write_report(f"file://{run_dir}", str(after))

    old, new = (json.loads((d / "report.json").read_text()) for d in (before, after))
    assert {k: v for k, v in new.items() if k not in ("png", "html")} == \
        {k: v for k, v in old.items() if k not in ("png", "html")}
    assert new["markers"] == 11 and new["goodput"] == pytest.approx(50 / 77)
    page = (after / "report.html").read_text()
    assert "<td>elastic_resize_planned</td><td>25</td><td>target=4 why=capacity returned</td>" in page

    from rayflex.telemetry.status import row_from_run_dir

    row = row_from_run_dir(f"file://{run_dir}")
    assert row["state"] == "FINISHED" and row["goodput"] == pytest.approx(50 / 77)


def test_a_diagnosed_hang_is_marked_and_its_verdict_and_table_are_in_the_report(run_dir, tmp_path):
    verdict = "rank 2 is not responding; ranks 0, 1, 3 wait in all_gather #85 of the dp group (ranks 0-3)"
    table = [{"rank": r, "step": 6, "phase": "forward_backward", "last_completed": 84,
              "at": "waits in all_gather(float[1280])"} for r in (0, 1, 3)]
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(_ev("hang_detected", 34, 29, ranks=[2], phases={"2": "unresponsive"})) + "\n")
        f.write(json.dumps(_ev("hang_diagnosed", 34.5, 29, verdict=verdict, diagnosis="not_responding", ranks=[2],
                               group="dp", members=[0, 1, 2, 3], op="all_gather", seq=85, table=table)) + "\n")
    out = tmp_path / "out"
    assert main(["report", "synth", "--storage", f"file://{run_dir.parent}", "--out", str(out)]) == 0
    summary = json.loads((out / "report.json").read_text())
    assert summary["marker_kinds"]["hang_diagnosed"] == 1
    assert summary["hang_diagnosis"] == f"step 29: {verdict}"
    page = (out / "report.html").read_text()
    assert "Hang diagnosed at step 29" in page and verdict in page and "waits in all_gather(float[1280])" in page
