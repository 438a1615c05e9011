"""Checkpoints: complete training state, exact resume, resharding on load, safe and verified files.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the entry points (they delegate
to :mod:`partita.checkpoint.save` and :mod:`partita.checkpoint.load`); the format is described
in :mod:`partita.checkpoint.format`; ``partita checkpoint inspect|verify|consolidate`` is
:mod:`partita.checkpoint.cli`. This package module stays import-light: the config loader
imports :mod:`partita.checkpoint.config` through it.
"""

from __future__ import annotations

from partita.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointSyncError

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSyncError",
    "wait_for_pending_save",
]


def wait_for_pending_save() -> None:
    """Block until this process's asynchronous checkpoint save (if any) is on disk; re-raise its error."""
    from partita.checkpoint.save import wait_for_pending_save as wait

    wait()

