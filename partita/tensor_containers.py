"""Walk the tensors inside a forward's inputs or outputs without changing the containers' types.

partita rewrites tensors inside what a model returns (ZeRO-3 wraps each output tensor so its
backward gathers the unit's parameters first) and what it receives (the engine casts
floating-point inputs to the compute dtype). The containers around those tensors belong to
the user's code and must come back as they went in: a Hugging Face ``ModelOutput`` (an
``OrderedDict`` subclass that is also a dataclass, read as ``out.loss``), a ``namedtuple``
(read as ``out.logits``), a plain or frozen dataclass, ``OrderedDict``/``defaultdict``, lists
and tuples, nested in any way. Rebuilding them as plain ``dict``/``tuple`` breaks attribute
access; skipping them hides their tensors.

Rules (:func:`map_tensors`):
- ``fn`` runs once per distinct tensor object, so a tensor reachable twice (a ``ModelOutput``
  holds each value as an item and as an attribute; the same tensor under two keys) maps to one
  result in every place;
- a container none of whose tensors changed is returned as is (the very object), so types the
  rules below do not know survive whenever nothing inside them is replaced;
- a changed container is rebuilt with its own type: ``namedtuple`` from its fields, other
  tuple and list types from the item list, mappings by a shallow copy (``copy.copy`` keeps a
  ``defaultdict``'s factory and a ``ModelOutput``'s fields) whose items are then set, and
  dataclasses by a shallow copy whose fields are then set (``object.__setattr__``, so frozen
  ones work too, and ``__init__``/``__post_init__`` never re-run on new values);
- anything else (a custom object, a set) is a leaf and is left untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "tensors_in"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The distinct tensors inside ``value`` (identity, first occurrence order)."""
    found: dict[int, torch.Tensor] = {}

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.setdefault(id(tensor), tensor)
        return tensor

    map_tensors(value, collect)
    return list(found.values())


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor ``t`` inside replaced by ``fn(t)``; containers keep their types."""
    return _Mapper(fn).map(value)


class _Mapper:
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._fn = fn
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (input kept alive, result)

    def map(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            hit = self._done.get(id(value))
            if hit is None:
                hit = self._done[id(value)] = (value, self._fn(value))
            return hit[1]
        if isinstance(value, dict):
            return self._map_mapping(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._map_dataclass(value)
        if isinstance(value, (tuple, list)):
            return self._map_sequence(value)
        return value

    def _map_sequence(self, value: tuple | list) -> tuple | list:
        items = [self.map(v) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        kind = type(value)
        if kind is tuple or kind is list:
            return kind(items)
        if isinstance(value, tuple) and hasattr(kind, "_fields"):  # namedtuple: fields are positional
            return kind(*items)
        return _construct(kind, items)

    def _map_mapping(self, value: dict) -> dict:
        items = {k: self.map(v) for k, v in value.items()}
        changed = {k: v for k, v in items.items() if v is not value[k]}
        if not changed:
            return value
        if type(value) is dict:
            return items
        new = copy.copy(value)
        try:
            for key, item in changed.items():
                new[key] = item  # ModelOutput's __setitem__ sets the attribute too
        except Exception:  # noqa: BLE001 - a mapping that refuses item assignment: rebuild it whole
            return _construct(type(value), items)
        return new

    def _map_dataclass(self, value: Any) -> Any:
        fields = [f.name for f in dataclasses.fields(value)]
        mapped = {name: self.map(getattr(value, name)) for name in fields}
        changed = {name: v for name, v in mapped.items() if v is not getattr(value, name)}
        if not changed:
            return value
        new = copy.copy(value)
        for name, item in changed.items():
            object.__setattr__(new, name, item)
        return new


def _construct(kind: type, items: Any) -> Any:
    try:
        return kind(items)
    except Exception as exc:  # noqa: BLE001 - name the type the caller's model returned
        raise TypeError(
            f"partita could not rebuild a {kind.__module__}.{kind.__qualname__} after replacing the tensors "
            f"inside it ({type(exc).__name__}: {exc}); return a tuple, list, dict, namedtuple or dataclass "
            "from the module's forward, or give this type a constructor that takes its items"
        ) from exc
