"""The refusal every ``partita.runtime`` module gives for a DeepSpeed name partita does not have.

    MISSING = {"BF16_Optimizer": "deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not in partita: ..."}
    __getattr__ = refuse(__name__, MISSING)

``module.BF16_Optimizer`` then raises :class:`partita.MissingDeepSpeedFeature` with the message
(an AttributeError too, so ``hasattr`` stays False and ``getattr(module, name, default)`` gives
the default).

``from module import BF16_Optimizer`` needs one more step. Python turns any AttributeError that
a module's ``__getattr__`` raises inside a ``from ... import`` into its own ImportError,
"cannot import name 'BF16_Optimizer'", and drops the message: the user would never learn why or
what to use instead. So when the caller is executing a ``from ... import`` (its current
instruction is ``IMPORT_FROM``), :class:`MissingDeepSpeedImport` is raised instead: an
ImportError (what a failed import promises) and a NotImplementedError (what it means), not an
AttributeError, so Python passes it on with the message intact.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable, Mapping
from typing import Any

from partita.deepspeed_compat import MissingDeepSpeedFeature

__all__ = ["MissingDeepSpeedImport", "refuse", "submodules"]

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


class MissingDeepSpeedImport(ImportError, NotImplementedError):
    """``from deepspeed.runtime.X import Name`` for a name partita lacks; the message says what to use."""


def _called_by_from_import(frame: Any) -> bool:
    """Whether ``frame`` is executing ``from module import name`` right now."""
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM


def refuse(module_name: str, missing: Mapping[str, str],
           lazy: Mapping[str, tuple[str, str]] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` that raises for every name in ``missing`` (name -> message) and
    gives Python's usual AttributeError for any other name. ``lazy`` (name -> (module, attribute))
    names partita objects imported on first access, for re-exports whose module is heavy
    (the engine, the bootstrap) or would import the caller back."""

    def __getattr__(name: str) -> Any:
        if lazy and name in lazy:
            import importlib

            module, attribute = lazy[name]
            return getattr(importlib.import_module(module), attribute)
        message = missing.get(name)
        if message is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if _called_by_from_import(sys._getframe(1)):
            raise MissingDeepSpeedImport(message, name=module_name)
        raise MissingDeepSpeedFeature(message)

    return __getattr__


def submodules(package_name: str) -> Callable[[str], Any]:
    """A package ``__getattr__`` that imports a submodule on first attribute access, so DeepSpeed's
    dotted paths work from a bare ``import partita as deepspeed``
    (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live``)."""

    def __getattr__(name: str) -> Any:
        import importlib
        import importlib.util

        if not name.startswith("_") and importlib.util.find_spec(f"{package_name}.{name}") is not None:
            return importlib.import_module(f"{package_name}.{name}")
        raise AttributeError(f"module {package_name!r} has no attribute {name!r}")

    return __getattr__
