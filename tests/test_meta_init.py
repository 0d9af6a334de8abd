"""A rank's weights do not depend on the layout, nor on building on the meta device.

Four plain gloo processes (no Ray) take part in four layouts in turn: pp1 x dp4, pp2 x
dp2, pp2 x dp2 with two (interleaved) stages per rank, and one process alone. In each,
every rank builds its stage(s) the plain way (full seeded build, then ``shard_stage``)
and on meta (``build_sharded_stages``); every local shard and buffer of both must equal,
bit for bit, this rank's slice of the one-process full build. Without a pipeline, two
training steps from each build give the same losses.
"""


import pytest
import torch

from rayflex.models.spec import build_stage
from rayflex.testing.processes import ForkedContext

from meta_init_helpers import buffered_spec, run_rank

WORLD = 4
LAYOUTS = [(4, 1, 1), (4, 2, 1), (4, 2, 2), (1, 1, 1)]  # (world, pp, stages per rank)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    ctx = ForkedContext()
    results = ctx.Queue()
    stores = tmp_path_factory.mktemp("rendezvous")
    layouts = [(*layout, str(stores / f"layout{i}")) for i, layout in enumerate(LAYOUTS)]
    procs = [ctx.Process(target=run_rank, args=(r, layouts, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=TIMEOUT_S) for _ in range(sum(world for world, _, _ in LAYOUTS)))
        errors = [v["exception"] for v in got.values() if "exception" in v]
        assert not errors, errors[0]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    spec = buffered_spec()
    full = build_stage(spec, list(range(spec.num_blocks)))
    reference = {n: t.detach() for n, t in [*full.named_parameters(), *full.named_buffers()]}
    return got, reference, {n for n, _ in full.named_buffers()}


def _dim0_slice(full: torch.Tensor, dp_index: int, dp: int) -> torch.Tensor:
    """FSDP2's default sharding, written out: ``torch.chunk`` on dim 0, empty past the end."""
    chunks = torch.chunk(full, dp, dim=0)
    return chunks[dp_index] if dp_index < len(chunks) else full[:0]


def _same_bits(a, b: torch.Tensor) -> bool:
    b = b.numpy()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.multiproc
@pytest.mark.parametrize("world,pp,per_rank", LAYOUTS, ids=["pp1xdp4", "pp2xdp2", "pp2xdp2-interleaved", "single"])
def test_meta_build_equals_the_full_seeded_build_bit_for_bit(built, world, pp, per_rank):
    got, reference, buffers = built
    assert any("inv_freq" in n for n in buffers), "the test model must have a non-persistent buffer"
    covered = set()
    for rank in range(world):
        r = got[(world, pp, per_rank, rank)]
        assert r["meta"].keys() == r["plain"].keys(), rank  # same names: checkpoint keys unchanged
        for name, mine in r["meta"].items():
            full = reference[name]
            expected = full if name in buffers else _dim0_slice(full, r["dp_index"], r["dp"])
            assert _same_bits(r["plain"][name], expected), (rank, name, "plain build")
            assert _same_bits(mine, expected), (rank, name, "meta build")
        if "losses" in r:  # and they train alike, step for step
            assert r["losses"]["meta"] == r["losses"]["plain"], (rank, r["losses"])
        covered |= r["meta"].keys()
    assert covered == reference.keys()  # the ranks together hold the whole model
    if world > 1:  # really sharded: some rank holds less than a whole parameter
        assert any(t.size < reference[n].numel() for n, t in got[(world, pp, per_rank, 0)]["meta"].items())
