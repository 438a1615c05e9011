"""One process, fused Adam/AdamW or 8-bit Adam/Lion: the optimizer step reads the gradients from
``param.grad`` and the fp32 gradient partition is never built
(``zero_optimization.one_rank_gradient_fold "stream"``).

[Note: the streamed step]
Why: at one rank the fp32 gradient partition (4 bytes per parameter) is the largest thing that
exists only for the step. Folding early puts it beside the activations backward has not freed
yet; folding at the end puts it beside every full-size ``param.grad``. Either way it is on the
peak: GPT-1.3B at micro-batch 1 peaked 2.1 GiB above FSDP2, whose fp32 gradients are made per
parameter as backward reaches them. Here the model-dtype ``param.grad``s (2 bytes per parameter)
are the only gradients: the reducer leaves them where autograd put them (as "end" does), the
global norm is summed over them, and the step walks each group's flat fp32 master in ranges of
``CHUNK_NUMEL`` elements. For each range it casts the gradients covering it into one fp32 buffer
(the cast the fold would have made into the partition; zeros where a parameter got no gradient),
steps master, ``exp_avg`` and ``exp_avg_sq`` over that range with torch's fused Adam/AdamW
(``torch.optim.adam.adam``, ``fused=True``), and frees each ``param.grad`` it has finished with.
bitsandbytes' block-wise 8-bit optimizers step the same ranges through their own ``update_step``
on views of the codes and block scales, as ``partita.optim.eight_bit.step_eight_bit`` steps a
partition in chunks (blocks of 256 elements are independent, so this is exact).
The peak of the step is then the model-dtype gradients plus one buffer, instead of the partition
plus (at the end fold) those gradients.

Why flat ranges and not one tensor per parameter: torch's CPU kernel computes the last
``numel % vector width`` elements of each tensor on a scalar path that rounds differently, so
per-parameter tensors would not be bitwise the flat step. Ranges starting at multiples of
``CHUNK_NUMEL`` (a power of two) put every element in the same lane as the flat step does, and
each element's update is then bitwise the partition's (tests/test_streamed_step.py). The step
counter and the moments are torch's own (``inner.state[master]``, created on the first step as
``Adam._init_group`` does), so checkpoints are those of the other rules and load under any of them.

The one difference: the global norm is summed per gradient (``torch._foreach_norm``), not over the
flat fp32 partition, so it can differ in its last bits, and so can the clip coefficient when
clipping is active. With clipping inactive (or off) the run is bitwise the other rules'.

At stages 0-2 the blocks' 16-bit weights come back before their backward and stay, as with
"early" (one_rank_weights.py), so the model is whole when ``engine.backward`` returns. The
write-back after the step is one ``torch._foreach_copy_`` per group from the new master, with no
cast buffer.
"""

from __future__ import annotations

from functools import partial

import torch

from partita.optim import eight_bit
from partita.optim.eight_bit import PER_BLOCK_KEYS, PER_ELEMENT_KEYS, block_span
from partita.optim.fused_adam_range import adam_state, fused_adam_optimizer, step_adam_range
from partita.zero.shard_group import ShardedParamGroup

__all__ = ["CHUNK_NUMEL", "STREAMABLE_EIGHT_BIT", "StreamedStep", "streamable_optimizer"]

CHUNK_NUMEL = 1 << 24
"""Master elements stepped per fused call (a power of two, see the note): a 64 MiB fp32 buffer."""


STREAMABLE_EIGHT_BIT = ("AdamW8bit", "Adam8bit", "Lion8bit")
"""bitsandbytes' block-wise optimizers the streamed step drives (the paged ones keep their states in
pages it does not slice)."""


def streamable_optimizer(inner: torch.optim.Optimizer) -> bool:
    """Whether the streamed step can drive ``inner``: torch's fused Adam/AdamW, or one of
    :data:`STREAMABLE_EIGHT_BIT`."""
    if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
        return fused_adam_optimizer(inner)
    return type(inner).__module__.startswith("bitsandbytes") and type(inner).__name__ in STREAMABLE_EIGHT_BIT


class StreamedStep:
    """Steps ``inner`` (torch's fused Adam/AdamW, or a bitsandbytes block-wise 8-bit optimizer,
    over one flat master per group) from the model's ``param.grad`` in fp32 ranges (see the
    module docstring)."""

    def __init__(self, groups: list[ShardedParamGroup], inner: torch.optim.Optimizer) -> None:
        self._groups = groups
        self._inner = inner
        self._eight_bit = type(inner).__module__.startswith("bitsandbytes")
        self._sources: list[tuple | None] = [None] * len(groups)  # write_back's cached master views

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self._groups for p in group.params if p.grad is not None]

    def grad_norm_sq(self) -> float:
        """The squared global L2 norm of the (still scaled) gradients, summed per gradient in fp32."""
        grads = self.grads()
        if not grads:
            return 0.0
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return float(torch.stack(norms).square().sum())

    def discard(self) -> None:
        """A skipped step (inf/nan): drop the gradients."""
        for group in self._groups:
            for param in group.params:
                param.grad = None

    @torch.no_grad()
    def step(self, multiplier: float) -> None:
        """One step of every group that got a gradient. ``multiplier`` (unscale and clip) is
        applied as the flat step applies it: inside torch's fused kernel as its ``grad_scale``
        divisor, or (8-bit) multiplied into the gradients first."""
        if self._eight_bit and not getattr(self._inner, "initialized", True):
            # What bitsandbytes' step() does before its first update (per-parameter overrides,
            # state placement); update_step alone skips it.
            self._inner.check_overrides()
            self._inner.to_gpu()
            self._inner.initialized = True
        grad_scale = torch.tensor(1.0 / multiplier, dtype=torch.float32) if multiplier != 1.0 else None
        self._step_ranges(multiplier, grad_scale)
        # The inner optimizer's own step() once, over masters without .grad (so its math is a no-op):
        # an LR scheduler then sees the optimizer stepped before it (torch warns otherwise), and
        # hooks registered with register_step_post_hook run, as after the flat step.
        if any(g.master.grad is not None for g in self._groups):
            raise RuntimeError("partita: a master has a .grad in the streamed step; it steps from param.grad only")
        self._inner.step()

    def _step_ranges(self, multiplier: float, grad_scale: torch.Tensor | None) -> None:
        for g, (group, options) in enumerate(zip(self._groups, self._inner.param_groups)):
            if any(p.grad is not None for p in group.params):  # else the flat step skips it (master.grad None)
                if self._eight_bit:
                    # Never past what one bitsandbytes call may step (a multiple of its blocks).
                    size = min(CHUNK_NUMEL, eight_bit.chunk_limit(group.master) or CHUNK_NUMEL)
                    self._step_group(group, partial(self._eight_bit_range, g, options, multiplier), size)
                else:
                    self._step_group(group, partial(self._adam_range, options, grad_scale), CHUNK_NUMEL)

    def _step_group(self, group: ShardedParamGroup, step_range, size: int) -> None:
        """Walk the group's master in ranges of ``size`` elements: fill one fp32 buffer from the
        gradients covering the range, ``step_range(master, lo, hi, grad)``, free the gradients
        stepped whole."""
        master = group.master
        numel = master.numel()
        buffer = torch.empty(min(size, numel), dtype=torch.float32, device=master.device)
        specs = group.layout.specs
        first = 0  # the first spec not wholly stepped yet
        for lo in range(0, numel, size):
            hi = min(lo + size, numel)
            grad = buffer[: hi - lo]
            filled = lo
            i = first
            while i < len(specs) and specs[i].partition_offset < hi:
                spec = specs[i]
                start, end = max(lo, spec.partition_offset), min(hi, spec.partition_offset + spec.numel)
                if start > filled:
                    grad[filled - lo : start - lo].zero_()  # layout padding (8-bit: whole blocks)
                param = group.params[spec.index]
                if end > start:
                    piece = grad[start - lo : end - lo]
                    if param.grad is None:
                        piece.zero_()  # stepped as zeros and restored (partita.zero.unused_params.restore_unused)
                    else:
                        offset = start - spec.partition_offset
                        piece.copy_(param.grad.reshape(-1)[offset : offset + (end - start)])
                    filled = end
                if spec.partition_offset + spec.numel > hi:
                    break  # continues in the next range
                param.grad = None  # wholly in the buffers stepped so far: free it
                i += 1
            first = i
            if filled < hi:
                grad[filled - lo :].zero_()
            step_range(master, lo, hi, grad)
        self._inner.state[master]["step"] += 1  # once per group and step, as torch and bitsandbytes count

    def _adam_range(self, options: dict, grad_scale: torch.Tensor | None, master: torch.Tensor, lo: int, hi: int,
                    grad: torch.Tensor) -> None:
        state = adam_state(self._inner, master, options)
        step_adam_range(self._inner, options, master, lo, hi, grad, state["step"], grad_scale)

    def _eight_bit_range(self, g: int, options: dict, multiplier: float, master: torch.Tensor, lo: int, hi: int,
                         grad: torch.Tensor) -> None:
        """One range through bitsandbytes' own ``update_step`` on views of the master and of its
        block-wise states, as ``partita.optim.eight_bit.step_eight_bit`` steps a chunk (ranges
        start at multiples of ``CHUNK_NUMEL``, whole 256-element blocks)."""
        state = self._inner.state[master]
        if not state:
            self._inner.init_state(options, master, g, 0)
        if multiplier != 1.0:
            grad.mul_(multiplier)  # where the flat step scales the partition (not a fused Adam)
        chunk = master[lo:hi]
        chunk.grad = grad
        first, last = block_span(lo, hi)
        self._inner.state[chunk] = {
            key: value[lo:hi] if key in PER_ELEMENT_KEYS else value[first:last] if key in PER_BLOCK_KEYS else value
            for key, value in state.items()
        }
        try:
            self._inner.update_step(options, chunk, g, 0)  # counts the step in this copy of the dict
        finally:
            del self._inner.state[chunk]
            chunk.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Stages 0-2: the new master into the model."""
        for g, group in enumerate(self._groups):
            if group.aliases_params:
                continue  # the parameters are views of the master
            targets, sources = self._copy_pairs(g, group)
            torch._foreach_copy_(targets, sources)

    def _copy_pairs(self, g: int, group: ShardedParamGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The group's parameters' ``.data`` and their master views (cached while the master is
        the tensor, at the address, they were cut from: a checkpoint load may replace it)."""
        master = group.master
        cached = self._sources[g]
        if cached is None or cached[0] is not master or cached[1] != master.data_ptr():
            sources = [master[s.partition_offset : s.partition_offset + s.numel].view(s.shape) for s in group.layout.specs]
            cached = self._sources[g] = (master, master.data_ptr(), sources)
        return [group.params[s.index].data for s in group.layout.specs], cached[2]
