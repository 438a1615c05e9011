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
    # tries every stage without checkpointing, then selective from stage 0 up.
    tight = recommend_config(big, "40GB", world_size=8, micro_batch=8)
    assert [_choice(c) for c in tight.tried] == [
        (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
        (0, "selective", "none"), (1, "selective", "none"),
    ]
    assert [c.fits for c in tight.tried] == [False] * 5 + [True] and tight.chosen is tight.tried[-1]
    assert "Faster setups tried first" in tight.explanation()
    # One rank cannot shard: a 1.3B model in 16 GB needs the optimizer in CPU memory (the
    # stage only decides whether offload is allowed: 1 is the first that allows it).
    assert _choice(recommend_config(big, "16GB", world_size=1, micro_batch=1)) == (1, "none", "cpu")
    # The headroom: a setup fits when its peak is at most (1 - headroom) x the memory.
    peak = estimate_memory(big, world_size=8, micro_batch=8).peak_accelerator
    assert _choice(recommend_config(big, peak, world_size=8, micro_batch=8, headroom=0.0)) == (0, "none", "none")
    assert _choice(recommend_config(big, peak, world_size=8, micro_batch=8)) != (0, "none", "none")
    # A 70B-class model on one 80 GB GPU with one rank: nothing fits.
    none = recommend_config(70_000_000_000, "80GB", activation_bytes=10**9)
    assert none.chosen is None and "Nothing fits" in none.explanation()
    with pytest.raises(EstimateError, match="headroom"):
        recommend_config(big, "80GB", headroom=1.5)


def test_recommend_respects_cpu_memory():
    big = GPTShape.preset("gpt-1.3b")
    # CPU offload needs ~21 GiB of host memory per rank here (master, gradients, Adam states);
    # NVMe moves Adam's states to disk (partita keeps master and gradients in memory, ~9.8 GiB)
    # and adds 4 state buffers of 1e8 fp32 elements.
    rec = recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="15GB", sub_group_size=10**8)
    assert rec.setup is not None and rec.setup.offload_optimizer == "nvme"
    assert [c.setup.offload_optimizer for c in rec.tried if not c.fits and c.setup.offload_optimizer == "cpu"]
    assert recommend_config(big, "16GB", world_size=1, micro_batch=1, cpu_memory="10GB").chosen is None
