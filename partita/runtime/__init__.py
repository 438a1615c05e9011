"""DeepSpeed's ``deepspeed.runtime`` paths, for scripts that import from them.

    from partita.runtime.zero.partition_parameters import GatheredParameters
    from partita.runtime.engine import DeepSpeedEngine

Each module here re-exports partita's implementation under DeepSpeed's module path; nothing
is implemented twice. Submodules are attributes of this package on first use.
"""

from __future__ import annotations

from partita.runtime._missing import submodules

__getattr__ = submodules(__name__)


def __dir__() -> list[str]:
    import pkgutil

    return sorted(set(globals()) | {info.name for info in pkgutil.iter_modules(__path__)})
