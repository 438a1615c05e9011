"""Resharding with ZeRO++ on: a ZeRO-3 checkpoint saved with qwZ + qgZ (and one with hpZ) on 4
ranks resumes on 2 ranks, and one saved on 2 resumes on 4, and training continues as the same
resume without ZeRO++ does.

Three launches (spawning is the cost): 2 ranks train straight and save at step SAVE_AT; 4 ranks
train straight, save, and resume the 2-rank checkpoints; 2 ranks resume the 4-rank checkpoints.
Every rank takes its slice of one fixed global batch, and each step's loss is the global batch's
mean, so losses compare across world sizes. Plain ZeRO-3 resumed at another world size continues
its uninterrupted run up to the reduction order (1% of the first loss, RESUME_TOLERANCE). qwZ + qgZ
round in blocks laid over each rank's shard, so at another world size the rounding differs; the
resumed run still follows its own uninterrupted run within that same bound. hpZ is exact, so its
losses, straight and resumed, are plain ZeRO-3's bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed

WIDTH, HIDDEN, CLASSES, STEPS, SAVE_AT, GLOBAL_BATCH = 32, 64, 10, 6, 2, 8
CASES = {"plain": {}, "zeropp": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
         "hpz": {"zero_hpz_partition_size": 2}}
# Of the first loss. Measured gaps to the uninterrupted run (2026-12-04): plain 0.0004-0.0009 (0.04%),
# qwZ + qgZ 0.0012-0.0026 (0.12%); qwZ + qgZ's own distance from plain ZeRO-3 here is 0.05 by step 5.
RESUME_TOLERANCE = 0.01


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class _Net(nn.Module):
    """Two blocks and a head: each block a ZeRO-3 unit (4,192 elements, every weight sharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float(), y)


def _config(zeropp: dict) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0,  # backward re-gathers: hpZ serves them
                                  **zeropp},
            "steps_per_print": 10**6}


def _train(case: str, steps: range, *, save: str | None = None, load: str | None = None) -> list[float]:
    """The global batch's mean loss at each of ``steps``."""
    import torch.distributed as dist

    import partita

    torch.manual_seed(0)
    model = _Net()
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=_config(CASES[case]))
    if load is not None:
        engine.load_checkpoint(load, tag="t")
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    micro, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    means = []
    for step in steps:
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        means.append(float(total) / dist.get_world_size())
        if save is not None and step == SAVE_AT:
            engine.save_checkpoint(save, tag="t")
    return means


def _straight(root: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])  # the harness's; partita.initialize starts the process group
    return {case: _train(case, range(STEPS), save=f"{root}/{case}_w{world}") for case in CASES}


def _resume(root: str, saved_world: int) -> dict:
    return {case: _train(case, range(SAVE_AT + 1, STEPS), load=f"{root}/{case}_w{saved_world}") for case in CASES}


def _four_ranks(root: str) -> dict:
    return {"straight": _straight(root), "resumed": _resume(root, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("zeropp_reshard"))
    two = run_distributed(_straight, 2, root)[0]
    four = run_distributed(_four_ranks, 4, root)[0]
    two_resumed = run_distributed(_resume, 2, root, 4)[0]
    return {"w2": two, "w4": four["straight"], "w4_from_w2": four["resumed"], "w2_from_w4": two_resumed}


@pytest.mark.parametrize("saved,resumed", [("w4", "w2_from_w4"), ("w2", "w4_from_w2")])
def test_zeropp_checkpoint_resumes_at_another_world_size(runs, saved, resumed) -> None:
    straight, after = runs[saved], runs[resumed]
    first = straight["plain"][0]
    tail = slice(SAVE_AT + 1, STEPS)
    # The resume loaded the trained state: its first loss is the trained run's, not a fresh model's.
    for case in CASES:
        assert after[case][0] < straight[case][0] - 0.1 * first, (case, after[case], straight[case])
    # Without ZeRO++ the resume continues the saved run up to the reduction order of another world
    # size; with qwZ + qgZ, whose blocks are laid over the new shards, it does within the same bound.
    for case in ("plain", "zeropp"):
        gap = max(abs(a - b) for a, b in zip(after[case], straight[case][tail]))
        assert gap <= RESUME_TOLERANCE * first, (case, after[case], straight[case])
    # hpZ is exact: the same losses as plain ZeRO-3, saved and resumed, bit for bit.
    assert straight["hpz"] == straight["plain"]
    assert after["hpz"] == after["plain"]
