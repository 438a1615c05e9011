"""The cost model's hpZ and 1-bit plans (partita/monitor/comm_model.py) against the comms logger's
counted bytes of tiny 4-rank runs, 0/1 Adam's modelled schedule against the steps a real run takes,
and the step log's "would not pay" note (partita/monitor/comm_advice.py) for hpZ and the 1-bit family."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from partita.monitor import comm_model as cm
from tests.harness import run_distributed

WORLD = 4
BLOCK = 32 * 48 + 48 + 48 * 32 + 32  # one _Block: 3,152 elements, one ZeRO-3 unit
HEAD = 32 * 10 + 10  # the head stays in the root unit
SMALL = 64 * 100 + 100 + 100 * 10 + 10  # the 1-bit runs' MLP, 4 parameter tensors
ZERO_ONE = {"var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 4}
ZERO_ONE_STEPS = 10


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 48), nn.Linear(48, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _key(purpose: str) -> str:
    return purpose.split(" (")[0]  # "gradient reduction (bucket 0 of 1)" -> "gradient reduction"


def _train(model: nn.Module, width: int, optimizer: dict, zero: dict, steps: int) -> list[dict]:
    """Per step: {(op, purpose): message bytes} counted by the comms logger."""
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": optimizer, "zero_optimization": zero,
           "comms_logger": {"enabled": True}, "steps_per_print": 10**6}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    out = []
    for _ in range(steps):
        COMMS_LOGGER.reset()
        x, y = torch.randn(2, width, generator=g), torch.randint(0, 10, (2,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()
        counted: dict[tuple[str, str], int] = {}
        for r in COMMS_LOGGER.records():
            counted[(r.op, _key(r.purpose))] = counted.get((r.op, _key(r.purpose)), 0) + r.message_bytes
        out.append(counted)
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 100), nn.Tanh(), nn.Linear(100, 10))


def _cases() -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # hpZ's groups of 2 are the "nodes"
    torch.manual_seed(0)
    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    # Reuse distance 0: every block is gathered again for its backward, which hpZ serves from its group.
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    out = {"hpz": _train(_Net(), 32, adamw, {**z3, "zero_hpz_partition_size": 2}, 2),
           "hpz_qwz": _train(_Net(), 32, adamw, {**z3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True}, 2)}
    for kind, stage, extra in (("OneBitAdam", 0, {}), ("OneBitAdam", 2, {}), ("OneBitLamb", 0, {}),
                               ("OneBitLamb", 2, {"weight_decay": 0.01})):
        opt = {"type": kind, "params": {"lr": 1e-3, "freeze_step": 2, **extra}}
        out[f"{kind}{stage}"] = _train(_mlp(), 64, opt, {"stage": stage}, 4)  # compressed from the second step
    out["ZeroOneAdam"] = _train(_mlp(), 64, {"type": "ZeroOneAdam", "params": {"lr": 1e-3, **ZERO_ONE}}, {"stage": 0},
                                ZERO_ONE_STEPS)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_cases, WORLD)


def _expected(plan: list[cm.Collective], steps: float = 1) -> dict:
    expected: dict[tuple[str, str], float] = {}
    for c in plan:
        expected[(c.op, c.purpose)] = expected.get((c.op, c.purpose), 0) + steps * c.count * c.message_bytes
    return expected


def _modelled_only(counted: dict, plan: list[cm.Collective]) -> dict:
    # The model has the step's data-parallel traffic; the engine's own checks and the clipping norm are not in it.
    purposes = {c.purpose for c in plan}
    return {k: v for k, v in counted.items() if k[1] in purposes}


def test_hpz_counted_bytes_equal_the_model(runs) -> None:
    # Per step: each block gathered over the world for its forward and in its group for its backward;
    # the root unit (the head) stays gathered through backward (gathers=1, so no group gather).
    for case, bits in (("hpz", None), ("hpz_qwz", 8)):
        plan = [*cm.zero3_collectives(BLOCK, WORLD, weight_bits=bits, hpz_partition_size=2)] * 3 + \
            cm.zero3_collectives(HEAD, WORLD, weight_bits=bits, gathers=1, hpz_partition_size=2)
        expected = _expected(plan)
        assert ("all_gather_into_tensor", "ZeRO-3 parameter all-gather within the hpZ group") in expected
        for rank in runs:
            for step in rank[case]:
                assert _modelled_only(step, plan) == expected, (case, step, expected)
    # Two nodes of two: the group gathers stay on the node, the world gathers do not.
    kw = dict(world=WORLD, ranks_per_node=2)
    plain = cm.zero3_collectives(BLOCK, WORLD)
    hpz = cm.zero3_collectives(BLOCK, WORLD, hpz_partition_size=2)
    message = WORLD * 788 * 2  # a block's 16-bit gather: 4 shards of 788
    assert cm.step_inter_node_bytes(hpz, **kw) == cm.step_inter_node_bytes(plain, **kw) - message / 2
    # 8 ranks, 2 per node, groups of 4 span two nodes: their gather sends half its message off each node,
    # against 3/4 for the world gather it replaces (and the reduce-scatter's 3/4).
    message = 8 * 394 * 2
    assert cm.step_inter_node_bytes(cm.zero3_collectives(BLOCK, 8, hpz_partition_size=4), world=8, ranks_per_node=2) \
        == pytest.approx(message * 3 / 4 + message / 2 + message * 3 / 4)
    assert cm.hpz_memory_bytes(1_315_819_520, 64, 8) == 1_315_819_520 * 2 // 8
    with pytest.raises(ValueError, match="hpz_partition_size 3 does not divide the world size 4"):
        cm.zero3_collectives(BLOCK, 4, hpz_partition_size=3)
    with pytest.raises(ValueError, match="straddles nodes of 4 ranks unevenly"):
        cm.step_inter_node_bytes(cm.zero3_collectives(BLOCK, 12, hpz_partition_size=6), world=12, ranks_per_node=4)


@pytest.mark.parametrize("case", ["OneBitAdam0", "OneBitAdam2", "OneBitLamb0", "OneBitLamb2"])
def test_onebit_compressed_phase_bytes_equal_the_model(runs, case) -> None:
    kind, stage = case[:-1], int(case[-1])
    plan = cm.onebit_collectives(SMALL, WORLD, optimizer=kind, stage=stage, parameters=4,
                                 weight_decay=kind == "OneBitLamb" and stage == 2)
    expected = _expected(plan)
    for rank in runs:
        # The last step: compressed, after the first compressed step's one-time momentum rebuild (stages 1-2).
        step = rank[case][-1]
        assert _modelled_only(step, plan) == expected, (case, step, expected)
        assert not any("gradient reduction" in purpose for _, purpose in step)  # the reducer stood aside
        assert any("gradient reduction" in purpose for _, purpose in rank[case][0])  # the warm-up reduces as usual


def test_zero_one_adam_schedule_and_bytes_equal_the_model(runs) -> None:
    kinds = cm.zero_one_adam_schedule(ZERO_ONE_STEPS, **ZERO_ONE)
    assert kinds == ["refresh", "compressed", "refresh", "compressed", "sync", "sync", "sync", "local", "local", "local"]
    exchange = ("all_to_all_single", "0/1 Adam compressed exchange: compressed all-to-all")
    reduce = ("all_reduce", "gradient reduction")
    for rank in runs:
        seen = [("refresh" if reduce in step else "sync/compressed" if exchange in step else "local")
                for step in rank["ZeroOneAdam"]]
        assert seen == [k if k in ("refresh", "local") else "sync/compressed" for k in kinds]
    plan = cm.zero_one_adam_collectives(SMALL, WORLD, steps=ZERO_ONE_STEPS, parameters=4, **ZERO_ONE)
    for rank in runs:
        total: dict = {}
        for step in rank["ZeroOneAdam"]:
            for key, value in step.items():
                total[key] = total.get(key, 0) + value
        expected = _expected(plan, ZERO_ONE_STEPS)
        assert {k: v for k, v in total.items() if k in expected} == pytest.approx(expected)
    # A window inside phase 2: one sync per local_step_clipper steps once the interval is clipped.
    late = cm.zero_one_adam_collectives(SMALL, WORLD, steps=8, first_step=100, parameters=4, **ZERO_ONE)
    assert {c.purpose: c.count for c in late}["0/1 Adam compressed exchange: compressed all-to-all"] == 2 / 8


# ---------------------------------------------------------------- the step log's note, as modelled
def _engine(zero: dict, optimizer: dict | None, numel: int, device: str):
    from partita.config import load_config

    cfg = {"train_batch_size": 64, "zero_optimization": zero, **({"optimizer": optimizer} if optimizer else {})}
    param = torch.empty(numel, device="meta").requires_grad_()
    return SimpleNamespace(config=load_config(cfg), topology=SimpleNamespace(is_model_parallel=lambda: False),
                           module=SimpleNamespace(parameters=lambda: [param]), device=torch.device(device))


def _note(monkeypatch, engine, world: int, per_node: int) -> str | None:
    from partita.monitor import comm_advice

    monkeypatch.setattr(comm_advice, "dist", SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    return comm_advice.compression_note(engine)


GPT13 = 1_315_819_520


def test_note_for_hpz(monkeypatch) -> None:
    engine = _engine({"stage": 3, "zero_hpz_partition_size": 8}, None, GPT13, "cuda")
    assert _note(monkeypatch, engine, 64, 8) is None  # the backward gathers leave the links: pays, costs no coding
    one_node = _note(monkeypatch, engine, 8, 8)
    assert one_node.startswith("compressed communication (zero_hpz_partition_size) would not pay: all 8 ranks are on "
                               "one node, so no bytes cross a slow link and compression only adds hpZ's secondary "
                               "weight copies (0.329 GB per rank)")
    both = _engine({"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True}, None, GPT13, "cuda")
    assert "only adds quantize work and hpZ's secondary weight copies" in _note(monkeypatch, both, 8, 8)


@pytest.mark.parametrize("kind,stage", [("OneBitAdam", 2), ("OneBitLamb", 0), ("OneBitLamb", 2), ("ZeroOneAdam", 0)])
def test_note_for_the_onebit_family(monkeypatch, kind, stage) -> None:
    params = {"lr": 1e-3, "weight_decay": 0.01}
    gpu = _engine({"stage": stage}, {"type": kind, "params": params}, GPT13, "cuda")
    assert _note(monkeypatch, gpu, 64, 8) is None  # GPT-1.3B at 64 GPUs, 8 per node: the exchange pays at 100 Gbps
    assert f"({kind}" in _note(monkeypatch, gpu, 8, 8) and "only adds 1-bit coding work" in _note(monkeypatch, gpu, 8, 8)
    # A small model on CPU ranks (20 GB/s), one per node: the saved microseconds do not cover the sign coding.
    cpu = _engine({"stage": stage}, {"type": kind, "params": params}, SMALL, "cpu")
    assert "would not pay: at 100 Gbps between nodes (4 nodes of 1 ranks) it saves" in _note(monkeypatch, cpu, 4, 1)


def test_zero_one_adam_note_models_deepspeeds_schedule(monkeypatch) -> None:
    from partita.monitor import comm_advice

    engine = _engine({"stage": 0}, {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}, GPT13, "cuda")
    params = engine.config.optimizer.params
    assert comm_advice.zero_one_adam_horizon(params) == 100_000 + 32_678 * 5  # DeepSpeed's defaults
    found = comm_advice.plans(engine, 64, 8)
    assert found.what == "ZeroOneAdam, the average of its first 263,390 steps"
    # Fewer bytes off each node than AdamW's all-reduce: phase 1's 1-bit steps and phase 2's rare syncs.
    kw = dict(world=64, ranks_per_node=8)
    assert cm.step_inter_node_bytes(found.compressed, **kw) < 0.2 * cm.step_inter_node_bytes(found.plain, **kw)
