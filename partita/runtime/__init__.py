"""DeepSpeed's ``deepspeed.runtime`` paths, for scripts that import from them.

    from partita.runtime.zero.partition_parameters import GatheredParameters
    from partita.runtime.engine import DeepSpeedEngine

Each module here re-exports partita's implementation under DeepSpeed's module path; nothing
is implemented twice. Submodules are attributes of this package on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    import pkgutil

    return sorted(set(globals()) | {info.name for info in pkgutil.iter_modules(__path__)})
