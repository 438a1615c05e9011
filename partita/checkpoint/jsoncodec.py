"""JSON with tensors: how non-tensor state (client_state, scheduler, hyperparameters) is stored.

Checkpoints never pickle, so everything that is not a tensor must be JSON. Plain JSON loses
two things training state relies on, so they get a tagged form:

- tuples (``betas=(0.9, 0.999)``) come back as tuples: ``{"__tuple__": [...]}``;
- dicts whose keys are not all strings (``{0: ...}``) keep their key types:
  ``{"__dict__": [[key, value], ...]}``.

A tensor is replaced by ``{"__tensor__": "<key>"}`` and handed to a *sink* (a dict the
caller writes into a safetensors file). Anything else is refused with the path of the
offending value and its type, at save time, so a checkpoint that was written can always be
read back. Floats round-trip exactly (``json`` writes ``repr``), inf and nan included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.safetensors_io import DTYPE_CODES

_MARKERS = frozenset({"__tensor__", "__tuple__", "__dict__"})


def encode(value: Any, *, path: str, sink: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-ready form of ``value``; tensors go to ``sink`` under keys derived from ``path``.

    Args:
        value: the object to store.
        path: how the value is named in error messages and tensor keys (``client_state['ema']``).
        sink: receives ``{key: tensor}`` for every tensor found.

    Raises:
        CheckpointError: a value is neither JSON nor a tensor (names its path and type).
    """
    if value is None or type(value) in (bool, int, float, str):
        return value
    for base in (bool, int, float, str):
        # Subclasses (IntEnum, numpy.float64) are stored as their base type, which is how they load.
        if isinstance(value, base):
            return base(value)
    if isinstance(value, torch.Tensor):
        problem = _unstorable(value)
        if problem is not None:
            # Refused here, before any rank writes, rather than by the file writer later
            # (on the background thread of an asynchronous save, that error would surface
            # only at the next checkpoint call).
            raise CheckpointError(
                f"{path} is {problem}, which a checkpoint cannot hold: safetensors stores dense tensors of "
                f"dtypes {', '.join(sorted(str(d).replace('torch.', '') for d in DTYPE_CODES))}; convert it "
                "(.to_dense(), torch.view_as_real(), .to(torch.float32)) or keep it out of the checkpoint"
            )
        key = path
        if key in sink:
            raise CheckpointError(f"two tensors would be stored under the key {key!r}; rename one of them")
        sink[key] = value.detach()
        return {"__tensor__": key}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, path=f"{path}[{i}]", sink=sink) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, path=f"{path}[{i}]", sink=sink) for i, v in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _MARKERS)
        if plain:
            return {k: encode(v, path=f"{path}[{k!r}]", sink=sink) for k, v in value.items()}
        return {
            "__dict__": [
                [encode(k, path=f"{path}.keys()[{i}]", sink=sink), encode(v, path=f"{path}[{k!r}]", sink=sink)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    raise CheckpointError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot hold: "
        "partita stores JSON values (dict, list, tuple, str, int, float, bool, None) and torch tensors, and "
        "never pickles; convert it (int(), float(), str(), .tolist(), torch.as_tensor()) or keep it out of "
        "the checkpoint"
    )


def _unstorable(tensor: torch.Tensor) -> str | None:
    """Why safetensors cannot store ``tensor`` (sparse layout, complex or quantised dtype), or None."""
    if tensor.layout != torch.strided:
        return f"a tensor with layout {tensor.layout}"
    if tensor.dtype not in DTYPE_CODES:
        return f"a tensor of dtype {tensor.dtype}"
    return None


def decode(value: Any, *, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Invert :func:`encode`; ``tensor(key)`` returns the stored tensor for a key."""
    if isinstance(value, list):
        return [decode(v, tensor=tensor) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (marker, inner), = value.items()
            if marker == "__tensor__":
                return tensor(inner)
            if marker == "__tuple__":
                return tuple(decode(v, tensor=tensor) for v in inner)
            if marker == "__dict__":
                return {_hashable(decode(k, tensor=tensor)): decode(v, tensor=tensor) for k, v in inner}
        return {k: decode(v, tensor=tensor) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
