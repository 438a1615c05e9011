"""Config loading: DeepSpeed defaults, one error listing every mistake, "auto", batch inference."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from partita.config import BatchSizes, ConfigError, PartitaConfig, load_config, resolve_batch_sizes
from partita.config.batch import infer_batch_sizes
from partita.config.unsupported import UNSUPPORTED


def problems_of(config: object) -> dict[str, str]:
    """{key path: rendered line} of the ConfigError that ``config`` must raise."""
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    return {p.path: p.render() for p in caught.value.problems}


def only_problem(config: object) -> str:
    found = problems_of(config)
    assert len(found) == 1, found
    return next(iter(found.values()))


# ----------------------------------------------------------------------------- valid configs


def test_empty_config_has_deepspeed_defaults() -> None:
    cfg = load_config({})
    assert cfg.train_batch_size is None
    assert cfg.train_micro_batch_size_per_gpu is None
    assert cfg.gradient_accumulation_steps is None
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print == 10
    assert cfg.wall_clock_breakdown is False
    assert cfg.seed is None
    assert cfg.precision == "fp32"
    zero = cfg.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.contiguous_gradients, zero.reduce_scatter) == (0, None, True, True)
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power) == (False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (
        1000,
        2,
        False,
        1.0,
    )
    assert cfg.bf16.enabled is False
    assert (cfg.distributed.backend, cfg.distributed.timeout_seconds) == ("auto", 1800.0)


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


def test_typical_deepspeed_zero2_config_loads() -> None:
    cfg = load_config(DEEPSPEED_ZERO2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 2)
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(cfg.zero_optimization.allgather_bucket_size, int)
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.fp16.initial_scale_power == 12 and cfg.fp16.loss_scale_window == 500
    assert cfg.precision == "fp16"
    assert cfg.gradient_clipping == 0.5 and cfg.steps_per_print == 100
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params.lr == 3e-4
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"


def test_precision_property_and_bfloat16_alias() -> None:
    assert load_config({"bf16": {"enabled": True}}).precision == "bf16"
    assert load_config({"bfloat16": {"enabled": True}}).precision == "bf16"
    assert load_config({"fp16": {"enabled": True}}).precision == "fp16"
    assert load_config({"fp16": {"enabled": False}, "bf16": {"enabled": False}}).precision == "fp32"


def test_to_dict_keeps_the_raw_config_as_given() -> None:
    raw = {"train_batch_size": "auto", "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
    cfg = load_config(raw)
    assert cfg.to_dict() == raw
    copy = cfg.to_dict()
    copy["zero_optimization"]["stage"] = 2
    raw["train_batch_size"] = 3
    assert cfg.to_dict() == {"train_batch_size": "auto", "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}


def test_loaded_config_is_frozen_and_reloading_returns_it() -> None:
    cfg = load_config({"steps_per_print": 5})
    with pytest.raises(pydantic.ValidationError):
        cfg.steps_per_print = 7  # type: ignore[misc]
    assert load_config(cfg) is cfg


# ----------------------------------------------------------------------------- numbers and types


def test_int_fields_accept_integral_floats_from_json() -> None:
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 1e9}, "steps_per_print": 1e2})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int
    assert cfg.zero_optimization.allgather_bucket_size == 1_000_000_000
    assert cfg.steps_per_print == 100 and type(cfg.steps_per_print) is int


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("zero_optimization", "reduce_bucket_size", 5.5, "wrong type: got a number with a fraction; allowed: an integer > 0 (default 500000000)"),
        ("zero_optimization", "reduce_bucket_size", "5", 'wrong type: got a string; allowed: an integer > 0 (default 500000000)'),
        ("zero_optimization", "stage", True, "wrong type: got a boolean; allowed: an integer (default 0)"),
        ("fp16", "enabled", "true", "wrong type: got a string; allowed: true or false (default false)"),
        ("zero_optimization", "overlap_comm", 1, "wrong type: got an integer; allowed: null or true or false (default null)"),
    ],
)
def test_no_silent_type_coercion(section: str, key: str, value: object, expected: str) -> None:
    line = only_problem({section: {key: value}})
    assert line == f"{section}.{key} = {json.dumps(value)}: {expected}"


def test_top_level_wrong_types() -> None:
    found = problems_of({"wall_clock_breakdown": "true", "gradient_clipping": "1.0", "fp16": True})
    assert found["wall_clock_breakdown"] == 'wall_clock_breakdown = "true": wrong type: got a string; allowed: true or false (default false)'
    assert found["gradient_clipping"].startswith('gradient_clipping = "1.0": wrong type: got a string; allowed: a number >= 0')
    assert found["fp16"].startswith("fp16 = true: wrong type: got a boolean; allowed: an object with keys 'enabled', 'loss_scale'")


@pytest.mark.parametrize(
    ("config", "path", "value", "allowed"),
    [
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", "-1", "an integer > 0 (default 500000000)"),
        ({"zero_optimization": {"allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size", "0", "an integer > 0 (default 500000000)"),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis", "0", "an integer >= 1 (default 2)"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window", "0", "an integer >= 1 (default 1000)"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", "0", "a number > 0 (default 1.0)"),
        ({"fp16": {"loss_scale": -2.0}}, "fp16.loss_scale", "-2.0", "a number >= 0 and <= 1099511627776.0 (default 0.0)"),
        ({"fp16": {"initial_scale_power": -1}}, "fp16.initial_scale_power", "-1", "an integer >= 0 and <= 40 (default 16)"),
        ({"steps_per_print": 0}, "steps_per_print", "0", "an integer >= 1 (default 10)"),
        ({"gradient_clipping": -0.5}, "gradient_clipping", "-0.5", "a number >= 0 (default 1.0)"),
        ({"train_batch_size": 0}, "train_batch_size", "0", "null or an integer >= 1 (default null)"),
        ({"gradient_accumulation_steps": -4}, "gradient_accumulation_steps", "-4", "null or an integer >= 1 (default null)"),
        ({"seed": -1}, "seed", "-1", "null or an integer >= 0 (default null)"),
        ({"distributed": {"timeout_seconds": 0}}, "distributed.timeout_seconds", "0", "a number > 0 (default 1800.0)"),
    ],
)
def test_out_of_range_values(config: dict, path: str, value: str, allowed: str) -> None:
    assert only_problem(config) == f"{path} = {value}: out of range; allowed: {allowed}"


def test_choice_fields_list_the_choices() -> None:
    line = only_problem({"distributed": {"backend": "mpi"}})
    assert line == 'distributed.backend = "mpi": not one of the choices; allowed: one of "auto", "nccl", "gloo" (default "auto")'


def test_nan_is_refused() -> None:
    line = only_problem({"gradient_clipping": float("nan")})
    assert line.startswith("gradient_clipping = NaN: out of range; allowed: a number >= 0")


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key_suggests_the_close_one() -> None:
    line = only_problem({"zero_optimisation": {"stage": 1}})
    assert line.startswith("zero_optimisation = {\"stage\": 1}: unknown key at the top level; did you mean 'zero_optimization'? Valid keys: train_batch_size, ")


def test_unknown_nested_key_suggests_and_lists_valid_keys() -> None:
    line = only_problem({"zero_optimization": {"reduce_bucket_sise": 5e8}})
    assert line == (
        "zero_optimization.reduce_bucket_sise = 500000000.0: unknown key in 'zero_optimization'; did you mean "
        "'reduce_bucket_size', 'stage3_prefetch_bucket_size' or 'allgather_bucket_size'? Valid keys: stage, overlap_comm, contiguous_gradients, "
        "reduce_bucket_size, allgather_bucket_size, reduce_scatter, stage3_param_persistence_threshold, "
        "stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance, "
        "stage3_gather_16bit_weights_on_model_save, one_rank_free_weights, sub_group_size, offload_optimizer, "
        "offload_param"
    )


def test_unknown_key_without_a_close_match_lists_valid_keys() -> None:
    line = only_problem({"fp16": {"zzz": 1}})
    assert line == (
        "fp16.zzz = 1: unknown key in 'fp16'. Valid keys: enabled, loss_scale, initial_scale_power, "
        "loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale"
    )


def test_typo_of_an_unsupported_key_says_so() -> None:
    line = only_problem({"cmet": {"enabled": True}})
    assert "did you mean 'comet' (a DeepSpeed setting partita does not implement yet)?" in line


def test_typo_of_a_monitor_section_suggests_it() -> None:
    line = only_problem({"tensorbord": {"enabled": True}})
    assert line.startswith("tensorbord = {\"enabled\": true}: unknown key at the top level; did you mean 'tensorboard'?")


def test_unknown_key_inside_optimizer_params_is_reported_with_its_path() -> None:
    found = problems_of({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}}})
    assert list(found) == ["optimizer.params.weight_decy"]
    assert found["optimizer.params.weight_decy"].startswith("optimizer.params.weight_decy = 0.1: unknown key in 'optimizer.params'")


def test_max_grad_norm_in_optimizer_params_points_to_gradient_clipping() -> None:
    line = only_problem({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "max_grad_norm": 1.0}}})
    assert line == (
        "optimizer.params.max_grad_norm = 1.0: max_grad_norm is not an optimizer parameter: remove it and set the "
        'top-level "gradient_clipping" key instead (0 disables clipping)'
    )


def test_a_short_list_is_reported_once_at_its_own_path() -> None:
    line = only_problem({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})
    assert line == (
        "optimizer.params.betas = [0.9]: too few items (1 item); allowed: a list of 2 items, each a number "
        ">= 0.0 and < 1.0 (default [0.9, 0.999])"
    )
    assert only_problem({"optimizer": {"type": "AdamW", "params": {"betas": []}}}).startswith(
        "optimizer.params.betas = []: too few items (0 items); allowed: a list of 2 items"
    )


def test_params_of_the_wrong_type_say_an_object_is_needed() -> None:
    line = only_problem({"optimizer": {"type": "AdamW", "params": [1]}})
    assert line == "optimizer.params = [1]: wrong type: got a list; allowed: an object (default {})"


def test_alias_and_name_together_is_an_error() -> None:
    line = only_problem({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert line == "bfloat16 = {\"enabled\": true}: 'bfloat16' is DeepSpeed's other name for 'bf16', which is also given; keep one"


# ----------------------------------------------------------------------------- rules across keys


def test_fp16_and_bf16_both_enabled() -> None:
    line = only_problem({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert line.startswith("fp16.enabled, bf16.enabled: fp16 and bf16 are both enabled")
    assert "Set bf16.enabled to false to train in fp16, or fp16.enabled to false to train in bf16" in line


def test_direct_construction_also_refuses_two_precisions() -> None:
    with pytest.raises(pydantic.ValidationError, match="fp16 and bf16 are both enabled"):
        PartitaConfig(fp16={"enabled": True}, bf16={"enabled": True})


def test_zero_stage_3_and_its_persistence_threshold_load() -> None:
    cfg = load_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4,
                                             "stage3_gather_16bit_weights_on_model_save": True}})  # as HF writes
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 10_000
    assert load_config({}).zero_optimization.stage3_param_persistence_threshold == 100_000


def test_zero_stage3_max_reuse_distance_loads_with_deepspeeds_default() -> None:
    assert load_config({}).zero_optimization.stage3_max_reuse_distance == 1_000_000_000
    zero = load_config({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e8}}).zero_optimization
    assert zero.stage3_max_reuse_distance == 100_000_000
    auto = load_config({"zero_optimization": {"stage3_max_reuse_distance": "auto"}}).zero_optimization
    assert auto.stage3_max_reuse_distance == 1_000_000_000
    assert load_config({"zero_optimization": {"stage3_max_reuse_distance": 0}}).zero_optimization.stage3_max_reuse_distance == 0
    assert only_problem({"zero_optimization": {"stage3_max_reuse_distance": -1}}).startswith(
        "zero_optimization.stage3_max_reuse_distance = -1: "
    )


def test_zero_stage_out_of_range() -> None:
    line = only_problem({"zero_optimization": {"stage": 4}})
    assert line == "zero_optimization.stage = 4: ZeRO stage must be 0, 1, 2 or 3"


def test_every_problem_is_listed_in_one_error() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            {
                "train_batch_size": -1,
                "fp16": {"enabled": True, "hysteresis": 0},
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 5, "reduce_bucket_size": -5, "typo": 1},
                "comet": {"enabled": True},
                "steps_per_print": 0,
            }
        )
    error = caught.value
    assert isinstance(error, ValueError)
    paths = [p.path for p in error.problems]
    # Ordered as the sections appear in the config.
    assert paths == [
        "train_batch_size",
        "fp16.enabled, bf16.enabled",
        "fp16.hysteresis",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage",
        "zero_optimization.typo",
        "comet",
        "steps_per_print",
    ]
    text = str(error)
    assert text.startswith("Invalid partita config (8 problems):\n  - train_batch_size = -1: out of range")
    assert text.count("\n  - ") == 8


# ----------------------------------------------------------------------------- DeepSpeed keys partita lacks


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"comet": {"enabled": True, "project": "p"}}, "comet"),
        ({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 0.5}}, "flops_profiler.recompute_fwd_factor"),
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
        ({"memory_breakdown": True}, "memory_breakdown"),
        ({"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": True}},
         "zero_optimization.stage3_use_all_reduce_for_fetch_params"),
        ({"zero_optimization": {"stage3_some_future_knob": 1}}, "zero_optimization.stage3_some_future_knob"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
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
    # Python says True == 1; zero_hpz_partition_size's no-op value is 1, not true.
    line = only_problem({"zero_optimization": {"zero_hpz_partition_size": True}})
    assert "'zero_optimization.zero_hpz_partition_size' is a DeepSpeed setting" in line


def test_unsupported_table_holds_the_documented_sections() -> None:
    top = set(UNSUPPORTED[()])
    for key in ("comet", "seq_parallel_communication_data_type",
                "prescale_gradients", "amp",
                "data_efficiency", "compression_training", "moe",
                "zero_allow_untested_optimizer", "memory_breakdown", "dump_state", "prescale_gradients"):  # fmt: skip
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


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("train", "micro", "gas", "ranks", "expected"),
    [
        (32, 4, None, 4, (32, 4, 2)),  # train + micro -> gas
        (32, None, 2, 4, (32, 4, 2)),  # train + gas -> micro
        (None, 4, 2, 4, (32, 4, 2)),  # micro + gas -> train
        (32, None, None, 4, (32, 8, 1)),  # only train -> gas 1
        (None, 4, None, 4, (16, 4, 1)),  # only micro -> gas 1
        (32, 4, 2, 4, (32, 4, 2)),  # all three agree
        (6, None, None, 1, (6, 6, 1)),  # one process
    ],
)
def test_batch_inference_table(train: int | None, micro: int | None, gas: int | None, ranks: int, expected: tuple) -> None:
    cfg = load_config(
        {
            k: v
            for k, v in {
                "train_batch_size": train,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas,
            }.items()
            if v is not None
        }
    )
    assert resolve_batch_sizes(cfg, dp_world_size=ranks) == BatchSizes(*expected)


def test_no_batch_size_given() -> None:
    with pytest.raises(ConfigError, match=r"^no batch size in the config: set train_batch_size .* or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(load_config({}), dp_world_size=2)
    with pytest.raises(ConfigError, match=r"^no batch size in the config \(only gradient_accumulation_steps = 4 is given\)"):
        resolve_batch_sizes(load_config({"gradient_accumulation_steps": 4}), dp_world_size=2)


def test_train_batch_not_divisible_by_world_size() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=10, micro=None, gas=None, ranks=4)
    assert str(caught.value) == (
        "train_batch_size = 10 cannot be split evenly over 4 data-parallel ranks (every rank must get the same "
        "number of samples); use a multiple of 4, e.g. 8 or 12, or run on a number of ranks that divides 10"
    )


def test_mismatched_triple_shows_all_numbers_and_consistent_fixes() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=32, micro=2, gas=2, ranks=4)
    assert str(caught.value) == (
        "batch sizes disagree: train_batch_size = 32, but train_micro_batch_size_per_gpu (2) x "
        "gradient_accumulation_steps (2) x 4 data-parallel ranks = 16. set train_batch_size to 16, or "
        "gradient_accumulation_steps to 4, or train_micro_batch_size_per_gpu to 4; or remove one of the three "
        "keys and partita infers it"
    )
    # Each suggested fix does make the triple agree.
    for train, micro, gas in ((16, 2, 2), (32, 2, 4), (32, 4, 2)):
        assert infer_batch_sizes(train=train, micro=micro, gas=gas, ranks=4) == BatchSizes(train, micro, gas)


def test_train_not_a_multiple_of_micro_times_ranks() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=12, micro=2, gas=None, ranks=4)
    assert str(caught.value) == (
        "train_batch_size = 12 is not a multiple of train_micro_batch_size_per_gpu (2) x 4 data-parallel ranks = 8, "
        "so gradient_accumulation_steps (12 / 8) is not a whole number. With 4 data-parallel ranks and micro-batch "
        "2, set train_batch_size to 8 or 16; or keep train_batch_size = 12 and set train_micro_batch_size_per_gpu "
        "to 1 or 3"
    )
    for train, micro in ((8, 2), (16, 2), (12, 1), (12, 3)):
        assert infer_batch_sizes(train=train, micro=micro, gas=None, ranks=4).train_batch_size == train


def test_train_not_a_multiple_of_gas_times_ranks() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=12, micro=None, gas=4, ranks=2)
    assert str(caught.value) == (
        "train_batch_size = 12 is not a multiple of gradient_accumulation_steps (4) x 2 data-parallel ranks = 8, "
        "so train_micro_batch_size_per_gpu (12 / 8) is not a whole number. With 2 data-parallel ranks and 4 "
        "accumulation steps, set train_batch_size to 8 or 16; or keep train_batch_size = 12 and set "
        "gradient_accumulation_steps to 2, 3 or 6"
    )


def test_train_smaller_than_one_micro_batch_per_rank() -> None:
    with pytest.raises(ConfigError, match=r"set train_batch_size to 16;"):
        infer_batch_sizes(train=8, micro=4, gas=None, ranks=4)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="dp_world_size must be an integer >= 1, got 0"):
        resolve_batch_sizes(load_config({"train_batch_size": 8}), dp_world_size=0)


# ----------------------------------------------------------------------------- files and inputs


def test_load_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED_ZERO2))
    for given in (path, str(path)):
        cfg = load_config(given)
        assert cfg.zero_optimization.stage == 2
        assert cfg.to_dict() == DEEPSPEED_ZERO2


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 7}}')
    with pytest.raises(ConfigError, match=r"^Invalid partita config in .*bad\.json \(1 problem\):"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"^config file not found: .*nope\.json"):
        load_config(path)


def test_not_a_json_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not a \.json file; pass the path of a JSON file"):
        load_config(str(tmp_path / "ds.yaml"))
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(folder)


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"invalid JSON in {path} at line 3 column 28: Expecting property name enclosed in double quotes")
    assert '"fp16": {"enabled": true,}' in message


def test_duplicate_keys_in_json(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match=r"duplicate keys in .*dup\.json: 'train_batch_size' appears more than once"):
        load_config(path)


def test_json_file_must_hold_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object \{\.\.\.\}, got a list"):
        load_config(path)


def test_json_nan_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    path.write_text('{"gradient_clipping": NaN}')
    with pytest.raises(ConfigError, match="NaN is not valid JSON"):
        load_config(path)


@pytest.mark.parametrize(("value", "name"), [([1], "list"), (3, "int"), (None, "NoneType"), (b"{}", "bytes")])
def test_other_config_types_are_refused(value: object, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config must be a dict or the path of a \.json file .*, got {name}"):
        load_config(value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- offload


def test_offload_sections_load_with_deepspeed_defaults() -> None:
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 1e8,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "pin_memory": True, "ratio": 0.5},
                "offload_param": {"device": "cpu"},
            },
            "aio": {"block_size": 262144, "thread_count": 2},
        }
    )
    zero = cfg.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.ratio, zero.offload_optimizer.buffer_count) == ("nvme", 0.5, 4)
    assert zero.offload_optimizer.delayed_param_update is False
    assert (zero.offload_param.device, zero.offload_param.buffer_count, zero.offload_param.buffer_size) == ("cpu", 5, 100_000_000)
    assert zero.sub_group_size == 100_000_000
    assert (cfg.aio.block_size, cfg.aio.intra_op_parallelism, cfg.aio.queue_depth) == (262144, 2, 8)
    assert load_config({"zero_optimization": {"offload_param": None}}).zero_optimization.offload_param.enabled is False


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer needs ZeRO stage 1, 2 or 3"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs ZeRO stage 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}}, "offload_optimizer.device"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}}, "ratio"),
        ({"aio": {"block_size": 1000}}, "aio.block_size must be a multiple of 4096"),
        ({"aio": {"use_gds": True}}, "GPUDirect Storage is not available"),
    ],
)
def test_bad_offload_settings_are_explained(config: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert expected in str(caught.value)
