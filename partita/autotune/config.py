"""The ``autotuning`` config section: DeepSpeed's keys, read by ``partita tune``.

A training run ignores the section, as DeepSpeed does without ``deepspeed --autotuning``;
``partita tune script.py --config ds.json`` reads it (its flags win). Each key keeps
DeepSpeed's name and default (``deepspeed/autotuning/constants.py``) and means what it means
there, within partita's search space (micro-batch x ZeRO stage x activation checkpointing
x optimizer offload):

- ``enabled``: accepted either way; ``partita tune`` is the switch (DeepSpeed's is
  ``deepspeed --autotuning``, which also needs it true).
- ``fast`` (true): tune ZeRO stages and micro-batch sizes, not ZeRO's communication knobs.
  Only true: ``false`` asks DeepSpeed to also search bucket sizes and ``overlap_comm``,
  which partita does not search.
- ``results_dir`` / ``exps_dir`` / ``overwrite``: where the best config and the CSV go, where
  each trial's config, log and result go, and whether a trial whose result already exists
  is run again (false: its recorded result is reused).
- ``start_profile_step`` / ``end_profile_step`` (3 / 5; DeepSpeed's docs also write
  ``start_step`` / ``end_step``): a trial runs ``end_profile_step`` optimizer steps and
  measures steps ``start_profile_step`` .. ``end_profile_step``.
- ``metric``: ``throughput`` (samples/s, highest wins), ``latency`` (seconds per optimizer
  step, lowest wins) or ``flops`` (achieved TFLOP/s per device; needs the model's FLOPs per
  token, from ``throughput.flops_per_token`` or a model method).
- ``tuner_type``: ``gridsearch`` (in order) or ``random`` (shuffled); ``tuner_num_trials``
  bounds the trials run, ``tuner_early_stopping`` stops after that many trials in a row
  without a better result (counted once a trial has finished: failures before the first
  success do not stop the search).
- ``arg_mappings``: config keys passed to the script as command-line flags as well
  (``{"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}``), for scripts that
  read their batch size from arguments.
- ``num_tuning_micro_batch_sizes``, ``min/max_train_micro_batch_size_per_gpu``,
  ``min/max_train_batch_size``: which micro-batch sizes are tried and which global batches
  are allowed.
- ``mp_size``: only 1 (partita has no model parallelism yet).
- ``model_info`` (``num_params``; ``profile``) / ``model_info_path``: the parameter count the
  memory estimate prunes with; without it the first finished trial's count is used.
  ``hidden_size`` / ``num_layers`` are accepted and unused: partita's activation estimate
  needs a whole GPT shape (``partita tune --gpt-preset``).

``metric_path`` is refused: partita writes each trial's metrics to ``exps_dir/<trial>/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from partita.config.base import JsonInt, StrictSection

# Config keys whose trial value can be handed to the script as a flag (arg_mappings).
MAPPABLE_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "zero_optimization.stage")


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


class ModelInfoConfig(StrictSection):
    """DeepSpeed's ``autotuning.model_info``: what is known of the model before any trial."""

    num_params: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None, description="Trainable parameters; the memory estimate prunes trials with it. Default null."
    )
    hidden_size: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None, description="Accepted, unused (partita's activation estimate needs a whole GPT shape). Default null."
    )
    num_layers: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None, description="Accepted, unused, as hidden_size. Default null."
    )
    profile: bool = Field(
        False,
        description="Measure the parameter count in a trial; partita does that whenever num_params is null. Default false.",
    )


class AutotuningConfig(StrictSection):
    """``partita tune``'s settings, in DeepSpeed's ``autotuning`` spelling (see the module docstring)."""

    key_aliases: ClassVar[Mapping[str, str]] = {"start_step": "start_profile_step", "end_step": "end_profile_step"}

    enabled: bool = Field(False, description="Accepted; `partita tune` runs the tuner. DeepSpeed default false.")
    fast: bool = Field(
        True, description="Tune ZeRO stage and micro-batch (not communication knobs); only true. DeepSpeed default true."
    )
    results_dir: str = Field(
        "autotuning_results", min_length=1,
        description="Where the best config (best_config.json) and trials.csv go. DeepSpeed default \"autotuning_results\".",
    )
    exps_dir: str = Field(
        "autotuning_exps", min_length=1,
        description="One folder per trial: config, log, result. DeepSpeed default \"autotuning_exps\".",
    )
    overwrite: bool = Field(
        True, description="Run a trial again when its result exists (false: reuse it). DeepSpeed default true."
    )
    start_profile_step: JsonInt = Field(3, ge=1, description="First measured optimizer step. DeepSpeed default 3.")
    end_profile_step: JsonInt = Field(5, ge=1, description="Last measured step; trials stop after it. DeepSpeed default 5.")
    metric: Annotated[Literal["throughput", "latency", "flops"], BeforeValidator(_lower)] = Field(
        "throughput", description="What ranks the trials. DeepSpeed default \"throughput\"."
    )
    metric_path: str | None = Field(None, description="Refused: partita keeps each trial's metrics in exps_dir.")
    tuner_type: Literal["gridsearch", "random", "model_based"] = Field(
        "gridsearch", description="Order of the trials; model_based is refused. DeepSpeed default \"gridsearch\"."
    )
    tuner_early_stopping: JsonInt = Field(
        5, ge=1, description="Stop after this many trials in a row without improvement. DeepSpeed default 5."
    )
    tuner_num_trials: JsonInt = Field(50, ge=1, description="At most this many trials run. DeepSpeed default 50.")
    arg_mappings: dict[str, str] | None = Field(
        None, description="Config keys also passed to the script as flags: {key: \"--flag\"}. DeepSpeed default null."
    )
    num_tuning_micro_batch_sizes: JsonInt = Field(
        3, ge=1, description="How many micro-batch sizes are tried. DeepSpeed default 3."
    )
    max_train_batch_size: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None, description="Largest global batch a trial may use. DeepSpeed default null (no bound)."
    )
    min_train_batch_size: JsonInt = Field(1, ge=1, description="Smallest global batch. DeepSpeed default 1.")
    max_train_micro_batch_size_per_gpu: JsonInt = Field(
        1024, ge=1, description="Largest micro-batch tried. DeepSpeed default 1024."
    )
    min_train_micro_batch_size_per_gpu: JsonInt = Field(1, ge=1, description="Smallest micro-batch tried. DeepSpeed default 1.")
    mp_size: JsonInt = Field(1, ge=1, description="Model-parallel size; only 1. DeepSpeed default 1.")
    model_info: ModelInfoConfig | None = Field(None, description="What is known of the model. DeepSpeed default null.")
    model_info_path: str | None = Field(
        None, description="A JSON file holding model_info ({\"num_params\": N}). DeepSpeed default null."
    )

    @model_validator(mode="after")
    def _refuse_what_partita_does_not_do(self) -> AutotuningConfig:
        if not self.fast:
            raise ValueError(
                "fast: false asks DeepSpeed to also search ZeRO's communication knobs (reduce/allgather bucket sizes, "
                "overlap_comm, contiguous_gradients), which partita does not search; set \"fast\": true (or remove it) "
                "to tune micro-batch x ZeRO stage x activation checkpointing x offload"
            )
        if self.metric_path is not None:
            raise ValueError(
                "metric_path is where DeepSpeed's engine writes a trial's metrics for its tuner; partita writes them "
                "to exps_dir/<trial>/result.json itself: remove metric_path"
            )
        if self.tuner_type == "model_based":
            raise ValueError(
                "tuner_type \"model_based\" (DeepSpeed's XGBoost cost model) is not implemented in partita; use "
                "\"gridsearch\" or \"random\" with tuner_num_trials / tuner_early_stopping"
            )
        if self.mp_size != 1:
            raise ValueError(
                f"mp_size {self.mp_size}: partita has no model (tensor) parallelism to tune yet; set \"mp_size\": 1"
            )
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(
                f"end_profile_step {self.end_profile_step} is before start_profile_step {self.start_profile_step}; "
                "a trial measures the steps between them"
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(
                f"min_train_micro_batch_size_per_gpu {self.min_train_micro_batch_size_per_gpu} exceeds "
                f"max_train_micro_batch_size_per_gpu {self.max_train_micro_batch_size_per_gpu}"
            )
        if self.max_train_batch_size is not None and self.min_train_batch_size > self.max_train_batch_size:
            raise ValueError(
                f"min_train_batch_size {self.min_train_batch_size} exceeds max_train_batch_size {self.max_train_batch_size}"
            )
        for key, flag in (self.arg_mappings or {}).items():
            if key not in MAPPABLE_KEYS:
                raise ValueError(
                    f"arg_mappings key {key!r} is not one partita tunes; the keys are {', '.join(MAPPABLE_KEYS)}"
                )
            if not flag.strip():
                raise ValueError(f"arg_mappings[{key!r}] is empty; give the script's flag, e.g. \"--batch_size\"")
        return self
