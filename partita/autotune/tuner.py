"""The autotuning loop: plan the trials, prune those the memory estimate says cannot fit,
run the rest, keep every outcome, and pick the fastest that fits.

Pruning uses :mod:`partita.estimate`: each point's predicted reserved accelerator memory per
rank (the peak plus the CUDA caching allocator's rounding and fragmentation; on a CPU run the
tensor bytes) against the device's memory less a headroom. The model is, in order: a GPT preset
(activations included), a parameter count (``--model-params``, ``model_info.num_params`` or
``model_info_path``; model states and buffers only, activations unknown), or else the
parameter count the first finished trial measured (the trials before it run unpruned; the
later ones are pruned at their turn).
Without a memory budget (a CPU run without ``--gpu-memory``) nothing is pruned.

Micro-batch sizes: the given list, or powers of two between DeepSpeed's
``min/max_train_micro_batch_size_per_gpu``, of which ``num_tuning_micro_batch_sizes`` are
kept per (stage, offload, checkpointing): the largest that fit when there is a budget (the
fastest are usually the largest), else the smallest (nothing says larger ones fit).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partita.autotune.config import AutotuningConfig
from partita.autotune.runner import TrialOutcome, run_trial
from partita.autotune.space import TrialPoint, micro_batch_candidates, points

__all__ = ["CSV_COLUMNS", "TrialRecord", "TuneOptions", "best_record", "guard_bytes", "tune"]

_GIB = float(2**30)
CSV_COLUMNS = ("trial", "zero_stage", "micro_batch", "gradient_accumulation_steps", "train_batch_size",
               "activation_checkpointing", "offload", "status", "tokens_per_sec", "samples_per_sec",
               "step_seconds", "tflops_per_device", "peak_memory_gib", "estimated_peak_gib", "seconds", "note")


@dataclass(frozen=True)
class TuneOptions:
    """Everything ``partita tune`` was told; the autotuning section supplies the rest."""

    script: str
    script_args: tuple[str, ...]
    base_config: Mapping[str, Any]
    autotuning: AutotuningConfig
    nproc: int
    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batches: tuple[int, ...] | None = None
    checkpointing: tuple[str, ...] = ("none", "every")
    offload: tuple[str, ...] = ("none", "cpu")
    gradient_accumulation_steps: int = 1
    module: bool = False
    model: Any = None  # GPTShape, a parameter count, or None (measured by the first trial)
    memory_budget_bytes: float | None = None
    trial_timeout_s: float = 600.0
    seed: int = 0
    allocator: str = "none"  # partita.estimate.allocator.ALLOCATORS: pruning on predicted reserved memory


@dataclass
class TrialRecord:
    point: TrialPoint
    status: str  # ok, oom, timeout, failed, pruned
    estimated_bytes: float | None = None
    outcome: TrialOutcome | None = None
    note: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        p, m = self.point, self.metrics
        return {
            "trial": p.name, "zero_stage": p.stage, "micro_batch": p.micro_batch,
            "gradient_accumulation_steps": p.gradient_accumulation_steps, "train_batch_size": p.train_batch_size,
            "activation_checkpointing": p.checkpointing, "offload": p.offload, "status": self.status,
            "tokens_per_sec": _fmt(m.get("avg_tokens_per_sec")), "samples_per_sec": _fmt(m.get("avg_samples_per_sec")),
            "step_seconds": _fmt(m.get("step_seconds")), "tflops_per_device": _fmt(m.get("tflops_per_device")),
            "peak_memory_gib": _fmt(m.get("memory_peak_gib")),
            "estimated_peak_gib": _fmt(None if self.estimated_bytes is None else self.estimated_bytes / _GIB),
            "seconds": _fmt(self.outcome.seconds if self.outcome else None), "note": self.note,
        }


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def metric_value(record: TrialRecord, metric: str) -> float | None:
    """Higher is better: samples/s, minus seconds per step, or TFLOP/s."""
    m = record.metrics
    if metric == "throughput":
        return m.get("avg_samples_per_sec")
    if metric == "latency":
        return -m["step_seconds"] if "step_seconds" in m else None
    return m.get("tflops_per_device")


def best_record(records: Sequence[TrialRecord], metric: str) -> TrialRecord | None:
    """The finished trial with the best metric (the earliest on a tie)."""
    scored = [(metric_value(r, metric), i, r) for i, r in enumerate(records) if r.status == "ok"]
    scored = [(v, i, r) for v, i, r in scored if v is not None]
    return max(scored, key=lambda s: (s[0], -s[1]))[2] if scored else None


class _Estimator:
    """Predicted peak accelerator bytes per rank of a point (None: no model known yet)."""

    def __init__(self, opts: TuneOptions) -> None:
        self._base = opts.base_config
        self._model = opts.model
        self._allocator = opts.allocator
        self._info = None

    def learn_parameters(self, count: int) -> None:
        if self._model is None:
            self._model = int(count)

    def __call__(self, point: TrialPoint) -> float | None:
        if self._model is None:
            return None
        from partita.estimate import Setup
        from partita.estimate.model_info import model_info

        if self._info is None:
            self._info = model_info(self._model)
        setup = Setup.from_config(
            dict(self._base), world_size=point.world_size, stage=point.stage, micro_batch=point.micro_batch,
            gradient_accumulation_steps=point.gradient_accumulation_steps, checkpointing=point.checkpointing,
            offload_optimizer="cpu" if point.offload != "none" else "none",
            offload_param="cpu" if point.offload == "cpu+param" else "none", allocator=self._allocator,
        )
        # Reserved, not allocated: a trial fails when the caching allocator cannot reserve a request,
        # and its rounding and fragmentation come on top of the tensors (partita/estimate/allocator.py).
        return float(guard_bytes(self._info, setup))


def guard_bytes(model: Any, setup: Any) -> int:
    """Accelerator bytes per rank the tuner requires free for a trial of ``model`` (what
    ``partita.estimate.estimate_memory`` takes) under ``setup`` (a ``partita.estimate.Setup``): the
    predicted reserved memory of the training loop most scripts run, which keeps each step's logits
    through the next forward (``logits, loss = engine(x, y)``, as examples/train_gpt.py and nanoGPT
    do; ``Setup.logits_held_to_next_step``): 16-bit logits then leave a hole the loss gradients cannot
    use, which made the one recorded tune sweep run out of memory where 124 GiB had been predicted
    (``partita.estimate.allocator_calibration.TUNE_RUN``). A loop that drops its logits needs less.
    No caching allocator (CPU): the tensor bytes. ``benchmarks/estimator_accuracy_gpu.py`` reports
    this guard next to each measurement."""
    from partita.estimate import estimate_memory

    return estimate_memory(model, setup.replace(logits_held_to_next_step=True)).reserved_accelerator


def _plan(opts: TuneOptions) -> tuple[list[TrialPoint], list[TrialRecord]]:
    """The points to try, in order, and the ones refused by the global batch bounds."""
    at = opts.autotuning
    sizes = list(opts.micro_batches) if opts.micro_batches else micro_batch_candidates(
        at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu)
    grid = points(stages=opts.stages, micro_batches=sizes, checkpointing=opts.checkpointing, offload=opts.offload,
                  gradient_accumulation_steps=opts.gradient_accumulation_steps, world_size=opts.nproc)
    refused, kept = [], []
    for point in grid:
        high = at.max_train_batch_size
        if point.train_batch_size < at.min_train_batch_size or (high is not None and point.train_batch_size > high):
            refused.append(TrialRecord(point, "pruned", note=(
                f"global batch {point.train_batch_size} outside [{at.min_train_batch_size}, {high or 'inf'}] "
                "(min/max_train_batch_size)")))
        else:
            kept.append(point)
    if at.tuner_type == "random":
        random.Random(opts.seed).shuffle(kept)
    return kept, refused


def _select_micro_batches(points_: list[TrialPoint], estimates: dict[TrialPoint, float | None], *,
                          budget: float | None, count: int, explicit: bool) -> tuple[list[TrialPoint], list[TrialRecord]]:
    """Prune what does not fit; keep ``count`` micro-batch sizes per (stage, offload, checkpointing)."""
    pruned, fitting = [], []
    for point in points_:
        estimate = estimates.get(point)
        if budget is not None and estimate is not None and estimate > budget:
            pruned.append(_pruned(point, estimate, budget))
        else:
            fitting.append(point)
    if explicit:
        return fitting, pruned
    groups: dict[tuple, list[TrialPoint]] = {}
    for point in fitting:
        groups.setdefault((point.stage, point.offload, point.checkpointing), []).append(point)
    chosen = set()
    for members in groups.values():
        by_size = sorted(members, key=lambda p: p.micro_batch)
        chosen.update(by_size[-count:] if budget is not None and all(estimates.get(p) is not None for p in members)
                      else by_size[:count])
    return [p for p in fitting if p in chosen], pruned


def _pruned(point: TrialPoint, estimate: float, budget: float) -> TrialRecord:
    return TrialRecord(point, "pruned", estimate, note=(
        f"estimated {estimate / _GIB:.3g} GiB per rank > {budget / _GIB:.3g} GiB available"))


def tune(opts: TuneOptions, *, exps_dir: Path, csv_path: Path | None = None,
         on_start: Callable[[int], None] | None = None,
         on_record: Callable[[TrialRecord, int, int], None] | None = None) -> list[TrialRecord]:
    """Run the search; every planned point comes back as a record (run, failed, skipped or pruned).

    ``on_start(total)`` gets the number of records to come, ``on_record(record, done, total)``
    each record as it is made (for a progress display);
    ``csv_path`` gets one row per record as soon as it exists, so an interrupted search
    keeps what it measured.
    """
    at = opts.autotuning
    budget = opts.memory_budget_bytes
    estimator = _Estimator(opts)
    planned, refused = _plan(opts)
    selected, pruned = _select_micro_batches(planned, {p: estimator(p) for p in planned}, budget=budget,
                                             count=at.num_tuning_micro_batch_sizes,
                                             explicit=opts.micro_batches is not None)
    total = len(refused) + len(pruned) + len(selected)
    if on_start is not None:
        on_start(total)
    records: list[TrialRecord] = []
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            csv.DictWriter(f, CSV_COLUMNS).writeheader()

    def keep(record: TrialRecord) -> None:
        records.append(record)
        if csv_path is not None:
            with open(csv_path, "a", newline="") as f:
                csv.DictWriter(f, CSV_COLUMNS).writerow(record.row())
        if on_record is not None:
            on_record(record, len(records), total)

    for record in refused + pruned:
        keep(record)
    run_count, since_best, best_value = 0, 0, None
    for point in selected:
        estimate = estimator(point)  # known now if an earlier trial measured the model
        if budget is not None and estimate is not None and estimate > budget:
            keep(_pruned(point, estimate, budget))
            continue
        if run_count >= at.tuner_num_trials:
            keep(TrialRecord(point, "skipped", estimate, note=f"tuner_num_trials {at.tuner_num_trials} reached"))
            continue
        if since_best >= at.tuner_early_stopping:
            keep(TrialRecord(point, "skipped", estimate,
                             note=f"early stop: {since_best} trials in a row without improvement (tuner_early_stopping)"))
            continue
        record = _run_point(point, opts, exps_dir, steps=at.end_profile_step, warmup=at.start_profile_step - 1,
                            estimate=estimate)
        run_count += 1
        if record.status == "ok" and "parameters" in record.metrics:
            estimator.learn_parameters(int(record.metrics["parameters"]))
        value = metric_value(record, at.metric) if record.status == "ok" else None
        if value is not None and (best_value is None or value > best_value):
            best_value, since_best = value, 0
        elif best_value is not None:  # early stopping counts from the first finished trial
            since_best += 1
        keep(record)
    return records


def _run_point(point: TrialPoint, opts: TuneOptions, exps_dir: Path, *, steps: int, warmup: int,
               estimate: float | None) -> TrialRecord:
    at = opts.autotuning
    folder = exps_dir / point.name
    config = point.trial_config(opts.base_config, steps=steps, warmup_steps=warmup)
    saved = folder / "record.json"
    if not at.overwrite and saved.exists():
        previous = json.loads(saved.read_text())
        if previous.get("config") == config:
            outcome = TrialOutcome(previous["status"], previous["seconds"], previous["result"], previous["error"])
            return _record(point, outcome, estimate, reused=True)
    args = list(opts.script_args)
    for key, flag in (at.arg_mappings or {}).items():
        args += [flag, str(point.config_value(key))]
    outcome = run_trial(folder=folder, config=config, script=opts.script, script_args=args, nproc=opts.nproc,
                        steps=steps, module=opts.module, timeout_s=opts.trial_timeout_s)
    saved.write_text(json.dumps({"config": config, "status": outcome.status, "seconds": outcome.seconds,
                                 "result": outcome.result, "error": outcome.error}, indent=2) + "\n")
    return _record(point, outcome, estimate, reused=False)


def _record(point: TrialPoint, outcome: TrialOutcome, estimate: float | None, *, reused: bool) -> TrialRecord:
    metrics = {k: float(v) for k, v in outcome.result.items() if isinstance(v, (int, float))}
    samples = metrics.get("avg_samples_per_sec")
    if samples:
        metrics["step_seconds"] = point.train_batch_size / samples
    note = outcome.error + (" (result reused: overwrite false)" if reused else "")
    if outcome.status == "oom" and "oom_requested_bytes" in metrics:
        # The allocator's own figures first (the table shows a note's start): what fragmentation cost.
        figures = [f"asked {metrics['oom_requested_bytes'] / _GIB:.3g} GiB"]
        figures += [f"{what} {metrics[key] / _GIB:.3g} GiB" for key, what in (
            ("oom_allocated_bytes", "allocated"), ("oom_cached_bytes", "cached unusable"),
            ("oom_capacity_bytes", "of")) if key in metrics]
        note = ", ".join(figures) + ": " + note
    return TrialRecord(point, outcome.status, estimate, outcome, note.strip(), metrics)
