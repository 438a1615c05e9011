"""Config validation: DeepSpeed defaults, types and ranges, unknown keys with suggestions,
rules across keys (one error listing every mistake), and the offload sections."""

from __future__ import annotations

import json

import pydantic
import pytest

from partita.config import ConfigError, PartitaConfig, load_config
from tests._config_helpers import DEEPSPEED_ZERO2, only_problem, problems_of


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
        "stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance, stage3_generation, "
        "stage3_one_rank_resident, stage3_gather_16bit_weights_on_model_save, zero_quantized_weights, zero_quantized_nontrainable_weights, "
        "zero_quantized_gradients, zero_quantized_gradients_bits, zero_hpz_partition_size, one_rank_free_weights, one_rank_gradient_fold, sub_group_size, offload_optimizer, "
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
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "gather_from_master": True},
                                "offload_optimizer": {"device": "cpu"}}},
         'gather_from_master reads the parameters from the fp32 master in host memory and needs '
         'offload_param.device "cpu" (got "nvme") and offload_optimizer.device "cpu" or "auto" (got "cpu")'),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "gather_from_master": True}}},
         'offload_optimizer.device "cpu" or "auto" (got "none"); set both, or remove gather_from_master'),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "gather_from_master": True},
                                "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}},
         "gather_from_master cannot be combined with offload_optimizer.delayed_param_update"),
    ],
)
def test_bad_offload_settings_are_explained(config: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert expected in str(caught.value)
