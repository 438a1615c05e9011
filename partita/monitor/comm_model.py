"""What compressed communication is worth on a network you do not have: a step-time model.

Pure functions, no process group. From a measured compute time per step and the bytes each
collective moves per step (counted by the comms logger, or computed here analytically from a
parameter count), the modelled step time at a given bandwidth between nodes, with no overlap
(compute + communication) and with full overlap (the larger of the two): the two bounds a real
job lies between.

[Note: inter-node bytes]
Only the links between nodes are modelled: inside a node (NVLink) the bytes are assumed free,
which is the regime ZeRO++ and 1-bit Adam are built for. A job of ``world`` ranks with
``ranks_per_node`` ranks per node has ``nodes = world / ranks_per_node`` nodes. ``gbps`` is one
node's bandwidth to the network, in one direction. Per collective, the bytes one node sends off
the node, from the message size the comms logger records (nccl-tests sizes: the whole gathered
output, the whole reduce-scatter input, one rank's whole all-to-all input):

- all-gather, reduce-scatter: ``message * (nodes-1)/nodes``, the bus factor over nodes: the
  node's ranks combine inside the node, so each byte of the result crosses once (a ring ordered
  by node does the same);
- all-reduce: ``message * 2(nodes-1)/nodes``; broadcast: ``message``;
- all-to-all: ``ranks_per_node * message * (nodes-1)/nodes``: every byte is meant for one rank,
  nothing can be combined on the way, so each of the node's ranks sends its own off-node share.

The last line is why a single-hop quantized all-to-all (1-bit Adam's exchange, qgZ on one rank
per node or over a sub-group) saves less between nodes than its message size says: int4
gradients are 1/4 of bf16's message, but at 8 ranks per node the node sends 8 shares of them,
2x a bf16 reduce-scatter's bytes. qgZ across nodes therefore goes in two hops
(partita/zero/hierarchical_reduce.py), as DeepSpeed's does: an all-to-all inside each node
(``within_node``: no byte leaves the node) and one among the ranks of equal local index, one per
node, whose message is one row per node. Its off-node bytes follow from the line above with
that smaller message: 1/ranks_per_node of the one-hop all-to-all's.

[Note: quantize cost]
Quantizing and dequantizing are memory-bound passes in plain torch ops. The cost is modelled as
bytes touched per element / the device's memory bandwidth: ``QUANTIZE_BYTES`` and
``DEQUANTIZE_BYTES`` are the reads and writes of the ops in partita/zero/quantized_comm.py
(fp32 temporaries included), rounded up. That cost is added to compute: it cannot overlap the
transfer it feeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partita.monitor.comms_logger import bus_factor
from partita.optim.onebit_comm import packed_row_bytes
from partita.zero.hierarchical_reduce import uses_two_hop
from partita.zero.quantized_comm import RowFormat

BANDWIDTHS_GBPS = (100, 200, 400, 800)
# Bytes read + written per element (see [Note: quantize cost]): quantize_blocks + encode_rows
# (pad to fp32, abs, amax, divide, round, clamp, nan_to_num, to int8, copy to the wire) and
# dequantize_blocks + decode_rows (to fp32, multiply, to the model dtype, copy out).
QUANTIZE_BYTES = 60
DEQUANTIZE_BYTES = 25
SIGN_BYTES = 40  # 1-bit: norm, sign compare, bit packing, unpack and scale (partita/optim/onebit_comm.py)


@dataclass(frozen=True, slots=True)
class Collective:
    """One kind of collective in a step: ``count`` calls of ``message_bytes`` each (nccl-tests
    sizes, as the comms logger records them), and the elements it quantizes and dequantizes."""

    op: str
    purpose: str
    message_bytes: int
    count: float = 1  # calls per step; a fraction in a plan averaged over a schedule (0/1 Adam's)
    quantized: int = 0  # elements quantized (per call)
    dequantized: int = 0  # elements dequantized (per call)
    sign_coded: int = 0  # elements 1-bit compressed or decoded (per call)
    within_node: bool = False  # its group is one node's ranks: nothing leaves the node (two-hop qgZ's hop 1)
    group_ranks: int | None = None  # its group's size, consecutive ranks (hpZ's group), None: the whole world


def _nodes(world: int, ranks_per_node: int) -> int:
    if world < 1 or ranks_per_node < 1:
        raise ValueError(f"world ({world}) and ranks_per_node ({ranks_per_node}) must be >= 1")
    if world % ranks_per_node and world > ranks_per_node:
        raise ValueError(f"world {world} is not a whole number of nodes of {ranks_per_node} ranks; "
                         f"pass the ranks per node that divides it")
    return max(1, world // ranks_per_node)


def inter_node_bytes(op: str, message_bytes: float, *, world: int, ranks_per_node: int) -> float:
    """Bytes one node sends to other nodes for one collective (see [Note: inter-node bytes])."""
    nodes = _nodes(world, ranks_per_node)
    across = bus_factor(op, nodes)  # 0 on one node
    if op == "all_to_all_single":
        return min(ranks_per_node, world) * message_bytes * across
    return message_bytes * across


def _off_node_bytes(c: Collective, *, world: int, ranks_per_node: int) -> float:
    """One call's bytes off each node. A group of consecutive ranks (hpZ's) spans
    ``group_ranks / ranks_per_node`` nodes and is modelled as a world of that size."""
    if c.within_node:
        return 0.0
    if c.group_ranks is None or c.group_ranks == world:
        return inter_node_bytes(c.op, c.message_bytes, world=world, ranks_per_node=ranks_per_node)
    if ranks_per_node % c.group_ranks == 0:
        return 0.0  # the group lies inside one node
    if c.group_ranks % ranks_per_node:
        raise ValueError(f"a group of {c.group_ranks} consecutive ranks ({c.purpose}) straddles nodes of "
                         f"{ranks_per_node} ranks unevenly; use a group size that divides or is a multiple "
                         f"of the ranks per node")
    return inter_node_bytes(c.op, c.message_bytes, world=c.group_ranks, ranks_per_node=ranks_per_node)


def step_inter_node_bytes(collectives: list[Collective], *, world: int, ranks_per_node: int) -> float:
    """Bytes one node sends off the node per step."""
    _nodes(world, ranks_per_node)  # the same check with or without a collective that leaves the node
    return sum(c.count * _off_node_bytes(c, world=world, ranks_per_node=ranks_per_node) for c in collectives)


def transfer_seconds(collectives: list[Collective], *, world: int, ranks_per_node: int, gbps: float) -> float:
    """Seconds per step on the inter-node links at ``gbps`` (one node's bandwidth, one direction)."""
    if not gbps > 0:
        raise ValueError(f"bandwidth must be > 0 Gbps, got {gbps!r}")
    return step_inter_node_bytes(collectives, world=world, ranks_per_node=ranks_per_node) * 8 / (gbps * 1e9)


def coding_seconds(collectives: list[Collective], *, memory_gbytes_per_s: float) -> float:
    """Seconds per step spent quantizing / dequantizing / sign-coding (see [Note: quantize cost])."""
    if not memory_gbytes_per_s > 0:
        raise ValueError(f"memory bandwidth must be > 0 GB/s, got {memory_gbytes_per_s!r}")
    touched = sum(c.count * (c.quantized * QUANTIZE_BYTES + c.dequantized * DEQUANTIZE_BYTES
                             + c.sign_coded * SIGN_BYTES) for c in collectives)
    return touched / (memory_gbytes_per_s * 1e9)


@dataclass(frozen=True, slots=True)
class StepTime:
    gbps: float
    transfer_s: float
    no_overlap_s: float  # compute + coding + transfer
    full_overlap_s: float  # max(compute + coding, transfer)


def step_time(compute_s: float, collectives: list[Collective], *, world: int, ranks_per_node: int, gbps: float,
              memory_gbytes_per_s: float) -> StepTime:
    """The modelled step at one bandwidth: both bounds (no overlap, full overlap)."""
    if compute_s < 0:
        raise ValueError(f"compute time must be >= 0 s, got {compute_s!r}")
    busy = compute_s + coding_seconds(collectives, memory_gbytes_per_s=memory_gbytes_per_s)
    transfer = transfer_seconds(collectives, world=world, ranks_per_node=ranks_per_node, gbps=gbps)
    return StepTime(gbps, transfer, busy + transfer, max(busy, transfer))


def sweep(compute_s: float, collectives: list[Collective], *, world: int, ranks_per_node: int,
          memory_gbytes_per_s: float, bandwidths: tuple[float, ...] = BANDWIDTHS_GBPS) -> list[StepTime]:
    """:func:`step_time` at each bandwidth (100, 200, 400 and 800 Gbps by default)."""
    return [step_time(compute_s, collectives, world=world, ranks_per_node=ranks_per_node, gbps=g,
                      memory_gbytes_per_s=memory_gbytes_per_s) for g in bandwidths]


# ---------------------------------------------------------------------- analytic bytes per step
def zero3_collectives(numel: int, world: int, *, weight_bits: int | None = None, grad_bits: int | None = None,
                      gathers: int = 2, dtype_bytes: int = 2, ranks_per_node: int | None = None,
                      hpz_partition_size: int = 1) -> list[Collective]:
    """One ZeRO-3 step's parameter all-gathers and gradient reduction for ``numel`` elements in one
    flat unit (padded to a multiple of ``world``, as partita shards it). ``gathers``: all-gathers
    per step (2: forward and backward re-gather; 1 when the unit stays gathered through backward).
    ``weight_bits=8``: qwZ; ``grad_bits`` 4 or 8: qgZ. The wire rows are quantized_comm's own.
    ``ranks_per_node``: qgZ's all-to-all goes in two hops where partita's does (several nodes of
    several ranks: hierarchical_reduce.uses_two_hop); None models the one-hop all-to-all.
    ``hpz_partition_size`` G > 1: hpZ (partita/zero/hpz.py); the forward gathers over the world, the
    backward's re-gather (``gathers - 1`` of them) over G consecutive ranks from the secondary copies,
    16-bit even with qwZ, with the same message as the world gather (the whole unit)."""
    shard = math.ceil(numel / world)
    if hpz_partition_size < 1 or world % hpz_partition_size:
        raise ValueError(f"hpz_partition_size {hpz_partition_size} does not divide the world size {world}; "
                         f"pass a divisor of it (the ranks per node)")
    hpz = hpz_partition_size > 1
    world_gathers = min(gathers, 1) if hpz else gathers
    if weight_bits is None:
        gather = Collective("all_gather_into_tensor", "ZeRO-3 parameter all-gather", world * shard * dtype_bytes,
                            world_gathers)
    else:
        row = RowFormat(shard, weight_bits).row_bytes
        gather = Collective("all_gather_into_tensor", f"int{weight_bits} ZeRO-3 parameter all-gather", world * row,
                            world_gathers, quantized=shard, dequantized=world * shard)
    gathers_out = [gather]
    if hpz and gathers > 1:
        gathers_out.append(Collective("all_gather_into_tensor", "ZeRO-3 parameter all-gather within the hpZ group",
                                      world * shard * dtype_bytes, gathers - 1, group_ranks=hpz_partition_size))
    if grad_bits is None:
        reduce = Collective("reduce_scatter_tensor", "gradient reduction", world * shard * dtype_bytes)
    elif ranks_per_node is not None and uses_two_hop(world, ranks_per_node):
        # Hop 1 sends and receives one row per rank inside the node; hop 2 one row per node
        # (each node's fp32 partial, re-quantized), among the ranks of one local index.
        row, nodes = RowFormat(shard, grad_bits).row_bytes, world // ranks_per_node
        return [*gathers_out,
                Collective("all_to_all_single", f"int{grad_bits} intra-node gradient reduction", world * row,
                           quantized=world * shard, dequantized=world * shard, within_node=True),
                Collective("all_to_all_single", f"int{grad_bits} inter-node gradient reduction", nodes * row,
                           quantized=nodes * shard, dequantized=nodes * shard)]
    else:
        row = RowFormat(shard, grad_bits).row_bytes
        reduce = Collective("all_to_all_single", f"int{grad_bits} gradient reduction", world * row,
                            quantized=world * shard, dequantized=world * shard)
    return [*gathers_out, reduce]


def hpz_memory_bytes(numel: int, world: int, hpz_partition_size: int, *, dtype_bytes: int = 2) -> int:
    """Bytes per rank of hpZ's secondary copies while a forward's units are held (partita/zero/hpz.py):
    1/G of every gathered unit, in the model's dtype, on top of ZeRO-3's own shards."""
    return world * math.ceil(numel / world) * dtype_bytes // hpz_partition_size


def data_parallel_collectives(numel: int, world: int, *, stage: int, onebit: bool = False,
                              dtype_bytes: int = 2) -> list[Collective]:
    """One step at ZeRO stage 0, 1 or 2 with AdamW, or with OneBitAdam in its compressed phase:
    stage 0 all-reduces the gradients (or exchanges 1-bit momentum); stages 1-2 reduce-scatter
    them (or exchange) and all-gather the updated 16-bit parameters. ``onebit`` models the
    exchange alone; :func:`onebit_collectives` has the whole compressed step."""
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2 here (OneBitAdam's stages), got {stage!r}")
    chunk = math.ceil(numel / world)
    if onebit:
        message = world * packed_row_bytes(chunk)
        out = [Collective("all_to_all_single", "1-bit momentum all-to-all", message, sign_coded=2 * world * chunk),
               Collective("all_gather_into_tensor", "1-bit momentum all-gather", message, sign_coded=chunk + world * chunk)]
    elif stage == 0:  # the reducer all-reduces the unpadded gradients
        out = [Collective("all_reduce", "gradient reduction", numel * dtype_bytes)]
    else:
        out = [Collective("reduce_scatter_tensor", "gradient reduction", world * chunk * dtype_bytes)]
    if stage > 0:
        out.append(Collective("all_gather_into_tensor", "parameter all-gather after the optimizer step",
                              world * chunk * dtype_bytes))
    return out


# ---------------------------------------------------------------------- the 1-bit family
ONEBIT_PURPOSES = {"OneBitAdam": "1-bit Adam momentum exchange", "OneBitLamb": "1-bit LAMB momentum exchange",
                   "ZeroOneAdam": "0/1 Adam compressed exchange"}  # the optimizers' comms-logger purposes


def _onebit_exchange(chunk: int, world: int, purpose: str, *, scales: int = 1, count: float = 1) -> list[Collective]:
    """partita/optim/onebit_comm.py's exchange: an all-to-all of every rank's sign rows and an
    all-gather of the servers' rows, each ``world`` rows of ``ceil(chunk/8)`` bytes + 4 per scale."""
    message = world * ((chunk + 7) // 8 + 4 * scales)
    return [Collective("all_to_all_single", f"{purpose}: compressed all-to-all", message, count,
                       sign_coded=2 * world * chunk),
            Collective("all_gather_into_tensor", f"{purpose}: compressed all-gather", message, count,
                       sign_coded=chunk + world * chunk)]


def _local_norms(purpose: str, parameters: int, count: float = 1) -> Collective:
    # One fp32 all-reduce per compressed step: the squared local norm and a "got a gradient" flag per parameter.
    return Collective("all_reduce", f"{purpose}: local gradient norms", 4 * (1 + parameters), count)


def onebit_collectives(numel: int, world: int, *, optimizer: str = "OneBitAdam", stage: int = 0, parameters: int = 1,
                       weight_decay: bool = False, dtype_bytes: int = 2) -> list[Collective]:
    """One compressed-phase step of OneBitAdam or OneBitLamb at ZeRO stage 0, 1 or 2, for ``numel``
    elements in ``parameters`` trainable tensors (one param group): the local-norm all-reduce, the
    1-bit exchange, and at stages 1-2 the 16-bit parameter all-gather after the step. OneBitLamb
    at stages 1-2 adds its per-parameter all-reduces over the partitions: the factor maxima, the
    update norms, and with weight decay the preliminary update's norms. One-time collectives (the
    momentum rebuild and LAMB's scaling norms at the first compressed step) are left out."""
    if optimizer not in ("OneBitAdam", "OneBitLamb"):
        raise ValueError(f"optimizer must be 'OneBitAdam' or 'OneBitLamb' here, got {optimizer!r} "
                         f"(ZeroOneAdam: zero_one_adam_collectives)")
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2 (the 1-bit optimizers' stages), got {stage!r}")
    purpose, chunk = ONEBIT_PURPOSES[optimizer], math.ceil(numel / world)
    out = [_local_norms(purpose, parameters), *_onebit_exchange(chunk, world, purpose)]
    if stage > 0:
        if optimizer == "OneBitLamb":
            out.append(Collective("all_reduce", f"{purpose}: per-parameter maxs", 4 * parameters))
            out.append(Collective("all_reduce", f"{purpose}: per-parameter sums", 4 * parameters,
                                  2 if weight_decay else 1))
        out.append(Collective("all_gather_into_tensor", "parameter all-gather after the optimizer step",
                              world * chunk * dtype_bytes))
    return out


def zero_one_adam_schedule(steps: int, *, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                           local_step_clipper: int) -> list[str]:
    """The kind of each of ``steps`` 0/1 Adam updates, on DeepSpeed's schedule as
    partita/optim/zero_one_adam.py runs it: "refresh" (variance refresh: the engine's full-precision
    gradient all-reduce), "compressed" (phase 1: the 1-bit exchange of the gradients), "local"
    (phase 2: no exchange) or "sync" (phase 2: the 1-bit exchange of the change since the last sync)."""
    kinds, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for n in range(steps):
        s = n + 2  # the optimizer's own count (its steps_done() + 2; see its [Note: DeepSpeed's steps])
        if n < var_freeze_step:
            kinds.append("compressed" if s % var_interval else "refresh")
            if s % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            continue
        kinds.append("local" if s % local_interval else "sync")
        local_counter += 1
        if local_counter == local_step_scaler:
            local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    return kinds


def zero_one_adam_collectives(numel: int, world: int, *, steps: int, parameters: int = 1, dtype_bytes: int = 2,
                              var_freeze_step: int = 100000, var_update_scaler: int = 16,
                              local_step_scaler: int = 32678, local_step_clipper: int = 16,
                              first_step: int = 0) -> list[Collective]:
    """The average step of 0/1 Adam (ZeRO stage 0) over its updates ``first_step`` .. ``first_step +
    steps - 1`` on DeepSpeed's schedule (defaults: DeepSpeed's): the counts are calls per step,
    fractions of the window. Refresh steps all-reduce the 16-bit gradients; every other step
    all-reduces the local norms; phase-1 compressed steps and phase-2 syncs run the 1-bit
    exchange, with one scale per parameter and row (DeepSpeed compresses each parameter alone)."""
    if steps < 1 or first_step < 0:
        raise ValueError(f"steps must be >= 1 and first_step >= 0, got steps={steps!r}, first_step={first_step!r}")
    kinds = zero_one_adam_schedule(first_step + steps, var_freeze_step=var_freeze_step,
                                   var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
                                   local_step_clipper=local_step_clipper)[first_step:]
    purpose, chunk = ONEBIT_PURPOSES["ZeroOneAdam"], math.ceil(numel / world)
    refresh = kinds.count("refresh") / steps
    exchanged = (kinds.count("compressed") + kinds.count("sync")) / steps
    out = []
    if refresh:
        out.append(Collective("all_reduce", "gradient reduction", numel * dtype_bytes, refresh))
    if refresh < 1:
        out.append(_local_norms(purpose, parameters, 1 - refresh))
    if exchanged:
        out.extend(_onebit_exchange(chunk, world, purpose, scales=parameters, count=exchanged))
    return out


# ---------------------------------------------------------------------- would it pay?
def compression_verdict(plain: list[Collective], compressed: list[Collective], *, world: int, ranks_per_node: int,
                        gbps: float, memory_gbytes_per_s: float, adds: str = "quantize work") -> str | None:
    """Why ``compressed`` would not pay against ``plain`` at ``gbps``, or None when it would: one
    node (no slow link: DeepSpeed #4886), or the transfer time saved below the coding time added.
    ``adds``: what the compressed plan costs besides bytes, for the one-node message (hpZ: memory)."""
    nodes = _nodes(world, ranks_per_node)
    if nodes == 1:
        return (f"all {world} ranks are on one node, so no bytes cross a slow link and compression only adds "
                f"{adds} (DeepSpeed #4886 measured no speedup on one node); turn it off, or run across nodes")
    args = dict(world=world, ranks_per_node=ranks_per_node, gbps=gbps)
    saved = transfer_seconds(plain, **args) - transfer_seconds(compressed, **args)
    added = (coding_seconds(compressed, memory_gbytes_per_s=memory_gbytes_per_s)
             - coding_seconds(plain, memory_gbytes_per_s=memory_gbytes_per_s))
    if saved > added:
        return None
    if saved <= 0:  # a one-hop all-to-all sends every rank's share off the node ([Note: inter-node bytes])
        kw = dict(world=world, ranks_per_node=ranks_per_node)
        return (f"between nodes ({nodes} nodes of {ranks_per_node} ranks) it sends "
                f"{step_inter_node_bytes(compressed, **kw) / 1e9:.3g} GB off each node per step against "
                f"{step_inter_node_bytes(plain, **kw) / 1e9:.3g} GB without it (modelled, "
                f"partita/monitor/comm_model.py: an all-to-all cannot combine bytes inside the node); turn it off")
    return (f"at {gbps:g} Gbps between nodes ({nodes} nodes of {ranks_per_node} ranks) it saves "
            f"{saved * 1e3:.1f} ms of transfer per step but adds {added * 1e3:.1f} ms of quantize/dequantize work "
            f"(modelled, partita/monitor/comm_model.py); turn it off, or check the bytes with comms_logger")
