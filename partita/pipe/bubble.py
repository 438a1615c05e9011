"""Idle ("bubble") time of each pipeline stage, from timers around the schedule's compute.

A stage's time in one ``train_batch`` schedule splits into compute and waiting. The torch
schedules run every micro-batch's work through three :class:`PipelineStage` methods, the same
on torch 2.11-2.13: ``forward_one_chunk``, ``backward_one_chunk`` (input and, without zero
bubble, weight gradients) and ``backward_weight_one_chunk`` (zero bubble's deferred weight
gradients); the last stage also calls the loss function. :class:`BubbleTimer` wraps those
methods on this rank's stage objects and the loss; everything else inside ``schedule.step``
(waiting for a neighbour's activations or gradients, sends, bookkeeping) is idle time:

    idle_s = schedule_s - compute_s,   idle_fraction = idle_s / schedule_s

which the theory puts at ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B (p stages, m
micro-batches), lower for the interleaved and zero-bubble schedules (:func:`theory_idle_fraction`).

The clock is the host's ``time.perf_counter``: exact on CPU, where work is synchronous. On
CUDA the host runs ahead of the device, so each timed call is bracketed by a device
synchronisation; that costs overlap, which is why ``pipeline.measure_bubble`` is off by default
there (on by default on CPU).

After each batch every rank's (schedule_s, compute_s) is all-gathered (one collective of two
floats per rank) and averaged per stage over the data and tensor ranks of that stage:
``engine.last_bubble`` (see :meth:`BubbleTimer.gather`) and the step log's
``pipe_idle_s<k>`` values (idle fraction of stage k over the print window).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from partita.distributed import collectives

__all__ = ["BubbleTimer", "theory_idle_fraction"]

_TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def theory_idle_fraction(stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """The closed-form idle fraction of a stage's wall time for ``schedule`` (p stages, m
    micro-batches, v model chunks per rank), unit costs F = B/2 and no communication time:

    GPipe and 1F1B ``(p - 1) / (m + p - 1)``; interleaved 1F1B ``(p - 1) / (v m + p - 1)`` (the
    warm-up shrinks with the chunk size); zero bubble ``(p - 1) / (3 v m + p - 1)`` (the weight
    gradients, a third of the work, fill the remaining gaps).
    """
    p, m, v = stages, micro_batches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m + p - 1)
    raise ValueError(f"no idle-fraction formula for pipeline schedule {schedule!r}")


class BubbleTimer:
    """Times compute inside one rank's schedule; :meth:`gather` turns it into per-stage figures."""

    def __init__(self, *, stage_id: int, num_stages: int, micro_batches: int, schedule: str,
                 device: torch.device, virtual_stages: int = 1) -> None:
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self._device = device
        self._cuda = device.type == "cuda"
        self._compute_s = 0.0
        self._schedule_s = 0.0
        self._depth = 0  # a timed call inside another (the loss inside a forward) is counted once
        # Sums since the last print step, per stage: [idle_s, schedule_s].
        self._window = [[0.0, 0.0] for _ in range(num_stages)]

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` counted as compute."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._sync()
            begin = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._sync()
                self._compute_s += time.perf_counter() - begin

        return run

    def wrap_stages(self, stages: list[Any]) -> None:
        """Time the compute methods of these PipelineStage objects (instance attributes shadow
        the class's, so the schedules call the timed ones)."""
        for stage in stages:
            for name in _TIMED:
                method = getattr(stage, name, None)
                if method is not None:
                    setattr(stage, name, self.timed(method))

    def run(self, schedule_step: Callable[[], Any]) -> Any:
        """Run one schedule step, timing it whole."""
        self._compute_s = 0.0
        self._sync()
        begin = time.perf_counter()
        try:
            return schedule_step()
        finally:
            self._sync()
            self._schedule_s = time.perf_counter() - begin

    def gather(self) -> dict[str, Any]:
        """Every stage's figures of the batch just run (a collective over the world: every rank
        calls it). Returns what ``engine.last_bubble`` holds:

        ``schedule``, ``stages``, ``micro_batches``, ``theory_idle_fraction`` (the
        schedule's closed form), this rank's ``stage``, ``schedule_s``, ``compute_s``, ``idle_s``,
        ``idle_fraction``, and ``per_stage``: one dict per stage with the same four times,
        averaged over the ranks of that stage (data and tensor ranks).
        """
        mine = torch.tensor([float(self.stage_id), self._schedule_s, self._compute_s], dtype=torch.float64)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rows = [mine.tolist()]
        if world > 1:
            local = mine.to(self._device)
            gathered = torch.empty(world * 3, dtype=torch.float64, device=self._device)
            collectives.all_gather_into_tensor(gathered, local, group=None, purpose="pipeline bubble timers")
            values = gathered.tolist()
            rows = [values[i : i + 3] for i in range(0, len(values), 3)]
        per_stage = []
        for s in range(self.num_stages):
            at = [r for r in rows if int(r[0]) == s]
            schedule_s = sum(r[1] for r in at) / len(at)
            compute_s = sum(r[2] for r in at) / len(at)
            per_stage.append(_figures(s, schedule_s, compute_s))
            self._window[s][0] += per_stage[-1]["idle_s"]
            self._window[s][1] += schedule_s
        own = _figures(self.stage_id, self._schedule_s, self._compute_s)
        return {"schedule": self.schedule, "stages": self.num_stages, "micro_batches": self.micro_batches,
                "theory_idle_fraction": theory_idle_fraction(self.num_stages, self.micro_batches, self.schedule,
                                                             self.virtual_stages),
                **own, "per_stage": per_stage}

    def window_metrics(self) -> dict[str, float]:
        """Idle fraction per stage since the last call (the step log's print window); resets."""
        out = {f"pipe_idle_s{s}": idle / total for s, (idle, total) in enumerate(self._window) if total > 0}
        self._window = [[0.0, 0.0] for _ in range(self.num_stages)]
        return out


def _figures(stage: int, schedule_s: float, compute_s: float) -> dict[str, float]:
    idle = max(0.0, schedule_s - compute_s)
    return {"stage": stage, "schedule_s": schedule_s, "compute_s": compute_s, "idle_s": idle,
            "idle_fraction": idle / schedule_s if schedule_s > 0 else 0.0}
