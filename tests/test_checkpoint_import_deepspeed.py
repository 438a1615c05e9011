"""``partita checkpoint import-deepspeed``: DeepSpeed 0.19.8 checkpoints resume under partita.

The fixtures (tests/fixtures/deepspeed_ckpt, made by tests/fixtures/make_deepspeed_checkpoints.py
under DeepSpeed 0.19.8 on 2 gloo ranks) hold DeepSpeed's checkpoint after 3 steps at ZeRO 0-3
and DeepSpeed's own resume from it: the parameters after 2 more steps, the losses and the lrs.
Imported, the checkpoint must resume under partita at 1 and 4 ranks (other ZeRO stages, the
same global batch) to DeepSpeed's parameters within 1e-5 relative, fp32. CI has no DeepSpeed.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from partita.checkpoint.cli import main as checkpoint_main
from partita.checkpoint.import_deepspeed import import_deepspeed
from partita.checkpoint.import_deepspeed_read import DeepSpeedImportError
from tests.fixtures.make_deepspeed_checkpoints import (BETAS, EPS, GLOBAL_BATCH, LR, TAG, WARMUP, WEIGHT_DECAY, TinyNet,
                                                       param_groups, rank_slice)
from tests.harness import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
STAGES = ("0", "1", "2", "3")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    return {s: import_deepspeed(FIXTURES / f"zero{s}", root / f"zero{s}") for s in STAGES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---------------------------------------------------------------------------- what is imported


@pytest.mark.parametrize("stage", STAGES)
def test_masters_and_weights_are_deepspeeds(imported, stage):
    """zero_to_fp32's reconstruction: every parameter exactly DeepSpeed's after step 3."""
    rank = load_file(str(imported[stage] / "rank00000.safetensors"))
    model = load_file(str(imported[stage] / "model.safetensors"))
    saved = EXPECTED["stages"][stage]["saved"]["params"]
    assert sorted(model) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "scale"]
    assert torch.equal(model["scale"], torch.tensor([1.0, 0.5, 2.0]))
    for name, values in saved.items():
        assert torch.equal(rank[f"master/{name}"], torch.tensor(values)), name
        assert torch.equal(model[name].reshape(-1), torch.tensor(values)), name


def test_optimizer_state_agrees_across_stages(imported):
    """The same 3 steps at ZeRO 0-3: Adam's moments rebuilt from four layouts agree (fp32 rounding)."""
    files = {s: load_file(str(imported[s] / "rank00000.safetensors")) for s in STAGES}
    keys = sorted(files["0"])
    assert [k for k in keys if k.startswith("state/exp_avg/")] == [
        "state/exp_avg/fc1.bias", "state/exp_avg/fc1.weight", "state/exp_avg/fc2.bias", "state/exp_avg/fc2.weight"]
    for stage in STAGES[1:]:
        assert sorted(files[stage]) == keys
        for key in keys:
            assert _rel(files[stage][key], files["0"][key]) < 1e-6, (stage, key)
    assert float(files["0"]["state/exp_avg_sq/fc2.bias"].min()) > 0  # really trained state


@pytest.mark.parametrize("stage", STAGES)
def test_meta_carries_counters_groups_scheduler_client_state(imported, stage):
    meta = json.loads((imported[stage] / "meta.json").read_text())
    assert meta["counters"] == {"global_steps": 3, "global_samples": 24, "skipped_steps": 0, "micro_steps": 0}
    assert meta["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    groups = meta["optimizer"]["groups"]
    assert [g["params"] for g in groups] == [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    assert [g["hyperparameters"]["weight_decay"] for g in groups] == [WEIGHT_DECAY, 0.0]
    assert groups[0]["hyperparameters"]["betas"] == {"__tuple__": list(BETAS)}
    assert groups[0]["partition_state"] == ["exp_avg", "exp_avg_sq"]
    assert meta["lr_scheduler"] == {"last_epoch": 3, "_step_count": 4}
    assert meta["client_state"] == {"epoch": 1, "note": "fixture"}
    assert meta["imported_from"]["zero_stage"] == int(stage)
    assert meta["imported_from"]["data_parallel_size"] == (2 if stage != "0" else 1)
    assert meta["loss_scaler"] is None and meta["precision"] == "float32"
    step = load_file(str(imported[stage] / "state.safetensors"))
    assert {float(v) for v in step.values()} == {3.0}  # Adam's step, one per group


# ---------------------------------------------------------------------------- resuming


def _resume(paths: list[str], stages: list[int], micro: int, accumulation: int) -> list[dict]:
    """On every rank: per imported checkpoint, resume partita at ``stages[i]`` and train 2 steps."""
    import partita

    out = []
    rank, world = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0, None
    for path, stage in zip(paths, stages):
        torch.manual_seed(123)  # other weights than DeepSpeed's: the checkpoint must replace them
        model = TinyNet()
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
        config = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
            "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
            "steps_per_print": 1000,
        }
        engine, _, _, _ = partita.initialize(model=model, optimizer=optimizer, config=config)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        _, client_state = engine.load_checkpoint(path)
        record = {"client_state": client_state, "global_steps": [engine.global_steps], "lr": [], "loss": [], "params": []}
        for step in (4, 5):
            data = EXPECTED["data"][str(step)]
            x, y = rank_slice(torch.tensor(data["x"]), rank, world), rank_slice(torch.tensor(data["y"]), rank, world)
            record["lr"].append(engine.get_lr()[0])
            total = torch.zeros(())
            for m in range(accumulation):
                xs, ys = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
                loss = torch.nn.functional.mse_loss(engine(xs), ys)
                engine.backward(loss)
                engine.step()
                total += loss.detach() / accumulation
            torch.distributed.all_reduce(total)
            record["loss"].append(float(total) / world)
            record["global_steps"].append(engine.global_steps)
            with partita.zero.GatheredParameters(list(model.parameters())):
                record["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        out.append(record)
    return out


def _check_resumed(records: list[dict], where: str) -> None:
    for stage, record in zip(STAGES, records):
        want = EXPECTED["stages"][stage]["resumed"]
        assert record["client_state"] == {"epoch": 1, "note": "fixture"}, where
        assert record["global_steps"] == [3, 4, 5], where
        assert record["lr"] == pytest.approx([w["lr"] for w in want], rel=1e-12), (where, stage)
        assert record["loss"] == pytest.approx([w["loss"] for w in want], rel=1e-5), (where, stage)
        for step, (got, expected) in enumerate(zip(record["params"], want), 4):
            for name, values in expected["params"].items():
                err = _rel(got[name].reshape(-1), torch.tensor(values))
                assert err < 1e-5, (where, f"DeepSpeed stage {stage}", f"step {step}", name, err)


def test_resume_on_four_ranks_equals_deepspeeds_resume(imported):
    """DeepSpeed's 2-rank checkpoint, resumed on 4 ranks (micro-batch 2), ZeRO stage 3 - DeepSpeed's."""
    paths = [str(imported[s].parent) for s in STAGES]
    records = run_distributed(_resume, 4, paths, [3, 3, 1, 2], 2, 1, timeout=600)[0]
    _check_resumed(records, "world 4")


def test_resume_on_one_rank_equals_deepspeeds_resume(imported):
    """The same on 1 rank with 2 micro-batches of 4 accumulated, at ZeRO 0 and 3."""
    paths = [str(imported[s].parent) for s in STAGES]
    records = run_distributed(_resume, 1, paths, [0, 3, 3, 0], 4, 2, timeout=600)[0]
    _check_resumed(records, "world 1")
