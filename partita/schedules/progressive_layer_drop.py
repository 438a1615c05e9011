"""Progressive layer dropping (Zhang and He, 2020, https://arxiv.org/abs/2010.13369): DeepSpeed's
``ProgressiveLayerDrop``.

The model drops each transformer layer with a probability that grows during training; the engine
only supplies the schedule. Every training forward gets ``progressive_layer_drop=True,
pld_theta=<theta>``, where after optimizer step ``t`` (counted from 0)

    theta(t) = (1 - theta) * exp(-gamma * t) + theta

so the keep probability starts at 1 and decays towards ``theta``. As in DeepSpeed, the value is
updated at each accumulation boundary with the step count *before* it advances, so the forwards
of global step 0 and 1 both see 1.0 and those of step ``s >= 1`` see ``theta(s - 1)``; every
micro-batch of one step sees the same value. What the model does with it is the model's business
(bing_bert's ``BertEncoder`` keeps layer ``i`` with probability ``1 - i / L * (1 - theta)``).
"""

from __future__ import annotations

import math

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop:
    """The PLD schedule. ``theta``: the keep probability theta(t) decays to; ``gamma``: how fast."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_state(self) -> dict[str, object]:
        """The keyword arguments a training forward receives."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def theta_at(self, global_step: int) -> float:
        """theta(t) after optimizer step ``global_step`` (0-based)."""
        return (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta

    def update_state(self, global_step: int) -> None:
        """Called at the accumulation boundary with the step count before it advances."""
        self.current_theta = self.theta_at(global_step)

    def resume(self, global_steps: int) -> None:
        """The value after ``global_steps`` completed steps, for a resumed run. DeepSpeed does not save
        it (its first step after a resume sees 1.0); partita recomputes it from the step count."""
        self.current_theta = 1.0 if global_steps == 0 else self.theta_at(global_steps - 1)
