"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: DeepSpeed's ``CurriculumScheduler``, built from
the legacy ``"curriculum_learning"`` dict (Megatron-DeepSpeed builds it itself and calls
``update_difficulty(iteration + 1)``); partita's :class:`partita.schedules.curriculum.CurriculumScheduler`."""

from partita.schedules.curriculum import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
