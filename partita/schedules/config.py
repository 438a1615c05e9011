"""Config sections of the forward schedules: ``progressive_layer_drop`` and the legacy top-level
``curriculum_learning`` (DeepSpeed 0.18.9's keys; DeepSpeed 0.19 removed both blocks)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import JsonInt, StrictSection

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]

# The schedule_config keys each schedule_type reads (DeepSpeed's CurriculumScheduler).
SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}
_EXAMPLE = {
    "fixed_linear": '{"total_curriculum_step": 30000, "difficulty_step": 8}',
    "fixed_root": '{"total_curriculum_step": 30000, "difficulty_step": 8, "root_degree": 2}',
    "fixed_discrete": '{"difficulty": [64, 128, 256], "max_step": [1000, 2000]}',
}


class ProgressiveLayerDropConfig(StrictSection):
    """DeepSpeed's ``progressive_layer_drop``: each training forward gets ``progressive_layer_drop=True,
    pld_theta=theta(t)``, theta(t) = (1 - theta) * exp(-gamma * t) + theta. Off by default."""

    enabled: bool = Field(False, description="Pass the PLD keyword arguments to the model's forward. DeepSpeed default false.")
    theta: float = Field(
        0.5, gt=0, le=1,
        description="Keep probability theta(t) decays to (lower trains faster, drops more layers). Required when enabled.",
    )
    gamma: float = Field(
        0.001, ge=0, description="Decay rate of theta(t) per optimizer step. Required when enabled."
    )

    @model_validator(mode="after")
    def _both_given(self) -> ProgressiveLayerDropConfig:
        missing = [k for k in ("theta", "gamma") if k not in self.model_fields_set]
        if self.enabled and missing:
            # DeepSpeed 0.18.9 reads both keys without a default (a KeyError at initialize).
            raise PydanticCustomError(
                "pld_missing",
                "progressive_layer_drop is enabled but {missing} not set; DeepSpeed requires both, e.g. "
                "\"progressive_layer_drop\": {example}",
                {"missing": " and ".join(missing) + (" are" if len(missing) > 1 else " is"),
                 "example": '{"enabled": true, "theta": 0.5, "gamma": 0.001}'},
            )
        return self


class CurriculumScheduleConfig(StrictSection):
    """``curriculum_learning.schedule_config``: which keys apply depends on ``schedule_type``."""

    total_curriculum_step: JsonInt | None = Field(
        None, ge=1, description="fixed_linear / fixed_root: steps from min_difficulty to max_difficulty."
    )
    difficulty_step: JsonInt | None = Field(
        None, ge=1,
        description="fixed_linear / fixed_root: every difficulty is a multiple of this (8 for fp16 tensor cores).",
    )
    root_degree: float | None = Field(None, gt=0, description="fixed_root: 2 is a square root, 1 is linear.")
    difficulty: list[JsonInt] | None = Field(None, description="fixed_discrete: the difficulties, in order.")
    max_step: list[JsonInt] | None = Field(
        None, description="fixed_discrete: the last step of each difficulty but the last (one fewer than difficulty)."
    )


class CurriculumLearningConfig(StrictSection):
    """DeepSpeed's legacy top-level ``curriculum_learning``: the engine updates the difficulty at every
    training forward and, for ``curriculum_type`` "seqlen", passes ``curriculum_seqlen=<difficulty>``.
    Off by default. (``data_efficiency.data_sampling.curriculum_learning`` is another feature.)"""

    enabled: bool = Field(False, description="Run the curriculum schedule. DeepSpeed default false.")
    curriculum_type: str = Field(
        "seqlen",
        min_length=1,
        description=(
            "What the difficulty measures. \"seqlen\": forward gets curriculum_seqlen=<difficulty>; any other "
            "name only updates engine.curriculum_scheduler_legacy. Default \"seqlen\"."
        ),
    )
    min_difficulty: JsonInt | None = Field(None, description="The first difficulty. Required when enabled.")
    max_difficulty: JsonInt | None = Field(None, description="The last difficulty. Required when enabled.")
    schedule_type: ScheduleType | None = Field(
        None,
        description=(
            "fixed_linear, fixed_root, fixed_discrete, or custom (engine.curriculum_scheduler_legacy."
            "set_custom_get_difficulty(fn)). Required when enabled."
        ),
    )
    schedule_config: CurriculumScheduleConfig = Field(
        default_factory=CurriculumScheduleConfig, description="The schedule's parameters (see schedule_type)."
    )

    @model_validator(mode="after")
    def _complete(self) -> CurriculumLearningConfig:
        if self.enabled:
            check_curriculum(self.model_dump(exclude_unset=False))
        return self


def check_curriculum(config: dict[str, Any]) -> None:
    """Raise PydanticCustomError for an incomplete or inconsistent curriculum (config as a dict)."""

    def fail(error: str, message: str, **values: Any) -> None:
        raise PydanticCustomError(f"curriculum_{error}", message, values)

    missing = [k for k in ("min_difficulty", "max_difficulty", "schedule_type") if config.get(k) is None]
    if missing:
        fail("missing", "curriculum learning requires {missing}, e.g. \"min_difficulty\": 64, \"max_difficulty\": "
             "1024, \"schedule_type\": \"fixed_linear\"", missing=", ".join(missing))
    low, high, kind = config["min_difficulty"], config["max_difficulty"], config["schedule_type"]
    if low > high:
        fail("range", "curriculum_learning.min_difficulty ({low}) is greater than max_difficulty ({high}); swap them",
             low=low, high=high)
    schedule = {k: v for k, v in (config.get("schedule_config") or {}).items() if v is not None}
    wanted = SCHEDULE_KEYS[kind]
    absent = [k for k in wanted if k not in schedule]
    if absent:
        fail("schedule_missing", "curriculum_learning.schedule_type \"{kind}\" requires schedule_config {absent}, e.g. "
             "\"schedule_config\": {example}", kind=kind, absent=", ".join(absent), example=_EXAMPLE[kind])
    extra = [k for k in schedule if k not in wanted and kind != "custom"]
    if extra:
        fail("schedule_extra", "curriculum_learning.schedule_config {extra} has no effect with schedule_type \"{kind}\" "
             "(it reads {wanted}); remove it", extra=", ".join(extra), kind=kind, wanted=", ".join(wanted))
    if kind == "fixed_discrete":
        difficulty, max_step = schedule["difficulty"], schedule["max_step"]
        if not max_step or len(difficulty) != len(max_step) + 1:
            fail("discrete_lengths", "fixed_discrete needs one more difficulty than max_step (the last difficulty "
                 "holds for all later steps) and at least one max_step; got {n} difficulties and {m} max_steps",
                 n=len(difficulty), m=len(max_step))
        if any(b <= a for a, b in zip(max_step, max_step[1:])):
            fail("discrete_order", "curriculum_learning.schedule_config.max_step must increase, got {max_step}",
                 max_step=max_step)
