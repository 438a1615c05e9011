"""Expert parallelism under ZeRO 0-3 on gloo ranks equals plain torch holding every expert.

Each rank holds num_experts / ep_size experts; tokens travel by all-to-all; expert
parameters are reduced (and sharded) within their expert-data group. The oracle is
tests/test_moe_reference.py (explicit per-token routing over the global batch).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_moe_reference import LR, MOMENTUM, MoENet, make_data, reference_train, stacked_view

STEPS = 3
MICRO = 2  # samples per rank and step (x SEQ tokens)
E = 4


def _config(world: int, stage: int, clip: float = 0.0) -> dict:
    return {
        "train_batch_size": MICRO * world,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "gradient_clipping": clip,
        # Tiny buckets: several reduce and gather buckets, dense and expert ones interleaved.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 150,
                              "stage3_param_persistence_threshold": 10},
        "steps_per_print": STEPS,  # the last step logs (and the routing monitor collects that step)
    }


def train_ep(runs: list[dict]) -> list[dict]:
    """On every rank: one training run per spec; returns this rank's parameters (and local expert rows)."""
    import torch.distributed as dist

    import partita
    from partita.zero.gathered import GatheredParameters

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for spec in runs:
        ep = spec["ep"]
        model = MoENet(num_experts=E, ep_size=ep, k=spec["k"], drop_tokens=spec["drop_tokens"],
                       capacity_factor=spec.get("capacity_factor", 1.0), expert_rank=rank % ep,
                       zero_gate=spec.get("zero_gate", False))
        engine, _, _, _ = partita.initialize(model=model, config=_config(world, spec["stage"], spec.get("clip", 0.0)))
        assert model.moe.local_expert_indices == list(range((rank % ep) * (E // ep), (rank % ep + 1) * (E // ep)))
        xs, ys = make_data(STEPS, MICRO * world)
        norms, routed_counts = [], []
        for step in range(STEPS):
            x = xs[step][rank * MICRO : (rank + 1) * MICRO]
            y = ys[step][rank * MICRO : (rank + 1) * MICRO]
            if spec.get("starve_rank") == rank:
                x = torch.zeros_like(x)  # every token of this rank routes alike
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            norms.append(engine.get_global_grad_norm())
            if step < STEPS - 1:
                routed_counts.append(model.moe.take_routing_stats().tokens_per_expert.tolist())
        with GatheredParameters(list(model.parameters())):
            params = stacked_view({n: p.detach().float().clone() for n, p in model.named_parameters()})
        out.append({"params": params, "experts": model.moe.local_expert_indices, "norms": norms,
                    "counts": routed_counts, "line": engine._step_log.last_line,
                    "metrics": {k: v for k, v in engine._step_log.last_metrics.items() if k.startswith("moe/")}})
        dist.barrier()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check(per_rank: list[list[dict]], runs: list[dict], world: int) -> None:
    for i, spec in enumerate(runs):
        ref, ref_norms = reference_train(num_experts=E, k=spec["k"], steps=STEPS, global_batch=MICRO * world,
                                         world=world, clip=spec.get("clip", 0.0), zero_gate=spec.get("zero_gate", False),
                                         starve_rank=spec.get("starve_rank"))
        for rank, results in enumerate(per_rank):
            got = results[i]
            for name, value in got["params"].items():
                expected = ref[name][got["experts"]] if name.startswith("moe.experts") else ref[name]
                err = _rel(value, expected)
                assert err < 1e-5, f"{spec} rank {rank} {name}: relative error {err:.2e}"
            if spec["stage"] > 0 or spec["ep"] == 1:  # stage 0 with ep > 1: see test_moe_norm.py
                for a, b in zip(got["norms"], ref_norms):
                    assert abs(a - b) / b < 1e-5, f"{spec} rank {rank}: grad norm {a} vs reference {b}"


# clip 0.3 is below the gradient norms here: the update depends on the global norm being right.
RUNS_2 = [{"ep": 2, "stage": s, "k": k, "drop_tokens": d, "capacity_factor": 4.0, "clip": c}
          for s, k, d, c in [(0, 1, False, 0.0), (1, 2, True, 0.3), (2, 2, False, 0.0), (3, 1, True, 0.3)]]
# The first step sends every token to expert 0 (all logits tie): rank 1's experts get none.
# Rank 1's inputs are all zeros, so its routing differs from rank 0's in later steps.
STARVED = [{"ep": 2, "stage": s, "k": 1, "drop_tokens": d, "capacity_factor": 4.0, "zero_gate": True, "starve_rank": 1}
           for s, d in [(2, False), (3, False)]]


def test_ep2_on_2_ranks_every_stage() -> None:
    per_rank = run_distributed(train_ep, 2, RUNS_2 + STARVED, timeout=240)
    _check(per_rank, RUNS_2 + STARVED, 2)
    for i in range(len(RUNS_2), len(RUNS_2 + STARVED)):
        # Both ranks sent all their first-step tokens to expert 0 (held by rank 0); experts 2, 3 idle.
        for rank in (0, 1):
            assert per_rank[rank][i]["counts"][0] == [6.0, 0.0, 0.0, 0.0], per_rank[rank][i]["counts"][0]
        # The step log's routing of the last step: 2 ranks x 6 tokens x k=1 over 4 experts.
        metrics = per_rank[0][i]["metrics"]
        assert metrics["moe/moe/tokens_per_expert_mean"] == 3.0
        assert metrics["moe/moe/tokens_per_expert_min"] <= 3.0 <= metrics["moe/moe/tokens_per_expert_max"]
        assert metrics["moe/moe/dropped_fraction"] == 0.0  # capacity 4.0 x: nothing dropped, dropless likewise
        assert metrics["moe/moe/l_aux"] > 0.0
        assert " moe[moe] tokens/expert=" in per_rank[0][i]["line"]


RUNS_4 = [
    {"ep": 2, "stage": 1, "k": 2, "drop_tokens": False},  # ep 2 x expert-data 2
    {"ep": 2, "stage": 3, "k": 2, "drop_tokens": True, "capacity_factor": 8.0},
    {"ep": 4, "stage": 2, "k": 3, "drop_tokens": False},
]


def test_ep_on_4_ranks() -> None:
    per_rank = run_distributed(train_ep, 4, RUNS_4, timeout=600)
    _check(per_rank, RUNS_4, 4)


def bad_ep_sizes() -> list[str]:
    import partita
    from partita.moe import ExpertMLP, MoE

    messages = []
    try:
        MoE(8, ExpertMLP(8, 16), num_experts=4, ep_size=3)
    except ValueError as error:
        messages.append(str(error))
    # Built before torch.distributed starts (as DeepSpeed users do): checked at initialize.
    model = torch.nn.Sequential(MoE(8, ExpertMLP(8, 16), num_experts=4, ep_size=4))
    try:
        partita.initialize(model=model, config=_config(2, 1))
    except ValueError as error:
        messages.append(str(error))
    import torch.distributed as dist

    dist.barrier()  # rank 0 hosts the store: it must not leave while the other rank still builds groups
    return messages


def test_bad_ep_size_errors_name_the_numbers() -> None:
    for messages in run_distributed(bad_ep_sizes, 2):
        assert messages[0].startswith("num_experts=4 is not divisible by ep_size=3")
        assert messages[1].startswith("MoE layer '0' (num_experts=4): ep_size=4 must be >= 1 and divide the "
                                      "data-parallel size 2"), messages[1]


STAGE0_CLIPPED = [{"ep": 2, "stage": 0, "k": 2, "drop_tokens": False, "clip": 0.3}]


def test_stage0_clipping_norm_with_expert_parallelism() -> None:
    per_rank = run_distributed(train_ep, 2, STAGE0_CLIPPED)
    _check(per_rank, STAGE0_CLIPPED, 2)
