"""Exports at ep_size 2 return every expert under its global name: ``get_fp32_state_dict``,
``_zero3_consolidated_16bit_state_dict`` and ``save_16bit_model`` on 2 and 4 gloo ranks at ZeRO
0-3 equal the single-process model's ``state_dict`` (same keys in the same order, exactly equal
fp32 values), before and after a training step, and the 16-bit file (fp32 and bf16 models) loads into a fresh
single-process MoE model with ``load_state_dict(strict=True)``."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_moe_checkpoint import E, MICRO, _config  # the same model, batch and ZeRO settings
from tests.test_moe_reference import MoENet, make_data


def _local_by_global_name(model) -> dict[str, torch.Tensor]:
    """This rank's parameters (gathered where ZeRO-3 shards them) under their global names."""
    from partita.moe.registry import checkpoint_name
    from partita.zero.gathered import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {checkpoint_name(n, p): p.detach().float().clone() for n, p in model.named_parameters()}


def exports(save_dir: str) -> dict:
    import partita
    from safetensors.torch import load_file

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for stage in range(4):
        model = MoENet(num_experts=E, ep_size=2, k=2, drop_tokens=False, expert_rank=rank % 2)
        engine, _, _, _ = partita.initialize(model=model, config=_config(world, stage))
        result = {"fp32": engine.get_fp32_state_dict(), "fp32_all": engine.get_fp32_state_dict(rank0_only=False),
                  "16bit": engine._zero3_consolidated_16bit_state_dict()}
        xs, ys = make_data(1, MICRO * world)
        loss = engine(xs[0][rank * MICRO : (rank + 1) * MICRO], ys[0][rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        result["stepped_local"] = _local_by_global_name(model)
        result["stepped_fp32"] = engine.get_fp32_state_dict(rank0_only=False)
        path = engine.save_16bit_model(os.path.join(save_dir, f"stage{stage}"), "model.safetensors")
        result["stepped_16bit"] = load_file(str(path)) if rank == 0 else {}
        out[stage] = result
    return out


def _single_process_state() -> dict[str, torch.Tensor]:
    return MoENet(num_experts=E, ep_size=1, k=2, drop_tokens=False).state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, *, ordered: bool = True) -> None:
    if ordered:
        assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for name, value in want.items():
        assert got[name].dtype == torch.float32, f"{what} {name}: {got[name].dtype}"
        assert torch.equal(got[name], value), f"{what} {name}: not the expected values"


@pytest.mark.parametrize("world", [2, 4])
def test_exports_at_ep2_hold_every_expert_by_global_name(tmp_path, world: int) -> None:
    per_rank = run_distributed(exports, world, str(tmp_path), timeout=600)
    initial = _single_process_state()
    assert any(".deepspeed_experts.3." in k for k in initial)  # the single-process model holds all 4 experts
    for stage in range(4):
        root = per_rank[0][stage]
        for key in ("fp32", "16bit"):
            _assert_same(root[key], initial, f"stage {stage} rank 0 {key}")
        # After a step: every rank's experts, under their global names, are the exported ones.
        stepped = {}
        for result in per_rank:
            stepped.update(result[stage]["stepped_local"])
        stepped = {name: stepped[name] for name in initial}  # the single-process order
        assert not torch.equal(stepped["moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight"],
                               initial["moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight"])
        # safetensors files list their keys sorted
        _assert_same(root["stepped_16bit"], stepped, f"stage {stage} save_16bit_model", ordered=False)
        for rank, result in enumerate(per_rank):
            _assert_same(result[stage]["fp32_all"], initial, f"stage {stage} rank {rank} fp32 (rank0_only=False)")
            _assert_same(result[stage]["stepped_fp32"], stepped, f"stage {stage} rank {rank} fp32 after a step")
            if rank:
                assert result[stage]["fp32"] == {} and result[stage]["16bit"] is None and result[stage]["stepped_16bit"] == {}
        fresh = MoENet(num_experts=E, ep_size=1, k=2, drop_tokens=False)
        fresh.load_state_dict(root["stepped_16bit"], strict=True)
        _assert_same(fresh.state_dict(), stepped, f"stage {stage} fresh model loaded from the 16-bit file")


def bf16_exports(save_dir: str) -> dict:
    import partita
    from safetensors.torch import load_file

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for stage in (2, 3):
        model = MoENet(num_experts=E, ep_size=2, k=2, drop_tokens=False, expert_rank=rank % 2)
        engine, _, _, _ = partita.initialize(model=model, config={**_config(world, stage), "bf16": {"enabled": True}})
        xs, ys = make_data(1, MICRO * world)
        loss = engine(xs[0][rank * MICRO : (rank + 1) * MICRO], ys[0][rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        path = engine.save_16bit_model(os.path.join(save_dir, f"stage{stage}"), "model.safetensors")
        out[stage] = {"fp32": engine.get_fp32_state_dict(), "file": load_file(str(path)) if rank == 0 else {}}
    return out


def test_bf16_export_at_ep2_loads_into_a_single_process_model(tmp_path) -> None:
    root = run_distributed(bf16_exports, 2, str(tmp_path), timeout=600)[0]
    for stage in (2, 3):
        saved, masters = root[stage]["file"], root[stage]["fp32"]
        assert sorted(saved) == sorted(_single_process_state())
        for name, value in masters.items():  # the bf16 weights are the fp32 masters rounded
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value.bfloat16()), f"stage {stage} {name}"
        fresh = MoENet(num_experts=E, ep_size=1, k=2, drop_tokens=False).bfloat16()
        fresh.load_state_dict(saved, strict=True)
        assert all(torch.equal(fresh.state_dict()[n], saved[n]) for n in saved)
