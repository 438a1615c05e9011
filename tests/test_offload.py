"""ZeRO-Offload (optimizer states and fp32 master weights in host memory) on CPU gloo ranks.

On a CPU-only machine the "device" is the host, but the offload path is the one GPU runs
use: gradients go through the bounded staging pool and the worker thread, parameters come
back through :meth:`HostTransfer.upload`. Tiny staging buffers force every transfer to be
cut into many chunks, so chunk boundaries and pool back-pressure are exercised too.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import _check_against_reference, _config, train_partita

STAGING_BYTES = 64  # 16 fp32 elements per chunk: every bucket is many chunks
BUFFERS = 2


def _offload(**extra) -> dict:
    return {"offload_optimizer": {"device": "cpu", "buffer_count": BUFFERS, **extra}}


def train_with_tiny_staging(configs: list[dict]) -> dict:
    import partita.offload.transfer as transfer

    transfer.STAGING_BYTES = STAGING_BYTES
    peaks = []
    original = transfer.HostTransfer.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        peaks.append(self.pool)

    transfer.HostTransfer.__init__ = spy
    results = train_partita(configs)
    return {"results": results, "pool_peaks": [p.peak_in_use for p in peaks], "capacities": [p.capacity for p in peaks]}


CASES = [(stage, gas) for stage in (1, 2, 3) for gas in (1, 2)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_training_equals_on_device_training_and_torch(world_size: int) -> None:
    configs = []
    for stage, gas in CASES:
        # On the device, the flat fp32 gradient partition offload keeps (one rank: not the streamed
        # step "auto" would take, whose norm differs in its last bits).
        configs += [_config(stage, gas, one_rank_gradient_fold="early"), _config(stage, gas, **_offload())]
    per_rank = run_distributed(train_with_tiny_staging, world_size, configs)
    for rank_out in per_rank:
        results = rank_out["results"]
        for i, (stage, gas) in enumerate(CASES):
            on_device, offloaded = results[2 * i], results[2 * i + 1]
            where = f"stage {stage}, gas {gas}, world {world_size}"
            for name, want in on_device["params"].items():
                # Same kernels on the same values in the same order: bit-identical.
                assert torch.equal(offloaded["params"][name], want), f"{where}: {name}"
            assert offloaded["norms"] == on_device["norms"], where
            _check_against_reference(offloaded, tol=1e-5)
        # One transfer pool per offloaded run, never past its buffer count. A step's first
        # gradients are written straight into the host partition (fp32 here: uploads need no
        # cast either), so only accumulation (stage 2+, gas 2: later passes add) stages.
        assert rank_out["capacities"] == [BUFFERS] * len(CASES)
        peaks = dict(zip(CASES, rank_out["pool_peaks"]))
        assert all(0 <= peak <= BUFFERS for peak in peaks.values()), peaks
        assert peaks[(2, 2)] >= 1 and peaks[(3, 2)] >= 1, peaks


def offloaded_state_lives_on_host(_: None) -> dict:
    import partita
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    cfg = _config(2, 1, **_offload())
    engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return {
        "offloaded": [g.offloaded for g in optimizer.groups],
        "aliases": [g.aliases_params for g in optimizer.groups],
    }


def test_offloaded_masters_never_alias_the_model_parameters() -> None:
    # At world 1 in fp32 the masters would otherwise become the parameters' storage;
    # offloaded masters are host copies, written back after each step.
    out = run_distributed(offloaded_state_lives_on_host, 1, None)[0]
    assert out == {"offloaded": [True, True], "aliases": [False, False]}


def test_offload_needs_a_sharding_stage() -> None:
    from partita.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="offload_optimizer needs ZeRO stage 1, 2 or 3"):
        load_config(_config(0, 1, **_offload()))


# ----------------------------------------------------------------------------- delayed update

DELAY_STEPS = 4


def _delayed_reference(global_batch: int) -> dict[str, torch.Tensor]:
    """Single-process torch with the one-step-delayed update: the gradients of step t are
    taken on the weights before update t-1 landed; update t lands at step t+1."""
    import copy

    from tests.test_zero_parity import CLIP, LR
    from tests.tiny_models import build_model, make_batches, param_groups

    model = build_model()
    master = copy.deepcopy(model)
    groups = param_groups(master)
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    xs, ys = make_batches(DELAY_STEPS, global_batch)
    for step in range(DELAY_STEPS):
        model.zero_grad()
        model(xs[step], ys[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.load_state_dict(master.state_dict())  # update step-1 reaches the model now
        for n, p in master.named_parameters():
            p.grad = grads[n]
        opt.step()
    model.load_state_dict(master.state_dict())  # finish_pending_step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_delayed(configs: list[dict]) -> list[dict]:
    import torch.distributed as dist

    import partita
    from tests.tiny_models import build_model, make_batches, param_groups

    out = []
    for cfg in configs:
        model = build_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        micro = engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(DELAY_STEPS, cfg["train_batch_size"])
        lrs = []
        for step in range(DELAY_STEPS):
            for m in range(engine.gradient_accumulation_steps()):
                lo = (m * world + rank) * micro
                engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
                engine.step()
            lrs.append(engine.get_lr())
        pending = engine.optimizer.update_pending
        engine.finish_pending_step()
        out.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "lrs": lrs,
                    "pending": pending, "final_lr": engine.get_lr()})
    return out


def test_delayed_parameter_update_matches_the_delayed_torch_reference() -> None:
    from tests.test_zero_parity import GLOBAL_BATCH

    delayed = [_config(stage, 1, **_offload(delayed_param_update=True)) for stage in (2, 3)]
    scheduled = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}
    with_lr = [{**_config(2, 1, **_offload(delayed_param_update=flag)), **scheduled} for flag in (False, True)]
    per_rank = run_distributed(train_delayed, 2, delayed + with_lr)
    want = _delayed_reference(GLOBAL_BATCH)
    for results in per_rank:
        for stage, result in zip((2, 3), results):
            assert result["pending"] is True
            for name, ref in want.items():
                got = result["params"][name]
                err = float((got - ref).norm() / ref.norm())
                assert err < 1e-5, f"stage {stage}, {name}: relative error {err:.2e}"
        # The schedule advances once per applied update either way: the delayed run only
        # shows it one step later (its update lands at the next step).
        plain, late = results[2], results[3]
        assert late["final_lr"] == plain["final_lr"]
        assert late["lrs"][1:] == plain["lrs"][:-1]


def test_delayed_update_without_offload_is_refused() -> None:
    from partita.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="delayed_param_update overlaps the host optimizer step"):
        load_config(_config(2, 1, offload_optimizer={"delayed_param_update": True}))


# ----------------------------------------------------------------------------- partial offload


def train_with_ratio(configs: list[dict]) -> dict:
    import partita.zero.api as api

    made = []
    original = api.ShardedOptimizer.__init__

    def spy(self, groups, *args, **kwargs):
        original(self, groups, *args, **kwargs)
        made.append([(g.offloaded, sum(p.numel() for p in g.params)) for g in groups])

    api.ShardedOptimizer.__init__ = spy
    return {"results": train_partita(configs), "groups": made}


def test_partial_offload_ratio_splits_groups_and_trains_identically() -> None:
    configs = []
    for stage in (2, 3):
        configs += [_config(stage, 1), _config(stage, 1, **_offload(ratio=0.5))]
    rank_out = run_distributed(train_with_ratio, 2, configs)[0]
    for i in (0, 1):
        on_device, partial = rank_out["results"][2 * i], rank_out["results"][2 * i + 1]
        # Splitting a group changes how the global norm's partial sums are grouped: equal up
        # to float rounding, not bit for bit.
        for name, want in on_device["params"].items():
            assert torch.allclose(partial["params"][name], want, rtol=1e-6, atol=1e-7), name
        _check_against_reference(partial, tol=1e-5)
    # TiedNet's groups: weights (embed 8x16=128 registered first, fc1 256, fc2 256; frozen
    # excluded) and vectors (fc1.bias 16, fc2.bias 16, norm 16+16, unused.bias 4 ...): the
    # first half of each group's elements, in registration order, is on the host.
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    expected = []
    for group in param_groups(model):
        trainable = [p for p in group["params"] if p.requires_grad]
        total, moved = sum(p.numel() for p in trainable), 0
        for p in trainable:  # registration order
            if moved >= 0.5 * total:
                break
            moved += p.numel()
        expected += [(True, moved), (False, total - moved)]
    assert rank_out["groups"][1] == expected
    assert rank_out["groups"][0] == [(False, sum(n for _, n in expected[0:2])), (False, sum(n for _, n in expected[2:4]))]


def test_eight_bit_optimizer_states_offload_to_host() -> None:
    pytest.importorskip("bitsandbytes")
    eight_bit = {"optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    configs = [{**_config(stage, 1), **eight_bit} for stage in (2, 3)]
    configs = [c for cfg in configs for c in (cfg, {**cfg, "zero_optimization": {**cfg["zero_optimization"], **_offload()}})]
    results = run_distributed(train_partita, 2, configs)[0]
    for i, stage in enumerate((2, 3)):
        on_device, offloaded = results[2 * i], results[2 * i + 1]
        for name, want in on_device["params"].items():
            assert torch.equal(offloaded["params"][name], want), f"stage {stage}: {name}"
        # 8-bit state: one uint8 code per element of the (offloaded) partition plus block scales.
        assert offloaded["state_numel"] == on_device["state_numel"]


# ----------------------------------------------------------------------------- pipelined step + upload


def train_pipelined(configs: list[dict]) -> dict:
    import partita.zero.sharded_optimizer as sharded
    from tests.test_offload_nvme_optimizer import _train_sometimes

    calls = []
    original = sharded.step_and_upload

    def spy(optimizer, restore):
        calls.append([len(optimizer.bucket_layout(g)) for g in range(len(optimizer.groups))])
        return original(optimizer, restore)

    sharded.step_and_upload = spy
    return {"params": [_train_sometimes(cfg) for cfg in configs], "calls": calls}


def test_offloaded_step_is_pipelined_with_the_upload_and_exact() -> None:
    # SometimesNet's "extra" gets no gradient in steps 2 and 3: its weights and moments must
    # be restored before its bucket is written back. Tiny all-gather buckets: many per group.
    configs = [_config(stage, 1, allgather_bucket_size=40, **extra) for stage in (1, 2)
               for extra in ({}, _offload())]  # fmt: skip
    out = run_distributed(train_pipelined, 2, configs)[0]
    for i, stage in enumerate((1, 2)):
        on_device, offloaded = out["params"][2 * i], out["params"][2 * i + 1]
        for name, want in on_device.items():
            assert torch.equal(offloaded[name], want), f"stage {stage}: {name}"
    # Steps 2-4 of each offloaded run (the first step creates the state unpipelined).
    assert len(out["calls"]) == 6
    assert all(max(buckets) > 1 for buckets in out["calls"])


def destroy_releases_offload(nvme_path: str) -> dict:
    import os

    import partita
    from tests.tiny_models import build_model, make_batches, param_groups

    model = build_model()
    cfg = _config(2, 1, offload_optimizer={"device": "nvme", "nvme_path": nvme_path, "delayed_param_update": True},
                  sub_group_size=64)
    cfg["aio"] = {"block_size": 4096}
    engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    xs, ys = make_batches(2, cfg["train_batch_size"])
    for step in range(2):
        engine.backward(engine(xs[step], ys[step]))
        engine.step()
    pending_before = optimizer.update_pending
    files_before = sum(len(files) for _, _, files in os.walk(nvme_path))
    transfer = optimizer.groups[0].host_transfer
    engine.destroy()
    return {
        "pending": (pending_before, optimizer.update_pending),
        "files": (files_before, sum(len(files) for _, _, files in os.walk(nvme_path))),
        "worker_alive": transfer._worker.is_alive(),
    }


def test_engine_destroy_lands_the_update_and_releases_offload(tmp_path) -> None:
    out = run_distributed(destroy_releases_offload, 1, str(tmp_path))[0]
    assert out["pending"] == (True, False)
    assert out["files"][0] > 0 and out["files"][1] == 0  # swap files removed
    assert out["worker_alive"] is False


# ----------------------------------------------------------------------------- resume under another ratio


def resume_across_ratios(save_dir: str) -> dict:
    import partita
    from tests.tiny_models import build_model, make_batches, param_groups

    def engine_for(extra: dict):
        model = build_model()
        cfg = _config(2, 1, **extra)
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        return engine, model

    import torch.distributed as dist

    xs, ys = make_batches(4, 8)

    def train(engine, first: int, last: int) -> None:
        rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
        for step in range(first, last):
            lo = rank * micro
            engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
            engine.step()

    out = {}
    for name, saved, resumed in (("half_to_none", _offload(ratio=0.5), {}), ("none_to_half", {}, _offload(ratio=0.5))):
        straight, model = engine_for(saved)
        train(straight, 0, 4)
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        first, _ = engine_for(saved)
        train(first, 0, 2)
        first.save_checkpoint(f"{save_dir}/{name}")
        second, model = engine_for(resumed)
        second.load_checkpoint(f"{save_dir}/{name}")
        train(second, 2, 4)
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name] = max(float((got[n] - w).norm() / w.norm().clamp_min(1e-12)) for n, w in want.items())
        out[name + "_groups"] = (len(first.optimizer.groups), len(second.optimizer.groups))
    return out


def test_checkpoint_resumes_under_another_offload_ratio(tmp_path) -> None:
    out = run_distributed(resume_across_ratios, 2, str(tmp_path))[0]
    assert out["half_to_none_groups"] == (4, 2) and out["none_to_half_groups"] == (2, 4)
    # The same optimizer state continues; only the grouping of the global norm's partial sums differs.
    assert out["half_to_none"] < 1e-6 and out["none_to_half"] < 1e-6, out


def test_offloaded_gradient_buffer_is_reused_and_its_first_pass_overwrites() -> None:
    """The host gradient partition is recycled between steps without a zero fill: the first
    pass writes (scaled), ranges it did not write are zeroed when the pass ends, later passes
    add, and overlapping writes in one pass are refused instead of silently overwriting."""
    from partita.offload.transfer import HostTransfer
    from partita.zero.shard_group import ShardedParamGroup

    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
    transfer = HostTransfer(torch.device("cpu"), buffer_count=2, pin_memory=False, staging_bytes=8)
    try:
        group = ShardedParamGroup(params, options={}, num_shards=1, shard_rank=0, host_transfer=transfer)
        first = group.ensure_grad_partition()
        first.fill_(float("nan"))  # what a recycled buffer may hold
        group.accumulate_grad(0, torch.arange(1.0, 6.0), scale=0.5)  # params[1] got no gradient
        transfer.drain()
        group.finish_pass()
        assert group.grad_partition.tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 0.0, 0.0, 0.0]
        group.accumulate_grad(5, torch.ones(3), scale=2.0)  # a second pass (accumulation) adds
        transfer.drain()
        group.finish_pass()
        assert group.grad_partition.tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 2.0, 2.0, 2.0]
        assert float(group.grad_norm_sq(torch.device("cpu"))) == pytest.approx(0.25 * 55 + 12)

        stepped = group.take_grad_partition()
        group.recycle_grad_buffer(stepped)  # what the optimizer does once its step is done
        again = group.ensure_grad_partition()
        assert again.data_ptr() == stepped.data_ptr()  # reused, not reallocated
        group.accumulate_grad(5, torch.full((3,), 4.0), scale=1.0)
        transfer.drain()
        group.finish_pass()
        assert group.grad_partition.tolist() == [0.0] * 5 + [4.0] * 3  # last step's values are gone

        group.zero_grad()
        group.accumulate_grad(0, torch.ones(5), scale=1.0)
        group.accumulate_grad(4, torch.ones(4), scale=1.0)
        transfer.drain()
        with pytest.raises(RuntimeError, match=r"range \[4, 8\) was written twice"):
            group.finish_pass()
    finally:
        transfer.close()
