"""Weights & Biases monitor. Offline (no network): set ``WANDB_MODE=offline``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partita.monitor.events import Event


class WandbMonitor:
    """One W&B run per training job, logged from rank 0 (needs the ``wandb`` package)."""

    def __init__(self, *, project: str, group: str | None, team: str | None, run_config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, group=group, entity=team, config=run_config)

    def write_events(self, events: Sequence[Event]) -> None:
        if not events:
            return
        # One log call per print step: W&B needs steps that only grow, which samples do.
        step = max(s for _, _, s in events)
        self._run.log({tag: value for tag, value, _ in events}, step=step)

    def close(self) -> None:
        self._run.finish()
