"""The host optimizer step of ZeRO-Offload, pipelined with the parameter upload.

Without it an offloaded step is: the host steps the whole fp32 partition, then the new weights
go up to the accelerator and are all-gathered. Here the host steps the partition one write-back
bucket at a time and hands each finished bucket to the upload at once: its host-to-device copy
and all-gather run on the accelerator while the host steps the next bucket, so only the last
bucket's upload is exposed.

Each bucket's range is stepped by a throw-away optimizer of the inner optimizer's class whose
one parameter is a view of the master range, and whose state tensors are views of the inner
optimizer's whole-partition state: ``inner.state`` stays the single source of truth (for
checkpoints, for the next step), and no state is copied.

Limited to torch's Adam and AdamW (whose state is ``step`` plus tensors shaped like the
parameter) and to ZeRO stages 1-2 (ZeRO-3 refreshes its parameter shards whole); other setups
take the unpipelined path. Ranges start at multiples of 64 elements: torch's fused CPU kernel
vectorises in chunks, and aligned ranges give bit-identical results to one whole-partition call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from partita.optim.fused_adam_range import adam_state
from partita.optim.host_adamw_compiled import host_adamw_step

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup
    from partita.zero.sharded_optimizer import ShardedOptimizer

_ALIGN = 64
_PIPELINED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def can_pipeline(optimizer: ShardedOptimizer) -> bool:
    """Whether the offloaded groups of ``optimizer`` can step bucket by bucket now.

    Needs their whole-partition state to exist already (the first step creates it, with
    torch's own initialisation, on the unpipelined path).
    """
    inner = optimizer.inner
    if type(inner) not in _PIPELINED_CLASSES or optimizer.param_store is not None or optimizer.swapper is not None:
        return False
    offloaded = [g for g in optimizer.groups if g.offloaded]
    return bool(offloaded) and all(_has_state(inner, g.master) for g in offloaded)


def reads_16bit_grads(inner: torch.optim.Optimizer, g: int, group: ShardedParamGroup) -> bool:
    """Whether offloaded group ``g`` can keep its host gradient partition in the model's 16-bit
    dtype and be stepped by :func:`partita.optim.host_adamw_compiled.host_adamw_step`: torch's
    fused Adam/AdamW (decoupled weight decay, or none) without amsgrad/maximize/capturable, one
    unsharded partition (one rank: reduced gradients arrive unscaled, so 16 bits hold them exactly)."""
    if type(inner) not in _PIPELINED_CLASSES or not group.offloaded or group.layout.num_shards != 1:
        return False
    if group.model_dtype not in (torch.bfloat16, torch.float16) or (group.comm is not None and group.comm.size != 1):
        return False
    options = inner.param_groups[g]
    decoupled = isinstance(inner, torch.optim.AdamW) or options.get("decoupled_weight_decay", False)
    return (bool(options.get("fused")) and not options["amsgrad"] and not options["maximize"]
            and not options.get("capturable") and not options.get("differentiable")
            and not isinstance(options["lr"], torch.Tensor) and (decoupled or options["weight_decay"] == 0))


def _host_grad(optimizer: ShardedOptimizer, g: int) -> torch.Tensor | None:
    """Group ``g``'s gradient for this step: its master's ``.grad``, or its 16-bit partition."""
    return optimizer.grads_16bit.get(g, optimizer.groups[g].master.grad)


@torch.no_grad()
def step_16bit_groups(optimizer: ShardedOptimizer) -> None:
    """Step the offloaded groups holding 16-bit gradients whole (the first step, which creates
    their state as torch does, and any step that does not go bucket by bucket)."""
    inner, options = optimizer.inner, snapshot_options(optimizer)
    for g, grad in optimizer.grads_16bit.items():
        master = optimizer.groups[g].master
        state = adam_state(inner, master, options[g])
        _step_range(options[g], master, grad, state, state["step"], 0, master.numel(), options[g]["_grad_scale"])
        state["step"] += 1


def _has_state(inner: torch.optim.Optimizer, master: torch.Tensor) -> bool:
    state = inner.state.get(master, {})
    return "step" in state and "exp_avg" in state


@torch.no_grad()
def step_and_upload(optimizer: ShardedOptimizer, restore_unused) -> None:
    """Step every group (masters' ``.grad`` already set) and write the new weights back.

    On-accelerator groups step in one call of the inner optimizer, then the offloaded groups
    step bucket by bucket, each bucket written back as soon as it is stepped.
    ``restore_unused(g, start, end)`` puts back the state of parameters that got no gradient
    within partition elements ``[start, end)`` of group ``g`` before they are written back.
    """
    held = step_accelerator_groups(optimizer, restore_unused)
    step_offloaded_groups(optimizer, held, restore_unused, snapshot_options(optimizer))


def snapshot_options(optimizer: ShardedOptimizer) -> list[dict]:
    """Each group's options (lr, betas, ...) and the fused kernel's ``grad_scale`` as they are
    now: a step that runs on after ``step()`` returns must not see the LR scheduler's next rate."""
    inner = optimizer.inner
    grad_scale = getattr(inner, "grad_scale", None)
    return [{**{k: v for k, v in group.items() if k != "params"}, "_grad_scale": grad_scale, "_class": type(inner)}
            for group in inner.param_groups]


def step_accelerator_groups(optimizer: ShardedOptimizer, restore_unused) -> dict[int, torch.Tensor | None]:
    """The inner optimizer's step over the groups that are not offloaded (offload ratio < 1),
    which also runs its step hooks; returns the offloaded groups' held-back gradients."""
    inner = optimizer.inner
    offloaded = [g for g, group in enumerate(optimizer.groups) if group.offloaded]
    held = {g: _host_grad(optimizer, g) for g in offloaded}
    for g in offloaded:
        optimizer.groups[g].master.grad = None  # the inner call below skips them
    inner.step()  # on-accelerator groups (ratio < 1); also runs the optimizer's step hooks
    for g, group in enumerate(optimizer.groups):
        if g not in held:
            restore_unused(g, 0, group.master.numel())
            optimizer.write_back_group(g)
    return held


def step_offloaded_groups(optimizer: ShardedOptimizer, held: dict[int, torch.Tensor | None], restore_unused,
                          options: list[dict], on_bucket=None, *, forward_order: bool = False,
                          write_back: bool = True, before_bucket=None) -> None:
    """Step the offloaded groups bucket by bucket, writing each bucket back once stepped;
    ``on_bucket(g, b)`` is told when bucket ``b`` of group ``g`` has been written back.
    ``forward_order``: buckets (and groups) in the reverse of the layout's order, which is the
    order the forward uses the parameters in (the layout follows backward's).
    ``write_back=False`` (the delayed update, which lands later) only steps;
    ``before_bucket(g, b)`` runs before bucket ``b``'s range is stepped."""
    groups = list(held)[::-1] if forward_order else list(held)
    for g in groups:
        group = optimizer.groups[g]
        grad = held[g]
        group.master.grad = grad if grad is None or grad.dtype == group.master.dtype else None
        if grad is None:  # no gradient anywhere in the group: torch would skip it
            if write_back:
                optimizer.write_back_group(g)
            for b in range(len(optimizer.bucket_layout(g))):
                on_bucket is not None and on_bucket(g, b)
            continue
        _step_group_by_bucket(optimizer, g, grad, restore_unused, options[g], on_bucket, forward_order, write_back,
                              before_bucket)


def _step_group_by_bucket(optimizer: ShardedOptimizer, g: int, grad: torch.Tensor, restore_unused, options: dict,
                          on_bucket, forward_order: bool, write_back: bool = True, before_bucket=None) -> None:
    """Each bucket's range is stepped before the bucket is written back. In layout order a
    range ends at the bucket's end rounded up to ``_ALIGN`` (the next bucket's first elements
    are stepped with it); in forward order see :func:`forward_bucket_steps`."""
    if forward_order:
        steps, done = forward_bucket_steps(optimizer, g, grad, restore_unused, options, on_bucket,
                                           write_back=write_back, before_bucket=before_bucket)
        for _, run in steps:
            run()
        done()
        return
    inner = optimizer.inner
    group = optimizer.groups[g]
    master, state = group.master, inner.state[group.master]
    numel = master.numel()
    grad_scale = options["_grad_scale"]
    step_before = state["step"].clone()
    stepped = 0
    for b, bucket in enumerate(optimizer.bucket_layout(g)):
        end = min(-(-bucket.partition_end // _ALIGN) * _ALIGN, numel)
        if end > stepped:
            _step_range(options, master, grad, state, step_before, stepped, end, grad_scale)
            stepped = end
        restore_unused(g, 0, stepped)
        optimizer.write_back_group(g, [bucket])
        if on_bucket is not None:
            on_bucket(g, b)
    if stepped < numel:  # padding after the last bucket
        _step_range(options, master, grad, state, step_before, stepped, numel, grad_scale)
    state["step"].copy_(step_before + 1)


def forward_bucket_steps(optimizer: ShardedOptimizer, g: int, grad: torch.Tensor, restore_unused, options: dict,
                         on_bucket, *, write_back: bool = True, before_bucket=None):
    """Offloaded group ``g``'s step in the forward's order (last bucket first), as separate
    calls: ``([(b, run), ...], done)``; each ``run()`` steps bucket ``b``'s range and writes
    the bucket back, ``done()`` (after the last) counts the step. Separate calls so that the
    overlapped step can interleave several groups' buckets (partita/offload/tiered_overlap.py).

    A range starts at its bucket's start rounded down to ``_ALIGN`` (the previous bucket's last
    elements are stepped with it), so each bucket is whole when it goes up."""
    inner = optimizer.inner
    group = optimizer.groups[g]
    master, state = group.master, inner.state[group.master]
    numel = master.numel()
    grad_scale = options["_grad_scale"]
    step_before = state["step"].clone()
    buckets = list(enumerate(optimizer.bucket_layout(g)))
    starts = [0] + [bucket.partition_start // _ALIGN * _ALIGN for _, bucket in buckets[1:]]
    ends = starts[1:] + [numel]

    def run(b: int, bucket, lo: int, hi: int) -> None:
        if before_bucket is not None:
            # The range reaches into the previous (later-stepped) bucket's first elements
            # only up to the rounding: wait for both buckets it touches.
            before_bucket(g, b)
            if b > 0 and lo < bucket.partition_start:
                before_bucket(g, b - 1)
        if hi > lo:
            _step_range(options, master, grad, state, step_before, lo, hi, grad_scale)
        restore_unused(g, lo, numel)
        if write_back:
            optimizer.write_back_group(g, [bucket])
        if on_bucket is not None:
            on_bucket(g, b)

    def done() -> None:
        state["step"].copy_(step_before + 1)

    steps = [(b, lambda b=b, bucket=bucket, lo=lo, hi=hi: run(b, bucket, lo, hi))
             for (b, bucket), lo, hi in reversed(list(zip(buckets, starts, ends)))]
    return steps, done


def _step_range(options: dict, master: torch.Tensor, grad: torch.Tensor, state: dict, step_before: torch.Tensor,
                lo: int, hi: int, grad_scale: torch.Tensor | None) -> None:
    """Step master elements ``[lo, hi)`` with the group's options as snapshotted: a 16-bit
    ``grad`` by the compiled host AdamW (bit-identical to the fused kernel on its upcast), an
    fp32 one by torch's kernel through a throw-away optimizer over a view of the range."""
    if grad.dtype != master.dtype:
        beta1, beta2 = options["betas"]
        host_adamw_step(master[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi], grad[lo:hi],
                        step=int(step_before.item()) + 1, lr=options["lr"], beta1=beta1, beta2=beta2,
                        eps=options["eps"], weight_decay=options["weight_decay"], grad_scale=grad_scale)
        return
    proxy = master[lo:hi]  # a view of a tensor that needs no grad: a leaf torch can optimise
    proxy.grad = grad[lo:hi]
    ranged = options["_class"]([{"params": [proxy], **{k: v for k, v in options.items() if not k.startswith("_")}}])
    if grad_scale is not None:
        ranged.grad_scale = grad_scale  # the step's unscale + clip, applied in the fused kernel
    ranged.state[proxy] = {
        key: (step_before.clone() if key == "step" else value[lo:hi])
        for key, value in state.items()
    }
    ranged.step()
