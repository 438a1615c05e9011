"""The forward schedules the engine runs: what each training forward gets as extra keyword arguments.

DeepSpeed's engine (0.18.9) adds, for a module in training mode:

- progressive layer drop: ``progressive_layer_drop=True, pld_theta=<theta>``; theta moves at each
  accumulation boundary (:meth:`ForwardSchedules.at_boundary`).
- legacy curriculum: before each training forward ``update_difficulty(global_steps + 1)``, then for
  ``curriculum_type`` "seqlen" ``curriculum_seqlen=<difficulty>``.

In eval mode nothing is added. The pipeline engine adds nothing either (DeepSpeed's pipeline engine
does not pass the curriculum, and its stages' forward takes one input, so progressive layer drop is
refused there at initialize).

Checkpoints: DeepSpeed saves neither schedule; its curriculum comes back because it is recomputed
from ``global_steps`` at the first forward, but its PLD theta restarts at 1.0 for the first step
after a resume. partita saves both (:meth:`state_dict`) and restores theta from the step count, so
a resumed run sees what an uninterrupted one would.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from partita.config.base import ConfigError
from partita.schedules.curriculum import CurriculumScheduler
from partita.schedules.progressive_layer_drop import ProgressiveLayerDrop

__all__ = ["ForwardSchedules", "build_forward_schedules"]


class ForwardSchedules:
    """Progressive layer drop and/or the legacy curriculum of one engine."""

    def __init__(self, *, pld: ProgressiveLayerDrop | None, curriculum: CurriculumScheduler | None,
                 curriculum_type: str = "seqlen", pass_kwargs: bool = True) -> None:
        self.pld = pld
        self.curriculum = curriculum
        self.curriculum_type = curriculum_type
        self._pass_kwargs = pass_kwargs  # False for the pipeline engine

    def forward_kwargs(self, *, training: bool, global_steps: int) -> dict[str, Any]:
        """The keyword arguments to add to this forward (updates the curriculum, as DeepSpeed does)."""
        if not training or not self._pass_kwargs:
            return {}
        extra: dict[str, Any] = self.pld.get_state() if self.pld is not None else {}
        if self.curriculum is not None:
            difficulty = self.curriculum.update_difficulty(global_steps + 1)
            if self.curriculum_type == "seqlen":
                extra["curriculum_seqlen"] = difficulty
        return extra

    def at_boundary(self, global_steps: int) -> None:
        """At the accumulation boundary, with the step count before it advances."""
        if self.pld is not None:
            self.pld.update_state(global_steps)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.pld is not None:
            state["progressive_layer_drop"] = {"current_theta": self.pld.get_theta()}
        if self.curriculum is not None:
            state["curriculum_learning"] = {"current_difficulty": self.curriculum.get_current_difficulty()}
        return state

    def load_state_dict(self, state: dict[str, Any] | None, *, global_steps: int) -> None:
        """Restore after a checkpoint load. The schedules' settings come from this run's config; theta
        is recomputed from ``global_steps`` (so a checkpoint saved without PLD resumes right too)."""
        if self.pld is not None:
            self.pld.resume(global_steps)
        saved = (state or {}).get("curriculum_learning")
        if self.curriculum is not None and saved is not None:
            self.curriculum.set_current_difficulty(saved["current_difficulty"])


def _accepts(module: nn.Module, names: tuple[str, ...]) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # not introspectable: let the call decide
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    given = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return all(name in given for name in names)


def build_forward_schedules(config: Any, module: nn.Module) -> ForwardSchedules | None:
    """The schedules ``config`` enables (None when neither is), checked against ``module.forward``."""
    if config is None:
        return None
    pld_config, curriculum_config = config.progressive_layer_drop, config.curriculum_learning
    if not pld_config.enabled and not curriculum_config.enabled:
        return None
    from partita.pipe.module import PipelineModule

    pipeline = isinstance(module, PipelineModule)
    name = type(module).__name__
    pld = None
    if pld_config.enabled:
        if pipeline:
            raise ConfigError(
                "progressive_layer_drop is enabled with a pipeline model: its stages' forward takes one input, so "
                "the engine cannot pass progressive_layer_drop/pld_theta (DeepSpeed fails there with a TypeError); "
                "disable it, or train the model without partita.pipe.PipelineModule")
        if not _accepts(module, ("progressive_layer_drop", "pld_theta")):
            raise ConfigError(
                f"progressive_layer_drop is enabled: every training forward is called with progressive_layer_drop=True, "
                f"pld_theta=<float>, but {name}.forward accepts neither; add the parameters "
                "(def forward(self, ..., progressive_layer_drop=False, pld_theta=None)) or **kwargs, or set "
                "\"progressive_layer_drop\": {\"enabled\": false}")
        pld = ProgressiveLayerDrop(theta=pld_config.theta, gamma=pld_config.gamma)
    curriculum = None
    if curriculum_config.enabled:
        curriculum = CurriculumScheduler(curriculum_config.model_dump())
        if (curriculum_config.curriculum_type == "seqlen" and not pipeline
                and not _accepts(module, ("curriculum_seqlen",))):
            raise ConfigError(
                f"curriculum_learning (curriculum_type \"seqlen\") is enabled: every training forward is called with "
                f"curriculum_seqlen=<int>, but {name}.forward does not accept it; add the parameter "
                "(def forward(self, ..., curriculum_seqlen=None)) or **kwargs, or set "
                "\"curriculum_learning\": {\"enabled\": false}")
    return ForwardSchedules(pld=pld, curriculum=curriculum, curriculum_type=curriculum_config.curriculum_type,
                            pass_kwargs=not pipeline)
