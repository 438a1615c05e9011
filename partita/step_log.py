"""Periodic step log (``steps_per_print``) and the ``wall_clock_breakdown`` timers.

Kept deliberately small: rank 0 prints one line every ``steps_per_print`` optimizer
steps with the loss, learning rate, gradient norm, loss scale, skipped steps and
throughput; with ``wall_clock_breakdown`` it adds the mean forward / backward / step
time since the last line. Timers synchronise the device only when the breakdown is on,
because a synchronisation per phase costs overlap.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import Iterator

import torch

logger = logging.getLogger("partita")


class StepLogger:
    def __init__(
        self, *, steps_per_print: int, wall_clock_breakdown: bool, device: torch.device, is_logging_rank: bool
    ) -> None:
        self._every = steps_per_print
        self._breakdown = wall_clock_breakdown
        self._device = device
        self._enabled = is_logging_rank
        self._totals: dict[str, float] = defaultdict(float)
        self._last_loss: torch.Tensor | None = None
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self.last_line: str | None = None

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    @contextlib.contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        if not self._breakdown:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._totals[phase] += time.perf_counter() - start

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._last_loss = loss.detach()

    def end_step(self, engine) -> None:
        """Called after each optimizer step; prints every ``steps_per_print`` steps."""
        self._window_samples += engine.train_batch_size()
        if engine.global_steps % self._every != 0:
            return
        elapsed = time.perf_counter() - self._window_start
        parts = [
            f"step={engine.global_steps}",
            f"loss={self._last_loss.float().item():.4f}" if self._last_loss is not None else "loss=n/a",
            "lr=" + ",".join(f"{lr:.3e}" for lr in engine.get_lr()),
            f"grad_norm={engine.get_global_grad_norm():.4f}",
            f"loss_scale={engine.get_loss_scale():g}",
            f"skipped={engine.skipped_steps}",
            f"samples/s={self._window_samples / max(elapsed, 1e-9):.1f}",
        ]
        if self._breakdown:
            steps = self._every
            parts.append(
                "time(ms/step) " + " ".join(f"{k}={1000 * v / steps:.1f}" for k, v in sorted(self._totals.items()))
            )
        self.last_line = " ".join(parts)
        if self._enabled:
            logger.info(self.last_line)
        self._totals.clear()
        self._window_start = time.perf_counter()
        self._window_samples = 0
