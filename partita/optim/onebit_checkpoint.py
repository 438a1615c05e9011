"""The 1-bit optimizers' error feedback in checkpoints (DeepSpeed resets it on load, losing it).

What a 1-bit optimizer's compressed phase carries from step to step, and where it is saved:
- ``exp_avg``, ``exp_avg_sq``, ``server_error``: partition-shaped optimizer state, saved per
  parameter like Adam's moments and re-cut for any world size by the checkpoint code;
- the synchronised momentum of the whole model: the concatenation of the ranks' ``exp_avg``
  partitions, so it is not saved but rebuilt by one all-gather at the next step;
- the worker error: each rank's own residual of compressing its momentum estimate, over the whole
  model. Saved here by every rank in its rank file, per parameter and over the parameter's whole
  elements (``onebit/worker_error/<name>``), so no layout is baked in;
- at stage 0 the server error (each rank's row of the flat group) is saved the same way
  (``onebit/server_error/<name>``, zeros outside the rank's row).

On load at the saved world size each rank takes its own worker error back: the resumed run is the
uninterrupted one. At another world size no rank has a counterpart of an old rank, so every rank
starts from the *mean* of the saved worker errors: what the server's average re-injects in the next
step, ``mean_r e_r``, is then exactly what it would have been.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist


if TYPE_CHECKING:
    from partita.optim.onebit import OneBitAdam

__all__ = ["load_worker_errors", "server_error_key", "worker_error_entries", "worker_error_key"]


def worker_error_key(name: str) -> str:
    return f"onebit/worker_error/{name}"


def server_error_key(name: str) -> str:
    return f"onebit/server_error/{name}"


def worker_error_entries(optimizer: OneBitAdam, names: dict[torch.nn.Parameter, str]) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of this rank's error feedback per parameter (none before the compressed phase):
    its worker error, and at stage 0 its server error (its row; zeros elsewhere), which at stages 1-2
    is per-element optimizer state instead."""
    entries = []
    for g, (group, rows) in enumerate(zip(optimizer.zero_groups, optimizer.rows)):
        error = optimizer.worker_errors[g]
        if error is None:
            continue
        server = None
        if not rows.sharded:
            server = rows.empty()
            server[rows.rank] = optimizer.server_error(g)
        for param, spec in zip(group.params, group.layout.specs):
            entries.append((worker_error_key(names[param]), rows.take(error, spec).clone()))
            if server is not None:
                entries.append((server_error_key(names[param]), rows.take(server, spec).clone()))
    return entries


@torch.no_grad()
def load_worker_errors(optimizer: OneBitAdam, reader: Any, meta: dict[str, Any], names: dict[torch.nn.Parameter, str],
                       rank_file: Any) -> None:
    """Set ``optimizer``'s error feedback from a checkpoint (see the module docstring).

    Server errors: each element has one owner in any layout, so the saved ones move exactly between
    world sizes and stages: per-element state (saved at stages 1-2) or the sum of the ranks' rows
    (saved at stage 0), then cut to this run's rows.
    """
    saved_world = int(meta["world_size"])
    rank = dist.get_rank()
    everyone = list(range(saved_world))
    sources = [rank] if saved_world == dist.get_world_size() else everyone
    errors: list[torch.Tensor | None] = []
    for g, (group, rows) in enumerate(zip(optimizer.zero_groups, optimizer.rows)):
        keys = [worker_error_key(names[p]) for p in group.params]
        if not reader.has(rank_file(0), keys[0]):
            errors.append(None)  # saved in the warm-up: no error feedback yet
            continue
        matrix = rows.empty()
        for key, spec in zip(keys, group.layout.specs):
            rows.put(matrix, spec, sum(reader.tensor(rank_file(s), key).to(torch.float32) for s in sources) / len(sources))
        errors.append(matrix)
        _load_server_error(optimizer, g, reader, names, rank_file, everyone)
    optimizer.worker_errors = errors


def _load_server_error(optimizer: OneBitAdam, g: int, reader: Any, names: dict, rank_file: Any,
                       everyone: list[int]) -> None:
    group, rows = optimizer.zero_groups[g], optimizer.rows[g]
    master = optimizer.param_groups[g]["params"][0]
    state = optimizer.state[master]
    keys = [server_error_key(names[p]) for p in group.params]
    whole = None
    if reader.has(rank_file(0), keys[0]):  # saved at stage 0: every rank's row, zeros elsewhere
        whole = rows.empty()
        for key, spec in zip(keys, group.layout.specs):
            rows.put(whole, spec, sum(reader.tensor(rank_file(s), key).to(torch.float32) for s in everyone))
    elif not rows.sharded and "server_error" in state:  # saved at stages 1-2, loaded whole here
        whole = rows.from_partition(state.pop("server_error"))
    if whole is None:
        return  # stages 1-2 from stages 1-2: the per-element state is already in place
    if rows.sharded:
        state["server_error"] = rows.own(whole).clone()
    else:
        optimizer.server_errors[g] = whole[rows.rank].clone()
