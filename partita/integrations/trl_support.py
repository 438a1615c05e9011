"""The models a Trainer only evaluates (TRL's reference model, GRPO's reward models) under partita.

TRL's DPO, GRPO, RLOO and KTO trainers keep a frozen *reference* model next to the policy and
hand it to ``accelerator.prepare_model(ref_model, evaluation_mode=True)`` (GRPO does the same for
reward models); with DeepSpeed on they call ``trl.models.prepare_deepspeed`` instead, which builds
a DeepSpeed engine without optimizer: ZeRO-3 when the policy trains at ZeRO-3, stage 0 (a whole
copy per rank) otherwise. A partita trainer (:func:`partita.integrations.hf.with_partita`)
intercepts that ``prepare_model`` call and gives the model :func:`prepare_frozen_model`'s answer:

- **ZeRO-3**: ``partita.initialize(model=..., config=<stage 3, no optimizer>)``, an inference-only
  :class:`partita.zero.inference_engine.ZeroInferenceEngine`: the weights are cast to the config's
  16-bit dtype (if any) and sharded over the ranks, no fp32 masters, no optimizer state, and each
  forward gathers unit by unit as in training (DeepSpeed's reference engine);
- **stages 0-2**: the model itself, frozen (``requires_grad_(False)``), in ``eval()`` mode, on the
  Trainer's device and in the config's 16-bit dtype (what DeepSpeed's stage-0 engine does with
  ``bf16``/``fp16`` enabled). Nothing to shard: every rank holds it whole.

GRPO and RLOO tell a reward *model* from a reward function by ``isinstance(f, nn.Module)`` (a
DeepSpeed engine is a module; a partita engine is not), so :func:`unwrap_reward_models` puts the
engine's module back in ``reward_funcs``: its ZeRO-3 hooks gather each unit for the forward as the
engine's would, and the trainer keeps the engine alive.

The engine's config keeps only the sections that shape how weights are stored and computed
(:data:`_KEPT`): the training config's optimizer, scheduler, ``offload_optimizer``, clipping,
monitors and checkpoint sections do not apply to a model that never trains (a checkpoint on
SIGTERM would even try to save it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from partita.config import ConfigError

__all__ = ["frozen_model_config", "prepare_frozen_model", "unwrap_reward_models", "zero_stage_of"]

# The config sections a frozen model's engine inherits from the training config.
_KEPT = ("zero_optimization", "bf16", "fp16", "tensor_parallel", "aio")


def zero_stage_of(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0) or 0)


def frozen_model_config(config: dict) -> dict:
    """The inference-only config for a frozen model, from a training config whose ``"auto"``
    values are filled (:func:`partita.integrations.hf_config.resolve_trainer_config`)."""
    kept = {key: copy.deepcopy(config[key]) for key in _KEPT if key in config}
    zero = kept.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)  # no optimizer state to offload
    return kept


def _dtype_of(config: dict) -> torch.dtype | None:
    for section, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(section) or {}).get("enabled"):
            return dtype
    return None


def prepare_frozen_model(model: nn.Module, config: dict, *, device: torch.device, sync_ref_model: bool = False) -> Any:
    """A frozen model ready for forwards under a partita trainer whose engine uses ``config``
    (resolved): an inference-only engine at ZeRO-3, the model on ``device`` otherwise (see the
    module doc). Every rank must call it (at ZeRO-3 it is a collective).

    Raises:
        ConfigError: ``sync_ref_model`` at ZeRO-3 (TRL's ``SyncRefModelCallback`` mixes the
            policy's weights into the reference's by reading ``param.data`` of both, which ZeRO-3
            shards on both sides).
    """
    stage = zero_stage_of(config)
    model.requires_grad_(False)  # never trained: no gradients, no masters
    if stage == 3:
        if sync_ref_model:
            raise ConfigError(
                "sync_ref_model=True is not supported with a partita ZeRO-3 config: TRL's SyncRefModelCallback "
                "copies the policy's weights into the reference model through param.data, which ZeRO-3 shards on "
                "both models; set sync_ref_model=False, or train at ZeRO stage 0-2 (the reference model stays whole)"
            )
        import partita
        from partita.zero.freed import is_freed

        dtype = _dtype_of(config)
        # The inference-only engine keeps the model's dtype: cast to the config's 16-bit dtype first, on
        # the model's own device, as DeepSpeed's reference engine does (half the bytes of an fp32 copy). A
        # model built under zero.Init holds shards already, in the dtype zero.Init gave them.
        if dtype is not None and not any(is_freed(p) for p in model.parameters()):
            model.to(dtype)
        engine, _, _, _ = partita.initialize(model=model, config=frozen_model_config(config))
        engine.eval()
        return engine
    dtype = _dtype_of(config)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def unwrap_reward_models(trainer: Any) -> None:
    """Replace each inference-only engine in ``trainer.reward_funcs`` (GRPO's, RLOO's) by its module,
    keeping the engine in ``trainer._partita_frozen_engines`` (see the module doc)."""
    from partita.zero.inference_engine import ZeroInferenceEngine

    funcs = getattr(trainer, "reward_funcs", None)
    if not isinstance(funcs, list):
        return
    kept = trainer.__dict__.setdefault("_partita_frozen_engines", [])
    for i, func in enumerate(funcs):
        if isinstance(func, ZeroInferenceEngine):
            kept.append(func)
            funcs[i] = func.module
