"""The multi-axis Topology on real gloo process groups: which ranks share each group.

Oracle: the groups are computed here by hand from the row-major rank order
(pipe, data, sequence, tensor) and compared with what every group really contains (an
all-gather of global ranks over it), so a wrong axis order or a wrong view fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed


def _members(group: dist.ProcessGroup) -> list[int]:
    size = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t.item()) for t in out]


def _topology_groups(pipe: int, sequence: int, tensor: int, ep_size: int) -> dict:
    from partita.distributed import build_topology, init_distributed
    from partita.distributed.topology import Axis

    init_distributed(backend="gloo", timeout_seconds=60)
    topo = build_topology(device_type="cpu", sizes={Axis.PIPE: pipe, Axis.SEQUENCE: sequence, Axis.TENSOR: tensor})
    experts = topo.expert_groups(ep_size)
    return {
        "coordinate": {a.value: r for a, r in topo.coordinate().items()},
        "sizes": {a.value: topo.axis_size(a) for a in topo.coordinate()},
        "groups": {a.value: _members(topo.axis_group(a)) for a in topo.coordinate()},
        "zero": _members(topo.zero_group),
        "zero_rank": topo.zero_rank,
        "zero_rank_in_group": dist.get_rank(topo.zero_group),
        "zero_group_ranks": topo.zero_group_ranks(),
        "expert": _members(experts.expert_group),
        "expert_rank": experts.expert_rank,
        "expert_rank_in_group": dist.get_rank(experts.expert_group),
        "expert_data": _members(experts.expert_data_group),
        "expert_data_rank": experts.expert_data_rank,
        "expert_data_rank_in_group": dist.get_rank(experts.expert_data_group),
        "model_parallel": topo.is_model_parallel(),
        "describe": topo.describe(),
    }


@pytest.mark.parametrize(
    "pipe,sequence,tensor,ep_size",
    [(2, 1, 2, 2), (1, 2, 2, 4)],  # pipe x data x tensor = 2x2x2; data x sequence x tensor = 2x2x2
)
def test_eight_ranks_groups_follow_axis_order(pipe: int, sequence: int, tensor: int, ep_size: int) -> None:
    world = 8
    data = world // (pipe * sequence * tensor)
    results = run_distributed(_topology_groups, world, pipe, sequence, tensor, ep_size, timeout=240)
    shape = (pipe, data, sequence, tensor)
    grid = {}
    for rank, coord in enumerate(itertools.product(*(range(n) for n in shape))):
        grid[coord] = rank
    for rank, out in enumerate(results):
        coord = next(c for c, r in grid.items() if r == rank)
        p, d, s, t = coord
        assert out["coordinate"] == dict(zip(("pipe", "data", "sequence", "tensor"), coord))
        assert out["sizes"] == {"pipe": pipe, "data": data, "sequence": sequence, "tensor": tensor}
        assert out["groups"]["tensor"] == [grid[(p, d, s, i)] for i in range(tensor)]
        assert out["groups"]["data"] == [grid[(p, i, s, t)] for i in range(data)]
        assert out["groups"]["sequence"] == [grid[(p, d, i, t)] for i in range(sequence)]
        assert out["groups"]["pipe"] == [grid[(i, d, s, t)] for i in range(pipe)]
        # ZeRO shards over data x sequence, data-major.
        zero = [grid[(p, i, j, t)] for i in range(data) for j in range(sequence)]
        assert out["zero"] == zero and out["zero_group_ranks"] == zero
        assert out["zero_rank"] == out["zero_rank_in_group"] == d * sequence + s
        # Experts borrow ranks from data x sequence: consecutive blocks of ep_size.
        zr = out["zero_rank"]
        assert out["expert"] == zero[(zr // ep_size) * ep_size:(zr // ep_size + 1) * ep_size]
        assert out["expert_rank"] == out["expert_rank_in_group"] == zr % ep_size
        assert out["expert_data"] == zero[zr % ep_size::ep_size]
        assert out["expert_data_rank"] == out["expert_data_rank_in_group"] == zr // ep_size
        assert out["model_parallel"] is True
        assert out["describe"] == f"pipe={pipe} data={data} sequence={sequence} tensor={tensor}"


def _bad_ep(ep_size: int) -> str:
    from partita.distributed import build_topology, init_distributed

    init_distributed(backend="gloo", timeout_seconds=60)
    topo = build_topology(device_type="cpu")
    try:
        topo.expert_groups(ep_size)
    except ValueError as error:
        return str(error)
    return ""


def test_expert_size_must_divide_data_parallel_size() -> None:
    message = run_distributed(_bad_ep, 2, 3)[0]
    assert "ep_size=3 must be >= 1 and divide the data-parallel size 2 (data 2 x sequence 1)" in message


def _initialize_with(config: dict) -> str:
    import partita
    from partita.models.gpt import GPT, GPTConfig

    try:
        engine, *_ = partita.initialize(model=GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16)), config=config)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return engine.topology.describe()


def test_config_sizes_make_the_mesh_and_a_bad_layout_names_every_factor() -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    ok = run_distributed(_initialize_with, 2, {**base, "tensor_parallel": {"autotp_size": 2}})
    assert ok == ["pipe=1 data=1 sequence=1 tensor=2"] * 2
    bad = run_distributed(_initialize_with, 2, {**base, "tensor_parallel": {"autotp_size": 4}})
    for message in bad:
        assert message.startswith("ConfigError: the parallel layout does not fit the job: world size 2 is not "
                                  "divisible by 4 = pipe=1 (pipeline.stages) x data=? (inferred")
        assert "tensor=4 (tensor_parallel.autotp_size)" in message
