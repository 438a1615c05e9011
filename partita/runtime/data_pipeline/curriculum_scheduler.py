"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: ``CurriculumScheduler`` is refused
(Megatron-DeepSpeed imports it for seqlen-based curriculum learning)."""

from partita.runtime._missing import refuse
from partita.runtime.data_pipeline import _WHY

__all__: list[str] = []

MISSING = {
    "CurriculumScheduler": (
        f"deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler is not in partita: {_WHY}; to "
        "grow the sequence length by hand, cut each batch to the length you want before engine(batch)"
    ),
}

__getattr__ = refuse(__name__, MISSING)
