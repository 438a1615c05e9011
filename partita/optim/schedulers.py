"""DeepSpeed's learning-rate schedules as torch ``LRScheduler`` subclasses.

Being torch schedulers, they work with any torch optimizer, their ``state_dict`` /
``load_state_dict`` are torch's, and code that expects a torch scheduler (``get_last_lr``,
checkpoint helpers) keeps working. The formulas, parameter names and step counting are
DeepSpeed's (0.19.8), so a DeepSpeed config trains with the same lr at every step.

Step convention: ``last_epoch`` counts completed ``step()`` calls (one per optimizer step, as
the engine does); the lr in the optimizer is always ``_lrs_at(last_epoch)``, the lr of the
next optimizer step.

- OneCycle: ``_lrs_at(k) = formula(k)``, as DeepSpeed's OneCycle.
- The three Warmup* schedules follow DeepSpeed's lagging counter: DeepSpeed's constructor sets
  the lr "before step 0" (``warmup_min_lr``; a ratio of 0, so lr 0, for WarmupCosineLR) and its
  ``step()`` then evaluates the formula at ``last_batch_iteration = k - 1`` after ``k`` steps.
  So ``_lrs_at(0)`` is the before-start value and ``_lrs_at(k) = formula(k - 1)``: the first
  two optimizer steps both run at the minimum lr, and the warm-up reaches its peak one step
  later than the formula alone says. The classes expose DeepSpeed's counter as
  ``last_batch_iteration`` (``last_epoch - 1``). Skipping that repeated step (partita before
  this) trained with a different lr at every step of the warm-up, which moved the losses 1e-4
  after the first update and 3% by step 40 on DeepSpeedExamples' CIFAR script.

Other deliberate differences from DeepSpeed, each noted where it applies: WarmupDecayLR with
no ``warmup_max_lr`` warms each param group up to its own lr (DeepSpeed: 0.001); OneCycle
keeps the optimizer's beta2 when cycling momentum (DeepSpeed writes 0.99), cycles SGD's
``momentum`` too, and sets the step-0 momentum from the formula.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from partita.optim.config import SchedulerConfig

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "build_scheduler"]

_WARMUP_TYPES = ("log", "linear")


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    _check_int("warmup_num_steps", warmup_num_steps, 1)
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {_WARMUP_TYPES}, got {warmup_type!r}")
    # DeepSpeed's clamp: log warmup divides by log(warmup_num_steps), which is 0 for 1.
    return max(2, warmup_num_steps)


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 at iteration 0, rising to (log: exactly; linear: almost) 1 at warmup_num_steps - 1.

    Log warm-up multiplies by ``1 / log(W)`` rather than dividing by ``log(W)``: DeepSpeed's
    rounding, so the lr is DeepSpeed's to the last bit.
    """
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _ClosedFormSchedule(LRScheduler):
    """A schedule given by ``_lrs_at(step)``; subclasses implement only that formula."""

    def _lrs_at(self, step: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self._lrs_at(self.last_epoch)

    def _get_closed_form_lr(self) -> list[float]:
        return self._lrs_at(self.last_epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then put the loaded step's values into the optimizer right away.

        torch only restores the counter; re-applying makes the lr correct even when the
        optimizer's own state was not (or not yet) loaded.
        """
        super().load_state_dict(state_dict)
        self._apply(self.last_epoch)

    def _apply(self, step: int) -> None:
        for group, lr in zip(self.optimizer.param_groups, self._lrs_at(step), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class _LaggedSchedule(_ClosedFormSchedule):
    """A Warmup* schedule on DeepSpeed's counter: after ``k`` steps, ``formula(k - 1)``.

    Subclasses implement ``_lrs_at_iteration(i)`` for DeepSpeed's ``last_batch_iteration``
    ``i >= 0`` and ``_lrs_before_start()``, the lr DeepSpeed's constructor sets.
    """

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name and value for the counter: -1 before the first ``step()``."""
        return self.last_epoch - 1

    def _lrs_at(self, step: int) -> list[float]:
        if step <= 0:
            return self._lrs_before_start()
        return self._lrs_at_iteration(step - 1)

    def _lrs_at_iteration(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _lrs_before_start(self) -> list[float]:
        raise NotImplementedError


class WarmupLR(_LaggedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    At DeepSpeed's iteration ``i`` (``k - 1`` after ``k`` optimizer steps, see the module doc):
    ``lr = min + (max - min) * w(i)`` for ``i < W``, else ``max``, where
    ``W = max(2, warmup_num_steps)`` and ``w(i) = log(i + 1) / log(W)`` ("log") or
    ``i / W`` ("linear"). Before the first ``step()`` the lr is ``min``. So the k-th optimizer
    step (1-based) runs at ``min`` for k = 1 and 2, then at ``min + (max - min) * w(k - 2)``.
    ``warmup_max_lr=None`` (DeepSpeed 0.19's default) warms each param group up to its own lr,
    as DeepSpeed 0.19.8 does.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_lr = float(warmup_min_lr)
        self.warmup_max_lr = None if warmup_max_lr is None else float(warmup_max_lr)
        super().__init__(optimizer, last_epoch)

    def _max_lrs(self) -> list[float]:
        if self.warmup_max_lr is None:
            return [float(lr) for lr in self.base_lrs]
        return [self.warmup_max_lr] * len(self.base_lrs)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at_iteration(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        low = self.warmup_min_lr
        return [low + (high - low) * gamma for high in self._max_lrs()]

    def _lrs_before_start(self) -> list[float]:
        return [self.warmup_min_lr] * len(self.base_lrs)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to ``warmup_min_lr`` at ``total_num_steps``.

    After warmup (DeepSpeed's iteration ``i >= W``, ``i = k - 1`` after ``k`` steps),
    ``lr = min + (max - min) * g(i)`` with ``g(i) = max(0, (T - i) / max(1, T - W))``,
    ``T = total_num_steps``; so the lr reaches ``warmup_min_lr`` at iteration T (after T + 1
    optimizer steps) and stays there.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_int("total_num_steps", total_num_steps, 1)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
            last_epoch=last_epoch,
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_LaggedSchedule):
    """Ratios of each group's base lr: warm up, then cosine decay to ``cos_min_ratio``.

    At DeepSpeed's iteration ``i`` (``k - 1`` after ``k`` optimizer steps):
    ``lr = base_lr * r(i)``. Warmup (``i < W``): ``r = wmin + (1 - wmin) * w(i)``
    (``w`` as in WarmupLR). After: ``p = min(1, (i - W + 1) / max(1, T - W))`` and
    ``r = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2)``; the ratio stays at
    ``cos_min_ratio`` from iteration T - 1 on. Before the first ``step()`` the ratio is 0, as
    DeepSpeed's: the first optimizer step runs at lr 0 even when ``warmup_min_ratio > 0``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_int("total_num_steps", total_num_steps, 1)
        for name, ratio in (
            ("warmup_min_ratio", warmup_min_ratio),
            ("cos_min_ratio", cos_min_ratio),
        ):
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {ratio!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at_iteration(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]

    def _lrs_before_start(self) -> list[float]:
        return [0.0] * len(self.base_lrs)


class OneCycle(_ClosedFormSchedule):
    """1Cycle: lr min -> max -> min over one cycle, then optional decay; momentum inverse.

    With ``S1 = cycle_first_step_size``, ``S2 = cycle_second_step_size`` (default S1) and
    ``n`` the step: for ``n <= S1 + S2`` the scale is ``s = n / S1`` on the way up and
    ``s = (S1 + S2 - n) / S2`` on the way down; a stair count ``k > 0`` for that half
    quantises it to ``floor(s * k) / k`` (computed in integers). ``lr = min + (max - min) * s``
    and ``momentum = max_mom - (max_mom - min_mom) * s``. After the cycle, with
    ``d = n - S1 - S2``: ``lr = min / (1 + decay_lr_rate * d / decay_step_size)`` and
    ``momentum = max_mom * (1 + decay_mom_rate * d / decay_step_size)`` (constant when
    ``decay_step_size`` or the rate is 0). Momentum is beta1 of ``betas`` (beta2 kept) or
    SGD's ``momentum``; other optimizers get a warning and no momentum cycling.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        first = _check_int("cycle_first_step_size", cycle_first_step_size, 1)
        second = first
        if cycle_second_step_size is not None:
            second = _check_int("cycle_second_step_size", cycle_second_step_size, 1)
        first_stairs = _check_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        second_stairs = first_stairs
        if cycle_second_stair_count is not None:
            second_stairs = _check_int("cycle_second_stair_count", cycle_second_stair_count, 0)
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, 0)
        self.cycle_min_lr = float(cycle_min_lr)
        self.cycle_max_lr = float(cycle_max_lr)
        self.decay_lr_rate = float(decay_lr_rate)
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = first_stairs
        self.second_stair_count = second_stairs
        self.cycle_min_mom = float(cycle_min_mom)
        self.cycle_max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.momentum_key = _momentum_key(optimizer) if cycle_momentum else None
        super().__init__(optimizer, last_epoch)

    @property
    def total_size(self) -> int:
        return self.first_step_size + self.second_step_size

    def _scale(self, step: int) -> float:
        position = step % self.total_size
        if position <= self.first_step_size:
            numerator, size, stairs = position, self.first_step_size, self.first_stair_count
        else:
            numerator = self.total_size - position
            size, stairs = self.second_step_size, self.second_stair_count
        if stairs > 0:
            return ((numerator * stairs) // size) / stairs
        return numerator / size

    def _decay_interval(self, step: int) -> float:
        return (step - self.total_size) / self.decay_step_size

    def _lrs_at(self, step: int) -> list[float]:
        if step <= self.total_size:
            lr = self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self._scale(step)
        elif self.decay_step_size == 0 or self.decay_lr_rate == 0.0:
            lr = self.cycle_min_lr
        else:
            lr = self.cycle_min_lr / (1.0 + self.decay_lr_rate * self._decay_interval(step))
        return [lr] * len(self.optimizer.param_groups)

    def momentum_at(self, step: int) -> float:
        """The momentum (beta1) the schedule sets after ``step`` scheduler steps."""
        if step <= self.total_size:
            span = self.cycle_max_mom - self.cycle_min_mom
            return self.cycle_max_mom - span * self._scale(step)
        if self.decay_step_size == 0 or self.decay_mom_rate == 0.0:
            return self.cycle_max_mom
        return self.cycle_max_mom * (1.0 + self.decay_mom_rate * self._decay_interval(step))

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._apply_momentum(self.last_epoch)

    def _apply(self, step: int) -> None:
        super()._apply(step)
        self._apply_momentum(step)

    def _apply_momentum(self, step: int) -> None:
        if self.momentum_key is None:
            return
        momentum = self.momentum_at(step)
        for group in self.optimizer.param_groups:
            if self.momentum_key == "betas":
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum


def _momentum_key(optimizer: torch.optim.Optimizer) -> str | None:
    for key in ("betas", "momentum"):
        if key in optimizer.defaults:
            return key
    warnings.warn(
        f"OneCycle: cycle_momentum is ignored because {type(optimizer).__name__} has neither "
        "'betas' nor 'momentum'; set cycle_momentum false to silence this warning",
        UserWarning,
        stacklevel=3,
    )
    return None


_SCHEDULERS: dict[str, type[_ClosedFormSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """Construct the scheduler a validated ``scheduler`` section describes.

    Construction already sets the optimizer's lr to the schedule's step-0 value; call
    ``step()`` once after every optimizer step.
    """
    return _SCHEDULERS[config.type](optimizer, **config.params.model_dump())
