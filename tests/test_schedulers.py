"""DeepSpeed lr schedules: each checked against its formula, written out independently here."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch
from pydantic import ValidationError

from partita.optim.config import SchedulerConfig
from partita.optim.schedulers import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _optimizer(lrs=(0.1,), kind="sgd"):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.5)
    if kind == "adam":
        return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.95))
    return torch.optim.Adagrad(groups, lr=lrs[0])


def _trajectory(scheduler, optimizer, steps):
    """lrs in the optimizer at construction and after each of ``steps`` step() calls."""
    seen = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        seen.append([g["lr"] for g in optimizer.param_groups])
    assert scheduler.get_last_lr() == seen[-1]
    return seen


def _warmup(i, warmup, kind):
    """DeepSpeed's warm-up fraction at its iteration ``i`` (its rounding: times 1 / log(W))."""
    w = max(2, warmup)
    if kind == "log":
        return (1.0 / math.log(w)) * math.log(i + 1)
    return i / w


# DeepSpeed's counter lags the optimizer by one: after n step() calls its iteration is n - 1,
# and before the first step() (n = 0) the Warmup* schedules hold their start value.


# ----------------------------------------------------------------------------- WarmupLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_formula(kind):
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=10, warmup_type=kind)
    got = _trajectory(sched, opt, 30)
    for n, lrs in enumerate(got[1:], 1):
        i = n - 1
        gamma = _warmup(i, 10, kind) if i < 10 else 1.0
        assert lrs == [0.01 + (0.2 - 0.01) * gamma], n
    assert got[0] == got[1] == [0.01]  # the first two optimizer steps both run at warmup_min_lr
    assert sched.last_batch_iteration == 29  # DeepSpeed's counter after 30 steps
    # the last warm-up step: log reaches the peak (to DeepSpeed's rounding, one ulp below it)
    assert got[10][0] == (pytest.approx(0.2, rel=1e-15, abs=0) if kind == "log" else 0.01 + 0.19 * 0.9)
    assert got[11] == got[30] == [0.2]


def test_warmup_lr_without_max_uses_each_groups_lr():
    opt = _optimizer(lrs=(0.1, 0.02))
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_num_steps=4, warmup_type="linear")
    got = _trajectory(sched, opt, 6)
    assert got[0] == [0.0, 0.0]
    for n, lrs in enumerate(got[1:], 1):
        gamma = (n - 1) / 4 if n - 1 < 4 else 1.0
        assert lrs == [0.1 * gamma, 0.02 * gamma]


def test_warmup_num_steps_one_is_clamped_to_two():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.5, warmup_max_lr=1.0, warmup_num_steps=1)
    assert _trajectory(sched, opt, 3) == [[0.5], [0.5], [1.0], [1.0]]


def test_warmup_lr_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup_num_steps must be an integer >= 1, got 0"):
        WarmupLR(_optimizer(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type must be one of"):
        WarmupLR(_optimizer(), warmup_type="cosine")


# ----------------------------------------------------------------------------- WarmupDecayLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_formula(kind):
    opt = _optimizer()
    sched = WarmupDecayLR(
        opt, total_num_steps=20, warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type=kind
    )
    got = _trajectory(sched, opt, 30)
    assert got[0] == [0.001]
    for n, lrs in enumerate(got[1:], 1):
        i = n - 1
        if i < 5:
            gamma = _warmup(i, 5, kind)
        else:
            gamma = max(0.0, (20 - i) / max(1, 20 - 5))
        assert lrs == [0.001 + (0.1 - 0.001) * gamma], n
    assert got[6] == [0.1]
    assert got[21] == got[30] == [0.001]


# ----------------------------------------------------------------------------- WarmupCosineLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_formula(kind):
    opt = _optimizer(lrs=(0.1, 0.05))
    sched = WarmupCosineLR(
        opt, total_num_steps=25, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01, warmup_type=kind
    )
    got = _trajectory(sched, opt, 40)
    for n, lrs in enumerate(got[1:], 1):
        i = n - 1
        if i < 5:
            ratio = 0.1 + _warmup(i, 5, kind) * (1.0 - 0.1)
        else:
            progress = min(1.0, (i - 5 + 1) / max(1, 25 - 5))
            ratio = max(0.0, 0.01 + (1.0 - 0.01) * ((1.0 + math.cos(math.pi * progress)) / 2.0))
        assert lrs == [0.1 * ratio, 0.05 * ratio], n
    assert got[0] == [0.0, 0.0]  # DeepSpeed's start ratio is 0, below warmup_min_ratio
    assert got[1] == [0.1 * 0.1, 0.05 * 0.1]
    assert got[25] == got[40] == [0.1 * 0.01, 0.05 * 0.01]


# ----------------------------------------------------------------------------- OneCycle


def _one_cycle_scale(n, first, second, stairs1, stairs2):
    position = Fraction(n % (first + second))
    if position <= first:
        fraction, stairs = position / first, stairs1
    else:
        fraction, stairs = (first + second - position) / second, stairs2
    if stairs:
        return math.floor(fraction * stairs) / stairs
    return float(fraction)


def test_one_cycle_lr_and_momentum_match_formula():
    opt = _optimizer(kind="adam")
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_lr_rate=0.5,
        decay_step_size=3,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.01,
    )
    moms = [opt.param_groups[0]["betas"]]
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(25):
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        moms.append(opt.param_groups[0]["betas"])
    for n in range(26):
        if n <= 10:
            scale = _one_cycle_scale(n, 4, 6, 0, 0)
            lr = 0.01 + (0.1 - 0.01) * scale
            mom = 0.95 - (0.95 - 0.85) * scale
        else:
            lr = 0.01 / (1.0 + 0.5 * ((n - 10) / 3))
            mom = 0.95 * (1.0 + 0.01 * ((n - 10) / 3))
        assert lrs[n] == [lr], n
        assert moms[n] == (mom, 0.95), n  # beta2 is the optimizer's, kept
    assert lrs[4] == [0.1] and lrs[10] == [0.01]


def test_one_cycle_staircase_and_defaults_for_second_half():
    opt = _optimizer()
    sched = OneCycle(
        opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=6, cycle_first_stair_count=3
    )
    got = _trajectory(sched, opt, 16)
    for n, lrs in enumerate(got):
        scale = _one_cycle_scale(n, 6, 6, 3, 3) if n <= 12 else 0.0
        assert lrs == [scale], n
    assert [x[0] for x in got[:13]] == [0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1, 2 / 3, 2 / 3, 1 / 3, 1 / 3, 0, 0]


def test_one_cycle_cycles_sgd_momentum():
    opt = _optimizer(kind="sgd")
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
    seen = [opt.param_groups[0]["momentum"]]
    for _ in range(4):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["momentum"])
    assert seen == [0.9 - (0.9 - 0.8) * scale for scale in (0.0, 0.5, 1.0, 0.5, 0.0)]
    assert seen[2] == 0.8


def test_one_cycle_warns_when_optimizer_has_no_momentum():
    opt = _optimizer(kind="adagrad")
    with pytest.warns(UserWarning, match="cycle_momentum is ignored because Adagrad"):
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.5)
    assert sched.momentum_key is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OneCycle(_optimizer(kind="adagrad"), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_momentum=False)


# ----------------------------------------------------------------------------- config + build


def test_build_scheduler_applies_deepspeed_defaults():
    opt = _optimizer(lrs=(0.3,))
    sched = build_scheduler(SchedulerConfig.model_validate({"type": "warmuplr"}), opt)
    assert isinstance(sched, WarmupLR)
    assert (sched.warmup_min_lr, sched.warmup_max_lr, sched.warmup_num_steps, sched.warmup_type) == (
        0.0,
        None,
        1000,
        "log",
    )
    for _ in range(500):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0 + (0.3 - 0.0) * ((1.0 / math.log(1000)) * math.log(500))


def test_scheduler_config_defaults():
    cos = SchedulerConfig.model_validate({"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}})
    assert cos.params.model_dump() == {
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "total_num_steps": 5000,
    }
    decay = SchedulerConfig.model_validate({"type": "WarmupDecayLR", "params": {"total_num_steps": 2e3}})
    assert decay.params.total_num_steps == 2000
    assert decay.params.warmup_max_lr is None
    one = SchedulerConfig.model_validate({"type": "onecycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}})
    assert one.type == "OneCycle"
    assert one.params.model_dump() == {
        "cycle_min_lr": 0.0,
        "cycle_max_lr": 1.0,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    }
    built = build_scheduler(one, _optimizer(kind="adam"))
    assert isinstance(built, OneCycle) and built.second_step_size == 2000


def test_nested_section_names_the_params_model():
    assert SchedulerConfig.nested_section("params", {"type": "onecycle"}).__name__ == "OneCycleParams"
    assert SchedulerConfig.nested_section("params", {"type": "LRRangeTest"}) is None
    decay = SchedulerConfig.nested_section("params", {"type": "WarmupDecayLR"})
    assert decay.__name__ == "WarmupDecayLRParams" and decay.auto_fields == frozenset()


def _error(data):
    with pytest.raises(ValidationError) as info:
        SchedulerConfig.model_validate(data)
    return [(e["loc"], e["msg"]) for e in info.value.errors()]


def test_scheduler_config_errors():
    assert _error({"type": "WarmupDecay"}) == [
        (
            ("type",),
            "Value error, unknown scheduler type 'WarmupDecay'; did you mean 'WarmupDecayLR' or "
            "'WarmupLR'? Supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle. Other "
            "DeepSpeed schedulers (LRRangeTest) are not implemented yet.",
        )
    ]
    assert _error({"type": "LRRangeTest"}) == [
        (
            ("type",),
            "Value error, scheduler type 'LRRangeTest': DeepSpeed's LRRangeTest is not implemented "
            "in partita yet. Supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle.",
        )
    ]
    assert _error({"type": "WarmupLR", "params": {"warmup_num_step": 10}}) == [
        (("params", "warmup_num_step"), "Extra inputs are not permitted")
    ]
    assert _error({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}) == [
        (("params", "warmup_num_steps"), "Input should be greater than or equal to 1")
    ]
    assert _error({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}) == [
        (("params", "warmup_num_steps"), "Input should be a valid integer")
    ]
    assert _error({"type": "WarmupLR", "params": {"warmup_type": "cos"}}) == [
        (("params", "warmup_type"), "Input should be 'log' or 'linear'")
    ]
    assert _error({"type": "WarmupLR", "params": {"warmup_max_lr": -1}}) == [
        (("params", "warmup_max_lr"), "Input should be greater than or equal to 0")
    ]
    assert _error({"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}) == [
        (
            ("params", "total_num_steps"),
            "Value error, total_num_steps (1000) must be greater than warmup_num_steps (1000): the "
            "decay runs from the end of warmup to total_num_steps; raise total_num_steps to the "
            "number of optimizer steps you will train for",
        )
    ]
    assert _error({"type": "WarmupCosineLR"}) == [(("params", "total_num_steps"), "Field required")]
    assert _error({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 5, "cos_min_ratio": 2}}) == [
        (("params", "cos_min_ratio"), "Input should be less than or equal to 1")
    ]
    assert _error({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}) == [
        (("params", "cycle_max_lr"), "Field required")
    ]


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize(
    "make",
    [
        lambda o: WarmupLR(o, warmup_max_lr=0.2, warmup_num_steps=10),
        lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_num_steps=5, warmup_type="linear"),
        lambda o: WarmupCosineLR(o, total_num_steps=20, warmup_num_steps=5),
        lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3),
    ],
)
def test_state_dict_resumes_the_schedule(make):
    opt = _optimizer(kind="adam")
    sched = make(opt)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    betas = opt.param_groups[0]["betas"]
    expected = _trajectory(sched, opt, 5)

    fresh_opt = _optimizer(kind="adam")
    fresh = make(fresh_opt)
    fresh.load_state_dict(state)  # the optimizer's own state is deliberately not loaded
    assert [g["lr"] for g in fresh_opt.param_groups] == expected[0]
    assert fresh_opt.param_groups[0]["betas"] == betas
    assert _trajectory(fresh, fresh_opt, 5) == expected
