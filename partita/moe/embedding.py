"""``ShardedEmbedding``: an embedding table (or bag) split row-wise across ranks, for tables
larger than one rank's memory (the recommender-system case).

The table's ``num_embeddings`` rows are cut into ``num_shards`` equal blocks; shard ``s`` holds
rows ``[s * n, (s + 1) * n)`` and no rank ever allocates the whole table. The ranks that split
one table are an *expert group* of the topology (``topology.expert_groups(num_shards)``), so a
table uses exactly the machinery of expert parallelism (partita/moe/dispatch.py and registry.py):

- forward: each rank sorts its ids by owner, exchanges counts, sends the ids to their owners
  with ``all_to_all_single`` (per-rank split sizes), the owners look the rows up, and the rows
  come back by the inverse all-to-all (an autograd function: gradients return to the owners);
- the shard is an expert parameter to ZeRO: reduced and sharded within its expert-data group
  (the ranks holding the same rows), averaged over the data-parallel world, so its optimizer
  states stay sharded with the rows;
- checkpoints record it as a dim-0 split of the ``(num_embeddings, dim)`` table, so a table
  saved with one number of shards loads with another.

Initial values: rows are drawn N(0, 1) (``nn.Embedding``'s default) from generators seeded per
block of rows, when the layer learns its shard (``initialize``), so the table is the same
whatever the number of shards. A layer with ``num_shards == 1`` holds the whole table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partita.moe.dispatch import _all_to_all_single, all_to_all
from partita.moe.registry import register_expert_params

__all__ = ["ShardedEmbedding"]

_INIT_BLOCK = 1024  # rows per generator seed: the initial table does not depend on the sharding


class ShardedEmbedding(nn.Module):
    """Row-sharded ``nn.Embedding`` (``mode=None``) or ``nn.EmbeddingBag`` (``mode`` "sum"/"mean"
    over the last id dimension). See the module docstring."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, num_shards: int = 1, mode: str | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        if num_shards < 1 or num_embeddings % num_shards != 0:
            raise ValueError(
                f"num_embeddings={num_embeddings} must be divisible by num_shards={num_shards} (each shard holds the "
                f"same number of rows); pad the table to a multiple of {num_shards} rows"
            )
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"mode={mode!r}: use None (an embedding), 'sum' or 'mean' (an embedding bag)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.seed = seed
        # The names expert parallelism uses (registry.py, checkpoints): rows are the "experts".
        self.ep_size = num_shards
        self.num_experts = num_embeddings
        self.num_local_experts = num_embeddings // num_shards
        self.weight = nn.Parameter(torch.empty(self.num_local_experts, embedding_dim))
        self._groups = None
        self._fill_rows(0)
        register_expert_params(self, [self.weight])

    def expert_parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    @property
    def expert_rank(self) -> int:
        return self._groups.expert_rank if self._groups is not None else 0

    def bind(self, groups) -> None:
        """Use these expert groups (``num_shards`` ranks split the table); draws this shard's rows."""
        if groups.ep_size != self.ep_size:
            raise ValueError(f"expert groups for ep_size={groups.ep_size} given to a table with num_shards={self.ep_size}")
        self._groups = groups
        self._fill_rows(groups.expert_rank)

    @torch.no_grad()
    def _fill_rows(self, shard: int) -> None:
        first, n = shard * self.num_local_experts, self.num_local_experts
        for block in range(first // _INIT_BLOCK, (first + n - 1) // _INIT_BLOCK + 1):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            rows = torch.randn(_INIT_BLOCK, self.embedding_dim, generator=g)
            lo, hi = max(first, block * _INIT_BLOCK), min(first + n, (block + 1) * _INIT_BLOCK)
            self.weight[lo - first : hi - first].copy_(rows[lo - block * _INIT_BLOCK : hi - block * _INIT_BLOCK])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be int32/int64, got {ids.dtype}")
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise ValueError(f"ids must lie in [0, {self.num_embeddings}); got {int(flat.min())}..{int(flat.max())}")
        rows_per_shard = self.num_local_experts
        if self.ep_size == 1:
            rows = F.embedding(flat, self.weight)
        else:
            if self._groups is None:
                raise RuntimeError(
                    f"this ShardedEmbedding has num_shards={self.ep_size} but no groups: train it through "
                    "partita.initialize(), or call partita.moe.bind_experts(model, topology) on every rank first"
                )
            group = self._groups.expert_group
            owner = torch.div(flat, rows_per_shard, rounding_mode="floor")
            order = torch.argsort(owner, stable=True)
            counts = torch.bincount(owner, minlength=self.ep_size)
            received = torch.empty_like(counts)
            _all_to_all_single(received, counts, None, None, group, "sharded embedding id counts")
            send, got = counts.tolist(), received.tolist()
            wanted = torch.empty(sum(got), dtype=torch.long, device=flat.device)
            _all_to_all_single(wanted, (flat[order] % rows_per_shard).contiguous(), got, send, group, "sharded embedding ids")
            looked_up = F.embedding(wanted, self.weight)
            back = all_to_all(looked_up, group, out_splits=send, in_splits=got, purpose="sharded embedding rows")
            rows = back.index_select(0, torch.argsort(order))
        out = rows.reshape(*ids.shape, self.embedding_dim)
        if self.mode == "sum":
            return out.sum(dim=-2)
        if self.mode == "mean":
            return out.mean(dim=-2)
        return out
