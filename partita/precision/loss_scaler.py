"""fp16 loss scaling with DeepSpeed's dynamics.

Why not ``torch.amp.GradScaler``: its dynamics differ (no hysteresis, growth counted
differently), and DeepSpeed users tune ``hysteresis`` / ``consecutive_hysteresis`` /
``min_loss_scale`` in their configs; to mean the same thing here the scaler must follow
DeepSpeed's rules step for step. The scaler is pure bookkeeping on Python numbers: the
engine finds overflow (an inf/nan check all-reduced across ranks), skips the optimizer step
when there is one, and reports it through :meth:`DynamicLossScaler.update`.

Dynamics of :class:`DynamicLossScaler` (DeepSpeed's, including its counting):

* Overflow: if the hysteresis budget is spent (``cur_hysteresis == 1``, or
  ``hysteresis == 1``) the scale is divided by ``scale_factor``, not below ``min_scale``;
  an overflow with the budget spent while already at ``min_scale`` raises
  :class:`LossScaleAtMinimumError`. Otherwise the budget drops by one and the scale is kept.
  The budget is not refilled by a decrease, so once spent every further overflow shrinks
  the scale until it is refilled.
* Clean step: with ``consecutive_hysteresis`` the budget is refilled. The scale is
  multiplied by ``scale_factor`` when the number of clean updates since the last overflow
  (or since the start), not counting this one, is a positive multiple of ``scale_window``:
  the first growth comes on the ``scale_window + 1``-th clean update, later ones every
  ``scale_window`` clean updates. Without ``consecutive_hysteresis`` growth refills the
  budget.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "LossScaleAtMinimumError",
    "StaticLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "build_loss_scaler",
]


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflowed even at the minimum loss scale; training cannot go on."""


def _positive_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e3 from JSON
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale`` > 0); overflowing steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self._scale = _positive_finite("loss scale", scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        """Nothing to adapt: the scale is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_type(state_dict, "static")
        self._scale = _positive_finite("loss scale", state_dict["scale"])


class DynamicLossScaler:
    """Loss scale that shrinks on overflow and grows after a run of clean steps.

    Args:
        init_scale: first scale (DeepSpeed: ``2 ** fp16.initial_scale_power``).
        scale_window: clean updates between growths (``fp16.loss_scale_window``).
        hysteresis: overflows tolerated before shrinking (``fp16.hysteresis``); 1 shrinks
            on every overflow.
        min_scale: the scale never goes below this (``fp16.min_loss_scale``).
        consecutive_hysteresis: refill the hysteresis budget on every clean update, so only
            ``hysteresis`` overflows in a row shrink the scale.
        scale_factor: shrink divisor and growth multiplier.
    """

    dynamic = True

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
    ) -> None:
        self.init_scale = _positive_finite("init_scale", init_scale)
        self.scale_window = _positive_int("scale_window", scale_window)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_scale = _positive_finite("min_scale", min_scale)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = _positive_finite("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        if self.init_scale < self.min_scale:
            raise ValueError(
                f"init_scale ({init_scale}) is below min_scale ({min_scale}); raise "
                "fp16.initial_scale_power or lower fp16.min_loss_scale"
            )
        self._scale = self.init_scale
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0  # updates seen so far
        self.last_overflow_iter = -1  # update index of the last overflow (-1: none yet)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome: ``overflow`` means inf/nan gradients."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.hysteresis > 1 and self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            return
        if self._scale == self.min_scale:
            raise LossScaleAtMinimumError(
                f"fp16 gradients overflowed (inf/nan) at the minimum loss scale {self.min_scale:g} "
                f"after {self.cur_iter} updates; the scale cannot shrink further, so training "
                "stopped. Try bf16 instead of fp16 (\"bf16\": {\"enabled\": true}, no loss "
                "scaling needed), a lower learning rate or more warmup, gradient clipping, and "
                "check the data for inf/nan or extreme values; lowering fp16.min_loss_scale "
                "only helps if the overflow is marginal."
            )
        self._scale = max(self._scale / self.scale_factor, self.min_scale)

    def _on_clean(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        clean_before = self.cur_iter - self.last_overflow_iter - 1
        if clean_before > 0 and clean_before % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            self._scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        """The evolving state; settings come from the config on resume."""
        return {
            "type": "dynamic",
            "scale": self._scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_type(state_dict, "dynamic")
        self._scale = _positive_finite("loss scale", state_dict["scale"])
        self.cur_hysteresis = int(state_dict["cur_hysteresis"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])


LossScaler = StaticLossScaler | DynamicLossScaler


def _check_type(state_dict: dict[str, Any], expected: str) -> None:
    found = state_dict.get("type")
    if found != expected:
        raise ValueError(
            f"loss-scaler state is for a {found!r} scaler, this run uses a {expected!r} one "
            "(fp16.loss_scale 0 = dynamic, > 0 = static); match the checkpoint's fp16 "
            "settings or skip loading the loss-scaler state"
        )


def build_loss_scaler(fp16: Any) -> LossScaler:
    """The scaler for an ``fp16`` config section (any object with FP16Config's fields).

    ``loss_scale == 0`` gives a :class:`DynamicLossScaler` starting at
    ``2 ** initial_scale_power``; a positive ``loss_scale`` a :class:`StaticLossScaler`.
    With fp16 disabled (fp32 or bf16) the result is a static scale of 1, so callers can
    always multiply by ``.scale``.
    """
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale == 0:
        return DynamicLossScaler(
            init_scale=2.0 ** fp16.initial_scale_power,
            scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_scale=fp16.min_loss_scale,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )
    return StaticLossScaler(fp16.loss_scale)
