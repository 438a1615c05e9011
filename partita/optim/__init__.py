"""Optimizers and learning-rate schedules built from the config's ``optimizer`` and
``scheduler`` sections (DeepSpeed's names, defaults and formulas)."""

from partita.optim.config import OptimizerConfig, SchedulerConfig
from partita.optim.factory import build_optimizer, required_alignment
from partita.optim.lion import Lion
from partita.optim.schedulers import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "build_optimizer",
    "required_alignment",
    "build_scheduler",
    "Lion",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
]
