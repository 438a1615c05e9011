"""DeepSpeed configs partita reads: DeepSpeed keys partita lacks are refused unless set to their
no-op default, and "auto" (the Hugging Face Trainer's placeholder) is inferred, defaulted or
listed as unfilled."""

from __future__ import annotations

import pytest

from partita.config import BatchSizes, PartitaConfig, load_config, resolve_batch_sizes
from partita.config.unsupported import UNSUPPORTED
from tests._config_helpers import only_problem, problems_of


# ----------------------------------------------------------------------------- DeepSpeed keys partita lacks


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"comet": {"enabled": True, "project": "p"}}, "comet"),
        ({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 0.5}}, "flops_profiler.recompute_fwd_factor"),
        ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
        ({"memory_breakdown": True}, "memory_breakdown"),
        ({"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": True}},
         "zero_optimization.stage3_use_all_reduce_for_fetch_params"),
        ({"zero_optimization": {"stage3_some_future_knob": 1}}, "zero_optimization.stage3_some_future_knob"),
        ({"zero_optimization": {"zero_quantized_future_knob": True}}, "zero_optimization.zero_quantized_future_knob"),
        ({"zero_optimization": {"round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
        ({"zero_optimization": {"mics_shard_size": 8}}, "zero_optimization.mics_shard_size"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ],
)
def test_unsupported_deepspeed_keys_are_refused(config: dict, path: str) -> None:
    line = only_problem(config)
    assert f": '{path}' is a DeepSpeed setting partita does not implement yet; remove it (the value " in line
    assert line.startswith(f"{path} = ")


def test_unsupported_message_names_the_harmless_value() -> None:
    line = only_problem({"comet": {"enabled": True}})
    assert line.startswith(
        'comet = {"enabled": true}: \'comet\' is a DeepSpeed setting partita does not implement yet; '
        'remove it (the value {"enabled": false} has no effect and is accepted).'
    )
    line = only_problem({"zero_optimization": {"cpu_offload": True}})  # a deprecated spelling names the current one
    assert line == (
        "zero_optimization.cpu_offload = true: 'zero_optimization.cpu_offload' is DeepSpeed's deprecated spelling of "
        '"offload_optimizer": {"device": "cpu"}, which partita reads under its current name only; write '
        '"offload_optimizer": {"device": "cpu"} instead (the value false has no effect and is accepted)'
    )


@pytest.mark.parametrize(
    "config",
    [
        {"tensorboard": {"enabled": False}},
        {"wandb": {}},
        {"comet": None},
        {"prescale_gradients": False},
        {"zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": None}},
        {"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": "auto", "stage3_param_persistence_threshold": 1e5}},
        {"zero_optimization": {"round_robin_gradients": False, "allgather_partitions": True}},
        {"fp16": {"auto_cast": False}},
        {"bf16": {"immediate_grad_update": False}},
    ],
)
def test_deepspeed_keys_set_to_their_no_op_default_are_accepted(config: dict) -> None:
    assert isinstance(load_config(config), PartitaConfig)


def test_a_boolean_is_not_mistaken_for_a_numeric_default() -> None:
    # Python says False == 0; stage3_module_granularity_threshold's no-op value is 0, not false.
    line = only_problem({"zero_optimization": {"stage3_module_granularity_threshold": False}})
    assert "'zero_optimization.stage3_module_granularity_threshold' is a DeepSpeed setting" in line


def test_unsupported_table_holds_the_documented_sections() -> None:
    top = set(UNSUPPORTED[()])
    for key in ("comet", "seq_parallel_communication_data_type",
                "amp",
                "data_efficiency", "compression_training", "moe",
                "zero_allow_untested_optimizer", "memory_breakdown", "dump_state"):  # fmt: skip
        assert key in top, key
    # Nothing partita implements is listed as unsupported.
    assert not top & set(PartitaConfig.model_fields)


# ----------------------------------------------------------------------------- "auto"


def test_auto_batch_sizes_are_inferred() -> None:
    cfg = load_config(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None, 4, None)
    assert resolve_batch_sizes(cfg, dp_world_size=2) == BatchSizes(8, 4, 1)


def test_auto_resolves_to_the_default_where_that_is_safe() -> None:
    cfg = load_config(
        {
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"},
            "fp16": {"enabled": True, "loss_scale": "auto", "hysteresis": "auto"},
        }
    )
    assert cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 500_000_000
    assert (cfg.fp16.loss_scale, cfg.fp16.hysteresis) == (0.0, 2)


def test_auto_precision_cannot_be_guessed() -> None:
    line = only_problem({"fp16": {"enabled": "auto"}})
    assert line == (
        'fp16.enabled = "auto": \'auto\' is a placeholder that the Hugging Face Trainer replaces with its own '
        "arguments; partita has no Trainer to fill it in and no default it can safely assume for this key. "
        "Set a value: true or false (default false)"
    )


def test_auto_where_auto_is_a_real_choice_is_kept() -> None:
    assert load_config({"distributed": {"backend": "auto"}}).distributed.backend == "auto"


def test_hugging_face_trainer_config_lists_every_unfilled_auto() -> None:
    hf = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }  # fmt: skip
    found = problems_of(hf)
    assert sorted(found) == sorted(
        [
            "fp16.enabled",
            "bf16.enabled",
            "optimizer.params.lr",
            "optimizer.params.betas",
            "optimizer.params.eps",
            "optimizer.params.weight_decay",
            "scheduler.params.warmup_min_lr",
            "scheduler.params.warmup_max_lr",
            "scheduler.params.warmup_num_steps",
        ]
    )
    for line in found.values():
        assert "'auto' is a placeholder that the Hugging Face Trainer replaces" in line
        assert "Set a value:" in line
