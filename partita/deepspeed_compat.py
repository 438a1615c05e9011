"""DeepSpeed names partita deliberately lacks, and the error that names each one.

With ``import partita as deepspeed`` a script may reach for a DeepSpeed call partita does not
have (``deepspeed.module_inject``, ``engine.train_batch()``, ...). A bare AttributeError
("module 'partita' has no attribute 'module_inject'", or worse, the engine's fall-through
"'Net' object has no attribute 'no_sync'") says nothing about why. Each name here raises
:class:`MissingDeepSpeedFeature` with the DeepSpeed name and what to use instead.

:class:`MissingDeepSpeedFeature` is both a NotImplementedError (what it means) and an
AttributeError (what attribute lookup promises), so ``hasattr(partita, "module_inject")``
is still False and ``getattr(obj, name, default)`` still returns the default.
"""

from __future__ import annotations

from typing import NoReturn


class MissingDeepSpeedFeature(NotImplementedError, AttributeError):
    """A DeepSpeed API that partita does not implement; the message says what to use instead."""


_INFERENCE = (
    "DeepSpeed's injected inference kernels are not part of partita: partita.init_inference(model, ...) runs the "
    "model's own modules (split by AutoTP with tensor_parallel.tp_size, compiled with enable_cuda_graph=True)"
)
_PIPE = (
    "pipeline parallelism (deepspeed.pipe: PipelineModule, LayerSpec, PipelineEngine.train_batch) is not in this "
    "build of partita (there is no partita.pipe package); train the model whole with ZeRO-3 "
    '("zero_optimization": {"stage": 3}), which shards parameters across the data-parallel ranks instead'
)

# Top-level names (``deepspeed.X``) and DeepSpeed subpackages partita has no counterpart for.
# A subpackage listed here (pipe, moe, sequence) is only reported missing while partita has no
# package of that name: partita/__init__.py looks for the package first.
TOP_LEVEL: dict[str, str] = {
    "module_inject": f"deepspeed.module_inject (kernel injection): {_INFERENCE}",
    "add_tuning_arguments": (
        "deepspeed.add_tuning_arguments (the DeepSpeed autotuner's flags): partita has no autotuner; "
        "`partita estimate` predicts memory per ZeRO stage and offload setting to choose one"
    ),
    "autotuning": "deepspeed.autotuning: partita has no autotuner; `partita estimate` predicts memory per setting",
    "DeepSpeedTransformerLayer": (
        "deepspeed.DeepSpeedTransformerLayer (DeepSpeed's fused CUDA transformer kernel) is not part of partita: "
        "write the block as a torch nn.Module (SDPA attention) and enable the config's \"compile\" section"
    ),
    "DeepSpeedTransformerConfig": "deepspeed.DeepSpeedTransformerConfig: see DeepSpeedTransformerLayer; not part of partita",
    "OnDevice": (
        "deepspeed.OnDevice (build a model on the meta device or in a dtype) is not in partita: build under "
        "partita.zero.Init(config_dict_or_path=cfg) to get it sharded, or use `with torch.device('meta'):`"
    ),
    "DeepSpeedConfig": (
        "deepspeed.DeepSpeedConfig is not in partita: partita.config.load_config(path_or_dict) validates and "
        "returns the config (engine.config on a running engine)"
    ),
    "compression": "deepspeed.compression (quantisation-aware training, pruning) is not part of partita",
    "elasticity": "deepspeed.elasticity is not part of partita: `partita run --max-restarts K` restarts failed jobs",
    "profiling": (
        "deepspeed.profiling is not in partita under that name: enable the config's \"flops_profiler\" section "
        "(engine.flops_profile() returns the result) or use partita.monitor.flops_profiler"
    ),
    "pipe": f"deepspeed.pipe: {_PIPE}",
    "PipelineModule": f"deepspeed.PipelineModule: {_PIPE}",
    "PipelineEngine": f"deepspeed.PipelineEngine: {_PIPE}",
    "LayerSpec": f"deepspeed.pipe.LayerSpec: {_PIPE}",
    "TiedLayerSpec": f"deepspeed.pipe.TiedLayerSpec: {_PIPE}",
    "moe": "deepspeed.moe (mixture of experts) is not in this build of partita (there is no partita.moe package)",
    "sequence": (
        "deepspeed.sequence (Ulysses sequence parallelism) is not in this build of partita (there is no "
        "partita.sequence package)"
    ),
}

# DeepSpeedEngine methods and attributes scripts use that partita's Engine does not have.
ENGINE: dict[str, str] = {
    "train_batch": f"engine.train_batch() belongs to DeepSpeed's PipelineEngine: {_PIPE}",
    "eval_batch": f"engine.eval_batch() belongs to DeepSpeed's PipelineEngine: {_PIPE}",
    "set_train_batch_size": "engine.set_train_batch_size() is not in partita: batch sizes are fixed at initialize()",
    "set_train_micro_batch_size": "engine.set_train_micro_batch_size() is not in partita: batch sizes are fixed at initialize()",
    "module_state_dict": (
        "engine.module_state_dict() is not in partita: engine.state_dict() (the module's, whole at ZeRO 0-2; at "
        "ZeRO-3 placeholders outside GatheredParameters), engine._zero3_consolidated_16bit_state_dict() (whole, "
        "rank 0), engine.get_fp32_state_dict() (fp32 weights at every stage) or engine.save_16bit_model(dir)"
    ),
    "get_summary_writer": (
        "engine.get_summary_writer() is not in partita: the config's \"tensorboard\" section writes every logged "
        "metric; log your own with torch.utils.tensorboard.SummaryWriter"
    ),
    "monitor": "engine.monitor is not in partita: the tensorboard / csv_monitor / wandb config sections write the metrics",
    "get_mom": "engine.get_mom() is not in partita: read engine.optimizer.param_groups[i]['betas'] (or 'momentum')",
    "empty_partition_cache": (
        "engine.empty_partition_cache() is not in partita: ZeRO-3 frees every gathered parameter at the end of "
        "its unit's backward (stage3_max_reuse_distance: 0 frees them at the end of each forward too)"
    ),
}


def _has_pipe() -> bool:
    import importlib.util

    return importlib.util.find_spec("partita.pipe") is not None


def missing_top_level(name: str) -> NoReturn | None:
    """Raise for a DeepSpeed top-level name partita lacks; return None for any other name."""
    message = TOP_LEVEL.get(name)
    if message is not None:
        raise MissingDeepSpeedFeature(message)
    return None


def missing_engine_attribute(name: str) -> NoReturn | None:
    """Raise for a DeepSpeedEngine attribute partita's Engine lacks; return None for any other name."""
    if name in ("train_batch", "eval_batch") and _has_pipe():
        raise MissingDeepSpeedFeature(
            f"engine.{name}() belongs to the pipeline engine: build the model as partita.pipe.PipelineModule "
            "(DeepSpeed's deepspeed.pipe.PipelineModule) and initialize() returns a PipelineEngine that has it; this "
            "engine trains with loss = engine(batch); engine.backward(loss); engine.step()"
        )
    message = ENGINE.get(name)
    if message is not None:
        raise MissingDeepSpeedFeature(message)
    return None
