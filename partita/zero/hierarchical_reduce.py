"""ZeRO++ qgZ across nodes: the quantized gradient reduce-scatter in two hops (inside each node, then between nodes).

[Note: why two hops]
A one-hop quantized all-to-all (quantized_comm.start_quantized_reduce_scatter) cannot combine
anything inside a node: each of a node's R ranks sends its own int4 copy of every other node's
rows off the node, R times what one node-combined copy would be (at 8 ranks per node, int4 then
sends 2x the off-node bytes of the bf16 reduce-scatter it replaces). DeepSpeed's qgZ
(arXiv 2306.10209, sec. 3.3) reduces inside the node first. Here, for N nodes of R ranks
(rank = node * R + local, torchrun's contiguous numbering):

- hop 1, inside the node (R ranks): rank (a, i) sends to local rank j of its node the quantized
  rows of every rank with local index j, one per node, ordered by node. Local rank j dequantizes
  the R contributions and sums them in fp32 (local-rank order): node a's partial sums for the N
  ranks (b, j).
- hop 2, between nodes (the N ranks with local index j): the partial rows, re-quantized, go one
  to each node's rank j; the owner dequantizes the N partials and sums them in fp32 (node order).

Rank b * R + j ends with row b * R + j of the packed bucket, the row the one-hop path gives it,
so the partition layout, the optimizer, checkpoints and resharding are those of one hop. Off the
node go only hop 2's rows: N per rank instead of N * R, 1/R of one hop's bytes (the rows, scales
included, have the same size). The price is a second rounding: each node's partial sum is
rounded once more, to 1/(2 qmax) of its block's largest partial (the bound is derived in
tests/test_zeropp_two_hop.py). Both hops and both sums run in one fixed order, so a run (and a
resumed one) is reproducible bit for bit.

[Note: the groups]
Every node group and every cross-node group is made with ``dist.new_group`` once, when the
reducer is built, by every rank in the same order (new_group is collective over the world).
Two hops are used only when the reduce runs over the whole world in rank order (plain data
parallelism; a sub-group such as tensor parallelism's ZeRO group or an expert-data group keeps
one hop), there are at least two nodes, every rank read the same ranks per node and the world is
a whole number of such nodes; otherwise one hop, which is also what a single node or one rank
per node needs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita.distributed import collectives
from partita.zero.quantized_comm import decode_rows, encode_rows

logger = logging.getLogger(__name__)


def ranks_per_node(world: int) -> int:
    """Ranks per node from torchrun's ``LOCAL_WORLD_SIZE`` (or ``LOCAL_SIZE``), at most ``world``;
    ``world`` (one host) when neither is set, which is what a launch without a multi-node launcher is."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world)
    return world


def uses_two_hop(world: int, per_node: int) -> bool:
    """Whether qgZ over ``world`` ranks, ``per_node`` to a node, goes in two hops (see [Note: the groups])."""
    return 1 < per_node < world and world % per_node == 0


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's two process groups for two-hop qgZ, and where it sits."""

    nodes: int
    per_node: int
    intra: dist.ProcessGroup  # this node's ranks (group rank = local index)
    inter: dist.ProcessGroup  # the ranks with this rank's local index, one per node (group rank = node)


def build_node_groups(process_group: dist.ProcessGroup | None, world_size: int) -> NodeGroups | None:
    """The node and cross-node groups of this job, or None where qgZ keeps one hop. Collective:
    every rank must call it at the same point (the reducer's construction)."""
    if world_size < 2 or not dist.is_initialized() or world_size != dist.get_world_size():
        return None
    per_node = ranks_per_node(world_size)
    # Nodes of different sizes read different LOCAL_WORLD_SIZEs: every rank must take the same
    # branch below (new_group is collective), so the ranks compare what they read first.
    seen: list[int | None] = [None] * world_size
    dist.all_gather_object(seen, per_node)
    if len(set(seen)) > 1 or not uses_two_hop(world_size, per_node):
        if per_node < world_size:
            logger.info("zero_quantized_gradients: %d ranks are not a whole number of equal nodes "
                        "(LOCAL_WORLD_SIZE per rank: %s); the gradient all-to-all keeps one hop",
                        world_size, sorted(set(seen)))
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_process_group_ranks(group) != list(range(world_size)):
        return None  # the same answer on every rank: they all reduce over a sub-group, or none does
    nodes, rank = world_size // per_node, dist.get_rank()
    intra = inter = None
    for a in range(nodes):  # every rank creates every group, in this order
        made = dist.new_group([a * per_node + i for i in range(per_node)])
        intra = made if a == rank // per_node else intra
    for j in range(per_node):
        made = dist.new_group([a * per_node + j for a in range(nodes)])
        inter = made if j == rank % per_node else inter
    return NodeGroups(nodes, per_node, intra, inter)


@dataclass(slots=True)
class TwoHopReduceScatter:
    """A two-hop quantized reduce-scatter in flight: hop 1 launched, hop 2 launched by :meth:`advance`."""

    groups: NodeGroups
    numel: int
    bits: int
    purpose: str
    hop1: dist.Work | None
    hop1_received: torch.Tensor  # (per_node, nodes, row_bytes): local rank i's rows for (node b, my local)
    hop2: dist.Work | None = None
    hop2_received: torch.Tensor | None = None  # (nodes, row_bytes): node a's partial sum of my row

    def advance(self) -> None:
        """Wait for hop 1, sum this node's contributions in fp32 and launch hop 2 (once)."""
        if self.hop2_received is not None:
            return
        collectives.wait(self.hop1, purpose=self.purpose)
        self.hop1 = None
        received = self.hop1_received
        partial = decode_rows(received[0], self.numel, self.bits, torch.float32)
        for i in range(1, received.shape[0]):
            partial += decode_rows(received[i], self.numel, self.bits, torch.float32)
        self.hop1_received = None  # hop 1's buffers go back before hop 2's
        send = encode_rows(partial, self.bits)  # the second rounding (see [Note: why two hops])
        del partial
        self.hop2_received = torch.empty_like(send)
        self.hop2 = collectives.all_to_all_single(
            self.hop2_received.view(-1), send.view(-1), group=self.groups.inter,
            purpose=f"int{self.bits} inter-node {self.purpose}", async_op=True)

    def reduce(self) -> torch.Tensor:
        """This rank's row summed over every rank, in fp32 (node partials in node order)."""
        self.advance()
        collectives.wait(self.hop2, purpose=self.purpose)
        received, self.hop2, self.hop2_received = self.hop2_received, None, None
        total = decode_rows(received[:1], self.numel, self.bits, torch.float32)[0]
        for a in range(1, received.shape[0]):
            total += decode_rows(received[a : a + 1], self.numel, self.bits, torch.float32)[0]
        return total


def start_two_hop_reduce_scatter(
    packed: torch.Tensor, *, bits: int, groups: NodeGroups, purpose: str
) -> tuple[dist.Work | None, TwoHopReduceScatter]:
    """Reduce-scatter ``packed`` (world, n) (row r goes to rank r) in two quantized hops; launches
    hop 1 now. Hop 2 starts at :meth:`TwoHopReduceScatter.advance` (called by ``reduce`` at the latest)."""
    nodes, per_node = groups.nodes, groups.per_node
    wire = encode_rows(packed, bits)
    # Row b * per_node + j goes to local rank j: chunk j of the send buffer is the rows (b, j), b in node order.
    send = wire.view(nodes, per_node, -1).transpose(0, 1).contiguous()
    del wire
    received = torch.empty_like(send)
    work = collectives.all_to_all_single(received.view(-1), send.view(-1), group=groups.intra,
                                         purpose=f"int{bits} intra-node {purpose}", async_op=True)
    return work, TwoHopReduceScatter(groups, packed.shape[1], bits, purpose, work, received)
