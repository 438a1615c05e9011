"""Monitoring: step metrics (throughput, MFU, memory), TensorBoard / CSV / W&B monitors,
phase timers, the communication logger, the flops profiler and ``partita plot``.

Submodules import their optional packages (tensorboard, wandb, matplotlib) only when used;
this package imports none of them.
"""

from partita.monitor.comms_logger import COMMS_LOGGER, CommsSummary
from partita.monitor.flops_profiler import FlopsProfile, get_model_profile
from partita.monitor.monitors import MissingMonitorPackageError

__all__ = ["COMMS_LOGGER", "CommsSummary", "FlopsProfile", "MissingMonitorPackageError", "get_model_profile"]
