"""The "selective" policy: keep what is expensive to recompute, recompute what is cheap.

Matmuls and attention hold nearly all of a transformer block's FLOPs while their outputs
are a small share of its activations; the elementwise ops (GELU, LayerNorm, softmax,
dropout, residual adds) are the opposite. So the policy saves the outputs of ``mm``,
``addmm``, ``bmm``, ``baddbmm`` and the fused SDPA kernels and recomputes everything else,
through torch's selective-checkpoint contexts.

Random ops are always recomputed. Saved ops are *not* re-run during recompute, so if a
random op were saved, the random ops after it would draw from a different RNG position on
recompute and dropout masks would differ from the forward. An SDPA kernel with
``dropout_p > 0`` is random, so it is recomputed too (with dropout off it is saved).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "selective_policy", "selective_context_fn"]

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    # Not every build has every kernel (cuDNN attention, CPU flash); skip the missing ones.
    return frozenset(getattr(_aten, name).default for name in names if hasattr(_aten, name))


_MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm")
_ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS: frozenset = _MATMUL_OPS | _ATTENTION_OPS
"""Ops whose outputs the selective policy keeps (attention only when its dropout is off)."""


def _dropout_p(func: Any, args: tuple, kwargs: dict) -> float:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            if "dropout_p" in kwargs:
                return float(kwargs["dropout_p"])
            if index < len(args):
                return float(args[index])
            return float(argument.default_value or 0.0)
    return 0.0


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torch SAC policy: save matmul / deterministic attention outputs, recompute the rest."""
    if func in _ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE if _dropout_p(func, args, kwargs) == 0.0 else CheckpointPolicy.MUST_RECOMPUTE
    if torch.Tag.nondeterministic_seeded in func.tags:
        return CheckpointPolicy.MUST_RECOMPUTE
    if func in _MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


selective_context_fn: Callable[[], tuple[ContextManager, ContextManager]] = functools.partial(
    create_selective_checkpoint_contexts, selective_policy
)
"""``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that applies :func:`selective_policy`."""
