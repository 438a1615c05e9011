"""MoE layers built under ``partita.zero.Init`` train at ZeRO-3 exactly as the same model built
plainly (2 gloo ranks, ep_size 1 and 2): the experts' rows are filled from the sharded template
through the dispatch mode, so every expert starts with the template's whole values."""

from __future__ import annotations

import os

import torch

from tests.harness import run_distributed
from tests.test_moe_reference import MoENet, make_data, stacked_view


def _train(ep: int, under_init: bool) -> dict:
    import partita
    from partita.zero.gathered import GatheredParameters

    rank = int(os.environ["RANK"])
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}, "steps_per_print": 1000}
    if under_init:
        with partita.zero.Init(config_dict_or_path=config):
            model = MoENet(num_experts=4, ep_size=ep, k=2, drop_tokens=False, expert_rank=rank % ep)
    else:
        model = MoENet(num_experts=4, ep_size=ep, k=2, drop_tokens=False, expert_rank=rank % ep)
    engine, *_ = partita.initialize(model=model, config=config)
    xs, ys = make_data(2, 4)
    losses = []
    for step in range(2):
        loss = engine(xs[step][rank * 2 : rank * 2 + 2], ys[step][rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with GatheredParameters(list(model.parameters())):
        params = stacked_view({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "params": params}


def _both(ep: int) -> tuple[dict, dict]:
    return _train(ep, False), _train(ep, True)


def test_zero_init_moe_trains_as_plain_build() -> None:
    for ep in (1, 2):
        for plain, built_under_init in run_distributed(_both, 2, ep, timeout=400):
            assert built_under_init["losses"] == plain["losses"], ep
            for name, value in plain["params"].items():
                assert torch.equal(built_under_init["params"][name], value), (ep, name)
