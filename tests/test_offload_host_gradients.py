"""The offloaded gradient partition in the model's dtype (partita/offload/host_gradients.py).

With the delayed update at one process and one gradient pass per step, a 16-bit model's host
gradient partition keeps the gradients' own dtype and the step casts it range by range. Each run here is trained twice,
once so and once with the rule switched off (the fp32 partition of before), and the two must be
bitwise equal: weights, norms, moments, and which steps an fp16 loss scaler skipped.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import _config


def _train(configs: list[dict]) -> list[dict]:
    """test_zero_parity's loop on one process, reading weights and moments once the last update
    has landed (``finish_pending_step``: delayed and overlapped updates may still be in flight)."""
    import partita
    from tests.test_zero_parity import STEPS
    from tests.tiny_models import build_model, make_batches, param_groups

    out = []
    for cfg in configs:
        model = build_model()
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(STEPS, cfg["train_batch_size"])
        norms = []
        for step in range(STEPS):
            for m in range(gas):
                engine.backward(engine(xs[step][m * micro : (m + 1) * micro], ys[step][m * micro : (m + 1) * micro]))
                engine.step()
            norms.append(engine.get_global_grad_norm())
        engine.finish_pending_step()
        out.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
                    "states": [t.clone() for s in optimizer.inner.state.values() for t in s.values() if torch.is_tensor(t)],
                    "steps": engine.global_steps, "skipped": engine.skipped_steps})
        engine.destroy()
    return out


def _offload(**extra) -> dict:
    return {"offload_optimizer": {"device": "cpu", **extra}}


def train_both_ways(configs: list[dict], chunk_numel: int | None = None) -> dict:
    """Each config trained with model-dtype host gradients where the rule allows them, then with
    the rule off; also what dtype each run's host partitions had."""
    import partita.offload.host_gradients as host_gradients
    import partita.zero.shard_group as shard_group

    if chunk_numel is not None:
        host_gradients.CAST_CHUNK_NUMEL = chunk_numel  # many casts and kernel calls per range
    seen: list[torch.dtype] = []
    original = shard_group.ShardedParamGroup.ensure_grad_partition

    def spy(self):
        partition = original(self)
        if self.offloaded:
            seen.append(partition.dtype)
        return partition

    shard_group.ShardedParamGroup.ensure_grad_partition = spy
    narrow = _train(configs)
    narrow_dtypes, seen[:] = sorted(set(seen), key=str), []
    rule = host_gradients.keeps_model_dtype
    host_gradients.keeps_model_dtype = lambda **_: False
    try:
        wide = _train(configs)
    finally:
        host_gradients.keeps_model_dtype = rule
    return {"narrow": narrow, "wide": wide, "narrow_dtypes": narrow_dtypes, "wide_dtypes": sorted(set(seen), key=str)}


def _assert_equal_runs(out: dict, labels: list[str]) -> None:
    for label, narrow, wide in zip(labels, out["narrow"], out["wide"]):
        for name, want in wide["params"].items():
            assert torch.equal(narrow["params"][name], want), f"{label}: {name}"
        assert narrow["norms"] == wide["norms"], label
        assert len(narrow["states"]) == len(wide["states"]) and all(
            torch.equal(a, b) for a, b in zip(narrow["states"], wide["states"])), f"{label}: optimizer states"
        assert (narrow["steps"], narrow["skipped"]) == (wide["steps"], wide["skipped"]), label


def _delayed(**extra) -> dict:
    return _offload(delayed_param_update=True, **extra)


CASES = {
    "stage 1": _config(1, 1, "bf16", **_delayed()),
    "stage 1, gas 2": _config(1, 2, "bf16", **_delayed()),
    "stage 2": _config(2, 1, "bf16", **_delayed()),
    "stage 1, landing beside the forward": _config(1, 1, "bf16", **_delayed(overlap_step_with_forward=True)),
    "stage 2, landing beside the forward": _config(2, 1, "bf16", **_delayed(overlap_step_with_forward=True)),
    # A loss scale of 2**16: the first two steps overflow and are skipped, the third applies.
    "stage 2, fp16": {**_config(2, 1, "fp16", **_delayed()), "fp16": {"enabled": True, "initial_scale_power": 16}},
}


def test_model_dtype_host_gradients_are_bitwise_the_fp32_partition() -> None:
    configs = list(CASES.values())
    configs[0] = {**configs[0], "gradient_clipping": 1e-3}  # clipping active: the norm must agree exactly
    out = run_distributed(train_both_ways, 1, configs, 64)[0]
    assert out["narrow_dtypes"] == [torch.bfloat16, torch.float16]  # the rule engaged, in each model dtype
    assert out["wide_dtypes"] == [torch.float32]
    _assert_equal_runs(out, list(CASES))
    assert [run["skipped"] for run in out["narrow"]] == [0] * (len(CASES) - 1) + [2]


NOT_NARROW = {
    "the exact step": (1, _config(2, 1, "bf16", **_offload())),
    "two processes": (2, _config(2, 1, "bf16", **_delayed())),
    "stage 2 with accumulation": (1, _config(2, 2, "bf16", **_delayed())),
    "stage 3": (1, _config(3, 1, "bf16", **_delayed())),
    "fp32 micro-batch sums": (1, {**_config(1, 2, "bf16", **_delayed()), "data_types": {"grad_accum_dtype": "fp32"}}),
    "part on the accelerator": (1, _config(2, 1, "bf16", **_delayed(ratio=0.5))),
    "fp32 model": (1, _config(2, 1, "fp32", **_delayed())),
}


@pytest.mark.parametrize("case", list(NOT_NARROW))
def test_other_setups_keep_the_fp32_partition(case: str) -> None:
    world, cfg = NOT_NARROW[case]
    out = run_distributed(train_both_ways, world, [cfg])[0]
    assert out["narrow_dtypes"] == [torch.float32], case
    _assert_equal_runs(out, [case])


def test_the_rule_needs_a_fused_host_adam_and_the_delayed_update() -> None:
    from partita.offload.host_gradients import keeps_model_dtype

    base = dict(delayed_update=True, zero_size=1, stage=2, dtype=torch.bfloat16, tiers=(0.0, 1.0, 0.0), fused_adam=True, fp32_sums=False,
                gradient_accumulation_steps=1)
    assert keeps_model_dtype(**base)
    assert not keeps_model_dtype(**{**base, "fused_adam": False})
    assert not keeps_model_dtype(**{**base, "delayed_update": False})
    assert not keeps_model_dtype(**{**base, "tiers": (0.0, 0.5, 0.5)})
    assert keeps_model_dtype(**{**base, "stage": 1, "gradient_accumulation_steps": 4})


def test_a_model_dtype_partition_refuses_scaled_or_other_dtype_gradients() -> None:
    from partita.offload.transfer import HostTransfer

    transfer = HostTransfer(torch.device("cpu"), buffer_count=1, pin_memory=False)
    try:
        target = torch.zeros(8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"a torch.bfloat16 partition takes torch.bfloat16 gradients unscaled, "
                                             r"got torch.bfloat16 with scale 0.5"):
            transfer.write_to_host(target, torch.ones(8, dtype=torch.bfloat16), scale=0.5)
        with pytest.raises(ValueError, match="got torch.float32 with scale 1.0"):
            transfer.write_to_host(target, torch.ones(8), scale=1.0)
        transfer.write_to_host(target, torch.full((8,), 3.0, dtype=torch.bfloat16), scale=1.0)
        assert torch.equal(target, torch.full((8,), 3.0, dtype=torch.bfloat16))
    finally:
        transfer.close()
