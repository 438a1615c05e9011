"""fp8.all_gather with the per-step scale precompute wired into the ZeRO-3 gatherer (refresh_shards):
2 gloo ranks, 3 steps. The first step's unit gathers all-reduce their amaxes (no step has run yet);
from then on one precompute all-reduce per step and none per gather. The losses and every gathered
weight equal those of the per-gather path (the precompute switched off) bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.harness import run_distributed
from tests.test_fp8_all_gather import CLASSES, FP8_SECTION, MICRO, WIDTH, _config, _Net

pytest.importorskip("torchao.float8")

STEPS = 3
PRECOMPUTE = "fp8 amax precompute (every FP8-gathered weight)"
PER_GATHER = "fp8 amax ZeRO-3 parameter all-gather"


def _train(precompute: bool) -> dict:
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER
    from partita.zero import param_gatherer

    original = param_gatherer.refresh_gatherer_fp8_scales
    if not precompute:
        param_gatherer.refresh_gatherer_fp8_scales = lambda *a, **k: None
    try:
        torch.manual_seed(0)
        model = _Net()
        seen: list[dict[str, torch.Tensor]] = []
        def record(module: torch.nn.Module, _args, name: str) -> None:  # after partita's gather: the weight is whole
            seen[-1].setdefault(name, module.weight.detach().clone())

        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name:
                module.register_forward_pre_hook(lambda m, a, name=name: record(m, a, name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = partita.initialize(model=model, config=_config(FP8_SECTION))
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        losses, per_step = [], []
        for _ in range(STEPS):
            seen.append({})
            COMMS_LOGGER.reset()
            x = torch.randn(MICRO, WIDTH, generator=g).to(torch.bfloat16)
            y = torch.randint(0, CLASSES, (MICRO,), generator=g)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            per_step.append([r.purpose for r in COMMS_LOGGER.records()
                             if r.op == "all_reduce" and r.purpose.startswith("fp8 amax")])
    finally:
        param_gatherer.refresh_gatherer_fp8_scales = original
    return {"losses": losses, "amax_all_reduces": per_step, "seen": seen}


def _on_rank() -> dict:
    return {"per_gather": _train(False), "precomputed": _train(True)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_on_rank, 2)


def test_one_amax_all_reduce_per_step(ranks) -> None:
    for rank in ranks:
        per, pre = rank["per_gather"]["amax_all_reduces"], rank["precomputed"]["amax_all_reduces"]
        # Per gather: one all-reduce for each FP8 unit gather (two blocks, forward and backward: 4 in the
        # first step; 2 after it, when the recorded trace keeps a block whole for its backward).
        assert [len(step) for step in per] == [4, 2, 2] and all(p == PER_GATHER for s in per for p in s)
        assert pre[0] == [PER_GATHER] * 4 + [PRECOMPUTE]  # before any step there is nothing precomputed
        assert pre[1:] == [[PRECOMPUTE]] * (STEPS - 1)


def test_same_losses_and_gathered_weights(ranks) -> None:
    for rank in ranks:
        per, pre = rank["per_gather"], rank["precomputed"]
        assert pre["losses"] == per["losses"]
        for a, b in zip(per["seen"], pre["seen"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
