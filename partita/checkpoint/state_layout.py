"""How the optimizer state of a master partition is cut per parameter for a checkpoint.

Each tensor of ``optimizer.state[master]`` is one of:

- **per element**: one value per partition element (Adam's ``exp_avg``; the 8-bit optimizers'
  ``state1``/``state2`` uint8 codes). Saved per parameter over the element range the rank
  owns, like the master weights.
- **per block**: one value per block of ``block_size`` partition elements (the 8-bit
  optimizers' ``absmax1``/``absmax2`` scales). Saved per parameter over the blocks of that
  range.
- **replicated**: the same on every rank (``step``, the 8-bit code tables ``qmap1``/``qmap2``):
  saved once, by rank 0, with the group's scalars.
- **local**: anything else (an optimizer partita does not know). Saved as this rank's whole
  tensor; it loads only onto the same layout.

[Note: block-wise state maps 1:1 across layouts]
bitsandbytes quantises per block of ``B`` consecutive partition elements. The ZeRO layout
for 8-bit optimizers has ``alignment = B`` (``partita.optim.factory.required_alignment``):
a parameter's shard holds ``s = ceil(numel / (W * B)) * B`` elements, rank ``r`` owns
parameter elements ``[r*s, (r+1)*s)``, and every shard starts at a partition offset that is
a sum of such ``s``, a multiple of ``B``. So for every world size ``W`` and stage, partition
block ``k`` of a shard is exactly parameter block ``(r*s)/B + k - offset/B``: the blocks of
a parameter always start at its element 0, never mix two parameters, and the same real
elements share a block in every layout. The codes and scales of a block therefore move as
they are, with no dequantise/requantise step and no rounding: a resumed run is
bit-identical to one that never stopped.

Padding: only a parameter's last block can hold both real elements and padding (elements
``[numel, ceil(numel/B)*B)``), and it lies whole in the shard of the rank that owns the last
real element, in every layout. That padding is not inert: bitsandbytes quantises a zero
moment to a small nonzero code, so the padding's moments and master weights drift, and the
moments take part in the block's ``absmax``. So the per-element state of a block-wise group is
saved over *block-rounded* ranges (the last shard of a parameter up to ``ceil(numel/B)*B``),
and the master weights of that padding are saved too (``format.master_padding_key``). Blocks
made only of padding hold zeros (scale 0) in any layout and are not saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.optim.eight_bit import BLOCK_SIZE, CONSTANT_KEYS, PER_BLOCK_KEYS, PER_ELEMENT_KEYS, is_block_wise


@dataclass(frozen=True)
class StateLayout:
    """The keys of one group's optimizer state, by how they are cut (see the module docstring)."""

    element: tuple[str, ...] = ()
    block: tuple[str, ...] = ()
    replicated: dict[str, Any] = field(default_factory=dict)
    local: tuple[str, ...] = ()
    block_size: int | None = None  # set for block-wise (8-bit) state
    dtypes: dict[str, str] = field(default_factory=dict)  # of the element and block keys


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def classify_state(state: dict[str, Any], master: torch.Tensor) -> StateLayout:
    """Sort ``state`` (the optimizer state of the flat partition ``master``) into kinds.

    Block-wise state is recognised by its keys, not its shapes: a 256-element partition has
    the shape of the code tables. A tensor that fits no kind makes the whole group local,
    since partita cannot know which of its elements belong to which parameter.
    """
    block_wise = is_block_wise(state)
    blocks = math.ceil(master.numel() / BLOCK_SIZE)
    element, block, replicated, local = [], [], {}, []
    for key, value in state.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            replicated[key] = value
        elif block_wise and key in CONSTANT_KEYS:
            replicated[key] = value
        elif block_wise and key in PER_ELEMENT_KEYS and value.shape == master.shape:
            element.append(key)
        elif block_wise and key in PER_BLOCK_KEYS and tuple(value.shape) == (blocks,):
            block.append(key)
        elif not block_wise and value.shape == master.shape:
            element.append(key)
        else:
            local.append(key)
    if local:
        return StateLayout(replicated=replicated, local=tuple(element + block + local))
    return StateLayout(
        element=tuple(element),
        block=tuple(block),
        replicated=replicated,
        block_size=BLOCK_SIZE if block_wise else None,
        dtypes={k: _dtype_name(state[k]) for k in element + block},
    )


def element_stop(end: int, block_size: int | None) -> int:
    """Where the saved per-element state of a shard ending at element ``end`` stops: ``end``,
    or for block-wise state the end of the block holding element ``end - 1``."""
    if block_size is None:
        return end
    return math.ceil(end / block_size) * block_size


def block_range(start: int, stop: int, block_size: int) -> tuple[int, int]:
    """Blocks ``[first, last)`` covering elements ``[start, stop)``; ``start`` must be block-aligned."""
    if start % block_size:
        raise ValueError(f"element {start} is not at a block boundary (blocks of {block_size})")
    return start // block_size, math.ceil(stop / block_size)


def element_shards(shards: list[dict[str, Any]], block_size: int | None) -> list[dict[str, Any]]:
    """A parameter's saved shards ``{file, start, end}`` as the element ranges its
    per-element state was saved over (block-rounded for block-wise state)."""
    return [{**s, "end": element_stop(s["end"], block_size)} for s in shards]


def block_shards(shards: list[dict[str, Any]], block_size: int) -> list[dict[str, Any]]:
    """A parameter's saved shards as the block ranges its per-block state was saved over."""
    out = []
    for s in shards:
        first, last = block_range(s["start"], s["end"], block_size)
        out.append({**s, "start": first, "end": last})
    return out

