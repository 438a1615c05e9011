"""1-bit Adam (DeepSpeed's ``OneBitAdam``) at ZeRO stages 0, 1 and 2.

[Note: the two phases]
- warm-up, the first ``freeze_step`` steps: plain AdamW. This class *is* torch's AdamW there
  (``super().step()``), on the flat fp32 partitions ZeRO reduces gradients into, so the phase is
  bit-identical to partita's ``"Adam"`` with the same settings (``fused: false``).
- compressed, every later step: the second moment is frozen; gradients are no longer reduced.
  The engine's gradient reducer stands aside (``GradientReducer.local_only``), each rank keeps its
  whole local gradient, and :meth:`OneBitAdam.compressed_step` (called by the sharded optimizer
  in place of its own step) exchanges the momentum compressed to one bit per element
  (:mod:`partita.optim.onebit_comm`).

[Note: 1-bit Adam with ZeRO] (DeepSpeed refuses ZeRO for its 1-bit optimizers.)
Every rank holds the synchronised momentum of the whole model (``world x partition`` fp32, rebuilt
from the ranks' ``exp_avg`` partitions by one fp32 all-gather when the phase starts or after a
checkpoint load) and its worker error of the same size; it forms its local estimate
``b1 * m + (1 - b1) * g_local`` over all partitions, and the compressed all-to-all + all-gather
(rows = ZeRO partitions) replace the gradient reduce-scatter. Rank ``r`` then updates only its
own partition with row ``r`` of the result and its frozen ``exp_avg_sq``; the usual parameter
all-gather follows. Costs: two extra model-sized fp32 buffers per rank in this phase, and at stage 2
the local gradients stay whole in ``param.grad`` until the step.
At stage 0 (DeepSpeed's only stage) the rows are the whole flat group cut in ``world`` pieces
(:mod:`partita.optim.onebit_rows`): rank ``r`` serves row ``r`` and every rank updates the whole
group with the same synchronised momentum, as DeepSpeed does.
The update is torch's AdamW rule with the variance's bias correction frozen at ``freeze_step``.
Gradient clipping and the fp16 overflow check use the local gradients (their norms are summed over
ranks in one fp32 all-reduce): the reported norm is ``sqrt(mean_r |g_r|^2)``, an upper bound of the
averaged gradient's norm.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from partita.config.base import ConfigError
from partita.distributed import collectives
from partita.optim.onebit_checkpoint import load_worker_errors, worker_error_entries
from partita.optim.onebit_comm import compressed_exchange
from partita.optim.onebit_rows import RowLayout, take_local_gradients
from partita.zero.unused_params import restore_unused, save_unused

if TYPE_CHECKING:
    from partita.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["OneBitAdam"]

_PURPOSE = "1-bit Adam momentum exchange"
_STAGES = (
    "optimizer type 'OneBitAdam' runs with zero_optimization.stage 0, 1 or 2 over two or more data-parallel ranks "
    "(its compressed exchange replaces the gradient all-reduce or reduce-scatter; stage 3 is not built); set "
    "zero_optimization.stage to 0, 1 or 2, or use type \"AdamW\""
)


class OneBitAdam(torch.optim.AdamW):
    """AdamW for ``freeze_step`` steps, then 1-bit compressed momentum with frozen variance."""

    def __init__(self, params: Any, *, freeze_step: int, **adamw: Any) -> None:
        super().__init__(params, foreach=False, fused=False, **adamw)
        self.freeze_step = freeze_step
        self._sharded: ShardedOptimizer | None = None
        self._reducer = None
        # Per group: the synchronised momentum and this rank's worker error, (world, partition).
        self._momentum: list[torch.Tensor | None] = []
        self.worker_errors: list[torch.Tensor | None] = []
        self.server_errors: list[torch.Tensor | None] = []
        self.rows: list[RowLayout] = []

    # ------------------------------------------------------------------ wiring
    def attach_zero(self, sharded: ShardedOptimizer) -> None:
        """Called by the sharded optimizer that owns this optimizer (partita/zero/sharded_optimizer.py)."""
        if sharded._world_size < 2 or any(g.layout.num_shards not in (1, sharded._world_size) for g in sharded.groups):
            raise ConfigError(_STAGES)
        if any(g.offloaded for g in sharded.groups) or any(g.comm is not None and g.comm.size != sharded._world_size
                                                            for g in sharded.groups):
            raise ConfigError(
                "optimizer type 'OneBitAdam' does not combine with offload_optimizer or MoE expert groups; "
                "remove them, or use type \"AdamW\""
            )
        self._sharded = sharded
        self._momentum = [None] * len(sharded.groups)
        self.worker_errors = [None] * len(sharded.groups)
        self.server_errors = [None] * len(sharded.groups)  # stage 0 only: this rank's row (1-2: in the state)
        self.rows = [RowLayout(g, sharded._world_size, _rank(sharded)) for g in sharded.groups]

    def _bind_reducer(self) -> None:
        if self._reducer is not None or self._sharded is None:
            return
        from partita.zero.gathered import owner_of

        state = owner_of(self._sharded.groups[0].params[0])
        if state.policy.shard_parameters:
            # Found here, at the first step: the sharded optimizer is built before ZeRO-3's gatherer.
            raise ConfigError(_STAGES)
        self._reducer = state.reducer
        if self._reducer._accumulate_in_fp32:
            raise ConfigError(
                "optimizer type 'OneBitAdam' keeps local gradients in param.grad in its compressed phase; "
                "data_types.grad_accum_dtype \"fp32\" is not supported with it: remove grad_accum_dtype"
            )
        self._reducer.local_only = self.compressed_phase

    def steps_done(self) -> int:
        """Applied steps so far (the most of any group: a group with no gradient yet has no state)."""
        steps = [self.state.get(group["params"][0], {}).get("step", 0) for group in self.param_groups]
        return max(int(s.item() if torch.is_tensor(s) else s) for s in steps)

    def compressed_phase(self) -> bool:
        """Whether the next step is compressed (``freeze_step`` steps are done)."""
        return self.steps_done() >= self.freeze_step

    # ------------------------------------------------------------------ warm-up
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self._bind_reducer()
        if self.compressed_phase():
            raise RuntimeError("OneBitAdam: compressed steps run through compressed_step() (ZeRO's sharded optimizer)")
        return super().step(closure)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind_reducer()
        # The synchronised momentum is rebuilt from the loaded exp_avg partitions at the next step.
        self._momentum = [None] * len(self._momentum)
        # The worker errors come back through load_checkpoint_entries (partita checkpoints) or restart at zero.
        self.worker_errors = [None] * len(self.worker_errors)
        self.server_errors = [None] * len(self.server_errors)

    @property
    def zero_groups(self) -> list:
        """The ZeRO groups whose masters this optimizer steps (in its param-group order)."""
        return self._sharded.groups

    def checkpoint_entries(self, names: dict) -> list[tuple[str, torch.Tensor]]:
        """Extra tensors of this rank's checkpoint file: the worker errors (partita/optim/onebit_checkpoint.py)."""
        return worker_error_entries(self, names)

    def load_checkpoint_entries(self, reader: Any, meta: dict, names: dict, rank_file: Any) -> None:
        """After ``load_state_dict`` from a partita checkpoint: the worker errors back (or their mean)."""
        load_worker_errors(self, reader, meta, names, rank_file)

    # ------------------------------------------------------------------ compressed phase
    @torch.no_grad()
    def compressed_step(self, *, loss_scale: float, clip: float) -> tuple[bool, float]:
        """One compressed step over every group; returns (applied, grad_norm). Collectives: one
        fp32 all-reduce (norm), then per group the compressed all-to-all and all-gather."""
        sharded = self._sharded
        self._bind_reducer()
        group_pg = sharded.process_group
        local = take_local_gradients(sharded, self.rows, loss_scale=loss_scale, clip=clip, purpose=_PURPOSE)
        grads, norm, multiplier, used = local.matrices, local.norm, local.multiplier, local.used
        if not math.isfinite(norm):
            return False, norm
        # Parameters no rank produced a gradient for keep their weights and states (as in the warm-up,
        # partita/zero/unused_params.py) and are left out of the compressed exchange.
        kept = save_unused(sharded.groups, self, used)
        for g, (group, grad) in enumerate(zip(sharded.groups, grads)):
            mask = self.rows[g].mask
            if not all(used[g]):
                mask = mask.clone()
                for spec, was_used in zip(group.layout.specs, used[g]):
                    if not was_used:
                        self.rows[g].drop(mask, spec)
            self._step_group(g, group, grad.mul_(multiplier), mask, group_pg)
        restore_unused(kept)
        return True, norm

    def server_error(self, g: int) -> torch.Tensor:
        """This rank's server error of group ``g``: its row of the exchange (stages 1-2: its partition,
        kept in the optimizer state, so checkpoints reshard it per element)."""
        if self.rows[g].sharded:
            master = self.param_groups[g]["params"][0]
            return self.state[master].setdefault("server_error", torch.zeros_like(master))
        if self.server_errors[g] is None:
            self.server_errors[g] = self.rows[g].empty()[0]
        return self.server_errors[g]

    def _step_group(self, g: int, group, grad: torch.Tensor, mask: torch.Tensor, process_group) -> None:
        options = self.param_groups[g]
        master = options["params"][0]
        state = self.state[master]
        if "exp_avg_sq" not in state:
            return  # no gradient reached this group in the warm-up: no variance to freeze; it stays as it is
        rows = self.rows[g]
        beta1, beta2 = options["betas"]
        if self._momentum[g] is None:
            momentum = rows.from_partition(state["exp_avg"])
            if momentum is None:  # stages 1-2: every rank's exp_avg partition
                momentum = rows.empty()
                collectives.all_gather_into_tensor(momentum.view(-1), state["exp_avg"], group=process_group,
                                                   purpose=f"{_PURPOSE}: momentum rebuild")
            self._momentum[g] = momentum
        if self.worker_errors[g] is None:
            self.worker_errors[g] = torch.zeros_like(grad)
        estimate = self._momentum[g].mul_(beta1).add_(grad, alpha=1 - beta1)
        synced = compressed_exchange(estimate, self.worker_errors[g], self.server_error(g), mask,
                                     rank=rows.rank, group=process_group, purpose=_PURPOSE)
        self._momentum[g] = synced
        state["exp_avg"].copy_(rows.own(synced))
        state["step"] += 1
        step = float(state["step"].item())
        lr, eps, decay = options["lr"], options["eps"], options["weight_decay"]
        master.mul_(1 - lr * decay)  # decoupled, as AdamW
        bias1 = 1 - beta1**step
        bias2 = 1 - beta2 ** min(step, self.freeze_step)  # the variance stopped at freeze_step
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
        master.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)


def _rank(sharded: ShardedOptimizer) -> int:
    import torch.distributed as dist

    return dist.get_rank(sharded.process_group)
