"""Transient communication buffers per rank: gradient reduce buckets, the all-gather that
writes updated weights back, and the parameters ZeRO-3 holds whole while units run.

These follow partita's code paths but are upper estimates of short-lived tensors (their
exact peak depends on timing), so their lines are marked ``exact=False``:

- reduce buckets (``partita/zero/reducer.py``): parameters in descending registration
  order across groups, cut into runs of at most ``reduce_bucket_size`` full-parameter
  elements; each bucket packs a ``(num_shards, bucket_shard_numel)`` matrix in the
  communication dtype, plus a reduce-scatter output row at stages 1-3. Up to ``_IN_FLIGHT``
  launched buckets stay alive next to the one being filled. No buckets at world size 1 or
  when stage 0 reduces fp32 gradients in place in the fp32 partition.
- write-back (``sharded_optimizer.write_back_params``), after the step: per all-gather
  bucket of each group's layout, this rank's slice cast to the model dtype (no copy in
  fp32) and the gathered ``(num_shards, shard)`` matrix; the previous bucket's matrix is
  still referenced while the next one is allocated. At stage 3 only buckets holding a
  persistent parameter are gathered. Nothing when the parameters alias the master.
- ZeRO-3 working set (``param_gatherer.py``): the root unit's parameters stay whole through
  forward and backward; the running unit is whole and the next units are prefetched up to
  ``stage3_prefetch_bucket_size`` elements; a unit whose backward comes within
  ``stage3_max_reuse_distance`` gathered elements stays whole after its forward (the last
  blocks), except at world size 1 with the shards on the accelerator, where no unit is kept
  across the forward's end (param_gatherer [Note: reuse]); nothing takes the whole elements
  past ``stage3_max_live_parameters``. One
  all-gather output buffer exists while a unit is unpacked; with ``offload_param`` also the
  device staging copy of this rank's shards it is gathered from (prefetch runs at world size
  1 too then: the gather is a host-to-device copy worth overlapping).
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.estimate.inputs import DTYPE_BYTES, Setup
from partita.estimate.model_info import ModelInfo
from partita.estimate.groups import zero_groups
from partita.estimate.result import BACKWARD, END_BACKWARD, START_BACKWARD, WRITE_BACK, Line
from partita.zero.reducer import _IN_FLIGHT  # launched buckets kept in flight (one rule, one place)

__all__ = ["IN_FLIGHT", "ReduceBucket", "bucket_bytes", "buffer_lines", "packs_buckets", "reduce_buckets"]

IN_FLIGHT = _IN_FLIGHT


@dataclass(frozen=True)
class ReduceBucket:
    """One gradient bucket: its per-rank element count and the registration indices it holds."""

    column: int
    orders: tuple[int, ...]


def reduce_buckets(info: ModelInfo, setup: Setup) -> list[ReduceBucket]:
    """The reducer's buckets (``GradientReducer._build_buckets``), in launch order."""
    entries = []
    for group in zero_groups(info, setup):
        for param, spec in zip(group.params, group.layout.specs):
            entries.append((param.order, spec.numel, spec.shard_numel))
    entries.sort(key=lambda e: -e[0])
    buckets: list[ReduceBucket] = []
    orders: list[int] = []
    numel = column = 0
    for order, full, shard in entries:
        if orders and numel + full > setup.reduce_bucket_size:
            buckets.append(ReduceBucket(column, tuple(orders)))
            orders, numel, column = [], 0, 0
        orders.append(order)
        numel += full
        column += shard
    if orders:
        buckets.append(ReduceBucket(column, tuple(orders)))
    return buckets


def packs_buckets(setup: Setup) -> bool:
    """Whether backward packs gradients into bucket buffers (world 1 adds them straight into the
    partition; stage 0 with fp32 communication all-reduces the fp32 partition in place)."""
    comm = setup.communication_dtype or setup.dtype
    return setup.world_size > 1 and not (setup.num_shards == 1 and comm == "fp32")


def bucket_bytes(setup: Setup, bucket: ReduceBucket) -> int:
    """The packed ``(num_shards, column)`` matrix plus, when reduce-scattered, the output row."""
    comm = setup.communication_dtype or setup.dtype
    scatter = setup.num_shards > 1 and setup.reduce_scatter
    return (setup.num_shards * bucket.column + (bucket.column if scatter else 0)) * DTYPE_BYTES[comm]


def _reduce_bytes(info: ModelInfo, setup: Setup) -> int:
    if not packs_buckets(setup):
        return 0
    per_bucket = [bucket_bytes(setup, b) for b in reduce_buckets(info, setup)]
    window = _IN_FLIGHT + 1
    return max(sum(per_bucket[i : i + window]) for i in range(len(per_bucket)))


def _write_back_bytes(info: ModelInfo, setup: Setup) -> int:
    if setup.streamed_step and setup.world_size == 1 and setup.stage < 3 and setup.offload_optimizer == "none":
        return 0  # StreamedStep.write_back: a foreach copy from the master into the parameters
    d = setup.dtype_bytes
    shards = setup.num_shards
    persistent = setup.stage3_param_persistence_threshold
    sizes: list[tuple[int, int]] = []  # (cast slice bytes, gathered matrix bytes) per bucket
    largest_param = 0
    for group in zero_groups(info, setup):
        if group.aliases_params:
            continue  # the parameters are views of the master: nothing to write back
        layout = group.layout
        if setup.stage == 3:
            # Only the persistent parameters' shards, packed (ShardedOptimizer._write_back_persistent):
            # the concatenation (on the master's device), its cast, the gathered matrix.
            specs = [s for s in layout.specs if s.numel <= persistent]
            if specs:
                packed = sum(s.shard_numel for s in specs)
                mine = (0 if group.offloaded else 4 * packed) + (packed * d if setup.dtype != "fp32" or group.offloaded else 0)
                sizes.append((mine, shards * packed * d if shards > 1 else 0))
                largest_param = max([largest_param] + [shards * s.shard_numel * d for s in specs if shards > 1])
            continue
        for bucket in layout.buckets(setup.allgather_bucket_size):
            specs = layout.specs[bucket.first : bucket.last]
            # .to(model dtype) copies unless fp32; a host master is always uploaded into a new tensor.
            mine = bucket.shard_numel * d if setup.dtype != "fp32" or group.offloaded else 0
            gathered = shards * bucket.shard_numel * d if shards > 1 else 0
            sizes.append((mine, gathered))
            largest_param = max([largest_param] + [shards * s.shard_numel * d for s in specs if shards > 1])
    peak = previous = 0
    for mine, gathered in sizes:
        peak = max(peak, previous + mine + gathered)
        previous = gathered
    # unpack_from_columns reshapes a strided slice: one parameter-sized copy.
    return peak + largest_param if sizes else 0


def _stage3_live_bytes(info: ModelInfo, setup: Setup) -> tuple[int, str]:
    """Elements held whole at the worst point of the forward, walking the units in order with
    the gatherer's rules (prefetch window, max live elements, reuse distance), plus the
    all-gather output buffer of the largest unit, as bytes."""
    d = setup.dtype_bytes
    threshold = setup.stage3_param_persistence_threshold
    whole = [0] * info.num_units
    padded = [0] * info.num_units
    for group in zero_groups(info, setup):
        for param, spec in zip(group.params, group.layout.specs):
            if param.numel > threshold:
                whole[param.unit] += param.numel
                padded[param.unit] += setup.num_shards * spec.shard_numel
    from partita.estimate.model_states import sharded_frozen

    for frozen in sharded_frozen(info, setup):  # gathered with their unit (partita/zero/frozen_params.py)
        whole[frozen.unit] += frozen.numel
        padded[frozen.unit] += setup.num_shards * -(-frozen.numel // setup.num_shards)
    if not info.exact_layout:
        assumed = min(whole[0], 2 * setup.stage3_prefetch_bucket_size, setup.stage3_max_live_parameters)
        return assumed * d, "no model shape: assumed 2 x stage3_prefetch_bucket_size elements whole"
    units = whole[1:]  # forward order (find_units: ModuleList children in registration order)
    max_live = setup.stage3_max_live_parameters
    prefetch = setup.stage3_prefetch_bucket_size if setup.world_size > 1 or setup.offload_param != "none" else 0
    live = peak = whole[0]  # the root stays whole through forward and backward
    is_live = [False] * len(units)
    for i, numel in enumerate(units):
        if not is_live[i]:
            live += numel
            is_live[i] = True
        ahead = 0
        for j in range(i + 1, len(units)):  # param_gatherer._prefetch
            if ahead >= prefetch:
                break
            need = 0 if is_live[j] else units[j]
            if live + need > max_live:
                break
            live += need
            ahead += need
            is_live[j] = True
        peak = max(peak, live)
        # param_gatherer._end_unit: kept whole when its backward (after the later units) comes soon.
        distance = sum(units[i + 1 :])
        local = setup.world_size == 1 and setup.offload_param == "none"  # a re-gather is a local cast
        if local or not (distance < setup.stage3_max_reuse_distance and live + distance <= max_live):
            live -= numel
            is_live[i] = False
    gather_buffer = max(padded)
    if setup.offload_param != "none":
        gather_buffer += max(padded) // setup.num_shards  # the staging copy all-gathered from
    return (peak + gather_buffer) * d, "root + kept and running units + prefetch, one all-gather buffer"


def buffer_lines(info: ModelInfo, setup: Setup) -> list[Line]:
    comm = setup.communication_dtype or setup.dtype
    lines = []
    reduce = _reduce_bytes(info, setup)
    if reduce:
        lines.append(Line("buffers", f"gradient reduce buckets ({comm}, up to {_IN_FLIGHT + 1} alive)", "accelerator",
                          reduce, frozenset({BACKWARD, END_BACKWARD}), exact=False, kind="reduce_buckets"))
    write_back = _write_back_bytes(info, setup)
    if write_back:
        lines.append(Line("buffers", "weight all-gather after the step", "accelerator", write_back,
                          frozenset({WRITE_BACK}), exact=False))
    if setup.stage == 3:
        live, note = _stage3_live_bytes(info, setup)
        lines.append(Line("buffers", "ZeRO-3 parameters gathered whole", "accelerator", live,
                          frozenset({START_BACKWARD, BACKWARD}), note=note, exact=False, kind="gathered"))
    return lines
