"""Where the allocator model's fragmentation coefficients come from: recorded H200 runs, refitted.

``FRAGMENTATION`` in :mod:`partita.estimate.allocator` is ``(a, f)`` per allocator: reserved minus
allocated = ``a x S + f x T``, with ``S`` the model states and ``T`` the rest of the peak. The runs:

- ``f``, the transient term, from the one activation-dominated run on record: ``partita tune`` on
  one H200 (README "Autotuning", commit c2dca91; no JSON was kept), GPT-2 124M, micro-batch 128,
  sequence 1024, no checkpointing, expandable segments: 98.6 GiB allocated and 15.7 GiB more
  reserved when backward asked for 24.6 GiB (the out-of-memory report). ``f`` = 15.7 GiB over the
  allocated bytes that were not model states.
- ``a``, the model-state term, from the largest-GPT runs of ``benchmarks/largest_per_setting.py``
  and ``largest_tiered.py`` (benchmarks/results/largest_*_h200_2026-12-01.json, partita settings,
  trials that trained): ZeRO-3, micro-batch 1, sequence 2048, every block checkpointed, where
  model states are 97-99% of the peak. Per run ``(reserved - allocated - f x T) / (allocated - T)``
  with ``T`` the estimator's transient part for that shape; ``a`` is the largest such value over
  the runs of one allocator (an envelope: no recorded run is under-predicted), clipped at 0.
  Fixed segments: the one partita run without expandable segments (largest_per_setting_h200,
  ZeRO-3, 7.87 B: 119.5 GiB allocated, 133.1 GiB reserved).
- Left out, and why: the runs with ``offload_param`` (p-optp): the estimator's allocated peak is 3x
  off there (3.8 GiB against 12-15 GiB measured), so their gap cannot be split into its terms;
  FSDP2 and DeepSpeed rows (not partita's allocation pattern).

:func:`fit` recomputes the coefficients from the files; :func:`residuals` lists each run's
measured reserved against the model's prediction from its measured allocated bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CalibrationRun", "TUNE_RUN", "fit", "load_runs", "residuals"]

GIB = 2**30
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# (file, setting index, estimator Setup options) of the partita runs used for ``a``.
_SOURCES: tuple[tuple[str, int, str, dict], ...] = (
    ("largest_per_setting_expandable_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_a_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_b_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_8b_h200_2026-12-01.json", 0, "expandable", {"optimizer": "AdamW8bit"}),
    ("largest_offload_a_h200_2026-12-01.json", 0, "expandable", {"optimizer": "AdamW8bit"}),
    ("largest_offload_a_h200_2026-12-01.json", 1, "expandable", {"offload_optimizer": "cpu"}),
    ("largest_per_setting_h200_2026-12-01.json", 0, "default", {}),
)


@dataclass(frozen=True)
class CalibrationRun:
    """One recorded run: measured peaks (bytes) and the estimator's model-state and transient bytes."""

    source: str
    allocator: str
    allocated: float
    reserved: float
    transient: float

    @property
    def gap(self) -> float:
        return self.reserved - self.allocated


TUNE_RUN = (98.6 * GIB, 15.7 * GIB)
"""The tune trial that ran out of memory: allocated bytes and cached-but-unusable bytes."""


def _tune_states() -> int:
    """Model states of that trial (GPT-2 124M, bf16, one rank, ZeRO-0) by the estimator."""
    from partita.estimate import GPTShape, estimate_memory

    return estimate_memory(GPTShape.preset("gpt2-124m"), stage=0, micro_batch=128).model_states("accelerator")


def load_runs(results: Path = RESULTS) -> list[CalibrationRun]:
    """The runs used for ``a``, with the estimator's transient bytes at each shape."""
    from partita.estimate import GPTShape, Setup, estimate_memory
    from partita.estimate.model_info import model_info

    runs = []
    for name, index, allocator, options in _SOURCES:
        setting = json.loads((results / name).read_text())["settings"][index]
        for trial in setting["trials"]:
            if trial.get("status") != "pass":
                continue
            d, n = trial["d_model"], trial["n_layers"]
            setup = Setup(dtype="bf16", stage=3, micro_batch=1, checkpointing="every", **options)
            if setup.streams_by_default():
                setup = setup.replace(fold_gradients_at_end=True, streamed_step=True)
            e = estimate_memory(model_info(GPTShape(d, n, d // 128, 50304, 2048)), setup)
            runs.append(CalibrationRun(f"{name} {setting['setting']} d{d}x{n}", allocator,
                                       trial["peak_gpu_allocated_gib"] * GIB, trial["peak_gpu_reserved_gib"] * GIB,
                                       float(e.peak_accelerator - e.model_states("accelerator"))))
    tiered = json.loads((results / "largest_tiered_h200_2026-12-01.json").read_text())["runs"][0]
    runs.append(CalibrationRun("largest_tiered_h200_2026-12-01.json d5120x42", "expandable",
                               tiered["peak_gpu_allocated_gib"] * GIB, tiered["peak_gpu_reserved_gib"] * GIB,
                               _tiered_transient()))
    return runs


def _tiered_transient() -> float:
    """The tiered run's transient bytes (ZeRO-2, every block checkpointed, micro-batch 1; the split
    moves model states, not activations)."""
    from partita.estimate import GPTShape, estimate_memory

    e = estimate_memory(GPTShape(5120, 42, 40, 50304, 2048), stage=2, micro_batch=1, checkpointing="every")
    return float(e.peak_accelerator - e.model_states("accelerator"))


def fit(results: Path = RESULTS) -> dict[str, tuple[float, float]]:
    """``{allocator: (a, f)}`` refitted from the records (rounded to 4 decimals, as stored)."""
    allocated, cached = TUNE_RUN
    f = cached / (allocated - _tune_states())
    out = {}
    for allocator in ("expandable", "default"):
        ratios = [max(0.0, (r.gap - f * r.transient) / (r.allocated - r.transient))
                  for r in load_runs(results) if r.allocator == allocator]
        out[allocator] = (round(max(ratios), 4), round(f, 4))
    return out


def residuals(results: Path = RESULTS) -> list[tuple[str, float, float, float]]:
    """Per run: (source, measured reserved GiB, predicted reserved GiB from the measured allocated
    bytes, relative error)."""
    from partita.estimate.allocator import FRAGMENTATION, LARGE_BUFFER, SMALL_BUFFER

    rows = []
    for r in load_runs(results):
        a, f = FRAGMENTATION[r.allocator]
        pages = LARGE_BUFFER + SMALL_BUFFER if r.allocator == "expandable" else SMALL_BUFFER
        predicted = r.allocated + a * (r.allocated - r.transient) + f * r.transient + pages
        rows.append((r.source, r.reserved / GIB, predicted / GIB, predicted / r.reserved - 1.0))
    return rows
