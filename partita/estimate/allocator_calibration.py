"""Where the allocator model's fragmentation coefficients come from: GPU memory snapshots, refitted.

``FRAGMENTATION`` in :mod:`partita.estimate.allocator` is ``(a, r, g)`` per allocator: reserved minus
allocated = ``a x S + r x K + g x T`` (model states, one recomputed block, the rest of the peak less
the blocks re-requested at one size; :func:`~partita.estimate.allocator.fragmentation_terms`).
The records, all on one H200 (139.8 GiB), torch's caching allocator:

- ``benchmarks/results/estimator_accuracy_h200_2026-12-03.json`` (:data:`BENCHMARK`, 12 settings of
  ``benchmarks/estimator_accuracy_gpu.py``: stages 0-3, micro-batches 1-64, checkpointing none /
  selective / every, GPT 125M-1.3B, frozen ``zero.Init`` parameters, sequence tiling; 11 with
  expandable segments, one with fixed segments). Each is judged end to end: the estimator's
  predicted reserved bytes (its own allocated peak, whose error counts) against
  ``max_memory_reserved``.
- The largest-GPT runs of ``benchmarks/largest_per_setting.py``, ``largest_tiered.py`` (files of
  2026-12-01, partita settings, trials that trained): ZeRO-3 (the tiered one ZeRO-2), micro-batch 1,
  sequence 2048, every block checkpointed, model states 97-99% of the peak. Their allocated peak
  is taken as measured (the estimator's non-state bytes are subtracted from it to get ``S``), so
  they calibrate the model-state term. Left out: ``offload_param`` runs (the estimator's
  allocated peak is 3x off there), FSDP2 and DeepSpeed rows (not partita's allocation pattern).

Expandable segments: ``(a, r, g)`` is the grid point (steps 0.001, 0.1, 0.001) with the smallest
largest over-prediction among those that under-predict no run. Fixed segments have two runs (one
model-state dominated, one activation dominated): ``r`` is expandable's, ``a`` the smallest value
that covers the first, ``g`` the smallest that then covers the second.

The one recorded ``partita tune`` out-of-memory trial (:data:`TUNE_RUN`) is not a fit input: a
different training script (the example's), no snapshot kept, and 15.7 GiB cached on 98.6 GiB
allocated where the benchmark's loop at half its micro-batch held 0.3 GiB on 62.7 GiB; no linear
model holds both. The example's loop keeps each step's logits through the next forward, and
16-bit logits leave a hole the fp32 loss gradients cannot use (item 3 of
:mod:`partita.estimate.allocator`, derived, not fitted): 12.3 GiB of its 15.7. With that habit
modelled (``Setup.logits_held_to_next_step``, what ``partita tune`` assumes) :func:`tune_run_check`
predicts the trial's need 2.7% above what it had asked for when it failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

__all__ = ["BENCHMARK", "CalibrationRun", "TUNE_RUN", "fit", "leave_one_out", "load_runs", "residuals", "tune_run_check"]

GIB = 2**30
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BENCHMARK = "estimator_accuracy_h200_2026-12-03.json"

# (file, setting index, allocator, estimator Setup options) of the largest-GPT runs.
_SOURCES: tuple[tuple[str, int, str, dict], ...] = (
    ("largest_per_setting_expandable_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_a_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_b_h200_2026-12-01.json", 0, "expandable", {}),
    ("largest_stream_8b_h200_2026-12-01.json", 0, "expandable", {"optimizer": "AdamW8bit"}),
    ("largest_offload_a_h200_2026-12-01.json", 0, "expandable", {"optimizer": "AdamW8bit"}),
    ("largest_offload_a_h200_2026-12-01.json", 1, "expandable", {"offload_optimizer": "cpu"}),
    ("largest_per_setting_h200_2026-12-01.json", 0, "default", {}),
)

TUNE_RUN = (98.6 * GIB, 15.7 * GIB, 24.56 * GIB)
"""The tune trial that ran out of memory (docs/guides/autotuning.md, commit c2dca91; GPT-2 124M,
micro-batch 128, no checkpointing, examples/train_gpt.py's loop, expandable segments, one H200):
allocated bytes, cached-but-unusable bytes, and the request that failed (an fp32 loss gradient,
128 x 1024 x 50304 x 4 bytes)."""


def tune_run_check() -> tuple[float, float]:
    """``(needed, predicted)`` reserved bytes of :data:`TUNE_RUN`: what the failed request needed
    reserved (allocated + cached + requested: a lower bound of the run's peak) and the estimator's
    prediction for that run with the loop's habit (logits held to the next step)."""
    from partita.estimate import GPTShape, estimate_memory

    predicted = estimate_memory(GPTShape.preset("gpt2-124m"), stage=0, micro_batch=128,
                                logits_held_to_next_step=True).reserved_accelerator
    return float(sum(TUNE_RUN)), float(predicted)


_A = np.round(np.arange(0, 61) * 0.001, 3)
_R = np.round(np.arange(0, 61) * 0.1, 1)
_G = np.round(np.arange(0, 81) * 0.001, 3)


@dataclass(frozen=True)
class CalibrationRun:
    """One recorded run: the fit's terms (bytes), the allocated peak the prediction starts from,
    the fixed overheads (rounding, pages) and the measured reserved peak."""

    source: str
    allocator: str
    states: float
    recompute: float
    rest: float
    allocated: float
    overhead: float
    reserved: float

    def predicted(self, a: float, r: float, g: float) -> float:
        return self.allocated + self.overhead + a * self.states + r * self.recompute + g * self.rest


def _benchmark_runs(results: Path) -> list[CalibrationRun]:
    """The 12 settings of :data:`BENCHMARK`, re-estimated from their recorded setup."""
    from partita.estimate import GPTShape, Setup, estimate_memory
    from partita.estimate.allocator import fragmentation_terms
    from partita.estimate.model_info import model_info

    data = json.loads((results / BENCHMARK).read_text())
    rows = {row["setting"]: row for row in data["rows"]}
    runs = []
    for s in data["settings"]:
        row = rows[s["name"]]
        shape = GPTShape(s["d_model"], s["n_layers"], s["n_heads"], s["vocab"], s["seq_len"])
        info = model_info(shape) if not s["frozen_blocks"] else replace(_frozen_info(s), gpt=shape)
        kind = "expandable" if "expandable_segments:True" in s["alloc_conf"] else "default"
        setup = Setup.from_config(row["config"], world_size=1, fold_gradients_at_end=row["fold"] in ("end", "stream"),
                                  streamed_step=row["fold"] == "stream", allocator=kind)
        e = estimate_memory(info, setup)
        states, recompute, rest = fragmentation_terms(e)
        parts = e.reserved
        runs.append(CalibrationRun(s["name"], kind, states, recompute, rest, e.peak_accelerator,
                                   parts.rounding + parts.pages, row["measured"]["reserved_gib"] * GIB))
    return runs


def _frozen_info(s: dict):
    """The benchmark's GPT with its first blocks frozen, read on the meta device (what ``zero.Init``
    builds is the same parameters; the estimator counts frozen ones from their shapes)."""
    import torch

    from partita.estimate.model_info import model_info
    from partita.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=s["vocab"], block_size=s["seq_len"], n_layer=s["n_layers"], n_head=s["n_heads"],
                       n_embd=s["d_model"])
    with torch.device("meta"):
        model = GPT(config)
    for block in list(model.blocks)[: s["frozen_blocks"]]:
        block.requires_grad_(False)
    return model_info(model, param_groups=model.optimizer_param_groups(0.1))


def _largest_runs(results: Path) -> list[CalibrationRun]:
    """The largest-GPT runs: measured allocated peak, the estimator's split of its non-state part."""
    from partita.estimate import GPTShape, Setup, estimate_memory
    from partita.estimate.model_info import model_info

    pages = 22 * 2**20
    runs = []
    for name, index, allocator, options in _SOURCES:
        setting = json.loads((results / name).read_text())["settings"][index]
        for trial in setting["trials"]:
            if trial.get("status") != "pass":
                continue
            d, n = trial["d_model"], trial["n_layers"]
            setup = Setup(dtype="bf16", stage=3, micro_batch=1, checkpointing="every", allocator=allocator, **options)
            if setup.streams_by_default():
                setup = setup.replace(fold_gradients_at_end=True, streamed_step=True)
            e = estimate_memory(model_info(GPTShape(d, n, d // 128, 50304, 2048)), setup)
            runs.append(_measured_run(f"{name} {setting['setting']} d{d}x{n}", allocator, e, trial,
                                      pages if allocator == "expandable" else 2 * 2**20))
    tiered = json.loads((results / "largest_tiered_h200_2026-12-01.json").read_text())["runs"][0]
    e = estimate_memory(GPTShape(5120, 42, 40, 50304, 2048), stage=2, micro_batch=1, checkpointing="every")
    runs.append(_measured_run("largest_tiered_h200_2026-12-01.json d5120x42", "expandable", e, tiered, pages))
    return runs


def _measured_run(source: str, allocator: str, e, trial: dict, pages: int) -> CalibrationRun:
    from partita.estimate.allocator import fragmentation_terms

    _, recompute, rest = fragmentation_terms(e)
    allocated = trial["peak_gpu_allocated_gib"] * GIB
    states = allocated - (e.peak_accelerator - e.model_states("accelerator"))
    return CalibrationRun(source, allocator, states, recompute, rest, allocated, pages,
                          trial["peak_gpu_reserved_gib"] * GIB)


def load_runs(results: Path = RESULTS) -> list[CalibrationRun]:
    """Every calibration run: the 12 benchmark settings first, then the largest-GPT runs."""
    return _benchmark_runs(results) + _largest_runs(results)


def _fit_expandable(runs: list[CalibrationRun]) -> tuple[float, float, float]:
    a, r, g = np.meshgrid(_A, _R, _G, indexing="ij")
    error = np.zeros(a.shape)
    low = np.full(a.shape, np.inf)
    for run in runs:
        e = (run.allocated + run.overhead + a * run.states + r * run.recompute + g * run.rest) / run.reserved - 1
        error, low = np.maximum(error, e), np.minimum(low, e)
    score = np.where(low >= 0, error, np.inf)
    i = np.unravel_index(int(score.argmin()), score.shape)
    return float(_A[i[0]]), float(_R[i[1]]), float(_G[i[2]])


def _cover(run: CalibrationRun, known: float, per_byte: float) -> float:
    """The smallest coefficient (3 decimals) of a term of ``per_byte`` bytes with which ``run``'s
    prediction reaches its measurement, ``known`` the bytes the other terms already give."""
    need = run.reserved - run.allocated - run.overhead - known
    return max(0.0, float(np.ceil(need / per_byte * 1000) / 1000)) if per_byte else 0.0


def _fit_default(runs: list[CalibrationRun], r: float) -> tuple[float, float, float]:
    by_states = max(runs, key=lambda x: x.states / x.allocated)
    a = _cover(by_states, r * by_states.recompute, by_states.states)
    others = [x for x in runs if x is not by_states]
    g = max((_cover(x, a * x.states + r * x.recompute, x.rest) for x in others), default=0.0)
    return a, r, g


def fit(results: Path = RESULTS, runs: list[CalibrationRun] | None = None) -> dict[str, tuple[float, float, float]]:
    """``{allocator: (a, r, g)}`` refitted from the records."""
    runs = load_runs(results) if runs is None else runs
    expandable = _fit_expandable([x for x in runs if x.allocator == "expandable"])
    return {"expandable": expandable, "default": _fit_default([x for x in runs if x.allocator == "default"],
                                                               expandable[1])}


def residuals(results: Path = RESULTS) -> list[tuple[str, float, float, float]]:
    """Per run: (source, measured reserved GiB, predicted reserved GiB, relative error)."""
    from partita.estimate.allocator import FRAGMENTATION

    rows = []
    for run in load_runs(results):
        p = run.predicted(*FRAGMENTATION[run.allocator])
        rows.append((run.source, run.reserved / GIB, p / GIB, p / run.reserved - 1.0))
    return rows


def leave_one_out(results: Path = RESULTS) -> list[tuple[str, tuple[float, float, float], float]]:
    """Per benchmark setting: the coefficients fitted without it and its relative error under them."""
    runs = load_runs(results)
    out = []
    for run in runs[:12]:
        coefficients = fit(runs=[x for x in runs if x is not run])[run.allocator]
        out.append((run.source, coefficients, run.predicted(*coefficients) / run.reserved - 1.0))
    return out
