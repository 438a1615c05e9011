"""ZeRO stages 0, 1, 2 on N gloo ranks equal single-process torch on the global batch.

The oracle is :func:`tests.tiny_models.reference_train`: the same model (tied weights, a
frozen layer, a parameter without gradient, two param groups), torch AdamW, and
``clip_grad_norm_`` on the whole model, on the full global batch each step.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import build_model, make_batches, param_groups, reference_train

LR = 1e-2
CLIP = 0.5  # small enough that clipping is active in every step
STEPS = 3
GLOBAL_BATCH = 8


def _config(stage: int, gas: int, precision: str = "fp32", **zero) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        # Tiny buckets: several reduce buckets and all-gather buckets per step.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50, **zero},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_partita(configs: list[dict]) -> list[dict]:
    """Runs on every rank: one training run per config, in one process group."""
    import torch.distributed as dist

    import partita

    out = []
    for cfg in configs:
        model = build_model()
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        gas = engine.gradient_accumulation_steps()
        micro = engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(STEPS, cfg.get("train_batch_size", GLOBAL_BATCH))
        norms = []
        for step in range(STEPS):
            for m in range(gas):
                start = (m * world + rank) * micro
                loss = engine(xs[step][start : start + micro], ys[step][start : start + micro])
                engine.backward(loss)
                engine.step()
            norms.append(engine.get_global_grad_norm())
        states = [t for s in optimizer.inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        out.append(
            {
                "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
                "norms": norms,
                # Bytes of the memory actually held, not numel of views: a master that were a
                # slice of a whole-model buffer would pass a numel check and fail this one.
                "master_bytes": _storage_bytes(g.master for g in optimizer.groups),
                "state_bytes": _storage_bytes(states),
                "master_numel": sum(g.master.numel() for g in optimizer.groups),
                "state_numel": sum(t.numel() for t in states),
                "steps": engine.global_steps,
                "skipped": engine.skipped_steps,
            }
        )
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check_against_reference(result: dict, *, tol: float) -> None:
    ref_params, ref_norms = reference_train(num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    initial = build_model()
    for name, ref in ref_params.items():
        got = result["params"][name]
        assert _rel_err(got, ref) < tol, f"{name}: relative error {_rel_err(got, ref):.2e} >= {tol}"
    # The frozen layer and the never-used layer must not move at all.
    for name in ("frozen.weight", "frozen.bias"):
        assert torch.equal(result["params"][name], dict(initial.named_parameters())[name].detach())
    for got, ref in zip(result["norms"], ref_norms):
        assert abs(got - ref) / ref < max(tol, 1e-5), (got, ref)
    assert result["steps"] == STEPS and result["skipped"] == 0


STAGE_GAS = [(stage, gas) for stage in (0, 1, 2) for gas in (1, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_parity_every_stage(world_size: int) -> None:
    configs = [_config(stage, gas) for stage, gas in STAGE_GAS]
    per_rank = run_distributed(train_partita, world_size, configs)
    for (stage, gas), result in zip(STAGE_GAS, per_rank[0]):
        try:
            _check_against_reference(result, tol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"stage {stage}, gas {gas}, world {world_size}: {e}") from e
    _check_state_is_one_nth(per_rank, world_size)
    # Every rank ends with the same full model.
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            for name in a["params"]:
                assert torch.equal(a["params"][name], b["params"][name]), name


def _check_state_is_one_nth(per_rank: list[list[dict]], world: int) -> None:
    """Bytes of fp32 master weights and Adam moments: whole model at stage 0, 1/world (+ padding) at 1 and 2."""
    trainable = [p for p in build_model().parameters() if p.requires_grad]
    total = sum(p.numel() for p in trainable)
    share = sum(-(-p.numel() // world) for p in trainable)  # ceil per parameter
    assert share * world - total < world * len(trainable)  # padding: < 1 element per rank per parameter
    for rank_results in per_rank:
        for (stage, _), result in zip(STAGE_GAS, rank_results):
            expected = total if stage == 0 else share
            assert result["master_bytes"] == 4 * expected, (stage, result["master_bytes"], 4 * expected)
            assert result["state_bytes"] == 2 * 4 * expected, (stage, result["state_bytes"])  # exp_avg + exp_avg_sq


def test_reduce_scatter_off_and_no_overlap_still_match() -> None:
    configs = [_config(2, 2, reduce_scatter=False), _config(1, 1, overlap_comm=False)]
    per_rank = run_distributed(train_partita, 2, configs)
    for result in per_rank[0]:
        _check_against_reference(result, tol=1e-5)


def test_mixed_precision_close_to_fp32() -> None:
    configs = [_config(stage, 2, precision) for precision in ("bf16", "fp16") for stage in (0, 2)]
    per_rank = run_distributed(train_partita, 2, configs)
    ref_params, _ = reference_train(num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    initial = dict(build_model().named_parameters())
    for cfg, result in zip(configs, per_rank[0]):
        assert result["skipped"] == 0
        for name, ref in ref_params.items():
            moved = (ref - initial[name].detach()).norm()
            err = (result["params"][name] - ref).norm()
            # bf16 keeps 8 bits of mantissa: errors stay a small fraction of how far training moved.
            if moved > 0:
                assert err / moved < 0.1, (cfg.get("bf16") or cfg.get("fp16"), name, float(err / moved))
