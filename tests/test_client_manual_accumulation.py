"""Client-driven gradient accumulation: ``engine.set_gradient_accumulation_boundary`` (Accelerate's
DeepSpeed wrapper calls it before every backward) and ``engine.no_sync()``, against DeepSpeed 0.19.8.

tests/client_scripts/manual_accumulation_ds_style.py runs the three loops on 2 gloo ranks. The
pinned values below are DeepSpeed's, from the same script (only the import differs):

    CLIENT_BACKEND=deepspeed DS_ACCELERATOR=cpu .bench-venv/bin/torchrun --nproc_per_node 2 \\
        tests/client_scripts/manual_accumulation_ds_style.py --out ds.json

DeepSpeed gave the same values at every ZeRO stage it allows (boundary: 0, 1, 2; no_sync: 0, 1),
so one row per loop. Parameters are the first 4 values of each tensor after 12 micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

# DeepSpeed 0.19.8's per-micro-batch losses (rank 0) and final parameters (see the module docstring).
DS = {
    "boundary": {
        "losses": [1.83776, 0.645144, 0.330645, 2.350494, 1.811367, 1.12401, 0.228145, 0.701773, 0.710318,
                   0.964346, 0.675, 0.721434],
        "params": [[-0.298606, -0.2097547, -0.3111708, -0.2463367], [-0.1940523, 0.2299144, 0.3254468, -0.3116305],
                   [0.0095486, 0.1538298, 0.1360615, -0.1837521], [-0.3780394, -0.1553825, -0.2771878]],
        "global_steps": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3],
        "micro_steps": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3],
    },
    "no_sync_ddp": {
        "losses": [1.83776, 0.645144, 0.330645, 2.350494, 1.811367, 1.12401, 0.228145, 0.701773, 0.710828,
                   0.964525, 0.676354, 0.723522],
        "params": [[-0.2945182, -0.2165829, -0.3102967, -0.2444425], [-0.195351, 0.2306144, 0.3276025, -0.3136933],
                   [0.0085937, 0.1526541, 0.1334639, -0.1812604], [-0.3710915, -0.1561384, -0.280312]],
        "global_steps": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3],
        "micro_steps": [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3],
    },
    "no_sync_every": {
        "losses": [1.83776, 0.645144, 0.370951, 2.578015, 1.729708, 1.254202, 0.204309, 0.714521, 0.670983,
                   1.014978, 0.653884, 0.630686],
        "params": [[-0.1566919, -0.3289902, -0.2508235, -0.1745556], [-0.1328079, 0.1699539, 0.2541353, -0.2972482],
                   [0.1149645, 0.0556087, 0.0082792, -0.2279312], [-0.3345128, -0.0346061, -0.294859]],
        "global_steps": [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6],
        "micro_steps": list(range(1, 13)),
    },
}


def _script_and_misuse() -> dict:
    from tests.client_scripts.manual_accumulation_ds_style import make_engine, micro_batches, main

    result = main([])
    # partita refuses what DeepSpeed silently allows: a step whose window was never reduced
    # (DeepSpeed's ranks would each apply their own gradients and drift apart).
    engine = make_engine("no_sync_ddp", 1)
    x, y = next(micro_batches(torch.distributed.get_rank(), 1))
    with engine.no_sync():
        engine.backward(nn.functional.mse_loss(engine(x), y))
    try:
        engine.step()
        result["unreduced_step"] = "none"
    except RuntimeError as error:
        result["unreduced_step"] = str(error)
    engine = make_engine("boundary", 0)
    for boundary in (True, False):
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.set_gradient_accumulation_boundary(True)
    try:
        engine.step()
        result["boundary_after_backward"] = "none"
    except RuntimeError as error:
        result["boundary_after_backward"] = str(error)
    with pytest.raises(TypeError, match=r"takes True or False, got 1"):
        engine.set_gradient_accumulation_boundary(1)
    return result


def test_manual_accumulation_loops_match_deepspeed_on_two_ranks() -> None:
    results = run_distributed(_script_and_misuse, 2, timeout=300)
    assert len(results) == 2
    first = results[0]
    for name, expected in DS.items():
        stages = (0, 1, 2) if name == "boundary" else (0, 1)
        for stage in stages:
            run = first[f"{name}/{stage}"]
            # Same Adam math; the two libraries' Adam kernels differ in fp32 rounding only.
            assert run["losses"] == pytest.approx(expected["losses"], abs=2e-6), (name, stage)
            for ours, theirs in zip(run["params"], expected["params"], strict=True):
                assert ours == pytest.approx(theirs, abs=2e-6), (name, stage)
            assert run["global_steps"] == expected["global_steps"], (name, stage)
            assert run["micro_steps"] == expected["micro_steps"], (name, stage)
            assert results[1][f"{name}/{stage}"]["params"] == run["params"]  # the ranks agree bit for bit
    assert first["boundary/0"]["boundary"] == [(i + 1) % 4 == 0 for i in range(12)]
    # global_samples counts the samples trained on: DeepSpeed adds train_batch_size (4) per step
    # in the DDP-style loop although each step trained on 4 micro-batches of 2 per rank.
    assert first["no_sync_ddp/0"]["samples"][3::4] == [16, 32, 48]
    assert first["boundary/1"]["samples"][3::4] == [16, 32, 48]
    refusals = first["refusals"]
    assert refusals["zero2"].startswith("ValueError: engine.no_sync() cannot be used at ZeRO stage 2")
    assert refusals["reentry"] == (
        "RuntimeError: engine.no_sync() was entered again inside engine.no_sync(); it does not nest")
    assert refusals["step_inside"].startswith("RuntimeError: engine.step() was called inside engine.no_sync()")
    for key in ("unreduced_step", "boundary_after_backward"):
        assert first[key].startswith("engine.step() at the accumulation boundary, but the last backward did not "
                                     "reduce the gradients across ranks"), key
