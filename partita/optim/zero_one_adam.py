"""0/1 Adam (DeepSpeed's ``ZeroOneAdam``, arXiv 2202.06009) at ZeRO stage 0.

[Note: DeepSpeed's steps] DeepSpeed's ZeroOneAdam spends its first ``step()`` setting up its
communication buffers (the weights do not move); its schedules count that step. partita updates from
the first step and runs DeepSpeed's schedules on DeepSpeed's count: partita's update ``n`` is
DeepSpeed's step ``s = n + 1``, and every condition below is written in ``s``. So a config gives
the same sequence of kinds of update as on DeepSpeed, one step earlier.

Phase 1 (``s <= var_freeze_step + 1``): the variance is refreshed on steps ``s`` with
``s % var_interval == 0``; ``var_interval`` starts at 1 and doubles after every
``var_update_scaler`` refreshes. A refresh step is Adam on the engine's full-precision averaged
gradient (the gradient reduction runs as usual). Every other step the gradient reducer stands aside
and the local gradients are averaged by the error-compensated 1-bit exchange
(:mod:`partita.optim.onebit_comm`); the momentum takes that average, the variance stays.
The update is DeepSpeed's: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``, without bias
correction (DeepSpeed's 0/1 Adam has none, whatever ``bias_correction`` says).

Phase 2 (frozen variance, local steps): each rank updates its whole model from its own momentum
(``m = b1 m + (1 - b1) g_local``) with no communication but the local-norm all-reduce, and on steps
with ``s % local_step_interval == 0`` the ranks synchronise: the change since the last
synchronisation, times ``sqrt(v) + eps`` (momentum units, so one 1-bit scale suits it), is averaged
by the 1-bit exchange; the momentum becomes ``-average / sum(lr)`` over the interval and the weights
``anchor + average / (sqrt(v) + eps)``. ``local_step_interval`` starts at 1 and doubles (up to
``local_step_clipper``) every ``local_step_scaler`` steps. The error feedback restarts at zero when the
variance freezes, as in DeepSpeed.

Deviation, on purpose: DeepSpeed undoes the local steps by subtracting their accumulated sum from the
weights, so each rank's rounding differs and the ranks' weights drift apart by rounding after every
synchronisation. partita keeps the weights of the last synchronisation (``anchor``, fp32, model-sized,
phase 2 only) and rebuilds the weights from it, so every rank holds bit-identical weights after each
synchronisation.

Checkpoints: ``exp_avg``, ``exp_avg_sq`` and ``anchor`` are per-element state (rank 0's, identical on
all ranks except ``exp_avg`` between synchronisations); each rank saves its error feedback and, between
synchronisations, its own weights and momentum (``zeroone/master/<name>``, ``zeroone/exp_avg/<name>``)
in its rank file, so resuming at the saved world size is the uninterrupted run. At another world size
every rank starts from the mean of the saved ranks' weights and momenta.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.optim.onebit_family import OneBitFamily

__all__ = ["ZeroOneAdam"]


def _local_key(what: str, name: str) -> str:
    return f"zeroone/{what}/{name}"


class ZeroOneAdam(OneBitFamily):
    kind = "ZeroOneAdam"
    purpose = "0/1 Adam compressed exchange"
    # DeepSpeed's 0/1 Adam compresses each parameter on its own (one scale per parameter and rank chunk);
    # one scale over a whole group's row mixes parameters of very different sizes of gradient.
    per_parameter_scales = True
    stage_reason = ("its local steps move every rank's whole model on its own, and at stages 1-2 a rank holds "
                    "only its partition of the fp32 master weights")

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    # ------------------------------------------------------------------ schedule
    def init_state(self, master: torch.Tensor) -> dict:
        state = super().init_state(master)
        state.setdefault("var_interval", 1)
        state.setdefault("var_counter", 0)
        state.setdefault("local_step_interval", 1)
        state.setdefault("local_step_counter", 0)
        state.setdefault("lrs", 0.0)
        return state

    def frozen(self) -> bool:
        """Whether the variance is frozen for the next step (DeepSpeed: after a step with s > var_freeze_step)."""
        return self.steps_done() >= self.var_freeze_step

    def _schedule(self) -> dict:
        return self.init_state(self.param_groups[0]["params"][0])

    def compressed_phase(self) -> bool:
        """Whether the next step skips the engine's gradient reduction (all but the variance refreshes)."""
        if self.frozen():
            return True
        return (self.steps_done() + 2) % self._schedule()["var_interval"] != 0

    # ------------------------------------------------------------------ phase 1
    def _adam_update(self, master: torch.Tensor, state: dict, options: dict) -> None:
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + options["eps"])
        if options["weight_decay"] > 0:
            update.add_(master, alpha=options["weight_decay"])
        master.add_(update, alpha=-options["lr"])

    def _end_phase_one_step(self) -> None:
        """Variance bookkeeping after a phase-1 step (every group), then the freeze when it is due."""
        s = self.steps_done() + 2
        for options in self.param_groups:
            state = self.init_state(options["params"][0])
            if s % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
            state["step"] += 1
        if self.frozen():
            for options in self.param_groups:
                master = options["params"][0]
                self.state[master]["anchor"] = master.detach().clone()
            self.reset_errors()  # DeepSpeed: the errors now measure another quantity (momentum, not gradient)

    def _full_update(self) -> None:
        for options in self.param_groups:
            master = options["params"][0]
            state = self.init_state(master)
            beta1, beta2 = options["betas"]
            if master.grad is not None:
                grad = master.grad
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            self._adam_update(master, state, options)
        self._end_phase_one_step()

    # ------------------------------------------------------------------ compressed steps
    def _compressed_update(self, grads: list[torch.Tensor], used: list[list[bool]]) -> None:
        if not self.frozen():
            for g, options in enumerate(self.param_groups):
                master = options["params"][0]
                state = self.init_state(master)
                average = self.rows[g].own(self.exchange(g, grads[g], used[g]))
                beta1 = options["betas"][0]
                state["exp_avg"].mul_(beta1).add_(average, alpha=1 - beta1)
                self._adam_update(master, state, options)
            self._end_phase_one_step()
            return
        s = self.steps_done() + 2
        for g, options in enumerate(self.param_groups):
            master = options["params"][0]
            state = self.init_state(master)
            beta1 = options["betas"][0]
            state["exp_avg"].mul_(beta1).add_(self.rows[g].own(grads[g]), alpha=1 - beta1)
            state["lrs"] += options["lr"]
            self._adam_update(master, state, options)
            if s % state["local_step_interval"] == 0:
                self._synchronise(g, master, state, options, used[g])
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
            state["step"] += 1

    def _synchronise(self, g: int, master: torch.Tensor, state: dict, options: dict, used: list[bool]) -> None:
        rows, anchor = self.rows[g], state["anchor"]
        denom = state["exp_avg_sq"].sqrt().add_(options["eps"])
        change = rows.from_partition((master - anchor).mul_(denom))
        average = rows.own(self.exchange(g, change, used))
        if state["lrs"] > 0:  # lr 0 all interval: no change, the momentum stays (DeepSpeed divides by zero)
            state["exp_avg"].copy_(average).div_(-state["lrs"])
        master.copy_(anchor + average / denom)
        anchor.copy_(master)
        state["lrs"] = 0.0

    # ------------------------------------------------------------------ checkpoints
    def _between_synchronisations(self) -> bool:
        return self.frozen() and any(self.state[o["params"][0]].get("lrs", 0.0) > 0 for o in self.param_groups)

    def checkpoint_entries(self, names: dict) -> list[tuple[str, torch.Tensor]]:
        entries = super().checkpoint_entries(names)
        if self._between_synchronisations():  # this rank's own weights and momentum differ from rank 0's
            for options, group, rows in zip(self.param_groups, self.zero_groups, self.rows):
                master = options["params"][0]
                for param, spec in zip(group.params, group.layout.specs):
                    lo, hi = spec.partition_offset, spec.partition_offset + spec.numel
                    entries.append((_local_key("master", names[param]), master[lo:hi].clone()))
                    entries.append((_local_key("exp_avg", names[param]), self.state[master]["exp_avg"][lo:hi].clone()))
        return entries

    @torch.no_grad()
    def load_checkpoint_entries(self, reader: Any, meta: dict, names: dict, rank_file: Any) -> None:
        super().load_checkpoint_entries(reader, meta, names, rank_file)
        saved_world = int(meta["world_size"])
        sources = [dist.get_rank()] if saved_world == dist.get_world_size() else list(range(saved_world))
        for options, group in zip(self.param_groups, self.zero_groups):
            master = options["params"][0]
            for param, spec in zip(group.params, group.layout.specs):
                key = _local_key("master", names[param])
                if not reader.has(rank_file(0), key):
                    continue  # saved at a synchronisation (or before the freeze): rank 0's state is everyone's
                lo, hi = spec.partition_offset, spec.partition_offset + spec.numel
                for what, target in (("master", master), ("exp_avg", self.state[master]["exp_avg"])):
                    saved = [reader.tensor(rank_file(s), _local_key(what, names[param])).to(torch.float32) for s in sources]
                    target[lo:hi].copy_(sum(saved) / len(saved))
