"""The DeepSpeed-style JSON config: load it, validate it, and resolve the batch sizes.

``load_config`` accepts a dict or the path of a ``.json`` file and raises one
:class:`ConfigError` that lists every mistake with its key path, the value given, what is
allowed and a fix.

``PartitaConfig`` and ``load_config`` are imported on first use: the root model imports
every section model (``partita.zero.config``, ``partita.optim.config``, ...), and those
import ``partita.config.base``; loading the root eagerly here would make that a cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from partita.config.base import ConfigError, Problem, StrictSection
from partita.config.batch import BatchSizes, resolve_batch_sizes

if TYPE_CHECKING:
    from partita.config.loader import load_config
    from partita.config.root import PartitaConfig

_LAZY = {"load_config": "partita.config.loader", "PartitaConfig": "partita.config.root"}

__all__ = [
    "BatchSizes",
    "ConfigError",
    "PartitaConfig",
    "Problem",
    "StrictSection",
    "load_config",
    "resolve_batch_sizes",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'partita.config' has no attribute {name!r}")
