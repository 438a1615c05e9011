"""offload_optimizer.overlap_step_with_forward over a tiered layout (device "auto": accelerator,
host-memory and NVMe groups; and device "nvme"), on one CPU gloo rank.

The oracle is the same run without the overlap (the serial step: the swapper steps its
sub-groups, then the inner optimizer the rest): every weight and gradient norm must be
bit-identical, with clipping active, an LR scheduler changing the rate every step, gradient
accumulation, ``eval()`` between steps, and a checkpoint saved mid-run and resumed in a fresh
engine. Both the host-memory ranges and the NVMe ranges are slowed (each sleeps first), so the
next forward really starts while the worker is still stepping: a module that did not wait for
its own buckets would compute on weights one update old and the weights would differ.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import _config

SUB_GROUP = 64  # elements per NVMe sub-group: every NVMe group is several ranges
STEPS = 4
SCHEDULED = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}


def _offload(path: str, overlap: bool, device: str = "auto", **extra) -> dict:
    offload = {"device": device, "nvme_path": path, "buffer_count": 4, "pipeline_read": True,
               "overlap_step_with_forward": overlap, **extra}
    if device == "auto":
        # A part of every param group on each tier (whole parameters at a time).
        offload["tiers"] = {"fractions": {"accelerator": 0.2, "cpu": 0.3, "nvme": 0.5}}
    return {"sub_group_size": SUB_GROUP, "offload_optimizer": offload}


def _slow_steps(seconds: float) -> list[bool]:
    """Every host-memory range and every NVMe range sleeps first; returns a list recording, at
    each ``engine.step()`` return, whether an overlapped update was still in flight."""
    import partita.offload.nvme_optimizer as nvme
    import partita.offload.pipelined_step as pipelined
    import partita.zero.sharded_optimizer as sharded

    host_range, nvme_range, step = pipelined._step_range, nvme.SwappedOptimizerStates._step_range, sharded.ShardedOptimizer.step

    def slow_host(*args, **kwargs):
        time.sleep(seconds)
        return host_range(*args, **kwargs)

    def slow_nvme(self, *args, **kwargs):
        time.sleep(seconds)
        return nvme_range(self, *args, **kwargs)

    in_flight: list[bool] = []

    def spy(self, **kwargs):
        result = step(self, **kwargs)
        in_flight.append(self.overlapped is not None and self.overlapped.in_flight)
        return result

    pipelined._step_range, nvme.SwappedOptimizerStates._step_range, sharded.ShardedOptimizer.step = slow_host, slow_nvme, spy
    return in_flight


def _engine(cfg: dict):
    import partita
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def _train(engine, xs, ys, steps: range, norms: list[float]) -> None:
    micro = engine.train_micro_batch_size_per_gpu()
    for step in steps:
        for m in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(xs[step][m * micro : (m + 1) * micro], ys[step][m * micro : (m + 1) * micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
        if step == 1:  # eval() between steps lands the update; the evaluation sees the newest weights
            engine.eval()
            with torch.no_grad():
                norms.append(float(engine(xs[0][:micro], ys[0][:micro])))
            engine.train()


def _params(engine) -> dict[str, torch.Tensor]:
    engine.finish_pending_step()
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def tiered_runs(nvme_path: str, save_dir: str, cases: list[tuple[str, int, int, bool]]) -> dict:
    """Per case and overlap flag: 4 steps with a checkpoint after step 2, and a fresh engine
    resumed from it for steps 3-4."""
    from tests.tiny_models import make_batches

    in_flight = _slow_steps(0.003)
    out: dict = {}
    for device, stage, gas, write in cases:
        for overlap in (False, True):
            name = f"{device} stage {stage} gas {gas} pipeline_write {write} overlap {overlap}"
            cfg = {**_config(stage, gas, **_offload(nvme_path, overlap, device, pipeline_write=write)), **SCHEDULED}
            xs, ys = make_batches(STEPS, cfg["train_batch_size"])
            engine = _engine(cfg)
            norms: list[float] = []
            first = len(in_flight)
            _train(engine, xs, ys, range(2), norms)
            engine.save_checkpoint(save_dir, tag=name)
            _train(engine, xs, ys, range(2, STEPS), norms)
            flags = in_flight[first:]
            tiers = sorted({("nvme" if g in engine.optimizer.swapper.swapped_groups else "cpu" if group.offloaded
                             else "accelerator") for g, group in enumerate(engine.optimizer.groups)})
            out[name] = {"params": _params(engine), "norms": norms, "in_flight": flags, "tiers": tiers}
            engine.destroy()
            resumed = _engine(cfg)
            resumed.load_checkpoint(save_dir, tag=name)
            rest: list[float] = []
            _train(resumed, xs, ys, range(2, STEPS), rest)
            out[name]["resumed"], out[name]["resumed_norms"] = _params(resumed), rest
            resumed.destroy()
    return out


CASES = [("auto", 2, 2, False), ("auto", 1, 1, True), ("nvme", 2, 1, True)]


def test_tiered_overlap_equals_the_serial_step_bitwise(tmp_path) -> None:
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    out = run_distributed(tiered_runs, 1, str(nvme_path), str(tmp_path / "ckpt"), CASES)[0]
    for device, stage, gas, write in CASES:
        where = f"{device} stage {stage} gas {gas} pipeline_write {write}"
        serial, overlapped = out[f"{where} overlap False"], out[f"{where} overlap True"]
        want_tiers = ["accelerator", "cpu", "nvme"] if device == "auto" else ["nvme"]
        assert overlapped["tiers"] == want_tiers, overlapped["tiers"]
        for name, want in serial["params"].items():
            assert torch.equal(overlapped["params"][name], want), f"{where}: {name}"
            # A checkpoint saved mid-run holds the whole update: resumed runs end the same.
            assert torch.equal(overlapped["resumed"][name], want), f"{where}, resumed: {name}"
            assert torch.equal(serial["resumed"][name], want), f"{where}, resumed serial: {name}"
        assert overlapped["norms"] == serial["norms"], where
        assert overlapped["resumed_norms"] == serial["resumed_norms"] == serial["norms"][-2:], where
        # The first step creates the states unoverlapped (torch initialises them); every later
        # step returned with its host and NVMe step still running beside the next forward.
        assert serial["in_flight"] == [False] * STEPS, serial["in_flight"]
        assert overlapped["in_flight"] == [False] + [True] * (STEPS - 1), (where, overlapped["in_flight"])
    assert list(nvme_path.iterdir()) == []  # every swap directory removed


def refusals(nvme_path: str) -> dict:
    import partita
    from partita.config import ConfigError
    from tests.tiny_models import build_model, param_groups

    out = {}
    sgd = {**_config(2, 1, **_offload(nvme_path, True)), "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
    for name, cfg in (("sgd", sgd), ("stage3", _config(3, 1, **_offload(nvme_path, True)))):
        model = build_model()
        try:
            partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
            out[name] = "accepted"
        except ConfigError as error:
            out[name] = str(error)
    # "auto" that keeps everything on the accelerator: nothing to overlap, the flag is dropped.
    model = build_model()
    cfg = _config(2, 1, **_offload(nvme_path, True))
    cfg["zero_optimization"]["offload_optimizer"]["tiers"] = {"fractions": {"accelerator": 1.0}}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    out["all_accelerator"] = (engine.optimizer.overlapped is None, engine.optimizer.swapper is None,
                              any(g.offloaded for g in engine.optimizer.groups))
    engine.destroy()
    return out


def test_unsupported_setups_name_the_key_and_the_fix(tmp_path) -> None:
    from partita.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(
            'overlap_step_with_forward runs the offloaded optimizer step beside the next forward and needs '
            'offload_optimizer.device "cpu", "nvme" or "auto" (got "none"); set one of them or remove '
            'overlap_step_with_forward')):
        load_config(_config(2, 1, offload_optimizer={"overlap_step_with_forward": True}))
    out = run_distributed(refusals, 1, str(tmp_path))[0]
    assert out["sgd"].startswith("zero_optimization.offload_optimizer.overlap_step_with_forward steps the offloaded "
                                 "partition range by range with torch's Adam/AdamW kernels; this run's optimizer is "
                                 "SGD. Use Adam or AdamW, or remove overlap_step_with_forward"), out["sgd"]
    assert "overlap_step_with_forward needs ZeRO stage 1 or 2" in out["stage3"] and "use stage 2" in out["stage3"]
    assert out["all_accelerator"] == (True, True, False)
