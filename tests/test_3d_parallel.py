"""3-D parallelism on CPU/gloo: tensor parallel x pipeline x FSDP/HSDP meshes train what one
process trains, and a checkpoint saved on one layout resumes on another.

The ranks are TrainWorkers in spawned processes (no Ray: the mesh is the question here,
and four processes that each import torch once run every layout one after another, as
an elastic restart reuses a process). Each layout starts from the same seeded weights
and sees the same batches, so its per-step losses must be the single-process reference's.
"""

from __future__ import annotations

import pytest

from conftest import SEQ_LEN
from spawn_ranks import JobPorts, run_ranks

# A guard against a pool that never ends, not a bound: its six jobs took 117 s of a 150 s
# guard inside the slow-host quota, and more with other load beside it.
TIMEOUT_S = 600
STEPS = 3
GLOBAL_BATCH = 12  # divisible by every dp below: 1, 2, 3, 4


class UserLM:
    """A user's own module (``ModelSpec.from_module``) with a TP plan in transformers'
    notation; its attention views heads by a fixed head size, as TP requires."""

    @staticmethod
    def build():
        import torch.nn.functional as F
        from torch import nn

        width, heads, vocab = 32, 4, 128

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
                self.o = nn.Linear(width, width)
                self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

            def forward(self, x):
                b, t, _ = x.shape
                h = self.norm(x)
                q, k, v = (p(h).view(b, t, -1, width // heads).transpose(1, 2) for p in (self.q, self.k, self.v))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
                x = x + self.o(a)
                return x + self.down(F.gelu(self.up(x)))

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, width)
                self.layers = nn.ModuleList(Layer() for _ in range(2))
                self.norm = nn.LayerNorm(width)
                self.lm_head = nn.Linear(width, vocab, bias=False)

            def forward(self, ids):
                x = self.embed(ids)
                for layer in self.layers:
                    x = layer(x)
                return self.lm_head(self.norm(x))

        return LM()

    PLAN = {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise",
            "layers.*.up": "colwise", "layers.*.down": "rowwise", "embed": "rowwise_replicated_input",
            "lm_head": "colwise_gather_output"}


def _model(kind: str = "gpt"):
    from rayflex.models import GPTConfig, gpt
    from rayflex.models.gpt_blocks import lm_loss
    from rayflex.models.spec import ModelSpec

    if kind.startswith("hf-"):  # a tiny Hugging Face model, TP plan from transformers
        from rayflex.models.hf import causal_lm

        from hf_helpers import tiny_config

        return causal_lm(tiny_config(kind[3:]))
    if kind == "user":
        return ModelSpec.from_module(UserLM.build, loss_fn=lm_loss, tp_plan=UserLM.PLAN,
                                     tp_divides={"attention heads": 4})
    # 4 heads, MLP 128 and a vocabulary of 128 split over tp=2; 4 layers = 6 blocks for pp=2.
    return gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=32, n_layers=4, n_heads=4))


def _spec(data_uri: str, storage: str, name: str, parallel, *, world: int, steps: int = STEPS, every: int = 0,
          resume: bool = False, model: str = "gpt"):
    import rayflex as rf

    return rf.TrainSpec(model=_model(model), data=rf.DataConfig(uri=data_uri, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH),
                        run=rf.RunConfig(name=name, storage=storage, steps=steps,
                                         optimizer=rf.OptimizerConfig(lr=1e-2, grad_clip=1.0)),
                        scaling=rf.ScalingConfig(num_workers=world), parallel=parallel,
                        checkpoint=rf.CheckpointConfig(every_steps=every, resume=resume, async_save=False))


def _layouts():
    import rayflex as rf

    return {
        "tp2_dp2": (4, rf.ParallelConfig(tp=2)),
        "pp2_tp2": (4, rf.ParallelConfig(pp=2, tp=2, microbatches=2)),
        "hsdp_replicate2_shard2": (4, rf.ParallelConfig(dp_shard=2)),
        "pp2_tp2_dp2": (8, rf.ParallelConfig(pp=2, tp=2, microbatches=2)),
        "dp3": (3, rf.ParallelConfig()),
        "user_tp2_dp2": (4, rf.ParallelConfig(tp=2)),
        "hf-llama_tp2_dp2": (4, rf.ParallelConfig(tp=2)),
        "hf-qwen3_tp2_dp2": (4, rf.ParallelConfig(tp=2)),
    }


def _run_jobs(rank: int, world: int, port: int, data_uri: str, storage: str, jobs: list, ports) -> dict:
    """Run each job ``(name, layout, end_step, run_steps, every, resume)`` on the first ranks
    of this process pool, in order; each answers its losses and where it restored from."""
    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    layouts = _layouts()
    out, worker = {}, None
    for name, layout, end_step, run_steps, every, resume in jobs:
        size, parallel = layouts[layout]
        if rank >= size:
            continue
        job_port = ports.port(rank, size, name)
        spec = _spec(data_uri, storage, "ckpt" if every or resume else name, parallel, world=size,
                     steps=run_steps, every=every, resume=resume, model=layout.split("_")[0] if layout.startswith(("user", "hf-")) else "gpt")
        plan = plan_mesh(spec.model, spec.parallel, spec.data, size)
        if worker is None or worker.spec != spec:
            worker = TrainWorker(rank, spec, plan)
        else:
            worker.reconfigure(rank, plan)
        info = worker.setup("127.0.0.1", job_port, restore=resume)
        worker.start(end_step)
        finished = worker.join(TIMEOUT_S - 30)
        status = worker.poll()
        assert finished and status.error is None, (name, status.error)
        qkv = [p for n, p in worker.stages[0][1].named_parameters() if n.endswith(("qkv.weight", ".q.weight", "q_proj.weight"))][0]
        out[name] = {"losses": [r.loss for r in status.records], "steps": [r.step for r in status.records],
                     "grad_norms": [r.grad_norm for r in status.records],
                     "restored": (info["restored"] or {}).get("step"), "mesh": plan.describe(),
                     # this rank's piece of a qkv weight: rows split over tp, then over dp by FSDP
                     "qkv": (tuple(qkv.shape), tuple(qkv.to_local().shape), [str(p) for p in qkv.placements])}
        assert worker.release(10, 0) == "left"
    return out


def _reference(data_uri: str, storage: str, steps: int, model: str = "gpt") -> dict:
    """The single-process run's losses and grad norms (AdamW barely notices a wrong norm
    under clipping, so the norm is compared on its own)."""
    import rayflex as rf
    from rayflex.testing.reference import single_process_train

    spec = _spec(data_uri, storage, "reference", rf.ParallelConfig(), world=1, steps=steps, model=model)
    losses, state = single_process_train(spec, steps)
    return {"losses": losses, "grad_norms": state.grad_norms}


@pytest.fixture(scope="module")
def four_rank_runs(dataset_uri, tmp_path_factory):
    """tp2 x dp2, pp2 x tp2, HSDP 2 x 2, then a checkpoint saved at pp2 x tp2 (step 2 of
    4) resumed at dp3: all in one pool of four processes."""
    storage = f"file://{tmp_path_factory.mktemp('runs3d')}"
    jobs = [("tp2_dp2", "tp2_dp2", STEPS, STEPS, 0, False), ("pp2_tp2", "pp2_tp2", STEPS, STEPS, 0, False),
            ("hsdp", "hsdp_replicate2_shard2", STEPS, STEPS, 0, False),
            ("user_tp2_dp2", "user_tp2_dp2", STEPS, STEPS, 0, False),
            # the first two steps of a 4-step run, then the rest of it on another layout
            ("save_pp2_tp2", "pp2_tp2", 2, 4, 2, False), ("resume_dp3", "dp3", 4, 4, 2, True)]
    got = run_ranks(_run_jobs, 4, dataset_uri, storage, jobs, JobPorts(4), timeout_s=TIMEOUT_S)
    return got, {STEPS: _reference(dataset_uri, storage, STEPS), 4: _reference(dataset_uri, storage, 4),
                 "user": _reference(dataset_uri, storage, STEPS, "user")}


@pytest.mark.multiproc
@pytest.mark.parametrize("name,mesh", [("tp2_dp2", "pp=1 x dp=2 x tp=2"), ("pp2_tp2", "pp=2 x dp=1 x tp=2"),
                                       ("hsdp", "pp=1 x dp=4 (2x2 hsdp)")])
def test_a_3d_mesh_trains_what_one_process_trains(four_rank_runs, name, mesh):
    got, reference = four_rank_runs
    for rank, runs in got.items():
        run = runs[name]
        assert run["mesh"] == mesh
        (rows, cols), local, placements = run["qkv"]
        tp = 2 if "tp=2" in mesh else 1
        dp_shard = 2 if "hsdp" in mesh else 2 if "dp=2" in mesh else 1
        assert local == (rows // (tp * dp_shard), cols), (name, run["qkv"])  # really split
        assert run["steps"] == list(range(1, STEPS + 1)), (rank, run)
        assert run["losses"] == pytest.approx(reference[STEPS]["losses"], abs=1e-5), (name, rank, run, reference)
        assert run["grad_norms"] == pytest.approx(reference[STEPS]["grad_norms"], rel=1e-5), (name, rank, run)


@pytest.mark.multiproc
def test_a_users_module_with_a_tp_plan_trains_at_tp2_dp2_as_in_one_process(four_rank_runs):
    got, reference = four_rank_runs
    for rank, runs in got.items():
        run = runs["user_tp2_dp2"]
        (rows, cols), local, _ = run["qkv"]
        assert local == (rows // 4, cols), run["qkv"]  # q split over tp, then over dp
        assert run["losses"] == pytest.approx(reference["user"]["losses"], abs=1e-5), (rank, run, reference["user"])
        assert run["grad_norms"] == pytest.approx(reference["user"]["grad_norms"], rel=1e-5), (rank, run)


@pytest.mark.multiproc
def test_a_checkpoint_saved_at_pp2_tp2_resumes_at_dp3_with_the_never_stopped_loss(four_rank_runs):
    got, reference = four_rank_runs
    for rank, runs in got.items():
        saved = runs["save_pp2_tp2"]
        assert saved["losses"] == pytest.approx(reference[4]["losses"][:2], abs=1e-5), (rank, saved)
        if rank < 3:
            resumed = runs["resume_dp3"]
            assert resumed["mesh"] == "pp=1 x dp=3" and resumed["restored"] == 2, resumed
            assert resumed["steps"] == [3, 4]
            assert resumed["losses"] == pytest.approx(reference[4]["losses"][2:], abs=1e-5), (rank, resumed, reference)
        else:
            assert "resume_dp3" not in runs


@pytest.mark.multiproc
@pytest.mark.slow  # eight processes; make test-slow
def test_pp2_tp2_dp2_on_eight_ranks_trains_what_one_process_trains(dataset_uri, tmp_path):
    storage = f"file://{tmp_path}/runs"
    got = run_ranks(_run_jobs, 8, dataset_uri, storage, [("pp2_tp2_dp2", "pp2_tp2_dp2", STEPS, STEPS, 0, False)],
                    JobPorts(8), timeout_s=TIMEOUT_S)
    reference = _reference(dataset_uri, storage, STEPS)
    for rank, runs in got.items():
        run = runs["pp2_tp2_dp2"]
        assert run["mesh"] == "pp=2 x dp=2 x tp=2"
        assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5), (rank, run, reference)
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), (rank, run, reference)


@pytest.mark.multiproc
@pytest.mark.slow  # four processes importing transformers; make test-slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head q/k norms, grads summed over tp
def test_a_hugging_face_model_trains_at_tp2_dp2_as_in_one_process(dataset_uri, tmp_path, family):
    storage = f"file://{tmp_path}/runs"
    layout = f"hf-{family}_tp2_dp2"
    got = run_ranks(_run_jobs, 4, dataset_uri, storage, [(layout, layout, STEPS, STEPS, 0, False)], JobPorts(4),
                    timeout_s=TIMEOUT_S)
    reference = _reference(dataset_uri, storage, STEPS, f"hf-{family}")
    for rank, runs in got.items():
        run = runs[layout]
        (rows, cols), local, _ = run["qkv"]
        assert local == (rows // 4, cols), run["qkv"]
        assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5), (rank, run, reference)
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), (rank, run, reference)
