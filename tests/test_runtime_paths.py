"""Every ``deepspeed.runtime.*`` name that DeepSpeedExamples and Megatron-DeepSpeed import, under partita.

Audit (DeepSpeed path -> names, and where the import was found):

microsoft/Megatron-DeepSpeed
- megatron/model/gpt_model.py: ``deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology``
  (and ``deepspeed.pipe.PipelineModule/LayerSpec/TiedLayerSpec``, also at ``runtime.pipe.module``)
- megatron/training.py: ``deepspeed.runtime.data_pipeline.data_routing.helper.convert_to_random_ltd``,
  ``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler``
- pretrain_gpt.py: ``deepspeed.runtime.utils.see_memory_usage``
- megatron/core/pipeline_parallel/deepspeed_engine.py: ``deepspeed.runtime.pipe.engine.PipelineEngine``,
  ``deepspeed.runtime.utils.PartitionedTensor``
- tasks/eval_harness/evaluate.py: ``from deepspeed.runtime.pipe import schedule`` (the module)
- megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py: ``deepspeed.runtime.pipe.schedule.``
  PipeSchedule, PipeInstruction, BufferOpInstruction, LoadMicroBatch, RecvActivation, SendActivation,
  RecvGrad, SendGrad, ForwardPass, BackwardPass, ReduceGrads, ReduceTiedGrads, OptimizerStep

microsoft/DeepSpeedExamples
- training/pipeline_parallelism/train.py: ``deepspeed.runtime.utils.set_random_seed`` (attribute access)
- training/offload_states/offload_states.py: ``deepspeed.runtime.zero.offload_config.OffloadDeviceEnum``,
  ``OffloadStateTypeEnum``
- applications/DeepSpeed-Chat/dschat/utils/utils.py: ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``
- training/data_efficiency/gpt_finetuning/run_clm_no_trainer.py:
  ``deepspeed.runtime.data_pipeline.data_routing.helper.convert_to_random_ltd``, ``save_without_random_ltd``

Named in the brief and found in other public client code (the code index's exact-string search,
whose hits do not name their repository): ``deepspeed.runtime.lr_schedules.WarmupLR / WarmupDecayLR /
WarmupCosineLR``, ``deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler /
CreateLossScaler / INITIAL_LOSS_SCALE / SCALE_WINDOW / DELAYED_SHIFT / MIN_LOSS_SCALE``,
``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer / estimate_zero2_model_states_mem_needs_all_live``,
``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 / estimate_zero3_model_states_mem_needs_all_live``,
``deepspeed.runtime.zero.config.ZeroStageEnum``, ``deepspeed.runtime.config.DeepSpeedConfig``,
``deepspeed.runtime.dataloader.RepeatingLoader``, ``deepspeed.runtime.bf16_optimizer.BF16_Optimizer``,
``deepspeed.runtime.pipe.ProcessTopology``, ``deepspeed.runtime.pipe.topology.PipelineParallelGrid``,
``deepspeed.runtime.pipe.module.PipelineModule / LayerSpec / TiedLayerSpec``,
``deepspeed.runtime.engine.DeepSpeedEngine``, ``deepspeed.runtime.activation_checkpointing.checkpointing``.

Each entry of :data:`AUDIT` is either the partita object the name must be (identity), or the
refusal: attribute access raises :class:`partita.MissingDeepSpeedFeature`, ``from path import
name`` raises ImportError (:class:`partita.runtime._missing.MissingDeepSpeedImport`), both with
the message that starts with the DeepSpeed name and names partita's way.
"""

from __future__ import annotations

import importlib
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

# (DeepSpeed module path, name, ("is", "partita.module:attribute") | ("refused", text the message contains))
AUDIT: list[tuple[str, str, tuple[str, str]]] = [
    ("runtime.pipe.topology", "ProcessTopology", ("is", "partita.pipe.topology:ProcessTopology")),
    ("runtime.pipe.topology", "PipeDataParallelTopology", ("is", "partita.pipe.topology:PipeDataParallelTopology")),
    ("runtime.pipe.topology", "PipeModelDataParallelTopology",
     ("is", "partita.pipe.topology:PipeModelDataParallelTopology")),
    ("runtime.pipe.topology", "PipelineParallelGrid", ("refused", "use engine.topology")),
    ("runtime.pipe", "ProcessTopology", ("is", "partita.pipe.topology:ProcessTopology")),
    ("runtime.pipe", "PipelineModule", ("is", "partita.pipe.module:PipelineModule")),
    ("runtime.pipe", "LayerSpec", ("is", "partita.pipe.module:LayerSpec")),
    ("runtime.pipe", "TiedLayerSpec", ("is", "partita.pipe.module:TiedLayerSpec")),
    ("runtime.pipe.module", "PipelineModule", ("is", "partita.pipe.module:PipelineModule")),
    ("runtime.pipe.module", "LayerSpec", ("is", "partita.pipe.module:LayerSpec")),
    ("runtime.pipe.module", "TiedLayerSpec", ("is", "partita.pipe.module:TiedLayerSpec")),
    ("runtime.pipe.module", "PipelineError", ("is", "partita.pipe.engine:PipelineError")),
    ("runtime.pipe.engine", "PipelineEngine", ("is", "partita.pipe.engine:PipelineEngine")),
    *[("runtime.pipe.schedule", name, ("refused", "pipeline.schedule (\"1f1b\" as DeepSpeed's TrainSchedule"))
      for name in ("PipeSchedule", "PipeInstruction", "BufferOpInstruction", "LoadMicroBatch", "RecvActivation",
                   "SendActivation", "RecvGrad", "SendGrad", "ForwardPass", "BackwardPass", "ReduceGrads",
                   "ReduceTiedGrads", "OptimizerStep", "TrainSchedule", "InferenceSchedule")],
    ("runtime.utils", "see_memory_usage", ("is", "partita.runtime.utils:see_memory_usage")),
    ("runtime.utils", "set_random_seed", ("is", "partita.bootstrap:_seed_everything")),
    ("runtime.utils", "PartitionedTensor", ("refused", "pipeline stages send whole activations")),
    ("runtime.engine", "DeepSpeedEngine", ("is", "partita.engine:Engine")),
    ("runtime.activation_checkpointing.checkpointing", "checkpoint", ("is", "partita.checkpointing:checkpoint")),
    ("runtime.activation_checkpointing.checkpointing", "configure", ("is", "partita.checkpointing:configure")),
    ("runtime.activation_checkpointing.checkpointing", "is_configured", ("is", "partita.checkpointing:is_configured")),
    ("runtime.activation_checkpointing.checkpointing", "get_cuda_rng_tracker",
     ("refused", "seed with the config's \"seed\" key")),
    ("runtime.activation_checkpointing.checkpointing", "model_parallel_cuda_manual_seed",
     ("refused", "seed with the config's \"seed\" key")),
    ("runtime.lr_schedules", "WarmupLR", ("is", "partita.optim.schedulers:WarmupLR")),
    ("runtime.lr_schedules", "WarmupDecayLR", ("is", "partita.optim.schedulers:WarmupDecayLR")),
    ("runtime.lr_schedules", "WarmupCosineLR", ("is", "partita.optim.schedulers:WarmupCosineLR")),
    ("runtime.lr_schedules", "OneCycle", ("is", "partita.optim.schedulers:OneCycle")),
    ("runtime.lr_schedules", "LRRangeTest", ("refused", "WarmupLR(warmup_type=\"linear\")")),
    ("runtime.fp16.loss_scaler", "LossScaler", ("is", "partita.precision.loss_scaler:StaticLossScaler")),
    ("runtime.fp16.loss_scaler", "DynamicLossScaler", ("is", "partita.precision.loss_scaler:DynamicLossScaler")),
    ("runtime.fp16.loss_scaler", "CreateLossScaler", ("refused", "build_loss_scaler(config.fp16)")),
    *[("runtime.fp16.loss_scaler", name, ("refused", "hysteresis (delayed_shift)"))
      for name in ("INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "MIN_LOSS_SCALE")],
    ("runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", ("refused", "ShardedOptimizer, engine.optimizer")),
    ("runtime.zero.stage_1_and_2", "estimate_zero2_model_states_mem_needs_all_live",
     ("refused", "partita.estimate.estimate_memory(model, Setup(stage=..., world_size=...))")),
    ("runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", ("refused", "ShardedOptimizer, engine.optimizer")),
    ("runtime.zero.stage3", "estimate_zero3_model_states_mem_needs_all_live",
     ("refused", "partita.estimate.estimate_memory(model, Setup(stage=..., world_size=...))")),
    ("runtime.zero.partition_parameters", "Init", ("is", "partita.zero:Init")),
    ("runtime.zero.partition_parameters", "GatheredParameters", ("is", "partita.zero:GatheredParameters")),
    ("runtime.zero.partition_parameters", "ZeroParamStatus", ("refused", "partita.zero.GatheredParameters(params)")),
    ("runtime.zero.offload_config", "OffloadDeviceEnum", ("is", "partita.zero.offload_states:OffloadDeviceEnum")),
    ("runtime.zero.offload_config", "OffloadStateTypeEnum", ("is", "partita.zero.offload_states:OffloadStateTypeEnum")),
    ("runtime.zero.config", "ZeroStageEnum", ("refused", "zero_optimization.stage is an int 0-3")),
    ("runtime.config", "DeepSpeedConfig", ("refused", "partita.config.load_config(path_or_dict)")),
    ("runtime.dataloader", "RepeatingLoader", ("is", "partita.data.repeating:RepeatingLoader")),
    ("runtime.dataloader", "DeepSpeedDataLoader", ("refused", "pass training_data=dataset")),
    ("runtime.bf16_optimizer", "BF16_Optimizer", ("refused", "keeps fp32 masters and steps them")),
    ("runtime.data_pipeline.curriculum_scheduler", "CurriculumScheduler", ("is", "partita.schedules.curriculum:CurriculumScheduler")),
    ("runtime.progressive_layer_drop", "ProgressiveLayerDrop",
     ("is", "partita.schedules.progressive_layer_drop:ProgressiveLayerDrop")),
    ("runtime.data_pipeline.data_routing.helper", "convert_to_random_ltd", ("refused", "(random-LTD) is not in partita")),
    ("runtime.data_pipeline.data_routing.helper", "save_without_random_ltd",
     ("refused", "(random-LTD) is not in partita")),
]


def _resolve(target: str):
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


@pytest.mark.parametrize(("path", "name", "expected"), AUDIT, ids=[f"{p}.{n}" for p, n, _ in AUDIT])
def test_audited_name_is_partitas_object_or_refused(path: str, name: str, expected: tuple[str, str]) -> None:
    from partita import MissingDeepSpeedFeature
    from partita.runtime._missing import MissingDeepSpeedImport

    module = importlib.import_module(f"partita.{path}")  # the module itself always imports
    kind, detail = expected
    statement = f"from partita.{path} import {name}"
    if kind == "is":
        assert getattr(module, name) is _resolve(detail)
        scope: dict = {}
        exec(statement, scope)  # noqa: S102 - the import statement a DeepSpeed script runs
        assert scope[name] is _resolve(detail)
        return
    # partita.checkpointing's own refusals name DeepSpeed's shorter alias of that module.
    prefix = f"deepspeed.{path}.{name}" if "checkpointing" not in path else f"deepspeed.checkpointing.{name}"
    with pytest.raises(MissingDeepSpeedFeature) as by_attribute:
        getattr(module, name)
    message = str(by_attribute.value)
    assert message.startswith(prefix) and detail in message, message
    assert not hasattr(module, name)
    with pytest.raises(MissingDeepSpeedImport) as by_import:
        exec(statement, {})  # noqa: S102
    assert str(by_import.value) == message
    assert isinstance(by_import.value, ImportError) and isinstance(by_import.value, NotImplementedError)


# Whole modules imported by name (``from deepspeed.runtime.pipe import schedule`` in
# Megatron-DeepSpeed's tasks/eval_harness/evaluate.py; the others in client pipeline engines).
MODULE_IMPORTS = [("runtime.pipe", "schedule"), ("runtime.pipe", "topology"), ("runtime", "utils"),
                  ("runtime", "lr_schedules"), ("runtime.activation_checkpointing", "checkpointing"),
                  ("runtime.zero", "partition_parameters"), ("runtime.zero", "stage3"), ("runtime.fp16", "loss_scaler")]


@pytest.mark.parametrize(("package", "name"), MODULE_IMPORTS, ids=[f"{p}.{n}" for p, n in MODULE_IMPORTS])
def test_from_package_import_module(package: str, name: str) -> None:
    scope: dict = {}
    exec(f"from partita.{package} import {name}", scope)  # noqa: S102
    assert scope[name] is importlib.import_module(f"partita.{package}.{name}")


def test_unknown_names_keep_pythons_errors() -> None:
    import partita.runtime.lr_schedules as lr_schedules

    with pytest.raises(AttributeError, match=r"^module 'partita.runtime.lr_schedules' has no attribute 'Nope'$"):
        lr_schedules.Nope
    with pytest.raises(ImportError, match=r"^cannot import name 'Nope' from 'partita.runtime.lr_schedules'"):
        exec("from partita.runtime.lr_schedules import Nope", {})  # noqa: S102


def test_set_random_seed_seeds_random_numpy_and_torch_as_deepspeed() -> None:
    from partita.runtime.utils import set_random_seed

    set_random_seed(1234)
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    assert drawn == (random.random(), float(np.random.rand()), float(torch.rand(())))


def test_repeating_loader_restarts_and_leaves_the_sampler_alone() -> None:
    """DeepSpeed's RepeatingLoader: a class, a new pass when one ends, no set_epoch (so a
    DistributedSampler repeats its order, as on DeepSpeed)."""
    import pytest

    from partita.runtime.dataloader import RepeatingLoader

    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    class Loader(list):
        sampler = Sampler()

    loader = Loader([1, 2, 3])
    repeating = RepeatingLoader(loader)
    assert isinstance(repeating, RepeatingLoader) and iter(repeating) is repeating and len(repeating) == 3
    assert [next(repeating) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert loader.sampler.epochs == []
    with pytest.raises(ValueError, match="RepeatingLoader: the loader yielded no batch in a whole pass"):
        next(RepeatingLoader([]))


def test_dotted_paths_from_a_bare_import() -> None:
    # A fresh interpreter: `import partita as deepspeed` alone must reach every audited module by
    # attribute access, as DeepSpeedExamples' `deepspeed.runtime.utils.set_random_seed(seed)` does.
    paths = sorted({path for path, _, _ in AUDIT})
    code = textwrap.dedent(f"""
        import json
        import partita as deepspeed
        reached = {{}}
        for path in {paths!r}:
            obj = deepspeed
            for part in path.split("."):
                obj = getattr(obj, part)
            reached[path] = obj.__name__
        print(json.dumps(reached))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {p: f"partita.{p}" for p in paths}
