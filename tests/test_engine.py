"""Engine behaviour: the loop's contract, misuse errors, fp16 overflow, a dying rank."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.tiny_models import build_model, make_batches, param_groups

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1000,
}


def _misuse_errors() -> dict:
    import partita

    found = {}
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, config=BASE)
    x, y = make_batches(1, 2)
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.step()
    loss = engine(x[0], y[0])
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="called twice without engine.step"):
        engine.backward(engine(x[0], y[0]))
    engine.step()
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(torch.ones(3, requires_grad=True))
    with torch.no_grad():
        frozen_loss = engine(x[0], y[0])
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(frozen_loss)

    frozen = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        partita.initialize(model=frozen, config=BASE)
    no_opt = {k: v for k, v in BASE.items() if k != "optimizer"}
    with pytest.raises(ValueError, match="no optimizer"):
        partita.initialize(model=build_model(), config=no_opt)
    model = build_model()
    with pytest.raises(ValueError, match="keep one"):
        partita.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=BASE)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not part of the model"):
        partita.initialize(model=build_model(), model_parameters=other.parameters(), config=BASE)
    found["ok"] = True
    return found


def test_misuse_gives_clear_errors() -> None:
    assert run_distributed(_misuse_errors, 1) == [{"ok": True}]


def _accumulation_counters() -> dict:
    import partita

    cfg = {**BASE, "gradient_accumulation_steps": 3, "steps_per_print": 2, "wall_clock_breakdown": True,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                          "warmup_num_steps": 10, "warmup_type": "linear"}}}
    engine, _, _, _ = partita.initialize(model=build_model(), config=cfg)
    x, y = make_batches(1, 2)
    boundaries, lrs = [], []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x[0], y[0]))
        engine.step()
        lrs.append(engine.get_lr()[0])
    return {"boundaries": boundaries, "lrs": lrs, "steps": engine.global_steps, "samples": engine.global_samples,
            "train_batch": engine.train_batch_size(), "log": engine._step_log.last_line}


def test_accumulation_boundary_and_scheduler_step_per_optimizer_step() -> None:
    results = run_distributed(_accumulation_counters, 2)
    r = results[0]
    assert r["boundaries"] == [False, False, True, False, False, True]
    assert r["steps"] == 2 and r["train_batch"] == 2 * 3 * 2 and r["samples"] == 24
    # The LR moves once per optimizer step (after micro-steps 3 and 6), not per micro-batch. On
    # DeepSpeed's WarmupLR counter the first two optimizer steps both run at warmup_min_lr (0), so
    # the lr first moves after the second step, to the formula's step-1 value; stepped per
    # micro-batch it would have moved after micro-step 2 and reached 0.005 after micro-step 6.
    assert r["lrs"][:5] == [0.0] * 5
    assert r["lrs"][5] == pytest.approx(0.01 * 1 / 10)
    # steps_per_print=2 with wall_clock_breakdown: one line at step 2 with the phase times.
    log = r["log"]
    assert log.startswith("step=2 loss=") and "lr=1.000e-03" in log and "skipped=0" in log
    assert "time(ms/step)" in log and "backward=" in log and "forward=" in log and "step=" in log


def _user_optimizer_and_scheduler() -> dict:
    import partita

    model = build_model()
    opt = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cfg = {k: v for k, v in BASE.items() if k != "optimizer"}
    engine, returned_opt, _, returned_sched = partita.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                                 config=cfg)
    x, y = make_batches(2, 2)
    for step in range(2):
        engine.backward(engine(x[step], y[step]))
        engine.step()
    return {
        "same_optimizer": returned_opt.inner is opt,
        "same_scheduler": returned_sched is sched,
        "lrs": engine.get_lr(),
        "momentum": [g["momentum"] for g in opt.param_groups],
        "weight_decay": [g["weight_decay"] for g in opt.param_groups],
    }


def test_user_optimizer_instance_keeps_groups_and_scheduler() -> None:
    r = run_distributed(_user_optimizer_and_scheduler, 2)[0]
    assert r["same_optimizer"] and r["same_scheduler"]
    assert r["lrs"] == pytest.approx([0.1 * 0.25, 2e-2 * 0.25])
    assert r["momentum"] == [0.9, 0.9] and r["weight_decay"] == [0.1, 0.0]


LION_CLIP = 0.5
LION_STEPS = 3


def _engine_contract() -> dict:
    """One world-2 run: batch-size error on every rank, zero_grad, get_lr, modes, Lion under ZeRO."""
    import partita
    from partita.config import ConfigError

    rank = int(os.environ["RANK"])  # the process group starts inside the first initialize()
    out: dict = {}
    # train_batch_size 3 cannot be split over 2 ranks: every rank fails at initialize, nothing hangs.
    no_micro = {k: v for k, v in BASE.items() if k != "train_micro_batch_size_per_gpu"}
    try:
        partita.initialize(model=build_model(), config={**no_micro, "train_batch_size": 3})
        out["batch_error"] = None
    except ConfigError as error:
        out["batch_error"] = str(error)

    # zero_grad() inside an accumulation window drops what the window accumulated so far
    # (model .grad at stages 0/1, the fp32 partition at stage 2): the result must equal a
    # window whose first micro-batch contributed exactly zero gradient.
    x, y = make_batches(2, 4)
    first, second = (x[0][2 * rank : 2 * rank + 2], y[0][2 * rank : 2 * rank + 2]), (
        x[1][2 * rank : 2 * rank + 2], y[1][2 * rank : 2 * rank + 2])
    for stage in (0, 1, 2):
        params = []
        for use_zero_grad in (True, False):
            model = build_model()
            cfg = {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage}}
            engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
            loss = engine(*first)
            engine.backward(loss if use_zero_grad else loss * 0.0)
            engine.step()
            if use_zero_grad:
                engine.zero_grad()
            engine.backward(engine(*second))
            engine.step()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        out[f"zero_grad_stage{stage}"] = all(torch.equal(params[0][n], params[1][n]) for n in params[0])
    out["lrs"] = engine.get_lr()  # one per param group: the config's lr, and the group's own
    out["modes"] = (engine.module is model, engine.eval() is engine, model.training,
                    engine.train() is engine, model.training)

    # Lion (partita's own optimizer) sharded by ZeRO 1 and 2 equals one process on the global batch.
    lion = {"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01}}
    xs, ys = make_batches(LION_STEPS, 4)
    for stage in (1, 2):
        model = build_model()
        cfg = {**BASE, "optimizer": lion, "gradient_clipping": LION_CLIP, "zero_optimization": {"stage": stage}}
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        for step in range(LION_STEPS):
            engine.backward(engine(xs[step][2 * rank : 2 * rank + 2], ys[step][2 * rank : 2 * rank + 2]))
            engine.step()
        out[f"lion_stage{stage}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"lion_class{stage}"] = type(optimizer.inner).__name__
    return out


def _lion_reference() -> dict[str, torch.Tensor]:
    from partita.optim.lion import Lion

    model = build_model()
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = Lion(groups, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    xs, ys = make_batches(LION_STEPS, 4)
    for step in range(LION_STEPS):
        opt.zero_grad()
        model(xs[step], ys[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), LION_CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_engine_contract_on_two_ranks() -> None:
    results = run_distributed(_engine_contract, 2)
    reference = _lion_reference()
    for r in results:
        assert r["batch_error"] == (
            "train_batch_size = 3 cannot be split evenly over 2 data-parallel ranks (every rank must get the "
            "same number of samples); use a multiple of 2, e.g. 2 or 4, or run on a number of ranks that divides 3"
        )
        assert r["zero_grad_stage0"] and r["zero_grad_stage1"] and r["zero_grad_stage2"]
        assert r["lrs"] == [1e-2, 2e-2]
        assert r["modes"] == (True, True, False, True, True)
        for stage in (1, 2):
            assert r[f"lion_class{stage}"] == "Lion"
            for name, ref in reference.items():
                got = r[f"lion_stage{stage}"][name]
                err = float((got - ref).norm() / ref.norm())
                assert err < 1e-5, (stage, name, err)


def _fp16_overflow_on_one_rank() -> dict:
    import torch.distributed as dist

    import partita

    cfg = {**BASE, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = make_batches(2, 4)
    rank = dist.get_rank()
    loss = engine(x[0][2 * rank : 2 * rank + 2], y[0][2 * rank : 2 * rank + 2])
    if rank == 1:
        loss = loss * float("inf")  # only rank 1 overflows
    engine.backward(loss)
    engine.step()
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    scale_after_overflow = engine.get_loss_scale()
    engine.backward(engine(x[1][2 * rank : 2 * rank + 2], y[1][2 * rank : 2 * rank + 2]))
    engine.step()
    return {"unchanged": unchanged, "skipped": engine.skipped_steps, "scale": scale_after_overflow,
            "norm_after": engine.get_global_grad_norm(), "steps": engine.global_steps}


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    for r in run_distributed(_fp16_overflow_on_one_rank, 2):
        assert r["unchanged"], "an overflowed step must not change any weight"
        assert r["skipped"] == 1 and r["steps"] == 2
        assert r["scale"] == 2.0**8 / 2  # hysteresis 1: the first overflow halves the scale
        assert math.isfinite(r["norm_after"])


def _rank_dies_mid_step() -> str:
    import torch.distributed as dist

    import partita
    from partita.distributed.collective_errors import CollectiveError

    cfg = {**BASE, "distributed": {"timeout_seconds": 30}}
    engine, _, _, _ = partita.initialize(model=build_model(), config=cfg)
    x, y = make_batches(1, 2)
    loss = engine(x[0], y[0])
    if dist.get_rank() == 1:
        os._exit(3)  # dies between forward and backward
    with pytest.raises(CollectiveError) as info:
        engine.backward(loss)
        engine.step()
    return str(info.value)


def test_a_dying_rank_fails_the_others_with_the_operation_named() -> None:
    results = run_distributed(_rank_dies_mid_step, 2, timeout=90, expect_dead=frozenset({1}))
    message = results[0]
    assert "partita rank 0" in message
    assert "gradient reduction" in message or "all-reduce" in message
