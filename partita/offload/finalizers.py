"""Closing what an offload object holds, once: when it is closed, or when it is collected.

Why not a plain ``weakref.finalize``: its callback runs on whichever thread the garbage collector
happens to run on. An NVMe swap store's close waits for its I/O threads; when the collector runs
on one of those very threads (a block request allocates, a collection starts there) while a read
is in flight (the read-ahead a step leaves for the next step, with the engine just dropped),
that wait is for the thread itself and never ends. So a close triggered by the collector on any
thread but the main one is handed to a thread of its own and the collecting thread goes on. An
explicit close, and the one at interpreter exit (on the main thread), still run in place and
have finished when they return.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Closer"]


def _when_collected(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    if threading.current_thread() is threading.main_thread():
        fn(*args)
        return
    # Not a daemon: an exit right after still lets the close finish (files removed).
    threading.Thread(target=fn, args=args, name="partita-offload-close").start()


class Closer:
    """Runs ``fn(*args)`` once: at :meth:`__call__` (in place), or when ``owner`` is collected or
    the interpreter exits (see the module docstring). ``args`` must not refer to ``owner``."""

    def __init__(self, owner: object, fn: Callable[..., None], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._finalizer = weakref.finalize(owner, _when_collected, fn, args)

    @property
    def alive(self) -> bool:
        """Not run yet."""
        return self._finalizer.alive

    def __call__(self) -> None:
        if self._finalizer.detach() is not None:
            self._fn(*self._args)
