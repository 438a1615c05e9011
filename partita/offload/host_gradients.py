"""The offloaded gradient partition in the model's 16-bit dtype, at one process, for the delayed update.

[Note: model-dtype host gradients]
Why: with the optimizer in CPU memory, the host's memory bandwidth bounds the step. On one H200
host, GPT-1.3B's fused AdamW over the fp32 partition moves 28 bytes per parameter and runs at
~120 GB/s; the gradient download (4 bytes per parameter written by the copy engine) and the
weight upload (4 read) share the same memory, so the delayed update, which runs all three at
once, reached 2.33x DeepSpeed's tokens/s against a goal of 2.5x. At one process with one
gradient pass per step the fp32 partition is only an exact upcast of the bf16/fp16 gradients:
no reduction or sum ever rounds in it. So the partition is kept in the model's dtype instead:
the copy engine writes 2 bytes per parameter into it, and the step casts it to fp32 in ranges
of :data:`CAST_CHUNK_NUMEL` elements into one small buffer that stays in the CPU caches, right
before torch's fused kernel reads them there. Host memory traffic per parameter falls from
about 36 bytes to 32, and the host holds 2 bytes per parameter less in each of the delayed
update's two gradient buffers.

Only for the delayed update, as measured on one H200 host (GPT-1.3B, ZeRO-2, docs/performance.md):
there the host step shares the memory with the next step's gradient download, and casting ranges
of 2^24 elements ran 37.4k tokens/s against 35.2k with the fp32 partition in the same lease. The
exact step runs alone on the host, where the second pass over each range costs more than the 2
bytes it saves: 22.4k against 26.5k tokens/s. So the exact step keeps the fp32 partition.

The update is bitwise the fp32 partition's: the kernel gets the same fp32 values, in ranges
that start at multiples of 64 elements (the pipelined step's ranges plus multiples of a power of
two), so every element keeps its SIMD lane (partita/optim/fused_adam_range.py). The gradient
norm is the same too: on CUDA it is summed on the accelerator from the same fp32 values as
before, and on the host ``vector_norm`` of the 16-bit partition accumulates in fp32.

When (:func:`keeps_model_dtype`): ``delayed_param_update``, one process in the ZeRO group, ZeRO
stage 1 or 2, 16-bit model, the whole optimizer in CPU memory (no accelerator or NVMe tier), torch's fused Adam or
AdamW on the host, no fp32 micro-batch sums, and one gradient pass per step (stage 1, or
stage 2 without gradient accumulation; stage 2 adds later micro-batches into the partition).
Anything else keeps the fp32 partition. ZeRO-3 is left out: it steps the whole partition at
once (its shards are refreshed whole), so it would need a full-size fp32 copy.

Why our own code: torch's fused Adam needs its gradient in the parameter's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from partita.optim.fused_adam_range import adam_state, fused_adam_optimizer, step_adam_range

if TYPE_CHECKING:
    from partita.zero.sharded_optimizer import ShardedOptimizer
    from partita.zero.shard_group import ShardedParamGroup

CAST_CHUNK_NUMEL = 1 << 24
"""Gradient elements cast to fp32 per kernel call (a 64 MiB buffer; a power of two, see the note):
small enough that the cast's output is still in the last-level cache when the kernel reads it,
large enough that the two parallel regions per range (cast, kernel) stay few: beside the next
forward and backward each region waits for its slowest thread. On one H200 host (16 cores, 300 MiB
L3) the delayed update ran 37.4k tokens/s with 2^24, 36.0k with 2^25 (same lease), and far slower
with 2^23 in another lease."""

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def keeps_model_dtype(*, delayed_update: bool, zero_size: int, stage: int, dtype: torch.dtype,
                      tiers: tuple[float, float, float], fused_adam: bool, fp32_sums: bool,
                      gradient_accumulation_steps: int) -> bool:
    """Whether offloaded gradient partitions are kept in the model's dtype (the rule of the
    note). ``tiers``: the optimizer state's (accelerator, cpu, nvme) shares."""
    return (delayed_update and zero_size == 1 and stage in (1, 2) and dtype in _SIXTEEN_BIT and tuple(tiers) == (0.0, 1.0, 0.0)
            and fused_adam and not fp32_sums and not (stage == 2 and gradient_accumulation_steps > 1))


def use_model_dtype_gradients(groups: list[ShardedParamGroup], inner: torch.optim.Optimizer, *,
                              delayed_update: bool, zero_size: int, stage: int, tiers: tuple[float, float, float],
                              fp32_sums: bool, gradient_accumulation_steps: int) -> bool:
    """Switch every group's host gradient partition to its model dtype where the rule holds;
    returns whether it did."""
    if not groups or not all(g.offloaded for g in groups):
        return False
    dtype = groups[0].model_dtype
    if any(g.model_dtype != dtype for g in groups) or not keeps_model_dtype(
        delayed_update=delayed_update, zero_size=zero_size, stage=stage, dtype=dtype, tiers=tiers, fused_adam=fused_adam_optimizer(inner),
        fp32_sums=fp32_sums, gradient_accumulation_steps=gradient_accumulation_steps,
    ):
        return False
    for group in groups:
        group.host_grad_dtype = dtype
    return True


def create_states(optimizer: ShardedOptimizer) -> None:
    """Make torch's Adam state for every group before its first step: model-dtype gradients are
    only ever stepped range by range (:func:`step_cast_range`), and ranges need the state to exist."""
    for group, options in zip(optimizer.groups, optimizer.inner.param_groups):
        adam_state(optimizer.inner, group.master, options)


def step_cast_range(inner: torch.optim.Optimizer, options: dict, group: ShardedParamGroup, lo: int, hi: int,
                    grad: torch.Tensor, step_before: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
    """Step master elements ``[lo, hi)`` of ``group`` from its model-dtype gradient partition
    ``grad``, cast :data:`CAST_CHUNK_NUMEL` elements at a time into the group's fp32 buffer."""
    buffer = group.cast_buffer(CAST_CHUNK_NUMEL)
    for start in range(lo, hi, CAST_CHUNK_NUMEL):
        end = min(start + CAST_CHUNK_NUMEL, hi)
        wide = buffer[: end - start]
        wide.copy_(grad[start:end])  # exact: every 16-bit value is an fp32 value
        step_adam_range(inner, options, group.master, start, end, wide, step_before, grad_scale)
