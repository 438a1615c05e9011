"""How DeepSpeed cuts a layer list into pipeline stages (``PipelineModule(partition_method=...)``).

The three methods and their arithmetic follow DeepSpeed's ``runtime/pipe/module.py`` and
``runtime/utils.py`` so that a model partitions the same way under partita as under DeepSpeed:

- ``"uniform"``: layer counts as equal as possible, the extra layers on the first stages;
- ``"parameters"`` (the default): balance the trainable-parameter count of each layer;
- ``"type:<regex>"``: balance the number of layers whose class name matches ``<regex>``
  (case-insensitive ``re.search``), so e.g. ``"type:transformer"`` spreads the blocks evenly.

Balancing solves the linear partition problem by dynamic programming, minimising the spread
(heaviest minus lightest stage), as DeepSpeed's ``partition_balanced`` does. Boundaries are
returned as ``parts``: stage ``s`` owns layers ``parts[s] .. parts[s + 1] - 1``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["partition_uniform", "partition_balanced", "partition_by_method", "layer_type_weights"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` runs of ``num_items`` items, sizes differing by at most one.

    With fewer items than parts, the first ``num_items`` parts get one item each and the rest none.
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    # The first `residual` parts take one extra item each (DeepSpeed adds 1 to every boundary after them).
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries that minimise (heaviest part - lightest part) over contiguous parts of ``weights``.

    The linear partition problem by dynamic programming over (items, parts); ties keep the last
    split point examined, as DeepSpeed's ``>=`` comparison does, so results match it exactly.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                segment = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], segment)
                min_sum = min(dp_min[k][j - 1], segment)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


def layer_type_weights(type_names: Sequence[str | None], pattern: str) -> list[int]:
    """1 for each layer whose class name matches ``pattern`` (case-insensitive search), else 0.

    Raises ValueError when nothing matches: balancing zeros would put every layer on one stage.
    """
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1 if name is not None and regex.search(name) else 0 for name in type_names]
    if not any(weights):
        raise ValueError(
            f"partition_method 'type:{pattern}' matches no layer; the layers' class names are "
            f"{[n for n in type_names if n is not None]}: give a regex that matches the repeated blocks"
        )
    return weights


def partition_by_method(
    method: str, *, num_parts: int, param_counts: Sequence[int], type_names: Sequence[str | None]
) -> list[int]:
    """Stage boundaries for ``method`` ("uniform", "parameters" or "type:<regex>", any case)."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(param_counts), num_parts)
    if lowered == "parameters":
        return partition_balanced(param_counts, num_parts)
    if lowered.startswith("type:"):
        return partition_balanced(layer_type_weights(type_names, method.split(":", 1)[1]), num_parts)
    if lowered == "profile":
        raise NotImplementedError(
            "partition_method='profile' is not implemented (DeepSpeed raises NotImplementedError too); "
            "use 'parameters', 'uniform' or 'type:<regex>'"
        )
    raise ValueError(
        f"partition_method={method!r} is not one of 'parameters', 'uniform', 'type:<regex>'"
    )
