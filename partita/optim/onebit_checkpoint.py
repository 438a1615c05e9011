"""The 1-bit optimizers' error feedback in checkpoints (DeepSpeed resets it on load, losing it).

What a 1-bit optimizer's compressed phase carries from step to step, and where it is saved:
- ``exp_avg``, ``exp_avg_sq``, ``server_error``: partition-shaped optimizer state, saved per
  parameter like Adam's moments and re-cut for any world size by the checkpoint code;
- the synchronised momentum of the whole model: the concatenation of the ranks' ``exp_avg``
  partitions, so it is not saved but rebuilt by one all-gather at the next step;
- the worker error: each rank's own residual of compressing its momentum estimate, over the whole
  model. Saved here by every rank in its rank file, per parameter and over the parameter's whole
  elements (``onebit/worker_error/<name>``), so no layout is baked in.

On load at the saved world size each rank takes its own worker error back: the resumed run is the
uninterrupted one. At another world size no rank has a counterpart of an old rank, so every rank
starts from the *mean* of the saved worker errors: what the server's average re-injects in the next
step, ``mean_r e_r``, is then exactly what it would have been.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from partita.zero.shard_group import pack_into_columns

if TYPE_CHECKING:
    from partita.optim.onebit import OneBitAdam

__all__ = ["load_worker_errors", "worker_error_entries", "worker_error_key"]


def worker_error_key(name: str) -> str:
    return f"onebit/worker_error/{name}"


def worker_error_entries(optimizer: OneBitAdam, names: dict[torch.nn.Parameter, str]) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of this rank's worker error per parameter (none before the compressed phase)."""
    entries = []
    for group, error in zip(optimizer.zero_groups, optimizer.worker_errors):
        if error is None:
            continue
        for param, spec in zip(group.params, group.layout.specs):
            columns = error[:, spec.partition_offset : spec.partition_offset + spec.shard_numel]
            entries.append((worker_error_key(names[param]), columns.reshape(-1)[: spec.numel].clone()))
    return entries


@torch.no_grad()
def load_worker_errors(optimizer: OneBitAdam, reader: Any, meta: dict[str, Any], names: dict[torch.nn.Parameter, str],
                       rank_file: Any) -> None:
    """Set ``optimizer``'s worker errors from a checkpoint (see the module docstring)."""
    saved_world = int(meta["world_size"])
    rank = dist.get_rank()
    sources = [rank] if saved_world == dist.get_world_size() else list(range(saved_world))
    errors: list[torch.Tensor | None] = []
    for group in optimizer.zero_groups:
        keys = [worker_error_key(names[p]) for p in group.params]
        if not reader.has(rank_file(sources[0]), keys[0]):
            errors.append(None)  # saved in the warm-up: no error feedback yet
            continue
        matrix = torch.zeros((group.layout.num_shards, group.layout.partition_numel), dtype=torch.float32,
                             device=group.master.device)
        for key, spec in zip(keys, group.layout.specs):
            total = sum(reader.tensor(rank_file(s), key).to(torch.float32) for s in sources)
            pack_into_columns(matrix, spec.partition_offset, spec, total / len(sources))
        errors.append(matrix)
    optimizer.worker_errors = errors
