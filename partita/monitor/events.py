"""What a monitor sink is: the event tuple and the two-method interface every sink implements.

This module sits below both the sinks (``csv``, ``tensorboard``, ``wandb``) and the fan-out in
``partita.monitor.monitors`` that builds them, so the sinks never import the module that
imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# (tag, value, step): ``Train/Samples/<metric>``, its value, the samples trained so far.
Event = tuple[str, float, int]


class Monitor(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...
