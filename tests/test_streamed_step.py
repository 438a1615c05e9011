"""``zero_optimization.one_rank_gradient_fold "stream"`` (partita/zero/streamed_step.py): one process,
no fp32 gradient partition, the fused AdamW (or block-wise 8-bit) step read range by range from
``param.grad``.

Against "early" (the flat partition's step) in the same process: with clipping inactive every
loss, master, moment and step counter is bitwise equal (stages 0-3, accumulation at stage 1, an
unused parameter, skipped fp16 steps, a checkpoint saved under one rule and resumed under the
other); with clipping active the global norm is summed per gradient, so it and the clip
coefficient may differ in their last bits only. What is alive after backward: no partition, every
``param.grad``, and at stages 0-2 the whole model again.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.harness import run_distributed

BIG_CLIP = 1e6  # clipping configured but never active: the multiplier is exactly 1 / loss scale


def _model():
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16))
    model.blocks[1].unused = torch.nn.Parameter(torch.randn(5))  # never gets a gradient
    return model


def _cfg(stage: int, fold: str, *, clip: float = BIG_CLIP, gas: int = 1, dtype: str = "bf16", optimizer: dict | None = None,
         scheduler: dict | None = None, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "one_rank_gradient_fold": fold,
                                 "stage3_param_persistence_threshold": 20, **zero},
           "steps_per_print": 10**6}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"].update(initial_scale_power=18, hysteresis=1)  # overflows at first: skipped steps
    return cfg


def _snapshot(engine) -> dict:
    return {
        "masters": [g.master.clone() for g in engine.optimizer.groups],
        "states": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                   for s in engine.optimizer.inner.state.values()],
    }


def _train(stage: int, fold: str, *, steps: int = 3, save_to: str | None = None, load_from: str | None = None,
           watch: bool = False, **kw) -> dict:
    import partita

    model = _model()
    engine, _, _, _ = partita.initialize(model=model, config=_cfg(stage, fold, **kw))
    unused_before = model.blocks[1].unused.detach().clone() if stage < 3 else None  # in the model's dtype now
    if load_from is not None:
        engine.load_checkpoint(load_from, tag="t")
    g = torch.Generator().manual_seed(1)
    out = {"losses": [], "norms": [], "applied": [], "after_backward": [], "lrs": []}
    gas = kw.get("gas", 1)
    stepped = []  # the inner optimizer's step hooks run once per step under every rule
    engine.optimizer.inner.register_step_post_hook(lambda *_: stepped.append(1))
    caught = warnings.catch_warnings(record=True)
    seen_warnings = caught.__enter__()
    warnings.simplefilter("always")
    for micro in range(steps * gas):
        x = torch.randint(0, 37, (2, 8), generator=g)
        loss = engine(x, x)[1]
        engine.backward(loss)
        if watch and (micro + 1) % gas == 0:
            out["after_backward"].append({
                "partitions": [grp.grad_partition is not None for grp in engine.optimizer.groups],
                "grads": sum(p.grad is not None for p in model.parameters()),
                "freed_params": sum(p.untyped_storage().nbytes() == 0 for p in model.parameters()),
            })
        engine.step()
        out["losses"].append(loss.item())
        if (micro + 1) % gas == 0:
            out["norms"].append(engine.get_global_grad_norm())
            out["applied"].append(engine.was_step_applied())
            out["lrs"].append(engine.get_lr())
    caught.__exit__(None, None, None)
    out["scheduler_warnings"] = [str(w.message) for w in seen_warnings if "lr_scheduler" in str(w.message)]
    out["step_hooks"] = len(stepped)
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="t")
    out.update(_snapshot(engine))
    out["unused_master_kept"] = stage < 3 and torch.equal(model.blocks[1].unused.detach(), unused_before)
    if stage < 3:  # the model is whole after the step and equals the master cast to its dtype
        out["whole_after_step"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                                      for p in model.parameters())
        out["grads_after_step"] = sum(p.grad is not None for p in model.parameters())
        out["params"] = [p.detach().clone() for p in model.parameters()]
    out["step_state"] = [(s["step"].dtype, s["step"].device.type, float(s["step"])) if torch.is_tensor(s["step"])
                         else s["step"] for s in engine.optimizer.inner.state.values()]
    engine.destroy()
    return out


def _same(a: dict, b: dict) -> bool:
    return (a["losses"] == b["losses"]
            and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
            and len(a["states"]) == len(b["states"])
            and all(x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x) for x, y in zip(a["states"], b["states"])))


def _equal(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b  # bitsandbytes counts steps in an int


def _bitwise_cases() -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        out[stage] = (_train(stage, "early"), _train(stage, "stream", watch=True))
    out["gas2"] = (_train(1, "early", gas=2), _train(1, "stream", gas=2, watch=True))
    out["fp16"] = (_train(2, "early", dtype="fp16", steps=4), _train(2, "stream", dtype="fp16", steps=4))
    out["fp32"] = (_train(2, "early", dtype="fp32"), _train(2, "stream", dtype="fp32"))
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    out["scheduler"] = (_train(2, "early", scheduler=warmup), _train(2, "stream", scheduler=warmup))
    # amsgrad (a third moment-shaped state) and classic Adam (L2 weight decay, not decoupled)
    amsgrad = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}}
    out["amsgrad"] = (_train(2, "early", optimizer=amsgrad), _train(2, "stream", optimizer=amsgrad))
    adam_l2 = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}}
    out["adam_l2"] = (_train(2, "early", optimizer=adam_l2), _train(2, "stream", optimizer=adam_l2))
    # bitsandbytes' block-wise 8-bit states, stepped range by range through its update_step
    for kind in ("AdamW8bit", "Lion8bit"):
        eight_bit = {"type": kind, "params": {"lr": 1e-3, "weight_decay": 0.1}}
        for stage in (2, 3):
            out[(kind, stage)] = (_train(stage, "early", optimizer=eight_bit), _train(stage, "stream", optimizer=eight_bit))
    return out


def test_stream_is_bitwise_early_when_clipping_is_inactive() -> None:
    results = run_distributed(_bitwise_cases, 1, timeout=400)[0]
    assert "max_exp_avg_sq" in results["amsgrad"][1]["states"][0]
    assert results[("AdamW8bit", 2)][1]["states"][0]["state1"].dtype == torch.uint8
    for case, (early, stream) in results.items():
        assert _same(early, stream), case
        assert stream["step_state"] == early["step_state"], case  # torch's own state: fp32 step on the device
        # The norms are summed per gradient (not over the flat partition): equal to fp32 rounding.
        assert stream["norms"] == pytest.approx(early["norms"], rel=1e-6, nan_ok=True), case
        assert stream["applied"] == early["applied"], case
        assert stream["lrs"] == early["lrs"] and stream["step_hooks"] == early["step_hooks"], case
        assert stream["scheduler_warnings"] == early["scheduler_warnings"] == [], case
    assert results["fp16"][1]["applied"][0] is False and all(results["fp16"][1]["applied"][-2:])  # skips happened
    for case in (0, 1, 2, "gas2"):
        early, stream = results[case]
        assert stream["unused_master_kept"] and early["unused_master_kept"], case
        assert stream["whole_after_step"] and stream["grads_after_step"] == 0, case
        assert all(torch.equal(a, b) for a, b in zip(stream["params"], early["params"])), case
        for seen in stream["after_backward"]:
            # No gradient partition; every gradient that backward made is still in param.grad
            # (all but the unused parameter's); the model whole again, as ZeRO-1/2 promise between
            # backward and step (the blocks were freed again inside backward, as with "end").
            assert seen["partitions"] == [False] * len(seen["partitions"]), case
            assert seen["grads"] == len(stream["params"]) - 1, case
            assert seen["freed_params"] == 0, case
    for seen in results[3][1]["after_backward"]:
        assert not any(seen["partitions"])


def _clipped_cases() -> dict:
    return {stage: (_train(stage, "early", clip=0.5), _train(stage, "stream", clip=0.5)) for stage in (2, 3)}


def test_stream_with_active_clipping_differs_only_in_rounding() -> None:
    for stage, (early, stream) in run_distributed(_clipped_cases, 1, timeout=300)[0].items():
        assert early["norms"][0] > 0.5  # clipping is active
        assert stream["norms"] == pytest.approx(early["norms"], rel=1e-6), stage
        for a, b in zip(stream["masters"], early["masters"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _checkpoint_cases(root: str) -> dict:
    # Saved under "stream" after 2 steps, resumed under "early" and under "stream" for 2 more:
    # the same state layout, so both continue bitwise alike; and the other way round.
    out = {}
    for saved, resumed in (("stream", "early"), ("early", "stream")):
        path = f"{root}/{saved}"
        _train(2, saved, steps=2, save_to=path)
        out[(saved, resumed)] = (_train(2, saved, steps=2, load_from=path), _train(2, resumed, steps=2, load_from=path))
    return out


def test_checkpoints_move_between_stream_and_the_partition(tmp_path) -> None:
    for case, (same_rule, other_rule) in run_distributed(_checkpoint_cases, 1, str(tmp_path), timeout=300)[0].items():
        assert _same(same_rule, other_rule), case
        assert [s[2] for s in other_rule["step_state"]][0] == 4.0, case  # 2 saved + 2 resumed steps


def _refusals() -> dict:
    import partita
    from partita.config import ConfigError

    def message(cfg: dict, optimizer=None) -> str:
        model = _model()
        try:
            if optimizer is not None:
                cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
                partita.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg)
            else:
                partita.initialize(model=model, config=cfg)
        except ConfigError as error:
            return str(error)
        return "accepted"

    sgd = _cfg(2, "stream")
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}
    return {
        "gas": message(_cfg(2, "stream", gas=2)),
        "stage1_gas": message(_cfg(1, "stream", gas=2)),
        "sgd": message(sgd),
        "unfused": message(_cfg(2, "stream"), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=False)),
        "fp32_sums": message({**_cfg(1, "stream"), "data_types": {"grad_accum_dtype": "fp32"}}),
        "offload": message(_cfg(2, "stream", offload_optimizer={"device": "cpu"})),
    }


def test_stream_refuses_what_it_cannot_step() -> None:
    got = run_distributed(_refusals, 1, timeout=200)[0]
    assert got["stage1_gas"] == "accepted"  # stages 0-1 accumulate in param.grad anyway
    assert 'ZeRO stage 2 sums micro-batches in fp32; with gradient_accumulation_steps 2' in got["gas"]
    assert ("fused Adam/AdamW kernel or bitsandbytes' block-wise 8-bit optimizers; the optimizer here is "
            "torch.optim.sgd.SGD. Use optimizer type Adam or AdamW") in got["sgd"]
    assert "torch.optim.adamw.AdamW without fused=True" in got["unfused"]
    assert 'data_types.grad_accum_dtype "fp32" asks for fp32 sums' in got["fp32_sums"]
    assert 'one_rank_gradient_fold "stream" holds every param.grad on the accelerator' in got["offload"]


def _two_ranks() -> str:
    import partita
    from partita.config import ConfigError

    try:
        partita.initialize(model=_model(), config=_cfg(2, "stream"))
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_stream_refuses_more_than_one_process() -> None:
    for message in run_distributed(_two_ranks, 2, timeout=120):
        assert 'one_rank_gradient_fold "stream" steps from every param.grad of one process; this job has 2' in message
