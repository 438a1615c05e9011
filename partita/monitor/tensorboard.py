"""TensorBoard monitor: scalars in event files under ``output_path/job_name``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from partita.monitor.events import Event


class TensorBoardMonitor:
    """Writes with torch's ``SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, value, step)
        # Events arrive only at print steps: flush so a running job is visible in TensorBoard.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
