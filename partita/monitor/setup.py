"""What ``partita.initialize`` does for monitoring before the model is touched."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partita.monitor.comms_logger import COMMS_LOGGER
from partita.monitor.monitors import check_monitor_packages

if TYPE_CHECKING:
    from partita.config import PartitaConfig


def prepare_monitoring(config: PartitaConfig) -> None:
    """Fail early if an enabled monitor's package is missing; start the communication logger.

    Runs on every rank right after the process group starts, so the initial weight
    broadcast is already recorded and every rank fails alike on a missing package.
    """
    check_monitor_packages(config)
    COMMS_LOGGER.configure(config.comms_logger)
