"""What 0/1 Adam and 1-bit LAMB share: ZeRO wiring, local gradients, the compressed exchange.

Both optimizers step in two ways, chosen per step by ``compressed_phase()`` (subclasses define it):
- a full-precision step: the engine reduces the gradients as for any optimizer, the sharded optimizer
  unscales and clips them and calls ``step()`` with each flat master's ``.grad`` set;
- a compressed step: the gradient reducer stands aside (``GradientReducer.local_only``), each rank keeps
  its own local gradient in ``param.grad`` and the sharded optimizer calls :meth:`compressed_step`, which
  gathers them into the ``(world, chunk)`` rows of :mod:`partita.optim.onebit_rows` and hands them to the
  subclass's ``_compressed_update``; the subclass exchanges what it needs through :meth:`exchange`
  (:mod:`partita.optim.onebit_comm`, the same error-compensated 1-bit all-to-all + all-gather as
  OneBitAdam).

0/1 Adam runs at stage 0 only, as in DeepSpeed: its local steps change every rank's whole model on its
own between synchronisations, and at stages 1-2 a rank holds only its partition of the fp32 masters.
1-bit LAMB also runs at stages 1-2 (``sharded_stages``): the rows are the ZeRO partitions, and its
per-parameter norms are summed over the ranks' parts (:meth:`OneBitFamily.reduce_over_ranks`). Clipping and the fp16 overflow check use the local
gradients, as OneBitAdam does (one fp32 all-reduce of the squared local norms per compressed step, so
that every rank skips or clips alike and the schedules stay in step).
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

__all__ = ["OneBitFamily"]


class OneBitFamily(torch.optim.Optimizer):
    """Base of :class:`~partita.optim.zero_one_adam.ZeroOneAdam` and
    :class:`~partita.optim.onebit_lamb.OneBitLamb` (two or more ranks)."""

    kind = ""  # the config type, for messages
    purpose = ""  # the comms logger's purpose of the compressed exchange
    per_parameter_scales = False  # one 1-bit scale per parameter and row, not per row (onebit_comm.py)

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        if any("exp_avg_mask" in group for group in self.param_groups):
            raise ValueError(
                f"{self.kind}: a param group sets 'exp_avg_mask' (DeepSpeed's momentum mask), which partita does not "
                "apply; remove it from the param groups (parameters that get no gradient are already left out of "
                "the compressed exchange)"
            )
        self._sharded: ShardedOptimizer | None = None
        self._reducer = None
        # Per group: this rank's worker error ((world, chunk)) and server error (its row), None until used.
        self.worker_errors: list[torch.Tensor | None] = []
        self.server_errors: list[torch.Tensor | None] = []
        self.rows: list[RowLayout] = []

    # ------------------------------------------------------------------ wiring
    sharded_stages = False  # whether ZeRO stages 1-2 (partitioned masters) are built for this optimizer
    stage_reason = ""

    def _stages_message(self) -> str:
        if self.sharded_stages:
            return (
                f"optimizer type '{self.kind}' runs with zero_optimization.stage 0, 1 or 2 over two or more "
                f"data-parallel ranks ({self.stage_reason}); set zero_optimization.stage to 0, 1 or 2, or use "
                "type \"AdamW\""
            )
        return (
            f"optimizer type '{self.kind}' runs with zero_optimization.stage 0 over two or more data-parallel ranks, "
            f"as in DeepSpeed ({self.stage_reason}); set zero_optimization.stage to 0, or use type \"OneBitAdam\" "
            "(1-bit Adam at stages 0-2)"
        )

    def attach_zero(self, sharded: ShardedOptimizer) -> None:
        """Called by the sharded optimizer that owns this optimizer (partita/zero/sharded_optimizer.py)."""
        allowed = (1, sharded._world_size) if self.sharded_stages else (1,)
        if sharded._world_size < 2 or any(g.layout.num_shards not in allowed for g in sharded.groups):
            raise ConfigError(self._stages_message())
        if any(g.offloaded for g in sharded.groups) or any(g.comm is not None and g.comm.size != sharded._world_size
                                                            for g in sharded.groups):
            raise ConfigError(
                f"optimizer type '{self.kind}' does not combine with offload_optimizer or MoE expert groups; "
                "remove them, or use type \"AdamW\""
            )
        import torch.distributed as dist

        self._sharded = sharded
        rank = dist.get_rank(sharded.process_group)
        self.rows = [RowLayout(g, sharded._world_size, rank) for g in sharded.groups]
        self.worker_errors = [None] * len(sharded.groups)
        self.server_errors = [None] * len(sharded.groups)

    def _bind_reducer(self) -> None:
        if self._reducer is not None or self._sharded is None:
            return
        from partita.zero.gathered import owner_of

        state = owner_of(self._sharded.groups[0].params[0])
        if state.policy.shard_parameters:
            raise ConfigError(self._stages_message())
        self._reducer = state.reducer
        if self._reducer._accumulate_in_fp32:
            raise ConfigError(
                f"optimizer type '{self.kind}' keeps local gradients in param.grad in its compressed steps; "
                "data_types.grad_accum_dtype \"fp32\" is not supported with it: remove grad_accum_dtype"
            )
        self._reducer.local_only = self.compressed_phase

    def compressed_phase(self) -> bool:  # pragma: no cover - defined by every subclass
        raise NotImplementedError

    def steps_done(self) -> int:
        """Applied steps so far (every group counts every applied step)."""
        state = self.state.get(self.param_groups[0]["params"][0], {})
        return int(state.get("step", 0))

    def init_state(self, master: torch.Tensor) -> dict:
        """The group's state, created zero on first use (every group, used or not, so the step
        counts and schedules of all groups stay equal)."""
        state = self.state[master]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        return state

    @property
    def zero_groups(self) -> list:
        """The ZeRO groups whose masters this optimizer steps (in its param-group order)."""
        return self._sharded.groups

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind_reducer()
        # The error feedback comes back through load_checkpoint_entries (partita checkpoints) or restarts at zero.
        self.worker_errors = [None] * len(self.worker_errors)
        self.server_errors = [None] * len(self.server_errors)

    def checkpoint_entries(self, names: dict) -> list[tuple[str, torch.Tensor]]:
        """Extra tensors of this rank's checkpoint file: its error feedback (partita/optim/onebit_checkpoint.py)."""
        return worker_error_entries(self, names)

    def load_checkpoint_entries(self, reader: Any, meta: dict, names: dict, rank_file: Any) -> None:
        """After ``load_state_dict`` from a partita checkpoint: this rank's error feedback back (or the mean)."""
        load_worker_errors(self, reader, meta, names, rank_file)

    def server_error(self, g: int) -> torch.Tensor:
        """This rank's server error of group ``g``: its row of the exchange (stages 1-2: its partition, kept in
        the optimizer state, so checkpoints reshard it per element, as OneBitAdam's)."""
        if self.rows[g].sharded:
            master = self.param_groups[g]["params"][0]
            return self.state[master].setdefault("server_error", torch.zeros_like(master))
        if self.server_errors[g] is None:
            self.server_errors[g] = self.rows[g].empty()[0]
        return self.server_errors[g]

    def reset_errors(self) -> None:
        """Error feedback back to zero (0/1 Adam does so when its variance freezes; stage 0 only)."""
        self.worker_errors = [None] * len(self.worker_errors)
        self.server_errors = [None] * len(self.server_errors)

    def reduce_over_ranks(self, values: torch.Tensor, op: str) -> torch.Tensor:
        """``values`` summed (``op`` "sum") or maxed ("max") over the data-parallel ranks at stages 1-2, where
        each rank holds a part of every parameter; as they are at stage 0."""
        if not self.rows or not self.rows[0].sharded:
            return values
        import torch.distributed as dist

        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        collectives.all_reduce(values, op=reduce_op, group=self._sharded.process_group,
                               purpose=f"{self.purpose}: per-parameter {op}s")
        return values

    # ------------------------------------------------------------------ compressed steps
    @torch.no_grad()
    def exchange(self, g: int, value: torch.Tensor, used: list[bool]) -> torch.Tensor:
        """The error-compensated 1-bit average over ranks of ``value`` (group ``g``'s rows), the same on
        every rank; parameters no rank produced a gradient for are left out (decode to zero)."""
        rows = self.rows[g]
        mask = rows.mask
        if not all(used):
            mask = mask.clone()
            for spec, was_used in zip(self.zero_groups[g].layout.specs, used):
                if not was_used:
                    rows.drop(mask, spec)
        if self.worker_errors[g] is None:
            self.worker_errors[g] = torch.zeros_like(value)
        return compressed_exchange(value, self.worker_errors[g], self.server_error(g), mask, rank=rows.rank,
                                   group=self._sharded.process_group, purpose=self.purpose,
                                   segments=rows.segments if self.per_parameter_scales else None)

    @torch.no_grad()
    def compressed_step(self, *, loss_scale: float, clip: float) -> tuple[bool, float]:
        """One compressed step over every group; returns (applied, grad_norm)."""
        self._bind_reducer()
        sharded = self._sharded
        local = take_local_gradients(sharded, self.rows, loss_scale=loss_scale, clip=clip, purpose=self.purpose)
        grads, norm, used = local.matrices, local.norm, local.used
        if not math.isfinite(norm):
            return False, norm
        multiplier = local.multiplier
        for grad in grads:
            grad.mul_(multiplier)
        # Parameters no rank produced a gradient for keep their weights and states (partita/zero/unused_params.py).
        kept = save_unused(sharded.groups, self, used)
        self._compressed_update(grads, used)
        restore_unused(kept)
        return True, norm

    def _compressed_update(self, grads: list[torch.Tensor], used: list[list[bool]]) -> None:  # pragma: no cover
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The full-precision step (the engine reduced the gradients into each master's ``.grad``)."""
        self._bind_reducer()
        if self.compressed_phase():
            raise RuntimeError(f"{self.kind}: compressed steps run through compressed_step() (ZeRO's sharded optimizer)")
        loss = closure() if closure is not None else None
        self._full_update()
        return loss

    def _full_update(self) -> None:  # pragma: no cover
        raise NotImplementedError
