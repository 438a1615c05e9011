"""Optimizer config, build_optimizer and Lion."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

import partita.optim.factory as factory
from partita.optim.config import AdamParams, AdamWParams, LionParams, OptimizerConfig, SGDParams
from partita.optim.factory import build_optimizer, fused_adam_supported
from partita.optim.lion import Lion


def _config(data):
    return OptimizerConfig.model_validate(data)


def _params(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in shapes]


# ----------------------------------------------------------------------------- config


def test_type_is_case_insensitive_and_canonical():
    assert [_config({"type": t}).type for t in ("adam", "ADAMW", "lIoN")] == ["Adam", "AdamW", "Lion"]
    assert _config({"type": "sgd", "params": {"lr": 0.1}}).type == "SGD"


def test_defaults_are_deepspeeds():
    assert _config({"type": "Adam"}).params == AdamParams(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, adam_w_mode=True
    )
    assert isinstance(_config({"type": "AdamW"}).params, AdamWParams)
    assert _config({"type": "Lion"}).params == LionParams(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    assert _config({"type": "SGD", "params": {"lr": 0.5}}).params == SGDParams(
        lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False
    )


def test_json_values_are_accepted():
    cfg = _config({"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0, "torch_adam": True}})
    assert cfg.params.betas == (0.9, 0.95) and cfg.params.weight_decay == 0.0 and cfg.params.lr == 3e-4
    assert _config(cfg.model_dump()) == cfg


def _errors(data):
    with pytest.raises(ValidationError) as info:
        OptimizerConfig.model_validate(data)
    return [(e["loc"], e["msg"]) for e in info.value.errors()]


def test_unknown_type_lists_supported_and_suggests():
    assert _errors({"type": "Adma", "params": {"whatever": 1}}) == [
        (
            ("type",),
            "Value error, unknown optimizer type 'Adma'; did you mean 'Adam' or 'AdamW'? Supported: "
            "Adam, AdamW, SGD, Lion, AdamW8bit, Adam8bit, Lion8bit, PagedAdamW8bit, PagedAdam8bit, "
            "PagedLion8bit, OneBitAdam, ZeroOneAdam, OneBitLamb. Other DeepSpeed optimizers (Lamb, "
            "Adagrad, Muon) are not implemented yet.",
        )
    ]
    assert _errors({"type": "Rprop"})[0][1].startswith("Value error, unknown optimizer type 'Rprop'. Supported:")
    assert _errors({"type": 3}) == [(("type",), "Value error, optimizer type must be a string, got 3")]


def test_known_deepspeed_type_not_implemented():
    assert _errors({"type": "lamb"}) == [
        (
            ("type",),
            "Value error, optimizer type 'lamb': DeepSpeed's Lamb is not implemented "
            "in partita yet. Supported: Adam, AdamW, SGD, Lion, AdamW8bit, Adam8bit, Lion8bit, "
            "PagedAdamW8bit, PagedAdam8bit, PagedLion8bit, OneBitAdam, ZeroOneAdam, OneBitLamb.",
        )
    ]


def test_param_errors_name_the_key():
    assert _errors({"type": "Adam", "params": {"betas": [0.9, 0.999], "weight_decy": 0.1}}) == [
        (("params", "weight_decy"), "Extra inputs are not permitted")
    ]
    assert _errors({"type": "Adam", "params": {"lr": -1}}) == [
        (("params", "lr"), "Input should be greater than or equal to 0")
    ]
    assert _errors({"type": "Adam", "params": {"lr": "1e-3"}}) == [
        (("params", "lr"), "Input should be a valid number")
    ]
    assert _errors({"type": "Lion", "params": {"betas": [0.9, 1.0]}}) == [
        (("params", "betas", 1), "Input should be less than 1")
    ]
    assert _errors({"type": "Adam", "params": {"betas": [0.9]}}) == [
        (("params", "betas", 1), "Field required")
    ]
    assert _errors({"type": "SGD"}) == [(("params", "lr"), "Field required")]
    # Lion has no eps: the key is foreign to the chosen type.
    assert _errors({"type": "Lion", "params": {"eps": 1e-8}}) == [
        (("params", "eps"), "Extra inputs are not permitted")
    ]


def test_contradictions_are_explained():
    assert _errors({"type": "AdamW", "params": {"adam_w_mode": False}}) == [
        (
            ("params", "adam_w_mode"),
            'Value error, adam_w_mode=false contradicts type "AdamW", which always decouples '
            'weight decay; use type "Adam" with adam_w_mode=false for L2-style weight decay',
        )
    ]
    assert _errors({"type": "Adam", "params": {"max_grad_norm": 1.0}}) == [
        (
            ("params",),
            "Value error, max_grad_norm is not an optimizer parameter: remove it and set the "
            'top-level "gradient_clipping" key instead (0 disables clipping)',
        )
    ]
    assert _errors({"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}) == [
        (
            ("params",),
            "Value error, nesterov=true needs momentum > 0 and dampening = 0, got momentum=0.0 "
            "and dampening=0.0; set momentum (e.g. 0.9) and dampening 0, or nesterov false",
        )
    ]


def test_nested_section_names_the_params_model_for_the_loader():
    assert OptimizerConfig.nested_section("params", {"type": "adamw"}) is AdamWParams
    assert OptimizerConfig.nested_section("params", {"type": "SGD"}) is SGDParams
    assert OptimizerConfig.nested_section("params", {"type": "Lamb"}) is None
    assert OptimizerConfig.nested_section("params", {}) is None
    # "auto" (a Hugging Face Trainer placeholder) is never resolved to a default here.
    assert AdamWParams.auto_fields == LionParams.auto_fields == SGDParams.auto_fields == frozenset()


def test_config_is_frozen():
    cfg = _config({"type": "Adam"})
    with pytest.raises(ValidationError):
        cfg.params.lr = 1.0


# ----------------------------------------------------------------------------- build_optimizer


def test_adam_is_adamw_unless_adam_w_mode_false():
    (p,) = _params((3,))
    assert type(build_optimizer(_config({"type": "Adam"}), [{"params": [p]}], device_type="cpu")) is torch.optim.AdamW
    assert type(build_optimizer(_config({"type": "AdamW"}), [{"params": [p]}], device_type="cpu")) is torch.optim.AdamW
    classic = build_optimizer(
        _config({"type": "Adam", "params": {"adam_w_mode": False}}), [{"params": [p]}], device_type="cpu"
    )
    assert type(classic) is torch.optim.Adam


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_weight_decay_semantics(adam_w_mode):
    lr, wd, eps = 0.1, 0.5, 1e-8
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    g = torch.tensor([0.5, 0.25, -1.0])
    cfg = _config({"type": "Adam", "params": {"lr": lr, "weight_decay": wd, "adam_w_mode": adam_w_mode}})
    opt = build_optimizer(cfg, [{"params": [p]}], device_type="cpu")
    start = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    # First Adam step: bias-corrected m/sqrt(v) = g / |g| (plus eps).
    if adam_w_mode:
        expected = start * (1 - lr * wd) - lr * g / (g.abs() + eps)
    else:
        g_l2 = g + wd * start
        expected = start - lr * g_l2 / (g_l2.abs() + eps)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_adam_hyperparameters_and_fused_kernel_on_cpu():
    cfg = _config(
        {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True}}
    )
    opt = build_optimizer(cfg, [{"params": _params((2, 2))}], device_type="cpu")
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"]) == (
        3e-4,
        (0.8, 0.95),
        1e-6,
        0.1,
        True,
    )
    assert fused_adam_supported("cpu") is True  # torch >= 2.4 has fused CPU AdamW
    assert group["fused"] is True


def test_fused_false_uses_the_unfused_kernel():
    cfg = _config({"type": "AdamW", "params": {"fused": False}})
    opt = build_optimizer(cfg, [{"params": _params((2,))}], device_type="cpu")
    assert not opt.param_groups[0]["fused"]


def test_fused_true_without_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(factory, "fused_adam_supported", lambda device_type: False)
    with pytest.raises(NotImplementedError, match="has no fused AdamW kernel for device 'cpu'"):
        build_optimizer(_config({"type": "AdamW", "params": {"fused": True}}), [{"params": _params((2,))}], device_type="cpu")
    # Auto (fused omitted) falls back silently.
    opt = build_optimizer(_config({"type": "AdamW"}), [{"params": _params((2,))}], device_type="cpu")
    assert not opt.param_groups[0]["fused"]


def test_sgd_and_lion_classes_and_hyperparameters():
    sgd = build_optimizer(
        _config({"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}}),
        [{"params": _params((2,))}],
        device_type="cpu",
    )
    assert type(sgd) is torch.optim.SGD
    group = sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["dampening"], group["nesterov"], group["weight_decay"]) == (
        0.2,
        0.9,
        0.0,
        True,
        1e-4,
    )
    lion = build_optimizer(
        _config({"type": "lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}),
        [{"params": _params((2,))}],
        device_type="cpu",
    )
    assert type(lion) is Lion
    assert {k: lion.param_groups[0][k] for k in ("lr", "betas", "weight_decay")} == {
        "lr": 1e-4,
        "betas": (0.95, 0.98),
        "weight_decay": 0.1,
    }


def test_per_group_overrides_win_and_inputs_are_not_modified():
    a, b, c = _params((2,), (3,), (4,))
    groups = [
        {"params": [a], "weight_decay": 0.0},
        {"params": [b], "lr": 0.5, "betas": [0.5, 0.6]},
        {"params": [c]},
    ]
    before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in groups])
    opt = build_optimizer(
        _config({"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}), groups, device_type="cpu"
    )
    got = [(g["lr"], g["weight_decay"], g["betas"]) for g in opt.param_groups]
    assert got == [(0.01, 0.0, (0.9, 0.999)), (0.5, 0.1, (0.5, 0.6)), (0.01, 0.1, (0.9, 0.999))]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == before


def test_param_groups_must_be_dicts_with_params():
    cfg = _config({"type": "AdamW"})
    with pytest.raises(TypeError, match=r"param_groups\[0\] must be a dict with a 'params' key"):
        build_optimizer(cfg, [_params((2,))[0]], device_type="cpu")
    with pytest.raises(TypeError, match="param_groups must be a list of dicts"):
        build_optimizer(cfg, {"params": _params((2,))}, device_type="cpu")


# ----------------------------------------------------------------------------- Lion


def _reference_lion(params, grads_per_step, *, lr, betas, weight_decay):
    """Chen et al. 2023, Algorithm 2, one tensor at a time."""
    beta1, beta2 = betas
    params = [p.clone() for p in params]
    moms = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            update = torch.sign(beta1 * moms[i] + (1 - beta1) * g)
            params[i] = params[i] - lr * (update + weight_decay * params[i])
            moms[i] = beta2 * moms[i] + (1 - beta2) * g
    return params, moms


@pytest.mark.parametrize("foreach", [True, False])
def test_lion_matches_reference(foreach):
    params = _params((5,), (3, 4), seed=1)
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(2)
    grads_per_step = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(4)]
    opt = Lion(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.5, foreach=foreach)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    ref_params, ref_moms = _reference_lion(start, grads_per_step, lr=0.01, betas=(0.9, 0.99), weight_decay=0.5)
    for p, ref, ref_m in zip(params, ref_params, ref_moms):
        torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_m, rtol=1e-6, atol=1e-7)
    # A sign update moves each element by exactly lr when there is no weight decay.
    q = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    q.grad = torch.tensor([2.0, -0.1, 0.0])
    Lion([q], lr=0.25, foreach=foreach).step()
    assert q.detach().tolist() == [0.75, 1.25, 1.0]


def test_lion_foreach_and_loop_are_bit_identical():
    results = []
    for foreach in (True, False):
        params = _params((7,), (2, 3), seed=3)
        opt = Lion(params, lr=0.003, betas=(0.8, 0.9), weight_decay=0.1, foreach=foreach)
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_lion_state_dict_round_trip_resumes_exactly():
    def run(params, opt, gen, steps):
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    params = _params((4,), seed=5)
    opt = Lion(params, lr=0.01)
    gen = torch.Generator().manual_seed(6)
    run(params, opt, gen, 2)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    assert set(saved_state["state"][0]) == {"exp_avg"}
    assert saved_state["param_groups"][0]["betas"] == (0.9, 0.99)
    gen_state = gen.get_state()
    run(params, opt, gen, 3)

    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = Lion(resumed, lr=0.01)
    opt2.load_state_dict(saved_state)
    gen2 = torch.Generator()
    gen2.set_state(gen_state)
    run(resumed, opt2, gen2, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def test_lion_skips_params_without_grad_and_validates_arguments():
    a, b = _params((2,), (2,))
    before = b.detach().clone()
    a.grad = torch.ones(2)
    Lion([a, b], lr=0.1).step()
    assert torch.equal(b.detach(), before)
    with pytest.raises(ValueError, match=r"Lion betas\[1\] must be in \[0, 1\), got 1.0"):
        Lion([a], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Lion lr must be >= 0, got -1"):
        Lion([a], lr=-1)
