"""Two-hop ZeRO++ qgZ (partita/zero/hierarchical_reduce.py): gloo ranks pretending to be several
nodes (LOCAL_WORLD_SIZE set in each rank before the engine or the groups are built: the reader the
reducer uses). The reduced rows against the exact fp32 sum within the two-rounding bound, the rows'
owners against one hop, the comms logger's bytes against the comm model and against one hop's,
training next to plain ZeRO-3, and checkpoint resume."""

from __future__ import annotations

import os

import torch

from partita.monitor import comm_model as cm
from partita.zero.quantized_comm import BLOCK
from tests.harness import run_distributed
from tests.test_zeropp import STEPS, _config, _train

N = 3 * BLOCK + 5  # a ragged last block
QMAX = {8: 127, 4: 7}


def _contribution(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s packed bucket (world, N): row t is what it sends to rank t. Row t is scaled by
    3^t, so a row reduced into the wrong owner misses by far more than any rounding bound."""
    g = torch.Generator().manual_seed(100 + rank)
    rows = torch.randn(world, N, generator=g) * (3.0 ** torch.arange(world, dtype=torch.float32)).unsqueeze(1)
    rows[:, 7] *= 40  # an outlier in the first block of every row: a coarse scale there
    return rows


def _block_max(x: torch.Tensor) -> torch.Tensor:
    """Per element: the largest magnitude of its block of BLOCK (x 1-D)."""
    padded = torch.nn.functional.pad(x.abs(), (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    return padded.amax(dim=1).repeat_interleave(BLOCK)[: x.numel()]


def _reduce_both_ways(per_node: int) -> dict:
    import torch.distributed as dist

    from partita.zero.hierarchical_reduce import build_node_groups, start_two_hop_reduce_scatter
    from partita.zero.quantized_comm import start_quantized_reduce_scatter

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_node_groups(None, world)
    out = {"nodes": groups.nodes, "per_node": groups.per_node}
    mine = _contribution(rank, world)
    exact = sum(_contribution(r, world)[rank].double() for r in range(world))
    # What a reduce that sent rows to the wrong owner would give this rank (its neighbour's row).
    misrouted = sum(_contribution(r, world)[(rank + 1) % world].double() for r in range(world))
    # Per element, sum over contributing ranks of their block's largest magnitude (row ``rank``).
    block_max = torch.stack([_block_max(_contribution(r, world)[rank]) for r in range(world)])
    for bits in (8, 4):
        work, pending = start_two_hop_reduce_scatter(mine, bits=bits, groups=groups, purpose="test")
        two_hop = pending.reduce()
        work, one = start_quantized_reduce_scatter(mine, bits=bits, group=None, purpose="test")
        work.wait()
        out[bits] = {"two_hop": two_hop, "one_hop": one.reduce(), "exact": exact, "misrouted": misrouted,
                   "block_max": block_max}
    # fp16's overflow check: an inf in one rank's contribution reaches its owner's block as non-finite
    # through both hops (the node's partial has an inf scale when it is re-quantized).
    poisoned = mine.clone()
    if rank == 0:
        poisoned[world - 1, BLOCK + 3] = float("inf")
    _, pending = start_two_hop_reduce_scatter(poisoned, bits=4, groups=groups, purpose="test")
    out["poisoned"] = pending.reduce()
    return out


def _check_rows(ranks: list[dict], world: int) -> None:
    for rank, result in enumerate(ranks):
        for bits in (8, 4):
            r = result[bits]
            q, m = QMAX[bits], r["block_max"]
            # One hop: each contribution is rounded once, by at most half its block's scale m/q.
            one_bound = m.sum(0) / (2 * q)
            # Two hops: node a's partial P_a = sum of its ranks' roundings, so |P~_a - P_a| <= sum_i m_i/(2q),
            # and its block's largest |P~_a| <= sum_i m_i (1 + 1/(2q)); rounding P~_a costs half of that / q.
            # Summed over nodes: sum_r m_r (1 + (1 + 1/(2q))) / (2q). fp32 sums: a relative 1e-5 on top.
            two_bound = m.sum(0) * (2 + 1 / (2 * q)) / (2 * q)
            one_err = (r["one_hop"].double() - r["exact"]).abs()
            two_err = (r["two_hop"].double() - r["exact"]).abs()
            slack = 1e-5 * m.sum(0)
            assert (one_err <= one_bound + slack).all(), (rank, bits)
            assert (two_err <= two_bound + slack).all(), (rank, bits, float((two_err - two_bound).max()))
            assert r["two_hop"].shape == (N,) and r["two_hop"].dtype == torch.float32
            # The bound can tell owners apart: rows are 3^t-scaled, so the neighbour's row breaks it.
            assert not ((r["misrouted"] - r["exact"]).abs() <= two_bound).all(), (rank, bits)
            assert not torch.equal(r["two_hop"], r["one_hop"])  # the second rounding really happened
        poisoned = result["poisoned"]
        if rank == world - 1:
            assert not poisoned[BLOCK: 2 * BLOCK].isfinite().any()
            assert poisoned[:BLOCK].isfinite().all() and poisoned[2 * BLOCK:].isfinite().all()
        else:
            assert poisoned.isfinite().all()


def _cases_4(save_dir: str) -> dict:
    rows = _reduce_both_ways(2)
    # Buckets of 20k elements: the net's 50k gradients go in 3, so a bucket's inter-node hop is started by
    # the next bucket's launch (the reducer's pipelining), except the last one's.
    both = _config(zero_quantized_weights=True, zero_quantized_gradients=True, reduce_bucket_size=20_000)
    out = {"rows": rows, "tiny_one_node": _tiny(4), "tiny_two_nodes": _tiny(2)}
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two for the training runs
    return {
        **out,
        "plain": _train(_config()),
        "both": _train(both, save=f"{save_dir}/ckpt"),
        "resumed": _train(both, steps=range(3, STEPS), load=f"{save_dir}/ckpt"),
        # overlap_comm=false: both hops of each bucket before backward goes on; the same sums.
        "no_overlap": _train(_config(zero_quantized_weights=True, zero_quantized_gradients=True,
                                     reduce_bucket_size=20_000, overlap_comm=False), steps=range(2)),
        # The shard layout is one hop's: the same checkpoint resumes on one "node" (one hop).
        "resumed_one_node": _one_node(lambda: _train(both, steps=range(3, STEPS), load=f"{save_dir}/ckpt")),
    }


def _one_node(run):
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    try:
        return run()
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = "2"


def _cases_8() -> dict:
    import torch.distributed as dist

    out = {"2x4": _reduce_both_ways(4), "4x2": _reduce_both_ways(2)}
    # Uneven nodes (6 + 2 ranks): ranks 6-7 alone would see 4 nodes of 2 and make groups the others never
    # make (a hang). The ranks compare what they read, and all keep one hop.
    from partita.zero.hierarchical_reduce import build_node_groups

    os.environ["LOCAL_WORLD_SIZE"] = "6" if dist.get_rank() < 6 else "2"
    out["uneven"] = build_node_groups(None, 8)
    return out


TINY_NUMEL = 64 * 100 + 100 + 100 * 10 + 10  # tests/test_comm_model.py's tiny model: one ZeRO-3 unit


def _tiny(per_node: int) -> dict:
    """3 steps of a one-unit model, qgZ only: the comms logger's bytes per (op, purpose)."""
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Tanh(), torch.nn.Linear(100, 10))
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "zero_quantized_gradients": True},
           "comms_logger": {"enabled": True}, "steps_per_print": 1000}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    COMMS_LOGGER.reset()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(2, 64, generator=g), torch.randint(0, 10, (2,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
    counted: dict[tuple[str, str], int] = {}
    for r in COMMS_LOGGER.records():
        if "ZeRO-3 parameter all-gather" in r.purpose or "gradient reduction" in r.purpose:
            key = (r.op, r.purpose.split(" (")[0])
            counted[key] = counted.get(key, 0) + r.message_bytes
    return counted


INTRA, INTER, ONE_HOP = ("int4 intra-node gradient reduction", "int4 inter-node gradient reduction",
                         "int4 gradient reduction")


def test_four_ranks_as_two_nodes_of_two(tmp_path) -> None:
    ranks = run_distributed(_cases_4, 4, str(tmp_path))
    assert (ranks[0]["rows"]["nodes"], ranks[0]["rows"]["per_node"]) == (2, 2)
    _check_rows([r["rows"] for r in ranks], 4)

    # Bytes: the comms logger's counts equal the comm model's two-hop plan exactly (3 steps, one
    # unit gathered once per step), and the inter-node hop's message is 1/R of one hop's.
    two_hop_plan = cm.zero3_collectives(TINY_NUMEL, 4, grad_bits=4, gathers=1, ranks_per_node=2)
    one_hop_plan = cm.zero3_collectives(TINY_NUMEL, 4, grad_bits=4, gathers=1)
    for rank in ranks:
        assert rank["tiny_two_nodes"] == {(c.op, c.purpose): 3 * c.count * c.message_bytes for c in two_hop_plan}
        assert rank["tiny_one_node"] == {(c.op, c.purpose): 3 * c.count * c.message_bytes for c in one_hop_plan}
        inter = rank["tiny_two_nodes"][("all_to_all_single", INTER)]
        one = rank["tiny_one_node"][("all_to_all_single", ONE_HOP)]
        assert inter * 2 == one  # the same rows, scales included: N of them instead of N * R
    # Off each node (the model's accounting; the intra-node hop counts zero): 1/R of one hop's all-to-all.
    kw = dict(world=4, ranks_per_node=2)
    assert cm.step_inter_node_bytes(two_hop_plan[1:], **kw) * 2 == cm.step_inter_node_bytes(one_hop_plan[1:], **kw)

    # Training: the same tolerance as one-hop qgZ next to plain ZeRO-3 (tests/test_zeropp.py), and resume.
    for rank in ranks:
        plain, both = rank["plain"]["losses"], rank["both"]["losses"]
        assert plain[-1] < 0.2 * plain[0]
        assert max(abs(a - b) for a, b in zip(both, plain)) <= 0.02 * plain[0], (both, plain)
        assert rank["both"]["bytes"].get(f"all_to_all_single: {INTER}", 0) > 0  # it did go in two hops
        assert f"all_to_all_single: {ONE_HOP}" not in rank["both"]["bytes"]
        assert rank["resumed"]["losses"] == both[3:]  # bit for bit
        assert rank["no_overlap"]["losses"] == both[:2]  # when hop 2 starts changes no sum
        one_node = rank["resumed_one_node"]
        assert f"all_to_all_single: {ONE_HOP}" in one_node["bytes"]  # it did resume on one hop
        assert one_node["losses"] != both[3:]  # one rounding instead of two: not the same numbers...
        assert max(abs(a - b) for a, b in zip(one_node["losses"], both[3:])) <= 0.02 * plain[0]  # ...but close


def test_eight_ranks_as_two_by_four_and_four_by_two() -> None:
    ranks = run_distributed(_cases_8, 8)
    for layout, (nodes, per_node) in (("2x4", (2, 4)), ("4x2", (4, 2))):
        assert (ranks[0][layout]["nodes"], ranks[0][layout]["per_node"]) == (nodes, per_node)
        _check_rows([r[layout] for r in ranks], 8)
    assert all(r["uneven"] is None for r in ranks)


def test_comm_model_two_hop_plan() -> None:
    # GPT-1.3B at 64 ranks, 8 per node: the inter-node hop sends 1/8 of the one-hop all-to-all's bytes
    # off each node, so qwZ + qgZ now sends fewer bytes than plain ZeRO-3 and the warning is silent.
    numel, kw = 1_315_819_520, dict(world=64, ranks_per_node=8)
    one = cm.zero3_collectives(numel, 64, weight_bits=8, grad_bits=4)
    two = cm.zero3_collectives(numel, 64, weight_bits=8, grad_bits=4, ranks_per_node=8)
    plain = cm.zero3_collectives(numel, 64)
    assert [c.purpose for c in two[1:]] == [INTRA, INTER] and two[1].within_node and not two[2].within_node
    assert cm.step_inter_node_bytes(two[2:], **kw) * 8 == cm.step_inter_node_bytes(one[1:], **kw)
    assert cm.step_inter_node_bytes(two, **kw) < 0.5 * cm.step_inter_node_bytes(plain, **kw)
    assert cm.compression_verdict(plain, two, gbps=100, memory_gbytes_per_s=3000, **kw) is None
    assert cm.compression_verdict(plain, one, gbps=100, memory_gbytes_per_s=3000, **kw).startswith("between nodes")
    # One node, or one rank per node: one hop, as the reducer does.
    assert cm.zero3_collectives(numel, 8, grad_bits=4, ranks_per_node=8) == cm.zero3_collectives(numel, 8, grad_bits=4)
    assert cm.zero3_collectives(numel, 8, grad_bits=4, ranks_per_node=1) == cm.zero3_collectives(numel, 8, grad_bits=4)


def test_step_log_no_longer_warns_about_qgz_across_nodes(monkeypatch) -> None:
    # The step log's check (comm_advice.compression_note) for GPT-1.3B's parameter count at 64 GPU ranks,
    # 8 per node (torchrun's LOCAL_WORLD_SIZE): with two hops, qwZ + qgZ pays at 100 Gbps, so no line.
    from types import SimpleNamespace

    from partita.config import load_config
    from partita.monitor import comm_advice

    config = load_config({"train_batch_size": 64, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}})
    engine = SimpleNamespace(config=config, topology=SimpleNamespace(is_model_parallel=lambda: False),
                             module=SimpleNamespace(parameters=lambda: [torch.empty(1_315_819_520, device="meta")]),
                             device=torch.device("cuda"))
    monkeypatch.setattr(comm_advice, "dist", SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 64))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert comm_advice.compression_note(engine) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")  # the same job on one (imaginary) node still gets its line
    assert "all 64 ranks are on one node" in comm_advice.compression_note(engine)
