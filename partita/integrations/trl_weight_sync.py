"""TRL's vLLM weight sync (``GRPOConfig(use_vllm=True)``, RLOO's too) on a partita policy.

With ``use_vllm=True`` TRL's GRPO and RLOO trainers generate rollouts with vLLM (colocated in each
training process, or on a server) and push the policy's weights to it before each generation
(``trl.generation.vllm_generation.VLLMGeneration.sync_weights``). They read those weights through
``VLLMGeneration._iter_named_params``: each parameter inside ``deepspeed.zero.GatheredParameters`` when
DeepSpeed ZeRO-3 is on, otherwise ``param.data`` as it is; for a PEFT policy it merges the adapters in
place (``merge_adapter``) after gathering the *whole* model at once. Under partita accelerate knows of
no DeepSpeed, so at ZeRO-3 that path would hand vLLM the empty shards (and merge into them).

:func:`install_weight_sync` (called by every ``with_partita`` trainer) replaces that one method of the
trainer's ``vllm_generation`` with :func:`generator_weights`, which yields the same ``(name, tensor)``
pairs (names and order of the policy's ``named_parameters()``, as TRL's own path gives them) from
partita, whole and never the whole model at once:

- a plain policy with its engine built: ``engine.iter_16bit_weight_buckets`` (partita/zero/weight_stream.py),
  the values ``save_16bit_model`` writes, made whole bucket by bucket (at most one bucket plus one
  tensor beyond a rank's shards; tensor- and expert-parallel weights under their checkpoint names);
  buffers and tied aliases are left out, as TRL's ``named_parameters()`` leaves them out;
- a PEFT policy: :func:`partita.integrations.peft_support.iter_merged_parameters`, one adapted layer
  gathered and merged at a time, under the base model's names (what vLLM's model knows), the values
  of ``merged_state_dict`` (``merge_and_unload`` of the unsharded model); the model is left exactly as
  it was (peft's ``unmerge_adapter`` would not restore bf16 weights bit for bit);
- before ``train()`` builds the engine (an ``evaluate()`` first): each parameter gathered alone
  (:class:`partita.integrations.hf_gathered.GatheredParameters`: also a base built under ``zero.Init``).

Every rank runs ``sync_weights`` (TRL calls it on all), so every rank iterates to the end, as the
gathers need. The bucket size is :data:`BUCKET_BYTES` unless the trainer sets
``partita_weight_sync_bucket_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from partita.config import ConfigError

__all__ = ["BUCKET_BYTES", "generator_weights", "install_weight_sync"]

# The most bytes of whole tensors one bucket of the weight stream holds (the engine's default).
BUCKET_BYTES = 512 << 20


def install_weight_sync(trainer: Any) -> None:
    """Route ``trainer.vllm_generation``'s weight reads through :func:`generator_weights` (see the module
    doc); nothing to do for a trainer without vLLM.

    Raises:
        ConfigError: ``use_vllm=True`` with a TRL whose ``VLLMGeneration`` has no ``_iter_named_params``
            (the one method partita replaces): its own sync would read ZeRO-3 shards.
    """
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return
    if not callable(getattr(generation, "_iter_named_params", None)):
        import trl

        raise ConfigError(
            f"use_vllm=True: this TRL ({trl.__version__}) syncs weights to vLLM without "
            "VLLMGeneration._iter_named_params, the method partita replaces to hand vLLM whole weights, so its own "
            "sync would read partita's ZeRO-3 shards; set use_vllm=False (rollouts then generate from the sharded "
            "policy through engine.generate), or use a TRL release with that method (1.16 has it)"
        )
    fix_name = getattr(generation, "_fix_param_name_to_vllm", None)
    generation._iter_named_params = lambda: generator_weights(trainer, fix_name=fix_name)


def generator_weights(trainer: Any, *, fix_name: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights for a generator, as ``(name, whole tensor)`` on every rank (see the module
    doc). Read or copy each tensor before asking for the next one. Every rank must iterate to the end.

    Args:
        trainer: a ``with_partita`` trainer (its ``engine`` may still be None).
        fix_name: TRL's name fix for vLLM (``_fix_param_name_to_vllm``: wrapper prefixes), applied to each name.
    """
    engine = trainer.engine
    model = engine.module if engine is not None else trainer.model
    fix = fix_name if fix_name is not None else (lambda name: name)
    if _is_peft_model(model):
        from partita.integrations.peft_support import iter_merged_parameters

        stream = iter_merged_parameters(engine if engine is not None else model)
    elif engine is not None:
        stream = _engine_parameters(engine, getattr(trainer, "partita_weight_sync_bucket_bytes", BUCKET_BYTES))
    else:
        stream = _gathered_parameters(model)
    for name, tensor in stream:
        yield fix(name), tensor


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _engine_parameters(engine: Any, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``engine.iter_16bit_weight_buckets``' entries, less buffers and the second names of tied weights."""
    module: nn.Module = engine.module
    first = {name for name, _ in module.named_parameters()}
    skipped = {name for name, _ in module.named_parameters(remove_duplicate=False)} - first
    skipped |= {name for name, _ in module.named_buffers()}
    for bucket in engine.iter_16bit_weight_buckets(bucket_bytes=bucket_bytes):
        for name, tensor in bucket:
            if name not in skipped:
                yield name, tensor


def _gathered_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Before the engine exists: each parameter whole while it is handed out."""
    from partita.integrations.hf_gathered import GatheredParameters

    for name, param in model.named_parameters():
        with GatheredParameters([param]):
            yield name, param.detach()
