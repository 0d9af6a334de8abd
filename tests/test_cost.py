"""What a run cost and where the money went (rayflex.telemetry.cost), on a timeline whose
dollars are worked out by hand: a spot node lost mid-run, a wait for capacity, a restart
that rolls three steps back, a straggler, two blocking saves."""

import pytest

import rayflex as rf
from rayflex.errors import ConfigError
from rayflex.config import node_price
from rayflex.telemetry.cost import CATEGORIES, cost_breakdown

A, B, C = "node-a", "node-b", "node-c"
PER_S = 3600.0  # a price per hour that costs one dollar a second


def _step(step, end, *, sync_wait=0.0):
    return {"step": step, "time": end, "step_time_s": 1.0, "tokens_per_s": 1000.0, "loss": 1.0,
            "sync_wait_s": sync_wait}


def _timeline():
    """Nodes A ($1/s) and B ($2/s) from t=0; B lost at 16; the restart places on A and C
    ($1/s) from 18 (its setup took 2 s); the run finishes at 26."""
    metrics = [_step(1, 11), _step(2, 12), _step(3, 13.5), _step(4, 14.5), _step(5, 15.5),  # 3-5: rolled back
               _step(3, 22), _step(4, 23, sync_wait=0.25), _step(5, 24, sync_wait=0.25), _step(6, 25, sync_wait=0.25)]
    events = [
        {"kind": "run_started", "time": 0.0, "step": 0, "name": "r", "target_steps": 6},
        {"kind": "plan_chosen", "time": 10.0, "world_size": 4, "rank_to_node": [A, A, B, B],
         "node_prices": {A: PER_S, B: 2 * PER_S}},
        {"kind": "workers_started", "time": 10.0, "step": 0, "world_size": 4, "setup_s": 6.0},
        {"kind": "checkpoint_committed", "time": 12.5, "step": 2, "blocked_s": 0.5},
        {"kind": "node_lost", "time": 16.0, "node_id": B, "ranks": [2, 3]},
        {"kind": "capacity_waited", "time": 19.0, "waited_s": 2.0, "reason": "min_workers=4"},
        {"kind": "plan_chosen", "time": 20.0, "world_size": 4, "rank_to_node": [A, A, C, C],
         "node_prices": {A: PER_S, C: PER_S}},
        {"kind": "checkpoint_loaded", "time": 20.0, "step": 2, "uri": "s3://b/r/step_2"},
        {"kind": "restarted", "time": 20.0, "step": 2, "world_size": 4, "from_step": 2, "lost_steps": 3},
        {"kind": "workers_started", "time": 20.0, "step": 2, "world_size": 4, "setup_s": 2.0},
        {"kind": "straggler_detected", "time": 22.5, "step": 3, "rank": 2, "node_id": C, "ratio": 5.0},
        {"kind": "checkpoint_committed", "time": 25.8, "step": 6, "blocked_s": 0.5, "reason": "final"},
        {"kind": "run_finished", "time": 26.0, "step": 6},
    ]
    return metrics, events


def test_every_second_is_charged_once_at_the_price_of_the_nodes_held_then():
    cost = cost_breakdown(*_timeline())
    assert cost.parts_usd == pytest.approx({
        "setup": 30 + 1,               # [0, 10] at $3/s (A+B), the final [25.5, 26] at $2/s (A+C)
        "training": 6 + 6.5,           # steps 1-2 at $3/s; steps 3-6 again less the waits, 3.25 s at $2/s
        "stragglers": 1.5,             # 3 x 0.25 s waited for the named straggler, at $2/s
        "checkpoint_stalls": 1.5 + 1,  # 0.5 s after step 2 at $3/s, 0.5 s after step 6 at $2/s
        "recomputed": 9,               # steps 3-5 the first time, 3 s at $3/s
        "recovery": 1.5 + 1 + 4,       # [15.5, 16] at $3/s, [16, 17] at $1/s (A alone), [19, 21] at $2/s
        "capacity_wait": 1 + 2,        # [17, 18] A alone, [18, 19] A+C (the new placement began at 18)
        "uncommitted": 0})
    # The sum of the parts is what the nodes cost while held: (A+B) 16 s, A 2 s, (A+C) 8 s.
    assert cost.total_usd == pytest.approx(sum(cost.parts_usd.values())) == pytest.approx(3 * 16 + 1 * 2 + 2 * 8)
    assert sum(cost.seconds.values()) == pytest.approx(26.0)
    assert cost.node_hours == pytest.approx((26 + 16 + 8) / 3600)
    assert cost.tokens == 6000 and cost.usd_per_1k_tokens == pytest.approx(66 / 6)
    assert set(cost.to_dict()["parts_usd"]) == set(CATEGORIES)


def test_steps_past_the_last_commit_of_an_unfinished_run_are_uncommitted():
    metrics, events = _timeline()
    events = [e for e in events if e["kind"] not in ("run_finished",) and e.get("reason") != "final"]
    cost = cost_breakdown(metrics, events)
    # The session ends at its last record (step 6 at 25): steps 3-6 of the second attempt
    # are past the newest commit (step 2), so a resume would train them again.
    assert cost.seconds["uncommitted"] == pytest.approx(4.0) and cost.seconds["stragglers"] == 0
    assert cost.parts_usd["uncommitted"] == pytest.approx(8.0)
    assert cost.total_usd == pytest.approx(3 * 16 + 1 * 2 + 2 * 7)


def test_a_node_without_a_price_is_named_and_no_price_at_all_is_no_cost():
    metrics, events = _timeline()
    for e in events:
        if e["kind"] == "plan_chosen":
            e["node_prices"] = {**e["node_prices"], C: None}
    cost = cost_breakdown(metrics, events)
    assert cost.unpriced_nodes == (C,)
    assert cost.total_usd == pytest.approx(3 * 16 + 1 * 2 + 1 * 8)  # C charged nothing
    for e in events:
        if e["kind"] == "plan_chosen":
            e["node_prices"] = {}
    assert cost_breakdown(metrics, events) is None


@pytest.mark.parametrize("labels, table, price", [
    ({"rayflex.io/price-per-hour": "3.5", "ray.io/market-type": "spot"}, {"spot": 2.0}, 3.5),  # the node's own label
    ({"ray.io/market-type": "spot"}, {"spot": 2.0, "on-demand": 6.0}, 2.0),
    ({"ray.io/market-type": "on-demand"}, {"spot": 2.0, "*": 9.0}, 9.0),
    ({}, {"*": 9.0}, 9.0),
    ({"ray.io/market-type": "spot"}, {"on-demand": 6.0}, None),
    ({"rayflex.io/price-per-hour": "cheap"}, {}, None),
])
def test_a_nodes_price_comes_from_its_label_else_the_table_by_market(labels, table, price):
    assert node_price(labels, table) == price


def test_a_price_table_that_cannot_price_anything_is_refused_before_the_run():
    assert rf.ScalingConfig(price_per_hour={"spot": 2.1, "on-demand": 6.5}).price_per_hour["spot"] == 2.1
    with pytest.raises(ConfigError, match=r"ScalingConfig.price_per_hour: unknown market 'preemptible'.*Fix: use e.g."):
        rf.ScalingConfig(price_per_hour={"preemptible": 2.1})
    with pytest.raises(ConfigError, match=r"the price of 'spot' must be a number of dollars >= 0, got -1"):
        rf.ScalingConfig(price_per_hour={"spot": -1})


def _run_dir(tmp_path, metrics, events):
    import json

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def test_the_report_and_status_show_the_same_breakdown(tmp_path, capsys):
    import json

    from rayflex.cli.main import main
    from rayflex.telemetry.report import write_report

    run_dir = _run_dir(tmp_path, *_timeline())
    write_report(f"file://{run_dir}")
    summary = json.loads((run_dir / "report.json").read_text())
    assert summary["cost_usd"] == pytest.approx(66.0) and summary["usd_per_1k_tokens"] == pytest.approx(11.0)
    assert summary["cost_parts_usd"]["recomputed"] == pytest.approx(9.0)
    page = (run_dir / "report.html").read_text()
    assert "<h2>Cost</h2>" in page and "$66.00 in all, $11.00 per 1k tokens" in page
    assert "<tr><td>capacity_wait</td><td>$3.00</td><td>4.5%</td><td>2.0</td></tr>" in page
    assert main(["status", "--storage", f"file://{tmp_path}/runs", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["cost_usd"] == pytest.approx(66.0) and row["cost"]["parts_usd"] == summary["cost_parts_usd"]


def test_rayflex_plan_prices_the_chosen_mesh_by_the_cluster_files_node_prices(tmp_path, capsys):
    import json

    from rayflex.cli.main import main

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("device: {name: H100-80GB, memory_gb: 80, tflops: 989, mfu: 0.4}\n"
                       "uniform: {nodes: 8, devices_per_node: 8, nodes_per_rack: 8, price_per_hour: 31.2}\n")
    assert main(["plan", "--model", "7b", "--cluster", str(cluster), "--global-batch", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cost, step_s = out["cost"], out["best"]["step_s"]
    assert cost["nodes"] == 8 and cost["usd_per_hour"] == pytest.approx(8 * 31.2)
    tokens = 512 * 2048
    assert cost["usd_per_1k_tokens"] == pytest.approx(8 * 31.2 / 3600 * step_s / (tokens / 1000))
    assert main(["plan", "--model", "7b", "--cluster", str(cluster)]) == 0
    assert "cost: $249.60 an hour for the 8 nodes it fills" in capsys.readouterr().out


def test_a_cluster_files_price_that_is_not_a_number_is_refused_naming_it(tmp_path, capsys):
    from rayflex.cli.main import main

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("device: {name: H100-80GB, memory_gb: 80, tflops: 989, mfu: 0.4}\n"
                       "uniform: {nodes: 8, devices_per_node: 8, price_per_hour: cheap}\n")
    assert main(["plan", "--model", "7b", "--cluster", str(cluster)]) != 0
    err = capsys.readouterr().err
    assert "cluster.uniform.price_per_hour: must be dollars per node-hour >= 0, got 'cheap'" in err
