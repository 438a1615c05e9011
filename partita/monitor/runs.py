"""Read the metrics a run logged, from its CSV files or its TensorBoard event files.

A run directory is the ``output_path/job_name`` directory of ``csv_monitor`` or
``tensorboard`` (or any directory above one: it is searched recursively). Both hold the
same series: ``Train/Samples/<metric>`` against the number of samples trained.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

_PREFIX = "Train_Samples_"


class NoMetricsError(ValueError):
    """A directory holds no partita/DeepSpeed metrics (no CSV monitor files, no event files)."""


@dataclass
class RunMetrics:
    """One run: metric name -> (samples, values), sorted by samples."""

    name: str
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    def steps_for(self, samples: list[float]) -> list[float] | None:
        """Optimizer steps at these sample counts, from the logged ``step`` metric."""
        if "step" not in self.series:
            return None
        lookup = dict(zip(*self.series["step"]))
        if not all(s in lookup for s in samples):
            return None
        return [lookup[s] for s in samples]


def read_run(directory: str | Path) -> RunMetrics:
    """The metrics under ``directory``: CSV monitor files if there are any, else TensorBoard events."""
    root = Path(directory)
    if not root.is_dir():
        raise NoMetricsError(f"{root} is not a directory; pass the output_path/job_name directory of a run")
    run = RunMetrics(name=root.resolve().name)
    csv_files = sorted(root.rglob(f"{_PREFIX}*.csv"))
    if csv_files:
        for path in csv_files:
            run.series[path.stem[len(_PREFIX):]] = _read_csv(path)
        return run
    event_dirs = sorted({p.parent for p in root.rglob("events.out.tfevents.*")})
    if event_dirs:
        for event_dir in event_dirs:
            run.series.update(_read_events(event_dir))
        return run
    raise NoMetricsError(
        f"no metrics under {root}: expected the CSV files of csv_monitor ({_PREFIX}<metric>.csv) or the "
        f"TensorBoard event files of tensorboard (events.out.tfevents.*)"
    )


def _read_csv(path: Path) -> tuple[list[float], list[float]]:
    points: dict[float, float] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        next(reader, None)  # header: step,<metric>
        for row in reader:
            if len(row) == 2:
                points[float(row[0])] = float(row[1])  # a restarted job rewrites steps: last wins
    xs = sorted(points)
    return xs, [points[x] for x in xs]


def _read_events(directory: Path) -> dict[str, tuple[list[float], list[float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as error:
        raise NoMetricsError(
            f"{directory} holds TensorBoard event files; reading them needs the 'tensorboard' package: "
            f"pip install tensorboard"
        ) from error
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    series = {}
    for tag in accumulator.Tags()["scalars"]:
        if not tag.startswith("Train/Samples/"):
            continue
        points = {float(e.step): float(e.value) for e in accumulator.Scalars(tag)}
        xs = sorted(points)
        series[tag.removeprefix("Train/Samples/")] = (xs, [points[x] for x in xs])
    return series
