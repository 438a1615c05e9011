"""The ``partita plot`` command: errors as one line and an exit status, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def plot_command(run_dirs: Sequence[str], out_dir: str, *, x_axis: str) -> int:
    from partita.monitor.plot import PlotDependencyError, plot_runs
    from partita.monitor.runs import NoMetricsError

    try:
        written = plot_runs(run_dirs, out_dir, x_axis=x_axis)
    except (NoMetricsError, PlotDependencyError) as error:
        print(f"partita plot: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
