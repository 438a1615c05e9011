"""Row-sharded embedding tables (partita.moe.ShardedEmbedding) on 2 and 4 gloo ranks equal an unsharded
nn.Embedding / EmbeddingBag in plain torch; each rank holds only its rows (and their Adam states)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed

ROWS, DIM, STEPS, MICRO, BAG = 16, 4, 3, 3, 2


class TableNet(nn.Module):
    def __init__(self, *, num_shards: int, mode: str | None) -> None:
        super().__init__()
        from partita.moe import ShardedEmbedding

        torch.manual_seed(0)
        self.table = ShardedEmbedding(ROWS, DIM, num_shards=num_shards, mode=mode)
        self.head = nn.Linear(DIM, 1)
        self.mode = mode

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.table(ids)
        if self.mode is None:
            h = h.sum(dim=1)
        return F.mse_loss(self.head(h), y)


def _data(world: int):
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, ROWS, (MICRO * world, BAG), generator=g) for _ in range(STEPS)]
    ids[0][:, :] = 3  # the first step looks up one row only: the other shard gets no id
    ys = [torch.randn(MICRO * world, 1, generator=g) for _ in range(STEPS)]
    return ids, ys


def _config(world: int, stage: int) -> dict:
    return {"train_batch_size": MICRO * world, "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 4}, "steps_per_print": 1000}


def train_tables(runs: list[dict]) -> list[dict]:
    import partita
    from partita.zero.gathered import GatheredParameters

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for spec in runs:
        model = TableNet(num_shards=spec["shards"], mode=spec["mode"])
        engine, optimizer, _, _ = partita.initialize(model=model, config=_config(world, spec["stage"]))
        ids, ys = _data(world)
        for step in range(STEPS):
            loss = engine(ids[step][rank * MICRO : (rank + 1) * MICRO], ys[step][rank * MICRO : (rank + 1) * MICRO])
            engine.backward(loss)
            engine.step()
        with GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        table_states = sum(t.numel() for g in optimizer.groups if any(p is model.table.weight for p in g.params)
                           for t in optimizer.inner.state[g.master].values() if torch.is_tensor(t) and t.dim() > 0)
        out.append({"params": params, "first_row": model.table.expert_rank * (ROWS // spec["shards"]),
                    "table_state_numel": table_states})
    return out


def _reference(mode: str | None, world: int) -> dict[str, torch.Tensor]:
    model = TableNet(num_shards=1, mode=mode)  # the same initial table (drawn per row block) and head
    table = nn.Embedding(ROWS, DIM) if mode is None else nn.EmbeddingBag(ROWS, DIM, mode=mode)
    table.weight.data.copy_(model.table.weight.data)
    head = model.head
    opt = torch.optim.Adam([table.weight, *head.parameters()], lr=0.05)
    ids, ys = _data(world)
    for step in range(STEPS):
        opt.zero_grad()
        h = table(ids[step]).sum(dim=1) if mode is None else table(ids[step])
        F.mse_loss(head(h), ys[step]).backward()
        opt.step()
    return {"table.weight": table.weight.detach(), "head.weight": head.weight.detach(), "head.bias": head.bias.detach()}


RUNS = [{"shards": 2, "stage": 2, "mode": "mean"}, {"shards": 2, "stage": 3, "mode": None}]


# 4 processes: 4 shards (no rank holds more than a quarter of the table), and 2 shards x 2
# data replicas of each shard (ZeRO then halves each shard's optimizer states again).
RUNS_4 = [{"shards": 4, "stage": 3, "mode": "sum"}, {"shards": 2, "stage": 2, "mode": None}]


def _check_tables(per_rank: list[list[dict]], runs: list[dict], world: int) -> None:
    for i, spec in enumerate(runs):
        ref = _reference(spec["mode"], world)
        rows = ROWS // spec["shards"]
        for rank, results in enumerate(per_rank):
            got = results[i]
            first = got["first_row"]
            assert got["params"]["table.weight"].shape == (rows, DIM)  # only this shard's rows exist here
            torch.testing.assert_close(got["params"]["table.weight"], ref["table.weight"][first : first + rows],
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["params"]["head.weight"], ref["head.weight"], rtol=1e-5, atol=1e-6)
            # Adam's two moments cover this rank's rows only, and ZeRO splits them over the ranks
            # that hold the same rows (world / shards of them).
            assert got["table_state_numel"] == 2 * rows * DIM // (world // spec["shards"])
        assert {r[i]["first_row"] for r in per_rank} == {s * rows for s in range(spec["shards"])}


def test_sharded_table_matches_unsharded() -> None:
    _check_tables(run_distributed(train_tables, 2, RUNS, timeout=600), RUNS, 2)


def test_sharded_table_on_4_processes() -> None:
    _check_tables(run_distributed(train_tables, 4, RUNS_4, timeout=600), RUNS_4, 4)


def test_sharded_table_errors() -> None:
    from partita.moe import ShardedEmbedding, is_moe_param

    with pytest.raises(ValueError, match=r"num_embeddings=10 must be divisible by num_shards=4"):
        ShardedEmbedding(10, DIM, num_shards=4)
    with pytest.raises(ValueError, match=r"mode='max'"):
        ShardedEmbedding(8, DIM, mode="max")
    table = ShardedEmbedding(8, DIM)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\); got 0..8"):
        table(torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="num_shards=2 but no groups"):
        ShardedEmbedding(8, DIM, num_shards=2)(torch.tensor([1]))
    assert not is_moe_param(table.weight)
    # One shard is nn.Embedding's math on the same table.
    ids = torch.tensor([[1, 7], [2, 2]])
    assert torch.equal(table(ids), F.embedding(ids, table.weight))
