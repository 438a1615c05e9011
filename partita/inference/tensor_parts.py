"""A tensor as the plain tensors it is stored in, for torchao's quantized weights and plain ones alike.

torchao's weight-only formats (``Int8Tensor``, ``IntxUnpackedToInt8Tensor``, ``Int4OpaqueTensor``,
``Int4TilePackedTo4dTensor``...) are wrapper tensor subclasses: the bytes live in a few inner plain
tensors (``qdata``, ``scale``, ``zero_point``...) named by ``__tensor_flatten__``. Their own
``pin_memory`` / ``.to(copy=...)`` / ``is_pinned`` are implemented unevenly (``IntxUnpackedToInt8Tensor``
has no ``is_pinned``, and rejects ``.to(copy=True)``), so partita moves, pins and counts them through
their parts: every operation below works on the plain leaves and rebuilds the subclass with
``__tensor_unflatten__``. That moves the int8/int4 data as stored, never a dequantized copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["leaves", "map_leaves", "stored_nbytes"]


def leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``t``'s data (``t`` itself when it is a plain tensor)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from leaves(getattr(t, name))
    else:
        yield t


def map_leaves(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t`` rebuilt with ``fn`` applied to each plain leaf (same subclass, same metadata)."""
    if not is_traceable_wrapper_subclass(t):
        return fn(t)
    names, ctx = t.__tensor_flatten__()
    inner = {name: map_leaves(getattr(t, name), fn) for name in names}
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def stored_nbytes(tensors) -> int:
    """Bytes the given tensors occupy as stored, each storage counted once (tied weights, views)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        for leaf in leaves(t):
            storage = leaf.untyped_storage()
            key = (str(leaf.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
