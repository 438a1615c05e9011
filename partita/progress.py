"""A progress display for training loops that behaves in terminals, log files and on many ranks.

tqdm draws a live bar, which is right in a terminal but fills log files (SLURM, CI, ``| tee``)
with carriage-return noise. When stdout is not a terminal this prints a plain line every
``interval_s`` seconds instead. Only one process shows anything (rank 0 by default), since N
ranks drawing N bars into one terminal is unreadable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm


def _is_rank_zero() -> bool:
    """Rank 0 of torch.distributed if it is initialized, else of the launcher's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _format_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """Progress over ``total`` units of work, optionally wrapping an iterable.

    Use either ``for item in Progress(iterable, ...)`` (one unit per item) or call
    ``update(n, **metrics)`` yourself; ``metrics`` are shown after the counter
    (``loss=2.31 tok/s=9.8k``). Close it (or use it as a context manager) to print the final line.
    """

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        enabled: bool | None = None,
        interval_s: float = 10.0,
        file: Any = None,
    ) -> None:
        self._iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total = total
        self.desc = desc
        self.n = 0
        self.enabled = _is_rank_zero() if enabled is None else enabled
        self._file = sys.stdout if file is None else file
        self._interval_s = interval_s
        self._metrics: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._last_print = self._start
        self._bar: tqdm | None = None
        self._closed = False
        isatty = getattr(self._file, "isatty", None)
        if self.enabled and isatty is not None and isatty():
            self._bar = tqdm(total=total, desc=desc, file=self._file, dynamic_ncols=True)

    def __iter__(self) -> Iterator[Any]:
        if self._iterable is None:
            raise TypeError("this Progress wraps no iterable; call update() instead of iterating")
        for item in self._iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1, **metrics: Any) -> None:
        """Advance by ``n`` units and replace the shown metrics with any given."""
        self.n += n
        self._metrics.update(metrics)
        if not self.enabled:
            return
        if self._bar is not None:
            if metrics:
                self._bar.set_postfix({k: _format_metric(v) for k, v in self._metrics.items()}, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last_print >= self._interval_s:
            self._last_print = now
            self._print_line()

    def write(self, message: str) -> None:
        """Print a message without breaking the bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._file)
        else:
            print(message, file=self._file, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            self._print_line()

    def _print_line(self) -> None:
        elapsed = time.perf_counter() - self._start
        if self.total:
            counter = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)"
            if 0 < self.n < self.total:
                counter += f", eta {elapsed / self.n * (self.total - self.n):.0f}s"
        else:
            counter = str(self.n)
        metrics = " ".join(f"{k}={_format_metric(v)}" for k, v in self._metrics.items())
        prefix = f"{self.desc}: " if self.desc else ""
        print(f"{prefix}{counter} [{elapsed:.0f}s] {metrics}".rstrip(), file=self._file, flush=True)


def progress(
    iterable_or_total: Iterable | int,
    *,
    desc: str = "",
    enabled: bool | None = None,
    interval_s: float = 10.0,
) -> Progress:
    """A :class:`Progress` over an iterable, or over ``total`` units when given an int.

    Args:
        iterable_or_total: what to iterate, or the number of units ``update()`` will count.
        desc: label in front of the counter.
        enabled: show anything at all; None means "only on rank 0".
        interval_s: seconds between plain log lines when stdout is not a terminal.
    """
    if isinstance(iterable_or_total, int):
        return Progress(total=iterable_or_total, desc=desc, enabled=enabled, interval_s=interval_s)
    return Progress(iterable_or_total, desc=desc, enabled=enabled, interval_s=interval_s)
