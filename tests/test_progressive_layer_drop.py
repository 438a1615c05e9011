"""Progressive layer drop (``"progressive_layer_drop"``) and the legacy curriculum's forward kwargs.

Pinned values: DeepSpeed 0.18.9 (the last release with PLD and the legacy curriculum; 0.19 removed
both), run on CPU by benchmarks/oracles/deepspeed_legacy_schedules.py:

    .bench-venv/bin/pip install --no-deps --no-build-isolation --target /tmp/ds0189 deepspeed==0.18.9
    PYTHONPATH=/tmp/ds0189 DS_ACCELERATOR=cpu .bench-venv/bin/python benchmarks/oracles/deepspeed_legacy_schedules.py

20 optimizer steps, gradient accumulation 2, theta 0.5, gamma 0.1, curriculum fixed_linear from 8
to 64 over 12 steps in steps of 8; the values below are what the model's forward received at the
first micro-batch of each global step (the second received the same).
"""

from __future__ import annotations

import math

import pytest
import torch

import partita
from partita.config.base import ConfigError
from tests._config_helpers import only_problem
from tests.harness import run_distributed

PLD_THETAS = [
    1.0, 1.0, 0.9524187090179798, 0.9093653765389909, 0.8704091103408589, 0.8351600230178197, 0.8032653298563167,
    0.7744058180470133, 0.7482926518957047, 0.7246644820586108, 0.7032848298702996, 0.6839397205857212,
    0.6664355418490397, 0.650597105956101, 0.6362658965170063, 0.6232984819708032, 0.611565080074215,
    0.6009482589973277, 0.5913417620263673, 0.5826494441107932,
]
SEQLENS = [8, 16, 16, 24, 24, 32, 40, 40, 48, 48, 56, 64, 64, 64, 64, 64, 64, 64, 64, 64]
# engine.get_pld_theta() after the last step (DeepSpeed: theta(19)).
LAST_THETA = 0.5747843096113175
# DeepSpeed resumed from global step 10: 1.0 (it does not save theta), then theta(10), theta(11), ...
DEEPSPEED_RESUMED_THETAS = [1.0, 0.6839397205857212, 0.6664355418490397, 0.650597105956101]

PLD = {"enabled": True, "theta": 0.5, "gamma": 0.1}
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 12, "difficulty_step": 8}}


@pytest.fixture
def no_process_group_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():  # initialize made a one-rank group: later tests in this process expect none
        dist.destroy_process_group()


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[dict] = []

    def forward(self, x, progressive_layer_drop=False, pld_theta=None, curriculum_seqlen=None):
        self.seen.append({"progressive_layer_drop": progressive_layer_drop, "pld_theta": pld_theta,
                          "curriculum_seqlen": curriculum_seqlen})
        return self.lin(x).pow(2).mean()


def _engine(model, **sections):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, **sections}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _micro_steps(engine, n: int) -> None:
    for _ in range(n):
        loss = engine(torch.ones(2, 4))
        engine.backward(loss)
        engine.step()


def test_forward_gets_deepspeeds_theta_and_seqlen_with_accumulation(no_process_group_left) -> None:
    model = Recorder()
    engine = _engine(model, progressive_layer_drop=PLD, curriculum_learning=CURRICULUM)
    assert engine.get_pld_theta() == 1.0
    _micro_steps(engine, 40)
    seen = model.seen
    assert [s["pld_theta"] for s in seen] == [t for t in PLD_THETAS for _ in range(2)]
    assert [s["curriculum_seqlen"] for s in seen] == [d for d in SEQLENS for _ in range(2)]
    assert all(s["progressive_layer_drop"] is True for s in seen)
    assert engine.get_pld_theta() == LAST_THETA
    assert engine.progressive_layer_drop.get_theta() == LAST_THETA
    assert engine.curriculum_scheduler_legacy.get_current_difficulty() == 64
    # The formula, for the record: theta(t) = (1 - 0.5) * exp(-0.1 t) + 0.5 after step t.
    assert LAST_THETA == pytest.approx(0.5 * math.exp(-0.1 * 19) + 0.5, rel=1e-15)
    # Eval mode: nothing is added (DeepSpeed adds them only while module.training).
    engine.eval()
    with torch.no_grad():
        engine(torch.ones(2, 4))
    assert model.seen[-1] == {"progressive_layer_drop": False, "pld_theta": None, "curriculum_seqlen": None}
    engine.destroy()


def test_off_by_default_and_the_engine_attributes(no_process_group_left) -> None:
    model = Recorder()
    engine = _engine(model)
    _micro_steps(engine, 2)
    assert model.seen[-1] == {"progressive_layer_drop": False, "pld_theta": None, "curriculum_seqlen": None}
    assert engine.get_pld_theta() is None and engine.progressive_layer_drop is None
    assert engine.curriculum_scheduler_legacy is None
    engine.destroy()


def test_a_forward_without_the_parameters_is_refused_at_initialize(no_process_group_left) -> None:
    plain = torch.nn.Linear(4, 1)
    with pytest.raises(ConfigError, match=r"progressive_layer_drop is enabled: every training forward is called with "
                                          r"progressive_layer_drop=True, pld_theta=<float>, but Linear.forward accepts "
                                          r"neither; add the parameters"):
        _engine(plain, progressive_layer_drop=PLD)
    with pytest.raises(ConfigError, match=r"curriculum_seqlen=<int>, but Linear.forward does not accept it"):
        _engine(torch.nn.Linear(4, 1), curriculum_learning=CURRICULUM)


def test_resume_keeps_theta_and_difficulty(tmp_path, no_process_group_left) -> None:
    model = Recorder()
    engine = _engine(model, progressive_layer_drop=PLD, curriculum_learning=CURRICULUM)
    _micro_steps(engine, 20)  # 10 global steps
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    resumed_model = Recorder()
    resumed = _engine(resumed_model, progressive_layer_drop=PLD, curriculum_learning=CURRICULUM)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert resumed.global_steps == 10
    assert resumed.get_pld_theta() == PLD_THETAS[10]
    assert resumed.curriculum_scheduler_legacy.get_current_difficulty() == engine.curriculum_scheduler_legacy.state[
        "current_difficulty"] == SEQLENS[9]
    _micro_steps(resumed, 8)
    # An uninterrupted run's values; DeepSpeed gives 1.0 on the first resumed step instead.
    assert [s["pld_theta"] for s in resumed_model.seen[::2]] == PLD_THETAS[10:14]
    assert DEEPSPEED_RESUMED_THETAS[1:] == PLD_THETAS[11:14] and DEEPSPEED_RESUMED_THETAS[0] == 1.0
    assert [s["curriculum_seqlen"] for s in resumed_model.seen[::2]] == SEQLENS[10:14]
    resumed.destroy()


def test_deepspeed_paths() -> None:
    from partita.runtime.progressive_layer_drop import ProgressiveLayerDrop
    from partita.schedules.progressive_layer_drop import ProgressiveLayerDrop as own

    assert ProgressiveLayerDrop is own
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    pld.update_state(2)
    assert pld.get_theta() == PLD_THETAS[3]


@pytest.mark.parametrize(
    ("section", "start"),
    [
        ({"enabled": True, "theta": 0.5}, 'progressive_layer_drop = {"enabled": true, "theta": 0.5}: progressive_layer_drop '
         'is enabled but gamma is not set; DeepSpeed requires both, e.g. "progressive_layer_drop": {"enabled": true, '
         '"theta": 0.5, "gamma": 0.001}'),
        ({"enabled": True}, 'progressive_layer_drop = {"enabled": true}: progressive_layer_drop is enabled but theta and '
         'gamma are not set'),
        ({"enabled": True, "theta": 1.5, "gamma": 0.1}, "progressive_layer_drop.theta = 1.5: "),
        ({"enabled": True, "theta": 0.5, "gamma": -1}, "progressive_layer_drop.gamma = -1: "),
        ({"enabled": True, "theta": 0.5, "gamma": 0.1, "drop": 1}, "progressive_layer_drop.drop = 1: "),
    ],
)
def test_config_errors(section: dict, start: str) -> None:
    line = only_problem({"progressive_layer_drop": section})
    assert line.startswith(start), line


# ----------------------------------------------------------------------------- a PLD-aware model on two ranks


class PLDNet(torch.nn.Module):
    """bing_bert's rule in expectation: block i of L is kept with probability 1 - (i + 1) / L * (1 - theta);
    its residual branch is scaled by that (deterministic, so ranks and the reference agree)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, y, progressive_layer_drop=False, pld_theta=None):
        theta = pld_theta if progressive_layer_drop else 1.0
        for i, block in enumerate(self.blocks):
            keep = 1.0 - (i + 1) / len(self.blocks) * (1.0 - theta)
            x = x + keep * torch.tanh(block(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def _pld_on_rank(stage: int) -> tuple[dict, list[float]]:
    import torch.distributed as dist

    model = PLDNet()
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.2}}, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0,
              "progressive_layer_drop": PLD}
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, thetas = dist.get_rank(), []
    for step in range(4):
        x, y = _data(step)
        for micro in range(2):  # rank r's micro-batches: rows [4r + 2m, 4r + 2m + 2)
            rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
        thetas.append(engine.get_pld_theta())
    state = {k: v.clone() for k, v in engine.get_fp32_state_dict(rank0_only=False).items()}
    engine.destroy()
    return state, thetas


def test_a_pld_model_trains_on_two_ranks_as_single_process_torch() -> None:
    results = run_distributed(_pld_on_rank, 2, 2, timeout=180)
    reference = PLDNet()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step in range(4):
        x, y = _data(step)
        optimizer.zero_grad()
        # 4 micro-batches of 2 equal rows: their mean loss is the batch's mean.
        reference(x, y, progressive_layer_drop=True, pld_theta=PLD_THETAS[step]).backward()
        optimizer.step()
    for state, thetas in results:
        assert thetas == PLD_THETAS[1:5]  # get_pld_theta() after step t is theta(t), the next step's value
        for name, expected in reference.state_dict().items():
            torch.testing.assert_close(state[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    # Without PLD's scaling the result differs (the test can fail).
    assert not torch.allclose(PLDNet().state_dict()["head.weight"], results[0][0]["head.weight"])
