"""``deepspeed.runtime.lr_schedules``: DeepSpeed's learning-rate schedules, partita's
(:mod:`partita.optim.schedulers`): ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``, with DeepSpeed's arguments and values. The config's ``"scheduler"`` section builds
the same classes. ``LRRangeTest`` and the schedule tuner's command-line flags are refused.
"""

from partita.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from partita.runtime._missing import refuse

__all__ = ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

MISSING = {
    "LRRangeTest": (
        "deepspeed.runtime.lr_schedules.LRRangeTest (the learning-rate range test) is not in partita: sweep the "
        "rate with WarmupLR(warmup_type=\"linear\") over a short run and read the losses, or use OneCycle"
    ),
    "add_tuning_arguments": (
        "deepspeed.runtime.lr_schedules.add_tuning_arguments (command-line flags for the LR range test and 1Cycle) "
        "is not in partita: give the schedule in the config's \"scheduler\" section"
    ),
}

__getattr__ = refuse(__name__, MISSING)
