"""partita.estimate.recommend_config: the documented order of setups tried, and the CPU memory limit."""

from __future__ import annotations

import pytest

from partita.estimate import EstimateError, GPTShape, estimate_memory, recommend_config


# ----------------------------------------------------------------------------- (3) recommendations


def _choice(chosen) -> tuple[int, str, str]:
    """(stage, checkpointing, optimizer offload) of a Recommendation or a Candidate."""
    setup = chosen.setup
    return setup.stage, str(setup.checkpointing), setup.offload_optimizer


def test_recommend_documented_order():
    big = GPTShape.preset("gpt-1.3b")
    assert _choice(recommend_config(big, "80GiB", world_size=8, micro_batch=8)) == (0, "none", "none")
    # 40 GB: no stage fits without checkpointing (activations ~29 GiB + model states); the order
    # tries every stage without checkpointing, then selective from stage 0 up. Selective at stage 1
    # allocates 31.7 GiB and is predicted to reserve 34.4 GiB (allocator fragmentation, fitted to the
    # H200 snapshots of 2026-12-03) against 35.4 GiB usable: it fits, and is chosen.
    tight = recommend_config(big, "40GB", world_size=8, micro_batch=8)
    assert [_choice(c) for c in tight.tried] == [
        (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
        (0, "selective", "none"), (1, "selective", "none"),
    ]
    assert [c.fits for c in tight.tried] == [False] * 5 + [True] and tight.chosen is tight.tried[-1]
    selective = tight.tried[5].estimate
    assert round(selective.peak_accelerator / 2**30, 1) == 31.7
    assert round(selective.reserved_accelerator / 2**30, 1) == 34.4
    assert selective.reserved_accelerator <= tight.usable < tight.tried[3].estimate.reserved_accelerator
    assert "Faster setups tried first" in tight.explanation()
    # One rank cannot shard: a 1.3B model in 16 GB needs the optimizer in CPU memory (the
    # stage only decides whether offload is allowed: 1 is the first that allows it).
    assert _choice(recommend_config(big, "16GB", world_size=1, micro_batch=1)) == (1, "none", "cpu")
    # The headroom: a setup fits when its predicted reserved memory is at most (1 - headroom) x the memory.
    peak = estimate_memory(big, world_size=8, micro_batch=8).reserved_accelerator
    assert _choice(recommend_config(big, peak, world_size=8, micro_batch=8, headroom=0.0)) == (0, "none", "none")
    assert _choice(recommend_config(big, peak, world_size=8, micro_batch=8)) != (0, "none", "none")
    # A 70B-class model on one 80 GB GPU with one rank: nothing fits.
    none = recommend_config(70_000_000_000, "80GB", activation_bytes=10**9)
    assert none.chosen is None and "Nothing fits" in none.explanation()
    with pytest.raises(EstimateError, match="headroom"):
        recommend_config(big, "80GB", headroom=1.5)


def test_recommend_respects_cpu_memory():
    big = GPTShape.preset("gpt-1.3b")
    # With a CPU memory size the offload tier is the tiered "auto" split: as much optimizer state on
    # the GPU as fits, then host memory; no disk given: no NVMe.
    rec = recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="15GB", sub_group_size=10**8)
    assert rec.setup is not None and rec.setup.offload_optimizer == "auto"
    a, c, n = rec.setup.offload_tiers
    assert 0.3 < a < 0.5 and n == 0.0 and rec.chosen.estimate.peak_cpu <= 15 * 10**9
    assert rec.chosen.estimate.reserved_accelerator <= rec.usable
    assert "no NVMe capacity given" in rec.explanation()
    # 10 GB of host memory: without a disk only every-block checkpointing at stage 3 leaves room;
    # with 30 GB of disk the fastest split (no checkpointing) puts ~48% of the state on NVMe.
    tight = recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="10GB", sub_group_size=10**8)
    assert (tight.setup.stage, str(tight.setup.checkpointing), tight.setup.offload_tiers[2]) == (3, "every", 0.0)
    disk = recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="10GB", nvme_memory="30GB",
                            sub_group_size=10**8)
    assert (disk.setup.stage, str(disk.setup.checkpointing)) == (1, "none")
    assert 0.4 < disk.setup.offload_tiers[2] < 0.55 and 0 < disk.chosen.estimate.nvme <= 30 * 10**9
    assert recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="2GB").chosen is None
    with pytest.raises(EstimateError, match="needs cpu_memory"):
        recommend_config(big, "16GB", nvme_memory="30GB")
