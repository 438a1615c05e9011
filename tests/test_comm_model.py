"""The communication cost model (partita/monitor/comm_model.py): its formulas on hand-computed
cases, its analytic bytes against the comms logger's counted bytes of a tiny ZeRO-3 run (plain and
qwZ + qgZ), and the step log's one-time "would not pay" line (partita/monitor/comm_advice.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from partita.monitor import comm_model as cm
from tests.harness import run_distributed

WORLD = 4
NUMEL = 64 * 100 + 100 + 100 * 10 + 10  # the tiny model below: 7,510 elements in one ZeRO-3 unit


# ---------------------------------------------------------------- formulas, by hand
def test_inter_node_bytes_per_op() -> None:
    # 16 ranks, 4 per node: 4 nodes, bus factor over nodes 3/4.
    kw = dict(world=16, ranks_per_node=4)
    assert cm.inter_node_bytes("all_gather_into_tensor", 1000, **kw) == 750
    assert cm.inter_node_bytes("reduce_scatter_tensor", 1000, **kw) == 750
    assert cm.inter_node_bytes("all_reduce", 1000, **kw) == 1500
    assert cm.inter_node_bytes("broadcast", 1000, **kw) == 1000
    assert cm.inter_node_bytes("all_to_all_single", 1000, **kw) == 4 * 750  # each rank's own share
    assert cm.inter_node_bytes("all_reduce", 1000, world=8, ranks_per_node=8) == 0  # one node
    with pytest.raises(ValueError, match="not a whole number of nodes of 3 ranks"):
        cm.inter_node_bytes("all_reduce", 1000, world=8, ranks_per_node=3)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        cm.inter_node_bytes("gather", 1000, **kw)


def test_step_time_bounds_and_coding_cost() -> None:
    # 2 nodes of 1 rank: a 1.25 GB all-gather sends 0.625 GB off each node = 0.05 s at 100 Gbps.
    plan = [cm.Collective("all_gather_into_tensor", "w", 1_250_000_000, count=2, quantized=1000, dequantized=2000)]
    coding = 2 * (1000 * cm.QUANTIZE_BYTES + 2000 * cm.DEQUANTIZE_BYTES) / 1e9  # at 1 GB/s
    assert cm.coding_seconds(plan, memory_gbytes_per_s=1.0) == pytest.approx(coding)
    t = cm.step_time(0.08, plan, world=2, ranks_per_node=1, gbps=100, memory_gbytes_per_s=1.0)
    assert t.transfer_s == pytest.approx(0.1)
    assert t.no_overlap_s == pytest.approx(0.08 + coding + 0.1)
    assert t.full_overlap_s == pytest.approx(0.1)  # the transfer is the longer
    rows = cm.sweep(0.08, plan, world=2, ranks_per_node=1, memory_gbytes_per_s=1.0)
    assert [r.gbps for r in rows] == [100, 200, 400, 800]
    assert [r.transfer_s for r in rows] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert rows[-1].full_overlap_s == pytest.approx(0.08 + coding)  # compute is the longer
    with pytest.raises(ValueError, match="bandwidth must be > 0 Gbps"):
        cm.transfer_seconds(plan, world=2, ranks_per_node=1, gbps=0)


def test_analytic_plans() -> None:
    # 1,000 elements at 4 ranks: shards of 250; int8 rows 4*1 scale + 250 -> 254 -> 256 bytes.
    plain = cm.zero3_collectives(1000, 4)
    assert [(c.op, c.message_bytes, c.count) for c in plain] == [
        ("all_gather_into_tensor", 2000, 2), ("reduce_scatter_tensor", 2000, 1)]
    both = cm.zero3_collectives(1000, 4, weight_bits=8, grad_bits=4)
    assert [(c.op, c.message_bytes) for c in both] == [("all_gather_into_tensor", 4 * 256),
                                                       ("all_to_all_single", 4 * 132)]  # 4 + 125 -> 132
    onebit = cm.data_parallel_collectives(1000, 4, stage=0, onebit=True)
    assert [c.message_bytes for c in onebit] == [4 * (32 + 4)] * 2  # ceil(250/8) sign bytes + a scale
    assert [c.op for c in cm.data_parallel_collectives(1000, 4, stage=2)] == [
        "reduce_scatter_tensor", "all_gather_into_tensor"]


def test_verdicts() -> None:
    plain, both = cm.zero3_collectives(10**9, 64), cm.zero3_collectives(10**9, 64, weight_bits=8, grad_bits=8)
    one_node = cm.compression_verdict(plain, both, world=8, ranks_per_node=8, gbps=100, memory_gbytes_per_s=3000)
    assert one_node.startswith("all 8 ranks are on one node") and "#4886" in one_node
    qwz = cm.zero3_collectives(10**9, 64, weight_bits=8)
    assert cm.compression_verdict(plain, qwz, world=64, ranks_per_node=8, gbps=100, memory_gbytes_per_s=3000) is None
    # qgZ: 2 int8 gathers x 1.016 GB x 7/8 + 8 ranks x 1.016 GB x 7/8 (all-to-all) = 8.89 GB; plain 3 x 2 GB x 7/8.
    more = cm.compression_verdict(plain, both, world=64, ranks_per_node=8, gbps=100, memory_gbytes_per_s=3000)
    assert more.startswith("between nodes (8 nodes of 8 ranks) it sends 8.89 GB off each node per step against 5.25 GB")
    slow = cm.compression_verdict(plain, qwz, world=64, ranks_per_node=8, gbps=100, memory_gbytes_per_s=20)
    assert slow.startswith("at 100 Gbps between nodes (8 nodes of 8 ranks) it saves")


# ---------------------------------------------------------------- against a real run (4 gloo ranks)
class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(zeropp: dict, local_world: str) -> dict:
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    os.environ["LOCAL_WORLD_SIZE"] = local_world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Tanh(), torch.nn.Linear(100, 10))
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zeropp},
           "comms_logger": {"enabled": True}, "steps_per_print": 1}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    handler = _ListHandler()
    logging.getLogger("partita").addHandler(handler)
    COMMS_LOGGER.reset()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(2, 64, generator=g), torch.randint(0, 10, (2,), generator=g)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
    logging.getLogger("partita").removeHandler(handler)
    counted: dict[tuple[str, str], int] = {}
    for r in COMMS_LOGGER.records():
        if "ZeRO-3 parameter all-gather" in r.purpose or "gradient reduction" in r.purpose:
            key = (r.op, r.purpose.split(" (")[0])
            counted[key] = counted.get(key, 0) + r.message_bytes
    notes = [m for m in handler.messages if "would not pay" in m]
    return {"bytes": counted, "notes": notes}


def _cases() -> dict:
    both = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    return {"plain": _run({}, "4"), "one_node": _run(both, "4"), "four_nodes": _run(both, "1")}


def test_counted_bytes_and_the_would_not_pay_line() -> None:
    ranks = run_distributed(_cases, WORLD)
    # One unit, gathered once per step (it stays gathered through backward): gathers=1; 3 steps.
    for case, plan in (("plain", cm.zero3_collectives(NUMEL, WORLD, gathers=1)),
                       ("one_node", cm.zero3_collectives(NUMEL, WORLD, weight_bits=8, grad_bits=4, gathers=1))):
        expected = {(c.op, c.purpose): 3 * c.count * c.message_bytes for c in plan}
        for rank in ranks:
            assert rank[case]["bytes"] == expected, (case, rank[case]["bytes"], expected)
    zero, others = ranks[0], ranks[1:]
    assert zero["plain"]["notes"] == []  # nothing compressed: nothing to say
    assert len(zero["one_node"]["notes"]) == 1  # three print steps, said once
    assert "(zero_quantized_weights and zero_quantized_gradients) would not pay: all 4 ranks are on one node" \
        in zero["one_node"]["notes"][0]
    # Four "nodes" of one rank on a CPU (20 GB/s of memory): the saved microseconds do not cover the quantizing.
    assert len(zero["four_nodes"]["notes"]) == 1
    assert "would not pay: at 100 Gbps between nodes (4 nodes of 1 ranks) it saves" in zero["four_nodes"]["notes"][0]
    assert all(rank[case]["notes"] == [] for rank in others for case in rank)  # rank 0 only
