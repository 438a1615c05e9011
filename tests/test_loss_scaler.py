"""fp16 loss scaler: DeepSpeed's dynamics, state round trips, the config bridge."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from partita.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
)


def _run(scaler, outcomes):
    """Scale after each update; outcomes is a string of 'o' (overflow) / '.' (clean)."""
    seen = []
    for outcome in outcomes:
        scaler.update(outcome == "o")
        seen.append(scaler.scale)
    return seen


def test_defaults():
    s = DynamicLossScaler()
    assert (s.scale, s.scale_window, s.hysteresis, s.cur_hysteresis, s.min_scale, s.scale_factor) == (
        65536.0,
        1000,
        2,
        2,
        1.0,
        2.0,
    )
    assert s.consecutive_hysteresis is False and s.dynamic is True


def test_scale_halves_after_hysteresis_overflows_and_keeps_halving():
    s = DynamicLossScaler(init_scale=1024.0, hysteresis=3)
    # Two overflows use up the budget, the third halves; the budget is not refilled by the
    # decrease, so every further overflow halves again.
    assert _run(s, "oooo") == [1024.0, 1024.0, 512.0, 256.0]
    assert s.cur_hysteresis == 1


def test_hysteresis_one_halves_on_every_overflow():
    s = DynamicLossScaler(init_scale=8.0, hysteresis=1)
    assert _run(s, "ooo") == [4.0, 2.0, 1.0]


def test_growth_comes_after_window_clean_steps_deepspeed_counting():
    s = DynamicLossScaler(init_scale=4.0, scale_window=3, hysteresis=1)
    # From the start: the 4th clean update doubles (3 clean updates before it), then every 3.
    assert _run(s, "..........") == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]


def test_overflow_restarts_the_window():
    s = DynamicLossScaler(init_scale=64.0, scale_window=2, hysteresis=1)
    assert _run(s, "..o....o...") == [64.0, 64.0, 32.0, 32.0, 32.0, 64.0, 64.0, 32.0, 32.0, 32.0, 64.0]


def test_growth_refills_hysteresis():
    s = DynamicLossScaler(init_scale=64.0, scale_window=2, hysteresis=2)
    assert _run(s, "oo") == [64.0, 32.0]
    assert s.cur_hysteresis == 1
    assert _run(s, "..") == [32.0, 32.0]
    assert s.cur_hysteresis == 1  # clean steps alone do not refill it
    assert _run(s, ".") == [64.0]
    assert s.cur_hysteresis == 2
    assert _run(s, "oo") == [64.0, 32.0]


@pytest.mark.parametrize(
    "consecutive, expected",
    [(False, [16.0, 16.0, 8.0, 8.0, 4.0, 2.0]), (True, [16.0, 16.0, 16.0, 16.0, 16.0, 8.0])],
)
def test_consecutive_hysteresis_refills_on_each_clean_step(consecutive, expected):
    s = DynamicLossScaler(init_scale=16.0, scale_window=100, hysteresis=2, consecutive_hysteresis=consecutive)
    # With consecutive hysteresis only `hysteresis` overflows in a row shrink the scale.
    assert _run(s, "o.o.oo") == expected


def test_min_scale_clamps_then_raises():
    s = DynamicLossScaler(init_scale=3.0, hysteresis=1, min_scale=2.0)
    assert _run(s, "o") == [2.0]  # 3 / 2 = 1.5 is clamped to the minimum
    with pytest.raises(LossScaleAtMinimumError) as info:
        s.update(True)
    message = str(info.value)
    assert message.startswith("fp16 gradients overflowed (inf/nan) at the minimum loss scale 2 after 1 updates")
    for hint in ("bf16", "lower learning rate", "check the data"):
        assert hint in message
    assert isinstance(info.value, RuntimeError)


def test_overflow_at_minimum_spends_hysteresis_before_raising():
    s = DynamicLossScaler(init_scale=1.0, hysteresis=2, min_scale=1.0)
    s.update(True)
    assert (s.scale, s.cur_hysteresis) == (1.0, 1)
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)


def test_state_dict_is_json_and_resumes_exactly():
    def make():
        return DynamicLossScaler(init_scale=256.0, scale_window=3, hysteresis=2)

    pattern = "o.o....oo..o......"
    straight = make()
    expected = _run(straight, pattern)

    first = make()
    _run(first, pattern[:7])
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"type": "dynamic", "scale": first.scale, "cur_hysteresis": first.cur_hysteresis, "cur_iter": 7, "last_overflow_iter": 2}
    second = make()
    second.load_state_dict(state)
    assert _run(second, pattern[7:]) == expected[7:]


def test_static_scaler():
    s = StaticLossScaler(128.0)
    assert _run(s, "o.o") == [128.0, 128.0, 128.0]
    assert s.dynamic is False
    state = json.loads(json.dumps(s.state_dict()))
    assert state == {"type": "static", "scale": 128.0}
    other = StaticLossScaler(4.0)
    other.load_state_dict(state)
    assert other.scale == 128.0


def test_loading_the_wrong_kind_of_state_is_refused():
    with pytest.raises(ValueError, match="loss-scaler state is for a 'static' scaler, this run uses a 'dynamic' one"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8.0).state_dict())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 0.0}, "init_scale must be a finite number > 0, got 0.0"),
        ({"scale_window": 0}, "scale_window must be an integer >= 1, got 0"),
        ({"hysteresis": 1.5}, "hysteresis must be an integer >= 1, got 1.5"),
        ({"scale_factor": 1.0}, "scale_factor must be > 1, got 1.0"),
        ({"init_scale": 0.5, "min_scale": 1.0}, r"init_scale \(0.5\) is below min_scale \(1.0\)"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def _fp16(**overrides):
    fields = {
        "enabled": True,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1.0,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_build_loss_scaler_from_fp16_section():
    dynamic = build_loss_scaler(
        _fp16(initial_scale_power=12, loss_scale_window=500, hysteresis=4, consecutive_hysteresis=True, min_loss_scale=0.25)
    )
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.scale, dynamic.scale_window, dynamic.hysteresis, dynamic.consecutive_hysteresis, dynamic.min_scale) == (
        4096.0,
        500,
        4,
        True,
        0.25,
    )
    static = build_loss_scaler(_fp16(loss_scale=512.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 512.0
    disabled = build_loss_scaler(_fp16(enabled=False, loss_scale=512.0))
    assert isinstance(disabled, StaticLossScaler) and disabled.scale == 1.0
