"""Fan scalar events out to the enabled monitors (TensorBoard, CSV, W&B), on rank 0.

An event is ``(tag, value, step)``. As in DeepSpeed, tags read ``Train/Samples/<metric>``
and ``step`` is the number of samples trained so far (``engine.global_samples``), so runs
with different batch sizes line up; ``Train/Samples/step`` carries the optimizer step.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from partita.monitor.csv import CSVMonitor

# Event and Monitor live in the sinks' own lower module (re-exported here, their historical
# path), so the sinks import nothing above them and this module can import them at the top:
# each imports its optional package (tensorboard, wandb) only when a monitor is built.
from partita.monitor.events import Event, Monitor
from partita.monitor.tensorboard import TensorBoardMonitor
from partita.monitor.wandb import WandbMonitor

if TYPE_CHECKING:
    from partita.config import PartitaConfig

__all__ = ["Event", "MissingMonitorPackageError", "Monitor", "MonitorMaster", "build_monitors",
           "check_monitor_packages", "job_dir"]


class MissingMonitorPackageError(ImportError):
    """A monitor is enabled in the config but the package it writes with is not installed."""


# section name -> (import name, pip requirement)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_monitor_packages(config: PartitaConfig) -> None:
    """Raise :class:`MissingMonitorPackageError` for an enabled monitor whose package is missing.

    Called by ``partita.initialize`` on every rank before any heavy work, so a run does not
    train for hours and then fail (or silently log nothing) at its first print step.
    """
    for section, (module, requirement) in _PACKAGES.items():
        if getattr(config, section).enabled and importlib.util.find_spec(module) is None:
            raise MissingMonitorPackageError(
                f"'{section}.enabled' is true in the config but the '{module}' package is not installed; "
                f"install it with `pip install {requirement}` (or `pip install 'partita[monitor]'`), "
                f"or set '{section}.enabled' to false"
            )


def job_dir(output_path: str, job_name: str) -> Path:
    """``output_path/job_name``; an empty ``output_path`` is the directory training started in."""
    return Path(output_path or os.getcwd()) / job_name


class MonitorMaster:
    """Every enabled monitor behind one ``write_events``; empty on ranks other than 0."""

    def __init__(self, monitors: Sequence[Monitor] = ()) -> None:
        self.monitors = list(monitors)

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def write_events(self, events: Sequence[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


def build_monitors(config: PartitaConfig, *, is_writing_rank: bool) -> MonitorMaster:
    """The monitors the config enables (none unless ``is_writing_rank``)."""
    if not is_writing_rank:
        return MonitorMaster()
    monitors: list[Monitor] = []
    if config.tensorboard.enabled:
        monitors.append(TensorBoardMonitor(job_dir(config.tensorboard.output_path, config.tensorboard.job_name)))
    if config.csv_monitor.enabled:
        monitors.append(CSVMonitor(job_dir(config.csv_monitor.output_path, config.csv_monitor.job_name)))
    if config.wandb.enabled:
        monitors.append(
            WandbMonitor(project=config.wandb.project, group=config.wandb.group, team=config.wandb.team,
                         run_config=config.to_dict())
        )
    return MonitorMaster(monitors)
