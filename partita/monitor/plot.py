"""``partita plot RUN_DIR... [-o OUT_DIR]``: PNG charts of one or several runs, overlaid.

Four files, one line per run in each: ``loss.png`` (training loss), ``throughput.png``
(samples/s, and tokens/s and MFU when logged), ``memory.png`` (allocated and peak, maximum
over ranks) and ``grad_norm.png``. Overlaying runs is the point: the same model under
ZeRO-1 and ZeRO-2, or with and without offload, side by side. Needs matplotlib
(``pip install 'partita[plot]'``); it draws with the Agg canvas, so no display is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from partita.monitor.runs import RunMetrics, read_run

logger = logging.getLogger("partita")

# file name -> (title, [(metric, y label)]): one panel per metric that some run logged.
CHARTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "loss.png": ("training loss", [("train_loss", "loss")]),
    "throughput.png": (
        "throughput",
        [("samples_per_sec", "samples/s"), ("tokens_per_sec", "tokens/s"), ("mfu", "MFU (fraction of peak)")],
    ),
    "memory.png": (
        "memory (max over ranks)",
        [("memory_allocated_gib", "allocated (GiB)"), ("memory_peak_gib", "peak (GiB)")],
    ),
    "grad_norm.png": ("global gradient norm", [("grad_norm", "grad norm")]),
}


class PlotDependencyError(ImportError):
    """matplotlib is not installed."""


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path, *, x_axis: str = "steps") -> list[Path]:
    """Write the charts for ``run_dirs`` into ``out_dir``; returns the files written.

    Args:
        run_dirs: ``output_path/job_name`` directories of csv_monitor or tensorboard.
        out_dir: where the PNG files go (created if needed).
        x_axis: "steps" (optimizer steps, from the logged ``step`` metric) or "samples".
    """
    if x_axis not in ("steps", "samples"):
        raise ValueError(f"x_axis must be 'steps' or 'samples', got {x_axis!r}")
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotDependencyError(
            "partita plot needs matplotlib: pip install matplotlib (or pip install 'partita[plot]')"
        ) from error
    runs = [read_run(d) for d in run_dirs]
    _disambiguate(runs, run_dirs)
    if x_axis == "steps" and not all(_steps_known(run) for run in runs):
        # One x axis for every line: a run without partita's `step` metric (e.g. logged by
        # DeepSpeed) has samples only, and steps and samples on one axis would mislead.
        unknown = ", ".join(run.name for run in runs if not _steps_known(run))
        logger.warning("partita plot: %s logged no optimizer step (Train/Samples/step); plotting every run "
                       "against samples trained", unknown)
        x_axis = "samples"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, (title, panels) in CHARTS.items():
        present = [(metric, label) for metric, label in panels if any(metric in run.series for run in runs)]
        if not present:
            continue
        fig = Figure(figsize=(7.0, 2.6 * len(present)), layout="constrained")
        axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (metric, label) in zip(axes, present):
            for run in runs:
                if metric in run.series:
                    xs, ys = run.series[metric]
                    ax.plot(run.steps_for(xs) if x_axis == "steps" else xs, ys, label=run.name, linewidth=1.4)
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        axes[0].set_title(title)
        axes[0].legend(fontsize="small")
        axes[-1].set_xlabel("optimizer step" if x_axis == "steps" else "samples")
        path = out / file_name
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def _steps_known(run: RunMetrics) -> bool:
    """Every logged point of ``run`` has its optimizer step."""
    return all(run.steps_for(xs) is not None for xs, _ in run.series.values())


def _disambiguate(runs: list[RunMetrics], run_dirs: Sequence[str | Path]) -> None:
    """Label runs by directory name, or by the path given when two names collide."""
    names = [run.name for run in runs]
    for run, given in zip(runs, run_dirs):
        if names.count(run.name) > 1:
            run.name = str(given)
