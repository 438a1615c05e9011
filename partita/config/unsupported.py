"""DeepSpeed settings that partita does not implement yet, and when they are harmless.

A DeepSpeed config copied into partita may carry keys for features partita lacks
(offload, ZeRO-3 tuning, the Comet monitor, ...). Silently ignoring them
would train something other than what the user asked for, so each one is rejected with
a message that says so. A key set to DeepSpeed's own default has no effect in DeepSpeed
either (``"comet": {"enabled": false}``, ``"offload_optimizer": {"device": "none"}``,
``"round_robin_gradients": false``, or ``"auto"``, which DeepSpeed drops), so it is
accepted: those appear in many shared configs and mean "feature off".

To support one of these keys, add a field to the owning section model and delete its
entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partita.config.base import format_value

_ZERO = ("zero_optimization",)


@dataclass(frozen=True)
class Unsupported:
    """One DeepSpeed key partita lacks.

    ``default`` is DeepSpeed's default. For a section it is a dict of the sub-keys whose
    default values still mean "off"; a section holding only those (or ``{}``/null) is inert.
    ``hint`` says what to do instead, when there is something better than deleting the key.
    ``modern``: the key is DeepSpeed's deprecated spelling of a setting partita has under its
    current name (``modern`` names it); the message says so instead of "not implemented".
    """

    default: Any
    hint: str = ""
    modern: str = ""

    def is_inert(self, value: Any) -> bool:
        """True when the value changes nothing in DeepSpeed (its default, off, or "auto")."""
        if value == "auto" and isinstance(value, str):
            return True
        if isinstance(self.default, dict):
            if value is None:
                return True
            return isinstance(value, Mapping) and all(
                key in self.default and same_value(item, self.default[key]) for key, item in value.items()
            )
        return same_value(value, self.default)

    def harmless_form(self) -> str:
        """The spelling of this key that is accepted, for the error message."""
        if isinstance(self.default, dict):
            return format_value({k: v for k, v in self.default.items() if k in ("enabled", "device")})
        return format_value(self.default)

    def message(self, path: str) -> str:
        if self.modern:
            text = (
                f"'{path}' is DeepSpeed's deprecated spelling of {self.modern}, which partita reads under its current "
                f"name only; write {self.modern} instead (the value {self.harmless_form()} has no effect and is accepted)"
            )
            return f"{text}. {self.hint}" if self.hint else text
        text = (
            f"'{path}' is a DeepSpeed setting partita does not implement yet; remove it "
            f"(the value {self.harmless_form()} has no effect and is accepted)"
        )
        return f"{text}. {self.hint}" if self.hint else text


def same_value(value: Any, default: Any) -> bool:
    """Equality that keeps true apart from 1 (Python says True == 1) and 5e8 equal to 500000000."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(default, Mapping):
        return (
            isinstance(value, Mapping)
            and value.keys() <= default.keys()
            and all(same_value(v, default[k]) for k, v in value.items())
        )
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def _off(**extra: Any) -> dict[str, Any]:
    """A section that is inert when disabled: {"enabled": false} plus the given defaults."""
    return {"enabled": False, **extra}


_MONITOR = 'Use "tensorboard", "wandb" or "csv_monitor" instead: they log the same metrics.'
_DEEPCOMPILE = (
    "It tunes DeepSpeed's DeepCompile (deepcompile: true); partita compiles each repeated block with "
    'torch.compile instead ("compile": {"enabled": true}).'
)

# Keyed by the path of the section that holds the key; () is the top level.
UNSUPPORTED: dict[tuple[str, ...], dict[str, Unsupported]] = {
    (): {
        "comet": Unsupported(_off(), _MONITOR),
        "seq_parallel_communication_data_type": Unsupported("fp32"),
        "amp": Unsupported(_off(), 'Use "bf16": {"enabled": true} or "fp16": {"enabled": true}.'),
        "torch_autocast": Unsupported(_off(), 'Use "bf16": {"enabled": true} or "fp16": {"enabled": true}.'),
        "data_efficiency": Unsupported(_off()),
        "eigenvalue": Unsupported(_off()),
        "compression_training": Unsupported({}),
        "hybrid_engine": Unsupported(_off()),
        "nebula": Unsupported(_off()),
        "moe": Unsupported(_off()),
        "timers": Unsupported({"throughput": {"enabled": True, "synchronized": True}}),
        "zero_allow_untested_optimizer": Unsupported(False),
        "zero_force_ds_cpu_optimizer": Unsupported(True),
        "memory_breakdown": Unsupported(False),
        "dump_state": Unsupported(False),
        "sparse_gradients": Unsupported(False),
        "disable_allgather": Unsupported(False),
        "fp32_allreduce": Unsupported(
            False, 'It means "communication_data_type": "fp32".', modern='"communication_data_type"'
        ),
        "graph_harvesting": Unsupported(False),
        "dataloader_drop_last": Unsupported(False),
    },
    _ZERO: {
        "cpu_offload": Unsupported(False, modern='"offload_optimizer": {"device": "cpu"}'),
        "cpu_offload_params": Unsupported(False, modern='"offload_param": {"device": "cpu"}'),
        "cpu_offload_use_pin_memory": Unsupported(False, modern='"pin_memory" inside "offload_optimizer" / "offload_param"'),
        "stage3_model_persistence_threshold": Unsupported(9_223_372_036_854_775_807),
        "stage3_gather_fp16_weights_on_model_save": Unsupported(False, modern='"stage3_gather_16bit_weights_on_model_save"'),
        "stage3_module_granularity_threshold": Unsupported(0),
        "stage3_use_all_reduce_for_fetch_params": Unsupported(False),
        "zeropp_loco_param": Unsupported(None),
        "round_robin_gradients": Unsupported(False),
        "elastic_checkpoint": Unsupported(False),
        "mics_shard_size": Unsupported(-1),
        "mics_hierarchical_params_gather": Unsupported(False),
        "allgather_partitions": Unsupported(True),
        "load_from_fp32_weights": Unsupported(True),
        "ignore_unused_parameters": Unsupported(True),
        "use_multi_rank_bucket_allreduce": Unsupported(True),
        "legacy_stage1": Unsupported(False),
        "memory_efficient_linear": Unsupported(True),
        "pipeline_loading_checkpoint": Unsupported(False),
        "override_module_apply": Unsupported(True),
        "log_trace_cache_warnings": Unsupported(False),
    },
    ("fp16",): {
        "auto_cast": Unsupported(False),
        "fp16_master_weights_and_grads": Unsupported(False),
    },
    ("compile",): {
        # DeepCompile's knobs (deepspeed/compile/config.py), inert at their defaults.
        **{key: Unsupported(default, _DEEPCOMPILE) for key, default in {
            "free_activation": False, "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
            "offload_opt_states": False, "double_buffer": True, "symmetric_memory": False, "debug_log": False,
            "offload_parameters": False, "sync_before_reduce": False, "sync_after_reduce": False,
            "sync_before_allgather": False, "sync_after_allgather": False, "keep_int_input_tensors": True,
            "keep_all_input_tensors": False, "passes": None,
        }.items()},
    },
    ("flops_profiler",): {
        # Activation-checkpointing recomputation; partita's profiler measures the real backward.
        "recompute_fwd_factor": Unsupported(0.0),
    },
    ("bf16",): {
        "immediate_grad_update": Unsupported(False),
        "check_grad_overflow": Unsupported(True),
        "bf16_master_weights_and_grads": Unsupported(False),
        "bf16_optimizer_states": Unsupported(False),
    },
}

# Whole families of keys, for spellings newer DeepSpeed versions add.
UNSUPPORTED_PREFIXES: dict[tuple[str, ...], tuple[str, ...]] = {
    _ZERO: ("stage3_", "mics_", "zero_quantized_", "cpu_offload"),
}


def lookup(section: tuple[str, ...], key: str) -> Unsupported | None:
    """The table entry for ``key`` inside the section at path ``section``, if any."""
    entry = UNSUPPORTED.get(section, {}).get(key)
    if entry is not None:
        return entry
    if key.startswith(UNSUPPORTED_PREFIXES.get(section, ())):
        # An unlisted key of a family partita lacks: nothing but "auto" or null is harmless.
        return Unsupported(None)
    return None


def unsupported_keys(section: tuple[str, ...]) -> list[str]:
    """The listed DeepSpeed keys of a section, for "did you mean" over unsupported names."""
    return list(UNSUPPORTED.get(section, {}))
