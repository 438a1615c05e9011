"""1-bit LAMB (DeepSpeed's ``OneBitLamb``, arXiv 2104.06069) at ZeRO stages 0, 1 and 2 (DeepSpeed: 0 only).

Steps are counted as DeepSpeed counts them (partita/optim/zero_one_adam.py, [Note: DeepSpeed's steps]):
DeepSpeed's first step only sets up buffers, so partita's update ``n`` is DeepSpeed's step ``n + 1``;
the warm-up is DeepSpeed's steps ``2 .. freeze_step``, i.e. ``freeze_step - 1`` LAMB updates, and
compression starts at the same update as on DeepSpeed.

Warm-up: LAMB on the engine's averaged gradient, per parameter (DeepSpeed's update, no bias correction):
``u = m / (sqrt(v) + eps) + weight_decay * p``, trust ratio ``|p| / |u|`` clamped to
``[min_coeff, max_coeff]`` (1 when either norm is zero), ``p -= lr * ratio * u``. Each parameter keeps
an EMA of its ratios (``coeff_beta``; ratios of exactly 1 are left out, as in DeepSpeed): the frozen
coefficient of the compressed phase. The last warm-up step copies the variance into
``exp_avg_sq_fresh``.

Compressed phase: the variance ``v`` is frozen. At its first step each parameter gets a momentum
scaling ``mean_q(rms(m_q)) / rms(m_p)`` (all parameters of all groups; 1 where ``m_p`` is zero),
which evens out the parameters' momentum sizes so that one 1-bit scale per chunk suits them all.
Each step the local momentum ``(b1 m + (1 - b1) g_local) * scaling`` goes through the
error-compensated 1-bit exchange, and is unscaled. From it the gradient is reconstructed,
``(m - b1 m_last) / (1 - b1)``, and feeds ``exp_avg_sq_fresh``. The per-parameter factor
``max(denom / denom_fresh)`` (blended towards 1 by the update's non-decay share when weight decay
is on) is clamped to ``[factor_min, factor_max]`` and to ``last_factor * (1 +- factor_threshold)``; the
step is ``p -= lr * frozen_coeff * factor * u`` with the frozen ``v``.

Stages 1-2: the exchange's rows are the ZeRO partitions (as OneBitAdam's). Each rank keeps the
synchronised momentum of the whole group (``world x partition`` fp32, rebuilt from the ``exp_avg``
partitions by one all-gather at the first compressed step or after a load) to form its local estimate
over every partition; it updates only its own partition, and ZeRO's parameter all-gather follows. Per
parameter, the norms are sums over the ranks' parts and the factor a maximum (two small all-reduces per
group and step). The warm-up is LAMB on the reduce-scattered gradient partitions, with the same all-reduced
norms.

Checkpoints: ``exp_avg``, ``exp_avg_sq``, ``exp_avg_sq_fresh`` (and at stages 1-2 ``server_error``) are
per-element state; the
per-parameter coefficients (``lamb_coeff_freeze``, ``last_factor``, ``scaling_coeff``) are lists of
floats in the state (JSON in the checkpoint); the error feedback is saved per rank as OneBitAdam's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from partita.optim.onebit_family import OneBitFamily

__all__ = ["OneBitLamb"]


def _spans(group) -> list[slice]:
    """Each parameter's elements in this rank's partition (stage 0: the whole parameter; may be empty)."""
    return [slice(spec.partition_offset, spec.partition_offset + (end - start)) for _, spec, (start, end) in
            group.owned_slices()]


class OneBitLamb(OneBitFamily):
    kind = "OneBitLamb"
    purpose = "1-bit LAMB momentum exchange"
    sharded_stages = True
    stage_reason = "its compressed exchange replaces the gradient all-reduce or reduce-scatter; stage 3 is not built"

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 freeze_step: int, max_coeff: float, min_coeff: float, coeff_beta: float, factor_max: float,
                 factor_min: float, factor_threshold: float) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                                      min_coeff=min_coeff))
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_coeffs: list[float] = []  # the last step's coefficient per parameter (DeepSpeed's get_lamb_coeffs)
        # Per group, compressed phase: the synchronised momentum of the whole group, (world, chunk), unscaled
        # (stages 1-2: every rank's partition; rebuilt from the exp_avg partitions by one all-gather).
        self._momentum: list[torch.Tensor | None] = []

    def attach_zero(self, sharded) -> None:
        super().attach_zero(sharded)
        self._momentum = [None] * len(sharded.groups)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._momentum = [None] * len(self._momentum)

    def _norms(self, x: torch.Tensor, spans: list[slice]) -> list[float]:
        """Each parameter's L2 norm of the partition-shaped ``x`` (stages 1-2: over every rank's part)."""
        if not self.rows[0].sharded:
            return torch.stack([torch.linalg.vector_norm(x[span]) for span in spans]).tolist()
        squares = torch.stack([x[span].square().sum() for span in spans])
        return self.reduce_over_ranks(squares, "sum").sqrt().tolist()

    def _maxes(self, x: torch.Tensor, spans: list[slice]) -> list[float]:
        """Each parameter's largest element of ``x`` (>= 0 here; an empty part counts 0)."""
        local = torch.stack([x[span].max() if span.stop > span.start else x.new_zeros(()) for span in spans])
        return self.reduce_over_ranks(local, "max").tolist()

    def get_lamb_coeffs(self) -> list[float]:
        """The LAMB coefficients the last step applied, per parameter in group order (as DeepSpeed's)."""
        return self.lamb_coeffs

    def init_state(self, master: torch.Tensor) -> dict:
        state = super().init_state(master)
        if "lamb_coeff_freeze" not in state:
            count = len(self.zero_groups[self._group_index(master)].params)
            state["lamb_coeff_freeze"] = [0.0] * count
            state["last_factor"] = [1.0] * count
        return state

    def _group_index(self, master: torch.Tensor) -> int:
        return next(g for g, o in enumerate(self.param_groups) if o["params"][0] is master)

    def compressed_phase(self) -> bool:
        """DeepSpeed compresses from its step freeze_step + 1 (partita's update freeze_step)."""
        return self.steps_done() + 2 > self.freeze_step

    # ------------------------------------------------------------------ warm-up: LAMB
    def _full_update(self) -> None:
        last_warm_up = self.steps_done() + 2 == self.freeze_step
        for g, options in enumerate(self.param_groups):
            master = options["params"][0]
            state = self.init_state(master)
            beta1, beta2 = options["betas"]
            if master.grad is not None:
                grad = master.grad
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if last_warm_up:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + options["eps"])
            if options["weight_decay"] > 0:
                update.add_(master, alpha=options["weight_decay"])
            spans = _spans(self.zero_groups[g])
            if g == 0:
                self.lamb_coeffs = []
            freeze = state["lamb_coeff_freeze"]
            for j, (span, weight_norm, update_norm) in enumerate(zip(spans, self._norms(master, spans),
                                                                     self._norms(update, spans))):
                coeff = 1.0
                if weight_norm != 0 and update_norm != 0:
                    coeff = min(max(weight_norm / update_norm, options["min_coeff"]), options["max_coeff"])
                if coeff != 1.0:
                    freeze[j] = self.coeff_beta * freeze[j] + (1 - self.coeff_beta) * coeff
                self.lamb_coeffs.append(coeff)
                master[span].add_(update[span], alpha=-options["lr"] * coeff)
            state["step"] += 1

    # ------------------------------------------------------------------ compressed phase
    def _scaling(self) -> None:
        """Each parameter's momentum scaling, fixed at the first compressed step (over all groups)."""
        rms = []
        for g, options in enumerate(self.param_groups):
            exp_avg = self.init_state(options["params"][0])["exp_avg"]
            group = self.zero_groups[g]
            norms = self._norms(exp_avg, _spans(group))
            rms.append([n / math.sqrt(spec.numel) for n, spec in zip(norms, group.layout.specs)])
        flat = [r for group_rms in rms for r in group_rms]
        united = sum(flat) / len(flat)
        for options, group_rms in zip(self.param_groups, rms):
            self.state[options["params"][0]]["scaling_coeff"] = [united / r if r > 0 else 1.0 for r in group_rms]

    def _momentum_of(self, g: int, exp_avg: torch.Tensor) -> torch.Tensor:
        if self._momentum[g] is None:
            rows = self.rows[g]
            momentum = rows.from_partition(exp_avg)
            if momentum is None:  # stages 1-2: every rank's exp_avg partition
                from partita.distributed import collectives

                momentum = rows.empty()
                collectives.all_gather_into_tensor(momentum.view(-1), exp_avg, group=self._sharded.process_group,
                                                   purpose=f"{self.purpose}: momentum rebuild")
            self._momentum[g] = momentum
        return self._momentum[g]

    def _compressed_update(self, grads: list[torch.Tensor], used: list[list[bool]]) -> None:
        if "scaling_coeff" not in self.init_state(self.param_groups[0]["params"][0]):
            self._scaling()
        self.lamb_coeffs = []
        for g, options in enumerate(self.param_groups):
            master = options["params"][0]
            state = self.init_state(master)
            rows, spans = self.rows[g], _spans(self.zero_groups[g])
            beta1, beta2 = options["betas"]
            exp_avg = state["exp_avg"]
            last = exp_avg.clone()
            # Every element's scaling (padding: the first parameter's; it is zero and masked anyway).
            scaling = torch.tensor(state["scaling_coeff"], dtype=torch.float32, device=master.device)[rows.segments]
            estimate = grads[g].mul_(1 - beta1).add_(self._momentum_of(g, exp_avg), alpha=beta1).mul_(scaling)
            self._momentum[g] = self.exchange(g, estimate, used[g]).div_(scaling)
            exp_avg.copy_(rows.own(self._momentum[g]))
            fresh = state.setdefault("exp_avg_sq_fresh", state["exp_avg_sq"].clone())
            rebuilt = (exp_avg - last * beta1) / (1 - beta1)
            fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
            denom = state["exp_avg_sq"].sqrt().add_(options["eps"])
            prelim = exp_avg / denom
            update = prelim.clone()
            if options["weight_decay"] > 0:
                update.add_(master, alpha=options["weight_decay"])
            factors = self._maxes(denom / (fresh.sqrt() + options["eps"]), spans)
            update_norms = self._norms(update, spans)
            prelim_norms = self._norms(prelim, spans) if options["weight_decay"] > 0 else update_norms
            for j, span in enumerate(spans):
                if not used[g][j]:
                    self.lamb_coeffs.append(0.0)
                    continue  # no gradient anywhere: weights and state are put back (unused_params.py)
                factor = factors[j]
                if options["weight_decay"] > 0:
                    share = min(1.0, prelim_norms[j] / update_norms[j]) if update_norms[j] > 0 else 1.0
                    factor = factor * share + (1.0 - share)
                factor = min(max(factor, self.factor_min), self.factor_max)
                previous = state["last_factor"][j]
                factor = min(max(factor, previous * (1.0 - self.factor_threshold)), previous * (1.0 + self.factor_threshold))
                state["last_factor"][j] = factor
                self.lamb_coeffs.append(state["lamb_coeff_freeze"][j] * factor)
                master[span].add_(update[span], alpha=-options["lr"] * self.lamb_coeffs[-1])
            state["step"] += 1
