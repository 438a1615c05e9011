"""What several tests/test_config_*.py files share: the problems a refused config reports, and
a typical DeepSpeed ZeRO-2 config."""

from __future__ import annotations

import pytest

from partita.config import ConfigError, load_config


def problems_of(config: object) -> dict[str, str]:
    """{key path: rendered line} of the ConfigError that ``config`` must raise."""
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    return {p.path: p.render() for p in caught.value.problems}


def only_problem(config: object) -> str:
    found = problems_of(config)
    assert len(found) == 1, found
    return next(iter(found.values()))



DEEPSPEED_ZERO2 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 100,
    "gradient_clipping": 0.5,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "none"},
        "round_robin_gradients": False,
    },
    "tensorboard": {"enabled": False},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
}
