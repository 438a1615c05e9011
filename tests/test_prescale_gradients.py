"""``prescale_gradients``: each gradient is divided by the data-parallel size before the cross-rank
sum (DeepSpeed's engine and ZeRO-1 ``mul_(1 / dp)`` then ``all_reduce``), so the sum is the mean.

The step must equal single-process torch on the global batch at every ZeRO stage. DeepSpeed 0.19.8
asserts "pre-scale gradients is not yet supported with ZeRO-2/ZeRO-3 with reduce scatter enabled"
there; partita reduce-scatters the pre-divided gradients, which is the same mean. With two ranks
dividing by 2 is exact, so the parameters also equal the default (post-divided) run's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from partita.config import load_config
from partita.config.base import ConfigError
from tests._config_helpers import only_problem
from tests.harness import run_distributed

STAGES = (0, 1, 2, 3)
STEPS = 2
LR = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(STEPS)]


def _train(stage: int, prescale: bool) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    import partita

    model = _model()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "prescale_gradients": prescale,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    # The reduction divides by the world before the sum (prescale) or by 1 before and 2 after (default).
    assert engine.zero.reducer._predivide == (2.0 if prescale else 1.0)
    for x, y in _batches():
        mine = slice(2 * rank, 2 * rank + 2)
        loss = torch.nn.functional.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
    state = {k: v.clone() for k, v in engine.get_fp32_state_dict(rank0_only=False).items()}
    engine.destroy()
    return state


def _on_rank() -> list[dict[str, torch.Tensor]]:
    return [_train(stage, prescale) for stage in STAGES for prescale in (False, True)]


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches():
        optimizer.zero_grad()
        # Two ranks' mean of their micro-batch losses = the global batch's mean (equal halves).
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_prescaled_gradients_are_the_mean_at_every_zero_stage_on_two_ranks() -> None:
    per_rank = run_distributed(_on_rank, 2, timeout=240)
    reference = _reference()
    for rank_states in per_rank:
        for i, stage in enumerate(STAGES):
            default, prescaled = rank_states[2 * i], rank_states[2 * i + 1]
            for name, expected in reference.items():
                torch.testing.assert_close(prescaled[name], expected, rtol=1e-6, atol=1e-6, msg=f"stage {stage} {name}")
                assert torch.equal(prescaled[name], default[name]), f"stage {stage} {name}: /2 before the sum is exact"
    assert all(torch.equal(per_rank[0][j][k], per_rank[1][j][k]) for j in range(len(per_rank[0])) for k in reference)


def test_prescale_with_a_predivide_factor_is_refused() -> None:
    line = only_problem({"prescale_gradients": True, "gradient_predivide_factor": 4.0})
    assert line.startswith("prescale_gradients, gradient_predivide_factor: prescale_gradients divides by the "
                           "data-parallel size before the sum, so gradient_predivide_factor 4.0 has no effect")
    with pytest.raises(ConfigError, match="remove gradient_predivide_factor"):
        load_config({"prescale_gradients": True, "gradient_predivide_factor": 4.0})


def test_prescale_values() -> None:
    assert load_config({"prescale_gradients": True}).prescale_gradients is True
    assert load_config({}).prescale_gradients is False
    assert load_config({"prescale_gradients": True, "gradient_predivide_factor": 1.0}).prescale_gradients is True
    line = only_problem({"prescale_gradients": 1})
    assert line.startswith("prescale_gradients = 1: ")
