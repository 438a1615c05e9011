"""Samples and tokens per second, with the first steps left out.

The first steps of a run are slow for reasons that say nothing about steady state
(allocator growth, kernel autotuning, lazy initialisation), so the clock starts only after
``warmup_steps`` optimizer steps, as DeepSpeed's throughput timer skips its first two.
Rates are measured between synchronisation points only (the step log's print steps), so a
GPU run is never synchronised just to time it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True, slots=True)
class Span:
    """Work done in a stretch of wall-clock time on this rank."""

    seconds: float
    samples: int  # global samples (all ranks)
    local_tokens: int  # tokens this rank processed (counted from its inputs)


def count_tokens(args: tuple, kwargs: dict) -> tuple[int, int | None]:
    """(tokens, sequence length) of a language-model batch: the first integer tensor of at
    least two dimensions among the inputs is read as (batch, sequence, ...) token ids."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point() and not value.is_complex():
            return value.numel(), int(value.shape[1])
    return 0, None


class ThroughputMeter:
    """Measures a window (since the last :meth:`take`) and the whole run after warm-up."""

    def __init__(self, *, warmup_steps: int, sync: Callable[[], Any]) -> None:
        self.warmup_steps = warmup_steps
        self._sync = sync
        self._steps_seen = 0
        self._start: tuple[float, int] | None = None  # (time, global samples) when the clock started
        self._window: tuple[float, int] | None = None
        self._total_tokens = 0
        self._window_tokens = 0
        self._step_tokens = 0

    @property
    def started(self) -> bool:
        return self._start is not None

    def _begin(self, global_samples: int) -> None:
        self._sync()  # once per run: the clock must not start while earlier work is queued
        now = time.perf_counter()
        self._start = self._window = (now, global_samples)

    def on_forward(self, *, local_tokens: int, global_samples: int) -> None:
        """A training forward pass began, with ``local_tokens`` tokens on this rank."""
        if self._start is None and self.warmup_steps == 0:
            self._begin(global_samples)
        if self._start is not None:
            self._total_tokens += local_tokens
            self._window_tokens += local_tokens
            self._step_tokens += local_tokens

    def on_step_end(self, *, global_samples: int) -> None:
        """An optimizer step ended (counted from this meter's creation, so a resumed run warms up too)."""
        self._steps_seen += 1
        self._step_tokens = 0
        if self._start is None and self._steps_seen == self.warmup_steps:
            self._begin(global_samples)

    def exclude_step(self, *, seconds: float, samples: int) -> None:
        """Leave the step that is ending out of the rates (the flops profiler's step, slowed by
        its per-module synchronisation). Call before :meth:`on_step_end`."""
        if self._start is None or self._window is None:
            return
        # Moving the start later by the step's time and samples removes exactly that step.
        self._start = (self._start[0] + seconds, self._start[1] + samples)
        self._window = (self._window[0] + seconds, self._window[1] + samples)
        self._total_tokens -= self._step_tokens
        self._window_tokens -= self._step_tokens

    def take(self, *, now: float, global_samples: int) -> tuple[Span | None, Span | None]:
        """(this window, everything since the clock started), and start a new window.

        Call after the device is synchronised; None where no measured step ended yet.
        """
        if self._start is None or self._window is None:
            return None, None
        window = Span(now - self._window[0], global_samples - self._window[1], self._window_tokens)
        total = Span(now - self._start[0], global_samples - self._start[1], self._total_tokens)
        self._window = (now, global_samples)
        self._window_tokens = 0
        return (window if window.samples > 0 else None), (total if total.samples > 0 else None)
