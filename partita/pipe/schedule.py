"""The pipeline schedules: torch.distributed.pipelining's, built the same way on torch 2.11-2.13.

Why these and how they are wired (shared/reference/model_parallel.md §1.3, §7):

- ``PipelineStage``'s ``group`` moved from the 5th to the 7th position in 2.12 (``output_grads``
  and ``input_grads`` were inserted before it), so everything past ``device`` is passed by keyword.
  Shapes are inferred from the first micro-batch (no example tensors), which both versions do.
- ``scale_grads=False``: torch would divide gradients by the number of micro-batches, right only
  for a mean loss and easy to double. Instead the loss function handed to the schedule returns
  ``loss / micro_batches * loss_scale`` (:class:`ScaledLoss`), so the schedule's gradients are
  exactly gradient accumulation's; the data-parallel mean is the ZeRO reducer's.
- Gradient reduction runs once after the schedule (see :mod:`partita.pipe.engine`), not from
  autograd hooks, so the zero-bubble schedule (whose weight gradients bypass those hooks,
  pt#144530) reduces correctly too.
- Interleaved schedules map stage ``i`` to pipe rank ``i % p`` (loop), the mapping
  :class:`partita.pipe.PipelineModule` builds its chunks in.
- ``zero_bubble`` runs ``ScheduleInterleavedZeroBubble`` over however many chunks a rank holds:
  one chunk per rank is the paper's ZB-H1 (bubble ``(p-1)/(3m+p-1)``), ``v`` chunks divide it by
  ``v``. One chunk is often the faster choice on CPU, where every chunk call and message has a
  fixed cost (``benchmarks/results/pipeline_cpu_2026-12-04.md``).
- Evaluation runs a schedule without a loss function (forward only, public on both versions:
  GPipe for one chunk per rank, else the training schedule's class) over stage objects of its own;
  2.11 does not re-infer shared stages' buffers when the mode switches (2.13 does).
- torch 2.13 calls the loss function once more while it infers the backward metadata at a
  schedule's first step; only the last ``micro_batches`` recorded losses are the batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from partita.config.base import ConfigError
from partita.pipe.module import PipelineModule
from partita.pipe.sequence import SequenceSlices
from partita.pipe.weight_grads import DeferredLinearGrads

__all__ = ["ScaledLoss", "build_stages", "build_schedule", "check_micro_batches"]

_MULTI = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}
_SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class ScaledLoss:
    """The loss function the schedule calls per micro-batch on the last stage.

    Returns ``loss_fn(output, target) * loss_scale / micro_batches`` for backward and keeps each
    micro-batch's unscaled loss (detached, fp32) for ``train_batch``'s return value. With sequence
    parallelism (``slices``) the loss of a slice becomes the mean over the whole sequence group's
    tokens (:mod:`partita.pipe.sequence`).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], micro_batches: int,
                 slices: SequenceSlices | None = None) -> None:
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.slices = slices
        self.loss_scale = 1.0
        self.losses: list[torch.Tensor] = []

    def unscaled(self, output: Any, target: Any) -> torch.Tensor:
        """The micro-batch's loss as ``train_batch`` and ``eval_batch`` report it."""
        loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"the PipelineModule's loss_fn must return a scalar tensor, got {shape}; reduce it with .mean()")
        return self.slices.group_mean(loss, target) if self.slices is not None else loss

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.unscaled(output, target)
        self.losses.append(loss.detach().float().reshape(()))
        return loss.float() * (self.loss_scale / self.micro_batches)


def check_micro_batches(schedule: str, micro_batches: int, num_stages: int, virtual_stages: int) -> None:
    """The schedules' own constraints, raised as ConfigErrors naming the config keys."""
    if schedule in _SINGLE and virtual_stages != 1:
        raise ConfigError(
            f"pipeline.schedule={schedule!r} runs one model chunk per rank, but the PipelineModule has "
            f"virtual_stages={virtual_stages}: use \"interleaved_1f1b\" or \"zero_bubble\", or build it with virtual_stages=1"
        )
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ConfigError(
            f"pipeline.schedule={schedule!r} needs at least 2 model chunks per rank: build the PipelineModule "
            "with virtual_stages=2 (or more), or use schedule \"1f1b\" (or \"zero_bubble\", which also runs one chunk per rank)"
        )
    if schedule == "1f1b" and micro_batches < num_stages:
        raise ConfigError(
            f"pipeline.schedule=\"1f1b\" needs at least as many micro-batches (gradient_accumulation_steps="
            f"{micro_batches}) as stages ({num_stages}): raise gradient_accumulation_steps or use \"gpipe\""
        )
    if schedule in _MULTI:
        rounds = max(1, micro_batches // num_stages)
        if micro_batches % rounds != 0:
            raise ConfigError(
                f"pipeline.schedule={schedule!r}: gradient_accumulation_steps={micro_batches} must be a multiple of "
                f"its rounds max(1, {micro_batches} // {num_stages} stages) = {rounds}; use a multiple of {num_stages}"
            )


class _DeferredStage(PipelineStage):
    """A stage whose ``nn.Linear`` weight gradients wait for the W action (:mod:`partita.pipe.weight_grads`)."""

    def __init__(self, chunk: Any, index: int, total: int, device: torch.device, *, group: dist.ProcessGroup) -> None:
        self.deferred = DeferredLinearGrads()
        self.deferred.patch(chunk)
        super().__init__(chunk, index, total, device, group=group, dw_builder=self.deferred.builder)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if fwd_chunk_id == 0:  # a new batch: drop what torch's first-step metadata inference kept
            self.deferred.clear()
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


def build_stages(module: PipelineModule, *, device: torch.device, group: dist.ProcessGroup,
                 defer_linear_weights: bool = False) -> list[PipelineStage]:
    """One PipelineStage per model chunk this rank holds; ``defer_linear_weights``: zero bubble's
    W computes the ``nn.Linear`` weight gradients (:mod:`partita.pipe.weight_grads`)."""
    total = module.num_stages * module.virtual_stages
    # The first stage sends no input gradient, so it has nothing to split: torch already runs its whole
    # backward as W (and an empty I), one pass, cheaper than any split.
    return [(_DeferredStage if defer_linear_weights and chunk.index > 0 else PipelineStage)(
        chunk, chunk.index, total, device, group=group) for chunk in module.chunks]


def build_schedule(name: str, stages: list[PipelineStage], micro_batches: int, loss: Callable[[Any, Any], Any] | None):
    """The torch schedule ``name`` (a key of config ``pipeline.schedule``) over this rank's ``stages``;
    ``loss=None``: forward only (GPipe stands in for 1F1B, which is the same without backwards)."""
    if name in _SINGLE:
        cls = _SINGLE[name] if loss is not None else ScheduleGPipe
        return cls(stages[0], micro_batches, loss_fn=loss, scale_grads=False)
    return _MULTI[name](stages, micro_batches, loss_fn=loss, scale_grads=False)
