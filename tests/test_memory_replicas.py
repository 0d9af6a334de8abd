"""Memory replicas without Ray: the keeper's budget and bookkeeping, who replicates to whom,
and DCP's save and load through them (a keeper here is the plain class, called directly)."""

import torch
import torch.distributed.checkpoint as dcp

from rayflex.planning.topology import Topology
from rayflex.checkpoint.replicas.client import ReplicaClient
from rayflex.checkpoint.replicas.holders import OWN_COPY, REPLICA, STORAGE, Holder
from rayflex.checkpoint.replicas.dcp_io import MemoryFirstReader, ReplicatingWriter
from rayflex.checkpoint.replicas.keeper import PRIMARY, ReplicaKeeper, digest_of
from rayflex.checkpoint.replicas.peers import choose_peers


class _Now:
    """Calls a keeper method at once (the shape of an actor method's ``.remote``)."""

    def __init__(self, fn):
        self.remote = fn


class _Direct:
    def __init__(self, keeper):
        self.keeper = keeper

    def __getattr__(self, name):
        return _Now(getattr(self.keeper, name))


class InProcessClient(ReplicaClient):
    """A rank's client whose keepers are plain objects in this process."""

    def __init__(self, node_id, keepers):
        super().__init__("run", node_id)
        self.keepers = keepers

    def _keeper(self, node_id):
        k = self.keepers.get(node_id)
        return None if k is None else _Direct(k)

    def _all_keepers(self):
        return {n: _Direct(k) for n, k in self.keepers.items()}

    @staticmethod
    def _get(value, timeout_s):
        return value


def _keepers(budget=1 << 30):
    a, b = ReplicaKeeper("run", "node-a", budget), ReplicaKeeper("run", "node-b", budget)
    a.set_peers([_Direct(b)], ["node-b"])
    b.set_peers([_Direct(a)], ["node-a"])
    return {"node-a": a, "node-b": b}


def test_a_kept_file_is_on_its_node_and_its_peer_and_reads_back_byte_exact():
    keepers = _keepers()
    data = bytes(range(256)) * 1000
    keepers["node-a"].put(7, "__0_0.distcp", data, digest=digest_of(data), origin_node="node-a")
    assert keepers["node-a"].inventory(7)["__0_0.distcp"]["role"] == PRIMARY
    assert keepers["node-b"].inventory(7)["__0_0.distcp"]["role"] == REPLICA
    got = keepers["node-b"].read(7, "__0_0.distcp", [(10, 5), (1000, 3)])
    assert [bytes(c) for c in got] == [data[10:15], data[1000:1003]]


def test_a_damaged_transfer_is_refused():
    keeper = ReplicaKeeper("run", "node-a", 1 << 20)
    got = keeper.put(1, "__0_0.distcp", b"abc", digest=digest_of(b"abd"), origin_node="node-a")
    assert not got["kept"] and keeper.inventory(1) == {}


def test_the_budget_evicts_older_steps_first_and_refuses_what_never_fits():
    keeper = ReplicaKeeper("run", "node-a", budget_bytes=300)  # a file needs twice its size while it arrives
    blob = b"x" * 100
    for step in (1, 2, 3):
        keeper.put(step, "__0_0.distcp", blob, digest=digest_of(blob), origin_node="node-a")
    st = keeper.stats()
    assert sorted(st["steps"]) == [2, 3] and st["evicted_steps"] == [1]
    assert st["held_bytes"] == 200 <= st["budget_bytes"] and st["peak_held_bytes"] == 200
    big = b"y" * 160
    got = keeper.put(4, "__0_0.distcp", big, digest=digest_of(big), origin_node="node-a")
    assert not got["kept"] and "does not fit the node's replica budget" in got["why"]
    keeper.committed(3)
    assert sorted(keeper.stats()["steps"]) == [3], "a commit supersedes the older steps"
    keeper.drop_after(2)
    assert keeper.stats()["steps"] == {}, "a restart at step 2 drops the steps after it"


def _topology(racks: dict):
    return Topology.from_dict({"nodes": [{"id": n, "slots": 1, "labels": {"rack": r}} for n, r in racks.items()]})


def test_replicas_go_to_another_rack_and_spread_over_it():
    topo = _topology({"a1": "r0", "a2": "r0", "b1": "r1", "b2": "r1"})
    peers = choose_peers(topo, ["a1", "a2", "b1", "b2"], copies=1)
    assert all(topo.node(n).rack != topo.node(p[0]).rack for n, p in peers.items())
    assert peers["a1"] != peers["a2"], "two nodes of a rack replicate to different nodes"


def test_one_rack_still_replicates_off_the_node():
    topo = _topology({"a1": "r0", "a2": "r0"})
    assert choose_peers(topo, ["a1", "a2"], copies=2) == {"a1": ["a2"], "a2": ["a1"]}


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "n": torch.tensor(3)}


def test_dcp_saves_through_the_keepers_and_loads_from_memory_or_falls_back(tmp_path):
    keepers = _keepers()
    client = InProcessClient("node-a", keepers)
    path = str(tmp_path / "step_00000005")
    saved = _state(0)
    writer = ReplicatingWriter(path, step=5, client=client, single_file_per_rank=True, sync_files=False)
    dcp.save(saved, storage_writer=writer)
    shard = next(p.name for p in (tmp_path / "step_00000005").iterdir() if p.name.endswith(".distcp"))
    assert (tmp_path / "step_00000005" / (shard + ".digest")).read_text() == \
        keepers["node-a"].inventory(5)[shard]["digest"]
    assert writer.kept == {shard: ["node-a", "node-b"]} and writer.off_node

    # The rank restarts on node b (node a is gone): the replica serves it.
    del keepers["node-a"]
    reader_client = InProcessClient("node-b", keepers)
    holders, missing = reader_client.locate(5, path, [shard])
    assert holders == {shard: [Holder("node-b", REPLICA)]} and missing == {}
    loaded = _state(1)
    reader = MemoryFirstReader(path, step=5, holders=holders, client=reader_client)
    dcp.load(loaded, storage_reader=reader)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert reader.report["files"] == {OWN_COPY: 0, REPLICA: 1, STORAGE: 0}

    # The replica is lost too: storage, and the reason is named.
    keepers.clear()
    holders, missing = reader_client.locate(5, path, [shard])
    assert holders == {} and "no live keeper holds it" in missing[shard]
    loaded = _state(2)
    reader = MemoryFirstReader(path, step=5, holders=holders, missing=missing, client=reader_client)
    dcp.load(loaded, storage_reader=reader)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert reader.report["files"][STORAGE] == 1 and "no live keeper" in reader.report["fell_back"][shard]


def test_a_copy_that_differs_from_the_committed_digest_is_not_used(tmp_path):
    keepers = _keepers()
    client = InProcessClient("node-a", keepers)
    path = str(tmp_path / "step_00000001")
    dcp.save(_state(0), storage_writer=ReplicatingWriter(path, step=1, client=client, single_file_per_rank=True))
    shard = next(p.name for p in (tmp_path / "step_00000001").iterdir() if p.name.endswith(".distcp"))
    other = b"not the committed bytes"
    keepers["node-a"].put(1, shard, other, digest=digest_of(other), origin_node="node-a", role=REPLICA)
    holders, missing = client.locate(1, path, [shard])
    assert [h.node_id for h in holders[shard]] == ["node-b"], "only the copy equal to storage's is used"


def test_a_rank_on_a_node_without_copies_reads_them_from_another_node(tmp_path):
    keepers = _keepers()
    path = str(tmp_path / "step_00000002")
    saved = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(9)}
    dcp.save(saved, storage_writer=ReplicatingWriter(path, step=2, client=InProcessClient("node-a", keepers),
                                                      single_file_per_rank=True))
    shard = next(p.name for p in (tmp_path / "step_00000002").iterdir() if p.name.endswith(".distcp"))
    elsewhere = InProcessClient("node-c", keepers)
    holders, _ = elsewhere.locate(2, path, [shard])
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    reader = MemoryFirstReader(path, step=2, holders=holders, client=elsewhere)
    dcp.load(loaded, storage_reader=reader)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert reader.report["files"] == {OWN_COPY: 1, REPLICA: 0, STORAGE: 0}, "the saving node's copy first"
    assert reader.report["remote_reads"] == 1


class _Held:
    """An executor that never runs what it is given: a keeper that dies before its upload."""

    def submit(self, *args, **kwargs):
        return None


def _emergency_save(root, keepers, node, leaving, step=9):
    import json

    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import EXTRA_FILE

    client = InProcessClient(node, keepers)
    client.leaving(leaving)
    path = mf.step_dir(root, step)
    saved = _state(step)
    writer = ReplicatingWriter(path, step=step, client=client, emergency=True, single_file_per_rank=True)
    dcp.save(saved, storage_writer=writer)
    with open(f"{path.removeprefix('file://')}/{EXTRA_FILE}", "w") as f:  # rank 0 writes it itself
        json.dump({"step": step}, f)
    return writer, saved, path


def _wait_uploads(keeper, step):
    import time

    deadline = time.monotonic() + 30
    while "pending" in keeper.uploads(step).values() and time.monotonic() < deadline:
        time.sleep(0.01)
    return keeper.uploads(step)


def test_an_emergency_save_on_a_leaving_node_hands_its_upload_to_the_replica_and_commits_after_it(tmp_path):
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import commit_if_whole

    root = f"file://{tmp_path}/ckpt"
    keepers = _keepers()
    writer, saved, path = _emergency_save(root, keepers, "node-a", leaving=["node-a"])
    shard = next(iter(writer.kept))
    assert writer.handed_off == {shard: "node-b"}, "the upload goes to the node that stays"
    assert keepers["node-a"].uploads(9) == {}
    assert _wait_uploads(keepers["node-b"], 9) == {shard: "uploaded"}
    commit_if_whole(root, 9, world_size=1, mesh={"dp": 1}, keep=2)
    assert mf.latest_committed(root) == 9
    loaded = _state(0)
    dcp.load(loaded, storage_reader=MemoryFirstReader(path, step=9, holders={}, client=writer.client))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), "the committed step is the saved state"


def test_an_emergency_save_on_a_node_that_stays_hands_its_upload_to_its_own_keeper(tmp_path):
    keepers = _keepers()
    writer, _, _ = _emergency_save(f"file://{tmp_path}/ckpt", keepers, "node-b", leaving=["node-a"])
    shard = next(iter(writer.kept))
    assert writer.handed_off == {shard: "node-b"} and writer.kept[shard] == ["node-b"]
    assert _wait_uploads(keepers["node-b"], 9) == {shard: "uploaded"}


def test_a_handed_off_step_whose_keeper_went_is_never_committed(tmp_path):
    import pytest

    from rayflex.errors import CheckpointError
    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.checkpointer import commit_if_whole

    root = f"file://{tmp_path}/ckpt"
    keepers = _keepers()
    keepers["node-b"]._upload_pool = _Held()  # node b's keeper dies before it uploads
    writer, _, _ = _emergency_save(root, keepers, "node-a", leaving=["node-a"])
    shard = next(iter(writer.kept))
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        commit_if_whole(root, 9, world_size=1, mesh={"dp": 1}, keep=2)
    assert mf.latest_committed(root) is None


def test_bad_replica_settings_are_refused_with_the_fix():
    import pytest

    import rayflex as rf
    from rayflex.errors import ConfigError

    with pytest.raises(ConfigError, match="upload='auto' or 'thread' with memory_replicas"):
        rf.CheckpointConfig(every_steps=5, memory_replicas=1, upload="process")
    with pytest.raises(ConfigError, match="memory_replicas"):
        rf.CheckpointConfig(memory_replicas=-1)
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        rf.CheckpointConfig(memory_replicas=1, memory_budget_gb=0)
    assert rf.CheckpointConfig(memory_replicas=1, memory_budget_gb=0.5).memory_budget_bytes == 2**29


def test_a_save_abandoned_mid_way_writes_nothing_more_to_storage(tmp_path):
    """A peer died while this rank's save was being kept in memory: the save can never
    commit, so its upload must not start (the process could then not be reused: the
    upload might land in a later attempt's step)."""
    import threading

    import pytest

    from rayflex.checkpoint.dcp_io import CheckpointWriter

    abandoned = threading.Event()

    class AbortedWhileKeeping(InProcessClient):
        def keep(self, *args, **kwargs):
            held = super().keep(*args, **kwargs)
            abandoned.set()  # the release's abort lands here
            return held

    keepers = _keepers()
    step_dir = tmp_path / "step_00000003"
    writer = ReplicatingWriter(str(step_dir), step=3, client=AbortedWhileKeeping("node-a", keepers),
                               abandoned=abandoned, single_file_per_rank=True)
    with pytest.raises(BaseException, match="can never commit"):
        dcp.save(_state(0), storage_writer=writer)
    assert not any(p.name.endswith(".distcp") for p in step_dir.iterdir()), "no shard uploaded"
    assert keepers["node-a"].inventory(3), "the memory copy (harmless) is there"

    # Without replicas: a save abandoned before it starts opens no file at all.
    plain_dir = tmp_path / "step_00000004"
    with pytest.raises(BaseException, match="can never commit"):
        dcp.save(_state(0), storage_writer=CheckpointWriter(str(plain_dir), abandoned=abandoned,
                                                            single_file_per_rank=True))
    assert not plain_dir.exists() or not any(plain_dir.iterdir())


def test_too_few_nodes_for_the_replicas_asked_is_an_event_with_the_fix():
    """``memory_replicas=1`` on one node: no replica can live off its shard's node. It used
    to be accepted silently; the attempt now says so in events.jsonl, with the fix."""
    from types import SimpleNamespace

    from rayflex.control.placing import _cover_with_keepers
    from rayflex.telemetry import events as ev

    topology = _topology({"a1": "r0", "a2": "r0"})
    nodes = ["a1", "a2"]

    def attempt_on(node_ids):
        recorded = []

        class Keepers:
            copies = 1

            def cover(self, nodes, topo):
                return choose_peers(topo, sorted(nodes), self.copies)

        ctx = SimpleNamespace(ensure_keepers=Keepers, cluster=SimpleNamespace(topology=lambda: topology),
                              record=recorded.append)
        _cover_with_keepers(ctx, SimpleNamespace(node_of={r: n for r, n in enumerate(node_ids)}))
        return recorded

    [short] = attempt_on([nodes[0], nodes[0]])
    assert isinstance(short, ev.MemoryReplicasShort)
    assert (short.wanted, short.fewest, short.nodes) == (1, 0, 1)
    assert short.reason == ("a replica lives on another node than its shard and this attempt has 1 node(s): add "
                            "nodes, or lower CheckpointConfig.memory_replicas to 0")
    assert attempt_on(nodes) == []  # two nodes: each holds the other's copy
