"""What a rank does about the replicate dimension, as ``CommConfig`` says; built at setup
once the stages are sharded, asked by the training loop after each update, at the run's
last step, after a restore, for what a checkpoint keeps and for the step's metrics."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayflex.checkpoint.checkpointer import RankOwn
from rayflex.config import CommConfig
from rayflex.mesh.plan import MeshPlan
from rayflex.worker.slow_tier.diloco import ANCHOR, DiLoCo, local_tensor
from rayflex.worker.slow_tier.hooks import reduce_gradients_over_replicas
from rayflex.worker.slow_tier.reduce import ReplicateReducer, ring_bytes


class SlowTier:
    """``replicate="allreduce"``: FSDP2 crosses the tier itself (bytes reported from the ring's
    arithmetic); ``"int8"``: a hook per FSDP module averages gradients through an int8
    :class:`ReplicateReducer`; ``"diloco"``: the :class:`DiLoCo` outer loop."""

    def __init__(self, comm: CommConfig, plan: MeshPlan, mesh, stages: list[tuple[int, nn.Module]],
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.mode = comm.replicate
        self._device = next((local_tensor(p).device for _, m in stages for p in m.parameters()), torch.device("cpu"))
        group = mesh["dp_replicate"].get_group() if plan.dp_replicate > 1 else None
        self.reducer: Optional[ReplicateReducer] = None
        self.diloco: Optional[DiLoCo] = None
        self._native_bytes = 0
        self._synced = 0
        if self.mode == "int8":
            self.reducer = ReplicateReducer(group, "int8", comm.block)
            reduce_gradients_over_replicas(stages, self.reducer)
        elif self.mode == "diloco":
            self.reducer = ReplicateReducer(group, comm.pseudo_grad, comm.block)
            named = [(name, p) for _, m in stages for name, p in m.named_parameters()]
            self.diloco = DiLoCo(named, self.reducer, inner_steps=comm.inner_steps, lr=comm.outer_lr,
                                 momentum=comm.outer_momentum, fragments=comm.fragments,
                                 overlap_steps=comm.overlap_steps)
        else:
            numel = sum(local_tensor(p).numel() for _, m in stages for p in m.parameters())
            element = torch.empty((), dtype=reduce_dtype).element_size()
            self._native_bytes = ring_bytes(numel, element, plan.dp_replicate)

    def after_update(self, step: int) -> None:
        """DiLoCo: synchronise the fragments due at ``step`` (collective)."""
        if self.diloco is not None:
            self._synced += self.diloco.sync(step)

    def settle(self) -> None:
        """DiLoCo, when the training loop ends: wait for a pseudo-gradient still in flight
        (overlap); a save after it still holds what was sent."""
        if self.diloco is not None:
            self.diloco.settle()

    def finish(self, step: int) -> None:
        """DiLoCo at the run's last step: synchronise every fragment, so the final
        checkpoint (what is exported and evaluated) is one model (collective)."""
        if self.diloco is not None:
            self._synced += self.diloco.sync_all(step)

    def after_restore(self, restored: dict) -> None:
        """DiLoCo after a restore (``TrainWorker.setup``'s ``restored``): from the anchor when
        the checkpoint had another number of replicas; the restored model becomes the anchor
        when the checkpoint had none."""
        if self.diloco is None:
            return
        if ANCHOR not in restored.get("loaded_sections", ()):
            self.diloco.reset_anchor()
            self.diloco.forget_in_flight()
        elif restored.get("replicas_changed"):
            self.diloco.start_from_anchor()
            self.diloco.forget_in_flight()
        else:
            self.diloco.resend()  # a fragment in flight at the save (overlap): on its way again

    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Sections a checkpoint keeps besides the model and optimizer (DiLoCo's outer state)."""
        return self.diloco.state() if self.diloco is not None else {}

    def own_state(self, plan: MeshPlan, rank: int) -> tuple[int, int]:
        """(replica, replicas) whose model and optimizer state ``rank`` saves as its own:
        under DiLoCo each replica's (they step apart), else one shared by all."""
        if self.diloco is None:
            return 0, 1
        return plan.mesh_coords(rank).dp_replicate, plan.dp_replicate

    def rank_own(self, plan: MeshPlan, rank: int) -> Optional[RankOwn]:
        """What only this rank holds, for its checkpoints: int8's residuals (what its roundings
        still owe) and DiLoCo's pseudo-gradient in flight (overlap). Read back by the same rank
        of the same mesh, so a resume there carries on exactly; on another mesh the residuals
        start from zero (at most one step's rounding is not carried) and nothing is in flight."""
        int8 = self.reducer is not None and self.reducer.wire == "int8"
        overlap = self.diloco is not None and self.diloco.overlap_steps > 0
        if not (int8 or overlap):
            return None

        def tensors() -> dict:
            out = {f"residual.{k}": t for k, t in self.reducer.residuals().items()} if int8 else {}
            if overlap:
                out.update((f"diloco.{k}", t) for k, t in self.diloco.own_state().items())
            return out

        def load(saved: dict) -> None:  # none saved for this rank of this mesh: from zero, nothing in flight
            if int8:
                self.reducer.load_residuals({k[len("residual."):]: t.to(self._device) for k, t in saved.items()
                                             if k.startswith("residual.")})
            if overlap:
                self.diloco.load_own_state({k[len("diloco."):]: t for k, t in saved.items() if k.startswith("diloco.")})

        prefix = (f"w{plan.world_size}_pp{plan.pp}_rep{plan.dp_replicate}_shard{plan.dp_shard}_tp{plan.tp}"
                  f"_rank{rank}")
        return RankOwn(prefix=prefix, tensors=tensors, load=load)

    def step_metrics(self) -> dict:
        """This rank's share of the step's metrics line: the bytes it sent over the replicate
        tier, the fragments synchronised (DiLoCo), what int8 rounding still owes."""
        out: dict = {"replicate_bytes": self.reducer.take_bytes() if self.reducer is not None else self._native_bytes}
        if self.diloco is not None:
            out["outer_synced"], self._synced = self._synced, 0
        if self.reducer is not None and self.reducer.wire == "int8":
            out["residual_norm"] = self.reducer.residual_norm()
        return out
