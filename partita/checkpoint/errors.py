"""Errors raised by checkpoint saving and loading.

They subclass ``ValueError`` like every user-triggerable partita error, so a caller that
catches ``ValueError`` keeps working; the subclass says which kind of problem it is.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """Something about a checkpoint call or a checkpoint directory is wrong; the message says what and how to fix it."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""


class CheckpointSyncError(CheckpointError):
    """The ranks did not make the same checkpoint call (only some called, or with different arguments)."""
