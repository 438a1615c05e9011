"""FP8 weight all-gather at ZeRO-3 (``fp8.all_gather``, tensorwise): a unit's Float8Linear weights
travel as float8_e4m3fn, one byte per element, with one scale per weight shared by the ZeRO group.

[Note: the FP8 wire]
torchao's FSDP2 version (``enable_fsdp_float8_all_gather``) wraps each weight in a tensor subclass
whose all-gather hooks FSDP2 calls; partita's flat shards have no such hooks, and torchao's flag
would replace the Parameter objects that partita's groups and masters hold. So the wire is built
here, on the same seam as ZeRO++'s int8 gather (a ``dequantize(wire)`` object in the flight):

1. each rank takes the abs-max of its shard of every FP8 weight in the gather (padding is zero,
   so it never raises an amax), and ONE all-reduce (max) of that small vector gives every rank the
   whole weight's amax: the same amax the weight's own tensorwise cast would compute;
2. the scale is torchao's (``amax_to_scale``: e4m3's max / amax in fp64, stored fp32) and the
   cast torchao's (fp32 multiply, saturating cast), so each shard's bytes are exactly the bytes
   of the whole weight cast in one process with that scale;
3. the all-gather moves the float8 bytes as uint8 (gloo and NCCL both move bytes);
4. every rank rebuilds the weight in the model dtype as ``fp8 / scale`` (torchao's
   ``to_original_precision``). The Float8Linear then casts that weight again with its own dynamic
   scale; its amax is the amax sent (the largest element maps to e4m3's max, a value e4m3 holds),
   so the second cast lands on the same grid and the forward sees the FP8 weight it would have.

Rebuilding rather than handing torchao a ``Float8TrainingTensor`` keeps the parameter an ordinary
tensor: the gatherer's unpacking, gradient hooks, activation checkpointing and compile see what
they see without FP8 gathers. The cost is one extra cast per weight per gather (elementwise,
fused under compile), against a matmul's worth of compute.

Gathers outside units (holds, exports, checkpoints) stay exact: the masters are never touched,
only the weights the forward and backward use.

[Note: per-step scales]
Step 1 costs one small all-reduce per unit gather, and ZeRO-3 gathers each unit twice a step
(forward and backward): 2 x units latency-bound collectives. The weights only change in the
optimizer step, so every gather between two steps computes the same amax. torchao's FSDP2 path
has ``precompute_float8_dynamic_scale_for_fsdp`` for this: after the step, one all-reduce of
every weight's amax. :func:`precompute_fp8_scales` is partita's version for its flat shards: it
takes each FP8-gathered weight's local shard once the shards follow the new masters, all-reduces
the vector of their amaxes in ONE collective, and stores each weight's scale on its Parameter;
:func:`start_fp8_all_gather` given those scales (:func:`precomputed_fp8_scales`) skips its own
all-reduce. The amax is a max (exact in any order) and ``amax_to_scale`` is elementwise, so the
scales, the FP8 bytes and the rebuilt weights equal the per-gather path's bit for bit.

A stored scale is right only while the shards are those it was computed from: whatever writes
the shards (the step's write-back, ``GatheredParameters`` with a modifier, a checkpoint load)
must call :func:`precompute_fp8_scales` again, or :func:`forget_fp8_scales` (the gathers then
all-reduce per gather again). A stale scale would saturate a weight that grew.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from partita.config.base import ConfigError
from partita.distributed import collectives

__all__ = [
    "FP8_DTYPE", "mark_fp8_all_gather", "is_fp8_gathered", "start_fp8_all_gather", "Fp8Gather",
    "precompute_fp8_scales", "precomputed_fp8_scales", "forget_fp8_scales", "refresh_fp8_scales",
    "refresh_gatherer_fp8_scales",
]

logger = logging.getLogger("partita")

FP8_DTYPE = torch.float8_e4m3fn  # torchao's forward dtype for weights (e5m2 is for gradients)
# Set on a Float8Linear's weight Parameter: its unit gathers go as FP8. On the Parameter, not in a
# set the gatherer holds: it is built later than the model is converted, and the Parameter object
# is what both see (Float8Linear keeps the plain linear's Parameter, see partita/precision/fp8.py).
_MARK = "_partita_fp8_all_gather"
# The weight's group-wide scale for the current shards (fp32, 0-dim), see [Note: per-step scales].
_SCALE = "_partita_fp8_scale"
PRECOMPUTE_PURPOSE = "fp8 amax precompute (every FP8-gathered weight)"


def mark_fp8_all_gather(model: nn.Module, *, zero_stage: int) -> list[str]:
    """Make the unit gathers of every Float8Linear weight in ``model`` travel as FP8; returns the
    names of the marked weights. ``zero_stage``: the run's stage (only stage 3 gathers weights)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if zero_stage != 3:
        raise ConfigError(
            f"fp8.all_gather needs zero_optimization.stage 3 (it is {zero_stage}): only ZeRO-3 all-gathers the "
            "weights before each unit; set the stage to 3, or remove fp8.all_gather"
        )
    # Every module that holds each Parameter itself: a weight tied to a module that is not a Float8Linear
    # (GPT's output head and its token embedding) must reach that module exactly, so it is not marked.
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append((name, module))
    marked, tied = [], []
    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        others = [n for n, m in holders.get(id(module.weight), []) if not isinstance(m, Float8Linear)]
        if others:
            tied.append(f"{name}.weight (tied to {', '.join(others)})")
            continue
        weight_cast = module.config.cast_config_weight
        if weight_cast.scaling_granularity is not ScalingGranularity.TENSORWISE or (
            weight_cast.scaling_type is not ScalingType.DYNAMIC
        ):
            raise ConfigError(
                f"fp8.all_gather is tensorwise only, but {name} casts its weight with "
                f"{weight_cast.scaling_granularity.value} scaling: one scale per weight is what lets every rank cast "
                "its own shard; set fp8.recipe to \"tensorwise\", or remove fp8.all_gather"
            )
        setattr(module.weight, _MARK, True)
        marked.append(f"{name}.weight")
    if tied:
        logger.info("fp8.all_gather: gathered exactly, as other modules read them too: %s", "; ".join(tied))
    if not marked:
        reason = "every FP8 linear's weight is tied to another module" if tied else "fp8.filter chose none"
        raise ConfigError(
            f"fp8.all_gather is set but no linear runs in FP8 with a weight of its own ({reason}), so no gather "
            "would change; widen fp8.filter, or remove fp8.all_gather"
        )
    return marked


def is_fp8_gathered(param: nn.Parameter) -> bool:
    return getattr(param, _MARK, False)


@dataclass(slots=True)
class Fp8Gather:
    """An FP8 all-gather of several weights' shards (packed in columns), in flight."""

    spans: list[tuple[int, int]]  # (first column, shard elements) of each weight
    scales: torch.Tensor  # fp32 (weights,): the group's shared scale of each
    dtype: torch.dtype  # the model dtype to rebuild in

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        """The gathered (world, columns) uint8 rows as values of the model dtype."""
        fp8 = wire.view(FP8_DTYPE)
        out = torch.zeros(wire.shape, dtype=self.dtype, device=wire.device)
        for (lo, n), scale in zip(self.spans, self.scales):
            out[:, lo : lo + n] = (fp8[:, lo : lo + n].to(torch.float32) / scale).to(self.dtype)
        return out


def _shard_amax(shard: torch.Tensor) -> torch.Tensor:
    # Padding is zero and an empty shard (a rank past the end of a small weight) counts as 0: neither
    # raises the group's max.
    return shard.abs().max().to(torch.float32) if shard.numel() else shard.new_zeros((), dtype=torch.float32)


def precompute_fp8_scales(
    shards: Sequence[tuple[nn.Parameter, torch.Tensor]], *, group: dist.ProcessGroup | None,
    dtype: torch.dtype | None = None,
) -> None:
    """After the shards changed (the optimizer step's write-back): ONE all-reduce (max) of the
    amaxes of every FP8-gathered weight's local ``shard``, and each weight's scale stored on its
    Parameter for the gathers until the next change (see [Note: per-step scales]).

    ``shards``: (weight, this rank's shard of it) in an order that is the same on every rank of
    ``group`` (the ZeRO group the weights are gathered over). ``dtype``: the dtype the gathers
    send from (the model dtype) when a shard is held in higher precision (a gather that casts
    the fp32 master as it copies): each amax is rounded to it, which is the amax of the cast
    shard (rounding is monotonic and symmetric), so the scale is the per-gather path's."""
    from torchao.float8.float8_utils import amax_to_scale

    if not shards:
        return
    amax = torch.stack([
        _shard_amax(shard) if dtype is None else _shard_amax(shard).to(dtype).to(torch.float32) for _, shard in shards
    ])
    collectives.all_reduce(amax, group=group, purpose=PRECOMPUTE_PURPOSE, op=dist.ReduceOp.MAX)
    for (param, _), scale in zip(shards, amax_to_scale(amax, FP8_DTYPE)):
        setattr(param, _SCALE, scale)


def refresh_fp8_scales(
    params: Iterable[nn.Parameter],
    shard_of: Callable[[nn.Parameter], tuple[torch.Tensor, torch.dtype]] | None,
    *, group: dist.ProcessGroup | None,
) -> None:
    """The ZeRO-3 gatherer's call once its shards changed (``refresh_shards``: the step's write-back,
    a checkpoint load, ``GatheredParameters`` with a modifier): precompute the scales of the
    FP8-gathered weights among ``params`` (the trainable parameters gathered over ``group``, the
    same order on every rank), or forget them where a precompute cannot see the shards.

    ``shard_of(param)``: (this rank's shard, as a view of the storage, and the dtype gathers send);
    None when the shards are not on the device (``offload_param``): those gathers all-reduce per gather."""
    marked = [param for param in params if is_fp8_gathered(param)]
    if not marked:
        return
    if shard_of is None:
        forget_fp8_scales(marked)
        return
    shards = [(param, *shard_of(param)) for param in marked]
    dtypes = {dtype for _, _, dtype in shards}
    if len(dtypes) > 1:  # one vector, one rounding: weights gathered in several dtypes keep the per-gather path
        forget_fp8_scales(marked)
        return
    precompute_fp8_scales([(param, shard) for param, shard, _ in shards], group=group, dtype=dtypes.pop())


def refresh_gatherer_fp8_scales(where: dict, groups: Sequence, storage, *, group: dist.ProcessGroup | None,
                                world_size: int) -> None:
    """:func:`refresh_fp8_scales` for the ZeRO-3 gatherer's own layout, its call in ``refresh_shards``:
    ``where`` maps each trainable sharded parameter to (group index, ShardSpec); ``groups`` are the
    ShardedParamGroups (their ``comm`` and ``model_dtype``); ``storage`` the shard storage. Only the
    weights gathered over ``group`` (the gatherer's ZeRO group) are precomputed; expert weights
    gathered within their expert-data group keep the per-gather all-reduce."""
    if world_size == 1:
        return  # one rank gathers nothing

    def shard_of(param: nn.Parameter) -> tuple[torch.Tensor, torch.dtype]:
        g, spec = where[param]  # a view; a group on the device may keep its fp32 master as the shard
        lo = spec.partition_offset
        return storage.shards[g][lo : lo + spec.shard_numel], groups[g].model_dtype

    params = [param for param, (g, _) in where.items() if groups[g].comm.process_group is group]
    refresh_fp8_scales(params, shard_of if storage.location == "accelerator" else None, group=group)


def precomputed_fp8_scales(params: Sequence[nn.Parameter]) -> torch.Tensor | None:
    """The stored scales of ``params`` as one fp32 vector, or None unless every one has one (the
    gather then all-reduces its own amaxes)."""
    scales = [getattr(param, _SCALE, None) for param in params]
    if not scales or any(scale is None for scale in scales):
        return None
    return torch.stack(scales)


def forget_fp8_scales(params: Iterable[nn.Parameter]) -> None:
    """Drop the stored scales (shards written without a new precompute): gathers all-reduce again."""
    for param in params:
        if hasattr(param, _SCALE):
            delattr(param, _SCALE)


def start_fp8_all_gather(
    local: torch.Tensor, spans: list[tuple[int, int]], *, size: int, group: dist.ProcessGroup | None, purpose: str,
    scales: torch.Tensor | None = None,
) -> tuple[dist.Work | None, torch.Tensor, Fp8Gather]:
    """All-gather ``local`` (1-D: the weights' shards at ``spans``) as float8_e4m3fn with one
    group-wide scale per weight (see the module note); returns the Work, the uint8 buffer it fills
    (size, local.numel()) and what turns that buffer into model-dtype values.

    ``scales``: the weights' scales from :func:`precompute_fp8_scales` (one per span, in span order):
    no amax all-reduce here. None: this gather all-reduces its weights' amaxes itself."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    if scales is None:
        amax = torch.stack([_shard_amax(local[lo : lo + n]) for lo, n in spans])
        collectives.all_reduce(amax, group=group, purpose=f"fp8 amax {purpose}", op=dist.ReduceOp.MAX)
        scales = amax_to_scale(amax, FP8_DTYPE)
    elif scales.shape != (len(spans),):
        raise ValueError(
            f"start_fp8_all_gather got {tuple(scales.shape)} scales for {len(spans)} weights; pass one precomputed "
            "scale per span (precomputed_fp8_scales of the gathered weights, in span order), or None"
        )
    mine = torch.zeros(local.numel(), dtype=FP8_DTYPE, device=local.device)
    for (lo, n), scale in zip(spans, scales):
        mine[lo : lo + n] = to_fp8_saturated(local[lo : lo + n].to(torch.float32) * scale, FP8_DTYPE)
    wire = torch.empty((size, local.numel()), dtype=torch.uint8, device=local.device)
    work = collectives.all_gather_into_tensor(wire.view(-1), mine.view(torch.uint8), group=group,
                                              purpose=f"fp8 {purpose}", async_op=True)
    return work, wire, Fp8Gather(spans, scales, local.dtype)
