"""DeepSpeed's ``CurriculumScheduler``: a difficulty (for "seqlen", the sequence length) that grows
from ``min_difficulty`` to ``max_difficulty`` with the optimizer step.

Schedules (``schedule_type``), for a step count ``s``:

- ``fixed_linear``: ``min + (max - min) * s / total_curriculum_step``, floored, then rounded down to
  a multiple of ``difficulty_step``, never below the first multiple of it at or above ``min``
  (DeepSpeed 0.19.8's rule; 0.18.9 could return 0 there), never above ``max``.
- ``fixed_root``: the same with ``(s / total_curriculum_step) ** (1 / root_degree)``.
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, the last
  difficulty after the last max_step.
- ``custom``: ``fn(s)`` of :meth:`CurriculumScheduler.set_custom_get_difficulty`.

:meth:`update_difficulty` moves the current difficulty only while it is below ``max_difficulty``.
The engine calls it at every training forward with ``global_steps + 1`` (so the forwards of step 0
use ``s = 1``); Megatron-DeepSpeed builds the scheduler itself from its config dict and calls
``update_difficulty(iteration + 1)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from partita.config.base import ConfigError
from partita.schedules.config import CurriculumLearningConfig

__all__ = ["CurriculumScheduler"]

logger = logging.getLogger("partita")

_STATE_KEYS = ("min_difficulty", "max_difficulty", "current_difficulty", "schedule_type", "schedule_config")


class CurriculumScheduler:
    """The curriculum schedule, built from DeepSpeed's ``curriculum_learning`` dict (the ``enabled``
    and ``curriculum_type`` keys may be there and are not read). ``state`` holds min_difficulty,
    max_difficulty, current_difficulty, schedule_type and schedule_config, as in DeepSpeed."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"CurriculumScheduler needs the curriculum_learning dict, got {type(config).__name__}")
        try:
            section = CurriculumLearningConfig.model_validate({**config, "enabled": True})
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'curriculum_learning'}: {e['msg']}"
                                 for e in error.errors())
            raise ConfigError(f"CurriculumScheduler: {problems}") from None
        schedule = {k: v for k, v in section.schedule_config.model_dump().items() if v is not None}
        self.state: dict[str, Any] = {
            "min_difficulty": section.min_difficulty,
            "max_difficulty": section.max_difficulty,
            "current_difficulty": section.min_difficulty,
            "schedule_type": section.schedule_type,
            "schedule_config": schedule,
        }
        self.custom_get_difficulty: Callable[[int], int] | None = None
        step = schedule.get("difficulty_step")
        if step is not None and step % 8 != 0:
            logger.warning(
                "curriculum_learning.schedule_config.difficulty_step %d is not a multiple of 8: for the seqlen metric, "
                "multiples of 8 (fp16) or 16 (int8) keep NVIDIA tensor cores busy; ignore this for other metrics", step)

    # ------------------------------------------------------------------ DeepSpeed's API
    def get_current_difficulty(self) -> int:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The difficulty function of schedule_type "custom": global step -> difficulty."""
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"CurriculumScheduler.set_state: the state lacks {', '.join(missing)}; pass what "
                             "get_state() returned")
        self.state = dict(state)

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at step count ``global_steps`` (without moving the current one)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1)
        if kind == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                "curriculum_learning.schedule_type is \"custom\" but no difficulty function is set; call "
                "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn) (fn: global step -> difficulty) "
                "before the first training forward")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move the current difficulty to the schedule's at ``global_steps`` unless it reached the maximum."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    # ------------------------------------------------------------------ schedules
    def _discrete(self, global_steps: int) -> int:
        schedule = self.state["schedule_config"]
        for difficulty, last_step in zip(schedule["difficulty"], schedule["max_step"]):
            if global_steps <= last_step:
                return difficulty
        return schedule["difficulty"][-1]

    def _root(self, global_steps: int, degree: float) -> int:
        schedule = self.state["schedule_config"]
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        step = schedule["difficulty_step"]
        fraction = (float(global_steps) / schedule["total_curriculum_step"]) ** (1.0 / degree)
        value = math.floor(fraction * (high - low) + low)
        value -= value % step
        first = -(-low // step) * step  # the first multiple of the step at or above min_difficulty
        return min(max(value, first), high)
