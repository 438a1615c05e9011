"""How many samples each optimizer step trained on, and a check that every rank trained on as many.

Why: the engine averages gradients over ranks with equal weights, which is the mean over the
global batch only when every data-parallel rank's micro-batches hold the same number of
samples; and ``engine.global_samples`` (the monitors' x axis, saved in checkpoints) should be
what was trained on, not the configured ``train_batch_size`` when a last batch is smaller.

What counts as a micro-batch's samples: the leading dimension of the first tensor among the
training forward's arguments (positional first, then keyword, looking inside lists, tuples and
dicts): ``engine(x)``, ``engine(input_ids=..., labels=...)``, ``engine(batch_dict)``. A forward
with no tensor argument counts as ``train_micro_batch_size_per_gpu``. The count of the last
training forward before each ``backward`` is the micro-batch's.

Different sizes on different ranks are refused, not reweighted: reweighting would need the
global sample count before the gradient reduction, i.e. one more blocking collective in every
step. Equal sizes smaller than configured (the last batch of an epoch under a
DistributedSampler, which pads every rank to the same count) are accepted and counted exactly.

The check costs one all-gather of one integer per rank, at points every rank reaches together:
the first optimizer step and every ``CHECK_EVERY`` steps; a checkpoint save also compares the
counts, through its store handshake rather than a collective (a save made by only some ranks
must still fail fast there), so a saved ``global_samples`` is verified. Between checks nothing is communicated; each rank sums what
it saw since the last check, so a mismatch in any step shows at the next check, which raises
on every rank with each rank's count. No check is made inside the hot loop of other steps,
because only the rank whose batch changed would know to join it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.distributed import collectives

CHECK_EVERY = 50  # optimizer steps between checks after the first step


def leading_dim(value: Any) -> int | None:
    """The leading dimension of the first tensor in ``value`` (nested lists, tuples, dicts), or None."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = leading_dim(item)
            if found is not None:
                return found
    return None


class SampleCounter:
    """The engine's sample bookkeeping: fed by forward and backward, read at each optimizer step."""

    def __init__(self, *, micro_batch_size: int, data_size: int, data_group: Any, device: torch.device) -> None:
        self._micro = micro_batch_size
        self._data_size = data_size
        self._group = data_group
        self._device = device
        self._last_forward: int | None = None
        self._window = 0  # this rank's samples in the accumulation window so far
        self._unchecked = 0  # this rank's samples since the last check
        self._first_unchecked_step = 1
        self.checks = 0  # checks made (observability and tests)

    def observe_forward(self, args: tuple, kwargs: dict) -> None:
        """A training forward ran on these inputs."""
        found = leading_dim((args, kwargs))
        self._last_forward = found if found is not None else self._micro

    def end_micro_batch(self) -> None:
        """``backward`` ran: the last training forward's samples are one micro-batch of this window."""
        self._window += self._last_forward if self._last_forward is not None else self._micro
        self._last_forward = None

    def drop_window(self) -> None:
        """``zero_grad`` dropped the window's gradients: its samples were not trained on."""
        self._window = 0

    def end_step(self, *, global_steps: int) -> int:
        """An optimizer step consumed the window: return the global samples it trained on.

        ``global_steps`` is the number of this step (1 for the first). Checks every rank's
        count at the first step and every :data:`CHECK_EVERY` steps.
        """
        local, self._window = self._window, 0
        self._unchecked += local
        if global_steps == 1 or global_steps % CHECK_EVERY == 0:
            self.verify(last_step=global_steps)
        return local * self._data_size

    @property
    def unchecked(self) -> int:
        """This rank's samples since the last check (what a checkpoint handshake exchanges)."""
        return self._unchecked

    def verify(self, *, last_step: int) -> None:
        """Every data-parallel rank must have trained on as many samples since the last check."""
        if self._data_size > 1 and dist.is_initialized():
            mine = torch.tensor([self._unchecked], dtype=torch.int64, device=self._device)
            every = torch.empty(self._data_size, dtype=torch.int64, device=self._device)
            collectives.all_gather_into_tensor(every, mine, group=self._group, purpose="micro-batch size check")
            self.check_counts(every.tolist(), last_step=last_step)
        else:
            self.check_counts([self._unchecked], last_step=last_step)

    def check_counts(self, counts: list[int], *, last_step: int) -> None:
        """Refuse unequal per-rank counts (every rank's :attr:`unchecked`, gathered by the caller)."""
        self.checks += 1
        if len(set(counts)) > 1:
            self._raise(counts, last_step)
        self._unchecked = 0
        self._first_unchecked_step = last_step + 1

    def _raise(self, counts: list[int], last_step: int) -> None:
        steps = (f"step {last_step}" if self._first_unchecked_step >= last_step
                 else f"steps {self._first_unchecked_step}-{last_step}")
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ValueError(
            f"micro-batches of different sizes on different data-parallel ranks: in {steps} the ranks trained on "
            f"{listing} samples (train_micro_batch_size_per_gpu is {self._micro}). The gradient average weights every "
            "rank alike, so it is only the global-batch mean when every rank's micro-batches hold the same number of "
            "samples. Give every rank equal batches: a DistributedSampler (it pads every rank to the same count) with "
            "the same batch size everywhere, drop_last=True, or initialize(training_data=...)"
        )
