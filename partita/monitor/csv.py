"""CSV monitor: one ``<tag with / as _>.csv`` file per metric, as DeepSpeed's csv_monitor.

Each file has a header ``step,<last part of the tag>`` and one ``step,value`` row per
print step (``step`` is the number of samples trained, as for the other monitors), e.g.
``Train_Samples_train_loss.csv``. ``partita plot`` reads these files.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from partita.monitor.events import Event


def csv_file_name(tag: str) -> str:
    return tag.replace("/", "_") + ".csv"


class CSVMonitor:
    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            path = self.log_dir / csv_file_name(tag)
            new = not path.exists()
            # Append and close per print step: the file is complete whenever the job dies.
            with path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerow([step, repr(float(value))])

    def close(self) -> None:
        """Nothing to release: every print step opens, appends to and closes its files."""
