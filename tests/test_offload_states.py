"""engine.offload_states / reload_states at ZeRO 0-3 on 2 gloo ranks: 2 steps, offload, reload, 2 more
steps equal 4 uninterrupted steps bit for bit (masters, optimizer states, 16-bit weights); every
offloaded tensor is re-pointed at new host storage and back (same objects, new storage), with the
bytes moved per kind equal to what the optimizer and the masters hold; what offload_optimizer keeps in
host memory is not moved; forward/backward/step while offloaded raise naming reload_states; unknown
kinds and devices are refused with the valid values."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import build_block_model, make_batches, param_groups

STEPS, GLOBAL_BATCH = 4, 8
RUNS = [  # (label, stage, bf16, offload_optimizer)
    ("stage0", 0, False, False),
    ("stage1", 1, False, False),
    ("stage2-bf16", 2, True, False),
    ("stage3", 3, False, False),
    ("stage3-bf16", 3, True, False),
    ("stage2-offload", 2, False, True),
]
# Offloaded in the middle of an accumulation window (gradient_accumulation_steps 2, after 2 steps and one
# micro-batch): stage 1 holds the window's gradients in param.grad, stage 2 in its fp32 gradient partition.
ACCUMULATING = [("stage1-accum", 1, "lp_grads"), ("stage2-accum", 2, "contiguous_grad_buffer")]


def _config(stage: int, bf16: bool, offload: bool, gas: int = 1) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50,
            "stage3_param_persistence_threshold": 10}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": zero}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, steps: range) -> None:
    gas = engine.gradient_accumulation_steps()
    _train_micro(engine, range(steps.start * gas, steps.stop * gas))


def _train_micro(engine, micro_batches: range) -> None:
    import torch.distributed as dist

    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for m in micro_batches:
        step, lo = m // gas, (dist.get_rank() * gas + m % gas) * micro
        engine.backward(engine(xs[step][lo:lo + micro], ys[step][lo:lo + micro]))
        engine.step()


def _accumulating(stage: int, kind: str) -> dict:
    import partita

    runs = []
    for interrupted in (False, True):
        model = build_block_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model),
                                             config=_config(stage, False, False, gas=2))
        _train_micro(engine, range(5))
        moved = engine.offload_states() if interrupted else None
        engine.reload_states()  # a no-op when nothing is offloaded
        _train_micro(engine, range(5, 2 * STEPS))
        runs.append({"snapshot": _snapshot(engine), "moved": moved})
        engine.destroy()
    return {"want": runs[0]["snapshot"], "got": runs[1]["snapshot"], "moved": runs[1]["moved"][kind]}


def _snapshot(engine) -> dict:
    opt = engine.optimizer
    return {
        "masters": [g.master.clone() for g in opt.groups],
        "states": [{k: v.clone() for k, v in opt.inner.state[g.master].items()} for g in opt.groups],
        "weights16": engine._zero3_consolidated_16bit_state_dict(),  # rank 0 only: gathers on every rank
        "fp32": engine.get_fp32_state_dict(rank0_only=False),
    }


def _device_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    """What offload_states must move here: masters, optimizer states, whole parameters, ZeRO-3 shards."""
    from partita.zero.freed import is_freed

    opt, out = engine.optimizer, []
    for i, g in enumerate(opt.groups):
        if g.offloaded:
            continue
        out.append((f"master{i}", g.master))
        out += [(f"state{i}.{k}", v) for k, v in opt.inner.state[g.master].items()]
    out += [(n, p) for n, p in engine.module.named_parameters() if not is_freed(p)]
    if engine.zero.gatherer is not None:
        out += [(f"shard{i}", s) for i, s in enumerate(engine.zero.gatherer.shards)]
    return out


def _refusals(engine) -> dict:
    """Messages of forward, step and backward while offloaded."""
    import torch.distributed as dist

    xs, ys = make_batches(1, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    batch = (xs[0][:micro], ys[0][:micro])
    out = {}
    engine.offload_states(include=["optim_states"])  # weights stay: a forward works, backward does not
    loss = engine(*batch)
    for what, call in (("backward", lambda: engine.backward(loss)), ("step", engine.step)):
        try:
            call()
        except RuntimeError as err:
            out[what] = str(err)
    engine.offload_states()  # the rest too: now the forward refuses
    try:
        engine(*batch)
    except RuntimeError as err:
        out["forward"] = str(err)
    engine.reload_states()
    engine.backward(loss)  # the loss computed while offloaded trains normally after the reload
    engine.step()
    out["rank"] = dist.get_rank()
    return out


def _inference_engine() -> dict:
    """ZeRO-Inference (ZeRO-3, no optimizer): its 16-bit shards move, its forward refuses, and after the
    reload it computes the same loss bit for bit."""
    import partita

    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}, "bf16": {"enabled": True},
           "steps_per_print": 1000}
    engine, _, _, _ = partita.initialize(model=build_block_model(), config=cfg)
    xs, ys = make_batches(1, 2)
    with torch.no_grad():
        before = engine(xs[0], ys[0])
        moved = engine.offload_states(include=["lp_params", "optim_states"])
        shard_bytes = sum(s.numel() * s.element_size() for s in engine.zero.gatherer.shards)
        try:
            engine(xs[0], ys[0])
            refused = None
        except RuntimeError as err:
            refused = str(err)
        engine.reload_states()
        after = engine(xs[0], ys[0])
    return {"before": before, "after": after, "moved": moved, "shard_bytes": shard_bytes, "refused": refused}


def body() -> dict:
    import partita

    results = {"inference": _inference_engine()}
    for label, stage, kind in ACCUMULATING:
        results[label] = _accumulating(stage, kind)
    for label, stage, bf16, offload in RUNS:
        cfg = _config(stage, bf16, offload)
        model = build_block_model()
        ref, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        _train(ref, range(STEPS))
        want = _snapshot(ref)
        ref.destroy()

        model = build_block_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        _train(engine, range(2))
        tensors = _device_tensors(engine)
        before = {name: (t, t.untyped_storage().data_ptr()) for name, t in tensors}
        kept = {i: g.master.untyped_storage().data_ptr() for i, g in enumerate(engine.optimizer.groups) if g.offloaded}
        expected_optim = sum(v.numel() * v.element_size() for n, v in tensors if n.startswith("state"))
        expected_hp = sum(t.numel() * t.element_size() for n, t in tensors if n.startswith("master"))
        if stage == 1:  # two calls: the second moves only what the first left
            first = engine.offload_states(include=["optim_states"])
            moved = engine.offload_states()
            moved["optim_states"] = first["optim_states"]
        else:
            moved = engine.offload_states()
        offloaded = {name: t.untyped_storage().data_ptr() != before[name][1] for name, t in tensors}
        host_copies = engine._offloaded_states.tensors()
        same_objects = all(any(t is h for h in host_copies) for _, t in tensors)
        kept_after = {i: engine.optimizer.groups[i].master.untyped_storage().data_ptr() == p for i, p in kept.items()}
        engine.reload_states()
        reloaded = {name: t.untyped_storage().data_ptr() for name, t in tensors}
        _train(engine, range(2, STEPS))
        got = _snapshot(engine)
        results[label] = {"want": want, "got": got, "moved": moved, "offloaded": offloaded, "kept": kept_after,
                          "expected_optim": expected_optim, "expected_hp": expected_hp, "same_objects": same_objects,
                          "reloaded_nonempty": all(p != 0 for p in reloaded.values())}
        if label == "stage0":
            results["refusals"] = _refusals(engine)
        engine.destroy()
    return results


def _equal(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert list(a) == list(b), what
        for k in a:
            _equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


def test_offload_reload_continues_bit_identically_at_every_stage() -> None:
    per_rank = run_distributed(body, 2, timeout=600)
    for rank, results in enumerate(per_rank):
        for label, *_ in RUNS:
            r = results[label]
            _equal(r["got"], r["want"], f"rank {rank} {label}")  # 2 + offload/reload + 2 == 4 steps, exactly
            assert all(r["offloaded"].values()), (label, [n for n, ok in r["offloaded"].items() if not ok])
            assert r["same_objects"] and r["reloaded_nonempty"], label
            on_host = label == "stage2-offload"  # offload_optimizer: masters and moments are in host memory already
            assert r["moved"]["optim_states"] == r["expected_optim"] and (r["expected_optim"] == 0) == on_host, label
            assert r["moved"]["hp_params"] == r["expected_hp"] and (r["expected_hp"] == 0) == on_host, label
            if label != "stage0":  # stage 0 fp32: the parameters are views of the master (moved as hp_params)
                assert r["moved"]["lp_params"] > 0, (label, r["moved"])
            assert r["moved"]["lp_grads"] == r["moved"]["contiguous_grad_buffer"] == 0, (label, r["moved"])
        assert results["stage2-offload"]["kept"] and all(results["stage2-offload"]["kept"].values())
    for rank, results in enumerate(per_rank):
        for label, *_ in ACCUMULATING:
            _equal(results[label]["got"], results[label]["want"], f"rank {rank} {label}")
            assert results[label]["moved"] > 0, label  # the window's gradients did move
    inference = per_rank[0]["inference"]
    assert torch.equal(inference["before"], inference["after"])
    assert inference["moved"]["lp_params"] > inference["shard_bytes"] > 0  # the shards and the persistent weights
    assert inference["moved"]["optim_states"] == 0  # it has no optimizer
    assert inference["refused"].startswith("the model's forward: the engine's states are offloaded")
    refusals = per_rank[0]["refusals"]
    fix = "the engine's states are offloaded to host memory (offload_states(include={})); call engine.reload_states() first"
    assert refusals["backward"] == "engine.backward(): " + fix.format("['optim_states']")
    assert refusals["step"] == "engine.step(): " + fix.format("['optim_states']")
    every = "['optim_states', 'hp_params', 'lp_params', 'lp_grads', 'contiguous_grad_buffer']"
    assert refusals["forward"] == "the model's forward: " + fix.format(every)


def test_bad_include_and_device_are_refused() -> None:
    from partita.zero.offload_states import parse_device, parse_include

    valid = "optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer"
    with pytest.raises(ValueError) as err:
        parse_include(["optim_states", "weights"])
    assert str(err.value) == ("offload_states(include=...): unknown state kind(s) 'weights'; valid kinds (DeepSpeed's "
                              f"OffloadStateTypeEnum): {valid} (None: all)")
    with pytest.raises(ValueError) as err:
        parse_device("cuda:0")
    assert str(err.value) == ("offload_states(device='cuda:0'): states can be offloaded to host memory only; use "
                              "device=\"cpu\" (for NVMe, configure zero_optimization.offload_optimizer / offload_param "
                              "with device \"nvme\")")
    from partita.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

    assert parse_include([OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states]) == (
        "optim_states", "hp_params")  # DeepSpeed's enum members (str enums) work as their values
    assert parse_device(OffloadDeviceEnum.cpu) == torch.device("cpu")
    with pytest.raises(ValueError, match="host memory only"):
        parse_device(OffloadDeviceEnum.nvme)
    assert parse_include("lp_params") == ("lp_params",)
    assert parse_include(["lp_grads", "optim_states"]) == ("optim_states", "lp_grads")  # DeepSpeed's order
    assert parse_include(None)[0] == "optim_states" and len(parse_include(None)) == 5
