"""Parameters, gradients and optimizer states per rank, byte for byte as partita allocates them.

Nothing here is a textbook ``2 + 2 + 12 bytes per parameter`` rule; every figure follows the
code that allocates the tensors:

- groups and layout (:mod:`partita.estimate.groups`, reusing ``ShardLayout``): per optimizer
  group (two with offload ratio < 1), parameters in reverse registration order, each
  flattened and padded to a multiple of ``num_shards * alignment``; a rank's partition holds
  ``partition_numel`` elements (its shard of every parameter). ``num_shards`` is the world
  size at stages 1-3 and 1 at stage 0; ``alignment`` is 256 for 8-bit optimizers.
- fp32 master (``shard_group.py``): one fp32 tensor of ``partition_numel`` per group. With
  fp32 training and one shard (stage 0, or one rank) below stage 3 the parameters become
  views of it (no second copy); at stage 3 the gatherer keeps no low-precision shard of an
  accelerator master (gathers cast from it).
- 16-bit parameters at stages 0-2: whole, except on one process without offload
  (``zero_optimization.one_rank_free_weights``, ``partita/zero/one_rank_weights.py``), where the
  parameters inside the ZeRO-3 units (the blocks) are freed from each block's forward to its
  backward: absent at the start of backward, back block by block during it, whole from its end.
- gradients: the fp32 gradient partition (``ShardedParamGroup.grad_partition``,
  ``partition_numel`` fp32 per group) exists from the first retired reduce bucket in
  backward (world size 1: the first gradient, folded in at once) until the optimizer step.
  Full-size ``param.grad`` in the model dtype is held across micro-batches at stages 0/1; at
  world size 1 offloaded groups send each gradient to the host partition as it arrives
  (``reducer.py``). ``data_types.grad_accum_dtype: fp32`` at stages 0/1 sums
  micro-batches in a full-size fp32 tensor per parameter instead. With
  ``one_rank_gradient_fold "stream"`` (``streamed_step.py``) there is no partition: the full-size
  ``param.grad`` is held into the step, which casts one fp32 range of ``CHUNK_NUMEL`` elements at a
  time, and writes the weights back by plain copies (no cast buffer).
- optimizer states (``partita/optim``): torch Adam/AdamW keep ``exp_avg`` and ``exp_avg_sq``
  shaped like the master (8 bytes per partition element, 12 with amsgrad) and a 4-byte fp32
  ``step`` tensor per group; SGD a ``momentum_buffer`` (4 bytes) only when momentum > 0;
  Lion ``exp_avg`` (4 bytes); bitsandbytes 8-bit: uint8 codes per element (2 states for
  Adam, 1 for Lion), an fp32 scale per 256-element block per state, and 256-entry fp32 code
  tables shared by the whole optimizer.
- ZeRO-3 (``param_gatherer.py``, ``offload/param_offload.py``): each rank keeps its model-dtype
  shard (``partition_numel`` per group) on the accelerator; parameters with at most
  ``stage3_param_persistence_threshold`` elements also stay whole on every rank; the others'
  storage is freed between uses. ``offload_param`` "cpu" keeps the same shards in host memory
  instead; "nvme" keeps only the non-persistent parameters' shards, the first of them (groups
  in order, layout order) within ``max_in_cpu`` elements in host memory and every other one in
  a swap file of whole ``aio.block_size`` blocks, plus ``buffer_count`` read/write buffers of
  ``buffer_size`` elements (each over-allocated by one page) when any shard is on disk.

Frozen parameters (no optimizer group): whole in the model dtype on every rank, except at ZeRO-3
those built under ``zero.Init`` and above the persistence threshold, of which each rank keeps its
``ceil(numel / N)``-element shard (``partita/zero/frozen_params.py``); no gradient, master or state.

Offload (``zero_optimization.offload_optimizer``, ``partita/offload``): an offloaded group's
fp32 master, fp32 gradient partition and optimizer states live in host memory ("cpu"); with
"nvme" the states shaped like the master go to swap files (one per state and sub-group of
``sub_group_size`` elements, rounded up to ``aio.block_size``) and host memory holds
``buffer_count`` state buffers instead (partita keeps master and gradients in host memory).
Gradients and weights cross through ``buffer_count`` pinned staging buffers of
``STAGING_BYTES``. ``delayed_param_update`` holds a second gradient partition (the previous
step's, read by the background step). At stage 3 an offloaded group's shards stay on the
accelerator (the all-gather reads them there; they are refreshed from the host master through
the staging pool), a separate copy even in fp32; an accelerator master needs no shard copy at
all (gathers cast from it).
"""

from __future__ import annotations

import math

from partita.estimate.groups import ZeroGroup, alignment_of, zero_groups
from partita.estimate.inputs import Setup
from partita.estimate.model_info import ModelInfo
from partita.zero.streamed_step import CHUNK_NUMEL as STREAM_CHUNK_NUMEL
from partita.estimate.result import ALWAYS, BACKWARD, END_BACKWARD, START_BACKWARD, STEP, WRITE_BACK, Line
from partita.offload.buffer_pool import BUFFER_ALIGNMENT
from partita.optim.eight_bit import BLOCK_SIZE
from partita.zero.partition import ShardLayout

__all__ = [
    "fp32_sums_active",
    "frees_block_weights",
    "frozen_lines",
    "sharded_frozen",
    "holds_grads_across_micro_batches",
    "model_state_lines",
    "optimizer_state_bytes",
    "swapped_state_count",
]

_CODE_TABLE_BYTES = 256 * 4  # one bitsandbytes quantisation map: 256 fp32 entries


def swapped_state_count(setup: Setup) -> int:
    """Optimizer state tensors shaped like the master (what NVMe offload swaps)."""
    if setup.optimizer in ("Adam", "AdamW"):
        return 3 if setup.amsgrad else 2
    if setup.optimizer == "SGD":
        return 1 if setup.sgd_momentum else 0
    return 1  # Lion


def optimizer_state_bytes(setup: Setup, partition_numel: int) -> tuple[int, str]:
    """Bytes of the inner optimizer's state for one group's master partition, and what they are
    (8-bit code tables, shared by all groups, are not included: see :func:`model_state_lines`)."""
    kind = setup.optimizer
    if kind in ("Adam", "AdamW"):
        what = "exp_avg + exp_avg_sq" + (" + max_exp_avg_sq" if setup.amsgrad else "") + " fp32, step"
        return 4 * swapped_state_count(setup) * partition_numel + 4, what
    if kind == "SGD":
        if setup.sgd_momentum == 0.0:
            return 0, "none (SGD without momentum keeps no state)"
        return 4 * partition_numel, "momentum_buffer fp32"
    if kind == "Lion":
        return 4 * partition_numel, "exp_avg fp32"
    states = 1 if "Lion" in kind else 2
    blocks = math.ceil(partition_numel / BLOCK_SIZE)
    return states * (partition_numel + 4 * blocks), f"{states} x uint8 codes + fp32 block scales"


def fp32_sums_active(setup: Setup) -> bool:
    """data_types.grad_accum_dtype fp32 at stages 0/1: micro-batches summed in full-size fp32 tensors."""
    return (
        setup.grad_accum_dtype == "fp32" and setup.dtype != "fp32" and setup.stage <= 1
        and setup.gradient_accumulation_steps > 1
    )


def holds_grads_across_micro_batches(setup: Setup) -> bool:
    """Stages 0/1 reduce only at the accumulation boundary: param.grad lives through the next forward."""
    return setup.stage <= 1 and setup.gradient_accumulation_steps > 1 and not fp32_sums_active(setup)


def streams_step(setup: Setup, host_groups: list[ZeroGroup]) -> bool:
    """``one_rank_gradient_fold "stream"`` applies: one rank, nothing offloaded (streamed_step.py)."""
    return setup.streamed_step and setup.world_size == 1 and not host_groups


def frees_weights_again(setup: Setup) -> bool:
    """Each block's weights are freed again after its backward (one_rank_weights.py [Note: freed
    again after the unit's backward]): one_rank_gradient_fold "end" only."""
    return setup.fold_gradients_at_end and not setup.streamed_step


def frees_block_weights(setup: Setup, groups: list[ZeroGroup]) -> bool:
    """``zero_optimization.one_rank_free_weights`` applies (partita/zero/one_rank_weights.py): one
    process, stages 0-2, no group offloaded or aliased to its master, no delayed update."""
    return (
        setup.one_rank_free_weights and setup.world_size == 1 and setup.stage < 3 and not setup.delayed_param_update
        and not any(g.offloaded or g.aliases_params for g in groups)
    )


def _ranges(numel: int, size: int) -> list[int]:
    """Sizes of the sub-groups a master partition is stepped in (nvme_optimizer._cut)."""
    return [min(size, numel - lo) for lo in range(0, numel, size)]


def _sum(groups: list[ZeroGroup], fn) -> int:
    return sum(fn(g) for g in groups)


def _stage3_shard_lines(groups: list[ZeroGroup], setup: Setup) -> list[Line]:
    """Where stage 3 keeps each rank's parameter shards (``partita.offload.param_offload``)."""
    d = setup.dtype_bytes
    if setup.offload_param == "cpu":
        # gather_from_master: a group whose fp32 master is in host memory is gathered from it (HostShards).
        kept = [g for g in groups if not (setup.param_gather_from_master and g.offloaded)]
        return [Line("parameters", f"{setup.dtype} parameter shards (offload_param cpu)", "cpu",
                     d * sum(g.partition_numel for g in kept), note="page-locked with pin_memory on a GPU")]
    if setup.offload_param == "nvme":
        # NvmeShards: non-persistent parameters' shards, a prefix within max_in_cpu in memory.
        pieces = [spec.shard_numel for g in groups for p, spec in zip(g.params, g.layout.specs)
                  if p.numel > setup.stage3_param_persistence_threshold]
        resident = kept = 0
        for numel in pieces:
            if resident + numel > setup.param_max_in_cpu:
                break
            resident += numel
            kept += 1
        block = setup.aio_block_size
        files = [math.ceil(d * numel / block) * block for numel in pieces[kept:]]
        lines = []
        if resident:
            lines.append(Line("parameters", f"{setup.dtype} parameter shards kept in memory (max_in_cpu)", "cpu",
                              d * resident, note="page-locked with pin_memory on a GPU"))
        if files:
            lines.append(Line("parameters", f"{setup.dtype} parameter shards (swap files)", "nvme", sum(files),
                              note="one file per sharded parameter"))
            lines.append(Line("buffers", "NVMe parameter buffers (offload_param)", "cpu",
                              setup.param_buffer_count * (d * setup.param_buffer_size + BUFFER_ALIGNMENT),
                              note="buffer_count x buffer_size elements"))
        return lines
    lines = []
    # A group whose fp32 master is on the accelerator keeps no shard: gathers cast from the
    # master (DeviceShards), which is counted once, under optimizer states.
    host_master = [g for g in groups if g.offloaded]
    if host_master:
        lines.append(Line("parameters", f"{setup.dtype} parameter shards of offloaded groups", "accelerator",
                          d * sum(g.partition_numel for g in host_master), note="refreshed from the host master"))
    return lines


def sharded_frozen(info: ModelInfo, setup: Setup) -> list:
    """Frozen parameters ZeRO-3 keeps sharded (partita/zero/frozen_params.py): built under zero.Init
    (``Setup.frozen_zero_init`` overrides what the module says) and above the persistence threshold."""
    if setup.stage != 3:
        return []
    built_sharded = (lambda f: f.zero_init) if setup.frozen_zero_init is None else (lambda f: setup.frozen_zero_init)
    return [f for f in info.frozen if built_sharded(f) and f.numel > setup.stage3_param_persistence_threshold]


def frozen_lines(info: ModelInfo, setup: Setup) -> list[Line]:
    """Frozen parameters: whole in the model dtype, except at ZeRO-3 those built under zero.Init, of
    which each rank keeps its shard (``FrozenShards``: zero.Init's layout, ``ceil(numel / N)``
    elements per rank), gathered with their unit (counted in the ZeRO-3 buffers), never reduced or
    stepped: no gradient, no master, no optimizer state."""
    d = setup.dtype_bytes
    sharded = sharded_frozen(info, setup)
    names = {f.name for f in sharded}
    whole = info.frozen_numel - sum(f.numel for f in sharded) if info.frozen else info.frozen_numel
    lines = []
    if whole:
        lines.append(Line("parameters", "frozen parameters", "accelerator", d * whole))
    if sharded:
        layout = ShardLayout.build([f.shape for f in sharded], num_shards=setup.world_size)
        lines.append(Line("parameters", "frozen parameter shards (zero.Init, sharded)", "accelerator",
                          d * sum(spec.shard_numel for spec in layout.specs),
                          note=f"{len(names)} parameters, 1/{setup.world_size} each"))
    return lines


def model_state_lines(info: ModelInfo, setup: Setup) -> list[Line]:
    """Per-rank bytes of parameters, gradients and optimizer states for ``setup``."""
    groups = zero_groups(info, setup)
    device_groups = [g for g in groups if not g.offloaded]
    host_groups = [g for g in groups if g.offloaded]
    d = setup.dtype_bytes
    trainable = info.trainable_numel
    lines: list[Line] = []

    def partition(gs: list[ZeroGroup]) -> int:
        return _sum(gs, lambda g: g.partition_numel)

    # ---------------------------------------------------------------- parameters
    if setup.stage < 3:
        aliased = [g for g in groups if g.aliases_params]
        plain = [g for g in groups if not g.aliases_params]
        if aliased:
            lines.append(Line("parameters", "fp32 parameters (views of the fp32 master: one copy)", "accelerator",
                              4 * partition(aliased)))
        blocks = _sum(plain, lambda g: sum(p.numel for p in g.params if p.unit >= 1)) if frees_block_weights(
            setup, groups) else 0
        if plain and blocks:
            # partita/zero/one_rank_weights.py: the blocks' weights are freed from their forward to
            # their backward, which brings them back block by block (the walk counts them there).
            lines.append(Line("parameters", f"{setup.dtype} parameters outside the blocks",
                              "accelerator", d * (_sum(plain, lambda g: sum(p.numel for p in g.params)) - blocks)))
            # With one_rank_gradient_fold "end" or "stream" each block's are freed again after its
            # backward and come back after finish_backward ([Note: freed again after the unit's backward]).
            phases = {BACKWARD, STEP, WRITE_BACK} | (set() if frees_weights_again(setup) else {END_BACKWARD})
            lines.append(Line("parameters", f"{setup.dtype} block parameters (freed from forward to backward)",
                              "accelerator", d * blocks, frozenset(phases),
                              note="cast back from the fp32 master before each block's backward",
                              kind="block_params"))
        elif plain:
            lines.append(Line("parameters", f"{setup.dtype} parameters", "accelerator",
                              d * _sum(plain, lambda g: sum(p.numel for p in g.params))))
    else:
        lines += _stage3_shard_lines(groups, setup)
        persistent = sum(p.numel for p in info.params() if p.numel <= setup.stage3_param_persistence_threshold)
        lines.append(Line(
            "parameters", f"persistent parameters (<= {setup.stage3_param_persistence_threshold:,} elements, whole)",
            "accelerator", d * persistent,
        ))
    lines += frozen_lines(info, setup)
    if info.float_buffer_numel or info.other_buffer_bytes:
        lines.append(Line("parameters", "module buffers", "accelerator",
                          d * info.float_buffer_numel + info.other_buffer_bytes))

    # ---------------------------------------------------------------- gradients
    # From the first retired bucket on; at world size 1 from the first gradient, which is folded
    # in as it arrives (reducer.py [Note: folding on one rank]).
    partition_phases = frozenset({BACKWARD, END_BACKWARD, STEP})
    if setup.world_size == 1 and setup.fold_gradients_at_end and not host_groups and \
            not holds_grads_across_micro_batches(setup):
        partition_phases = frozenset({END_BACKWARD, STEP})  # allocated by finish_backward
    streamed = streams_step(setup, host_groups)
    if device_groups and not streamed:
        lines.append(Line("gradients", "fp32 gradient partition", "accelerator", 4 * partition(device_groups),
                          partition_phases, kind="grad_partition"))
    if streamed:
        # StreamedStep._step_group: one fp32 buffer of a range of the group's master at a time.
        widest = max(min(STREAM_CHUNK_NUMEL, g.partition_numel) for g in device_groups)
        lines.append(Line("buffers", "fp32 gradient range of the streamed step", "accelerator", 4 * widest,
                          frozenset({STEP}), note="one_rank_gradient_fold \"stream\""))
    if host_groups:
        # A (pinned) host buffer reused from step to step, not freed between them
        # (ShardedParamGroup: [Note: offloaded gradient partitions]).
        lines.append(Line("gradients", "fp32 gradient partition (offloaded)", "cpu", 4 * partition(host_groups),
                          ALWAYS, note="reused from step to step"))
        if setup.delayed_param_update:
            # The background step still reads the previous step's partition while the next
            # micro-batches fill the other buffer (ShardedOptimizer.step hands the old one over).
            lines.append(Line("gradients", "previous step's fp32 gradient partition (delayed update)", "cpu",
                              4 * partition(host_groups), ALWAYS))
            # ShardedParamGroup.fill_upload_copy: the update's host cast runs on the background thread.
            lines.append(Line("parameters", f"{setup.dtype} upload copy of the updated master (delayed update)", "cpu",
                              d * partition(host_groups), ALWAYS))
    held = holds_grads_across_micro_batches(setup)
    kept = trainable
    if setup.world_size == 1 and not held:
        # One rank: on-device groups fold each gradient as it arrives (or, one_rank_gradient_fold
        # "end", hold it until finish_backward), and offloaded ones send it to the host as it
        # arrives (GradientReducer._on_grad_ready, download_during_backward).
        kept = trainable if setup.fold_gradients_at_end and not host_groups else 0
    if (setup.world_size == 1 or held) and kept:
        phases = {BACKWARD} | ({START_BACKWARD} if held else set()) | ({END_BACKWARD} if setup.world_size == 1 else set())
        phases |= {STEP} if streamed else set()  # each freed once the step has read it
        why = ("held across micro-batches" if held else "read by the optimizer step (one rank, stream)" if streamed
               else "kept until the end of backward (one rank)")
        lines.append(Line("gradients", f"full-size {setup.dtype} gradients (param.grad)", "accelerator", d * kept,
                          frozenset(phases), note=why, kind="full_grads"))
    if fp32_sums_active(setup):
        phases = {START_BACKWARD, BACKWARD} | ({END_BACKWARD} if setup.world_size == 1 else set())
        lines.append(Line("gradients", "fp32 micro-batch gradient sums (grad_accum_dtype fp32)", "accelerator",
                          4 * trainable, frozenset(phases), kind="fp32_sums"))

    # ---------------------------------------------------------------- optimizer states
    has_master = [g for g in groups if not g.aliases_params]
    if [g for g in has_master if not g.offloaded] or not groups:
        lines.append(Line("optimizer states", "fp32 master weights", "accelerator",
                          4 * partition([g for g in has_master if not g.offloaded])))
    if [g for g in has_master if g.offloaded]:
        lines.append(Line("optimizer states", "fp32 master weights (offloaded)", "cpu",
                          4 * partition([g for g in has_master if g.offloaded])))
    _, what = optimizer_state_bytes(setup, 0)
    tables = (1 if "Lion" in setup.optimizer else 2) * _CODE_TABLE_BYTES if alignment_of(setup) > 1 else 0
    if device_groups or not host_groups:
        state = _sum(device_groups, lambda g: optimizer_state_bytes(setup, g.partition_numel)[0]) + tables
        lines.append(Line("optimizer states", f"{setup.optimizer} states: {what}", "accelerator", state))
        tables = 0  # bitsandbytes shares one set of code tables across all groups
    cpu_tier = [g for g in host_groups if g.tier == "cpu"]
    nvme_tier = [g for g in host_groups if g.tier == "nvme"]
    if cpu_tier:
        state = _sum(cpu_tier, lambda g: optimizer_state_bytes(setup, g.partition_numel)[0]) + tables
        lines.append(Line("optimizer states", f"{setup.optimizer} states (offloaded): {what}", "cpu", state))
    if nvme_tier:
        # nvme_optimizer: one swap file per state and sub-group, rounded up to aio.block_size.
        block = setup.aio_block_size
        files = [math.ceil(4 * n / block) * block for g in nvme_tier
                 for n in _ranges(g.partition_numel, setup.sub_group_size)] * swapped_state_count(setup)
        lines.append(Line("optimizer states", f"{setup.optimizer} states (swap files): {what}", "nvme", sum(files),
                          note="one file per state and sub-group"))
        widest = max(min(setup.sub_group_size, g.partition_numel) for g in nvme_tier)
        lines.append(Line("buffers", "NVMe state buffers (fp32, page-aligned, not page-locked)", "cpu",
                          setup.optimizer_buffer_count * (4 * widest + BUFFER_ALIGNMENT),
                          note="buffer_count x min(sub_group_size, partition) elements"))
    if setup.optimizer == "Lion":
        # partita's foreach Lion builds the update direction in a temporary the size of the partition.
        lines.append(Line("buffers", "Lion update temporary (fp32 partition)", "accelerator",
                          4 * partition(device_groups), frozenset({STEP}), exact=False))

    # ---------------------------------------------------------------- offload staging
    if host_groups:  # (device auto with everything on the accelerator runs as "none": no pool)
        # partita.offload.buffer_pool: buffer_count buffers, each over-allocated by one page
        # so that it can start on a 4096-byte boundary (O_DIRECT).
        lines.append(Line(
            "buffers", "pinned staging buffers (offload_optimizer)", "cpu",
            setup.optimizer_buffer_count * (setup.staging_bytes + BUFFER_ALIGNMENT),
            note=f"buffer_count x {setup.staging_bytes:,} B (STAGING_BYTES)",
        ))
    # Zero-byte lines say nothing, except that an optimizer keeps no state (SGD without momentum).
    return [line for line in lines if line.nbytes or line.category in ("parameters", "optimizer states")]
