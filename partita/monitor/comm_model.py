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
    count: int = 1
    quantized: int = 0  # elements quantized (per call)
    dequantized: int = 0  # elements dequantized (per call)
    sign_coded: int = 0  # elements 1-bit compressed or decoded (per call)
    within_node: bool = False  # its group is one node's ranks: nothing leaves the node (two-hop qgZ's hop 1)


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


def step_inter_node_bytes(collectives: list[Collective], *, world: int, ranks_per_node: int) -> float:
    """Bytes one node sends off the node per step."""
    _nodes(world, ranks_per_node)  # the same check with or without a collective that leaves the node
    return sum(c.count * inter_node_bytes(c.op, c.message_bytes, world=world, ranks_per_node=ranks_per_node)
               for c in collectives if not c.within_node)


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
                      gathers: int = 2, dtype_bytes: int = 2, ranks_per_node: int | None = None) -> list[Collective]:
    """One ZeRO-3 step's parameter all-gathers and gradient reduction for ``numel`` elements in one
    flat unit (padded to a multiple of ``world``, as partita shards it). ``gathers``: all-gathers
    per step (2: forward and backward re-gather; 1 when the unit stays gathered through backward).
    ``weight_bits=8``: qwZ; ``grad_bits`` 4 or 8: qgZ. The wire rows are quantized_comm's own.
    ``ranks_per_node``: qgZ's all-to-all goes in two hops where partita's does (several nodes of
    several ranks: hierarchical_reduce.uses_two_hop); None models the one-hop all-to-all."""
    shard = math.ceil(numel / world)
    if weight_bits is None:
        gather = Collective("all_gather_into_tensor", "ZeRO-3 parameter all-gather", world * shard * dtype_bytes, gathers)
    else:
        row = RowFormat(shard, weight_bits).row_bytes
        gather = Collective("all_gather_into_tensor", f"int{weight_bits} ZeRO-3 parameter all-gather", world * row,
                            gathers, quantized=shard, dequantized=world * shard)
    if grad_bits is None:
        reduce = Collective("reduce_scatter_tensor", "gradient reduction", world * shard * dtype_bytes)
    elif ranks_per_node is not None and uses_two_hop(world, ranks_per_node):
        # Hop 1 sends and receives one row per rank inside the node; hop 2 one row per node
        # (each node's fp32 partial, re-quantized), among the ranks of one local index.
        row, nodes = RowFormat(shard, grad_bits).row_bytes, world // ranks_per_node
        return [gather,
                Collective("all_to_all_single", f"int{grad_bits} intra-node gradient reduction", world * row,
                           quantized=world * shard, dequantized=world * shard, within_node=True),
                Collective("all_to_all_single", f"int{grad_bits} inter-node gradient reduction", nodes * row,
                           quantized=nodes * shard, dequantized=nodes * shard)]
    else:
        row = RowFormat(shard, grad_bits).row_bytes
        reduce = Collective("all_to_all_single", f"int{grad_bits} gradient reduction", world * row,
                            quantized=world * shard, dequantized=world * shard)
    return [gather, reduce]


def data_parallel_collectives(numel: int, world: int, *, stage: int, onebit: bool = False,
                              dtype_bytes: int = 2) -> list[Collective]:
    """One step at ZeRO stage 0, 1 or 2 with AdamW, or with OneBitAdam in its compressed phase:
    stage 0 all-reduces the gradients (or exchanges 1-bit momentum); stages 1-2 reduce-scatter
    them (or exchange) and all-gather the updated 16-bit parameters."""
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2 here (OneBitAdam's stages), got {stage!r}")
    chunk = math.ceil(numel / world)
    if onebit:
        message = world * packed_row_bytes(chunk)
        out = [Collective("all_to_all_single", "1-bit momentum all-to-all", message, sign_coded=2 * world * chunk),
               Collective("all_gather_into_tensor", "1-bit momentum all-gather", message, sign_coded=chunk + world * chunk)]
    elif stage == 0:
        out = [Collective("all_reduce", "gradient all-reduce", world * chunk * dtype_bytes)]
    else:
        out = [Collective("reduce_scatter_tensor", "gradient reduction", world * chunk * dtype_bytes)]
    if stage > 0:
        out.append(Collective("all_gather_into_tensor", "parameter all-gather", world * chunk * dtype_bytes))
    return out


# ---------------------------------------------------------------------- would it pay?
def compression_verdict(plain: list[Collective], compressed: list[Collective], *, world: int, ranks_per_node: int,
                        gbps: float, memory_gbytes_per_s: float) -> str | None:
    """Why ``compressed`` would not pay against ``plain`` at ``gbps``, or None when it would: one
    node (no slow link: DeepSpeed #4886), or the transfer time saved below the coding time added."""
    nodes = _nodes(world, ranks_per_node)
    if nodes == 1:
        return (f"all {world} ranks are on one node, so no bytes cross a slow link and compression only adds "
                f"quantize work (DeepSpeed #4886 measured no speedup on one node); turn it off, or run across nodes")
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
